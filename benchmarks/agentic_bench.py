"""The data path at agentic sizes (issue 12): end to end against raw Kafka, bytes against the distinct data.

For each workload of ``agentic_workloads`` (single-turn, 12-turn; the long-context one
with ``--long``, as ``make bench`` runs it), on one embedded broker in one run:
- raw: the same encoded steps produced (acknowledged) and consumed back through a plain
  topic of the same partitions: the baseline;
- end to end: ``submit_steps`` (all groups in flight, turn by turn) -> worker (started and
  recovered before the clock starts) -> ``fetch_dataproto`` (verl rows), in steps/s and
  distinct tokens/s, and the ratio, at two call patterns side by side: calls of 64 steps from
  one thread, and the gateway's, one acknowledged step per call from ``--callers`` threads
  (16), each an agent's lane (a fresh topic prefix and worker for each);
- bytes on the broker's disk per topic (steps, groups, the worker's changelog) against the
  bytes of the distinct token ids and log-probs (4 bytes each);
- the worker's peak resident memory;
- recovery (multi-turn): every group pending (all turns but the last sent and applied), the
  worker SIGKILLed, a new one started, the last turns sent: seconds from the new worker's
  start until every group is fetched.

Prints a table and writes benchmarks/results/agentic.json. ``python -m benchmarks.agentic_bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import time
import uuid
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.agentic_workloads import (LONG_CONTEXT, MULTI_TURN, SINGLE_TURN, Workload, distinct_bytes,
                                          distinct_tokens, generate)
from benchmarks.assembly_bench import raw_round_trip
from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.topics import describe_topics
from trajbus.pipelines.processes import worker_process
from trajbus.streams.wire import codec
from trajbus.streams.worker.assembler import STATE_TABLE
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.stats import applied_positions
from trajbus.streams.client.snapshots import read_snapshots
from trajbus.streams.wire.topics import steps_topic
from trajbus.pipelines.tables import print_table as draw_table

RESULTS = Path(__file__).resolve().parent / "results"
FETCH_TIMEOUT = 300.0


def topic_bytes(data_dir: Path, topic: str) -> int:
    """Bytes of a topic's log segments on the broker's disk (every partition; before any compaction)."""
    return sum(f.stat().st_size for d in data_dir.glob(f"{topic}-*") if d.name.rsplit("-", 1)[1].isdigit()
               for f in d.glob("*.log"))


def peak_memory_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def wait_until_running(bootstrap: str, prefix: str, worker) -> None:
    """Until the worker has its partitions and has recovered (its first statistics snapshot): the
    clock then measures the data path, not a worker's start, which the raw baseline does not have."""
    deadline = time.monotonic() + FETCH_TIMEOUT
    while not any(f"-{worker.pid}-" in s["worker_id"] for s in read_snapshots(bootstrap, prefix)):
        if time.monotonic() > deadline or not worker.alive():
            raise RuntimeError(f"the worker did not start: {worker.log_tail()}")
        time.sleep(0.2)  # polls the stats topic until the deadline


def turn_by_turn(groups: list[list[Step]], turns: int) -> list[Step]:
    """All groups in flight at once, as agents send: every group's turn 0, then every group's turn 1, ..."""
    per_turn = [[s for s in group if s.step_index == turn] for turn in range(turns) for group in groups]
    return [s for batch in per_turn for s in batch]


def backend(workload: Workload) -> VerlBackend:
    if workload.multi_turn:  # one row per trajectory: the task, then every turn's response and tool output
        return VerlBackend(prompt_length=workload.task_tokens,
                           response_length=workload.turns * (workload.response_tokens + workload.tool_tokens),
                           row_mode="trajectory")
    return VerlBackend(prompt_length=workload.task_tokens, response_length=workload.response_tokens)


def submit(producer: StepProducer, steps: list[Step], callers: int) -> None:
    """``callers`` 0: calls of 64 steps from one thread. Else the gateway's pattern: one acknowledged step
    per call from ``callers`` threads, each an agent's lane (its trajectories' steps in turn order)."""
    if not callers:
        for first in range(0, len(steps), 64):
            producer.submit_steps(steps[first:first + 64], channel="train")
        return
    with ThreadPoolExecutor(callers) as pool:
        list(pool.map(lambda lane: [producer.submit_steps([steps[i]], channel="train") for i in lane],
                      lanes_of(steps, callers)))


def lanes_of(steps: list[Step], callers: int) -> list[list[int]]:
    """The indexes of ``steps`` each of ``callers`` agents submits, in order: a trajectory stays in one lane."""
    lanes: dict[int, list[int]] = defaultdict(list)
    for index, step in enumerate(steps):
        lanes[zlib.crc32(step.trajectory_uid.encode()) % callers].append(index)
    return list(lanes.values())


