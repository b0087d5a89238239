"""``trajbus demo``: the first path end to end, on a real broker.

Brings up a throw-away embedded Kafka broker (or uses ``--bootstrap-servers``),
starts the stream worker, submits prompt groups of synthetic agent steps with
their trajectories interleaved, fetches the ready groups as a trainer would,
prints what flowed, and tears everything down, also on Ctrl-C.
"""

from __future__ import annotations

import random
import tempfile
import time
import uuid
from pathlib import Path

from consumers import BatchConsumer
from infra.kafka_broker import EmbeddedKafka
from pipelines.processes import worker_process
from streams.producer import StepProducer
from streams.records import Step


def synthetic_groups(n_groups: int, n_rollouts: int, steps_per_trajectory: int, seed: int = 0) -> list[Step]:
    """Steps of ``n_groups`` prompt groups, interleaved across groups and trajectories."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    per_trajectory: list[list[Step]] = []
    for g in range(n_groups):
        prompt_uid = f"demo-{run}-p{g}"
        prompt = [rng.randrange(32000) for _ in range(rng.randint(8, 24))]
        for r in range(n_rollouts):
            trajectory_uid = f"{prompt_uid}-t{r}"
            reward = float(rng.random() < 0.5)
            history = list(prompt)
            steps = []
            for i in range(steps_per_trajectory):
                response = [rng.randrange(32000) for _ in range(rng.randint(4, 16))]
                last = i == steps_per_trajectory - 1
                steps.append(Step(
                    prompt_ids=list(history), response_ids=response, trajectory_uid=trajectory_uid,
                    prompt_uid=prompt_uid, step_index=i, reward=reward if last else 0.0, is_last=last,
                    rollout_log_probs=[-rng.random() for _ in response], metadata={"turn": i},
                ))
                history += response + [rng.randrange(32000) for _ in range(4)]  # tool output between turns
            per_trajectory.append(steps)
    interleaved = []
    while per_trajectory:
        chosen = rng.randrange(len(per_trajectory))
        interleaved.append(per_trajectory[chosen].pop(0))
        if not per_trajectory[chosen]:
            per_trajectory.pop(chosen)
    return interleaved


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
            steps = synthetic_groups(n_groups, n_rollouts, steps_per_trajectory)
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
