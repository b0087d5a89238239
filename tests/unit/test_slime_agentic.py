"""The rules of slime's agentic rollout that need no broker: slime's signature and outputs, how many groups
to hand out, the dynamic filter's verdict, sampling from slime's flags, eval datasets, a group's trajectories
matched to the samples they answer, per-token policy versions, and a group rebuilt from the ledger."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from trajbus.consumers.slime.sample import Sample, Status
from trajbus.consumers.slime.sample_kind import TRAJBUS_SAMPLES
from trajbus.pipelines.slime import SlimeDataSource, SlimeSettings
from trajbus.pipelines.slime import agentic
from trajbus.pipelines.slime.agentic_rollout import group_samples, handed_out
from trajbus.pipelines.slime.harness import SAMPLE_INDEX
from trajbus.pipelines.slime.rollout_args import (DynamicFilterVerdict, RolloutShape, dynamic_filter, eval_sets,
                                                  sampling_of)
from trajbus.consumers.slime.samples import POLICY_VERSIONS, samples_from_group
from trajbus.streams.wire.records import ReadyGroup, Step
from tests.unit.test_ledger import FakeLedger
from tests.unit.test_slime_data_source import no_broker, slime_args  # noqa: F401 (a fixture)

STANDIN = Path(__file__).resolve().parents[1] / "slime_standin"


def test_generate_rollout_has_slimes_signature():
    parameters = inspect.signature(agentic.generate_rollout).parameters
    assert tuple(parameters) == ("args", "rollout_id", "data_source", "evaluation")
    assert parameters["evaluation"].default is False


def test_outputs_are_slimes_classes_where_slime_has_them_else_trajbus_ones_of_the_same_fields(monkeypatch):
    assert agentic._slime_outputs() is None
    assert [f for f in agentic.TrainOutput.__dataclass_fields__] == ["samples", "metrics"]
    assert [f for f in agentic.EvalOutput.__dataclass_fields__] == ["data", "metrics"]
    monkeypatch.syspath_prepend(str(STANDIN))
    try:
        train, evaluation = agentic._slime_outputs()
        assert (train.__name__, evaluation.__name__) == ("RolloutFnTrainOutput", "RolloutFnEvalOutput")
    finally:
        for name in [name for name in sys.modules if name == "slime" or name.startswith("slime.")]:
            del sys.modules[name]


def test_groups_in_flight_are_topped_up_to_the_over_sampling_batch_while_the_batch_falls_short():
    assert RolloutShape.of(None) == RolloutShape(1, 1), "args=None (slime's contract test): one group"
    assert RolloutShape.of(argparse.Namespace(rollout_batch_size=16, over_sampling_batch_size=None)) == \
        RolloutShape(16, 16), "slime's default: over-sampling by the batch size"
    shape = RolloutShape(16, 24)
    assert shape.to_dispatch(kept=0, in_flight=0) == 24, "a round of over_sampling_batch_size"
    assert shape.to_dispatch(kept=0, in_flight=8) == 16, "groups carried over count as in flight"
    assert shape.to_dispatch(kept=10, in_flight=6) == 0, "kept and in flight fill the batch"
    assert shape.to_dispatch(kept=12, in_flight=2) == 22
    assert RolloutShape(16, 16).to_dispatch(kept=0, in_flight=5) == 11, "a resume waits for the groups ready"
    assert RolloutShape(16, 4).to_dispatch(kept=0, in_flight=0) == 16, "at least the missing groups"


def test_the_dynamic_filter_is_read_as_slimes_output_or_its_older_bool():
    args = argparse.Namespace(dynamic_sampling_filter_path="tests.unit.test_slime_agentic:keep_label_1")
    verdict = dynamic_filter(args)
    assert verdict([Sample(label="1")]) == DynamicFilterVerdict(True, "label", True)
    assert verdict([Sample(label="2")]) == DynamicFilterVerdict(False, "label", True)
    older = dynamic_filter(argparse.Namespace(dynamic_sampling_filter_path="tests.unit.test_slime_agentic:odd"))
    assert older([Sample(index=3)]) == DynamicFilterVerdict(True)
    assert older([Sample(index=2)]) == DynamicFilterVerdict(False)
    assert dynamic_filter(None)([Sample()]) == DynamicFilterVerdict(True)
    with pytest.raises(ValueError, match="dynamic_sampling_filter_path: cannot import 'no.such:thing'"):
        dynamic_filter(argparse.Namespace(dynamic_sampling_filter_path="no.such:thing"))


def keep_label_1(args, group):
    return SimpleNamespace(keep=group[0].label == "1", reason="label", keep_when_insufficient=True)


def odd(args, group):
    return group[0].index % 2 == 1


def test_sampling_comes_from_the_eval_dataset_then_slimes_eval_flags_then_its_rollout_flags():
    args = argparse.Namespace(rollout_temperature=0.8, rollout_top_p=0.9, rollout_max_response_len=256,
                              eval_temperature=0.0, eval_top_p=None, eval_max_response_len=None)
    assert sampling_of(args) == {"temperature": 0.8, "top_p": 0.9, "max_tokens": 256}
    config = SimpleNamespace(temperature=None, top_p=None, max_response_len=64)
    assert sampling_of(args, config) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 64}
    assert sampling_of(None) == {}, "the engine's defaults"


def test_each_eval_prompt_is_a_group_of_n_copies_with_fresh_indices(tmp_path):
    data = tmp_path / "eval.jsonl"
    data.write_text('{"q": "a", "a": "1"}\n{"q": "b", "a": "2"}\n')
    args = argparse.Namespace(eval_datasets=[SimpleNamespace(name="e", path=str(data), input_key="q", label_key="a",
                                                             n_samples_per_eval_prompt=3, max_response_len=32)])
    cache: dict = {}
    [found] = eval_sets(args, TRAJBUS_SAMPLES, cache)
    assert found.name == "e" and found.sampling == {"max_tokens": 32}
    assert [[(s.prompt, s.label, s.index, s.group_index) for s in g] for g in found.groups] == [
        [("a", "1", 0, 0), ("a", "1", 1, 0), ("a", "1", 2, 0)], [("b", "2", 3, 1), ("b", "2", 4, 1), ("b", "2", 5, 1)]]
    data.write_text('{"q": "changed", "a": "3"}\n')
    assert eval_sets(args, TRAJBUS_SAMPLES, cache)[0].groups[0][0].prompt == "a", "read once"
    assert eval_sets(None, TRAJBUS_SAMPLES, cache) == []


def step(uid: str, index: int, prompt: list[int], response: list[int], **fields) -> Step:
    return Step(prompt, response, uid, "pu", index, rollout_log_probs=[-0.5] * len(response), **fields)


def test_each_trajectory_becomes_the_sample_its_metadata_names_whatever_the_order_of_uids():
    steps = [step("a", 0, [1], [2], reward=1.0, is_last=True, metadata={SAMPLE_INDEX: 11}),
             step("b", 0, [1], [3], reward=0.0, is_last=True, metadata={SAMPLE_INDEX: 10})]
    dispatched = [Sample(index=10, prompt="q", label="x"), Sample(index=11, prompt="q", label="x")]
    samples = group_samples(ReadyGroup("pu", "train", steps, 2), dispatched, TRAJBUS_SAMPLES, None)
    assert [(s.index, s.tokens, s.reward) for s in samples] == [(11, [1, 2], 1.0), (10, [1, 3], 0.0)]
    unnamed = [step("a", 0, [1], [2], is_last=True), step("b", 0, [1], [3], is_last=True)]
    samples = group_samples(ReadyGroup("pu", "train", unnamed, 2), dispatched, TRAJBUS_SAMPLES, None)
    assert [s.index for s in samples] == [10, 11], "no sample named: in order"


def test_a_generation_cut_by_a_weight_update_gives_the_version_of_each_response_token():
    cut = [step("t", 0, [1], [2, 3, 4], policy_version=1, version_segments=[[0, 1], [2, 2]]),
           step("t", 1, [1, 2, 3, 4, 9], [5], policy_version=2, is_last=True)]
    [sample] = samples_from_group(cut, [Sample(index=0)], TRAJBUS_SAMPLES)
    assert sample.weight_versions == ["1", "2", "2"], "one entry per run of one version"
    assert sample.metadata[POLICY_VERSIONS] == [1, 1, 2, 2, 2], "the token between turns takes the next call's"
    [plain] = samples_from_group([step("t", 0, [1], [2, 3], policy_version=4, is_last=True)], [Sample(index=0)],
                                 TRAJBUS_SAMPLES)
    assert plain.weight_versions == ["4"] and POLICY_VERSIONS not in plain.metadata, "one version: nothing extra"


def test_a_group_handed_out_before_a_resume_is_rebuilt_from_the_ledger(no_broker, tmp_path, monkeypatch):  # noqa: F811
    ledger = FakeLedger()
    ledger.topic, ledger.close = "t.prompts.train", lambda: None
    monkeypatch.setattr(SlimeSettings, "open_ledger", lambda settings, policy_version: ledger)
    args = slime_args(tmp_path, trajbus_settled_by="worker", rollout_shuffle=True)
    first = SlimeDataSource(args).get_samples(3)
    resumed = SlimeDataSource(args)
    for group in first:
        again = handed_out(resumed, group[0].prompt_uid)
        assert [(s.prompt, s.label, s.index, s.group_index, s.prompt_uid) for s in again] == \
            [(s.prompt, s.label, s.index, s.group_index, s.prompt_uid) for s in group]


def test_the_agentic_settings_are_keys_of_the_custom_config_yaml(monkeypatch):
    settings = SlimeSettings.from_args(argparse.Namespace(trajbus_gateway_url="http://gw:8100",
                                                          trajbus_agent_concurrency="8"))
    assert (settings.gateway_url, settings.agent_concurrency, settings.eval_channel) == ("http://gw:8100", 8, "val")
    assert settings.agent_path == "trajbus.pipelines.slime.agents.calculator_agent"
    with pytest.raises(ValueError, match="trajbus_agent_concurrency: expected a positive integer, got 0"):
        SlimeSettings.from_args(argparse.Namespace(trajbus_agent_concurrency=0))
    with pytest.raises(ValueError, match="trajbus_agent: not a trajbus setting .*trajbus_agent_path"):
        SlimeSettings.from_args(argparse.Namespace(trajbus_agent="x.y"))
    monkeypatch.setenv("TRAJBUS_SLIME_EVAL_CHANNEL", "no spaces")
    with pytest.raises(ValueError, match="channel"):
        SlimeSettings.from_args(None)


def test_a_ledger_the_rollout_settles_and_one_channel_for_both_are_refused(no_broker, tmp_path, monkeypatch):  # noqa: F811
    ledger = FakeLedger()
    ledger.topic, ledger.close = "t.prompts.train", lambda: None
    monkeypatch.setattr(SlimeSettings, "open_ledger", lambda settings, policy_version: ledger)
    source = SlimeDataSource(slime_args(tmp_path))
    with pytest.raises(ValueError, match="trajbus_settled_by: .* set trajbus_settled_by: worker"):
        agentic.generate_rollout(slime_args(tmp_path), 0, source)
    with pytest.raises(ValueError, match="trajbus_eval_channel: 'train' is the training channel too"):
        agentic.generate_rollout(argparse.Namespace(trajbus_eval_channel="train"), 0, object())
    assert not agentic._rollouts, "nothing started"
