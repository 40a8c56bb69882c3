#!/usr/bin/env python3
"""Cut a release of offloadpool, and find or build any release from the repository alone.

    python3 hack/release.py cut VERSION [--date YYYY-MM-DD] [--build]
    python3 hack/release.py list                    # every release: version, commit, date
    python3 hack/release.py find VERSION            # the commit a release was cut at
    python3 hack/release.py build VERSION           # its image and chart archive (as root)
    python3 hack/release.py check                   # the version's homes agree (the lint phase)

The version has one home, ``__version__`` in ``agent/offloadpool/__init__.py`` (the package's
version through hatch); the chart's ``version`` and ``appVersion``, the image tag of the plain
manifests in ``deploy/`` and of the chart's default image, and the image ``hack/image.py``
builds all follow it, and ``check`` fails when one does not. A version is SemVer 2.0 as Helm
requires (``0.1.0``, ``0.2.0-dev``); PEP 440 reads the same string (``0.2.0.dev0``).

``cut`` makes two commits on a clean tree: ``release: cut VERSION`` sets the version in its
homes and turns the CHANGELOG's ``## Unreleased`` section into ``## VERSION — DATE``; then
``release: record VERSION`` writes that commit's id into ``hack/releases.json`` and opens the
next patch's development version (``X.Y.(Z+1)-dev``), so a working tree's image and chart never
carry a released version's tag. Releases are found through ``releases.json``, never through
tags: a clone (CI's included) knows every release without fetching anything. ``build`` checks
the release's commit out as a git worktree under ``$OFFLOADPOOL_CACHE/releases/<commit>/``
(kept: cached by commit), builds its image there with its own ``hack/image.py`` and packages
its chart with ``helm`` — what the upgrade test installs before upgrading to the working tree.

Standard library only (it runs before any virtual environment exists).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VERSION_FILE = Path("agent/offloadpool/__init__.py")
CHART_FILE = Path("charts/offloadpool/Chart.yaml")
CHANGELOG = Path("CHANGELOG.md")
RECORD = Path("hack/releases.json")
#: The plain manifests whose image tag is the version (``image: <repo>:<version>``).
MANIFESTS = (Path("deploy/operator.yaml"), Path("deploy/csi.yaml"), Path("deploy/dra.yaml"))
IMAGE_REPOSITORY = "ghcr.io/offloadpool/offloadpool"
UNRELEASED = "## Unreleased"

_SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?$")
_VERSION_LINE = re.compile(r'^__version__ = "([^"]*)"$', re.M)


class ReleaseError(Exception):
    """A release step refused; nothing was written (the message says what to do)."""


@dataclass(frozen=True)
class Version:
    """A SemVer 2.0 version, ordered as SemVer orders them (a pre-release before its release)."""

    major: int
    minor: int
    patch: int
    pre: tuple[tuple[int, int | str], ...] = ()
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> Version:
        m = _SEMVER.match(text)
        if not m:
            raise ReleaseError(f"{text!r} is not a version MAJOR.MINOR.PATCH[-PRE] (SemVer, as Helm needs)")
        pre: tuple[tuple[int, int | str], ...] = ()
        if m[4]:
            pre = tuple((0, int(p)) if p.isdigit() else (1, p) for p in m[4].split("."))
        return cls(int(m[1]), int(m[2]), int(m[3]), pre, text)

    def key(self) -> tuple[int, int, int, int, tuple[tuple[int, int | str], ...]]:
        # A release sorts after every pre-release of itself.
        return (self.major, self.minor, self.patch, 0 if self.pre else 1, self.pre)

    @property
    def released(self) -> bool:
        return not self.pre

    def next_dev(self) -> Version:
        return Version.parse(f"{self.major}.{self.minor}.{self.patch + 1}-dev")


# -- where the version lives -------------------------------------------------------------------
def read_version(root: Path) -> str:
    m = _VERSION_LINE.search((root / VERSION_FILE).read_text())
    if not m:
        raise ReleaseError(f"no __version__ line in {VERSION_FILE}")
    return m[1]


def _chart_field(text: str, field: str) -> str | None:
    m = re.search(rf'^{field}: *"?([^"\n]*)"?$', text, re.M)
    return m[1] if m else None


def homes(root: Path) -> dict[str, str | None]:
    """Each place that states the version, and what it says there."""
    chart = (root / CHART_FILE).read_text()
    out: dict[str, str | None] = {
        str(VERSION_FILE): read_version(root),
        f"{CHART_FILE} version": _chart_field(chart, "version"),
        f"{CHART_FILE} appVersion": _chart_field(chart, "appVersion"),
    }
    for manifest in MANIFESTS:
        tags = set(re.findall(rf"{re.escape(IMAGE_REPOSITORY)}:([\w.-]+)", (root / manifest).read_text()))
        out[str(manifest)] = tags.pop() if len(tags) == 1 else (", ".join(sorted(tags)) or None)
    return out


def check(root: Path) -> list[str]:
    """What disagrees with ``__version__``; empty when every home states it."""
    version = read_version(root)
    problems = []
    try:
        Version.parse(version)
    except ReleaseError as exc:
        problems.append(f"{VERSION_FILE}: {exc}")
    for where, found in homes(root).items():
        if found != version:
            problems.append(f"{where} says {found!r}, {VERSION_FILE} {version!r}")
    return problems


def write_version(root: Path, version: str) -> None:
    path = root / VERSION_FILE
    path.write_text(_VERSION_LINE.sub(f'__version__ = "{version}"', path.read_text(), count=1))
    chart = root / CHART_FILE
    text = re.sub(r"^version: .*$", f"version: {version}", chart.read_text(), count=1, flags=re.M)
    chart.write_text(re.sub(r"^appVersion: .*$", f'appVersion: "{version}"', text, count=1, flags=re.M))
    for manifest in MANIFESTS:
        p = root / manifest
        p.write_text(re.sub(rf"({re.escape(IMAGE_REPOSITORY)}):[\w.-]+", rf"\g<1>:{version}", p.read_text()))


# -- the record --------------------------------------------------------------------------------
def releases(root: Path) -> list[dict[str, str]]:
    path = root / RECORD
    return json.loads(path.read_text())["releases"] if path.exists() else []


def find(root: Path, version: str) -> dict[str, str]:
    for release in releases(root):
        if release["version"] == version:
            return release
    known = ", ".join(r["version"] for r in releases(root)) or "none"
    raise ReleaseError(f"no release {version} in {RECORD} (releases: {known})")


def _write_record(root: Path, entries: list[dict[str, str]]) -> None:
    body = {
        "comment": "Every release of offloadpool and the commit it was cut at (hack/release.py).",
        "releases": entries,
    }
    (root / RECORD).write_text(json.dumps(body, indent=2) + "\n")


# -- the CHANGELOG -----------------------------------------------------------------------------
def changelog_section(text: str, version: str, date: str) -> str:
    """``text`` with its Unreleased section named ``version`` and a new empty one above it."""
    if UNRELEASED + "\n" not in text:
        raise ReleaseError(f"{CHANGELOG} has no '{UNRELEASED}' section to release")
    start = text.index(UNRELEASED + "\n") + len(UNRELEASED) + 1
    nxt = text.find("\n## ", start)
    body = text[start : nxt if nxt >= 0 else len(text)]
    if not body.strip():
        raise ReleaseError(f"{CHANGELOG}'s '{UNRELEASED}' section is empty: nothing to release")
    return text.replace(UNRELEASED + "\n", f"{UNRELEASED}\n\n## {version} — {date}\n", 1)


# -- git ---------------------------------------------------------------------------------------
def git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReleaseError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def cut(root: Path, version_text: str, date: str) -> tuple[str, str]:
    """Cut ``version``: the release commit and the record commit (their ids)."""
    version = Version.parse(version_text)
    if not version.released:
        raise ReleaseError(f"{version_text} is a pre-release; cut a release X.Y.Z")
    if git(root, "status", "--porcelain"):
        raise ReleaseError("the working tree has uncommitted changes; commit or stash them first")
    if problems := check(root):
        raise ReleaseError("the version's homes disagree: " + "; ".join(problems))
    done = releases(root)
    if done:
        last = max((Version.parse(r["version"]) for r in done), key=Version.key)
        if version.key() <= last.key():
            raise ReleaseError(f"{version_text} is not newer than the last release {last.text}")
    changelog = changelog_section((root / CHANGELOG).read_text(), version_text, date)

    write_version(root, version_text)
    (root / CHANGELOG).write_text(changelog)
    git(root, "add", "-A")
    git(
        root,
        "commit",
        "-q",
        "-m",
        f"release: cut {version_text}",
        "-m",
        f"Released {date}; recorded in {RECORD}.",
    )
    commit = git(root, "rev-parse", "HEAD")

    _write_record(root, [*done, {"version": version_text, "commit": commit, "date": date}])
    nxt = version.next_dev().text
    write_version(root, nxt)
    git(root, "add", "-A")
    git(
        root,
        "commit",
        "-q",
        "-m",
        f"release: record {version_text}, open {nxt}",
        "-m",
        f"{version_text} is commit {commit}. The working tree's version is {nxt} from here on, "
        "so its image and chart never carry a released tag.",
    )
    return commit, git(root, "rev-parse", "HEAD")


# -- building a release ------------------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("OFFLOADPOOL_CACHE", "/var/cache/offloadpool")) / "releases"


def source(root: Path, version: str) -> Path:
    """The release's tree, a git worktree of its recorded commit (made once, kept)."""
    commit = find(root, version)["commit"]
    tree = cache_root() / commit / "src"
    if not (tree / VERSION_FILE).exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        git(root, "worktree", "prune")
        git(root, "worktree", "add", "--force", "--detach", str(tree), commit)
    if read_version(tree) != version:
        raise ReleaseError(f"{tree} says version {read_version(tree)}, not {version}: remove it")
    return tree


