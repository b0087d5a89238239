"""What the agentic rollout reads off slime's ``args``: batch sizes, sampling, the dynamic filter, eval sets.

Each value has slime's name and, where a bare ``args`` (or ``None``, as slime's contract tests call a
rollout function) lacks it, a default: ``rollout_batch_size`` 1, ``over_sampling_batch_size`` the
batch size (slime's own rule), sampling the engine's defaults, no filter, no eval datasets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from trajbus.infra.dotted import import_dotted
from trajbus.pipelines.prompt_dataset import PromptDataset
from trajbus.consumers.slime.sample_kind import SampleKind
from trajbus.pipelines.slime.settings import source_args

__all__ = ["EvalSet", "RolloutShape", "DynamicFilterVerdict", "dynamic_filter", "eval_sets", "sampling_of"]


@dataclass(frozen=True)
class RolloutShape:
    """``rollout_batch_size`` groups per rollout, dispatched ``over_sampling_batch_size`` at a time."""

    batch: int
    over_sampling: int

    @classmethod
    def of(cls, args: Any) -> "RolloutShape":
        batch = getattr(args, "rollout_batch_size", None) or 1
        return cls(batch, getattr(args, "over_sampling_batch_size", None) or batch)

    def to_dispatch(self, kept: int, in_flight: int) -> int:
        """Groups to hand out now: none while kept + in flight fill the batch, else enough to bring the
        groups in flight up to ``over_sampling`` (slime's round), and at least the missing ones."""
        missing = self.batch - kept - in_flight
        return max(missing, self.over_sampling - in_flight) if missing > 0 else 0


def _first(*values: Any) -> Any:
    return next((value for value in values if value is not None), None)


def sampling_of(args: Any, config: Any = None) -> dict[str, Any]:
    """OpenAI sampling parameters: an eval dataset's (``config``), else slime's eval or rollout flags."""
    evaluating = config is not None
    values = {
        "temperature": _first(getattr(config, "temperature", None),
                              getattr(args, "eval_temperature", None) if evaluating else None,
                              getattr(args, "rollout_temperature", None)),
        "top_p": _first(getattr(config, "top_p", None), getattr(args, "eval_top_p", None) if evaluating else None,
                        getattr(args, "rollout_top_p", None)),
        "max_tokens": _first(getattr(config, "max_response_len", None),
                             getattr(args, "eval_max_response_len", None) if evaluating else None,
                             getattr(args, "rollout_max_response_len", None)),
    }
    return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True)
class DynamicFilterVerdict:
    """slime's ``DynamicFilterOutput``, read off whatever the filter returned (a bool in slime's older form)."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False
    """Keep a rejected group when dropping it would leave too few groups to fill the batch."""


def dynamic_filter(args: Any) -> Callable[[list[Any]], DynamicFilterVerdict]:
    """``--dynamic-sampling-filter-path`` as a verdict on a group's Samples; without one, every group is kept."""
    path = getattr(args, "dynamic_sampling_filter_path", None)
    if not path:
        return lambda group: DynamicFilterVerdict(True)
    function = import_dotted(path, "dynamic_sampling_filter_path")

    def verdict(group: list[Any]) -> DynamicFilterVerdict:
        output = function(args, group)
        return DynamicFilterVerdict(bool(getattr(output, "keep", output)), getattr(output, "reason", None),
                       bool(getattr(output, "keep_when_insufficient", False)))

    return verdict


@dataclass
class EvalSet:
    """One evaluation dataset as groups to roll out: each prompt ``n`` times, fresh indices."""

    name: str
    groups: list[list[Any]]
    sampling: dict[str, Any]


def _prompts(args: Any, config: Any) -> PromptDataset:
    """An eval dataset's prompts, read with slime's data-source keys (the dataset's own where it has them)."""
    base = source_args(args)
    return PromptDataset(dataclasses.replace(
        base, prompt_data=config.path, rollout_shuffle=False, rollout_global_dataset=True,
        input_key=_first(getattr(config, "input_key", None), base.input_key),
        label_key=_first(getattr(config, "label_key", None), base.label_key),
        metadata_key=_first(getattr(config, "metadata_key", None), base.metadata_key),
        tool_key=_first(getattr(config, "tool_key", None), base.tool_key),
        apply_chat_template=_first(getattr(config, "apply_chat_template", None), base.apply_chat_template),
        rollout_max_prompt_len=getattr(args, "eval_max_prompt_len", None)))


def eval_sets(args: Any, kind: SampleKind, cache: dict[tuple, PromptDataset]) -> list[EvalSet]:
    """slime's ``eval_datasets`` (its ``EvalDatasetConfig``: name, path, keys, ``n_samples_per_eval_prompt``,
    sampling), each prompt's group of copies; datasets are read once (``cache``)."""
    sets = []
    for config in getattr(args, "eval_datasets", None) or []:
        key = (config.path, getattr(config, "input_key", None), getattr(config, "label_key", None))
        if key not in cache:
            cache[key] = _prompts(args, config)
        n = _first(getattr(config, "n_samples_per_eval_prompt", None), getattr(args, "n_samples_per_eval_prompt", None),
                   1)
        groups, index = [], 0
        for group_index, prompt in enumerate(cache[key].origin_samples):
            group = []
            for _ in range(n):
                sample = kind.new(prompt)
                sample.index, sample.group_index = index, group_index
                index += 1
                group.append(sample)
            groups.append(group)
        sets.append(EvalSet(config.name, groups, sampling_of(args, config)))
    return sets
