"""Synthetic agent traffic: prompt groups of multi-step trajectories, interleaved as
concurrent rollout workers send them. Used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import random

from trajbus.streams.wire.records import Step


def group_steps(prompt_uid: str, trajectories_per_group: int, n_steps: int, rng: random.Random,
                **extra) -> list[list[Step]]:
    """Per trajectory, its steps in order; the last one carries the reward."""
    trajectories = []
    for r in range(trajectories_per_group):
        steps = []
        for i in range(n_steps):
            response = [rng.randrange(150000) for _ in range(rng.randint(1, 8))]
            steps.append(Step(
                prompt_ids=[rng.randrange(150000) for _ in range(rng.randint(1, 12))], response_ids=response,
                trajectory_uid=f"{prompt_uid}/t{r}", prompt_uid=prompt_uid, step_index=i,
                reward=float(r) if i == n_steps - 1 else 0.0, is_last=i == n_steps - 1,
                rollout_log_probs=[-0.5] * len(response), metadata={"i": i}, **extra,
            ))
        trajectories.append(steps)
    return trajectories


def interleave(trajectories: list[list[Step]], rng: random.Random) -> list[Step]:
    """A random merge that keeps each trajectory's own order (as concurrent agents produce)."""
    queues = [list(t) for t in trajectories]
    merged = []
    while queues:
        i = rng.randrange(len(queues))
        merged.append(queues[i].pop(0))
        if not queues[i]:
            queues.pop(i)
    return merged


def make_groups(n_groups: int, trajectories_per_group: int, n_steps: int, seed: int, tag: str = "g",
                window: int = 50) -> tuple[dict[str, list[Step]], list[Step]]:
    """``n_groups`` groups: the steps sent per prompt_uid, and all steps as agents send them:
    interleaved across the trajectories of ``window`` groups at a time, as rollout workers do."""
    rng = random.Random(seed)
    sent: dict[str, list[Step]] = {}
    stream: list[Step] = []
    for first in range(0, n_groups, window):
        trajectories = []
        for g in range(first, min(first + window, n_groups)):
            per_group = group_steps(f"{tag}{g:04d}", trajectories_per_group, n_steps, rng)
            sent[f"{tag}{g:04d}"] = [s for t in per_group for s in t]
            trajectories += per_group
        stream += interleave(trajectories, rng)
    return sent, stream
