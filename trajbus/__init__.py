"""trajbus: the Kafka data plane of agentic RL for LLMs.

Installed, every package lives under ``trajbus.`` (``trajbus.streams``,
``trajbus.gateway``, ``trajbus.consumers``, ``trajbus.pipelines``,
``trajbus.infra``); the repository keeps them as top-level folders, which a
source checkout serves under the same names. The names of the public contract
are exported here, imported when first used (``import trajbus`` stays cheap:
no torch, no Faust).

A script in the folder that holds a checkout cloned as ``trajbus/`` would get
that folder for ``import trajbus``: no ``__init__.py`` there, so an empty
namespace package ("cannot import name ... (unknown location)"), and this file
would never run to say so. The venv that ``make`` builds imports this package
as Python starts, before the script's folder is on the path
(``trajbus-first.pth``, Makefile), so the package wins.
"""

from __future__ import annotations

from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "streams" / "wire" / "records.py").is_file():
    __path__.append(str(_checkout))  # a source checkout: trajbus.streams is ./streams

from trajbus.infra.lazy import lazy_exports  # noqa: E402 - after the checkout is on __path__

_EXPORTS = {
    "Step": "trajbus.streams.wire.records",
    "TrajectoryEnd": "trajbus.streams.wire.records",
    "ReadyGroup": "trajbus.streams.wire.records",
    "StepProducer": "trajbus.streams.client.producer",
    "BatchConsumer": "trajbus.consumers",
    "VerlBackend": "trajbus.consumers.backends",
    "PolicyVersionPublisher": "trajbus.streams.client.policy",
    "RolloutDataSource": "trajbus.pipelines.data_source",
    "RolloutDataSourceWithBuffer": "trajbus.pipelines.data_source",
    "SlimeDataSource": "trajbus.pipelines.slime",
    "GlobalDataset": "trajbus.pipelines.global_dataset",
    "GlobalDatasetManager": "trajbus.pipelines.global_dataset",
    "EnvManager": "trajbus.pipelines.env_manager",
    "KafkaTraceStore": "trajbus.consumers.rllm",
    "VerlAgentLoopManager": "trajbus.pipelines.verl",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports("trajbus", _EXPORTS, lambda: globals())
