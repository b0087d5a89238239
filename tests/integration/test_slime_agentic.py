"""slime's agentic rollout (``trajbus.pipelines.slime.agentic.generate_rollout``): agents through the gateway,
the groups the worker assembled back as slime Samples, and a kill -9 of slime's loop resumed from its checkpoint.

One scripted engine, one stream worker and one gateway serve the whole file (a channel per test). The
engine answers, in turn, a calculator tool call and a final answer, so the calculator agents' trajectories
have zero, one or two tool turns; the agents run 16 at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.replay import Replay
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.processes import ServiceProcess
from trajbus.pipelines.slime import SlimeDataSource
from trajbus.pipelines.slime.agentic import close, generate_rollout
from trajbus.pipelines.slime.harness import SAMPLE_INDEX
from trajbus.streams.wire.records import ReadyGroup, Step
from trajbus.streams.wire.topics import groups_topic
from tests.helpers import agent_stack, audit_report, end_offsets, wait_for
from tests.lifecycle_driver import prompt_of
from tests.slime_agentic_driver import GATE

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "slime_standin"
CHANNELS = ("slime", "slimekill", "slimeval", "slimecontract")
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
REPLIES = [TOOL_CALL, "It is 42."]


@dataclass
class Stack:
    servers: str
    prefix: str
    gateway_url: str
    tokenizer_path: Path


@pytest.fixture(scope="module")
def stack(bootstrap_servers: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prefix, logs = f"t{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("slime-agentic")
    with agent_stack(bootstrap_servers, prefix, CHANNELS, tiny_model_dir, logs, REPLIES,
                     ["--prompt-length", "2048", "--response-length", "128", "--health-interval", "0.5"]) as (url, _):
        yield Stack(bootstrap_servers, prefix, url, tiny_model_dir)


@pytest.fixture
def slime_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    """slime importable (the stand-in: its ``Sample`` and rollout outputs); forgotten afterwards."""
    monkeypatch.syspath_prepend(str(STANDIN))
    from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
    from slime.utils.types import Sample

    yield SimpleNamespace(Sample=Sample, TrainOutput=RolloutFnTrainOutput, EvalOutput=RolloutFnEvalOutput)
    for name in [name for name in sys.modules if name == "slime" or name.startswith("slime.")]:
        del sys.modules[name]


def write_prompts(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"question": f"What is 6 * 7? ({i})", "answer": "42" if i % 2 else "41"})
                            + "\n" for i in range(count)))
    return path


def slime_args(stack: Stack, tmp_path: Path, channel: str, prompts: int, **overrides: Any) -> dict[str, Any]:
    """slime's args as its loop has them, the trajbus_* keys as its --custom-config-path YAML sets them."""
    return {"prompt_data": str(write_prompts(tmp_path / f"{channel}.jsonl", prompts)), "input_key": "question",
            "label_key": "answer", "n_samples_per_prompt": 4, "rollout_batch_size": 16,
            "rollout_global_dataset": True, "rollout_max_response_len": 96, "rollout_temperature": 1.0,
            "trajbus_bootstrap_servers": stack.servers, "trajbus_prefix": stack.prefix, "trajbus_channel": channel,
            "trajbus_settled_by": "worker", "trajbus_gateway_url": stack.gateway_url,
            "trajbus_agent_concurrency": 16, "trajbus_eval_channel": "slimeval", "trajbus_group_timeout": 60,
            **overrides}


def groups_on_topic(stack: Stack, channel: str) -> dict[str, ReadyGroup]:
    with BatchConsumer(channel, stack.servers, prefix=stack.prefix, group_id=f"{stack.prefix}.check",
                       rank=0, world_size=1) as reader:
        return {group.prompt_uid: group for group in reader.drain(timeout=30)}


def zero_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of zeros."""
    runs, start = [], None
    for position, bit in enumerate([*mask, 1]):
        if bit == 0 and start is None:
            start = position
        elif bit == 1 and start is not None:
            runs.append((start, position))
            start = None
    return runs


def assert_the_trajectory(sample: Any, trajectory: list[Step], tokenizer: Any) -> None:
    """The sample is the trajectory's steps token for token; its mask is 0 on exactly the tool turns."""
    first, last = trajectory[0], trajectory[-1]
    start = len(first.prompt_ids)
    assert sample.tokens == list(last.prompt_ids) + list(last.response_ids), "prompt and every turn, as captured"
    assert sample.response_length == len(sample.tokens) - start == len(sample.loss_mask)
    spans = [(len(s.prompt_ids) - start, len(s.prompt_ids) - start + len(s.response_ids)) for s in trajectory]
    assert sample.loss_mask == [int(any(a <= k < b for a, b in spans)) for k in range(sample.response_length)]
    runs = zero_runs(sample.loss_mask)
    assert len(runs) == len(trajectory) - 1, "one masked run between two calls"
    for (a, b), step in zip(runs, trajectory):
        assert "<tool_call>" in tokenizer.decode(step.response_ids), "the call before a masked run called the tool"
        masked = tokenizer.decode(sample.tokens[start + a:start + b])
        assert "<tool_response>\n42\n</tool_response>" in masked and "<tool_call>" not in masked, masked
    log_probs = [p for s in trajectory for p in s.rollout_log_probs]
    assert [p for p, bit in zip(sample.rollout_log_probs, sample.loss_mask) if bit] == pytest.approx(log_probs)
    assert all(p == 0.0 for p, bit in zip(sample.rollout_log_probs, sample.loss_mask) if not bit)
    assert sample.reward == last.reward and sample.index == first.metadata[SAMPLE_INDEX]


