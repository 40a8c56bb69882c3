"""The calling process's own cgroup limits, checked before a pool touches a byte.

Why: in a pod the agent runs in cgroups the kubelet sized from the pod's resources. The
kernel enforces them late and badly for a pool: ``hugetlb.<size>.rsvd.max`` fails the
pre-fault's mmap with ENOMEM, ``hugetlb.<size>.max`` turns the page faults into SIGBUS/EFAULT,
and a tmpfs pool past ``memory.max`` / ``memory.limit_in_bytes`` gets the agent OOM-killed
mid-populate. Read up front, the same limits give a message that names the file, its value,
the pool's need and the resource the pod must ask for.

What is charged where (measured on Linux 6.18, cgroup v2 hugetlb):

* hugetlbfs: the reservation (``rsvd``) is charged to the cgroup of the process that first
  maps a range of the file (the pre-fault's mmap), the page (``hugetlb.<size>.current``) to
  the one that first faults it; both stay charged to that cgroup until the file is truncated
  or removed, so a consumer attaching later is charged nothing. Huge pages are not memory of
  the memory controller unless cgroup v2 is mounted with ``memory_hugetlb_accounting``.
* tmpfs: every page is charged to the memory cgroup of the process that writes it first.

Both cgroup versions and the hybrid layout (v1 controllers plus a v2 hierarchy that holds,
say, only ``hugetlb``) are read from ``/proc/self/cgroup`` and ``/proc/self/mountinfo``; a
limit set on an ancestor binds too, so every level from the process's cgroup up to the
hierarchy's mount is checked and the tightest one is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from offloadpool.region.errors import CapacityError, fmt_bytes
from offloadpool.region.memory.media import Medium

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
UNLIMITED = 1 << 62  # v1 reports "no limit" as a huge page-aligned number, v2 as "max"


class CgroupLimitError(CapacityError):
    """The pool does not fit in a limit of this process's own cgroup (its pod's resources)."""


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller of this process lives: the cgroup directory and the mount above it."""

    version: int  # 1 or 2
    directory: Path  # this process's cgroup in that hierarchy
    mount_point: Path  # the hierarchy's mount (the topmost directory visible here)
    options: frozenset[str]  # the mount's super options (controllers on v1, flags on v2)


@dataclass(frozen=True)
class Limit:
    """One limit file at one level and what is already charged against it."""

    file: Path
    limit: int
    usage: int
    usage_what: str  # how usage was read, for the message

    @property
    def room(self) -> int:
        return max(0, self.limit - self.usage)


@cache
def _mounts(mountinfo: str) -> tuple[tuple[str, Path, str, frozenset[str]], ...]:
    """(fstype, mount point, mount root, super options) of every cgroup mount in the mount
    table at path ``mountinfo``.

    Read once per process: the container runtime mounts the cgroup hierarchies before the
    agent starts, and nothing mounts another under a running one. The table has a line per
    container mount on a node (a pool per simulated node in the scale test), so reading it at
    every provision would cost the agent in proportion to the node's mounts.
    """
    out = []
    for line in Path(mountinfo).read_text().splitlines():
        if " - cgroup" not in line:  # most of a node's mounts: skipped before any split
            continue
        head, sep, tail = line.partition(" - ")
        if not sep:
            continue
        fields, rest = head.split(), tail.split()
        if len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        point = fields[4].replace("\\040", " ")
        out.append((rest[0], Path(point), fields[3], frozenset(rest[2].split(","))))
    return tuple(out)


def _inside(mount_root: str, path: str) -> str | None:
    """``path`` (from /proc/self/cgroup) relative to a mount of ``mount_root``; None if outside."""
    root = mount_root.rstrip("/")
    if path == root or root == "":
        return path.lstrip("/")
    if path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return None


def hierarchy(
    controller: str, *, proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo"
) -> Hierarchy | None:
    """The hierarchy ``controller`` is attached to for this process, v1 first (a controller in
    use on v1 is not available on v2); None when it is mounted nowhere visible."""
    lines = [ln.split(":", 2) for ln in Path(proc_cgroup).read_text().splitlines() if ln.count(":") >= 2]
    mounts = _mounts(mountinfo)
    for hid, controllers, path in lines:
        if hid != "0" and controller in controllers.split(","):
            for fstype, point, root, opts in mounts:
                rel = _inside(root, path)
                if fstype == "cgroup" and controller in opts and rel is not None:
                    return Hierarchy(1, point / rel, point, opts)
            return None
    for hid, _, path in lines:
        if hid != "0":
            continue
        for fstype, point, root, opts in mounts:
            rel = _inside(root, path)
            if fstype == "cgroup2" and rel is not None:
                return Hierarchy(2, point / rel, point, opts)
    return None


def _levels(h: Hierarchy) -> list[Path]:
    """The process's cgroup and each ancestor up to the hierarchy's mount."""
    out = [h.directory]
    while out[-1] != h.mount_point and h.mount_point in out[-1].parents:
        out.append(out[-1].parent)
    return out


def _number(text: str) -> int:
    text = text.strip()
    return UNLIMITED if text == "max" else int(text)


def _read(path: Path) -> int | None:
    try:
        return _number(path.read_text())
    except (OSError, ValueError):
        return None


def _reclaimable_cache(directory: Path, version: int) -> int:
    """Page cache the kernel would reclaim before failing a charge (file LRU pages).

    tmpfs pages sit on the anon LRU (swap-backed), so they are not counted here: they are
    exactly the memory a pool keeps charged."""
    keys = ("inactive_file", "active_file") if version == 2 else ("total_inactive_file", "total_active_file")
    try:
        stat = dict(line.split() for line in (directory / "memory.stat").read_text().splitlines())
    except (OSError, ValueError):
        return 0
    return sum(int(stat.get(k, 0)) for k in keys)


