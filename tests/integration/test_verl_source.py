"""verl's fully-async trainer fed by trajbus's ready groups (``TRAJBUS_VERL_QUEUE=groups``).

Multi-turn tool-calling agents go through the gateway (scripted engine); the worker assembles their
prompt groups; ``DurableMessageQueue`` hands them out as the pickled ``RolloutSample``s verl's rollouter
puts, and verl's own ``assemble_batch_from_rollout_samples`` turns them into the training batch: the
tensors are ``BatchConsumer.fetch_dataproto``'s, the uids group GRPO's rollouts, the policy versions
reach ``min_global_steps`` / ``max_global_steps``. Handing out a version's last sample publishes the
trainer's version (the gateway tags the next calls with it). The run trains one row per trajectory; a
run resumed from a checkpoint, one row per LLM call, gets exactly the groups handed out after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from pathlib import Path

import httpx
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from trajbus.consumers import BatchConsumer
from trajbus.consumers.backends import VerlBackend
from trajbus.consumers.verl.queue import DurableMessageQueue
from trajbus.infra.bootstrap import ENV_VAR
from trajbus.infra.tiny_model import WEATHER_TOOL
from trajbus.infra.group_lag import consumer_group_lag
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.wire.topics import groups_topic, trainer_group_id
from tests.helpers import audit_report, wait_for
from tests.integration.test_multi_turn import TOOL_REPLY, agent, chat

ANSWER = "It is sunny."
PROMPT_LENGTH, RESPONSE_LENGTH = 1024, 512


def trainer_config(tmp_path: Path, model: Path):
    return OmegaConf.create({
        "trainer": {"project_name": "p", "experiment_name": "e", "resume_mode": "auto",
                    "default_local_dir": str(tmp_path / "checkpoints"), "balance_batch": False},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 1}, "model": {"path": str(model)}},
        "async_training": {"require_batches": 1, "trigger_parameter_sync_step": 1},  # each sample ends a version
        "data": {"max_prompt_length": PROMPT_LENGTH, "max_response_length": RESPONSE_LENGTH},
    })


class Agent:
    """One rollout: a tool call, the tool's answer, a reply."""

    def __init__(self, gateway: str, prompt_uid: str) -> None:
        self.trajectory = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": prompt_uid, "n_rollouts": 2}
                                     ).json()
        self.client = agent(self.trajectory["base_url"])
        self.messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    def call_tool(self) -> None:
        reply = chat(self.client, self.messages, stream=False, tools=[WEATHER_TOOL])
        self.messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "sunny"}]

    def answer(self, reward: float) -> None:
        assert chat(self.client, self.messages, stream=False, tools=[WEATHER_TOOL])["content"] == ANSWER
        done = httpx.post(f"{self.trajectory['base_url']}/complete_trajectory", json={"reward": reward})
        assert done.status_code == 200


def reference(bootstrap_servers: str, prefix: str, name: str, pad: int, row_mode: str, **options) -> BatchConsumer:
    """A consumer group of its own: the same groups, converted by ``fetch_dataproto``."""
    return BatchConsumer("train", bootstrap_servers, prefix=prefix, group_id=f"{prefix}.{name}",
                         backend=VerlBackend(PROMPT_LENGTH, RESPONSE_LENGTH, pad, row_mode=row_mode), **options)


def check_batch(batch, expected: list, rollouts: dict[str, list[Agent]], versions: list[tuple[int, int]],
                turns: int) -> None:
    """verl's assembled batch: ``fetch_dataproto``'s tensors, rows grouped by prompt (``uid``), and the
    policy versions of alpha's rows (its first turns sampled by version 0, its answers by version 1)."""
    keys = set(expected[0].batch.keys())
    assert set(batch.batch.keys()) == keys >= {
        "prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "rm_scores",
        "rollout_log_probs", "token_policy_version", "token_staleness"}
    for key in keys:
        assert torch.equal(batch.batch[key], torch.cat([e.batch[key] for e in expected])), key
    columns = batch.non_tensor_batch
    rows = len(versions)  # of each prompt
    assert Counter(columns["uid"]) == {f"uid_{name}": rows for name in rollouts}
    for name, agents in rollouts.items():
        own = columns["uid"] == f"uid_{name}"
        assert sorted(set(columns["trajectory_uid"][own])) == sorted(a.trajectory["trajectory_uid"] for a in agents)
    alpha = columns["uid"] == "uid_alpha"
    assert list(zip(columns["min_global_steps"][alpha], columns["max_global_steps"][alpha])) == versions
    assert set(columns["min_global_steps"][~alpha]) | set(columns["max_global_steps"][~alpha]) <= {0}
    alpha_rows = torch.from_numpy(alpha)
    sampled = batch.batch["response_mask"][alpha_rows].bool()
    assert set(batch.batch["token_staleness"][alpha_rows][sampled].tolist()) == {0, 1}  # at trainer version 1
    assert list(columns["__num_turns__"]) == [turns] * len(columns["uid"])
    assert batch.meta_info["fully_async/partial/total_partial_num"] == sum(low != high for low, high in versions)
    assert len(columns["processing_times"]) == len(columns["tool_calls_times"]) == len(columns["uid"])


