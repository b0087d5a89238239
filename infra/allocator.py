"""The C allocator, set for a server whose calls hold large buffers for a while: freed, they go back to the OS.

A gateway call at a 32k-token context holds several buffers of 100-200 KB while it waits on the engine (its
prompt's token array, the engine request's JSON, the step's record), and thousands of calls wait at once. glibc's
``malloc`` serves a block that large with ``mmap`` and returns it with ``munmap``, but only until the first such
block is freed: from then on it raises its threshold to that block's size, serves them from its heap, and
keeps what they freed (a heap shrinks only at its top). After a burst of 1,024 calls in flight, the gateway's
heap held 363 MB free, more than the trajectories it kept (``benchmarks.fleet_bench``: 19.8 bytes per context
token of RSS; with the threshold fixed, 12.4). Fixing the threshold keeps every large block a mapping of its
own, unmapped when freed; ``malloc_trim``, which would return the rest, is not used: it walks the whole heap
under the allocator's lock, 60-380 ms at a few GB, a pause every call in flight would wait out.

Mapping and unmapping a block costs a few page faults (~12 us for a 128 KB slice, the same as from the heap
when measured alone). Another C library (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("trajbus.infra")
LARGE_BLOCK_BYTES = 64 * 1024
"""Blocks from this size up are mapped on their own and returned to the OS when freed (glibc's default
starts at 128 KiB, then follows the largest block freed, up to 32 MiB)."""
_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter (malloc.h); setting it also stops the threshold from following freed blocks."""


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fix glibc's mmap threshold; False (and nothing changed) under another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        gnu_libc_version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    gnu_libc_version.restype = ctypes.c_char_p
    if not mallopt(_M_MMAP_THRESHOLD, threshold):
        log.warning("glibc %s refused mmap threshold %d: large freed blocks may stay in the heap",
                    gnu_libc_version().decode(), threshold)
        return False
    return True
