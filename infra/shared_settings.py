"""Settings that more than one component has, each declared once here; a component's settings class
names the ones it has (``broker_outage_limit: float = outage_limit_setting("gateway", ...)``), so the
default, the parsing and the words of the flag are the same everywhere."""

from __future__ import annotations

import argparse
from typing import Any

from trajbus.infra.arguments import positive_float
from trajbus.infra.declared import setting
from trajbus.infra.outage import OUTAGE_LIMIT
from trajbus.infra.tracing import OFF, parse_modes


def outage_limit_setting(component: str, meanwhile: str = "") -> Any:
    """``--broker-outage-limit``: how long ``component`` rides through a Kafka outage (``infra.outage``);
    ``meanwhile``: what it does during one."""
    during = f" ({meanwhile})" if meanwhile else ""
    return setting(OUTAGE_LIMIT, parse=positive_float,
                   help=f"seconds Kafka may be unreachable{during} before the {component} exits non-zero for a "
                        "supervisor")


def prefix_setting(default: str) -> Any:
    """``--prefix``: the first part of every topic's name (``{prefix}.steps.{channel}``); each component and
    command of one deployment is given the same one. ``default``: ``streams.wire.topics.DEFAULT_PREFIX``."""
    return setting(default, help="topic name prefix")


def _tracing_modes(text: str) -> str:
    try:
        return parse_modes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def tracing_setting(component: str) -> Any:
    """``--tracing``: where ``component``'s OpenTelemetry spans go (``infra.tracing``); off costs nothing."""
    return setting(OFF, parse=_tracing_modes,
                   help=f"OpenTelemetry spans of the {component}: off, kafka (to the PREFIX.traces topic, read by "
                        "`trajbus trace`), otlp (OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT) or kafka,otlp")
