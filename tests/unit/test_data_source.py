"""slime's RolloutDataSource(WithBuffer) semantics, reproduced."""

from __future__ import annotations

import json
import random

import pytest

from trajbus.pipelines.data_source import DataSourceArgs, RolloutDataSource, RolloutDataSourceWithBuffer, Sample


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"text": f"question {i}", "label": str(i), "metadata": {"id": i}} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def args(path, **overrides) -> DataSourceArgs:
    return DataSourceArgs(prompt_data=str(path), label_key="label", n_samples_per_prompt=2, **overrides)


def labels(groups: list[list[Sample]]) -> list[str]:
    return [g[0].label for g in groups]


def test_epoch_crossing_independent_copies_and_fresh_indices(prompts):
    source = RolloutDataSource(args(prompts))
    first = source.get_samples(3)
    assert labels(first) == ["0", "1", "2"]
    second = source.get_samples(3)  # crosses the epoch boundary inside the call
    assert labels(second) == ["3", "4", "0"]
    assert (source.epoch_id, source.sample_offset) == (1, 1)
    assert [s.index for g in first + second for s in g] == list(range(12))
    assert all(len(g) == 2 and g[0].prompt == g[1].prompt for g in first + second)
    first[0][0].metadata["seen"] = True
    first[0][0].response = "changed"
    assert first[0][1].metadata == {"id": 0} and first[0][1].response == "", "copies must be independent"
    assert source.get_samples(1)[0][0].metadata == {"id": 1}, "the dataset's own prompt must stay untouched"


def test_reshuffle_is_deterministic_per_seed_and_epoch(prompts):
    a = RolloutDataSource(args(prompts, rollout_shuffle=True, rollout_seed=7))
    b = RolloutDataSource(args(prompts, rollout_shuffle=True, rollout_seed=7))
    epochs_a = [labels(a.get_samples(5)) for _ in range(3)]
    assert epochs_a == [labels(b.get_samples(5)) for _ in range(3)]
    for epoch, order in enumerate(epochs_a):
        permutation = list(range(5))
        random.Random(7 + epoch).shuffle(permutation)
        assert order == [str(i) for i in permutation]
    assert len({tuple(o) for o in epochs_a}) > 1, "each epoch reshuffles"
    other = RolloutDataSource(args(prompts, rollout_shuffle=True, rollout_seed=8))
    assert [labels(other.get_samples(5)) for _ in range(3)] != epochs_a


def test_buffer_first_custom_filter_and_clear_errors(prompts):
    source = RolloutDataSourceWithBuffer(args(prompts, buffer_filter_path="tests.data_source_filters:newest_first"))
    returned = source.get_samples(2)
    source.add_samples(returned)
    assert source.get_buffer_length() == 2
    got = source.get_samples(3)
    assert labels(got) == ["1", "0", "2"], "buffer first, through the custom filter (newest first), then the dataset"
    assert source.get_buffer_length() == 0
    with pytest.raises(ValueError, match=r"samples\[0\]: has 1 samples, n_samples_per_prompt is 2"):
        source.add_samples([[Sample()]])
    with pytest.raises(ValueError, match="a group is a list of Sample"):
        source.add_samples([["not a sample", "either"]])
    with pytest.raises(RuntimeError, match="read-only"):
        RolloutDataSource(args(prompts)).add_samples(returned)
    with pytest.raises(ValueError, match="buffer_filter_path: cannot import"):
        RolloutDataSourceWithBuffer(args(prompts, buffer_filter_path="tests.nowhere:f"))

    source.update_metadata({"rollout": 3})
    assert source.get_metadata() == {"rollout": 3}


def test_aborted_partial_rollouts_go_back_to_the_buffer(prompts):
    source = RolloutDataSourceWithBuffer(args(prompts))
    groups = source.get_samples(3)
    groups[1][0].status, groups[1][0].response = Sample.Status.ABORTED, "half an ans"
    assert source.return_aborted(groups) == 1
    [again] = source.get_samples(1)
    assert again is groups[1] and again[0].response == "half an ans", "the partial response is kept"


def test_save_and_load_mid_epoch_with_buffer_continues_exactly(prompts, tmp_path):
    def run(source, calls):
        return [[(s.index, s.label, s.status.value) for s in g] for n in calls for g in source.get_samples(n)]

    settings = dict(rollout_shuffle=True, rollout_seed=3, save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"))
    original = RolloutDataSourceWithBuffer(args(prompts, **settings))
    run(original, [2])
    partial = original.get_samples(1)
    partial[0][0].status = Sample.Status.ABORTED
    original.return_aborted(partial)
    original.update_metadata({"seen": 3})
    assert original.save(rollout_id=4).exists()
    uninterrupted = run(original, [2, 3, 4])

    resumed = RolloutDataSourceWithBuffer(args(prompts, **settings))
    assert resumed.load(rollout_id=4)
    assert resumed.get_buffer_length() == 1 and resumed.get_metadata() == {"seen": 3}
    assert run(resumed, [2, 3, 4]) == uninterrupted
    assert uninterrupted[0][0][2] == "aborted", "the restored buffer is served first"
    assert not RolloutDataSourceWithBuffer(args(prompts, **settings)).load(rollout_id=99)


def test_bad_dataset_input_names_the_problem(prompts, tmp_path):
    with pytest.raises(ValueError, match="prompt_data: no such file"):
        RolloutDataSource(args(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="input_key: record 1 .* has no 'question'"):
        RolloutDataSource(args(prompts, input_key="question"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok", "label": "1"}\n{not json\n')
    with pytest.raises(ValueError, match="broken.jsonl:2 is not JSON"):
        RolloutDataSource(args(broken))
