"""Kafka outages as this process's clients see them: one line when one begins, one when it ends.

librdkafka reports every reconnect attempt (every 50 ms to 1 s per client, per broker): a
20 s outage was 80 lines from one producer, and a consumer at a wrong address 194 lines in
5 s. What a person needs is the state change. ``ClusterOutage`` keeps one cluster's state
for the whole process (every client built by ``infra.clients`` reports to it through its
``error_cb``, see ``clients.client_config``): when a client has lost every broker, a
probe of its own (one metadata request a second, only while in doubt) confirms it, and the
outage is logged once at WARNING, naming the bootstrap servers; when the probe is answered
again, once at INFO with its duration. The attempts themselves are DEBUG records.

``OutageWatch`` is the one rule for riding through outages up to a limit (worker, gateway,
the trainer's ``BatchConsumer``): a probe every few seconds, even when no client is busy,
reports to the same ``ClusterOutage``, and past ``limit`` seconds the component gives up
(a service exits non-zero with one line, a trainer's fetch raises ``KafkaUnreachable``).

A cluster no client of this process has reached yet is not in an outage: it may be a wrong
address, which ``infra.first_contact`` tells in one line; meanwhile the outage line is held
back (``ClusterOutage.contacting``), so that error is the only line.

The probes are readers of their own (``client_roles``), not ``clients.reader``: a probe's failed
attempts are the outage it looks at, so it must not report them to it.

A probe still running when the process exits is stopped and closed first (``_stop_probes``, at exit): a
librdkafka client left mid-handshake while the interpreter and OpenSSL were torn down crashed a CLI that had
already said why it failed (``trajbus topics`` against a broker whose certificate it could not verify, exit
-11 instead of 2, once under a loaded test run).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException

from trajbus.infra.client_roles import connection_config, reader_settings

log = logging.getLogger(__name__)

PROBE_TIMEOUT = 3.0
"""One probe's wait for metadata: long enough that a slow but healthy broker is not called down."""

EXIT_JOIN_SECONDS = 5.0
"""How long the process's exit waits for each probe to stop (one metadata request slice, then its close)."""

_exiting = threading.Event()
"""Set at exit: no probe starts, and a running one stops."""

PROBE_INTERVAL = 1.0
"""Between probes while a cluster is down: how late "outage ended" may come."""

QUIET = 30.0
"""Probing stops once no client reported a failure for this long (they were all closed, or none polls):
the outage stays open, without a line, until a client reports again."""

OUTAGE_LIMIT = 120.0
"""Seconds a component rides through an outage before it gives up, unless told otherwise
(``--broker-outage-limit``, ``BatchConsumer(outage_limit=)``): a broker's restart or a leader election
with room, while a cluster that stays away is still told within minutes."""


class KafkaUnreachable(RuntimeError):
    """Kafka did not answer for longer than a client or component waits: its outage limit (it exits for a
    supervisor), or a first contact's ``CONNECT_TIMEOUT`` (``first_contact.ClusterNotReached``)."""


class Probe(Protocol):
    def check(self) -> str | None:
        """None when the cluster answered; else why not."""

    def close(self) -> None: ...


def _probe_reader(servers: str, settings: dict[str, Any]) -> Consumer:
    """A probe's own reader, its ``error_cb`` in ``settings``: its failed attempts are the outage it looks
    at, so they are not reported to that outage (``clients.reader`` builds every other reader)."""
    return Consumer(connection_config(servers, reader_settings(settings)))


class MetadataProbe:
    """A metadata request on a reader of its own, quiet (its attempts are the outage, already told).
    A fresh reader that loses every broker says so at once (a refused connection): that is an answer
    too, without waiting out the timeout."""

    def __init__(self, servers: str) -> None:
        self._lost = threading.Event()
        self._reader = _probe_reader(servers, {"logger": log, "log_level": 0, "error_cb": self._error,
                                        "reconnect.backoff.max.ms": int(PROBE_INTERVAL * 1000)})

    def _error(self, error: Any) -> None:
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._lost.set()

    def check(self) -> str | None:
        deadline = time.monotonic() + PROBE_TIMEOUT
        while True:
            try:
                self._reader.list_topics(timeout=0.25)
                return None
            except KafkaException as exc:
                self._reader.poll(0)  # serves the error callback
                if self._lost.is_set() or time.monotonic() > deadline or _exiting.is_set():
                    self._lost.clear()
                    return str(exc)

    def close(self) -> None:
        self._reader.close()


