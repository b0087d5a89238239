"""The agentic data path on a replicated cluster against raw Kafka on the same cluster (issue 24).

For one embedded node and for the embedded 3-node cluster (replication 3,
``min.insync.replicas`` 2, every producer ``acks=all`` with idempotence), in one run:
each agentic workload (single-turn, 12-turn) end to end through ``submit_steps`` ->
worker -> ``fetch_dataproto``, at the gateway's call pattern (one acknowledged step per call from
``--callers`` threads, each an agent's lane of trajectories), against raw produce (acknowledged) + consume of the same
encoded steps through a plain topic with the same replication and partitions
(``agentic_bench.run_patterns``). The ratio is raw seconds over end-to-end seconds. Beside it, Kafka's
own price of the call pattern: the same records produced one acknowledged record per call from the same
threads ("raw per call"), which bounds what any client of that pattern can reach. On the cluster
also at 256 callers, the fleet's pattern (many agents, each waiting for its acknowledged step).

Then the worker tier's curve on the cluster: 1, 2 and 4 workers sharing 16 steps partitions, the
single-turn workload (256 groups) from 256 callers, groups per second end to end for each count.

Prints a table and the targets (issue 46: end to end at least 0.8x raw at the same call pattern on the
cluster, each workload, each call pattern) with their figures, and writes benchmarks/results/cluster.json.
``python -m benchmarks.cluster_bench``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.agentic_bench import FETCH_TIMEOUT, RESULTS, end_to_end, run_patterns, turn_by_turn
from benchmarks.agentic_workloads import MULTI_TURN, SINGLE_TURN, generate
from benchmarks.targets import Target, print_targets
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster
from trajbus.infra.topics import ensure_topics
from trajbus.pipelines.processes import worker_process
from trajbus.pipelines.tables import print_table
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.stats import held_partitions
from trajbus.streams.client.snapshots import read_snapshots

PLAN = [(SINGLE_TURN, 8), (MULTI_TURN, 8)]
FLEET_CALLERS = 256
RAW_SHARE = 0.8
"""Issue 46's target: end to end at least this share of raw at the same call pattern on the same cluster."""
CURVE_WORKERS = (1, 2, 4)
CURVE_PARTITIONS = 16
CURVE_WORKLOAD = dataclasses.replace(SINGLE_TURN, name="single_turn_curve", groups=256)


def on(topology: str, workdir: Path, callers: tuple[int, ...], curve: tuple[int, ...] = ()) -> tuple[list, list]:
    """Every workload of ``PLAN`` on a fresh embedded ``topology`` ("1 node" or "3 nodes") at each pattern,
    then the worker curve for each count of ``curve``."""
    nodes = int(topology.split()[0])
    broker = EmbeddedKafka(state_dir=workdir / "broker") if nodes == 1 else \
        EmbeddedCluster(workdir / "cluster", nodes=nodes)
    state = broker.start(fresh=True)
    print(f"{topology}: {state.bootstrap_servers}", flush=True)
    try:
        results = [{"topology": topology, **result} for workload, batch in PLAN
                   for result in run_patterns(workload, state.bootstrap_servers, None, workdir, batch,
                                              with_recovery=False, patterns=callers)]
        return results, [worker_tier(state.bootstrap_servers, workdir, count) for count in curve]
    finally:
        broker.stop()


def wait_until_all_partitions_held(bootstrap: str, prefix: str, workers: list) -> None:
    """Until every worker is live and the steps partitions are all held: the clock measures the data path."""
    deadline = time.monotonic() + FETCH_TIMEOUT
    pids = {f"-{worker.pid}-" for worker in workers}
    while True:
        held = held_partitions(read_snapshots(bootstrap, prefix))
        mine = {wid: channels for wid, channels in held.items() if any(pid in wid for pid in pids)}
        if len(mine) == len(workers) and \
                sum(len(channels.get("train", [])) for channels in mine.values()) == CURVE_PARTITIONS:
            return
        if time.monotonic() > deadline or not all(worker.alive() for worker in workers):
            raise RuntimeError(f"the workers did not start: {[worker.log_tail() for worker in workers]}")
        time.sleep(0.5)  # polls the stats topic until the deadline


