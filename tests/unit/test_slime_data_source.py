"""trajbus's data source inside slime, held to slime's contract: slime's own plugin-contract tests
(tests/plugin_contracts/test_plugin_path_loading_contracts.py) build a ``--data-source-path`` class from
a bare ``args`` and call ``get_samples``; slime's rollout and trainer read slime's ``Sample`` fields and
compare ``status`` with slime's ``Sample.Status``. slime is not installed here: where a test needs it
importable, it puts the stand-in package ``tests/slime_standin/slime`` on sys.path (see its docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from trajbus.consumers.slime.sample_kind import SampleKind
from trajbus.consumers.slime.sample import Sample, Status
from trajbus.pipelines.slime import SlimeDataSource, SlimeSettings, samples_from_group
from trajbus.consumers.slime.samples import slime_sample_class
from trajbus.pipelines.slime.rollout_args import DynamicFilterVerdict, dynamic_filter
from trajbus.pipelines.slime.settle import InFlight, settle_groups
from trajbus.pipelines.slime.sglang import generate_rollout
from trajbus.streams.wire.ledger import ABANDONED, EMITTED
from trajbus.streams.wire.records import Step
from tests.unit.test_ledger import FakeLedger

STANDIN = Path(__file__).resolve().parents[1] / "slime_standin"


class BareArgs:
    """The ``args`` slime's contract test builds its data source from (``make_args``), attribute for attribute."""

    rollout_global_dataset = False
    buffer_filter_path = None
    n_samples_per_prompt = 2
    custom_rm_path = None
    group_rm = False
    rm_type = None
    reward_key = None


