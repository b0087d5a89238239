"""How long Kafka has been unreachable, for components that ride through outages up to a limit.

Kafka clients reconnect on their own, so a broker restart needs nothing from a
person. What a supervisor needs is the opposite case: an outage that does not end.
``OutageWatch`` asks the broker for metadata every few seconds from a thread of its
own; it logs the state changes (lost, back), and past ``limit`` seconds calls
``on_limit`` once, after which the component exits non-zero with one line.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from confluent_kafka import KafkaException

from trajbus.infra.clients import reader

log = logging.getLogger(__name__)


class OutageWatch:
    def __init__(self, bootstrap_servers: str, limit: float, on_limit: Callable[[str], None],
                 interval: float = 5.0, what: str = "component") -> None:
        self.limit, self.interval, self.what = limit, interval, what
        self.down_since: float | None = None
        self._on_limit = on_limit
        self._probe = reader(bootstrap_servers, {"logger": log, "log_level": 0})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kafka-outage-watch", daemon=True)

    def start(self) -> "OutageWatch":
        self._thread.start()
        return self

    def _reachable(self) -> bool:
        try:
            self._probe.list_topics(timeout=self.interval)
            return True
        except KafkaException:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            if self._reachable():
                if self.down_since is not None:
                    log.info("kafka reachable again after %.0fs", time.time() - self.down_since)
                self.down_since = None
                continue
            if self.down_since is None:
                self.down_since = time.time()
                log.warning("kafka unreachable; the %s rides through it for up to %gs", self.what, self.limit)
            if time.time() - self.down_since > self.limit:
                self._on_limit(f"Kafka unreachable for {time.time() - self.down_since:.0f}s "
                               f"(--broker-outage-limit {self.limit:g}); exiting for a supervisor to restart it")
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval)
        self._probe.close()
