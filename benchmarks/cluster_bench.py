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

Prints a table and the targets (issue 31: at least half of raw on the cluster, each workload, each
call pattern) with their figures, and writes benchmarks/results/cluster.json.
``python -m benchmarks.cluster_bench``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.agentic_bench import RESULTS, run_patterns
from benchmarks.agentic_workloads import MULTI_TURN, SINGLE_TURN
from benchmarks.targets import Target, print_targets
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster
from trajbus.pipelines.tables import print_table

PLAN = [(SINGLE_TURN, 8), (MULTI_TURN, 8)]
FLEET_CALLERS = 256
RAW_SHARE = 0.5
"""Issue 31's target: end to end at least this share of raw produce + consume on the same cluster."""


def on(topology: str, workdir: Path, callers: tuple[int, ...]) -> list[dict]:
    """Every workload of ``PLAN`` on a fresh embedded ``topology`` ("1 node" or "3 nodes") at each pattern."""
    nodes = int(topology.split()[0])
    broker = EmbeddedKafka(state_dir=workdir / "broker") if nodes == 1 else \
        EmbeddedCluster(workdir / "cluster", nodes=nodes)
    state = broker.start(fresh=True)
    print(f"{topology}: {state.bootstrap_servers}", flush=True)
    try:
        return [{"topology": topology, **result} for workload, batch in PLAN
                for result in run_patterns(workload, state.bootstrap_servers, None, workdir, batch,
                                           with_recovery=False, patterns=callers)]
    finally:
        broker.stop()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the cluster (default: %(default)s)")
    parser.add_argument("--callers", type=int, default=16,
                        help="threads submitting one step per call (0: calls of 64 steps from one; default: %(default)s)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-cluster-bench-"))
    cluster = f"{args.nodes} nodes"
    results = on("1 node", workdir, (args.callers,)) + on(cluster, workdir, (args.callers, FLEET_CALLERS))
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
    targets = print_targets([Target(f"{r['workload']} on {cluster}, {r['calls']}: e2e / raw", f">= {RAW_SHARE}x",
                                    f"{r['ratio']:.3f}x", r["ratio"] >= RAW_SHARE)
                             for r in results if r["topology"] == cluster], "Targets (this machine)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster.json").write_text(json.dumps({"results": results, "targets": targets}, indent=2))
    return results


if __name__ == "__main__":
    main()