def worker_tier(bootstrap: str, workdir: Path, count: int) -> dict:
    """``count`` workers on ``CURVE_PARTITIONS`` steps partitions: groups per second end to end."""
    workload = CURVE_WORKLOAD
    steps = turn_by_turn(generate(workload, seed=2), workload.turns)
    prefix = f"bench-curve-{count}-{uuid.uuid4().hex[:6]}"
    ensure_topics(bootstrap, TopicSettings(prefix=prefix, steps_partitions=CURVE_PARTITIONS).specs(["train"]))
    workers = [worker_process(bootstrap, prefix, workdir / f"worker-curve-{count}-{i}.log",
                              n_rollouts=workload.rollouts,
                              extra=["--stats-interval", "0.5", "--steps-partitions", str(CURVE_PARTITIONS)]).start()
               for i in range(count)]
    try:
        wait_until_all_partitions_held(bootstrap, prefix, workers)
        seconds = end_to_end(bootstrap, prefix, workload, steps, 8, FLEET_CALLERS)
    finally:
        for worker in workers:
            worker.stop()
    print(f"  {count} worker(s): {workload.groups} groups in {seconds:.1f} s", flush=True)
    return {"workers": count, "groups": workload.groups, "seconds": seconds, "groups_per_s": workload.groups / seconds}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the cluster (default: %(default)s)")
    parser.add_argument("--callers", type=int, default=16,
                        help="threads submitting one step per call (0: calls of 64 steps from one; default: %(default)s)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-cluster-bench-"))
    cluster = f"{args.nodes} nodes"
    results, _ = on("1 node", workdir, (args.callers,))
    on_cluster, curve = on(cluster, workdir, (args.callers, FLEET_CALLERS), CURVE_WORKERS)
    results += on_cluster
    print()
    print_table(["topology", "workload", "calls", "raw steps/s", "raw per call", "e2e steps/s", "ratio",
                 "ratio per call", "tokens/s", "worker peak MB"],
                [[r["topology"], r["workload"], r["calls"], f"{r['raw_steps_per_s']:.0f}",
                  f"{r['raw_calls_steps_per_s']:.0f}", f"{r['e2e_steps_per_s']:.1f}", f"{r['ratio']:.2f}x",
                  f"{r['ratio_at_calls']:.2f}x", f"{r['e2e_distinct_tokens_per_s']:.0f}", f"{r['worker_peak_mb']:.0f}"]
                 for r in results])
    print("end to end: the calls column's pattern (one acknowledged step per call from that many threads)")
    print("raw: the same encoded steps produced (acks=all, idempotent) at once and consumed through a plain topic "
          "of the same replication; ratio = raw seconds / end-to-end seconds")
    print("raw per call: the same records produced one acknowledged record per call from the same threads "
          "(Kafka's price of the call pattern); ratio per call = its seconds / end-to-end seconds")
    print()
    print_table(["workers", "steps partitions", "groups", "seconds", "groups/s", "vs 1 worker"],
                [[c["workers"], CURVE_PARTITIONS, c["groups"], f"{c['seconds']:.1f}", f"{c['groups_per_s']:.1f}",
                  f"{c['groups_per_s'] / curve[0]['groups_per_s']:.2f}x"] for c in curve],
                title=f"The worker tier on {cluster}: {CURVE_WORKLOAD.describe()}, {FLEET_CALLERS} callers")
    print("the JVMs of the cluster, the workers and the callers share this machine's cores: a curve as measured")
    targets = print_targets([Target(f"{r['workload']} on {cluster}, {r['calls']}: e2e / raw at the same pattern",
                                    f">= {RAW_SHARE}x", f"{r['ratio_at_calls']:.3f}x", r["ratio_at_calls"] >= RAW_SHARE)
                             for r in results if r["topology"] == cluster], "Targets (this machine)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster.json").write_text(json.dumps({"results": results, "curve": curve, "targets": targets},
                                                     indent=2))
    return results


if __name__ == "__main__":
    main()
