"""verl's V1 trainer reading rollouts from TransferQueue: trajbus's feeder against verl's own agent-loop writes.

Both paths write the same groups into one TransferQueue (TQ; a local ``ray.init(num_cpus=4)``, 2 storage
units: verl's 8 wait for 9 Ray CPUs): ``--groups`` prompts of ``--rollouts`` trajectories, each one
``--prompt-tokens`` prompt (shared by the group, as GRPO samples it) + ``--response-tokens``, ids random in a
32k vocabulary, with log-probs and a 0/1 reward; ``--in-flight`` prompts written at once.

- direct: verl's ``AgentLoopWorkerTQ`` (``verl.trainer.ppo.v1.agent_loop_tq``): a ``running`` tag, then per
  session (concurrently) ``AgentLoopOutput.as_dict()`` + the prompt's fields, ``session_id``, ``loss_mask``,
  ``input_ids``, ``position_ids`` in one ``async_kv_batch_put``, then the prompt tagged ``finished``;
- trajbus: each trajectory's Step and end through ``StepProducer`` (acknowledged) as the gateway records them
  (``n_rollouts``, the session under ``slime_index``), a ``trajbus worker`` process assembling the groups and
  the manager's ``GroupFeeder`` writing them into TQ in verl's layout. The gateway's own cost is
  gateway_bench's and is left out here.

Measured for each: groups/s into TQ, from the first ``running`` tag to the last prompt ``finished`` (target:
trajbus >= 0.5x direct); the trainer's wait for a ready batch with every group ``finished``: verl's
``ReplayBuffer.sample`` (sync trainer) + ``tq.kv_batch_get`` of what a training step reads, per ``--batch``
prompts, p50/p99 (target: p50 <= 50 ms; the rows read back are checked token for token); for trajbus, the
feeder's lag from the worker emitting a group (``ready_at``) to its prompt ``finished``, p50/p99.

Two groups through each path first, untimed. Uses TRAJBUS_BOOTSTRAP_SERVERS or the running embedded broker,
else a throw-away one. Prints a table, writes benchmarks/results/verl_v1.json. ``python -m
benchmarks.verl_v1_bench`` (smoke test: ``--groups 6 --prompt-tokens 256 --response-tokens 64``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import tempfile
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.assembly_bench import RESULTS
from benchmarks.bench_broker import bench_broker
from benchmarks.targets import Target, print_targets
from trajbus.infra import ray_exit
from trajbus.infra.clients import admin
from trajbus.pipelines.processes import ServiceProcess, worker_process
from trajbus.pipelines.slime.harness import SAMPLE_INDEX
from trajbus.pipelines.tables import print_table
from trajbus.pipelines.verl.feeder import Expected, GroupFeeder
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.prefix import StructuredGroup
from trajbus.streams.wire.records import Step

ROOT = Path(__file__).resolve().parents[1]
VOCAB, PARTITION, CHANNEL, STEP = 32000, "train", "v1bench", 1
FIELDS = ["uid", "input_ids", "position_ids", "responses", "response_mask", "rollout_log_probs", "rm_scores"]
"""What the trainer's step reads back (``trainer_base``: reward, old log-prob and advantage stages)."""
THROUGHPUT_TARGET, WAIT_P50_TARGET_MS = 0.5, 50.0
WARMUP = 2


@dataclass
class Group:
    """One prompt's rollouts as the engine returned them, and the prompt's fields as verl registered it."""

    uid: str
    prompt: dict[str, Any]
    prompt_ids: list[int]
    responses: list[list[int]]
    log_probs: list[list[float]]
    rewards: list[float]


def make_groups(count: int, args: argparse.Namespace, rng: np.random.Generator) -> list[Group]:
    n, length = args.rollouts, args.response_tokens
    return [Group("", {"raw_prompt": [{"role": "user", "content": f"question {i}"}], "data_source": "bench",
                       "reward_model": {"style": "rule", "ground_truth": "42"}, "extra_info": {"index": i},
                       "index": i, "global_steps": STEP},
                  rng.integers(1, VOCAB, args.prompt_tokens).tolist(),
                  [rng.integers(1, VOCAB, length).tolist() for _ in range(n)],
                  [(-5 * rng.random(length)).tolist() for _ in range(n)], rng.integers(0, 2, n).astype(float).tolist())
            for i in range(count)]


