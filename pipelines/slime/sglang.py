"""slime's ``--rollout-function-path trajbus.pipelines.slime.sglang.generate_rollout``: slime's own rollout,
settled on trajbus's data source.

It runs the rollout function ``trajbus_rollout_function_path`` names (slime's sglang rollout by
default) unchanged, between ``SlimeDataSource.begin_rollout`` and ``settle``: the data source then
knows which of the groups it handed out were trained, which were surplus, filtered or aborted
(``pipelines.slime.settle``). It relies on what slime's sglang rollout does: every group it took
has ended (finished or aborted) when it returns. slime's fully-async rollout keeps groups in flight
from one rollout to the next, so run that one directly, not through this function.
Evaluation, and any other data source, go to the inner function as they are.
"""

from __future__ import annotations

from typing import Any

from trajbus.infra.dotted import import_dotted
from trajbus.pipelines.slime.data_source import SlimeDataSource
from trajbus.pipelines.slime.settings import SlimeSettings

__all__ = ["generate_rollout"]


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """slime's rollout function signature; returns what the inner rollout function returns."""
    settings = data_source.settings if isinstance(data_source, SlimeDataSource) else SlimeSettings.from_args(args)
    inner = import_dotted(settings.rollout_function_path, "trajbus_rollout_function_path")
    if evaluation or not isinstance(data_source, SlimeDataSource):
        return inner(args, rollout_id, data_source, evaluation=evaluation)
    data_source.begin_rollout(rollout_id)
    output = inner(args, rollout_id, data_source, evaluation=False)
    data_source.settle(getattr(output, "samples", output))
    return output
