"""verl's default trainer (V1) on trajbus: an agent-loop manager chosen by one key of verl's command.

    python -m verl.trainer.main_ppo ... \\
        +actor_rollout_ref.rollout.agent.agent_loop_manager_class=trajbus.VerlAgentLoopManager

verl's ``TaskRunnerV1.init_agent_loop_manager`` builds the class that key names with ``create(config=,
llm_client=, teacher_client=, reward_loop_worker_handles=)`` and then only calls
``generate_sequences(prompts)``, which must not block: the trainer registered the prompts in
TransferQueue and samples them from there once they are ``finished`` or ``failure``.

Each prompt becomes a prompt group: ``rollout.n`` trajectories (``val_kwargs.n`` when validating), one
agent each (``TRAJBUS_VERL_AGENT``) talking to the model through trajbus's gateway, which records every
call token-exactly. The stream worker assembles the group; the feeder (``pipelines.verl.feeder``) writes
it into TransferQueue in verl's layout and tags the prompt. Training prompts are recorded on the
channel's prompt ledger first, so a prompt whose group was ready before a crash is written again from
Kafka, not generated again (``pipelines.verl.dispatches``). Validation goes through its own channel.

The gateway is the user's (``TRAJBUS_VERL_GATEWAY_URL``) or the manager's own, at verl's inference
servers (``pipelines.verl.services``). Before each training step's prompts go out, the manager publishes
the policy version verl's servers hold (the step before: verl updates them after each step), which the
gateway stamps on every token and paces by.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from trajbus.consumers.trained_log import GrowingSteps, StepRecorder, TrainedLog
from trajbus.consumers.verl.settings import VerlQueueSettings
from trajbus.infra.bootstrap import resolve_bootstrap_servers
from trajbus.infra.dotted import import_dotted
from trajbus.pipelines.ledger import PromptLedger
from trajbus.pipelines.slime.harness import AgentHarness
from trajbus.pipelines.verl.dispatches import Dispatches, Draw
from trajbus.pipelines.verl.feeder import GroupFeeder
from trajbus.pipelines.verl.services import OwnServices, engine_addresses
from trajbus.streams.client.policy import PolicyVersionPublisher
from trajbus.streams.client.producer import StepProducer
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.wire.topics import groups_topic

__all__ = ["VerlAgentLoopManager", "VerlSample"]

log = logging.getLogger("trajbus.verl")

SETTLE_TIMEOUT = 120.0
"""Seconds the worker may take to settle what a crashed run left open."""
NOT_STORED = ("agent_name", "validate", "__rollout_n__", "__do_sample__")
"""Batch keys verl's agent loop consumes and does not put into TransferQueue."""


@dataclass
class VerlSample:
    """One rollout of a verl prompt, as an agent gets it (``pipelines.slime.agents``' contract)."""

    prompt: Any
    """verl's ``raw_prompt``: the chat messages."""
    label: Any
    """The ground truth (``reward_model.ground_truth``), what the gateway's answer_match compares with."""
    index: int
    """The session: which of the prompt's rollouts this is."""
    fields: dict[str, Any] = field(default_factory=dict)


def run_name(config: Any) -> str:
    """``{project}/{experiment}`` of verl's trainer config: what a resumed run shares with its crashed one."""
    trainer = config.trainer
    name = f"{trainer.get('project_name') or 'verl'}/{trainer.get('experiment_name') or 'default'}"
    return re.sub(r"[^A-Za-z0-9._/-]", "-", name)


def prompt_rows(batch: Any) -> list[dict[str, Any]]:
    """Each prompt of verl's batch as a dict, as verl's agent-loop worker splits it."""
    import torch
    from tensordict import NonTensorData, NonTensorStack

    rows: list[dict[str, Any]] = [{} for _ in range(len(batch))]
    for key, value in batch.items():
        for i, row in enumerate(rows):
            if isinstance(value, torch.Tensor):
                row[key] = value[i]
            elif isinstance(value, NonTensorStack):
                row[key] = value[i].data
            elif isinstance(value, NonTensorData):
                row[key] = value.data
    return rows


def ground_truth(prompt: dict[str, Any]) -> Any:
    reward_model = prompt.get("reward_model")
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


