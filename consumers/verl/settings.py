"""The settings of trajbus inside verl, declared once: each is a ``TRAJBUS_VERL_<NAME>`` variable.

They serve both ways in: the fully-async trainer's queue (``queue``, ``topic``) and the V1 trainer's
agent-loop manager (``pipelines.verl``: ``gateway_url``, ``agent``, ``agent_concurrency``,
``val_channel``); ``prefix`` and ``channel`` mean the same to both. verl's command line belongs to verl
(hydra), so trajbus is tuned by environment variables, which verl's Ray workers inherit from the
launching shell on a local cluster (on a cluster started apart, pass them with
``+ray_kwargs.ray_init.runtime_env.env_vars``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any, Mapping

from trajbus.infra.arguments import positive_int
from trajbus.infra.declared import resolve, setting
from trajbus.infra.shared_settings import prefix_setting
from trajbus.streams.wire.topics import DEFAULT_PREFIX, validate_channel, validate_prefix

ENV_PREFIX = "TRAJBUS_VERL_"
MODES = ("kafka", "groups")
CALCULATOR_AGENT = "trajbus.pipelines.slime.agents.calculator_agent"


@dataclass(frozen=True)
class VerlQueueSettings:
    """Which queue verl gets and where it keeps its samples."""

    queue: str | None = setting(None, choices=MODES, help=(
        "swap verl's in-memory MessageQueue for trajbus's: kafka (verl's own samples, durable) or groups "
        "(also the ready groups of trajbus's gateway and worker)"))
    topic: str | None = setting(None, help=(
        "the samples topic (default: {prefix}.verl.{project_name}.{experiment_name} of verl's trainer config)"))
    prefix: str = prefix_setting(DEFAULT_PREFIX)
    channel: str = setting("train", help="groups mode: the channel whose ready groups are served")
    row_mode: str = setting("trajectory", choices=("trajectory", "step"), help=(
        "groups mode: one row per trajectory (multi-turn in one row) or per LLM call"))
    val_channel: str = setting("val", help="V1: the channel validation prompts go through")
    gateway_url: str | None = setting(None, help=(
        "V1: the trajbus gateway the agents talk through (default: the manager starts one at verl's own "
        "inference servers, and a stream worker for both channels)"))
    gateway_api_key: str | None = setting(None, help="V1: that gateway's --api-key, when it has one")
    agent: str = setting(CALCULATOR_AGENT, help=(
        "V1: the agent run per rollout, agent(base_url, sample, sampling) -> reward or None (sample: .prompt "
        "is verl's raw_prompt, .label the ground truth, .fields the prompt's fields)"))
    agent_concurrency: int = setting(64, parse=positive_int, help="V1: agents run at once")

    def __post_init__(self) -> None:
        validate_prefix(self.prefix)
        validate_channel(self.channel)
        validate_channel(self.val_channel)
        if self.val_channel == self.channel:
            raise ValueError(f"TRAJBUS_VERL_VAL_CHANNEL: {self.val_channel!r} is the training channel too")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "VerlQueueSettings":
        """The settings the environment gives (``ValueError`` naming a variable that is wrong)."""
        return cls(**resolve(cls, argparse.Namespace(), ENV_PREFIX, environ))

    def samples_topic(self, trainer_config: Any) -> str:
        """This experiment's samples topic: a resumed run reads the topic its crashed run wrote."""
        if self.topic:
            return self.topic
        trainer = trainer_config.trainer
        name = f"{trainer.get('project_name') or 'verl'}.{trainer.get('experiment_name') or 'default'}"
        return f"{self.prefix}.verl.{re.sub(r'[^A-Za-z0-9._-]', '-', name)}"
