"""Token ids as the gateway holds them: packed 32-bit arrays, not Python lists.

A trajectory's context (its last prompt and the reply sampled for it) stays in memory while the trajectory is
open, and an instance holds thousands of them at tens of thousands of tokens each. As a list, a token is an
8-byte pointer to a 28-byte int object; as ``array('I')`` it is 4 bytes, and extending a context is a memory
copy. Lists still arrive (a tokenizer's output, an engine's reply, a white-box agent's ``prompt_ids``) and are
packed where they join a context. ``orjson`` writes the engine's request from a zero-copy numpy view.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Union

import numpy as np

TOKEN_TYPECODE = "I"
TOKEN_BYTES = array(TOKEN_TYPECODE).itemsize
TokenIds = array
"""``array('I')``: unsigned 32-bit token ids (every vocabulary fits)."""
AnyIds = Union[array, list]


def packed(ids: Iterable[int]) -> array:
    """``ids`` as a token array (the same object when it is one already)."""
    if isinstance(ids, array) and ids.typecode == TOKEN_TYPECODE:
        return ids
    return array(TOKEN_TYPECODE, ids)


def sampled_ids(ids: list[int]) -> AnyIds:
    """An engine's sampled ids as a step carries them: packed, so checking and writing them are C loops over
    4-byte ids (an ``array('I')`` holds nothing else); as they came when one is no 32-bit id, for the step's
    check to name it."""
    try:
        return packed(ids)
    except (OverflowError, TypeError):
        return ids


def joined(ids: AnyIds, more: Iterable[int]) -> AnyIds:
    """``ids`` followed by ``more``, a new sequence of ``ids``'s kind (``ids`` is never changed)."""
    if isinstance(ids, array):
        return ids + packed(more)
    return ids + list(more)


def as_json(ids: AnyIds) -> np.ndarray | list:
    """What ``orjson`` writes as a JSON list of ints (with ``OPT_SERIALIZE_NUMPY``), without a copy."""
    return np.frombuffer(ids, dtype=np.uint32) if isinstance(ids, array) else ids
