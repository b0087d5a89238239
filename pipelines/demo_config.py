"""The demo's YAML configuration, checked before anything starts.

A malformed file, an unknown key, a missing dataset, a dataset record without
``prompt`` / ``label``, or a dotted path that does not import is a
``ValueError`` naming the problem; the CLI turns it into one line and exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from trajbus.gateway.config import GatewaySettings
from trajbus.infra.declared import check_values, to_flags
from trajbus.infra.dotted import import_dotted
from trajbus.pipelines.global_dataset import GlobalDataset
from trajbus.streams.client.topic_settings import TopicSettings
from trajbus.streams.worker.settings import ChannelSettings, WorkerSettings

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "demo.yaml"
ENVS = ("math", "calculator")
AGENTS = ("black_box", "white_box")


@dataclass
class EnvGroup:
    env: str
    agent: str
    group_size: int = 4


@dataclass
class Rollout:
    temperature: float = 1.0
    max_tokens: int = 32
    env_groups: list[EnvGroup] = field(default_factory=list)


@dataclass
class Trainer:
    groups_per_step: int = 3
    learning_rate: float = 2e-3
    prompt_length: int = 256
    response_length: int = 192
    fetch_timeout: float = 180.0


WORKER_SETTINGS = (ChannelSettings, WorkerSettings)
GATEWAY_SETTINGS = (GatewaySettings,)
DEMO_WORKER = {"max_staleness": 2, "max_queue_size": 6}
"""The demo's worker settings unless its file says otherwise (any worker flag's setting may be given)."""
DEMO_GATEWAY = {"prompt_length": 512, "response_length": 48, "max_backlog_groups": 6, "max_staleness": 2}
"""The demo's gateway settings unless its file says otherwise (any gateway flag's setting may be given)."""


@dataclass
class DemoConfig:
    seed: int = 7
    policy_versions: int = 3
    datasets: dict[str, Path] = field(default_factory=dict)
    rollout: Rollout = field(default_factory=Rollout)
    trainer: Trainer = field(default_factory=Trainer)
    worker: dict[str, Any] = field(default_factory=lambda: dict(DEMO_WORKER))
    """Settings of the worker, by the names of its flags' fields (``worker_flags``)."""
    gateway: dict[str, Any] = field(default_factory=lambda: dict(DEMO_GATEWAY))
    """Settings of the gateway, by the names of its flags' fields (``gateway_flags``)."""
    report: Path = Path("demo-report.png")
    replication_factor: int | None = None
    """Replicas of the demo's topics (None: the cluster's default; one on the embedded broker)."""
    min_insync_replicas: int | None = None
    """``min.insync.replicas`` of the demo's topics (None: the cluster's default)."""

    def topic_settings(self, prefix: str) -> TopicSettings:
        return TopicSettings(prefix=prefix, replication_factor=self.replication_factor,
                             min_insync_replicas=self.min_insync_replicas)

    def worker_flags(self) -> list[str]:
        replication = [flag for name in ("replication_factor", "min_insync_replicas") if getattr(self, name)
                       for flag in ("--" + name.replace("_", "-"), str(getattr(self, name)))]
        return to_flags(WORKER_SETTINGS, self.worker) + replication

    def gateway_flags(self) -> list[str]:
        return to_flags(GATEWAY_SETTINGS, self.gateway)


def _mapping(data: Any, where: str) -> dict:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    return data


def _section(cls: type, data: Any, where: str) -> Any:
    data = _mapping(data, where)
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown setting (known: {', '.join(known)})")
    return cls(**data)


def _settings(classes: tuple[type, ...], data: Any, where: str) -> dict[str, Any]:
    """A section of a component's settings, checked against its settings classes (as its flags are)."""
    return check_values(classes, _mapping(data, where), where)


def load_demo_config(path: str | Path | None = None) -> DemoConfig:
    path = Path(path or DEFAULT_CONFIG)
    if not path.is_file():
        raise ValueError(f"config: no such file {str(path)!r}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"config: {path} is not valid YAML ({str(exc).splitlines()[0]})") from None
    raw = raw or {}
    config = _section(DemoConfig, {k: v for k, v in raw.items()
                                   if k not in ("rollout", "trainer", "worker", "gateway")}, "config")
    config.rollout = _section(Rollout, raw.get("rollout"), "rollout")
    config.rollout.env_groups = [_section(EnvGroup, g, f"rollout.env_groups[{i}]")
                                 for i, g in enumerate(config.rollout.env_groups or [])]
    config.trainer = _section(Trainer, raw.get("trainer"), "trainer")
    config.worker = {**DEMO_WORKER, **_settings(WORKER_SETTINGS, raw.get("worker"), "worker")}
    config.gateway = {**DEMO_GATEWAY, **_settings(GATEWAY_SETTINGS, raw.get("gateway"), "gateway")}
    config.datasets = {name: (path.parent / p).resolve() for name, p in (config.datasets or {}).items()}
    config.report = Path(config.report)
    _check(config)
    return config


def _check(config: DemoConfig) -> None:
    config.topic_settings("demo")  # replication: positive, min.insync.replicas within it
    if not isinstance(config.policy_versions, int) or config.policy_versions < 1:
        raise ValueError(f"policy_versions: expected a positive integer, got {config.policy_versions!r}")
    if not config.rollout.env_groups:
        raise ValueError("rollout.env_groups: at least one env group is needed")
    for i, group in enumerate(config.rollout.env_groups):
        if group.env not in ENVS:
            raise ValueError(f"rollout.env_groups[{i}].env: expected one of {ENVS}, got {group.env!r}")
        if group.agent not in AGENTS:
            raise ValueError(f"rollout.env_groups[{i}].agent: expected one of {AGENTS}, got {group.agent!r}")
        if not isinstance(group.group_size, int) or group.group_size < 1:
            raise ValueError(f"rollout.env_groups[{i}].group_size: expected a positive integer")
        if group.env not in config.datasets:
            raise ValueError(f"datasets.{group.env}: no dataset configured for env {group.env!r}")
    for name, dataset_path in config.datasets.items():
        try:
            items = GlobalDataset(dataset_path).items
        except ValueError as exc:
            raise ValueError(f"datasets.{name}: {exc}") from None
        for number, item in enumerate(items, 1):
            for key in ("prompt", "label"):
                if key not in item:
                    raise ValueError(f"datasets.{name}: record {number} of {dataset_path} has no {key!r}")
    for where, dotted in (("worker.group_filter", config.worker.get("group_filter")),
                          ("gateway.reward_function", config.gateway.get("reward_function"))):
        if dotted:
            import_dotted(dotted, where)
