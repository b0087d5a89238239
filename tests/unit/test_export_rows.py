"""The rows of an export: tokens stored once per trajectory, provenance, the filters, the SFT shape."""

from __future__ import annotations

import pyarrow as pa
import pytest

from trajbus.pipelines.export_filters import TrajectoryFilter, parse_versions
from trajbus.pipelines.export_rows import RL_SCHEMA, Provenance, RlColumns, trace_id, trajectories
from trajbus.pipelines.export_sft import SFT_SCHEMA, SftRows, SftUnavailable
from trajbus.streams.wire import codec
from trajbus.streams.wire.prefix import StructuredGroup, structure
from trajbus.streams.wire.records import SEGMENT_START, ReadyGroup, Step

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
WHERE = Provenance("p.groups.train", 0, 41, {"g/t0": TRACEPARENT})


def conversation(uid: str, turns: int, reward: float, version: int = 3, restart_at: int | None = None,
                 log_probs: bool = True, messages: bool = False) -> list[Step]:
    """A multi-turn trajectory: each prompt is the last prompt + response + a new turn, except at ``restart_at``."""
    steps, context = [], [1, 2, 3]
    for i in range(turns):
        prompt = [90 + i] if i == restart_at else context + ([50 + i, 51 + i] if i else [])
        response = [100 * (i + 1) + k for k in range(i + 2)]
        steps.append(Step(prompt_ids=prompt, response_ids=response, trajectory_uid=uid, prompt_uid="g",
                          step_index=i, reward=reward if i == turns - 1 else 0.0, policy_version=version,
                          is_last=i == turns - 1, rollout_log_probs=[-0.25] * len(response) if log_probs else None,
                          metadata={SEGMENT_START: True} if i == restart_at else
                          ({"messages": [{"role": "user", "content": f"turn {i}"}]} if messages else {})))
        context = prompt + response
    return steps


def group(*trajectories_steps: list[Step]) -> ReadyGroup:
    return ReadyGroup(prompt_uid="g", channel="train", steps=[s for t in trajectories_steps for s in t],
                      n_rollouts=len(trajectories_steps), ready_at=1_700_000_000.5)


def decoded(ready: ReadyGroup):
    """The group as the export reads it: encoded, decoded in its prefix structure with numpy arrays."""
    return codec.decode(codec.encode(ready), arrays=True, structured=True)


def in_memory(ready: ReadyGroup) -> StructuredGroup:
    """The group's prefix structure built in memory (token ids as lists), not read from a record."""
    shared, entries = structure(sorted(ready.steps, key=lambda s: (s.trajectory_uid, s.step_index)))
    return StructuredGroup(shared, entries, dict(prompt_uid=ready.prompt_uid, channel=ready.channel,
                                                 n_rollouts=ready.n_rollouts, ready_at=ready.ready_at,
                                                 status=ready.status, metadata=ready.metadata))


def rl_table(ready: ReadyGroup) -> pa.Table:
    columns, record = RlColumns(), decoded(ready)
    for trajectory in trajectories(record):
        columns.add(trajectory, record, WHERE)
    return columns.table()


def prompts_of(row: dict) -> list[list[int]]:
    """Each step's whole prompt, rebuilt from a row the way a reader of the dataset would."""
    prompts, context = [], list(row["prompt_ids"])
    for step in row["steps"]:
        prompt = context + step["new_prompt_ids"] if step["extends_previous"] else step["new_prompt_ids"]
        prompts.append(prompt)
        context = prompt + step["response_ids"]
    return prompts


def test_a_row_stores_each_token_once_and_gives_back_every_prompt():
    first, second = conversation("g/t0", 4, 1.0), conversation("g/t1", 3, 0.5, restart_at=2)
    rows = rl_table(group(first, second)).to_pylist()
    assert [r["trajectory_uid"] for r in rows] == ["g/t0", "g/t1"]
    for row, steps in zip(rows, (first, second)):
        assert row["prompt_ids"] == steps[0].prompt_ids
        assert prompts_of(row) == [s.prompt_ids for s in steps]
        assert [s["response_ids"] for s in row["steps"]] == [s.response_ids for s in steps]
        assert [s["rollout_log_probs"] for s in row["steps"]] == [s.rollout_log_probs for s in steps]
    assert rows[0]["steps"][0]["new_prompt_ids"] == [] and rows[0]["steps"][1]["new_prompt_ids"] == [51, 52]
    restarted = rows[1]["steps"][2]
    assert restarted["extends_previous"] is False and restarted["new_prompt_ids"] == [92]
    assert [r["reward"] for r in rows] == [1.0, 0.5]


