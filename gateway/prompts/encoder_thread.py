"""The tokenizer's encoding on a thread of its own, so its many small allocations come from a heap of their own.

glibc's ``malloc`` gives each thread an arena. The event loop's (the main arena) holds what the calls keep and
free in any order: thousands of contexts growing each turn, the strings of the requests in flight. A Rust
``tokenizers`` encode allocates hundreds of blocks a call (its vectors, the BPE's words, hash maps); served from
that fragmented heap, each costs a walk of its bins. Measured with a 1.7k-token encode beside 4,096 agents' state
(contexts and request strings as ``benchmarks.fleet_bench`` leaves them): 1.19 ms on a clean heap, 1.58-1.83 ms
on the event loop's, 1.20-1.27 ms on a thread of its own. In the gateway under ``perf``, glibc's malloc was
19.7 % of its CPU at 256 agents and 35.4 % at 4,096, its callers mostly the encode (``docs/benchmarks.md``).

Only a gateway on glibc (``--allocator system``, the default) encodes here: under mimalloc (``infra.allocator``)
the encode is as fast beside that state as on a clean heap (0.488 against 0.474 ms, ``benchmarks.arena_bench``),
and the hand-off would cost about 60 us of CPU a call for nothing.

The caller waits for the result on its own thread: the encode holds the GIL throughout (``tokenizers`` does not
release it for one text), so nothing else could run meanwhile anyway, and a synchronous hand-off takes the GIL
straight back instead of competing for it with a busy event loop.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class EncoderThread:
    """Runs one function at a time on a thread of its own, the caller blocked until it returns (or raises)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajbus-tokenize")

    def run(self, function: Callable[..., T], *args) -> T:
        return self._pool.submit(function, *args).result()

    def close(self) -> None:
        """Ends the thread once what it runs returned; a ``run`` after it raises ``RuntimeError``."""
        self._pool.shutdown(wait=True)


def inline(function: Callable[..., T], *args) -> T:
    """Runs ``function`` on the caller's thread: a builder's default where no thread is owned for it."""
    return function(*args)
