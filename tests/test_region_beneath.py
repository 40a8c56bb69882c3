"""``region.files.beneath``: names opened under a directory descriptor, never through a link.

Each case runs twice: with ``openat2(2)`` (this kernel has it) and with the ``O_NOFOLLOW`` walk
used where it does not (forced by clearing the probe's answer), on real files, links and fifos.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from offloadpool.region.files import beneath

MiB = 1 << 20


@pytest.fixture(params=["openat2", "walk"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "openat2":
        beneath._use_openat2 = None
        assert beneath.has_openat2(), "this kernel has openat2 (5.6+): the probe must say so"
    else:
        monkeypatch.setattr(beneath, "_use_openat2", False)
    return request.param


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """A directory (by descriptor) holding ``sub/file``, and a file outside it."""
    base = tmp_path / "base"
    (base / "sub").mkdir(parents=True)
    (base / "sub" / "file").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.write_bytes(b"outside")
    os.chmod(outside, 0o644)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd, base, outside
    finally:
        os.close(fd)


def test_plain_names_open_and_write(mode, tree):
    fd, base, _ = tree
    assert beneath.read_file(fd, "sub/file") == b"inside"
    beneath.write_file(fd, "sub/new", b"written", 0o640)
    st = os.lstat(base / "sub" / "new")
    assert (base / "sub" / "new").read_bytes() == b"written" and stat.S_IMODE(st.st_mode) == 0o640
    assert [n for n in os.listdir(base / "sub") if n.endswith(".tmp")] == []


@pytest.mark.parametrize("rel", ["..", "../outside", "/etc/passwd", "sub/../sub/file", "", "sub//file", "."])
def test_names_that_could_leave_the_directory_are_refused(mode, tree, rel):
    fd, _, _ = tree
    with pytest.raises(ValueError, match="not a plain relative name"):
        beneath.open_file(fd, rel)


def test_a_link_at_the_last_name_is_never_followed(mode, tree):
    fd, base, outside = tree
    (base / "link").symlink_to(outside)
    (base / "dangling").symlink_to(base.parent / "made-through-a-link")
    for rel, flags in (
        ("link", os.O_RDWR),
        ("link", os.O_RDWR | os.O_CREAT),
        ("dangling", os.O_RDWR | os.O_CREAT),
    ):
        with pytest.raises(beneath.WrongEntry, match="symbolic link"):
            beneath.open_file(fd, rel, flags)
    beneath.write_file(fd, "link", b"replaced")  # replaces the link as a name
    assert not (base / "link").is_symlink() and (base / "link").read_bytes() == b"replaced"
    assert outside.read_bytes() == b"outside"
    assert not (base.parent / "made-through-a-link").exists()


def test_a_link_on_the_way_is_never_followed(mode, tree):
    fd, base, outside = tree
    (base / "hop").symlink_to(outside.parent)
    with pytest.raises(beneath.WrongEntry, match="symbolic link"):
        beneath.open_file(fd, "hop/outside", os.O_RDWR)
    with pytest.raises(beneath.WrongEntry):
        beneath.open_dir(fd, "hop")
    with pytest.raises(beneath.WrongEntry):
        beneath.unlink(fd, "hop/outside")
    assert outside.read_bytes() == b"outside"


def test_a_fifo_a_directory_and_a_second_link_are_refused_without_blocking(mode, tree):
    fd, base, outside = tree
    os.mkfifo(base / "fifo")
    os.link(outside, base / "alias")
    with pytest.raises(beneath.WrongEntry, match="a fifo"):
        beneath.open_file(fd, "fifo")
    with pytest.raises(beneath.WrongEntry, match="a directory"):
        beneath.open_file(fd, "sub", os.O_RDWR)
    with pytest.raises(beneath.WrongEntry, match="2 hard links"):
        beneath.open_file(fd, "alias", os.O_RDWR)
    fd2 = beneath.open_file(fd, "alias", links=2)  # a caller that expects two links may open it
    os.close(fd2)
    with pytest.raises(beneath.WrongEntry, match="more than"):
        (base / "big").write_bytes(b"x" * (beneath.MAX_READ + 1))
        beneath.read_file(fd, "big")


def test_removal_removes_the_name_not_the_target(mode, tree):
    fd, base, outside = tree
    (base / "link").symlink_to(outside)
    assert beneath.unlink(fd, "link") and not os.path.lexists(base / "link")
    assert not beneath.unlink(fd, "link")
    assert outside.read_bytes() == b"outside"
