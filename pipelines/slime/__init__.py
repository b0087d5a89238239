"""trajbus inside slime (THUDM/slime): its data source and its rollout's settling, on the prompt ledger.

In slime's command::

    --data-source-path trajbus.pipelines.slime.SlimeDataSource
    --rollout-function-path trajbus.pipelines.slime.sglang.generate_rollout
    --custom-config-path trajbus.yaml     # trajbus_bootstrap_servers: host:9092, ...

or, for agents through trajbus's gateway (``trajbus_settled_by: worker`` in that YAML)::

    --rollout-function-path trajbus.pipelines.slime.agentic.generate_rollout
    --eval-function-path trajbus.pipelines.slime.agentic.generate_rollout

``samples_from_group`` turns a group assembled by trajbus's stream worker into slime Samples.
"""

from trajbus.pipelines.slime.data_source import SlimeDataSource
from trajbus.consumers.slime.samples import sample_kind, samples_from_group
from trajbus.pipelines.slime.settings import SlimeSettings

__all__ = ["SlimeDataSource", "SlimeSettings", "sample_kind", "samples_from_group"]
