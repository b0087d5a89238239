"""ROLL's episode scheduler on the prompt ledger (against test_ledger's FakeLedger): each group's episode is
recorded once before its envs run, and a resumed scheduler continues the counters and rolls out the
abandoned episodes again exactly once, with the same seed and a new uid."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.unit.test_ledger import FakeLedger
from trajbus.pipelines.agents import Episode
from trajbus.pipelines.env_manager import EnvConfig, EnvManager, EpisodeScheduler, parse_prompt_uid
from trajbus.pipelines.envs import MathEnv
from trajbus.pipelines.global_dataset import GlobalDataset
from trajbus.streams.wire.ledger import ABANDONED, Dispatch, LedgerError, Outcome


class RecordingAgent:
    """Runs no model: notes each episode's prompt and checks that its group was on the ledger first."""

    def __init__(self, ledger: FakeLedger | None) -> None:
        self.ledger = ledger
        self.seen: list[tuple[str, str, dict[str, Any]]] = []

    def run_episode(self, env: Any, observation: Any, prompt_uid: str, n_rollouts: int,
                    metadata: dict[str, Any]) -> Episode:
        if self.ledger is not None:
            recorded = {r.prompt_uid for r in list(self.ledger.records) if isinstance(r, Dispatch)}
            assert prompt_uid in recorded, "the dispatch is acknowledged before the agent runs"
        self.seen.append((prompt_uid, observation.item["prompt"], metadata))
        return Episode(metadata["traj_id"], prompt_uid, 0.0, 1)

    def stop(self) -> None:
        pass


@pytest.fixture
def dataset(tmp_path) -> GlobalDataset:
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n"
                            for i in range(50)))
    return GlobalDataset(path)


def run(scheduler: EpisodeScheduler, dataset: GlobalDataset, ledger: FakeLedger | None, groups: int = 2,
        group_size: int = 2, seed: int = 100) -> list[EnvManager]:
    """Every env's rollout loop to its end, on threads as ROLL runs them."""
    managers = [EnvManager(MathEnv(dataset), RecordingAgent(ledger), scheduler,
                           EnvConfig(g, g * group_size + e, group_size)) for g in range(groups) for e in range(group_size)]
    with ThreadPoolExecutor(len(managers)) as pool:
        list(pool.map(lambda m: m.run_rollout_loop({"seed": seed}), managers))
    return managers


def uids(manager: EnvManager) -> list[str]:
    return [e.prompt_uid for e in manager.episodes]


def test_each_group_episode_is_recorded_once_before_its_envs_run(dataset):
    ledger = FakeLedger()
    managers = run(EpisodeScheduler(episodes_per_group=3, ledger=ledger, dataset=dataset), dataset, ledger)
    for manager in managers:
        g = manager.env_config.group_id
        assert uids(manager) == [f"{g}_{e}_{100 + g + e}" for e in range(3)], "ROLL's uids, unchanged"
    dispatches = [r for r in ledger.records if isinstance(r, Dispatch)]
    assert sorted(d.prompt_uid for d in dispatches) == sorted({u for m in managers for u in uids(m)})
    first = next(d for d in dispatches if d.prompt_uid == "1_2_103")
    assert (first.n_rollouts, first.epoch, first.offset, first.sample_indices, first.source, first.dataset,
            first.policy_version) == (2, 0, 2, [2], "dataset", dataset.identity(), 7)
    prompts = [[(uid, prompt) for uid, prompt, _ in m.agent.seen] for m in managers]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3], "the envs of a group roll out the same prompts"


def test_without_a_ledger_nothing_changes(dataset):
    scheduler = EpisodeScheduler(episodes_per_group=2)
    managers = run(scheduler, dataset, None)
    assert [uids(m) for m in managers] == [["0_0_100", "0_1_101"]] * 2 + [["1_0_101", "1_1_102"]] * 2
    assert all("attempt" not in metadata for m in managers for _, _, metadata in m.agent.seen)
    assert scheduler.get_episode_id(0, 0) is None and scheduler.get_episode_id(9, 0) == 0


def crashed_run(dataset: GlobalDataset) -> FakeLedger:
    """Group 0: episode 0 emitted, 1 emitted just before the crash (the ledger did not see it yet).
    Group 1: episode 0 dropped by a filter, 1 open, 2 reached by one env only: both left open."""
    ledger = FakeLedger()
    scheduler = EpisodeScheduler(ledger=ledger, dataset=dataset)
    for group, env, episodes in ((0, 0, 2), (0, 1, 2), (1, 2, 2), (1, 3, 3)):
        for _ in range(episodes):
            scheduler.get_episode_id(group, env, group_seed=100 + group, group_size=2)
    ledger.records += [Outcome("0_0_100", "emitted", placed=[0, 0]), Outcome("1_0_101", "dropped", "equal_rewards")]
    ledger.emitted.add("0_1_101")
    ledger.refresh()
    return ledger


