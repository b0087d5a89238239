"""Ray actors that feed one data-parallel rank each: consume, convert, place on the device.

Each rank reads only its own partitions of the groups topic (``BatchConsumer(rank=,
world_size=)``: partition ``p`` belongs to rank ``p % world_size``): ranks never
overlap, never miss a group, a whole prompt group always lands on one rank (what
GRPO's per-group advantages need), and the broker serves each group once. Where the
topic's partitions are no multiple of the world size, a rank falls back to reading
every group in its own consumer group and keeping those whose ``prompt_uid`` hashes
to it (CRC32 modulo the world size), with a warning. Batches are copied to the rank's
device from pinned host memory without blocking; with no GPU the device is the CPU.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any

from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.batch_consumer import BatchConsumer
from trajbus.streams.wire.topics import DEFAULT_PREFIX, trainer_group_id

log = logging.getLogger(__name__)


def rank_of(prompt_uid: str, world_size: int) -> int:
    """The data-parallel rank that trains a prompt group when ranks share one partition (stable across
    processes)."""
    return zlib.crc32(prompt_uid.encode()) % world_size


def to_device(batch: Any, device: Any) -> Any:
    """``batch`` (a DataProto) with its tensors on ``device``: each staged in pinned host memory and copied
    without blocking, then one wait on the device's stream (``benchmarks/convert_bench.py`` times it). On
    the CPU the batch is returned as it is."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return batch
    for key in list(batch.batch.keys()):
        batch.batch[key] = batch.batch[key].pin_memory().to(device, non_blocking=True)
    torch.cuda.current_stream(device).synchronize()
    return batch


class BatchWorker:
    """One rank's feeder; ``make_batch_workers`` starts them as Ray actors."""

    def __init__(self, rank: int, world_size: int, backend: dict[str, Any], channel: str = "train",
                 bootstrap_servers: str | None = None, prefix: str = DEFAULT_PREFIX, device: str | None = None) -> None:
        import torch

        if not 0 <= rank < world_size:
            raise ValueError(f"rank: {rank} is not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            self.consumer = BatchConsumer(channel, bootstrap_servers, prefix=prefix, backend=VerlBackend(**backend),
                                          rank=rank, world_size=world_size)
        except ValueError as exc:  # partitions no multiple of the world size
            log.warning("%s; rank %d reads every group and keeps its own", exc, rank)
            self.consumer = BatchConsumer(channel, bootstrap_servers, prefix=prefix,
                                          group_id=f"{trainer_group_id(channel, prefix)}.rank{rank}",
                                          backend=VerlBackend(**backend),
                                          keep=lambda prompt_uid: rank_of(prompt_uid, world_size) == rank)

    def next_batch(self, n_groups: int, timeout: float = 60.0, current_version: int | None = None) -> Any | None:
        """This rank's next ``n_groups`` groups as a DataProto on the device, or None on timeout (the
        groups that did arrive start the next batch)."""
        batch = self.consumer.fetch_dataproto(n_groups, timeout, current_version)
        return None if batch is None else self.to_device(batch)

    def to_device(self, batch: Any) -> Any:
        return to_device(batch, self.device)

    def commit(self) -> None:
        self.consumer.commit()

    def state_dict(self) -> dict[str, Any]:
        return self.consumer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumer.load_state_dict(state)

    def close(self) -> None:
        self.consumer.close()


def make_batch_workers(world_size: int, backend: dict[str, Any], **options: Any) -> list[Any]:
    """One ``BatchWorker`` Ray actor per rank, each given a GPU when the cluster has them."""
    import ray

    gpus = 1 if ray.cluster_resources().get("GPU", 0) >= world_size else 0
    actor = ray.remote(num_gpus=gpus, num_cpus=0)(BatchWorker)
    return [actor.remote(rank, world_size, backend, **options) for rank in range(world_size)]