def test_agents_through_the_gateway_come_back_as_the_groups_the_worker_assembled(stack, slime_standin, tmp_path):
    eval_data = write_prompts(tmp_path / "eval.jsonl", 3)
    args = argparse.Namespace(**slime_args(
        stack, tmp_path, "slime", 40, rollout_batch_size=8, over_sampling_batch_size=10,
        hf_checkpoint=str(stack.tokenizer_path),
        dynamic_sampling_filter_path="tests.slime_agentic_driver:every_fifth_group",
        trajbus_agent_path="tests.slime_agentic_driver:calculator_agent_crashing_once",
        eval_datasets=[SimpleNamespace(name="calc", path=str(eval_data), n_samples_per_eval_prompt=2)]))
    source = SlimeDataSource(args)
    try:
        outputs = [generate_rollout(args, rollout_id, source) for rollout_id in (0, 1)]
        evaluation = generate_rollout(args, 2, source, evaluation=True)
    finally:
        close(source)
        source.close()

    tokenizer = AutoTokenizer.from_pretrained(stack.tokenizer_path)
    on_topic = groups_on_topic(stack, "slime")
    tool_turns = 0
    for output in outputs:
        assert type(output) is slime_standin.TrainOutput
        assert [len(group) for group in output.samples] == [4] * 8
        for group in output.samples:
            assert group[0].group_index % 5 != 0 and len({s.prompt_uid for s in group}) == 1
            steps = on_topic[group[0].prompt_uid].steps
            for sample in group:
                assert type(sample) is slime_standin.Sample and sample.status == sample.Status.COMPLETED
                trajectory = [s for s in steps if s.trajectory_uid == sample.metadata["trajectory_uid"]]
                assert_the_trajectory(sample, trajectory, tokenizer)
                tool_turns += len(trajectory) - 1
    assert tool_turns > 0, "some trajectories called the tool"
    trained = [g[0].group_index for output in outputs for g in output.samples]
    assert len(set(trained)) == 16 and not any(offset % 5 == 0 for offset in trained), "each kept prompt once"
    assert 3 in trained and sum(output.metrics.get("rollout/trajbus/groups_failed", 0) for output in outputs) == 1, \
        "the group whose agent crashed was given up, and handed out again from the buffer"
    with PromptLedger(stack.servers, "slime", stack.prefix) as ledger:
        ledger.refresh()
        filtered = [prompt_of(uid) for uid in ledger.view.dispatched
                    if ledger.view.dropped_for(uid) == "filtered: every_5th"]
        handed_out = len(ledger.view.dispatched)
        given_up = [uid for uid in ledger.view.dispatched if ledger.view.dropped_for(uid) == "abandoned"]
    assert [prompt_of(uid) for uid in given_up] == [3] and ledger.view.reissued[given_up[0]].startswith("buffer/")
    drops = sum(output.metrics.get("rollout/dynamic_filter/drop_every_5th", 0) for output in outputs)
    assert drops == len(filtered) > 0 and all(offset % 5 == 0 for offset in filtered), \
        "each group the filter dropped counted in slime's metric and recorded with its reason"
    assert handed_out >= 18, "rollout 1 handed out a round of --over-sampling-batch-size 10 for a batch of 8"
    code, report = audit_report(stack.servers, stack.prefix, "slime", "--live")  # groups still in flight
    assert (code, report["steps"], report["violations"]) == (0, 2, []), report["violations"]
    with Replay("slime", stack.servers, prefix=stack.prefix) as replay:
        for rollout_id, output in enumerate(outputs):
            assert [g.prompt_uid for g in replay.batch_of_step(rollout_id)] == \
                [group[0].prompt_uid for group in output.samples], "each rollout's batch, in its order"

    assert type(evaluation) is slime_standin.EvalOutput
    calc = evaluation.data["calc"]
    assert [s.index for s in calc["samples"]] == list(range(6)) and len(calc["rewards"]) == len(calc["truncated"]) == 6
    assert calc["rewards"] == [s.reward for s in calc["samples"]] and not any(calc["truncated"])


class ContractDataSource:
    """The data source slime's rollout contract test gives a rollout function: groups of 2 finished samples."""

    def __init__(self, sample_class: type) -> None:
        self.sample_class, self.next_index = sample_class, 0

    def get_samples(self, num_samples: int) -> list[list[Any]]:
        groups = []
        for _ in range(num_samples):
            groups.append([self.sample_class(index=self.next_index + i, prompt=f"prompt-{self.next_index + i}",
                                             tokens=[1, 2], response_length=2, reward=0.0, metadata={},
                                             status=self.sample_class.Status.COMPLETED) for i in range(2)])
            self.next_index += 2
        return groups


