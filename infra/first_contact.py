"""A first contact with a cluster: a wrong address is one error naming it, in bounded time.

A cluster no client of this process has reached yet is not in an outage: it may be a wrong
address. ``first_contact`` (a producer's first call, a consumer's first fetch, the CLI's
commands) waits up to ``CONNECT_TIMEOUT`` for its first answer and otherwise raises
``ClusterNotReached``, one line naming the address; meanwhile the outage line is held back
(``outage.ClusterOutage.contacting``), so that error is the only line.

It asks with an ordinary admin client (``infra.clients``), whose errors name the last failed
attempt and refused credentials; that is why it sits above ``clients``, while the outage it
reports to sits below.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException

from trajbus.infra.clients import RefusedCredentials, admin, cluster_metadata
from trajbus.infra.kafka_config import error_words
from trajbus.infra.outage import KafkaUnreachable, cluster_outage

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 10.0
"""How long a first contact waits for a cluster no client of this process has reached: a broker that
is up answers in milliseconds, one starting has these seconds, a wrong address is told after them."""


class ClusterNotReached(KafkaUnreachable):
    """No broker at the bootstrap address answered a first contact: a wrong address, or a cluster not up."""


def first_contact(servers: str, timeout: float = CONNECT_TIMEOUT) -> None:
    """Return once the cluster at ``servers`` answered a client of this process (at once if one did
    before); else raise ``ClusterNotReached`` after ``timeout`` seconds, one line naming the address and
    the last attempt's words. Refused credentials raise ``clients.RefusedCredentials`` at once."""
    cluster = cluster_outage(servers)
    if cluster.answered:
        return
    with cluster.contacting():
        try:
            cluster_metadata(admin(servers, {"logger": log}), timeout)
        except RefusedCredentials:
            raise
        except KafkaException as exc:
            cluster.not_reached()
            why = cluster.reason or error_words(exc)
            raise ClusterNotReached(f"no Kafka broker answers at {servers} within {timeout:g}s ({why}); "
                                    "is the address right? (--bootstrap-servers, TRAJBUS_BOOTSTRAP_SERVERS)"
                                    ) from None
    cluster.reached()
