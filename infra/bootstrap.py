"""How every component finds the broker, in one place.

Order: an explicit ``--bootstrap-servers``, else ``TRAJBUS_BOOTSTRAP_SERVERS``,
else the embedded broker (or cluster) that ``trajbus broker up`` started, found
by its state directory (``TRAJBUS_STATE_DIR``, else the default under the cache).
``DISCOVERY`` says so in words: the error of a failed search and README.md's
paragraph both quote it (tests/unit/test_readme_claims.py holds them to it).
"""

from __future__ import annotations

import os

from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster, layout_size
from trajbus.infra.paths import default_state_dir

ENV_VAR = "TRAJBUS_BOOTSTRAP_SERVERS"

DISCOVERY = ("`--bootstrap-servers`, else `TRAJBUS_BOOTSTRAP_SERVERS`, else the embedded broker that "
             "`trajbus broker up` started, found by its state directory: `TRAJBUS_STATE_DIR` (set it to the "
             "`--state-dir` the broker was started with), else `~/.cache/trajbus/broker`")
"""Every way a component finds the broker, in the order it tries them."""


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
    raise BrokerNotFound(not_found_message())


def not_found_message() -> str:
    """One line: every way tried, where the embedded broker was looked for, and what to do."""
    return (f"no Kafka broker: none given, and none runs in {default_state_dir()}. trajbus takes {DISCOVERY}; "
            "start one with `trajbus broker up`")