def test_verl_trains_on_the_gateways_groups_as_its_rollouter_would_have_put_them(
        bootstrap_servers, prefix, scripted_engine, start_gateway, start_worker, tiny_model_dir, tmp_path,
        monkeypatch):
    from ray import cloudpickle
    from verl.experimental.fully_async_policy.detach_utils import assemble_batch_from_rollout_samples

    for name, value in {ENV_VAR: bootstrap_servers, "TRAJBUS_VERL_QUEUE": "groups", "TRAJBUS_VERL_PREFIX": prefix,
                        "TRAJBUS_VERL_CHANNEL": "train", "TRAJBUS_VERL_ROW_MODE": "trajectory"}.items():
        monkeypatch.setenv(name, value)
    with StepProducer(bootstrap_servers, prefix=prefix) as producer:
        producer.provision("train")
    engine, _ = scripted_engine([TOOL_REPLY] * 3 + [ANSWER, TOOL_REPLY] + [ANSWER] * 3)  # in the order called below
    gateway, _ = start_gateway([engine], ["--prompt-length", "1024", "--response-length", "256"])
    start_worker(n_rollouts=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = trainer_config(tmp_path, tiny_model_dir)
    loop = asyncio.new_event_loop()

    def get_sample(queue: DurableMessageQueue):
        sample, _remaining = loop.run_until_complete(asyncio.wait_for(queue.get_sample(), 60))
        return cloudpickle.loads(sample)

    def trainer_version(version: int) -> None:
        wait_for(lambda: httpx.get(f"{gateway}/statistics").json()["policy_versions"].get("train") == version, 30,
                 f"the gateway to learn the trainer's version {version}")

    try:
        with contextlib.ExitStack() as stack:
            queue = DurableMessageQueue(config, max_queue_size=8)
            stack.callback(queue.close)
            trajectories = stack.enter_context(reference(bootstrap_servers, prefix, "trajectories", pad, "trajectory"))
            alpha = [Agent(gateway, "alpha") for _ in range(2)]
            beta = [Agent(gateway, "beta") for _ in range(2)]
            for rollout in alpha:  # alpha's first turns under version 0 ...
                rollout.call_tool()
            for rollout, reward in zip(beta, (1.0, 0.0)):
                rollout.call_tool()
                rollout.answer(reward)
            first = get_sample(queue)  # beta's, at version 0: handing it out ends version 0
            expected = [trajectories.fetch_dataproto(1, timeout=60, current_version=0)]
            trainer_version(1)
            for rollout, reward in zip(alpha, (0.5, 1.0)):  # ... their answers under version 1
                rollout.answer(reward)
            second = get_sample(queue)
            expected.append(trajectories.fetch_dataproto(1, timeout=60, current_version=1))
            trainer_version(2)
            assert loop.run_until_complete(queue.get_queue_size()) == 0
        lag = consumer_group_lag(bootstrap_servers, trainer_group_id("train", prefix), groups_topic("train", prefix))
        assert sum(p.committed or 0 for p in lag) == 2 and sum(p.lag for p in lag) == 0  # committed at each version

        assert [first.sample_id, second.sample_id, first.epoch] == ["beta", "alpha", 0]
        batch = assemble_batch_from_rollout_samples([first, second], tokenizer, config, None)
        check_batch(batch, expected, {"beta": beta, "alpha": alpha}, [(0, 1)] * 2, turns=4)
        assert batch.meta_info["fully_async/count/total_generated_samples"] == 1

        checkpoint = Path(config.trainer.default_local_dir)  # the trainer resumes from global_step_1 ...
        (checkpoint / "global_step_1").mkdir(parents=True)
        (checkpoint / "latest_checkpointed_iteration.txt").write_text("1")
        monkeypatch.setenv("TRAJBUS_VERL_ROW_MODE", "step")  # ... with one row per LLM call
        with contextlib.ExitStack() as stack:
            resumed = DurableMessageQueue(config, max_queue_size=8)
            stack.callback(resumed.close)
            steps = stack.enter_context(reference(bootstrap_servers, prefix, "steps", pad, "step",
                                                  keep=lambda prompt_uid: prompt_uid == "alpha"))
            again = get_sample(resumed)  # handed out after the checkpoint: handed out again, beta not
            assert again.sample_id == "alpha" and loop.run_until_complete(resumed.get_queue_size()) == 0
            expected = [steps.fetch_dataproto(1, timeout=60, current_version=1)]
        batch = assemble_batch_from_rollout_samples([again], tokenizer, config, None)
        check_batch(batch, expected, {"alpha": alpha}, [(0, 0), (1, 1)] * 2, turns=2)
        code, report = audit_report(bootstrap_servers, prefix)  # each version a step, the resumed one once
        assert (code, report["steps"], report["violations"]) == (0, 2, []), report["violations"]
        assert {fate["prompt_uid"]: fate["steps"] for fate in report["prompts"]} == {"beta": [1], "alpha": [2]}
    finally:
        loop.close()
