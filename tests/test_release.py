"""Releases: ``hack/release.py`` cuts one in a real git clone, records its commit in the
repository itself, and finds it again from a clone that has no tags; the version's homes agree."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
import release  # noqa: E402  (hack/ is not a package on the path)

SCRIPT = REPO / "hack" / "release.py"
#: A committer for the clones (CI's machine may have no git identity).
GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "offloadpool tests",
    "GIT_AUTHOR_EMAIL": "tests@offloadpool.invalid",
    "GIT_COMMITTER_NAME": "offloadpool tests",
    "GIT_COMMITTER_EMAIL": "tests@offloadpool.invalid",
}


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


def script(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args], env=GIT_ENV, capture_output=True, text=True
    )


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A clone of this repository's HEAD, with an Unreleased entry to release."""
    dest = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", "--no-tags", str(REPO), str(dest)], check=True)
    changelog = dest / "CHANGELOG.md"
    changelog.write_text(
        changelog.read_text().replace("## Unreleased\n", "## Unreleased\n\n- A change worth releasing.\n", 1)
    )
    git(dest, "commit", "-qam", "test: a change to release")
    return dest


def next_release(root: Path) -> str:
    """The release the clone's version leads to: X.Y.Z of X.Y.Z-dev (or the next patch)."""
    v = release.Version.parse(release.read_version(root))
    return f"{v.major}.{v.minor}.{v.patch}" if v.pre else f"{v.major}.{v.minor}.{v.patch + 1}"


def test_versions_order_as_semver() -> None:
    order = ["0.1.0", "0.1.1-dev", "0.1.1", "0.1.10", "0.2.0-dev", "0.2.0-rc.1", "0.2.0", "1.0.0"]
    keys = [release.Version.parse(v).key() for v in order]
    assert keys == sorted(keys)
    assert release.Version.parse("0.1.0").next_dev().text == "0.1.1-dev"
    for bad in ("0.1", "v0.1.0", "01.1.0", "0.1.0.dev0", "0.1.0-"):
        with pytest.raises(release.ReleaseError):
            release.Version.parse(bad)


def test_the_version_has_one_home() -> None:
    """Every place that states the version states ``__version__`` (the lint phase runs this)."""
    assert release.check(REPO) == []
    done = subprocess.run([sys.executable, str(SCRIPT), "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_check_names_the_home_that_disagrees(clone: Path) -> None:
    chart = clone / "charts/offloadpool/Chart.yaml"
    chart.write_text(re.sub(r"^appVersion: .*$", 'appVersion: "9.9.9"', chart.read_text(), flags=re.M))
    done = script(clone, "check")
    assert done.returncode == 1
    assert "Chart.yaml appVersion says '9.9.9'" in done.stderr


def test_cut_records_the_release_in_the_repository(clone: Path, tmp_path: Path) -> None:
    version = next_release(clone)
    before = git(clone, "rev-parse", "HEAD")
    done = script(clone, "cut", version, "--date", "2026-12-03")
    assert done.returncode == 0, done.stderr

    # Two commits: the release, then its record and the next development version.
    commits = git(clone, "rev-list", f"{before}..HEAD").split()
    assert len(commits) == 2
    cut_at = commits[1]
    assert git(clone, "log", "-1", "--format=%s", cut_at) == f"release: cut {version}"

    # A clone of the clone, without tags, finds the release and its tree states the version.
    again = tmp_path / "again"
    subprocess.run(["git", "clone", "-q", "--no-tags", str(clone), str(again)], check=True)
    assert git(again, "tag") == ""
    found = script(again, "find", version)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == cut_at
    assert f'__version__ = "{version}"' in git(again, "show", f"{cut_at}:agent/offloadpool/__init__.py")
    chart = git(again, "show", f"{cut_at}:charts/offloadpool/Chart.yaml")
    assert f"\nversion: {version}\n" in chart and f'appVersion: "{version}"' in chart
    assert f"ghcr.io/offloadpool/offloadpool:{version}" in git(
        again, "show", f"{cut_at}:deploy/operator.yaml"
    )
    changelog = git(again, "show", f"{cut_at}:CHANGELOG.md")
    assert f"## Unreleased\n\n## {version} — 2026-12-03\n\n- A change worth releasing.\n" in changelog

    # The working tree moved on to the next development version; every home agrees at both.
    nxt = release.Version.parse(version).next_dev().text
    assert release.read_version(again) == nxt
    assert release.check(again) == []
    git(again, "checkout", "-q", cut_at)
    assert release.check(again) == []
    record = json.loads((clone / "hack/releases.json").read_text())["releases"]
    assert record[-1] == {"version": version, "commit": cut_at, "date": "2026-12-03"}
    assert script(clone, "list").stdout.splitlines()[-1] == f"{version}\t{cut_at}\t2026-12-03"


def test_cut_refuses_and_writes_nothing(clone: Path) -> None:
    version = next_release(clone)
    head = git(clone, "rev-parse", "HEAD")

    pre = script(clone, "cut", f"{version}-rc.1")
    assert pre.returncode == 1 and "pre-release" in pre.stderr

    (clone / "stray.txt").write_text("not committed")
    dirty = script(clone, "cut", version)
    assert dirty.returncode == 1 and "uncommitted changes" in dirty.stderr
    (clone / "stray.txt").unlink()

    assert script(clone, "cut", version).returncode == 0
    head = git(clone, "rev-parse", "HEAD")
    same = script(clone, "cut", version)
    assert same.returncode == 1 and "not newer than the last release" in same.stderr

    # Nothing to release: the Unreleased section the cut opened is empty.
    later = script(clone, "cut", next_release(clone))
    assert later.returncode == 1 and "section is empty" in later.stderr
    assert git(clone, "rev-parse", "HEAD") == head
    assert git(clone, "status", "--porcelain") == ""


def test_an_unknown_release_is_named() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "find", "99.0.0"], capture_output=True, text=True)
    assert done.returncode == 1
    assert "no release 99.0.0" in done.stderr


def test_every_recorded_release_is_in_this_history_at_its_version() -> None:
    """0.1.0 and every later release: an ancestor of HEAD whose tree states its version."""
    recorded = release.releases(REPO)
    assert [r["version"] for r in recorded][:1] == ["0.1.0"]
    for r in recorded:
        subprocess.run(["git", "merge-base", "--is-ancestor", r["commit"], "HEAD"], cwd=REPO, check=True)
        tree = git(REPO, "show", f"{r['commit']}:agent/offloadpool/__init__.py")
        assert f'__version__ = "{r["version"]}"' in tree
    assert (
        release.Version.parse(release.read_version(REPO)).key()
        > release.Version.parse(recorded[-1]["version"]).key()
    )
