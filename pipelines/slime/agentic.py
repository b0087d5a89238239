"""slime's ``--rollout-function-path trajbus.pipelines.slime.agentic.generate_rollout``: agents through trajbus's gateway.

slime's default rollout samples each prompt with one ``/generate`` call; this one hands each sample of
a group to an agent (``trajbus_agent_path``: any callable ``agent(base_url, sample, sampling)``, the
demo's calculator agent by default) that talks to the model through trajbus's gateway, as many turns
and tools as it likes. The gateway records every call token-exactly, trajbus's stream worker assembles
each prompt's trajectories into a group, and the rollout returns those groups as slime Samples:
``tokens`` (prompt + every turn), ``response_length``, ``loss_mask`` (1 on the model's tokens, 0 on
tool and environment turns), ``rollout_log_probs`` (the engine's, 0.0 between turns), ``reward``,
``status`` (truncated when the last call hit its length budget), ``weight_versions`` and, where a
weight update cut a generation, the policy version of each response token (``metadata["policy_versions"]``).

It keeps slime's contract: ``generate_rollout(args, rollout_id, data_source, evaluation=False)``
returns slime's ``RolloutFnTrainOutput`` (samples and metrics: slime's dynamic-filter drop counts
and trajbus's ``rollout/trajbus/*``) or, for ``--eval-function-path``, ``RolloutFnEvalOutput``
(``{dataset: {rewards, truncated, samples}}`` over slime's ``eval_datasets``); an older slime gets
the list it expects, and without slime trajbus's ``TrainOutput`` / ``EvalOutput`` of the same fields.
``--dynamic-sampling-filter-path`` and ``--over-sampling-batch-size`` act as in slime's rollout,
except that groups in flight when the batch is full are not aborted: they count toward the next
rollout. ``args`` may be None (slime's contract tests call it so): the settings then come from the
environment and one group is rolled out (``pipelines.slime.rollout_args``).

Settings are ``trajbus_*`` keys of slime's ``--custom-config-path`` YAML (``pipelines.slime.settings``).
With ``--data-source-path trajbus.pipelines.slime.SlimeDataSource`` and ``trajbus_settled_by: worker``,
a resume from slime's checkpoint trains every prompt once (``pipelines.slime.group_reader``).
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass, field
from typing import Any

from trajbus.pipelines.slime.agentic_rollout import AgenticRollout
from trajbus.pipelines.slime.data_source import SlimeDataSource
from trajbus.consumers.slime.samples import slime_sample_class
from trajbus.pipelines.slime.settings import SlimeSettings

__all__ = ["EvalOutput", "TrainOutput", "close", "generate_rollout"]


@dataclass
class TrainOutput:
    """slime's ``RolloutFnTrainOutput`` where slime is not installed: the same fields."""

    samples: list[list[Any]]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalOutput:
    """slime's ``RolloutFnEvalOutput`` where slime is not installed: the same fields."""

    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] = field(default_factory=dict)


_rollouts: dict[int, tuple[Any, AgenticRollout]] = {}
"""id(data_source) -> (the data source, its rollouts): slime passes the same data source every time."""
_lock = threading.Lock()


def _rollout_for(args: Any, data_source: Any) -> AgenticRollout:
    with _lock:
        known = _rollouts.get(id(data_source))
        if known is None or known[0] is not data_source:
            settings = data_source.settings if isinstance(data_source, SlimeDataSource) else \
                SlimeSettings.from_args(args)
            known = _rollouts[id(data_source)] = (data_source, AgenticRollout(settings, args, data_source))
        return known[1]


def _slime_outputs() -> tuple[type, type] | None:
    """slime's output classes, where this slime has them."""
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    except ImportError:
        return None
    return RolloutFnTrainOutput, RolloutFnEvalOutput


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function: ``rollout_batch_size`` groups of Samples assembled from agents' calls
    (``evaluation``: the eval datasets' results)."""
    rollout = _rollout_for(args, data_source)
    outputs = _slime_outputs()
    legacy = outputs is None and slime_sample_class() is not None
    if evaluation:
        data = rollout.evaluate(args, rollout_id)
        if legacy:
            return data
        return outputs[1](data=data, metrics={}) if outputs else EvalOutput(data)
    samples, metrics = rollout.train(args, rollout_id)
    if legacy:
        return samples
    return outputs[0](samples=samples, metrics=metrics) if outputs else TrainOutput(samples, metrics)


def close(data_source: Any = None) -> None:
    """End the agents and close the readers of ``data_source``'s rollouts (None: every data source's)."""
    with _lock:
        keys = [id(data_source)] if data_source is not None else list(_rollouts)
        ended = [_rollouts.pop(key)[1] for key in keys if key in _rollouts]
    for rollout in ended:
        rollout.close()


atexit.register(close)
