"""Schema v2 on a real broker: multi-turn steps travel as deltas and arrive whole, at the trainer and in a replay."""

from __future__ import annotations

import time

from trajbus.consumers import BatchConsumer
from trajbus.consumers.replay import Replay
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StepDelta
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.topics import steps_topic
from tests.helpers import fetch_groups, read_to_end
from tests.unit.test_prefix import trajectory

TURNS = 5


def tokens(step: Step) -> tuple:
    return (step.trajectory_uid, step.step_index, step.prompt_ids, step.response_ids, step.rollout_log_probs,
            step.reward, step.is_last)


def multi_turn_groups(created: float) -> dict[str, list[list[Step]]]:
    """2 groups x 2 rollouts x 5 turns; turn t of every trajectory is created at ``created + t``."""
    groups = {}
    for g in range(2):
        rollouts = []
        for r in range(2):
            steps = trajectory(f"mt{g}/r{r}", TURNS, start=created)
            for step in steps:
                step.prompt_uid = f"mt{g}"
                step.reward = float(r) if step.is_last else 0.0
            rollouts.append(steps)
        groups[f"mt{g}"] = rollouts
    return groups


def test_multi_turn_steps_travel_as_deltas_and_arrive_whole(bootstrap_servers, prefix, start_worker):
    created = time.time() - 100
    groups = multi_turn_groups(created)
    every = [s for rollouts in groups.values() for t in rollouts for s in t]
    with StepProducer(bootstrap_servers, prefix=prefix) as producer, \
            BatchConsumer("train", bootstrap_servers, prefix=prefix) as trainer:
        producer.provision("train")
        start_worker(n_rollouts=2)
        for turn in range(TURNS):  # as agents send them: turn by turn
            producer.submit_steps([s for s in every if s.step_index == turn], channel="train")
        got = {g.prompt_uid: g for g in fetch_groups(trainer, 2, timeout=120)}
    for uid, rollouts in groups.items():
        assert [tokens(s) for s in got[uid].steps] == [tokens(s) for t in rollouts for s in t], \
            "the trainer gets whole prompts"

    stored = read_to_end(bootstrap_servers, steps_topic("train", prefix))
    records = [codec.decode(m.value()) for m in stored]
    assert sum(isinstance(r, StepDelta) for r in records) == len(every) - 4  # all but each first turn
    assert sum(len(m.value()) for m in stored) < sum(len(codec.encode(s)) for s in every) / 2

    with Replay("train", bootstrap_servers, prefix=prefix, source="steps", start_time=created + 3) as replay:
        window = [record for _m, record in replay.records()]
    assert sorted((s.trajectory_uid, s.step_index) for s in window) == \
        sorted((s.trajectory_uid, s.step_index) for s in every if s.step_index >= 3)
    by_key = {s.key: s for s in every}
    assert all(tokens(s) == tokens(by_key[s.key]) for s in window), "steps extending ones before it are rebuilt"