def hugetlb_size_name(page_size: int) -> str:
    """The kernel's name for a huge page size in hugetlb cgroup files: 2MB, 1GB, 64KB."""
    if page_size >= GiB:
        return f"{page_size // GiB}GB"
    if page_size >= MiB:
        return f"{page_size // MiB}MB"
    return f"{page_size // KiB}KB"


def hugetlb_limits(page_size: int, *, rsvd: bool, h: Hierarchy | None) -> list[Limit]:
    """Every set limit on huge pages of ``page_size`` (faulted, or reserved when ``rsvd``)."""
    if h is None:
        return []
    size = hugetlb_size_name(page_size)
    if h.version == 2:
        limit_name, usage_name = (
            (f"hugetlb.{size}.rsvd.max", f"hugetlb.{size}.rsvd.current")
            if rsvd
            else (f"hugetlb.{size}.max", f"hugetlb.{size}.current")
        )
    else:
        limit_name, usage_name = (
            (f"hugetlb.{size}.rsvd.limit_in_bytes", f"hugetlb.{size}.rsvd.usage_in_bytes")
            if rsvd
            else (f"hugetlb.{size}.limit_in_bytes", f"hugetlb.{size}.usage_in_bytes")
        )
    out = []
    for level in _levels(h):
        limit = _read(level / limit_name)
        if limit is None or limit >= UNLIMITED:
            continue
        out.append(Limit(level / limit_name, limit, _read(level / usage_name) or 0, usage_name))
    return out


def memory_limits(h: Hierarchy | None) -> list[Limit]:
    """Every set memory limit, usage counted as the kernel would see it when charging (the
    cgroup's usage less the page cache it would reclaim first)."""
    if h is None:
        return []
    limit_name, usage_name = (
        ("memory.max", "memory.current")
        if h.version == 2
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    out = []
    for level in _levels(h):
        limit = _read(level / limit_name)
        if limit is None or limit >= UNLIMITED:
            continue
        used = max(0, (_read(level / usage_name) or 0) - _reclaimable_cache(level, h.version))
        out.append(Limit(level / limit_name, limit, used, f"{usage_name} less reclaimable page cache"))
    return out


def quantity(n: int) -> str:
    """``n`` bytes as a Kubernetes quantity, rounded up to whole MiB (Gi when exact)."""
    if n > 0 and n % GiB == 0:
        return f"{n // GiB}Gi"
    return f"{-(-n // MiB)}Mi"


def _refuse(
    what: str, need: int, want: int, limit: Limit, own: Path, resource: str, note: str
) -> CgroupLimitError:
    where = (
        "this process's cgroup"
        if limit.file.parent == own
        else f"an ancestor of this process's cgroup ({own})"
    )
    ask = limit.usage + want
    freed = f" ({fmt_bytes(need - want)} of it freed by the pool it replaces)" if want != need else ""
    return CgroupLimitError(
        f"{what} needs {fmt_bytes(need)}{freed}, but {where} allows less: {limit.file} is "
        f"{fmt_bytes(limit.limit)} with {fmt_bytes(limit.usage)} in use ({limit.usage_what}): short by "
        f"{fmt_bytes(want - limit.room)}{note}; nothing was touched. The agent's pod must request "
        f"resources.limits.{resource}: {quantity(ask)} (or more)"
    )


def check(
    medium: Medium,
    need: int,
    *,
    credit: int = 0,
    proc_cgroup: str = "/proc/self/cgroup",
    mountinfo: str = "/proc/self/mountinfo",
) -> None:
    """Raise CgroupLimitError unless ``need`` bytes of ``medium`` fit every limit of this
    process's cgroups; ``credit`` is what a pool being replaced frees (its pages leave the
    cgroup that was charged for them, normally this one)."""
    paths = {"proc_cgroup": proc_cgroup, "mountinfo": mountinfo}
    want = need - credit
    if want <= 0:
        return
    if medium.hugetlb:
        page = medium.page_size
        h = hierarchy("hugetlb", **paths)
        resource = f"hugepages-{quantity(page)}"
        what = f"{medium.name} pool of {need // page} huge pages ({hugetlb_size_name(page)})"
        for rsvd, note in (
            (
                True,
                " (the reservation limit: charged when the pool's files are mapped, "
                "the mmap fails with ENOMEM past it)",
            ),
            (False, " (charged as pages are faulted: SIGBUS past it)"),
        ):
            for limit in hugetlb_limits(page, rsvd=rsvd, h=h):
                if want > limit.room:
                    raise _refuse(
                        what, need, want, limit, h.directory if h else limit.file.parent, resource, note
                    )
        mem = hierarchy("memory", **paths)
        v2_accounts_hugetlb = (
            mem is not None and mem.version == 2 and "memory_hugetlb_accounting" in mem.options
        )
        if not v2_accounts_hugetlb:
            return
        note = " (cgroup v2 is mounted with memory_hugetlb_accounting: huge pages count as memory)"
    else:
        mem = hierarchy("memory", **paths)
        what = f"{medium.name} pool (tmpfs)"
        note = " (tmpfs pages are charged to the memory cgroup of the process that writes them first)"
    for limit in memory_limits(mem):
        if want > limit.room:
            raise _refuse(
                what, need, want, limit, mem.directory if mem else limit.file.parent, "memory", note
            )
