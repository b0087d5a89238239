"""verl's ``MessageQueue`` on Kafka: the same methods, signatures and returns, and nothing is lost.

What differs from verl's in-memory queue, on purpose:
- it never drops: ``put_sample`` returns True once the broker acknowledged the sample, however
  many wait (``max_queue_size`` is reported, not enforced; the rollouter already pauses on
  ``get_queue_size``, which is what was put and not yet handed out, measured on Kafka);
- its read position is kept with the trainer's checkpoints (``checkpoints``): after a crash of the
  trainer, the rollouter or both, the resumed trainer gets every sample put after its checkpoint,
  once;
- ``clear_queue`` skips what waits now for this run only; a resume still reads it;
- ``get_memory_usage`` reports 0 bytes: the samples are on the broker, not in this process.
Validation batches (``put_validate`` / ``get_validate``) stay in memory, as in verl: a resumed
trainer validates afresh.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Protocol

from trajbus.consumers.verl.checkpoints import CheckpointPositions, Position, VersionClock, resume_version
from trajbus.consumers.verl.sample_log import END, MAX_SAMPLE_BYTES, SampleLog
from trajbus.consumers.verl.settings import VerlQueueSettings
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.topics import TopicSpec, ensure_topics

log = logging.getLogger(__name__)

POLL_SECONDS = 0.1
"""How long one read waits before the queue looks at ``shutdown`` again."""


class SampleSource(Protocol):
    """Where handed-out samples come from. Its calls block; the queue makes them from a thread."""

    def take(self, timeout: float) -> Any:
        """The next sample (``END`` for the end-of-stream sentinel), or None if none came in time."""

    def backlog(self) -> int:
        """Samples waiting, measured on Kafka."""

    def where(self) -> Any:
        """The read position, as JSON."""

    def resume(self, where: Any) -> None: ...

    def from_start(self) -> None:
        """Where a run of the experiment with no checkpoint yet begins."""

    def begin_fresh(self) -> None:
        """Where a run that ignores checkpoints (``resume_mode: disable``) begins."""

    def end(self) -> Any:
        """The position at the log end now."""

    def skip_to(self, end: Any) -> None: ...

    def version_ended(self, version: int) -> None:
        """The trainer took the last sample of policy version ``version - 1``."""

    def close(self) -> None: ...


def topic_specs(topic: str) -> list[TopicSpec]:
    """The samples topic (kept a week, records up to ``MAX_SAMPLE_BYTES``) and its checkpoint positions."""
    return [TopicSpec(topic, 1, {"max.message.bytes": str(MAX_SAMPLE_BYTES), "retention.ms": str(7 * 86400 * 1000)}),
            TopicSpec(f"{topic}.positions", 1, {"cleanup.policy": "compact"})]


class DurableMessageQueue:
    """verl's ``MessageQueue`` (``config``, ``max_queue_size``), its samples on Kafka (module docstring)."""

    def __init__(self, config: Any, max_queue_size: int = 1000) -> None:
        if max_queue_size is None:
            raise ValueError(f"max_queue_size cannot be None, got: {max_queue_size}")
        self.config = config
        self.max_queue_size = int(max_queue_size)
        settings = VerlQueueSettings.from_env()
        bootstrap = resolve_bootstrap_servers()
        topic = settings.samples_topic(config)
        ensure_topics(bootstrap, topic_specs(topic))
        self.samples = SampleLog(bootstrap, topic)
        self.sources: dict[str, SampleSource] = {"samples": self.samples}
        self._positions: CheckpointPositions | None = None
        try:
            self._positions = CheckpointPositions(bootstrap, f"{topic}.positions")
            if settings.queue == "groups":
                from trajbus.consumers.verl.groups import GroupSamples  # torch and verl's DataProto: only here

                self.sources["groups"] = GroupSamples(bootstrap, settings, config)
            self.version = resume_version(config)
            self._clock = VersionClock.of(config, self.version or 0)
            self._resume()
        except BaseException:
            self.close()
            raise
        self.val_queue: deque = deque()
        self.running = True
        self._reading = asyncio.Lock()
        self._skip: dict[str, Any] | None = None
        self.total_produced = 0
        self.total_consumed = 0
        self.dropped_samples = 0
        log.info("verl MessageQueue on Kafka: topic %s, sources %s, resumed at policy version %s",
                 topic, ", ".join(self.sources), self.version)

    def _resume(self) -> None:
        """Read from the position of the checkpoint the trainer resumes from (module docstring)."""
        recorded = (self._positions.load() if self.version is not None else {}).get(self.version, {})
        if self.version and not recorded:
            log.warning("no queue position recorded for checkpoint global_step_%d (saved with another queue?): "
                        "reading what is put from now on", self.version)
        for name, source in self.sources.items():
            if name in recorded:
                source.resume(recorded[name])
            elif self.version == 0:
                source.from_start()
            else:
                source.begin_fresh()
        if set(recorded) != set(self.sources):
            self._positions.record(self._clock.version, self._where())

    def _where(self) -> Position:
        return {name: source.where() for name, source in self.sources.items()}

    def _backlog(self) -> int:
        return sum(source.backlog() for source in self.sources.values())

    # -- verl's MessageQueue -------------------------------------------------------------
    async def put_sample(self, sample: Any) -> bool:
        """Acknowledged on Kafka before it returns; always True (nothing is dropped)."""
        await self.samples.append(sample)
        self.total_produced += 1
        if self.total_produced % 100 == 0:
            log.info("verl MessageQueue: produced=%d, consumed=%d", self.total_produced, self.total_consumed)
        return True

    async def get_sample(self) -> Any | None:
        """``(sample, remaining)`` once one is there; ``None`` once shut down with none left."""
        async with self._reading:
            while True:
                for name, source in self._reading_from():
                    if self._skip is not None and name in self._skip:
                        await asyncio.to_thread(source.skip_to, self._skip.pop(name))
                    sample = await asyncio.to_thread(source.take, POLL_SECONDS / len(self.sources))
                    if sample is not None:
                        return await asyncio.to_thread(self._hand_out, sample)
                if not self.running and await asyncio.to_thread(self.samples.backlog) == 0:
                    return None

    def _reading_from(self) -> list[tuple[str, SampleSource]]:
        """Every source; once shut down, verl's own samples only (the rollouter ended them with its
        sentinel), so a shutdown ends while agents still deliver groups."""
        return list(self.sources.items()) if self.running else [("samples", self.samples)]

    def _hand_out(self, sample: Any) -> tuple[Any, int]:
        self.total_consumed += 1
        if sample is END:
            return None, self._backlog()
        ended = self._clock.tick()
        if ended is not None:  # the trainer's checkpoint of this version will resume here
            self._positions.record(ended, self._where())
            for source in self.sources.values():
                source.version_ended(ended)
        return sample, self._backlog()

    async def get_queue_size(self) -> int:
        return await asyncio.to_thread(self._backlog)

    async def get_statistics(self) -> dict[str, Any]:
        return {
            "queue_size": await self.get_queue_size(),
            "total_produced": self.total_produced,
            "total_consumed": self.total_consumed,
            "dropped_samples": self.dropped_samples,
            "max_queue_size": self.max_queue_size,
        }

    async def clear_queue(self) -> None:
        """Skip what waits now (this run only: a resume from a checkpoint still reads it). A ``get_sample``
        waiting meanwhile skips before its next read."""
        ends = {name: await asyncio.to_thread(source.end) for name, source in self.sources.items()}
        if self._reading.locked():
            self._skip = ends
        else:
            async with self._reading:
                for name, source in self.sources.items():
                    await asyncio.to_thread(source.skip_to, ends[name])
        log.info("verl MessageQueue: cleared (skipping to %s)", ends)

    async def shutdown(self) -> None:
        """Wake a waiting ``get_sample``: it hands out what is left, then None."""
        self.running = False
        log.info("verl MessageQueue shutdown")

    async def get_memory_usage(self) -> dict:
        """The samples are on the broker: none is held in this process."""
        return {"queue_samples": await self.get_queue_size(), "estimated_memory_bytes": 0,
                "estimated_memory_mb": 0.0}

    async def put_validate(self, data: Any) -> None:
        self.val_queue.append(data)

    async def get_validate(self) -> Any | None:
        return self.val_queue.popleft() if self.val_queue else None

    def close(self) -> None:
        """Close the Kafka clients (verl never calls it: the actor ends with the job)."""
        for source in self.sources.values():
            source.close()
        if self._positions is not None:
            self._positions.close()
