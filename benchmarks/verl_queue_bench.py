"""verl's fully-async MessageQueue: trajbus's durable queue against verl's in-memory one, both as Ray actors.

Each sample is what verl's rollouter puts: ``ray.cloudpickle.dumps(RolloutSample)`` whose ``full_batch``
is a DataProto of 8 responses of 2,048 prompt + 512 response tokens (prompts, responses, input_ids,
attention_mask, position_ids, response_mask, rollout_log_probs, rm_scores), every token id random in a
32k vocabulary and every sample its own, so lz4 gets no easier bytes than real rollouts give it. Both
queues are the actor verl creates (``MessageQueue.remote(config, max_queue_size)`` on a local
``ray.init(num_cpus=4)``), driven through verl's ``MessageQueueClient`` as verl drives them:

- throughput: a producer with ``--concurrency`` ``put_sample`` calls in flight (the rollouter's
  concurrent samples) while a consumer calls ``get_sample`` in a loop (the trainer), ``--samples``
  samples from the first put to the last get: samples/s, MB/s, trajbus/verl (target >= 0.5x);
- the trainer's wait per ``get_sample`` when samples are ready (all put, acknowledged, before the
  first get): p50 and p99 in ms (target: trajbus p50 <= 5 ms).

Two samples through each queue first, untimed (connections, the reader's first fetch). Uses
TRAJBUS_BOOTSTRAP_SERVERS or the running embedded broker, else a throw-away one. Prints a table and
writes benchmarks/results/verl_queue.json. ``python -m benchmarks.verl_queue_bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch
from omegaconf import DictConfig, OmegaConf
from verl import DataProto
from verl.experimental.fully_async_policy import message_queue
from verl.experimental.fully_async_policy.detach_utils import RolloutSample
from verl.experimental.fully_async_policy.message_queue import MessageQueueClient

from benchmarks.assembly_bench import RESULTS
from benchmarks.bench_broker import bench_broker
from trajbus.consumers.verl.actor import MessageQueue as TrajbusMessageQueue
from trajbus.consumers.verl.settings import VerlQueueSettings
from trajbus.infra.clients import admin
from trajbus.infra.bootstrap import ENV_VAR
from trajbus.pipelines.tables import print_table

PROMPT, RESPONSE, VOCAB, RESPONSES = 2048, 512, 32000, 8
QUEUES = ("verl", "trajbus")
THROUGHPUT_TARGET, P50_TARGET_MS = 0.5, 5.0
WARMUP = 2


def make_sample(index: int, generator: torch.Generator) -> bytes:
    """One rollouter put: the pickled RolloutSample of one prompt's 8 responses, tensors as verl's agent
    loop returns them (full-length rows: no padding zeros to compress)."""
    prompts = torch.randint(1, VOCAB, (RESPONSES, PROMPT), generator=generator)
    responses = torch.randint(1, VOCAB, (RESPONSES, RESPONSE), generator=generator)
    input_ids = torch.cat([prompts, responses], dim=1)
    rm_scores = torch.zeros(RESPONSES, RESPONSE)
    rm_scores[:, -1] = torch.randint(0, 2, (RESPONSES,), generator=generator).float()  # the reward, at the last token
    tensors = {"prompts": prompts, "responses": responses, "input_ids": input_ids,
               "attention_mask": torch.ones_like(input_ids),
               "position_ids": torch.arange(PROMPT + RESPONSE).expand(RESPONSES, -1).contiguous(),
               "response_mask": torch.ones_like(responses),
               "rollout_log_probs": -torch.rand(RESPONSES, RESPONSE, generator=generator) * 5, "rm_scores": rm_scores}
    batch = DataProto.from_dict(tensors, non_tensors={"uid": np.array([f"uid_{index}"] * RESPONSES, dtype=object)})
    sample = RolloutSample(full_batch=batch, sample_id=f"sample_{index}", epoch=0,
                           rollout_status={"param_version": 0, "index": index})
    return ray.cloudpickle.dumps(sample)


def queue_config(workdir: Path) -> DictConfig:
    """The trainer config both queues get; a fresh experiment name makes trajbus's topic a fresh one."""
    return OmegaConf.create({
        "trainer": {"project_name": "bench", "experiment_name": f"verl-queue-{uuid.uuid4().hex[:8]}",
                    "resume_mode": "auto", "default_local_dir": str(workdir / uuid.uuid4().hex[:8])},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 32}},
        "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 4}})


def actor_class(queue: str) -> Any:
    """The Ray actor class: verl's own (kept as ``InMemoryMessageQueue`` when trajbus's plugin swapped
    it in) or trajbus's."""
    if queue == "trajbus":
        return TrajbusMessageQueue
    return getattr(message_queue, "InMemoryMessageQueue", message_queue.MessageQueue)


async def put_all(client: MessageQueueClient, samples: list[bytes], concurrency: int) -> None:
    """The rollouter: ``concurrency`` puts in flight; every one must be accepted (nothing dropped)."""
    gate = asyncio.Semaphore(concurrency)

    async def put(sample: bytes) -> None:
        async with gate:
            if not await client.put_sample(sample):
                raise RuntimeError("a sample was dropped")

    await asyncio.gather(*(put(sample) for sample in samples))


async def get_all(client: MessageQueueClient, count: int) -> tuple[list[bytes], list[float]]:
    """The trainer: ``count`` get_sample calls in a loop, each one's wait in seconds."""
    got, waits = [], []
    for _ in range(count):
        start = time.perf_counter()
        answer = await client.get_sample()
        waits.append(time.perf_counter() - start)
        if answer is None or answer[0] is None:
            raise RuntimeError("the queue ended early")
        got.append(answer[0])
    return got, waits


