"""Which policy version sampled which response token: a step's version segments.

A weight update may cut a generation at the engine; the gateway continues it
from prompt + partial response under the new weights, so one response holds
tokens of two (or more) versions. A step records that as ``version_segments``:
``[[start, version], ...]``, the response token index where each run of one
version begins (the first at 0, starts strictly increasing, every start inside
the response). ``None`` (every step without a cut) means one run of the step's
``policy_version``, so a step without a cut carries nothing extra; the list is
O(cuts), never O(tokens).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["check_version_segments", "token_versions", "Segments"]

_I64 = 2**63


def check_version_segments(segments: object, n_tokens: int) -> list[list[int]]:
    """``segments`` as a list of ``[start, version]`` pairs; ``ValueError`` naming the first defect."""
    name = "version_segments"
    if not isinstance(segments, (list, tuple)) or not segments:
        raise ValueError(f"{name}: must be a non-empty list of [start, version] pairs or null, got {segments!r}")
    previous = -1
    for position, pair in enumerate(segments):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or any(type(v) is not int for v in pair):
            raise ValueError(f"{name}[{position}]: must be a pair of integers [start, version], got {pair!r}")
        start, version = pair
        if position == 0 and start != 0:
            raise ValueError(f"{name}[0]: the first segment starts at token 0, got {start}")
        if start <= previous or start >= max(n_tokens, 1):
            raise ValueError(f"{name}[{position}]: starts must increase and lie within the {n_tokens} response "
                             f"tokens, got {start}")
        if not -_I64 <= version < _I64:
            raise ValueError(f"{name}[{position}]: version must fit 64 bits, got {version}")
        previous = start
    return [list(pair) for pair in segments]


def token_versions(segments: Sequence[Sequence[int]] | None, n_tokens: int, policy_version: int) -> np.ndarray:
    """One version per response token (int64): the runs of ``segments``, else ``policy_version``."""
    versions = np.full(n_tokens, policy_version, dtype=np.int64)
    if segments:
        starts = [int(start) for start, _ in segments] + [n_tokens]
        for (start, version), end in zip(segments, starts[1:]):
            versions[int(start):end] = int(version)
    return versions


class Segments:
    """A writer's builder: tokens are added as they arrive, each run under the version that sampled it."""

    __slots__ = ("runs", "count")

    def __init__(self) -> None:
        self.runs: list[list[int]] = []
        self.count = 0

    def add(self, n_tokens: int, version: int) -> None:
        if n_tokens <= 0:
            return
        if not self.runs or self.runs[-1][1] != version:
            self.runs.append([self.count, version])
        self.count += n_tokens

    def wire(self, policy_version: int) -> list[list[int]] | None:
        """What the step carries: None when every token is ``policy_version``'s (nothing on the wire)."""
        if not self.runs or (len(self.runs) == 1 and self.runs[0][1] == policy_version):
            return None
        return [list(run) for run in self.runs]
