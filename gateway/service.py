"""The gateway's parts, composed and owned: what the routes are given.

The HTTP server starts answering before anything is ready; the tokenizer loads
and Kafka connects in background threads, and ``/ready`` reports what is still
missing. Each part has one concern: ``KafkaLink`` (records), ``ServedVersion`` (the
policy version the engines serve),
``Pacing`` (admission of new trajectories), ``TrajectoryLifecycle`` (the rules of
a trajectory's life), ``StateSweeper`` (bounded state), ``BackendPool`` (engines),
``UpdateGate`` (weight updates: pause, cut, resume), ``EngineCalls`` (every engine call, over the pool and
the gate), ``ChatCompletions`` (chat completions and Anthropic's messages). No part imports this module: each
is handed the parts it uses.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any, Callable

from trajbus.gateway.admission.pacing import Pacing
from trajbus.gateway.broker.kafka_link import KafkaLink
from trajbus.gateway.chat.completions import ChatCompletions
from trajbus.gateway.config import EXIT_USAGE, GatewaySettings
from trajbus.gateway.engine.calls import EngineCalls
from trajbus.gateway.engine.pool import BackendPool
from trajbus.gateway.engine.updates import UpdateGate
from trajbus.gateway.errors import unavailable
from trajbus.gateway.http.quiet import QuietUpkeep
from trajbus.gateway.metrics import GatewayMetrics
from trajbus.gateway.prompts.tokenizer import ChatTokenizer
from trajbus.gateway.rewards import RewardScorer
from trajbus.gateway.state.lifecycle import TrajectoryLifecycle
from trajbus.gateway.state.served_version import ServedVersion
from trajbus.gateway.state.sweeper import StateSweeper
from trajbus.gateway.state.trajectories import TrajectoryStore
from trajbus.infra import tracing
from trajbus.infra.collector import CollectionPacer
from trajbus.streams.wire.topics import traces_topic

log = logging.getLogger("trajbus.gateway")

DRAINING = "draining: the gateway is shutting down (SIGTERM) and takes no new calls"


class GatewayService:
    """Owns every part of one gateway instance; starts and closes them in order."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.metrics = GatewayMetrics(settings.instance, settings.base_address)
        self.tokenizer = ChatTokenizer(settings.tokenizer_path, settings.multi_turn,
                                       without_torch=settings.reward_function is None,  # its code may need torch
                                       on_failure=lambda reason: self._give_up(reason, EXIT_USAGE))
        self.backends = BackendPool(settings.vllm_addresses, settings.backend_timeout, settings.health_interval,
                                    read_interval=settings.engine_read_interval,
                                    connections_per_engine=settings.engine_connections)
        self.store = TrajectoryStore(settings.state_dir, settings.cached_trajectories)
        self.rewards = RewardScorer(settings.reward_function, settings.reward_worker_name,
                                    settings.ray_address, settings.ray_namespace)
        self.kafka = KafkaLink(settings, self.metrics, on_connected=self._kafka_connected, give_up=self._give_up)
        self.served = ServedVersion(settings.prefix, settings.default_channel)
        self.pacing = Pacing(settings, self.metrics, self.served.serving, self.served.trainer)
        self.updates = UpdateGate(settings.max_pause, self.metrics, self.served)
        self.lifecycle = TrajectoryLifecycle(settings.default_channel, self.store, self.kafka, self.pacing,
                                             self.rewards, self.metrics, self.served)
        self.sweeper = StateSweeper(settings, self.store, self.metrics)
        self.engine = EngineCalls(settings, self.backends, self.updates, self.metrics,
                                  stop_ids=lambda: self.tokenizer.stop_ids)
        self.chat = ChatCompletions(settings, self.require, self.tokenizer, self.engine, self.kafka, self.lifecycle,
                                    self.metrics)
        self.upkeep = QuietUpkeep(self.metrics.heap_releases,
                                  pacer=CollectionPacer(full_seconds=settings.full_collection_every))
        """Paces the collector while calls are in flight; collects fully and gives the free heap back to the OS
        when none is (told so by ``middleware.CallLimit``)."""
        self.stop_serving: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGTERM)
        """Ends the HTTP server gracefully (``gateway.server`` sets it to uvicorn's own exit flag)."""
        self.fatal: str | None = None
        """Why the gateway ended itself (Kafka unreachable past the limit, a tokenizer that did not load): it then
        exits ``fatal_status``."""
        self.fatal_status = 1
        """1 for an outage (a supervisor restarts it), ``EXIT_USAGE`` for settings that cannot work (a restart would
        not help: ``gateway.fleet`` stops)."""
        self.started_at = time.time()
        self.draining_since: float | None = None
        """When SIGTERM began the drain (``time.monotonic()``); None while serving (see ``drain``)."""
        self.tracing: tracing.Tracing | None = None
        """This process's tracing (``--tracing``), configured once Kafka's address is known."""

    async def start(self) -> None:
        self.pacing.start(self.store.unfinished())  # admitted before a restart
        self.sweeper.start()
        self.tokenizer.load_in_background()
        self.kafka.start()
        self.backends.start()
        log.info("gateway listening instance=%s url=%s backends=%s state=%s", self.settings.instance,
                 self.settings.base_address, ",".join(self.settings.vllm_addresses), self.store.path)

    def _kafka_connected(self, servers: str) -> None:
        if self.tracing is None:  # before the first call can be served
            self.tracing = tracing.configure("trajbus-gateway", self.settings.tracing, servers,
                                             traces_topic(self.settings.prefix))
        self.served.watch(servers)
        self.pacing.watch(servers)

    def _give_up(self, reason: str, status: int = 1) -> None:
        """Kafka stayed away past ``--broker-outage-limit``, or the tokenizer did not load: stop serving
        (graceful: what started is closed), exit ``status``; called on the failing part's thread."""
        if self.fatal is None:
            self.fatal, self.fatal_status = reason, status
        log.error("%s", reason)
        self.stop_serving()  # graceful shutdown; serve() then exits fatal_status with the reason

    async def close(self) -> None:
        self.upkeep.close()
        await self.sweeper.close()
        await asyncio.to_thread(self.pacing.close)
        await self.backends.close()
        self.tokenizer.close()  # no call is left to encode
        await asyncio.to_thread(self.kafka.close)
        await asyncio.to_thread(self.served.close)
        if self.tracing is not None:  # the last calls' spans out
            await asyncio.to_thread(self.tracing.shutdown)
        self.store.close()
        log.info("gateway stopped: producer flushed, trajectory state closed")

    def drain(self) -> None:
        """Begin the drain of a shutdown (``gateway.server`` on SIGTERM): ``/ready`` answers 503 at once and new
        calls 503 with Retry-After (``middleware.Drain``), so a load balancer stops sending before the server
        stops listening. Only sets a flag: it runs in a signal handler."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def readiness(self) -> list[str]:
        """What is not ready yet; empty when the gateway can serve every endpoint."""
        missing = [DRAINING] if self.draining else []
        if not self.tokenizer.ready:
            missing.append(self.tokenizer.missing)
        kafka = self.kafka.missing()
        if kafka:
            missing.append(kafka)
        if not self.backends.ready:
            missing.append(self._no_backend())
        return missing

    def _no_backend(self) -> str:
        return (f"no inference backend answers: none of {', '.join(self.backends.backends)} (--vllm-addresses) "
                "passes its health check or answers its calls")

    def require(self, *parts: str) -> None:
        """503 unless the named parts (tokenizer, kafka, backend) are ready."""
        if "tokenizer" in parts and not self.tokenizer.ready:
            raise unavailable(self.tokenizer.missing)
        if "kafka" in parts:
            self.kafka.require()
        if "backend" in parts and not self.backends.ready:
            raise unavailable(self._no_backend(), code="no_backend")

    def statistics(self) -> dict[str, Any]:
        def total(counter) -> dict[str, float]:
            return {"/".join(s.labels.values()) or "all": s.value
                    for metric in counter.collect() for s in metric.samples if s.name.endswith("_total")}

        return {"instance": self.settings.instance, "base_url": self.settings.base_address, "pid": os.getpid(),
                "uptime_seconds": round(time.time() - self.started_at, 1),
                "ready": not self.readiness(), "not_ready": self.readiness(),
                "trajectories": self.store.counts(), "state_bytes": self.store.bytes_in_use(),
                "policy_versions": self.served.versions(),
                "steps_published": total(self.metrics.steps),
                "tokens": total(self.metrics.tokens),
                "prompts": total(self.metrics.prompts),
                "requests": total(self.metrics.requests),
                "admissions": total(self.metrics.admissions),
                "generations": total(self.metrics.generations),
                "update": self.updates.state(),
                "backends": self.backends.describe(),
                "admission": self.pacing.state()}
