"""Whether a token sequence begins with another, decided in place: no copy of the prefix.

A multi-turn step is checked against its trajectory's last context at every call (the wire's base,
``streams.wire.prefix``; the gateway's stored token state, ``gateway.state.trajectories``). Slicing the prompt to
compare copies the whole context first: at 32k tokens a 128 KB block that glibc maps and unmaps each time (blocks
from 96 KiB up, ``infra.allocator``), or, below that, a large block served from a heap that thousands of
trajectories' state fragments (in ``perf`` at 4,096 agents, array slices were the first caller of ``_int_malloc``
on the gateway's event loop). Two token arrays of one kind are compared by the C library's ``memcmp`` over their
buffers instead (in-process, 3 against 12 us at 32k tokens, 1 against 3 at 8k); anything else by slicing.
"""

from __future__ import annotations

import ctypes
from array import array
from typing import Any, Callable, Sequence


def _libc_memcmp() -> Callable[[int, int, int], int] | None:
    """``memcmp`` called with the GIL held (``PyDLL``): a call of a few microseconds gains nothing from letting
    another thread in, and the arrays it reads cannot change under it."""
    try:
        memcmp = ctypes.PyDLL(None).memcmp
    except (OSError, AttributeError):  # no C library reachable by name: compare by slicing
        return None
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


_MEMCMP = _libc_memcmp()
INTEGER_TYPECODES = frozenset("bBhHiIlLqQ")
"""Arrays whose items are equal exactly when their bytes are (not floats: NaN, -0.0)."""


def begins_with(ids: Sequence[Any], prefix: Sequence[Any]) -> bool:
    """Whether ``ids`` start with every item of ``prefix`` (an empty prefix: always). A list and an array of the
    same ids are the same sequence here."""
    n = len(prefix)
    if len(ids) < n:
        return False
    if not n:
        return True
    if _MEMCMP is not None and isinstance(ids, array) and isinstance(prefix, array) \
            and ids.typecode == prefix.typecode and prefix.typecode in INTEGER_TYPECODES:
        return _MEMCMP(ids.buffer_info()[0], prefix.buffer_info()[0], n * prefix.itemsize) == 0
    head = ids[:n]
    return head == prefix if type(head) is type(prefix) else list(head) == list(prefix)