def end_to_end(bootstrap: str, prefix: str, workload: Workload, steps: list[Step], batch_groups: int,
               callers: int = 0) -> float:
    """Seconds from the first submit to the last ``fetch_dataproto`` of every group."""
    with StepProducer(bootstrap, prefix=prefix) as producer, \
            BatchConsumer("train", bootstrap, prefix=prefix, backend=backend(workload)) as consumer:
        consumer.fetch_group(timeout=1.0)  # join the group before the clock starts
        consumer.backend.convert(steps[:1], None)  # and import verl (a trainer process does it once)
        start = time.perf_counter()
        submit(producer, steps, callers)
        for _ in range(workload.groups // batch_groups):
            if consumer.fetch_dataproto(batch_groups, timeout=FETCH_TIMEOUT) is None:
                raise RuntimeError(f"{workload.name}: a batch of {batch_groups} groups did not arrive")
        return time.perf_counter() - start


def recovery(bootstrap: str, prefix: str, workload: Workload, workdir: Path) -> float:
    """Seconds from a new worker's start (the old one SIGKILLed with every group pending) to all groups fetched."""
    groups = generate(workload, seed=3, tag="rec-")
    steps = turn_by_turn(groups, workload.turns)
    last_turn = [s for s in steps if s.is_last]
    with StepProducer(bootstrap, prefix=prefix) as producer:
        producer.provision("train")
    worker = worker_process(bootstrap, prefix, workdir / "worker-killed.log", n_rollouts=workload.rollouts,
                            extra=["--stats-interval", "0.5"]).start()
    with StepProducer(bootstrap, prefix=prefix) as producer, \
            BatchConsumer("train", bootstrap, prefix=prefix, group_id=f"{prefix}.recovery") as consumer:
        producer.submit_steps([s for s in steps if not s.is_last], channel="train")
        ends = describe_topics(bootstrap, names=[steps_topic("train", prefix)])[0].end_offsets
        deadline = time.monotonic() + FETCH_TIMEOUT
        while any(applied_positions(read_snapshots(bootstrap, prefix), {worker.pid}).get(("train", p), 0) < end
                  for p, end in enumerate(ends)):
            if time.monotonic() > deadline:
                raise RuntimeError("recovery: the first worker did not apply every pending step")
            time.sleep(0.5)  # polls published positions until the deadline
        os.kill(worker.pid, signal.SIGKILL)
        worker.process.wait()
        successor = worker_process(bootstrap, prefix, workdir / "worker-recovered.log",
                                   n_rollouts=workload.rollouts).start()
        started = time.perf_counter()
        try:
            producer.submit_steps(last_turn, channel="train")
            fetched = set()
            while len(fetched) < workload.groups:
                group = consumer.fetch_group(timeout=FETCH_TIMEOUT)
                if group is None:
                    raise RuntimeError(f"recovery: {len(fetched)} of {workload.groups} groups")
                fetched.add(group.prompt_uid)
            return time.perf_counter() - started
        finally:
            successor.stop()


def run(workload: Workload, bootstrap: str, data_dir: Path | None, workdir: Path, batch_groups: int,
        with_recovery: bool = True, callers: int = 0) -> dict:
    """One workload at one call pattern (``callers``, as ``submit``): raw baseline, end to end, bytes per
    topic, the worker's peak memory (and, for the multi-turn one, recovery unless ``with_recovery`` is False)."""
    return run_patterns(workload, bootstrap, data_dir, workdir, batch_groups, with_recovery, (callers,))[0]


def run_patterns(workload: Workload, bootstrap: str, data_dir: Path | None, workdir: Path, batch_groups: int,
                 with_recovery: bool = True, patterns: tuple[int, ...] = (0,)) -> list[dict]:
    """One workload, one raw baseline, then end to end at each call pattern (``callers`` of ``submit``), each
    under its own topic prefix with its own worker: one result per pattern, its ratio against that baseline.
    Recovery (multi-turn, unless ``with_recovery`` is False) goes with the first pattern."""
    groups = generate(workload, seed=1)
    steps = turn_by_turn(groups, workload.turns)
    print(f"{workload.name}: {workload.describe()} ({len(steps)} steps) ...", flush=True)
    values = [(s.prompt_uid.encode(), codec.encode(s)) for s in steps]
    raw_s = raw_round_trip(bootstrap, values, partitions=8)
    results = []
    for callers in patterns:
        # Kafka's own price of the call pattern: the same records, one acknowledged produce per call
        raw_calls_s = raw_round_trip(bootstrap, values, 8, lanes_of(steps, callers)) if callers else raw_s
        prefix = f"bench-{workload.name}-{uuid.uuid4().hex[:6]}"
        with StepProducer(bootstrap, prefix=prefix) as producer:
            producer.provision("train")
        worker = worker_process(bootstrap, prefix, workdir / f"worker-{workload.name}-{callers}.log",
                                n_rollouts=workload.rollouts, extra=["--stats-interval", "0.5"]).start()
        try:
            wait_until_running(bootstrap, prefix, worker)
            e2e_s = end_to_end(bootstrap, prefix, workload, steps, batch_groups, callers)
            memory = peak_memory_mb(worker.pid)
        finally:
            worker.stop()
        print(f"  {calls(callers)}: {e2e_s:.1f} s end to end, raw {raw_s:.1f} s, raw at the call pattern "
              f"{raw_calls_s:.1f} s", flush=True)
        distinct = distinct_bytes(workload)
        result = {"workload": workload.name, "shape": workload.describe(), "steps": len(steps),
                  "callers": callers, "calls": calls(callers),
                  "raw_steps_per_s": len(steps) / raw_s, "e2e_steps_per_s": len(steps) / e2e_s,
                  "e2e_distinct_tokens_per_s": distinct_tokens(workload) / e2e_s, "ratio": raw_s / e2e_s,
                  "raw_calls_steps_per_s": len(steps) / raw_calls_s, "ratio_at_calls": raw_calls_s / e2e_s,
                  "worker_peak_mb": memory, "distinct_bytes": distinct}
        if data_dir is not None:
            result["bytes"] = {"steps": topic_bytes(data_dir, f"{prefix}.steps.train"),
                               "groups": topic_bytes(data_dir, f"{prefix}.groups.train"),
                               "changelog": topic_bytes(data_dir, f"{prefix}-worker-train-{STATE_TABLE}-changelog")}
        if workload is MULTI_TURN and with_recovery and not results:
            result["recovery_s"] = recovery(bootstrap, f"{prefix}-rec", workload, workdir)
        results.append(result)
    return results


def calls(callers: int) -> str:
    """The call pattern of ``submit``, as the table names it."""
    return f"1 step x {callers} threads" if callers else "64 steps x 1 thread"


def print_table(results: list[dict]) -> None:
    rows = []
    for r in results:
        b = r.get("bytes", {})
        per = (lambda k: f"{b[k] / r['distinct_bytes']:.2f}x") if b else (lambda k: "n/a")
        rows.append([r["workload"], r.get("calls", calls(r.get("callers", 0))), f"{r['raw_steps_per_s']:.0f}",
                     f"{r['e2e_steps_per_s']:.1f}", f"{r['ratio']:.2f}x",
                     f"{r['e2e_distinct_tokens_per_s']:.0f}", per("steps"), per("groups"),
                     f"{b['changelog'] / b['steps']:.2f}x" if b else "n/a", f"{r['worker_peak_mb']:.0f}",
                     f"{r['recovery_s']:.1f}" if "recovery_s" in r else "-"])
    print()
    draw_table(["workload", "calls", "raw steps/s", "e2e steps/s", "ratio", "tokens/s", "steps/dist", "groups/dist",
                 "chlog/steps", "peak MB", "recovery s"], rows)
    print("targets: single_turn ratio >= 0.5x; multi_turn ratio >= 1.0x, steps and groups <= 1.25x distinct, "
          "changelog <= 0.25x steps, recovery <= 15 s")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agentic_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--long", action="store_true", help="also the long-context workload (16 x 40 turns, 62k)")
    parser.add_argument("--callers", type=int, default=16,
                        help="beside calls of 64 steps from one thread, one step per call from this many threads "
                             "(the gateway's pattern; 0: only calls of 64 steps; default: %(default)s)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-agentic-"))
    broker, data_dir = None, None
    bootstrap = os.environ.get("TRAJBUS_BOOTSTRAP_SERVERS")
    if not bootstrap:  # a broker of our own: its disk says what each topic holds
        broker = EmbeddedKafka(state_dir=workdir / "broker")
        bootstrap = broker.start().bootstrap_servers
        data_dir = broker.data_dir
    plan = [(SINGLE_TURN, 8), (MULTI_TURN, 8)] + ([(LONG_CONTEXT, 1)] if args.long else [])
    try:
        patterns = (0, args.callers) if args.callers else (0,)
        results = [r for workload, batch in plan
                   for r in run_patterns(workload, bootstrap, data_dir, workdir, batch, patterns=patterns)]
    finally:
        if broker is not None:
            broker.stop()
    print_table(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "agentic.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
