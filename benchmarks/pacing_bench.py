"""The demo with and without pacing: what was generated, what the trainer used, how long it waited.

Both runs are ``make demo``'s job (the same config, the same broker, one after the
other) except for the gateway's admission limits: the baseline generates freely
and the worker's queue bound drops what the trainer cannot take; the paced run
holds new trajectories back while the trainer's backlog is at its mark. Prints a
table and writes benchmarks/results/pacing.json.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

from trajbus.infra.kafka_broker import EmbeddedKafka
from trajbus.pipelines.demo import DemoOutcome, run_demo
from trajbus.pipelines.demo_config import load_demo_config
from trajbus.pipelines.tables import print_table

RESULTS = Path(__file__).resolve().parent / "results"


def measure(paced: bool, bootstrap_servers: str, report_dir: Path) -> dict:
    config = load_demo_config()
    if not paced:
        config.gateway.update(max_backlog_groups=None, max_staleness=None)
    config.report = report_dir / ("paced.png" if paced else "unpaced.png")
    outcome = DemoOutcome()
    if run_demo(config, bootstrap_servers, outcome) != 0:
        raise RuntimeError("the demo failed")
    trained = sum(r.groups for r in outcome.records)
    return {"pacing": paced, "max_backlog_groups": config.gateway["max_backlog_groups"],
            "max_queue_size": config.worker["max_queue_size"], "groups_trained": trained,
            "rows_trained": sum(r.rows for r in outcome.records), "episodes_generated": outcome.episodes,
            "dropped": outcome.drops, "refusals_429": outcome.refusals, "held": outcome.held,
            "trainer_wait_s": sum(r.wait_seconds for r in outcome.records),
            "trainer_step_s": sum(r.seconds for r in outcome.records), "wall_s": outcome.seconds,
            "versions": [dataclasses.asdict(r) for r in outcome.records]}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="trajbus-pacing-") as workdir:
        broker = EmbeddedKafka(state_dir=Path(workdir) / "broker")
        try:
            servers = broker.start().bootstrap_servers
            runs = [measure(False, servers, Path(workdir)), measure(True, servers, Path(workdir))]
        finally:
            broker.stop()
    print("\npacing: the demo without and with admission control (same config, same broker)")
    rows = []
    for run in runs:
        used = run["rows_trained"] / run["episodes_generated"] if run["episodes_generated"] else 0.0
        steps = len(run["versions"]) or 1
        rows.append(["paced" if run["pacing"] else "unpaced", run["episodes_generated"], run["rows_trained"],
                     f"{used:.0%}", f"{run['dropped'].get('queue_full', 0):.0f}", f"{run['dropped'].get('stale', 0):.0f}",
                     run["held"], run["refusals_429"], f"{run['trainer_wait_s']:.1f}",
                     f"{run['trainer_wait_s'] / steps:.1f}", f"{run['wall_s']:.1f}"])
    print_table(["run", "episodes", "rows trained", "used", "queue_full", "stale", "held", "429s", "trainer wait s",
                 "wait/step", "wall s"], rows)
    paced, unpaced = runs[1], runs[0]
    ratio = paced["trainer_wait_s"] / unpaced["trainer_wait_s"] if unpaced["trainer_wait_s"] else float("nan")
    print(f"trainer wait, paced / unpaced: {ratio:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pacing.json").write_text(json.dumps({"runs": runs, "wait_ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