def test_args_none_as_slimes_contract_test_calls_it(stack, slime_standin, monkeypatch):
    for name, value in {"TRAJBUS_BOOTSTRAP_SERVERS": stack.servers, "TRAJBUS_SLIME_PREFIX": stack.prefix,
                        "TRAJBUS_SLIME_CHANNEL": "slimecontract", "TRAJBUS_SLIME_EVAL_CHANNEL": "slimeval",
                        "TRAJBUS_SLIME_GATEWAY_URL": stack.gateway_url}.items():
        monkeypatch.setenv(name, value)
    source = ContractDataSource(slime_standin.Sample)
    try:
        train = generate_rollout(None, 2, source, evaluation=False)
        evaluation = generate_rollout(None, 2, source, evaluation=True)
    finally:
        close(source)
    assert type(train) is slime_standin.TrainOutput and len(train.samples) == 1
    assert type(evaluation) is slime_standin.EvalOutput and list(evaluation.data) == ["data_source"]
    samples = train.samples[0] + evaluation.data["data_source"]["samples"]
    assert [len(train.samples[0]), len(evaluation.data["data_source"]["rewards"])] == [2, 2]
    for sample in samples:  # slime's assert_sample_contract
        assert type(sample) is slime_standin.Sample and isinstance(sample.response, str)
        assert sample.tokens and all(type(token) is int for token in sample.tokens)
        assert type(sample.response_length) is int and sample.reward is not None
        assert isinstance(sample.status, slime_standin.Sample.Status) and sample.rollout_id == sample.index


def driver(stack: Stack, tmp_path: Path, args_file: Path, checkpoints: Path, gate: Path | None = None
           ) -> ServiceProcess:
    count = len(list(tmp_path.glob("loop*.log")))
    env = {"PYTHONPATH": str(ROOT), **({GATE: str(gate)} if gate is not None else {})}
    return ServiceProcess(["--args", str(args_file), "--checkpoint-dir", str(checkpoints), "--last-rollout", "2"],
                          tmp_path / f"loop{count}.log", env=env, module="tests.slime_agentic_driver").start()


def said(process: ServiceProcess, line: str) -> bool:
    return line in process.log_file.read_text().splitlines()


def test_a_kill_9_after_rollout_1_resumed_from_load_1_trains_every_prompt_once(stack, tmp_path):
    checkpoints = tmp_path / "ckpt"
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps(slime_args(
        stack, tmp_path, "slimekill", 32, save=str(checkpoints), load=str(checkpoints),
        trajbus_agent_path="tests.slime_agentic_driver:gated_calculator_agent")))
    topic = groups_topic("slimekill", stack.prefix)
    gate = tmp_path / "gate"
    loop = driver(stack, tmp_path, args_file, checkpoints, gate)
    try:
        wait_for(lambda: said(loop, "saved 1") or not loop.alive(), 60, "rollout 1 trained and saved")
        wait_for(lambda: (sum(end_offsets(stack.servers, topic)) >= 20 and gate.with_suffix(".waiting").exists())
                 or not loop.alive(), 60, "4 groups of rollout 2 ready and agents of its last 8 at the gate")
        assert loop.alive(), loop.log_tail()
        loop.kill()  # mid rollout 2: groups ready, read or not, and the gated groups cut (their agents wait)
        assert not said(loop, "saved 2")
        gate.touch()
        loop = driver(stack, tmp_path, args_file, checkpoints, gate)
        wait_for(lambda: said(loop, "done") or not loop.alive(), 90, "the resumed loop to finish")
        assert said(loop, "done"), loop.log_tail()
    finally:
        loop.kill()

    trained = json.loads((checkpoints / "checkpoint.json").read_text())["trained"]
    assert sorted(prompt_of(uid) for uid in trained) == list(range(32)), "every prompt of the epoch, once"
    assert all("-e0-" in uid for uid in trained), "no prompt of the next epoch took the place of one"
    metrics = json.loads(next(line for line in loop.log_file.read_text().splitlines()
                              if line.startswith("rollout 2 metrics ")).split(" ", 3)[3])
    assert metrics["rollout/trajbus/groups_resumed"] > 0, "groups ready before the kill were read again"
    with PromptLedger(stack.servers, "slimekill", stack.prefix) as ledger:
        ledger.refresh()
        reissued = [d for d in ledger.view.dispatched.values() if d.source == "reissue"]
        abandoned = [uid for uid in ledger.view.dispatched if ledger.view.dropped_for(uid) == "abandoned"]
    assert reissued and {d.origin for d in reissued} == set(abandoned), "the groups cut by the kill, once more"
    assert not {d.prompt_uid for d in reissued} & set(abandoned) and not set(abandoned) & set(trained)
