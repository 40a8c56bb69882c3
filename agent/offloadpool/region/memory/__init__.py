"""The memory itself: media, huge pages, mounts, NUMA placement, cgroup limits and the pre-fault.

Everything here is about pages and the kernel (what a medium is, how many huge pages there are,
a pool's own mount, ``mbind``, the parallel workers that fault or zero memory); nothing here
knows a pool's files beyond the segment plan it is handed.
"""
