"""The C allocator, set for a server whose calls hold large buffers for a while: freed, they go back to the OS.

A gateway call at a 32k-token context holds buffers of 100-250 KB while it waits on the engine (its prompt's
token array, the engine request's JSON as orjson grows it), and thousands of calls wait at once. glibc's
``malloc`` serves a block that large with ``mmap`` and returns it with ``munmap``, but only until the first such
block is freed: from then on it raises its threshold to that block's size, serves them from its heap, and keeps
what they freed (a heap shrinks only at its top). After a burst of 1,024 calls in flight the gateway's heap held
363 MB free (``benchmarks.fleet_bench``: 19.8 bytes of RSS per context token). Fixing the threshold keeps every
large block a mapping of its own, unmapped when freed; ``malloc_trim``, which would return the rest, is not
used: it walks the whole heap under the allocator's lock, 60-380 ms at a few GB, a pause every call would wait.

The threshold is a trade, measured: at 64 KiB the RSS was 11.5-12.4 bytes a context token, but every call
mapped two more blocks (librdkafka's LZ4 state and output, 64 KiB each, and SQLite's page cache, 88 KiB):
about 0.5 ms more CPU a call in ``benchmarks.gateway_bench``. At 96 KiB those stay in the heap, 0.4 blocks a
call are mapped (orjson's growing buffer), no CPU cost showed, and the RSS was 15.0 bytes a token. Another C
library (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("trajbus.infra")
LARGE_BLOCK_BYTES = 96 * 1024
"""Blocks from this size up are mapped on their own and returned to the OS when freed (glibc's default
starts at 128 KiB, then follows the largest block freed, up to 32 MiB); a token array from 24k tokens up."""
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
