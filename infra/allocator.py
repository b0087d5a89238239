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

A gateway may run on mimalloc instead (``--allocator mimalloc``): glibc serves the small blocks of a Rust
``tokenizers`` encode slowly from a heap that thousands of calls' long-lived blocks fragment (malloc was 19.7 % of
the gateway's CPU at 256 agents and 35.4 % at 4,096), where mimalloc's size-class pages do not care
(``benchmarks.arena_bench``: a 1.7k-token encode 0.744 ms on a clean glibc heap, 1.017 ms beside 4,096 agents'
state, 0.474 and 0.488 ms under mimalloc). It keeps more, though: a page returns to the OS only when every block
on it is free, where ``malloc_trim`` returns the free pages inside glibc's heap (``benchmarks.fleet_bench`` at
4,096 agents: 2.99 against 3.72 ms a call, 10.6 against 7.7 bytes a context token). A C allocator is chosen
before the process starts, so the gateway starts itself again with the ``cmeel-mimalloc`` wheel's library
preloaded (``run_on``); the free heap is then given back by mimalloc's own collection.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.metadata
import logging
import os
import sys
from typing import Mapping

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


MIMALLOC, SYSTEM = "mimalloc", "system"
ALLOCATORS = (MIMALLOC, SYSTEM)
PRELOAD = "LD_PRELOAD"


@functools.cache
def mimalloc_library() -> str | None:
    """The path of mimalloc's shared library from the ``cmeel-mimalloc`` wheel; None when it is not installed."""
    try:
        distribution = importlib.metadata.distribution("cmeel-mimalloc")
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in distribution.files or () if f.name == "libmimalloc.so"]
    return str(distribution.locate_file(found[0])) if found else None


@functools.cache
def mimalloc_active() -> bool:
    """Whether this process's ``malloc`` is mimalloc's (its library preloaded)."""
    return hasattr(ctypes.CDLL(None), "mi_version")


def _preloads(env: Mapping[str, str]) -> list[str]:
    return [path for path in env.get(PRELOAD, "").split(":") if path]


def preloaded(env: Mapping[str, str], mimalloc: bool = True) -> dict[str, str]:
    """``env`` with mimalloc's library first in ``LD_PRELOAD`` (unchanged when the wheel is not installed), or
    without it (``mimalloc=False``): the environment of a child that should allocate with it, or not."""
    library, env = mimalloc_library(), dict(env)
    others = [path for path in _preloads(env) if path != library]
    paths = [library, *others] if mimalloc and library is not None else others
    if paths:
        env[PRELOAD] = ":".join(paths)
    else:
        env.pop(PRELOAD, None)
    return env


def run_on(allocator: str) -> None:
    """Start this process again, the same command, on ``allocator`` (mimalloc preloaded, or not) unless it runs on
    it already; returns only when it cannot (the wheel missing, or preloaded once and still not on it: a loader
    that refused the library), after saying why. Once on it, ``LD_PRELOAD`` no longer names mimalloc, so the
    processes it starts (a local Ray, a tool) choose their own."""
    wanted = allocator == MIMALLOC
    if mimalloc_active() == wanted:
        if PRELOAD in os.environ:
            os.environ.update(preloaded({PRELOAD: os.environ.pop(PRELOAD)}, mimalloc=False))
        return
    library = mimalloc_library()
    if wanted and (library is None or library in _preloads(os.environ)):
        log.warning("mimalloc not %s: the system allocator serves this process",
                    "installed (the cmeel-mimalloc wheel)" if library is None else f"loaded from {library}")
        return
    if not wanted and library not in _preloads(os.environ):
        log.warning("mimalloc was loaded by other means than %s=%s: it serves this process", PRELOAD, library)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], preloaded(os.environ, wanted))


def return_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Fix glibc's mmap threshold; False (and nothing changed) under another C library or mimalloc."""
    libc = _glibc()
    if libc is None or mimalloc_active():
        return False
    if not libc.mallopt(_M_MMAP_THRESHOLD, threshold):
        log.warning("glibc %s refused mmap threshold %d: large freed blocks may stay in the heap",
                    libc.gnu_get_libc_version().decode(), threshold)
        return False
    return True


def release_free_heap() -> bool:
    """Give the free pages inside the allocator's heaps back to the OS: glibc's ``malloc_trim(0)`` (not only those
    at a heap's top; True when some were), or mimalloc's forced collection of this thread's heap and of the pages
    no thread holds (True). Holds each heap's lock while it walks it: call it where no one waits on that."""
    if mimalloc_active():
        return release_thread_heap()
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def release_thread_heap() -> bool:
    """Under mimalloc, whose heaps are per thread, give back what the calling thread's own heap holds free (a
    forced ``mi_collect``: only the owner can); False, doing nothing, under another allocator."""
    if not mimalloc_active():
        return False
    ctypes.CDLL(None).mi_collect(ctypes.c_bool(True))
    return True
