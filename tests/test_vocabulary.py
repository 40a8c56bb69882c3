"""Each word of the domain is written in one product module; every other module imports it.

A medium, a layout, a policy or a phase spelled out a second time is a second definition that
can drift (a renamed phase the metrics never learn, a medium the manifest check still
refuses). This greps the product tree (``agent/offloadpool``, ``operator/offloadpool``,
``bench``) for each word as a quoted string, code, docstrings and comments alike, the way a
reader greps it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offloadpool.api import status
from offloadpool.api.constants import MAX_MESSAGE_LENGTH
from offloadpool.region import vocabulary

REPO = Path(__file__).resolve().parents[1]
PRODUCT = [REPO / "agent" / "offloadpool", REPO / "operator" / "offloadpool", REPO / "bench"]
ENGINE_WORDS = "agent/offloadpool/region/vocabulary.py"
API_WORDS = "agent/offloadpool/api/status.py"

#: The same spelling in another vocabulary, where it means something else.
OTHER_MEANINGS = {
    ("None", "operator/offloadpool/operator/webhookconfig.py"),  # a webhook's sideEffects
    ("Always", "operator/offloadpool/operator/admission.py"),  # a container's restartPolicy
}

ENGINE = sorted(
    {
        *vocabulary.MEDIA,
        *vocabulary.LAYOUTS,
        *vocabulary.NUMA_POLICIES,
        *vocabulary.SCRUB_POLICIES,
        *vocabulary.RECLAIM_POLICIES,
        *vocabulary.DELIVERIES,
        *vocabulary.NODE_PHASES,
        *vocabulary.STATE_PHASES,
    }
)
API = sorted(
    {
        *status.POOL_PHASES,
        *status.CONDITION_TYPES,
        status.ROLLOUT_HALTED,
        status.ROLLOUT_PENDING,
        status.WAITING_FOR_RELEASE,
    }
    - set(ENGINE)
)


def _sources() -> dict[str, str]:
    return {
        path.relative_to(REPO).as_posix(): path.read_text()
        for root in PRODUCT
        for path in sorted(root.rglob("*.py"))
    }


SOURCES = _sources()


def _written_in(word: str) -> set[str]:
    quoted = re.compile(r"""(["'])""" + re.escape(word) + r"\1")
    return {
        module
        for module, text in SOURCES.items()
        if quoted.search(text) and (word, module) not in OTHER_MEANINGS
    }


def test_the_product_tree_is_read() -> None:
    assert ENGINE_WORDS in SOURCES and API_WORDS in SOURCES
    assert any(module.startswith("operator/") for module in SOURCES)
    assert any(module.startswith("bench/") for module in SOURCES)
    assert "HugePages-2Mi" in ENGINE and "Populating" in ENGINE and "Degraded" in API


@pytest.mark.parametrize("word", ENGINE)
def test_an_engine_word_is_written_only_in_the_vocabulary(word: str) -> None:
    assert _written_in(word) == {ENGINE_WORDS}


@pytest.mark.parametrize("word", API)
def test_a_condition_word_is_written_only_in_the_status_model(word: str) -> None:
    assert _written_in(word) == {API_WORDS}


def test_messages_are_cut_in_one_place() -> None:
    cut = re.compile(rf"\[:\s*{MAX_MESSAGE_LENGTH}\s*\]")
    assert [m for m, text in SOURCES.items() if cut.search(text)] == []


def test_the_huge_page_test_is_written_once() -> None:
    """``region.memory.media.is_hugetlbfs`` (from ``Medium.hugetlb``) is the one test for a name."""
    prefix = re.compile(r"""startswith\((["'])HugePages""")
    assert [m for m, text in SOURCES.items() if prefix.search(text)] == []


def test_the_api_types_are_the_engines() -> None:
    from offloadpool.api import media

    assert media.MEDIA == vocabulary.MEDIA
    assert media.NODE_PHASES == vocabulary.NODE_PHASES
    assert set(media.PAGE_SIZES) == set(vocabulary.MEDIA)
    assert media.HUGEPAGE_MEDIA == (vocabulary.HUGEPAGES_2MI, vocabulary.HUGEPAGES_1GI)


def test_an_environment_name_is_written_in_one_module() -> None:
    """Every ``OFFLOADPOOL_*`` variable a product module reads or sets is spelled in one place
    (``api.agent_env`` for the agent's, ``region.vocabulary``/``api.pods`` for a pod's)."""
    name = re.compile(r"""["'](OFFLOADPOOL_[A-Z0-9_]+)["']""")
    where: dict[str, set[str]] = {}
    for module, text in SOURCES.items():
        for found in name.findall(text):
            where.setdefault(found, set()).add(module)
    assert "OFFLOADPOOL_ROOT" in where and "OFFLOADPOOL_POOL_DIR" in where
    assert {n: sorted(m) for n, m in where.items() if len(m) > 1} == {}