def fresh(tq: Any, groups: list[Group]) -> list[Group]:
    """The same rollouts under new uids (verl's uuid4 per prompt drawn: no ``_``, keys split on it), registered
    ``pending`` as the trainer registers a batch before handing it to the agent-loop manager."""
    uids = [str(uuid.uuid4()) for _ in groups]
    tq.kv_batch_put(keys=uids, partition_id=PARTITION,
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": STEP} for _ in uids])
    return [replace(group, uid=uid, prompt={**group.prompt, "uid": uid}) for group, uid in zip(groups, uids)]


async def bounded(groups: list[Group], in_flight: int, write: Callable[[Group], Awaitable[None]]) -> float:
    """``write`` each group, ``in_flight`` at once; the seconds it took."""
    gate, start = asyncio.Semaphore(in_flight), time.perf_counter()

    async def one(group: Group) -> None:
        async with gate:
            await write(group)

    await asyncio.gather(*(one(group) for group in groups))
    return time.perf_counter() - start


# -- direct: verl's AgentLoopWorkerTQ -------------------------------------------------------------
async def direct_session(tq: Any, group: Group, session: int) -> None:
    """``_agent_loop_postprocess`` of one session's output (text only, reward already scored)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
    from verl.utils.model import compute_position_id_with_mask
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    response = group.responses[session]
    output = AgentLoopOutput.model_construct(
        prompt_ids=group.prompt_ids, response_ids=response, response_mask=[1] * len(response),
        response_logprobs=group.log_probs[session], reward_score=group.rewards[session], num_turns=2,
        metrics=AgentLoopMetrics(), extra_fields={"min_global_steps": 0, "max_global_steps": 0,
                                                  "reward_extra_info": {}, "turn_scores": [], "tool_rewards": []})
    field = output.as_dict()
    field.update(group.prompt, session_id=session)
    input_ids = torch.cat([field["prompts"], field["responses"]])
    field.update(loss_mask=field["response_mask"], input_ids=input_ids, multi_modal_inputs={},
                 position_ids=compute_position_id_with_mask(torch.ones_like(input_ids).unsqueeze(0)).squeeze(0))
    prompt_len, response_len = field["prompts"].size(0), field["responses"].size(0)
    tag = {"status": "success", "prompt_len": prompt_len, "response_len": response_len,
           "seq_len": prompt_len + response_len, "global_steps": STEP, "min_global_steps": 0, "max_global_steps": 0}
    await tq.async_kv_batch_put(keys=[f"{group.uid}_{session}_0"], fields=list_of_dict_to_tensordict([field]),
                                tags=[tag], partition_id=PARTITION)


def direct(tq: Any, groups: list[Group], in_flight: int) -> float:
    """verl's ``_run_prompt`` for each group; seconds from the first ``running`` tag to the last ``finished``."""
    async def prompt(group: Group) -> None:
        await tq.async_kv_put(key=group.uid, partition_id=PARTITION, tag={"status": "running"})
        await asyncio.gather(*(direct_session(tq, group, s) for s in range(len(group.responses))))
        await tq.async_kv_put(key=group.uid, partition_id=PARTITION, tag={"status": "finished"})

    return asyncio.run(bounded(groups, in_flight, prompt))


# -- trajbus: producer -> worker -> feeder --------------------------------------------------------
class TimedFeeder(GroupFeeder):
    """The manager's feeder, noting each group's lag (emitted -> ``finished``) and when the last was written."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.lags: list[float] = []
        self.last_written = 0.0

    def _write(self, fetched: list[tuple[StructuredGroup, Expected]]) -> None:
        super()._write(fetched)
        now = time.time()
        self.lags += [now - group.ready_at for group, _ in fetched]
        if fetched:
            self.last_written = time.perf_counter()


async def produce(producer: StepProducer, feeder: GroupFeeder, group: Group) -> None:
    """The manager's hand-off (``running``, ``expect``), then each trajectory as the gateway records it."""
    feeder.tag([group.uid], "running")
    feeder.expect(group.uid, group.uid, group.prompt)
    n = len(group.responses)

    async def trajectory(session: int) -> None:
        uid = f"{group.uid}-{session}"
        step = Step(prompt_ids=group.prompt_ids, response_ids=group.responses[session], trajectory_uid=uid,
                    prompt_uid=group.uid, rollout_log_probs=group.log_probs[session], channel=CHANNEL,
                    n_rollouts=n, metadata={SAMPLE_INDEX: session, "finish_reason": "stop"})
        await producer.submit_steps_async([step], CHANNEL, n)
        await producer.complete_trajectory_async(uid, group.uid, group.rewards[session], CHANNEL, n, steps=[0])

    await asyncio.gather(*(trajectory(s) for s in range(n)))


def through_trajbus(producer: StepProducer, feeder: TimedFeeder, worker: ServiceProcess, groups: list[Group],
                    in_flight: int) -> float:
    """Seconds from the first ``running`` tag to the feeder's last write of these groups."""
    target, feeder.lags = feeder.written + len(groups), []
    start = time.perf_counter()
    asyncio.run(bounded(groups, in_flight, lambda group: produce(producer, feeder, group)))
    deadline = time.monotonic() + 120 + len(groups)
    while feeder.written < target:
        if not worker.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{target - feeder.written} groups never reached TQ; worker:\n{worker.log_tail()}")
        time.sleep(0.002)
    return feeder.last_written - start


# -- the trainer's side ---------------------------------------------------------------------------
def check(data: Any, keys: list[str], by_uid: dict[str, Group]) -> None:
    """Every row read back is its session's prompt + response, its reward on the last token."""
    for i, key in enumerate(keys):
        uid, session, _ = key.split("_")
        group = by_uid[uid]
        if data["uid"][i] != uid or float(data["rm_scores"][i][-1]) != group.rewards[int(session)] or \
                not torch.equal(data["input_ids"][i], torch.tensor(group.prompt_ids + group.responses[int(session)])):
            raise RuntimeError(f"row {key} read back is not the rollout written")


def trainer_waits(tq: Any, groups: list[Group], batch: int) -> list[float]:
    """Every ready group sampled, ``batch`` prompts at a time, read, checked and cleared (as the trainer does
    after its step); each sample + read in seconds."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    buffer = ReplayBuffer(trainer_mode="sync", trainer_config=OmegaConf.create({}), max_off_policy_threshold=8,
                          max_off_policy_strategy="drop", sampler_kwargs=OmegaConf.create({}), refill_fn=None,
                          filter_groups_metric=None, sync_refill_failed_groups=False, train_batch_size=batch,
                          gen_batch_size=batch, max_inflight_gen_batches=1, poll_interval=0.05)  # the sync trainer's
    by_uid, waits = {g.uid: g for g in groups}, []
    for _ in range(len(groups) // batch):
        start = time.perf_counter()
        sampled, _ = buffer.sample(global_steps=STEP, partition_id=PARTITION, batch_size=batch)
        data = tq.kv_batch_get(keys=sampled.keys, partition_id=PARTITION, select_fields=FIELDS)
        waits.append(time.perf_counter() - start)
        if len(sampled.keys) != batch * len(groups[0].responses):
            raise RuntimeError(f"sampled {len(sampled.keys)} rows, not {batch} groups' worth")
        check(data, sampled.keys, by_uid)
        tq.kv_clear(keys=sampled.keys, partition_id=PARTITION)
    left = list((tq.kv_list(PARTITION) or {}).get(PARTITION, {}))
    if left:  # groups short of a batch
        tq.kv_clear(keys=left, partition_id=PARTITION)
    return waits


# -- the run ----------------------------------------------------------------------------------------
def ms(values: list[float], q: float) -> float:
    """The ``q`` quantile of seconds, in ms."""
    return 1e3 * sorted(values)[min(len(values) - 1, round(q * (len(values) - 1)))]


def measure(tq: Any, path: str, data: list[Group], args: argparse.Namespace,
            write: Callable[[list[Group]], float], lags: Callable[[], list[float]] | None = None) -> dict:
    """Warm-up groups through ``write``, then the timed ones; then the trainer samples them."""
    warmup = fresh(tq, data[:WARMUP])
    write(warmup)
    trainer_waits(tq, warmup, 1)
    print(f"{path}: {len(data) - WARMUP} groups, {args.in_flight} in flight", flush=True)
    groups = fresh(tq, data[WARMUP:])
    seconds = write(groups)
    waits, tokens = trainer_waits(tq, groups, args.batch), sum(
        len(g.prompt_ids) * len(g.responses) + sum(map(len, g.responses)) for g in groups)
    result = {"path": path, "groups": len(groups), "seconds": seconds, "groups_per_s": len(groups) / seconds,
              "tokens_per_s": tokens / seconds, "batches": len(waits), "wait_p50_ms": ms(waits, 0.5),
              "wait_p99_ms": ms(waits, 0.99), "wait_max_ms": ms(waits, 1.0)}
    if lags is not None:
        result.update(lag_p50_ms=ms(lags(), 0.5), lag_p99_ms=ms(lags(), 0.99), lag_max_ms=ms(lags(), 1.0))
    print(f"{path}: {result['groups_per_s']:.2f} groups/s, trainer wait p50 {result['wait_p50_ms']:.1f} ms",
          flush=True)
    return result


def run_trajbus(tq: Any, data: list[Group], args: argparse.Namespace, servers: str, workdir: Path) -> dict:
    """The trajbus path, under a fresh topic prefix, dropped at the end."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    with StepProducer(servers, prefix=prefix) as producer:
        producer.provision(CHANNEL)
        worker = worker_process(servers, prefix, workdir / "worker.log", channels=CHANNEL,
                                n_rollouts=args.rollouts).start()
        feeder = TimedFeeder(servers, prefix, CHANNEL, PARTITION, None, tq).start()
        try:  # the warm-up also waits out the worker's start
            result = measure(tq, "trajbus (steps -> worker -> feeder)", data, args,
                             lambda groups: through_trajbus(producer, feeder, worker, groups, args.in_flight),
                             lambda: feeder.lags)
        finally:
            feeder.close()
            worker.stop()
    client = admin(servers)  # held until the deletes answer
    topics = [t for t in client.list_topics(timeout=30).topics if t.startswith(f"{prefix}.")]
    for future in (client.delete_topics(topics, operation_timeout=30).values() if topics else []):
        future.result(60)
    return result


def report(results: list[dict], args: argparse.Namespace) -> dict:
    direct_run, trajbus_run = results
    ratio = trajbus_run["groups_per_s"] / direct_run["groups_per_s"]
    print(f"\nverl V1 TransferQueue: {args.groups} groups of {args.rollouts} x {args.prompt_tokens} + "
          f"{args.response_tokens} tokens, {args.in_flight} in flight; trainer batches of {args.batch} prompts")
    print_table(["path", "groups/s", "ratio", "k tokens/s", "trainer wait p50 ms", "p99 ms", "feeder lag p50 ms",
                 "p99 ms"],
                [[r["path"], f"{r['groups_per_s']:.2f}", f"{r['groups_per_s'] / direct_run['groups_per_s']:.3f}x",
                  f"{r['tokens_per_s'] / 1e3:.0f}", f"{r['wait_p50_ms']:.1f}", f"{r['wait_p99_ms']:.1f}",
                  *([f"{r['lag_p50_ms']:.1f}", f"{r['lag_p99_ms']:.1f}"] if "lag_p50_ms" in r else ["-", "-"])]
                 for r in results])
    targets = print_targets([
        Target("groups/s into TQ, trajbus / direct", f">= {THROUGHPUT_TARGET}x", f"{ratio:.3f}x",
               ratio >= THROUGHPUT_TARGET),
        Target("trainer wait p50, trajbus's groups ready", f"<= {WAIT_P50_TARGET_MS:g} ms",
               f"{trajbus_run['wait_p50_ms']:.1f} ms", trajbus_run["wait_p50_ms"] <= WAIT_P50_TARGET_MS)],
        "verl V1: trajbus's feeder against verl's own agent-loop writes")
    return {"arguments": vars(args), "runs": results, "throughput_ratio": ratio, "targets": targets}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verl_v1_bench", description=__doc__.split("\n")[0])
    for flag, default, what in [("--groups", 128, "prompt groups per path"), ("--rollouts", 8, "trajectories a group"),
                                ("--prompt-tokens", 4096, "tokens of a group's prompt"),
                                ("--response-tokens", 1024, "tokens of each response"),
                                ("--batch", 4, "prompts per trainer sample"),
                                ("--in-flight", 8, "prompts written at once (verl's concurrent agent loops)")]:
        parser.add_argument(flag, type=int, default=default, help=f"{what} (default: %(default)s)")
    args = parser.parse_args(argv)
    print(f"making {args.groups + WARMUP} groups", flush=True)
    data = make_groups(args.groups + WARMUP, args, np.random.default_rng(0))
    with tempfile.TemporaryDirectory(prefix="trajbus-verl-v1-") as workdir, bench_broker(Path(workdir)) as servers:
        ray_exit.connect(num_cpus=4, include_dashboard=False, log_to_driver=False,
                         runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        import ray
        import transfer_queue as tq

        logging.getLogger("transfer_queue.utils.common").setLevel(logging.ERROR)  # a line a put on < 8 cores
        try:
            tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}}))
            results = [measure(tq, "direct (verl agent loop)", data, args,
                               lambda groups: direct(tq, groups, args.in_flight)),
                       run_trajbus(tq, data, args, servers, Path(workdir))]
        finally:
            tq.close()
            ray.shutdown()
    result = report(results, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verl_v1.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
    ray_exit.exit_process(0)  # Ray's threads can crash a normal interpreter exit (infra.ray_exit)
