"""``trajbus demo``: the first path end to end, on a real broker.

Brings up a throw-away embedded Kafka broker (or uses ``--bootstrap-servers``),
starts the stream worker, submits prompt groups of synthetic agent steps with
their trajectories interleaved, fetches the ready groups as a trainer would,
prints what flowed, and tears everything down, also on Ctrl-C.
"""

from __future__ import annotations

import tempfile
import time
import uuid
from pathlib import Path

from consumers import BatchConsumer
from infra.kafka_broker import EmbeddedKafka
from pipelines.processes import worker_process
from pipelines.synthetic import make_groups
from streams.producer import StepProducer


def run_demo(bootstrap_servers: str | None = None, n_groups: int = 8, n_rollouts: int = 4,
             steps_per_trajectory: int = 3, timeout: float = 120.0) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="trajbus-demo-"))
    broker = None
    worker = None
    try:
        if bootstrap_servers is None:
            broker = EmbeddedKafka(state_dir=workdir / "broker")
            print(f"[1/5] starting Apache Kafka {broker.version} (KRaft, single node) ...", flush=True)
            bootstrap_servers = broker.start().bootstrap_servers
        print(f"[1/5] broker at {bootstrap_servers}", flush=True)
        prefix = f"demo-{uuid.uuid4().hex[:6]}"
        with StepProducer(bootstrap_servers, prefix=prefix) as producer:
            producer.provision("train")  # before the worker subscribes
            print(f"[2/5] topics provisioned under prefix {prefix}; starting the stream worker", flush=True)
            worker = worker_process(bootstrap_servers, prefix, workdir / "worker.log", n_rollouts=n_rollouts).start()
            _, steps = make_groups(n_groups, n_rollouts, steps_per_trajectory, seed=0, tag=f"{prefix}-p")
            started = time.monotonic()
            acked = producer.submit_steps(steps, channel="train")
            print(f"[3/5] {acked} steps acknowledged by the broker "
                  f"({n_groups} groups x {n_rollouts} trajectories x {steps_per_trajectory} steps, interleaved)",
                  flush=True)

        print("[4/5] fetching ready groups as the trainer ...", flush=True)
        received = []
        with BatchConsumer("train", bootstrap_servers, prefix=prefix) as consumer:
            deadline = time.monotonic() + timeout
            while len(received) < n_groups and time.monotonic() < deadline:
                if not worker.alive():
                    raise RuntimeError(f"the stream worker exited:\n{worker.log_tail()}")
                group = consumer.fetch_group(timeout=1.0)
                if group is not None:
                    received.append((group, time.monotonic() - started))
            consumer.commit()

        print(f"\n{'prompt_uid':<24} {'traj':>4} {'steps':>5} {'tokens':>7} {'rewards':<12} {'ready after submit':>18}")
        for group, elapsed in received:
            tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in group.steps)
            rewards = "".join(str(int(s.reward)) for s in group.steps if s.is_last)
            print(f"{group.prompt_uid:<24} {len(group.trajectory_uids):>4} {len(group.steps):>5} "
                  f"{tokens:>7} {rewards:<12} {elapsed:>17.2f}s")
        ok = len(received) == n_groups
        print(f"\n[5/5] received {len(received)} of {n_groups} groups "
              f"({sum(len(g.steps) for g, _ in received)} steps) -> {'OK' if ok else 'INCOMPLETE'}")
        if not ok and worker is not None:
            print(worker.log_tail())
        return 0 if ok else 1
    except KeyboardInterrupt:
        print("\ninterrupted; tearing down")
        return 130
    finally:
        if worker is not None:
            worker.stop()
        if broker is not None:
            broker.stop()
            print("torn down: worker and broker stopped")
