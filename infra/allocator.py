"""The C allocator, set for a server whose calls hold large buffers for a while: freed, they go back to the OS.

A gateway call at a 32k-token context holds buffers of 100-250 KB while it waits on the engine (its prompt's
token array, the engine request's JSON as orjson grows it), and thousands of calls wait at once. glibc's
``malloc`` serves a block that large with ``mmap`` and returns it with ``munmap``, but only until the first such
block is freed: from then on it raises its threshold to that block's size, serves them from its heap, and keeps
what they freed (a heap shrinks only at its top). After a burst of 1,024 calls in flight the gateway's heap held
363 MB free (``benchmarks.fleet_bench``: 19.8 bytes of RSS per context token). Fixing the threshold keeps every
large block a mapping of its own, unmapped when freed. What smaller blocks freed stays in the heap, between the
trajectories' state; ``malloc_trim`` returns it (``release_free_heap``), but it walks the whole heap under the
allocator's lock, 10-150 ms at a few hundred MB, a pause every call then in flight would wait: the gateway calls it
only when no call is in flight (``gateway.http.quiet``).

The threshold is a trade, measured: at 64 KiB the RSS was 11.5-12.4 bytes a context token, but every call
mapped two more blocks (librdkafka's LZ4 state and output, 64 KiB each, and SQLite's page cache, 88 KiB):
about 0.5 ms more CPU a call in ``benchmarks.gateway_bench``. At 96 KiB those stay in the heap, 0.4 blocks a
call are mapped (orjson's growing buffer), no CPU cost showed, and the RSS was 15.0 bytes a token. Another C
library (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("trajbus.infra")
LARGE_BLOCK_BYTES = 96 * 1024
"""Blocks from this size up are mapped on their own and returned to the OS when freed (glibc's default
starts at 128 KiB, then follows the largest block freed, up to 32 MiB); a token array from 24k tokens up."""
_M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter (malloc.h); setting it also stops the threshold from following freed blocks."""


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (the settings below are its own), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
    except (OSError, AttributeError):
        return None
    return libc


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fix glibc's mmap threshold; False (and nothing changed) under another C library."""
    libc = _glibc()
    if libc is None:
        return False
    if not libc.mallopt(_M_MMAP_THRESHOLD, threshold):
        log.warning("glibc %s refused mmap threshold %d: large freed blocks may stay in the heap",
                    libc.gnu_get_libc_version().decode(), threshold)
        return False
    return True


def release_free_heap() -> bool:
    """Give the free pages inside glibc's heaps back to the OS (``malloc_trim(0)``), not only those at a heap's
    top; True when some were. Holds each heap's lock while it walks it: call it where no one waits on that."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
