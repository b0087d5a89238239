"""Every prompt of an epoch trained exactly once, through kill -9 of the rollout driver, the trainer or both,
each resumed from the last checkpoint (the data source from the prompt ledger)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from confluent_kafka import Producer

from trajbus.consumers import BatchConsumer
from trajbus.pipelines.data_source import DataSourceArgs, RolloutDataSource
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.processes import ServiceProcess
from trajbus.pipelines.training_state import TrainingState
from trajbus.streams.wire.ledger import Dispatch, LedgerError
from trajbus.streams.wire.topics import dlq_topic, prompts_topic
from tests.helpers import audit_report, read_to_end, wait_for
from tests.lifecycle_driver import RUN, prompt_of

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = 64


def role(name: str, servers: str, prefix: str, tmp_path: Path, *extra: str) -> ServiceProcess:
    count = len(list(tmp_path.glob(f"{name}*.log")))
    return ServiceProcess([name, "--bootstrap-servers", servers, "--prefix", prefix, *extra],
                          tmp_path / f"{name}{count}.log", env={"PYTHONPATH": str(ROOT)},
                          module="tests.lifecycle_driver").start()


def lines(process: ServiceProcess, word: str) -> list[list[str]]:
    return [line.split()[1:] for line in process.log_file.read_text().splitlines() if line.startswith(word + " ")]


def test_kill_the_driver_the_trainer_or_both_and_every_prompt_is_trained_once(
        bootstrap_servers, prefix, start_worker, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"text": f"question {i}"}) + "\n" for i in range(PROMPTS)))
    start_worker(n_rollouts=2, extra=["--channel-setting", "train.group_filter=tests.group_filters:drop_every_13th"])
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    driver_flags = ("--data", str(data), "--in-flight", "8", "--seconds", "0.15")
    trainer_flags = ("--checkpoint-dir", str(checkpoints), "--every", "8", "--prompts", str(PROMPTS))
    driver = role("driver", bootstrap_servers, prefix, tmp_path, *driver_flags)
    trainer = role("trainer", bootstrap_servers, prefix, tmp_path, *trainer_flags)
    try:
        # 1. the driver, mid-dispatch: a dozen groups handed out, most still rolling out
        wait_for(lambda: len(lines(driver, "dispatched")) >= 12 or None, 120, "12 dispatches")
        driver.kill()
        driver = role("driver", bootstrap_servers, prefix, tmp_path, *driver_flags)

        # 2. both, mid-group: a group with one rollout done and its slower second one not yet
        def half_done() -> bool:
            done = [uid for uid, _ in lines(driver, "rollout")]
            return len(done) >= 6 and any(done.count(uid) == 1 for uid in done)

        wait_for(half_done, 120, "a group half rolled out")
        driver.kill()
        trainer.kill()
        driver = role("driver", bootstrap_servers, prefix, tmp_path, *driver_flags)
        trainer = role("trainer", bootstrap_servers, prefix, tmp_path, *trainer_flags)

        # 3. the trainer, just after a checkpoint (and the driver with it)
        wait_for(lambda: lines(trainer, "checkpoint") or None, 120, "a checkpoint after the restart")
        trainer.kill()
        driver.kill()
        driver = role("driver", bootstrap_servers, prefix, tmp_path, *driver_flags)
        trainer = role("trainer", bootstrap_servers, prefix, tmp_path, *trainer_flags)

        wait_for(lambda: (checkpoints / "done.json").exists() or not trainer.alive(), 240, "the epoch trained")
        assert (checkpoints / "done.json").exists(), trainer.log_tail()
    finally:
        driver.kill()
        trainer.kill()

    done = json.loads((checkpoints / "done.json").read_text())
    trained = [prompt_of(uid) for uid in done["trained"]]
    filtered = {prompt_of(uid) for uid, reason in done["drops"].items() if reason == "filtered: every_13th"}
    abandoned = {uid for uid, reason in done["drops"].items() if reason == "abandoned"}
    assert sorted(trained) == sorted(set(trained)), "no prompt is trained twice"
    assert filtered == {0, 13, 26, 39, 52}, "dropped by the filter, counted with their reason"
    assert sorted(set(trained) | filtered) == list(range(PROMPTS)), "no prompt is skipped"
    assert not set(trained) & filtered
    assert not abandoned & set(done["trained"]), "abandoned trajectories never reach the trainer"
    assert abandoned, "the kills left groups open, which the resumes abandoned and issued again"
    assert done["depth"] == 0, "nothing dispatched is left untrained"
    with PromptLedger(bootstrap_servers, "train", prefix) as ledger:
        ledger.refresh()
        reissued = [d for d in ledger.view.dispatched.values() if d.source == "reissue"]
        assert {d.origin for d in reissued} == abandoned, "each abandoned prompt was dispatched again once"
        assert len(reissued) == len({d.origin for d in reissued})
    audit_clean_then_each_violation_named(bootstrap_servers, prefix, done)


def audit_clean_then_each_violation_named(bootstrap_servers: str, prefix: str, done: dict) -> None:
    """The epoch audits clean; then a trainer that skips its ``load_state_dict`` trains a group again, and a
    prompt is dispatched and never settled: the audit names both, exit 1."""
    code, report = audit_report(bootstrap_servers, prefix)
    assert (code, report["violations"], report["run"]) == (0, [], RUN), report["violations"]
    fates = {fate["prompt_uid"]: fate for fate in report["prompts"]}
    assert {uid for uid, fate in fates.items() if fate["status"] == "trained"} == set(done["trained"])
    assert all(len(fates[uid]["steps"]) == 1 for uid in done["trained"]), "each trained group at one step"
    assert {uid for uid, fate in fates.items() if fate["status"] == "abandoned"} == \
        {uid for uid, reason in done["drops"].items() if reason == "abandoned"}
    assert report["steps"] == len(done["trained"]), "a step per group, those a resume trained again counted once"

    with BatchConsumer("train", bootstrap_servers, prefix=prefix, rank=0, world_size=1) as consumer, \
            PromptLedger(bootstrap_servers, "train", prefix) as ledger, \
            TrainingState(consumer, ledger, run=RUN) as careless:
        careless.recorder.last_step = len(done["trained"])  # its model resumed; its consumer starts over
        again = consumer.fetch_group(timeout=60)
        assert again is not None and again.prompt_uid in done["trained"]
        careless.record_step()
        ledger.refresh()
        first = next(iter(ledger.view.dispatched.values()))
        ledger.write([Dispatch("p-never-settled", "train", 2, first.dataset, 1, 0, [1000, 1001])])
    code, report = audit_report(bootstrap_servers, prefix)
    first_step = fates[again.prompt_uid]["steps"][0]
    assert code == 1
    assert {fate["prompt_uid"]: fate["violation"] for fate in report["violations"]} == {
        again.prompt_uid: f"trained twice: steps {first_step}, {len(done['trained']) + 1}",
        "p-never-settled": "never settled: dispatched, neither emitted nor dropped"}


def test_a_bad_ledger_record_goes_to_the_dlq_and_another_dataset_is_refused(bootstrap_servers, prefix, tmp_path):
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path, count in zip(files, (4, 5)):
        path.write_text("".join(json.dumps({"text": f"q{i}"}) + "\n" for i in range(count)))
    with PromptLedger(bootstrap_servers, "train", prefix) as ledger:
        ledger.provision()
        raw = Producer({"bootstrap.servers": bootstrap_servers})
        raw.produce(prompts_topic("train", prefix), key=b"dispatch/x", value=b"{not json")
        assert raw.flush(10) == 0
        del raw  # its threads end with it
        source = RolloutDataSource(DataSourceArgs(prompt_data=str(files[0]), n_samples_per_prompt=2), ledger=ledger)
        assert [g[0].prompt for g in source.get_samples(2)] == ["q0", "q1"], "the data source keeps going"
    dead = read_to_end(bootstrap_servers, dlq_topic(prefix))
    assert len(dead) == 1 and dead[0].value() == b"{not json"
    assert dict(dead[0].headers())["trajbus-dlq-reason"].decode().startswith(
        "undecodable: ledger record b'dispatch/x' is undecodable: JSONDecodeError")
    with PromptLedger(bootstrap_servers, "train", prefix) as ledger, \
            pytest.raises(LedgerError, match=r"^dataset: the prompt ledger was written for dataset \w+/4 "
                                             r"\(fingerprint/size\), this data source reads \w+/5$"):
        RolloutDataSource(DataSourceArgs(prompt_data=str(files[1]), n_samples_per_prompt=2), ledger=ledger)


def test_roll_scheduler_resumes_from_the_ledger_and_the_worker_settles_what_was_open(
        bootstrap_servers, prefix, start_worker):
    from trajbus.pipelines.env_manager import EpisodeScheduler, roll_prompt_uid
    from trajbus.streams.client.producer import StepProducer
    from trajbus.streams.client.topic_settings import TopicSettings

    start_worker(n_rollouts=2)

    def roll_out(producer: StepProducer, prompt_uid: str, env_id: int) -> None:
        uid = f"{prompt_uid}_{env_id}"
        producer.submit_steps([{"prompt_ids": [1, 2], "response_ids": [3], "trajectory_uid": uid,
                                "prompt_uid": prompt_uid, "step_index": 0, "n_rollouts": 2}])
        producer.complete_trajectory(uid, prompt_uid, reward=1.0, n_rollouts=2)

    with StepProducer(bootstrap_servers, settings=TopicSettings(prefix=prefix)) as producer, \
            BatchConsumer("train", bootstrap_servers, prefix=prefix, rank=0, world_size=1) as trainer:
        with PromptLedger(bootstrap_servers, "train", prefix) as ledger:
            before = EpisodeScheduler(episodes_per_group=2, ledger=ledger)
            first = [before.next_episode(0, env, group_seed=40, group_size=2) for env in (0, 1)]
            assert [t.episode_id for t in first] == [0, 0], "one dispatch, both envs of the group"
            roll_out(producer, roll_prompt_uid(0, 0, 40), 0)  # env 1 dies before its rollout ends
        with PromptLedger(bootstrap_servers, "train", prefix) as ledger:
            after = EpisodeScheduler(episodes_per_group=2, ledger=ledger)  # abandons 0_0_40, settled by the worker
            assert ledger.view.dropped_for(roll_prompt_uid(0, 0, 40)) == "abandoned"
            tickets = [after.next_episode(0, env, group_seed=40, group_size=2) for env in (0, 1)]
            assert [(t.episode_id, t.attempt, t.seed) for t in tickets] == [(0, 1, 40)] * 2, "same seed, once"
            for env in (0, 1):
                roll_out(producer, roll_prompt_uid(0, 0, 40, attempt=1), env)
            assert [after.next_episode(0, env, group_seed=40, group_size=2).episode_id for env in (0, 1)] == [1, 1]
        group = trainer.fetch_group(timeout=60)
        assert group is not None and group.prompt_uid == "0_0_40~1"
        assert sorted(group.trajectory_uids) == ["0_0_40~1_0", "0_0_40~1_1"], "the abandoned rollout never arrives"