def _ignore(_error: Any) -> None:
    """A probe's own errors: the outage it looks at, told once by ``ClusterOutage``."""


class ClusterOutage:
    """One cluster's reachability for every client of this process, and the two lines of an outage."""

    def __init__(self, servers: str, probe: Callable[[str], Probe] = MetadataProbe,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.servers = servers
        self.down_since: float | None = None
        """Wall-clock time the current outage began (None: no outage known)."""
        self.reason: str | None = None
        """The last failed attempt's words a client reported (the outage line gives them)."""
        self.answered = False
        """Whether a client of this process had an answer from the cluster (a first contact, a probe)."""
        self._began: float | None = None
        self._told = False
        """Whether the current outage's first line was logged (not when a first contact tells it)."""
        self._first_contacts = 0
        self._last_failure = float("-inf")
        self._probe, self._clock = probe, clock
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None

    def all_brokers_down(self) -> None:
        """A client lost every broker: a probe tells a real outage from a client's late report of an old one."""
        self._reported(None, start=True)

    def failure(self, reason: str) -> None:
        """A client's connection attempt failed (every attempt lands here): the reason the outage line gives."""
        self._reported(reason, start=self._began is not None)

    def _reported(self, reason: str | None, start: bool) -> None:
        with self._lock:
            self._last_failure = self._clock()
            if reason:
                self.reason = reason
            if start and not _exiting.is_set() and (self._watcher is None or not self._watcher.is_alive()):
                self._watcher = threading.Thread(target=self._watch, name="kafka-outage-probe", daemon=True)
                self._watcher.start()

    def failed(self, reason: str | None = None) -> None:
        """The cluster is confirmed unreachable: the outage's first line, once (a DEBUG record while a
        first contact with a cluster never answered is under way: its error tells it)."""
        with self._lock:
            if self._began is not None:
                return
            self._began, self.down_since = self._clock(), time.time()
            reason = reason or self.reason or "no broker answered"
            self._told = self.answered or not self._first_contacts
        if not self._told:
            log.debug("no broker of %s answers a first contact yet (%s)", self.servers, reason)
            return
        log.warning("Kafka outage began: no broker of %s answers (%s); clients keep retrying, each attempt "
                    "logged at DEBUG", self.servers, reason)

    def reached(self) -> None:
        """The cluster answered: the outage's last line, once (none for an outage that had no first line)."""
        with self._lock:
            began, told = self._began, self._told
            self._began, self.down_since, self.answered = None, None, True
        if began is not None and told:
            log.info("Kafka outage ended: %s answers again after %.1fs", self.servers, self._clock() - began)

    @contextlib.contextmanager
    def contacting(self) -> Iterator[None]:
        """A first contact under way: an outage confirmed meanwhile, of a cluster never answered, is its
        to tell (``failed`` logs it at DEBUG)."""
        with self._lock:
            self._first_contacts += 1
        try:
            yield
        finally:
            with self._lock:
                self._first_contacts -= 1

    def join_probe(self, timeout: float) -> None:
        """Wait for this cluster's probe to end (at exit, once it was told to stop)."""
        with self._lock:
            watcher = self._watcher
        if watcher is not None:
            watcher.join(timeout)

    def not_reached(self) -> None:
        """A first contact failed and raised its error: the cluster is down from now on, already told."""
        with self._lock:
            if self._began is None:
                self._began, self.down_since, self._told = self._clock(), time.time(), False

    def _watch(self) -> None:
        """Probe until the cluster answers, or until no client has reported a failure for ``QUIET`` s.
        A probe that cannot be built or asked must not take a client down: it ends the watch (DEBUG)."""
        try:
            probe = self._probe(self.servers)
        except Exception:
            log.debug("kafka outage probe of %s not built", self.servers, exc_info=True)
            return
        try:
            while True:
                started = self._clock()
                why = probe.check()
                if _exiting.is_set():  # the process is ending: no line about what it no longer waits for
                    return
                if why is None:
                    self.reached()
                    return
                self.failed(self.reason or why)
                if self._clock() - self._last_failure > QUIET or \
                        _exiting.wait(max(0.0, PROBE_INTERVAL - (self._clock() - started))):
                    return
        except Exception:
            log.debug("kafka outage probe of %s failed", self.servers, exc_info=True)
        finally:
            probe.close()


_clusters: dict[str, ClusterOutage] = {}
_clusters_lock = threading.Lock()


def cluster_outage(servers: str) -> ClusterOutage:
    """The process's one ``ClusterOutage`` of ``servers`` (the same list in any order is the same cluster)."""
    key = ",".join(sorted(part.strip() for part in servers.split(",") if part.strip()))
    with _clusters_lock:
        if key not in _clusters:
            _clusters[key] = ClusterOutage(servers)
        return _clusters[key]


def _forget_after_fork() -> None:
    """A forked child (a gateway instance) has none of its parent's probe threads: it starts afresh."""
    global _clusters_lock
    _clusters.clear()
    _clusters_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


@atexit.register
def _stop_probes() -> None:
    """Stop and close every probe before the interpreter is torn down (atexit runs while it is whole)."""
    _exiting.set()
    with _clusters_lock:
        clusters = list(_clusters.values())
    for cluster in clusters:
        cluster.join_probe(EXIT_JOIN_SECONDS)


class OutageWatch:
    """The one rule of riding through an outage: the cluster is down from the first unanswered probe (or
    from when ``ClusterOutage`` confirmed it), and past ``limit`` seconds the component gives up.

    A component probes every ``interval`` s from a thread of its own (``start``; past the limit,
    ``on_limit`` once); a client that polls anyway (the trainer's ``BatchConsumer``) asks itself, with
    ``check``, through a probe of its own (``reachable``). The interval is at most a quarter of the
    limit, so a component gives up within ~1.25x its limit."""

    def __init__(self, bootstrap_servers: str, limit: float, on_limit: Callable[[str], None] | None = None,
                 interval: float = 5.0, what: str = "component", setting: str = "--broker-outage-limit",
                 consequence: str | None = "exiting for a supervisor to restart it",
                 reachable: Callable[[float], bool] | None = None) -> None:
        self.limit, self.what, self.setting, self.consequence = limit, what, setting, consequence
        self.interval = min(interval, max(0.5, limit / 4))
        self.down_since: float | None = None
        self._on_limit = on_limit
        self._cluster = cluster_outage(bootstrap_servers)
        self._probe = None
        if reachable is None:
            self._probe = _probe_reader(bootstrap_servers, {"logger": log, "log_level": 0, "error_cb": _ignore})
        self._reachable = reachable or self._answers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kafka-outage-watch", daemon=True)

    def start(self) -> "OutageWatch":
        self._thread.start()
        return self

    def _answers(self, timeout: float) -> bool:
        try:
            self._probe.list_topics(timeout=timeout)
            return True
        except KafkaException:
            return False

    def check(self, timeout: float | None = None) -> str | None:
        """One probe (answered within ``timeout``, default the interval): None while the cluster answers or
        its outage is within the limit; else why the component gives up."""
        asked = time.time()
        if self._reachable(self.interval if timeout is None else timeout):
            self._cluster.reached()
            self.down_since = None
            return None
        self._cluster.failed()
        if self.down_since is None:  # unanswered since the probe was sent, or since a client lost it
            self.down_since = min(asked, self._cluster.down_since or asked)
            log.info("the %s rides through the Kafka outage for up to %gs", self.what, self.limit)
        down = time.time() - self.down_since
        if down <= self.limit:
            return None
        reason = f"Kafka unreachable for {down:.0f}s ({self.setting} {self.limit:g})"
        return f"{reason}; {self.consequence}" if self.consequence else reason

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            reason = self.check()
            if reason is not None:
                if self._on_limit is not None:
                    self._on_limit(reason)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2 * self.interval)
        if self._probe is not None:
            self._probe.close()
