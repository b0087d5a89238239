"""What trajbus's slime tests load by dotted path, as slime would: a rollout function that behaves like
slime's sglang rollout (over-sampling, a dynamic filter, an abort when the batch is full), a dynamic
filter and a buffer filter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DROPPED_LABEL = "3"
"""The prompt ``drop_label_3`` filters out."""


@dataclass
class Output:
    """slime's ``RolloutFnTrainOutput``: the batch, one group per prompt."""

    samples: list[list[Any]]
    metrics: dict | None = None


@dataclass
class DynamicFilterVerdict:
    """slime's ``DynamicFilterOutput``."""

    keep: bool
    reason: str | None = None


def drop_label_3(args: Any, samples: list[Any], **kwargs: Any) -> DynamicFilterVerdict:
    keep = samples[0].label != DROPPED_LABEL
    return DynamicFilterVerdict(keep, None if keep else "label_3")


def newest_first(args, rollout_id, buffer, num_samples):
    """A buffer filter in slime's form; it marks ``args`` to show which ``args`` it was given."""
    args.buffer_filter_calls = getattr(args, "buffer_filter_calls", 0) + 1
    taken = buffer[-num_samples:][::-1]
    del buffer[-num_samples:]
    return taken


def _generate(group: list[Any]) -> None:
    for sample in group:
        if sample.status != type(sample).Status.COMPLETED:  # a finished sample is taken as it is, as slime does
            sample.response, sample.response_length = f"answer to {sample.prompt}", 3
            sample.reward, sample.status = float(sample.index % 2), type(sample).Status.COMPLETED


def sglang_like(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Output:
    """Take ``over_sampling_batch_size`` groups at a time; finish them in order until the batch holds
    ``rollout_batch_size`` groups the dynamic filter keeps; then one more finishes (surplus) and the rest
    are cut off mid-answer (aborted), as slime's abort leaves them."""
    batch: list[list[Any]] = []
    while len(batch) < args.rollout_batch_size:
        one_more = True
        for group in data_source.get_samples(args.over_sampling_batch_size):
            if len(batch) < args.rollout_batch_size:
                _generate(group)
                if drop_label_3(args, group).keep:
                    batch.append(group)
            elif one_more:  # finished after the batch was full: slime drops it
                _generate(group)
                one_more = False
            else:
                for sample in group:
                    sample.response, sample.status = "cut off", type(sample).Status.ABORTED
    return Output(sorted(batch, key=lambda group: group[0].index))
