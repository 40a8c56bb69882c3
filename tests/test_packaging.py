"""Packaging contracts of the repository layout.

The folder `operator/` shares its name with a standard-library module, so the layout is only
safe while nothing makes the repository root an import location for a package named `operator`.
These tests run real interpreters in real working directories, the way users and CI do.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The environment's own interpreter and scripts (the .venv in CI and development).
PYTHON = sys.executable
SCRIPTS = Path(sysconfig.get_path("scripts"))


def _python(code: str, cwd: Path) -> str:
    proc = subprocess.run([PYTHON, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"python -c {code!r} in {cwd} failed:\n{proc.stderr}"
    return proc.stdout.strip()


def test_stdlib_operator_is_not_shadowed_from_the_repo_root() -> None:
    # `python -c` puts the current directory first on sys.path: the exact shadowing risk.
    out = _python("import collections, operator; print(operator.__file__)", REPO_ROOT)
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(out).resolve().parent == stdlib, f"operator loaded from {out}, not {stdlib}"
    assert not (REPO_ROOT / "operator" / "__init__.py").exists()


def test_cli_console_script_prints_help(tmp_path: Path) -> None:
    script = SCRIPTS / "offloadpool"
    assert script.exists(), f"console script missing: {script} (is the package installed?)"
    proc = subprocess.run([str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()


def test_operator_package_resolves_from_its_source_root(tmp_path: Path) -> None:
    # From a directory outside the clone: only the installed (editable) package can answer.
    out = _python("import offloadpool.operator as m; print(m.__file__)", tmp_path)
    expected = REPO_ROOT / "operator" / "offloadpool" / "operator" / "__init__.py"
    assert Path(out).resolve() == expected.resolve()


def test_engine_library_resolves_from_the_agent_root(tmp_path: Path) -> None:
    out = _python("import offloadpool.region as m; print(m.__file__)", tmp_path)
    expected = REPO_ROOT / "agent" / "offloadpool" / "region" / "__init__.py"
    assert Path(out).resolve() == expected.resolve()
