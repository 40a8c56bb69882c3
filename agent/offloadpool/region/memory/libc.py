"""The C library through ctypes, with the prototypes of the memory calls the node engine
(``vm``) and the pinning helper (``offloadpool.pinning.libc``) make, declared once.

A ctypes call releases the GIL for its whole duration, so threads fault or pin pages on
separate cores; ``use_errno`` keeps the call's errno for the caller's error.
"""

from __future__ import annotations

import ctypes
import ctypes.util

#: What mmap(2) returns on failure.
MAP_FAILED = ctypes.c_void_p(-1).value

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
for _name in ("munmap", "mlock", "munlock"):
    getattr(LIBC, _name).restype = ctypes.c_int
    getattr(LIBC, _name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.madvise.restype = ctypes.c_int
LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
LIBC.fallocate.restype = ctypes.c_int
LIBC.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
LIBC.memset.restype = ctypes.c_void_p
LIBC.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
