"""The agentic data path on a replicated cluster against raw Kafka on the same cluster (issue 24).

For one embedded node and for the embedded 3-node cluster (replication 3,
``min.insync.replicas`` 2, every producer ``acks=all`` with idempotence), in one run:
each agentic workload (single-turn, 12-turn) end to end through ``submit_steps`` ->
worker -> ``fetch_dataproto``, at the gateway's call pattern (one acknowledged step per call from
``--callers`` threads, each an agent's lane of trajectories), against raw produce (acknowledged) + consume of the same
encoded steps through a plain topic with the same replication and partitions
(``agentic_bench.run``). The ratio is raw seconds over end-to-end seconds.

Prints a table and writes benchmarks/results/cluster.json. ``python -m benchmarks.cluster_bench``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.agentic_bench import RESULTS, run
from benchmarks.agentic_workloads import MULTI_TURN, SINGLE_TURN
from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.infra.kafka_cluster import EmbeddedCluster
from trajbus.pipelines.tables import print_table

PLAN = [(SINGLE_TURN, 8), (MULTI_TURN, 8)]


def on(topology: str, workdir: Path, callers: int) -> list[dict]:
    """Every workload of ``PLAN`` on a fresh embedded ``topology`` ("1 node" or "3 nodes")."""
    nodes = int(topology.split()[0])
    broker = EmbeddedKafka(state_dir=workdir / "broker") if nodes == 1 else \
        EmbeddedCluster(workdir / "cluster", nodes=nodes)
    state = broker.start(fresh=True)
    print(f"{topology}: {state.bootstrap_servers}", flush=True)
    try:
        return [{"topology": topology, **run(workload, state.bootstrap_servers, None, workdir, batch,
                                             with_recovery=False, callers=callers)} for workload, batch in PLAN]
    finally:
        broker.stop()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the cluster (default: %(default)s)")
    parser.add_argument("--callers", type=int, default=16,
                        help="threads submitting one step per call (0: calls of 64 steps from one; default: %(default)s)")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-cluster-bench-"))
    results = on("1 node", workdir, args.callers) + on(f"{args.nodes} nodes", workdir, args.callers)
    print()
    print_table(["topology", "workload", "raw steps/s", "e2e steps/s", "ratio", "tokens/s", "worker peak MB"],
                [[r["topology"], r["workload"], f"{r['raw_steps_per_s']:.0f}", f"{r['e2e_steps_per_s']:.1f}",
                  f"{r['ratio']:.2f}x", f"{r['e2e_distinct_tokens_per_s']:.0f}", f"{r['worker_peak_mb']:.0f}"]
                 for r in results])
    print(f"end to end: one step per call from {args.callers} threads" if args.callers else
          "end to end: calls of 64 steps from one thread")
    print("raw: the same encoded steps produced (acks=all, idempotent) and consumed through a plain topic of the "
          "same replication; ratio = raw seconds / end-to-end seconds")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
