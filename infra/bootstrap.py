"""How every component finds the broker, in one place.

Order: an explicit ``--bootstrap-servers``, else ``TRAJBUS_BOOTSTRAP_SERVERS``,
else the embedded broker (or cluster) that ``trajbus broker up`` started.
"""

from __future__ import annotations

import os

from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster, layout_size

ENV_VAR = "TRAJBUS_BOOTSTRAP_SERVERS"


class BrokerNotFound(RuntimeError):
    """No bootstrap address was given and no embedded broker is running."""


def resolve_bootstrap_servers(explicit: str | None = None) -> str:
    if explicit:
        return explicit
    from_env = os.environ.get(ENV_VAR, "").strip()
    if from_env:
        return from_env
    state = EmbeddedKafka().status() or EmbeddedCluster(nodes=layout_size() or 1).status()
    if state is not None:
        return state.bootstrap_servers
    raise BrokerNotFound(
        "no Kafka broker: pass --bootstrap-servers, set TRAJBUS_BOOTSTRAP_SERVERS, "
        "or start the embedded one with `trajbus broker up`"
    )