def test_provenance_columns_name_the_record_and_the_trace():
    row = rl_table(group(conversation("g/t0", 2, 1.0)))
    assert row.schema.equals(RL_SCHEMA)
    [found] = row.to_pylist()
    assert (found["topic"], found["partition"], found["offset"]) == ("p.groups.train", 0, 41)
    assert (found["prompt_uid"], found["channel"], found["group_status"]) == ("g", "train", "complete")
    assert found["ready_at"] == 1_700_000_000.5
    assert found["traceparent"] == TRACEPARENT and found["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert trace_id(None) is None and trace_id("garbage") is None


def test_versions_segments_and_missing_log_probs_are_kept():
    steps = conversation("g/t0", 2, 1.0, version=4, log_probs=False)
    steps[1].version_segments = [[0, 4], [1, 5]]
    [row] = rl_table(group(steps)).to_pylist()
    assert [s["rollout_log_probs"] for s in row["steps"]] == [None, None]
    assert row["steps"][1]["version_segments"] == [{"start": 0, "version": 4}, {"start": 1, "version": 5}]
    assert row["steps"][0]["version_segments"] is None
    assert (row["policy_version"], row["newest_policy_version"]) == (4, 5)


def test_a_group_of_full_steps_gives_the_same_rows_as_its_record():
    ready = group(conversation("g/t0", 3, 1.0), conversation("g/t1", 3, 0.0, restart_at=1))
    columns = RlColumns()
    record = in_memory(ready)
    for trajectory in trajectories(record):
        columns.add(trajectory, record, WHERE)
    assert columns.table().to_pylist() == rl_table(ready).to_pylist()


@pytest.mark.parametrize("text, versions", [("2,3", {2, 3}), ("2-5", {2, 3, 4, 5}), ("1, 4-5", {1, 4, 5})])
def test_policy_versions_are_lists_or_ranges(text, versions):
    assert parse_versions(text) == versions


@pytest.mark.parametrize("text", ["", "two", "5-2", "1-x"])
def test_bad_policy_versions_are_refused_by_name(text):
    with pytest.raises(ValueError, match="--policy-version"):
        parse_versions(text)


def test_filters_by_reward_version_and_staleness():
    [low, high] = trajectories(decoded(group(conversation("g/t0", 2, 0.2, version=1),
                                                conversation("g/t1", 2, 0.9, version=4))))
    assert [TrajectoryFilter(min_reward=0.5).keeps(t, None) for t in (low, high)] == [False, True]
    assert [TrajectoryFilter(max_reward=0.5).keeps(t, None) for t in (low, high)] == [True, False]
    assert [TrajectoryFilter(policy_versions=frozenset({4})).keeps(t, None) for t in (low, high)] == [False, True]
    newest = TrajectoryFilter(max_staleness=2)
    assert [newest.keeps(t, 4) for t in (low, high)] == [False, True]  # 4 - 1 = 3 versions behind
    current = TrajectoryFilter(max_staleness=2, current_version=3)
    assert [current.keeps(t, 4) for t in (low, high)] == [True, True]
    with pytest.raises(ValueError, match="--max-reward"):
        TrajectoryFilter(min_reward=1.0, max_reward=0.0)


def test_a_segment_version_counts_for_the_filters():
    steps = conversation("g/t0", 2, 1.0, version=4)
    steps[1].version_segments = [[0, 2], [1, 4]]
    [trajectory] = trajectories(decoded(group(steps)))
    assert trajectory.versions == {2, 4}
    assert not TrajectoryFilter(policy_versions=frozenset({4})).keeps(trajectory, None)
    assert not TrajectoryFilter(max_staleness=1).keeps(trajectory, 4)


class WordTokenizer:
    """Decodes each id as ``w<id>``: enough to see which ids were decoded."""

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"w{i}" for i in ids) + ("" if skip_special_tokens else " <eos>")


def sft_rows(ready: ReadyGroup, tokenizer=None) -> list[dict]:
    rows, record = SftRows(tokenizer), decoded(ready)
    for trajectory in trajectories(record):
        rows.add(trajectory, record, WHERE)
    table = rows.table()
    assert table.schema.equals(SFT_SCHEMA)
    return table.to_pylist()


def test_sft_rows_from_the_chat_steps_carry():
    steps = conversation("g/t0", 2, 1.0, messages=True)
    steps[-1].metadata["completion"] = "the answer"
    [row] = sft_rows(group(steps))
    assert row["messages"] == [{"role": "user", "content": "turn 1"}, {"role": "assistant", "content": "the answer"}]
    assert row["completion"] == "the answer" and row["prompt"] is None
    assert row["offset"] == 41 and row["reward"] == 1.0


def test_sft_rows_decoded_with_a_tokenizer_where_steps_carry_no_chat():
    steps = conversation("g/t0", 2, 1.0)
    [row] = sft_rows(group(steps), WordTokenizer())
    assert row["messages"] is None
    assert row["prompt"] == " ".join(f"w{i}" for i in steps[-1].prompt_ids) + " <eos>"
    assert row["completion"] == " ".join(f"w{i}" for i in steps[-1].response_ids)


def test_sft_without_chat_or_tokenizer_says_what_is_missing():
    with pytest.raises(SftUnavailable, match="carry no chat .*give --tokenizer PATH"):
        sft_rows(group(conversation("g/t0", 2, 1.0)))
