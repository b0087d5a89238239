"""``trajbus export``: rows that lead back to their group records, exactly once across a kill -9 of
``--follow``, the SFT shape as a Hugging Face dataset, and bad input in one line."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest

from trajbus.consumers.replay import Replay
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.pipelines.export import export_group_id
from trajbus.pipelines.processes import ServiceProcess
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.records import Step
from trajbus.streams.wire.topics import groups_topic
from tests.helpers import end_offsets, trajbus, wait_for

ROLLOUTS, TURNS = 2, 3


def conversation(prompt_uid: str, rollout: int, reward: float, chat: bool = False, tokenizer=None) -> list[Step]:
    """A multi-turn trajectory whose prompts extend the last prompt + response (or, with ``tokenizer``,
    one call of a chat: its prompt rendered by the chat template, its reply ``"7"``)."""
    uid = f"{prompt_uid}/r{rollout}"
    if tokenizer is not None:
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
        reply = tokenizer.encode("7<|im_end|>")
        return [Step(prompt_ids=prompt, response_ids=reply, trajectory_uid=uid, prompt_uid=prompt_uid,
                     reward=reward, is_last=True, rollout_log_probs=[-0.1] * len(reply))]
    steps, context = [], [7, 8, 9, rollout]
    for i in range(TURNS):
        prompt = context + ([60 + i] if i else [])
        response = [100 + 10 * i + k for k in range(3)]
        metadata = {"messages": [{"role": "user", "content": f"turn {i}"}], "completion": f"reply {i}"} if chat else {}
        steps.append(Step(prompt_ids=prompt, response_ids=response, trajectory_uid=uid, prompt_uid=prompt_uid,
                          step_index=i, reward=reward if i == TURNS - 1 else 0.0, is_last=i == TURNS - 1,
                          policy_version=1 + rollout, rollout_log_probs=[-0.5] * 3, metadata=metadata))
        context = prompt + response
    return steps


def produce(servers: str, prefix: str, uids: list[str], total: int, **options) -> None:
    """Groups ``uids`` through the worker; returns once the groups topic holds ``total`` records."""
    with StepProducer(servers, prefix=prefix) as producer:
        for uid in uids:
            producer.submit_steps([s for r in range(ROLLOUTS) for s in conversation(uid, r, float(r), **options)],
                                  channel="train")
    wait_for(lambda: sum(end_offsets(servers, groups_topic("train", prefix))) >= total, 120,
             f"{total} groups on the groups topic")


@pytest.fixture
def channel(bootstrap_servers, prefix, start_worker):
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    start_worker(n_rollouts=ROLLOUTS)
    return groups_topic("train", prefix)


def export_args(servers: str, prefix: str, output: Path, *more: str) -> list[str]:
    return ["export", "--bootstrap-servers", servers, "--prefix", prefix, "--channel", "train",
            "--output", str(output), *more]


def parquet_rows(output: Path) -> list[dict]:
    files = sorted(str(p) for p in output.glob("part-*.parquet"))
    return list(datasets.load_dataset("parquet", data_files=files, split="train")) if files else []


def test_every_row_leads_back_to_its_group_record(bootstrap_servers, prefix, channel, tmp_path):
    uids = [f"a{i}" for i in range(4)]
    produce(bootstrap_servers, prefix, uids, total=4)
    result = trajbus(*export_args(bootstrap_servers, prefix, tmp_path / "all", "--part-rows", "3"))
    assert result.returncode == 0, result.stderr
    assert "exported 8 rows of 4 groups in 2 new parts" in result.stdout, result.stdout
    rows = parquet_rows(tmp_path / "all")
    assert sorted(r["trajectory_uid"] for r in rows) == sorted(f"{u}/r{r}" for u in uids for r in range(ROLLOUTS))
    with Replay("train", bootstrap_servers, prefix=prefix) as replay:
        records = {(message.topic(), message.partition(), message.offset()): group
                   for message, group in replay.records()}
    for row in rows:
        group = records[(row["topic"], row["partition"], row["offset"])]  # the record the row names
        steps = [s for s in group.steps if s.trajectory_uid == row["trajectory_uid"]]
        assert group.prompt_uid == row["prompt_uid"] and group.ready_at == row["ready_at"]
        assert [s.response_ids for s in steps] == [s["response_ids"] for s in row["steps"]]
        assert steps[0].prompt_ids == row["prompt_ids"] and row["reward"] == steps[-1].reward
        assert [s.prompt_ids[len(b.prompt_ids) + len(b.response_ids):] for b, s in zip(steps, steps[1:])] == \
            [s["new_prompt_ids"] for s in row["steps"][1:]]
    again = trajbus(*export_args(bootstrap_servers, prefix, tmp_path / "all"))
    assert again.returncode == 0 and "exported 0 rows of 0 groups in 0 new parts" in again.stdout, again.stdout
    kept = trajbus(*export_args(bootstrap_servers, prefix, tmp_path / "rewarded", "--min-reward", "1",
                                "--policy-version", "2", "--from-offset", "1"))
    assert kept.returncode == 0, kept.stderr
    after_first = sorted(f"{group.prompt_uid}/r1" for (_t, _p, offset), group in records.items() if offset >= 1)
    assert sorted(r["trajectory_uid"] for r in parquet_rows(tmp_path / "rewarded")) == after_first


def test_follow_writes_every_group_once_across_a_kill(bootstrap_servers, prefix, channel, tmp_path):
    output = tmp_path / "live"
    produce(bootstrap_servers, prefix, [f"f{i}" for i in range(3)], total=3)
    follow = ServiceProcess(export_args(bootstrap_servers, prefix, output, "--follow", "--part-rows", "2"),
                            tmp_path / "export1.log").start()
    try:
        wait_for(lambda: list(output.glob("part-*.parquet")) or not follow.alive(), 60, "the first part")
        assert follow.alive(), follow.log_tail()
    finally:
        follow.kill()
    produce(bootstrap_servers, prefix, [f"f{i}" for i in range(3, 6)], total=6)
    restarted = ServiceProcess(export_args(bootstrap_servers, prefix, output, "--follow", "--part-rows", "2"),
                               tmp_path / "export2.log").start()
    try:
        wait_for(lambda: len(parquet_rows(output)) >= 12 or not restarted.alive(), 60, "all 12 rows on disk")
        assert restarted.alive(), restarted.log_tail()
        group = export_group_id(prefix, "train", output)
        wait_for(lambda: [p.committed for p in consumer_group_lag(bootstrap_servers, group, channel)] == [6], 30,
                 "the export's commits at the end of the topic")
    finally:
        restarted.stop()
    rows = parquet_rows(output)
    assert sorted(r["trajectory_uid"] for r in rows) == sorted(f"f{i}/r{r}" for i in range(6) for r in range(2))
    assert sorted({(r["partition"], r["offset"]) for r in rows}) == [(0, o) for o in range(6)]
    assert not list(output.glob(".writing-*"))


def test_sft_shape_as_a_hugging_face_dataset(bootstrap_servers, prefix, channel, tmp_path):
    from trajbus.infra.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    produce(bootstrap_servers, prefix, ["chat"], total=1, chat=True)
    produce(bootstrap_servers, prefix, ["tokens"], total=2, tokenizer=tokenizer)
    refused = trajbus(*export_args(bootstrap_servers, prefix, tmp_path / "no-tokenizer", "--shape", "sft"))
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "trajbus export: --shape sft: trajectory tokens/r0's steps carry no chat (metadata.messages); "
        "give --tokenizer PATH to decode their token ids"], refused.stderr
    result = trajbus(*export_args(bootstrap_servers, prefix, tmp_path / "sft", "--shape", "sft", "--format", "hf",
                                  "--tokenizer", str(tmp_path / "tokenizer")))
    assert result.returncode == 0, result.stderr
    rows = {row["trajectory_uid"]: row for row in datasets.load_from_disk(str(tmp_path / "sft"))}
    assert sorted(rows) == ["chat/r0", "chat/r1", "tokens/r0", "tokens/r1"]
    assert rows["chat/r1"]["messages"] == [{"role": "user", "content": "turn 2"},
                                           {"role": "assistant", "content": "reply 2"}]
    assert rows["tokens/r0"]["messages"] is None and rows["tokens/r0"]["completion"] == "7"
    assert "What is 3 + 4?" in rows["tokens/r0"]["prompt"] and rows["tokens/r1"]["offset"] == 1
    assert not list(tmp_path.glob(".sft*"))  # the parts beside it are gone once the dataset is saved


@pytest.mark.parametrize("more, says", [
    (["--min-reward", "high"], "--min-reward: expected a number, got 'high'"),
    (["--policy-version", "5-2"], "--policy-version: the range '5-2' ends before it starts"),
    (["--follow", "--to-offset", "3"], "--follow: keeps exporting as groups arrive; it takes no window end"),
    (["--follow", "--format", "hf"], "--format hf saves a dataset once"),
    (["--tokenizer", "/no/such/folder", "--shape", "sft"], "--tokenizer /no/such/folder: no such folder"),
])
def test_bad_input_is_one_line_and_exit_2(more, says, tmp_path):
    result = trajbus(*export_args("127.0.0.1:9", "nothing", tmp_path / "out", *more))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("trajbus export: ") and says in result.stderr, result.stderr


def test_a_channel_without_topics_is_one_line_and_exit_2(bootstrap_servers, prefix, tmp_path):
    result = trajbus(*export_args(bootstrap_servers, prefix, tmp_path / "out"))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"trajbus export: channel 'train': topic {prefix}.groups.train does not exist"], result.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
