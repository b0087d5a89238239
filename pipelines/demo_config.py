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

from trajbus.pipelines.global_dataset import GlobalDataset
from trajbus.streams.settings import import_dotted

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


@dataclass
class Worker:
    max_staleness: int | None = 2
    max_queue_size: int | None = 6
    group_filter: str | None = None


@dataclass
class Gateway:
    prompt_length: int = 512
    response_length: int = 48
    reward_function: str | None = None
    max_backlog_groups: int | None = 6
    """Pacing: new trajectories wait while the trainer's backlog is at this many groups (None: off)."""
    max_staleness: int | None = 2
    """Pacing: new trajectories wait while they would start more versions behind the trainer (None: off)."""


@dataclass
class DemoConfig:
    seed: int = 7
    policy_versions: int = 3
    datasets: dict[str, Path] = field(default_factory=dict)
    rollout: Rollout = field(default_factory=Rollout)
    trainer: Trainer = field(default_factory=Trainer)
    worker: Worker = field(default_factory=Worker)
    gateway: Gateway = field(default_factory=Gateway)
    report: Path = Path("demo-report.png")


def _section(cls: type, data: Any, where: str) -> Any:
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            raise ValueError(f"{where}.{key}: unknown setting (known: {', '.join(known)})")
    return cls(**data)


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
    config.worker = _section(Worker, raw.get("worker"), "worker")
    config.gateway = _section(Gateway, raw.get("gateway"), "gateway")
    config.datasets = {name: (path.parent / p).resolve() for name, p in (config.datasets or {}).items()}
    config.report = Path(config.report)
    _check(config)
    return config


def _check(config: DemoConfig) -> None:
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
    for name in ("max_backlog_groups", "max_staleness"):
        value = getattr(config.gateway, name)
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"gateway.{name}: expected a positive integer or null, got {value!r}")
    for where, dotted in (("worker.group_filter", config.worker.group_filter),
                          ("gateway.reward_function", config.gateway.reward_function)):
        if dotted:
            import_dotted(dotted, where)