def test_a_resume_continues_the_counters_and_rolls_out_the_abandoned_once_with_their_seeds(dataset):
    ledger = crashed_run(dataset)
    before = {d.prompt_uid for d in ledger.view.dispatched.values()}
    managers = run(EpisodeScheduler(episodes_per_group=4, ledger=ledger, dataset=dataset), dataset, ledger)
    assert ledger.view.dropped_for("1_1_102") == ABANDONED and ledger.view.outcomes["0_1_101"].outcome == "emitted"
    assert [uids(m) for m in managers] == [["0_2_102", "0_3_103"]] * 2 + [
        ["1_1_102~1", "1_2_103~1", "1_3_104"]] * 2, "the abandoned first, then after the last dispatched"
    dispatched = [d.prompt_uid for d in ledger.view.dispatched.values() if d.prompt_uid not in before]
    assert sorted(dispatched) == ["0_2_102", "0_3_103", "1_1_102~1", "1_2_103~1", "1_3_104"], "each once"
    again = ledger.view.dispatched["1_1_102~1"]
    assert (again.source, again.origin, again.offset, again.sample_indices) == ("reissue", "1_1_102", 1, [1])
    seen = {uid: (prompt, metadata) for uid, prompt, metadata in managers[2].agent.seen}
    assert seen["1_1_102~1"][0] == dataset.get_data_item(102)["prompt"], "the same seed, the same prompt"
    assert (seen["1_1_102~1"][1]["episode_seed"], seen["1_1_102~1"][1]["attempt"]) == (102, 1)
    assert seen["1_1_102~1"][1]["traj_id"] == "1_1_102~1_2"


def test_a_second_crash_reissues_the_reissue_and_never_the_first_dispatch_again(dataset):
    ledger = crashed_run(dataset)
    scheduler = EpisodeScheduler(ledger=ledger, dataset=dataset)
    assert scheduler.get_episode_id(1, 2, group_seed=999, group_size=2) == 1, "the seed comes from the ledger"
    third = EpisodeScheduler(episodes_per_group=4, ledger=ledger, dataset=dataset)
    tickets = [third.next_episode(1, 3, group_seed=101, group_size=2) for _ in range(4)]
    assert [(t.episode_id, t.attempt, t.seed) for t in tickets[:3]] == [(1, 2, 102), (2, 1, 103), (3, 0, None)]
    assert tickets[3] is None
    assert [r.origin for r in ledger.records if isinstance(r, Dispatch) and r.source == "reissue"] == [
        "1_1_102", "1_1_102~1", "1_2_103"]
    assert parse_prompt_uid("1_1_102~2") == (1, 1, 102, 2) and parse_prompt_uid("p1234-e0-o1") is None


def test_the_other_envs_of_a_group_wait_for_the_acknowledgement(dataset):
    ledger, writing, order = FakeLedger(), threading.Event(), []
    scheduler = EpisodeScheduler(ledger=ledger, dataset=dataset)
    write = ledger.write

    def slow_write(records: list) -> None:
        writing.set()
        time.sleep(0.2)
        write(records)
        order.append("acknowledged")

    ledger.write = slow_write
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(scheduler.get_episode_id, 0, 0, group_seed=5)
        assert writing.wait(5)
        second = pool.submit(lambda: order.append(scheduler.get_episode_id(0, 1, group_seed=5)))
        assert first.result() == 0 and second.result() is None
    assert order == ["acknowledged", 0] and len(ledger.records) == 1


def test_an_unacknowledged_dispatch_hands_nothing_out(dataset):
    ledger = FakeLedger()
    scheduler = EpisodeScheduler(ledger=ledger, dataset=dataset)
    ledger.write = lambda records: (_ for _ in ()).throw(RuntimeError("not acknowledged"))
    with pytest.raises(RuntimeError, match="not acknowledged"):
        scheduler.get_episode_id(0, 0, group_seed=5)
    del ledger.write
    assert [scheduler.get_episode_id(0, env, group_seed=5) for env in (1, 0)] == [0, 0]
    assert [d.prompt_uid for d in ledger.view.dispatched.values()] == ["0_0_5"]
    with pytest.raises(ValueError, match="group_seed"):
        scheduler.get_episode_id(3, 0)


def test_another_dataset_a_traversal_dataset_and_another_channel_are_refused(dataset, tmp_path):
    ledger = crashed_run(dataset)
    with pytest.raises(LedgerError, match="fingerprint/size"):
        EpisodeScheduler(ledger=ledger, dataset="other/3")
    with pytest.raises(ValueError, match="traversal"):
        EpisodeScheduler(ledger=FakeLedger(), dataset=GlobalDataset(tmp_path / "math.jsonl", mode="traversal"))
    agent = RecordingAgent(None)
    agent.channel = "val"
    with pytest.raises(ValueError, match="channel 'train'"):
        EnvManager(MathEnv(dataset), agent, EpisodeScheduler(ledger=FakeLedger()), EnvConfig(0, 0, 1))