class VerlAgentLoopManager:
    """verl V1's ``agent_loop_manager_class`` (module docstring)."""

    @classmethod
    def create(cls, config: Any, llm_client: Any = None, teacher_client: Any = None,
               reward_loop_worker_handles: Any = None, **_: Any) -> "VerlAgentLoopManager":
        """verl's constructor call (``TaskRunnerV1.init_agent_loop_manager``)."""
        return cls(config, llm_client)

    def __init__(self, config: Any, llm_client: Any = None, settings: VerlQueueSettings | None = None) -> None:
        import transfer_queue as tq

        self.config, self.settings = config, settings or VerlQueueSettings.from_env()
        self.bootstrap_servers = resolve_bootstrap_servers()
        channels = {"train": self.settings.channel, "val": self.settings.val_channel}
        with StepProducer(self.bootstrap_servers, settings=TopicSettings(prefix=self.settings.prefix)) as producer:
            for channel in channels.values():  # the gateway refuses a channel whose topics do not exist
                producer.provision(channel)
        self.services: OwnServices | None = None
        self.feeders: dict[str, GroupFeeder] = {}
        self.harness: AgentHarness | None = None
        self.ledger = PromptLedger(self.bootstrap_servers, channels["train"], self.settings.prefix)
        self.trained = TrainedLog(self.bootstrap_servers, channels["train"], self.settings.prefix)
        try:
            gateway_url = self.settings.gateway_url or self._own_services(list(channels.values()), llm_client)
            self.dispatches = Dispatches(self.ledger, run_name(config))
            steps = GrowingSteps(StepRecorder(self.trained, run_name(config), "verl_v1",
                                              groups_topic(channels["train"], self.settings.prefix)))
            self.feeders = {
                "train": GroupFeeder(self.bootstrap_servers, self.settings.prefix, channels["train"], "train",
                                     self.dispatches, tq, steps),
                "val": GroupFeeder(self.bootstrap_servers, self.settings.prefix, channels["val"], "val", None, tq)}
            self.dispatches.settle_previous(SETTLE_TIMEOUT)
            for feeder in self.feeders.values():
                feeder.start()
            agent = import_dotted(self.settings.agent, "TRAJBUS_VERL_AGENT")
            self.harness = AgentHarness(gateway_url, agent, self.settings.agent_concurrency,
                                        self.settings.gateway_api_key)
            self.publisher = PolicyVersionPublisher(self.bootstrap_servers, self.settings.prefix, channels["train"])
        except BaseException:
            self.close()
            raise
        self.version = -1
        self.reuse = config.trainer.get("resume_mode", "auto") != "disable"
        """A run that ignores its checkpoints (``resume_mode: disable``) generates every prompt afresh."""
        self.draws: Counter = Counter()
        self.resumed = 0
        """Training prompts whose group was already on Kafka: written into TransferQueue, not generated."""
        log.info("verl V1 on trajbus: channels %s, gateway %s", channels, gateway_url)

    def _own_services(self, channels: list[str], llm_client: Any) -> str:
        self.services = OwnServices(self.bootstrap_servers, self.settings.prefix, channels, self.config,
                                    engine_addresses(llm_client))
        return self.services.start()

    # -- verl's contract -------------------------------------------------------------------
    def generate_sequences(self, prompts: Any) -> None:
        """Hand each prompt of the batch to agents (or to Kafka's copy of its group); returns at once."""
        validate = bool(prompts["validate"]) if "validate" in prompts.keys() else False
        rollout = self.config.actor_rollout_ref.rollout
        rows = prompt_rows(prompts)
        self.feeders["val" if validate else "train"].tag([str(row["uid"]) for row in rows], "running")
        for prompt in rows:
            n = int(prompt.pop("__rollout_n__", rollout.val_kwargs.n if validate else rollout.n))
            sampling = self._sampling(validate, bool(prompt.pop("__do_sample__", True)))
            stored = {key: value for key, value in prompt.items() if key not in NOT_STORED}
            if validate:
                self._start(self.feeders["val"], self.settings.val_channel, str(prompt["uid"]), stored, n, sampling)
            else:
                self._train(stored, n, sampling)

    def _train(self, prompt: dict[str, Any], n: int, sampling: dict[str, Any]) -> None:
        uid, step = str(prompt["uid"]), int(prompt["global_steps"])
        self._publish(step - 1)
        index = int(prompt.get("index", -1))
        draw = Draw(step, index, self.draws[(step, index)])
        self.draws[(step, index)] += 1
        feeder = self.feeders["train"]
        found = self.dispatches.find(uid, draw) if self.reuse else None
        outcome = self.dispatches.emitted(found) if found is not None else None
        if outcome is not None and feeder.place(found.prompt_uid, uid, prompt, outcome.placed):
            self.resumed += 1
            log.info("verl V1: prompt %s (step %d, index %d) taken from Kafka, not generated again (group %s)",
                     uid, step, index, found.prompt_uid)
            return
        dispatch = self.dispatches.record(uid, draw, n, max(self.version, 0), again=found)
        self._start(feeder, self.settings.channel, uid, prompt, n, sampling, dispatch.prompt_uid)

    def _start(self, feeder: GroupFeeder, channel: str, uid: str, prompt: dict[str, Any], n: int,
               sampling: dict[str, Any], prompt_uid: str | None = None) -> None:
        prompt_uid = prompt_uid or uid
        samples = [VerlSample(prompt.get("raw_prompt"), ground_truth(prompt), session, prompt)
                   for session in range(n)]
        expected = feeder.expect(prompt_uid, uid, prompt)
        expected.run = self.harness.start(prompt_uid, samples, channel, sampling)

    def _sampling(self, validate: bool, do_sample: bool) -> dict[str, Any]:
        """The agents' OpenAI sampling arguments, from verl's rollout config (as its agent loop takes them)."""
        rollout = self.config.actor_rollout_ref.rollout
        source = rollout.val_kwargs if validate else rollout
        sampling = {"temperature": float(source.temperature), "top_p": float(source.top_p),
                    "max_tokens": int(self.config.data.max_response_length)}
        if not validate and not do_sample:
            sampling.update(temperature=0.0, top_p=1.0)
        return sampling

    def _publish(self, version: int) -> None:
        if version > self.version:
            self.publisher.publish(version)
            self.version = version

    def close(self) -> None:
        """Stop the agents, the feeders, the ledger and the services this manager started."""
        if self.harness is not None:
            self.harness.close()
        for feeder in self.feeders.values():
            feeder.close()
        self.ledger.close()
        self.trained.close()
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()
        if self.services is not None:
            self.services.close()
