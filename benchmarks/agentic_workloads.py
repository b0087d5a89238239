"""Agentic RL workloads at the sizes real trainers see (issue 12), as trajbus ``Step``s.

- ``single_turn``: 64 groups x 8 rollouts x 2 steps; a 1,950-token prompt shared by a
  group's rollouts and steps, 460 sampled tokens a step; 32k vocabulary.
- ``multi_turn``: 8 groups x 8 rollouts x 12 turns; a 1,024-token task, then per turn 256
  sampled + 512 tool-output tokens, each prompt the previous prompt + response + tool
  output (the last ~9.5k tokens); 151k vocabulary.
- ``long_context``: 1 group x 16 rollouts x 40 turns; per turn ~500 sampled + ~1,000
  tool-output tokens, contexts to ~62k tokens.

Log-probs are varied floats (as engines return), so nothing compresses to nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from trajbus.streams.wire.records import Step


@dataclass(frozen=True)
class Workload:
    name: str
    groups: int
    rollouts: int
    turns: int
    task_tokens: int
    response_tokens: int
    tool_tokens: int
    vocabulary: int
    multi_turn: bool = True
    """Every turn's prompt is the previous prompt + response + tool output; else every step's is the task."""

    def describe(self) -> str:
        return (f"{self.groups} groups x {self.rollouts} rollouts x {self.turns} turns, task {self.task_tokens}, "
                f"per turn {self.response_tokens} sampled + {self.tool_tokens} tool tokens")


SINGLE_TURN = Workload("single_turn", 64, 8, 2, 1950, 460, 0, 32_000, multi_turn=False)
MULTI_TURN = Workload("multi_turn", 8, 8, 12, 1024, 256, 512, 151_000)
LONG_CONTEXT = Workload("long_context", 1, 16, 40, 2048, 500, 1000, 151_000)


def _tokens(rng: np.random.Generator, n: int, vocabulary: int) -> list[int]:
    return rng.integers(0, vocabulary, size=n).tolist()


def _log_probs(rng: np.random.Generator, n: int) -> list[float]:
    return (-rng.exponential(1.5, size=n)).astype(np.float32).tolist()


def trajectory(workload: Workload, prompt_uid: str, rollout: int, task: list[int],
               rng: np.random.Generator) -> list[Step]:
    """One rollout's steps in turn order; in multi-turn, each prompt extends the last."""
    steps, prompt = [], list(task)
    for turn in range(workload.turns):
        response = _tokens(rng, workload.response_tokens, workload.vocabulary)
        steps.append(Step(prompt_ids=list(prompt), response_ids=response,
                          trajectory_uid=f"{prompt_uid}/r{rollout}", prompt_uid=prompt_uid, step_index=turn,
                          rollout_log_probs=_log_probs(rng, len(response)), is_last=turn == workload.turns - 1,
                          reward=float(rollout % 2) if turn == workload.turns - 1 else 0.0,
                          n_rollouts=workload.rollouts))
        if workload.multi_turn:
            prompt += response + _tokens(rng, workload.tool_tokens, workload.vocabulary)
    return steps


def generate(workload: Workload, seed: int = 0, tag: str = "") -> list[list[Step]]:
    """Per group, its steps as agents send them: turn by turn, the group's rollouts interleaved."""
    rng = np.random.default_rng(seed)
    order = random.Random(seed)
    groups = []
    for g in range(workload.groups):
        uid = f"{tag}{workload.name}-{g:03d}"
        task = _tokens(rng, workload.task_tokens, workload.vocabulary)
        rollouts = [trajectory(workload, uid, r, task, rng) for r in range(workload.rollouts)]
        sent = []
        for turn in range(workload.turns):
            this_turn = [steps[turn] for steps in rollouts]
            order.shuffle(this_turn)
            sent += this_turn
        groups.append(sent)
    return groups


def distinct_tokens(workload: Workload) -> int:
    """Token ids a workload has once each: a group's task, each rollout's responses and tool outputs."""
    per_rollout = workload.turns * (workload.response_tokens + workload.tool_tokens)
    return workload.groups * (workload.task_tokens + workload.rollouts * per_rollout)


def distinct_bytes(workload: Workload) -> int:
    """Bytes of the distinct token ids and of the sampled tokens' log-probs, 4 bytes each."""
    sampled = workload.groups * workload.rollouts * workload.turns * workload.response_tokens
    return 4 * (distinct_tokens(workload) + sampled)
