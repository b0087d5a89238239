"""Settings that more than one component has, each declared once here; a component's settings class
names the ones it has (``broker_outage_limit: float = outage_limit_setting("gateway", ...)``), so the
default, the parsing and the words of the flag are the same everywhere."""

from __future__ import annotations

from typing import Any

from trajbus.infra.arguments import positive_float
from trajbus.infra.declared import setting
from trajbus.infra.outage import OUTAGE_LIMIT


def outage_limit_setting(component: str, meanwhile: str = "") -> Any:
    """``--broker-outage-limit``: how long ``component`` rides through a Kafka outage (``infra.outage``);
    ``meanwhile``: what it does during one."""
    during = f" ({meanwhile})" if meanwhile else ""
    return setting(OUTAGE_LIMIT, parse=positive_float,
                   help=f"seconds Kafka may be unreachable{during} before the {component} exits non-zero for a "
                        "supervisor")