def check(got: list[bytes], samples: list[bytes]) -> None:
    """Every sample came back whole, once."""
    if Counter(map(hash, got)) != Counter(map(hash, samples)):
        raise RuntimeError("the samples handed out are not the samples put")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(queue: str, samples: list[bytes], warmup: list[bytes], args: argparse.Namespace,
                  workdir: Path) -> dict:
    """Both phases through one fresh actor of ``queue``; the actor is closed and killed at the end."""
    config = queue_config(workdir)
    actor = actor_class(queue).remote(config, max_queue_size=2 * len(samples) + WARMUP)
    client = MessageQueueClient(actor)
    try:
        await put_all(client, warmup, 1)
        check((await get_all(client, len(warmup)))[0], warmup)
        print(f"{queue}: throughput, {len(samples)} samples, {args.concurrency} puts in flight", flush=True)
        start = time.perf_counter()
        _, (got, _) = await asyncio.gather(put_all(client, samples, args.concurrency), get_all(client, len(samples)))
        elapsed = time.perf_counter() - start
        check(got, samples)
        print(f"{queue}: {len(samples) / elapsed:.1f} samples/s; ready gets, {len(samples)} samples put first",
              flush=True)
        put_start = time.perf_counter()
        await put_all(client, samples, args.concurrency)
        put_elapsed = time.perf_counter() - put_start
        got, waits = await get_all(client, len(samples))
        check(got, samples)
        stats = await client.get_statistics()
    finally:
        await client.shutdown()
        if queue == "trajbus":
            await asyncio.wrap_future(actor.close.remote().future())
        ray.kill(actor)
    nbytes = sum(map(len, samples))
    ms = [w * 1e3 for w in waits]
    return {"queue": queue, "samples": len(samples), "sample_mb": nbytes / len(samples) / 1e6,
            "seconds": elapsed, "samples_per_s": len(samples) / elapsed, "mb_per_s": nbytes / elapsed / 1e6,
            "put_only_samples_per_s": len(samples) / put_elapsed, "ready_get_p50_ms": percentile(ms, 0.5),
            "ready_get_p99_ms": percentile(ms, 0.99), "ready_get_max_ms": max(ms), "statistics": stats,
            "topic": VerlQueueSettings.from_env().samples_topic(config) if queue == "trajbus" else None}


def delete_topics(servers: str, topic: str) -> None:
    """Drop the topics this run wrote (hundreds of MB at the default size)."""
    client = admin(servers)  # held until the deletes answer: a dropped client fails them
    for future in client.delete_topics([topic, f"{topic}.positions"], operation_timeout=30).values():
        try:
            future.result(60)
        except Exception as exc:  # noqa: BLE001 - left behind is harmless, but said
            print(f"could not delete a topic of this run: {exc}", flush=True)


def report(results: list[dict], args: argparse.Namespace) -> dict:
    verl, trajbus = results
    ratio = trajbus["samples_per_s"] / verl["samples_per_s"]
    print(f"\nverl MessageQueue as a Ray actor: {args.samples} samples of {trajbus['sample_mb']:.2f} MB "
          f"(8 x {PROMPT} + {RESPONSE} tokens), {args.concurrency} puts in flight")
    print_table(["queue", "samples/s", "MB/s", "ratio", "put-only samples/s", "ready get p50 ms", "p99 ms"],
                [[r["queue"] + (" (baseline)" if r is verl else ""), f"{r['samples_per_s']:.1f}",
                  f"{r['mb_per_s']:.1f}", f"{r['samples_per_s'] / verl['samples_per_s']:.3f}x",
                  f"{r['put_only_samples_per_s']:.1f}", f"{r['ready_get_p50_ms']:.3f}", f"{r['ready_get_p99_ms']:.3f}"]
                 for r in results])
    throughput_met = ratio >= THROUGHPUT_TARGET  # decided on the unrounded figures
    p50_met = trajbus["ready_get_p50_ms"] <= P50_TARGET_MS
    print_table(["target", "trajbus", "met"],
                [[f"throughput trajbus / verl >= {THROUGHPUT_TARGET}x", f"{ratio:.3f}x",
                  "yes" if throughput_met else "NO"],
                 [f"ready get p50 <= {P50_TARGET_MS:g} ms", f"{trajbus['ready_get_p50_ms']:.3f} ms",
                  "yes" if p50_met else "NO"]])
    return {"arguments": vars(args), "runs": results, "throughput_ratio": ratio,
            "targets": {"throughput_ratio_min": THROUGHPUT_TARGET, "throughput_met": throughput_met,
                        "trajbus_p50_ms_max": P50_TARGET_MS, "p50_met": p50_met}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verl_queue_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200, help="samples per phase (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=16,
                        help="put_sample calls in flight, below the actor's max_concurrency 20 (default: %(default)s)")
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    print(f"making {args.samples + WARMUP} samples", flush=True)
    samples = [make_sample(i, generator) for i in range(args.samples + WARMUP)]
    warmup, samples = samples[:WARMUP], samples[WARMUP:]
    with tempfile.TemporaryDirectory(prefix="trajbus-verl-queue-") as workdir, bench_broker(Path(workdir)) as servers:
        os.environ[ENV_VAR] = servers  # the queue actors inherit it
        for name in ("TRAJBUS_VERL_QUEUE", "TRAJBUS_VERL_TOPIC"):  # verl's own queue; a fresh topic per run
            os.environ.pop(name, None)
        ray.init(num_cpus=4, include_dashboard=False)
        try:
            results = [asyncio.run(measure(queue, samples, warmup, args, Path(workdir))) for queue in QUEUES]
        finally:
            ray.shutdown()
        delete_topics(servers, results[1]["topic"])
    result = report(results, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verl_queue.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