@pytest.fixture
def no_broker(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAJBUS_BOOTSTRAP_SERVERS", raising=False)
    monkeypatch.setenv("TRAJBUS_STATE_DIR", str(tmp_path / "no-broker-here"))


@pytest.fixture
def slime(monkeypatch):
    """slime importable: the stand-in on sys.path; its modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(STANDIN))
    yield importlib.import_module("slime.utils.types")
    for name in [name for name in sys.modules if name == "slime" or name.startswith("slime.")]:
        del sys.modules[name]


def standin_sample_class() -> type:
    """The stand-in's Sample, loaded from its file without making ``slime`` importable."""
    spec = importlib.util.spec_from_file_location("standin_types", STANDIN / "slime" / "utils" / "types.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sample


def slime_args(tmp_path, **overrides) -> argparse.Namespace:
    data = tmp_path / "prompts.jsonl"
    tools = [{"type": "function", "function": {"name": "calc"}}]
    data.write_text("".join(json.dumps({"text": f"q{i}", "label": str(i), "tools": tools}) + "\n" for i in range(6)))
    values = dict(prompt_data=str(data), input_key="text", label_key="label", tool_key="tools",
                  n_samples_per_prompt=2, rollout_global_dataset=True, rollout_shuffle=False, rollout_seed=42,
                  save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"), buffer_filter_path=None,
                  dynamic_sampling_filter_path=None, rollout_batch_size=2, over_sampling_batch_size=4)
    return argparse.Namespace(**{**values, **overrides})


def test_slime_builds_it_from_a_bare_args_and_without_a_broker_it_says_so_once_and_serves(no_broker, caplog):
    assert tuple(inspect.signature(SlimeDataSource.__init__).parameters)[:2] == ("self", "args")
    started = time.monotonic()
    source = SlimeDataSource(BareArgs())
    groups = source.get_samples(1)
    assert time.monotonic() - started < 5, "no broker configured: nothing waits for one"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "trajbus_bootstrap_servers" in warnings[0] and \
        "TRAJBUS_BOOTSTRAP_SERVERS" in warnings[0]
    assert [[(s.index, s.group_index, s.status) for s in g] for g in groups] == \
        [[(0, 0, Status.PENDING), (1, 0, Status.PENDING)]]
    assert len(source) == 0 and source.ledger is None
    assert (source.epoch_id, source.sample_offset, source.sample_index, source.due) == (0, 0, 2, []), \
        "where it stands, read as on slime's own data source"
    source.add_samples([[Sample(index=0), Sample(index=1)], [Sample(index=2), Sample(index=3)]])
    assert source.get_buffer_length() == 2 and [s.index for s in source.get_samples(1)[0]] == [0, 1]
    assert source.save(1) is None and source.load(1) is False, "nowhere to save: slime's args has no save"


def test_with_slime_importable_it_hands_out_slimes_own_sample_and_keeps_it_through_save_and_load(
        slime, no_broker, tmp_path):
    args = slime_args(tmp_path, buffer_filter_path="tests.slime_rollouts.newest_first")
    source = SlimeDataSource(args)
    groups = source.get_samples(3)
    samples = [s for g in groups for s in g]
    assert all(type(s) is slime.Sample for s in samples) and len(source) == 6
    assert all(s.status == slime.Sample.Status.PENDING for s in samples), "slime compares with its own enum"
    assert [(s.index, s.group_index, s.prompt, s.label) for s in groups[1]] == [(2, 1, "q1", "1"), (3, 1, "q1", "1")]
    assert samples[0].metadata["tools"][0]["function"]["name"] == "calc", "slime keeps a prompt's tools there"
    groups[0][0].status, groups[0][0].response = slime.Sample.Status.ABORTED, "half an ans"
    assert source.return_aborted(groups) == 1
    source.add_samples([groups[2]])
    assert source.save(3).exists()

    resumed = SlimeDataSource(args)
    assert resumed.load(3) and resumed.get_buffer_length() == 2
    served = resumed.get_samples(3)
    assert args.buffer_filter_calls == 1, "the buffer filter gets slime's own args"
    assert [g[0].index for g in served] == [4, 0, 6], "newest first from the buffer, then the dataset goes on"
    assert type(served[1][0]) is slime.Sample and served[1][0].status == slime.Sample.Status.ABORTED
    assert served[1][0].response == "half an ans" and served[1][1].status == slime.Sample.Status.PENDING


def test_without_slime_trajbus_sample_has_slimes_field_names_and_status_values(no_broker, tmp_path):
    assert slime_sample_class() is None, "slime is not installed here"
    theirs = standin_sample_class()
    assert {f.name for f in dataclasses.fields(theirs)} <= {f.name for f in dataclasses.fields(Sample)}
    assert [s.value for s in theirs.Status] == [s.value for s in Sample.Status]
    [group] = SlimeDataSource(slime_args(tmp_path)).get_samples(1)
    assert type(group[0]) is Sample and group[0].tools[0]["function"]["name"] == "calc"
    as_theirs = SampleKind(theirs).new(group[0])
    assert as_theirs.status == theirs.Status.PENDING and as_theirs.metadata["tools"] == group[0].tools
    back = SampleKind(Sample).restore(theirs(index=3, status=theirs.Status.TRUNCATED).to_dict())
    assert (back.index, back.status) == (3, Status.TRUNCATED)


def test_a_settled_rollout_returns_its_surplus_and_aborted_groups_to_the_buffer(no_broker, tmp_path):
    args = slime_args(tmp_path, dynamic_sampling_filter_path="tests.slime_rollouts.drop_label_3",
                      trajbus_rollout_function_path="tests.slime_rollouts.sglang_like")
    source = SlimeDataSource(args)
    batch = generate_rollout(args, 0, source).samples
    assert [g[0].label for g in batch] == ["0", "1"] and source.in_flight == {}
    surplus, aborted = source.buffer
    assert [(s.status, s.response) for s in surplus] == [(Status.COMPLETED, "answer to q2")] * 2
    assert [(s.status, s.response, s.label) for s in aborted] == [(Status.PENDING, "", "3")] * 2, \
        "an aborted group goes back as it was handed out"
    batch = generate_rollout(args, 1, source).samples
    assert [g[0].label for g in batch] == ["2", "4"], "the surplus group is trained as it was; 3 is filtered"
    assert [g[0].label for g in source.buffer] == ["5"], "5 finished after the batch was full"
    assert generate_rollout(args, 2, source, evaluation=True).samples and source.in_flight == {}, \
        "evaluation runs the inner rollout as it is, outside any rollout's settling"


def test_the_rule_matches_a_trained_group_by_index_when_the_rollout_built_new_samples():
    def flight(index: int, status: Status, reward: float | None) -> InFlight:
        group = [Sample(index=index, status=status, reward=reward, label=str(index))]
        return InFlight(group, group, f"u{index}")

    flights = [flight(0, Status.COMPLETED, 1.0), flight(1, Status.COMPLETED, 1.0), flight(2, Status.COMPLETED, 0.0),
               flight(3, Status.ABORTED, None), flight(4, Status.COMPLETED, None)]
    copies = [[Sample(index=0)]]  # a rollout that returned new objects, carrying the index
    args = argparse.Namespace(dynamic_sampling_filter_path="tests.slime_rollouts.drop_label_3")

    def all_but_label_2(group: list[Sample]) -> DynamicFilterVerdict:
        return DynamicFilterVerdict(group[0].label != "2", "two")

    settled = settle_groups(flights, copies, Status, all_but_label_2)
    assert [f.prompt_uid for f in settled.trained] == ["u0"] and [f.prompt_uid for f in settled.surplus] == ["u1"]
    assert [(f.prompt_uid, why) for f, why in settled.filtered] == [("u2", "filtered: two")]
    assert [f.prompt_uid for f in settled.aborted] == ["u3", "u4"], "a sample without its reward is not finished"
    assert dynamic_filter(args)([Sample(label="3")]) == DynamicFilterVerdict(False, "label_3")
    assert dynamic_filter(argparse.Namespace())([Sample(label="3")]) == DynamicFilterVerdict(True)


def test_without_the_settling_rollout_a_checkpoint_counts_what_was_handed_out_before_it(
        no_broker, tmp_path, monkeypatch):
    ledger = FakeLedger()
    ledger.topic, ledger.close = "t.prompts.train", lambda: None

    def open_ledger(settings, policy_version):
        ledger.policy_version = policy_version
        return ledger

    monkeypatch.setattr(SlimeSettings, "open_ledger", open_ledger)
    args = slime_args(tmp_path)
    source = SlimeDataSource(args)
    before = source.get_samples(2)
    source.save(0)
    after = source.get_samples(2)  # then the run dies
    outcomes = {uid: o.outcome for uid, o in ledger.view.outcomes.items()}
    assert outcomes == {g[0].prompt_uid: EMITTED for g in before}, "consumed before the checkpoint, as slime counts"

    resumed = SlimeDataSource(args)
    assert resumed.load(0)
    assert {uid: ledger.view.dropped_for(uid) for uid in (g[0].prompt_uid for g in after)} == \
        {g[0].prompt_uid: ABANDONED for g in after}
    again = resumed.get_samples(3)
    assert [g[0].prompt_uid for g in again[:2]] == [g[0].prompt_uid + "~1" for g in after]
    assert [g[0].label for g in again] == ["2", "3", "4"], "then the dataset goes on after the last handed out"


def test_settings_come_from_the_custom_config_yaml_keys_then_the_environment(monkeypatch):
    args = argparse.Namespace(n_samples_per_prompt=8)
    for key, value in yaml.safe_load("trajbus_channel: val\ntrajbus_ledger_timeout: 5\n").items():
        setattr(args, key, value)  # what slime does with every key of --custom-config-path
    monkeypatch.setenv("TRAJBUS_SLIME_PREFIX", "exp1")
    monkeypatch.setenv("TRAJBUS_SLIME_CHANNEL", "ignored")
    settings = SlimeSettings.from_args(args)
    assert (settings.channel, settings.ledger_timeout, settings.prefix, settings.settled_by) == \
        ("val", 5.0, "exp1", "rollout")
    with pytest.raises(ValueError, match=r"trajbus_bootstrap_server: not a trajbus setting .*known: "
                                         r"trajbus_bootstrap_servers"):
        SlimeSettings.from_args(argparse.Namespace(trajbus_bootstrap_server="h:9092"))
    with pytest.raises(ValueError, match="trajbus_settled_by: expected one of rollout, worker, got 'nobody'"):
        SlimeSettings.from_args(argparse.Namespace(trajbus_settled_by="nobody"))
    monkeypatch.setenv("TRAJBUS_SLIME_LEDGER_TIMEOUT", "-1")
    with pytest.raises(ValueError, match=r"\$TRAJBUS_SLIME_LEDGER_TIMEOUT: expected a positive number"):
        SlimeSettings.from_args(argparse.Namespace())


def test_an_assembled_group_becomes_slime_samples_one_per_trajectory(slime):
    def step(uid: str, index: int, prompt: list[int], response: list[int], **fields) -> Step:
        return Step(prompt, response, uid, "pu", index, rollout_log_probs=[-0.5] * len(response), **fields)

    steps = [step("t0", 0, [1, 2], [3, 4], policy_version=1),
             step("t0", 1, [1, 2, 3, 4, 9], [5], reward=1.0, policy_version=2, is_last=True,
                  metadata={"finish_reason": "stop"}),
             step("t1", 0, [1, 2], [7, 8], is_last=True, metadata={"finish_reason": "length"})]
    dispatched = [slime.Sample(index=4, group_index=2, prompt="q", label="x", metadata={"id": 1}),
                  slime.Sample(index=5, group_index=2, prompt="q", label="x", metadata={"id": 1})]
    first, second = samples_from_group(steps, dispatched)
    assert type(first) is slime.Sample
    assert (first.tokens, first.response_length, first.loss_mask) == ([1, 2, 3, 4, 9, 5], 4, [1, 1, 0, 1])
    assert first.rollout_log_probs == [-0.5, -0.5, 0.0, -0.5] and first.reward == 1.0
    assert (first.status, second.status) == (slime.Sample.Status.COMPLETED, slime.Sample.Status.TRUNCATED)
    assert [(s.index, s.rollout_id, s.group_index, s.label) for s in (first, second)] == [(4, 4, 2, "x"),
                                                                                        (5, 5, 2, "x")]
    assert first.weight_versions == ["1", "2"] and second.metadata == {"id": 1, "trajectory_uid": "t1"}
    with pytest.raises(ValueError, match="prompt_uid pu: 2 trajectories, but 1 samples were handed out"):
        samples_from_group(steps, dispatched[:1])
