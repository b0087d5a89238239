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

import threading
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class EncoderThread:
    """Runs one function at a time on a thread of its own, the caller blocked until it returns (or raises).

    The hand-off is two plain locks, one released by each side: a ``ThreadPoolExecutor``'s future, work item,
    queue and condition cost 52 us of CPU a call where they cost 24 (in-process, an empty function)."""

    def __init__(self) -> None:
        self._callers = threading.Lock()
        """One call at a time: held by the caller from the hand-off to the outcome."""
        self._called, self._answered = threading.Lock(), threading.Lock()
        """Released by the caller once the call is set, by the thread once its outcome is: each starts held."""
        self._called.acquire()
        self._answered.acquire()
        self._call: tuple[Callable[..., Any], tuple] | None = None
        self._outcome: tuple[bool, Any] = (False, None)
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="trajbus-tokenize", daemon=True)
        self._thread.start()

    def run(self, function: Callable[..., T], *args) -> T:
        with self._callers:
            if self._closed:
                raise RuntimeError("the encoder thread is closed")
            self._call = (function, args)
            self._called.release()
            try:
                self._answered.acquire()
            except BaseException:  # interrupted: the call still ends on the thread; its outcome is not left over
                self._answered.acquire()
                raise
            (returned, value), self._outcome = self._outcome, (False, None)
        if returned:
            return value
        raise value

    def _serve(self) -> None:
        while True:
            self._called.acquire()
            call, self._call = self._call, None
            if call is None:  # closed
                return
            function, args = call
            try:
                self._outcome = (True, function(*args))
            except BaseException as exc:  # the caller's to raise
                self._outcome = (False, exc)
            self._answered.release()

    def close(self) -> None:
        """Ends the thread once what it runs returned; a ``run`` after it raises ``RuntimeError``."""
        with self._callers:
            if self._closed:
                return
            self._closed = True
            self._called.release()  # no call set: the thread ends
        self._thread.join()


def inline(function: Callable[..., T], *args) -> T:
    """Runs ``function`` on the caller's thread: a builder's default where no thread is owned for it."""
    return function(*args)