def build(root: Path, version: str, helm: str = "helm") -> dict[str, str]:
    """The release's image (OCI layout and archive) and chart archive, built from its tree."""
    tree = source(root, version)
    image = subprocess.run(
        [sys.executable, str(tree / "hack/image.py"), "archive"], check=True, capture_output=True, text=True
    ).stdout.strip()
    out = tree.parent / "chart"
    chart = out / f"offloadpool-{version}.tgz"
    if not chart.exists():
        out.mkdir(exist_ok=True)
        if shutil.which(helm) is None and not Path(helm).exists():
            raise ReleaseError(f"no helm at {helm!r}: give --helm (the control plane cache has one)")
        subprocess.run([helm, "package", str(tree / "charts/offloadpool"), "-d", str(out)], check=True)
    return {"version": version, "source": str(tree), "image_archive": image, "chart": str(chart)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("cut", help="cut VERSION from the current commit (two commits)")
    c.add_argument("version")
    c.add_argument("--date", default=dt.date.today().isoformat())
    c.add_argument("--build", action="store_true", help="then build its image and chart (as root)")
    c.add_argument("--helm", default="helm")
    sub.add_parser("list", help="every recorded release")
    f = sub.add_parser("find", help="the commit a release was cut at")
    f.add_argument("version")
    b = sub.add_parser("build", help="a release's image and chart archive, from its commit (as root)")
    b.add_argument("version")
    b.add_argument("--helm", default="helm")
    sub.add_parser("check", help="fail when a home of the version disagrees with __version__")
    args = parser.parse_args(argv)
    root: Path = args.root
    try:
        if args.command == "cut":
            commit, record = cut(root, args.version, args.date)
            print(f"released {args.version} at {commit}; recorded at {record}")
            if args.build:
                print(json.dumps(build(root, args.version, args.helm), indent=2))
        elif args.command == "list":
            for r in releases(root):
                print(f"{r['version']}\t{r['commit']}\t{r['date']}")
        elif args.command == "find":
            print(find(root, args.version)["commit"])
        elif args.command == "build":
            print(json.dumps(build(root, args.version, args.helm), indent=2))
        else:
            problems = check(root)
            for p in problems:
                print(f"release check: {p}", file=sys.stderr)
            return 1 if problems else 0
    except ReleaseError as exc:
        print(f"hack/release.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
