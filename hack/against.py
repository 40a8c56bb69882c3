"""Run today's tests against an older commit's product code.

    python3 -m hack.against <commit> [pytest args...]

A fix's "fails before, passes now" evidence: the tests (tests/, hack/, docs/, examples/) are
this checkout's HEAD; the product (agent/, operator/, charts/, crds/, deploy/, Dockerfile,
pyproject.toml) is ``<commit>``'s, staged too, so hack/image.py (which builds the node's image
from ``git ls-files``) builds the old code. The tree is a worktree under
``$OFFLOADPOOL_AGAINST_TREE`` (default /var/tmp/offloadpool-against/<commit>), reset on every
run but its ``.venv`` (remade only when the old pyproject.toml changes). Run it as the tests need
(root, caches built: hack/test.sh's phases), one real node or control plane on the machine at a
time as ever. Runs on one tree take turns (an flock beside it): each run resets the tree, so
worktrees running at once should each name their own ``OFFLOADPOOL_AGAINST_TREE`` anyway.

Modules that moved between ``<commit>`` and HEAD (``git diff -M``: renames only) are importable
under their new names too: a finder, installed in that venv by a ``.pth`` file, answers a new
name with the old module itself (same object), and a package that did not exist yet with an
empty one. So HEAD's test imports load, and their assertions meet the old code unchanged. A name
HEAD added (not moved) stays missing: that test fails with ImportError, which is the truth.

Standard library only. Exit status: pytest's.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: what a commit's product is; everything else comes from HEAD
PRODUCT = ("agent", "operator", "charts", "crds", "deploy", "Dockerfile", "pyproject.toml")
SOURCE_ROOTS = ("agent/", "operator/")

FINDER = '''"""hack/against.py: modules renamed since the product's commit, under their new names."""
import importlib
import importlib.abc
import importlib.util
import sys

MODULES = {modules!r}
PACKAGES = {packages!r}


class _Renamed(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self.specs = {{}}

    def find_spec(self, name, path, target=None):
        if name in MODULES or name in PACKAGES:
            return importlib.util.spec_from_loader(name, self, is_package=name in PACKAGES)
        return None

    def create_module(self, spec):
        if spec.name not in MODULES:
            return None  # a package the old tree lacks: empty
        module = importlib.import_module(MODULES[spec.name])
        self.specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        name = module.__spec__.name
        if name in MODULES:
            module.__spec__ = self.specs[name]  # the old module keeps its own spec


sys.meta_path.append(_Renamed())
'''


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def module_name(path: str) -> str | None:
    """agent/offloadpool/region/files/manifest.py -> offloadpool.region.files.manifest"""
    root = next((r for r in SOURCE_ROOTS if path.startswith(r)), None)
    if root is None or not path.endswith(".py"):
        return None
    parts = path[len(root) : -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def renames(commit: str, head: str) -> tuple[dict[str, str], list[str]]:
    """new module name -> old one, for every module moved since ``commit``; and the packages
    of new names that ``commit`` lacks."""
    modules: dict[str, str] = {}
    out = git("diff", "-M", "--name-status", "--diff-filter=R", commit, head, "--", *SOURCE_ROOTS)
    for line in out.splitlines():
        _, old_path, new_path = line.split("\t")
        old, new = module_name(old_path), module_name(new_path)
        if old and new and old != new:
            modules[new] = old
    old_files = set(git("ls-tree", "-r", "--name-only", commit, "--", *SOURCE_ROOTS).split())
    old_packages = {m for m in map(module_name, old_files) if m} | {
        m.rsplit(".", 1)[0] for m in map(module_name, old_files) if m and "." in m
    }
    packages = sorted(
        {
            new.rsplit(".", i)[0]
            for new in modules
            for i in range(1, new.count("."))
            if new.rsplit(".", i)[0] not in old_packages
        }
    )
    return modules, packages


def prepare(commit: str, head: str, tree: Path) -> Path:
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        git("worktree", "add", "--detach", str(tree), head)
    else:
        git("checkout", "--detach", "--force", head, cwd=tree)
        git("clean", "-fdq", cwd=tree)  # not -x: .venv stays
    paths = [p for p in PRODUCT if git("ls-tree", "--name-only", commit, "--", p).strip()]
    git("restore", f"--source={commit}", "--staged", "--worktree", "--", *paths, cwd=tree)
    left = git("diff", "--cached", "--name-only", commit, "--", *paths, cwd=tree).strip()
    assert not left, f"the product paths differ from {commit}: {left}"
    venv = tree / ".venv"
    python = venv / "bin" / "python"
    stamp = venv / ".against-pyproject"
    want = hashlib.sha256((tree / "pyproject.toml").read_bytes()).hexdigest()
    if not python.exists() or not stamp.exists() or stamp.read_text() != want:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", ".[test]"], cwd=tree, check=True)
        stamp.write_text(want)
    modules, packages = renames(commit, head)
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "_offloadpool_against.py").write_text(FINDER.format(modules=modules, packages=packages))
    (Path(purelib) / "_offloadpool_against.pth").write_text("import _offloadpool_against\n")
    print(
        f"against: tests from {head[:12]}, product from {commit[:12]} in {tree}; "
        f"{len(modules)} renamed module(s) importable by their new names",
        file=sys.stderr,
    )
    return python


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    commit = git("rev-parse", "--verify", f"{argv[0]}^{{commit}}").strip()
    head = git("rev-parse", "HEAD").strip()
    tree = Path(os.environ.get("OFFLOADPOOL_AGAINST_TREE", f"/var/tmp/offloadpool-against/{commit[:12]}"))
    tree.parent.mkdir(parents=True, exist_ok=True)
    # one run per tree at a time: each run resets the tree to its own HEAD's tests, so a second
    # checkout (another worktree's, another session's) under a running one would change what it
    # runs; the next run waits, saying so
    with open(tree.parent / f".{tree.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"hack.against: {tree} is in use by another run; waiting for it", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        python = prepare(commit, head, tree)
        return subprocess.run([str(python), "-m", "pytest", *argv[1:]], cwd=tree).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
