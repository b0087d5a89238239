"""Every test, unit and integration: what it printed holds no raw librdkafka line.

trajbus owns its Kafka clients' logs (issue 35): their lines pass through Python logging, an outage is
told once, each attempt at DEBUG. A line librdkafka printed itself (``%4|1732420000.123|GETPID|...``,
a client built without trajbus's ``logger``), or one of its lines printed bare by Python's last-resort
handler (``FAIL [rdkafka#producer-4] ...``, a WARNING-or-above record in a process that set up no
logging), fails the test that captured it, naming the line. A line in trajbus's own log format went
through logging and is not raw; a subprocess's output to its log file is not captured output.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

import pytest

from trajbus.infra.kafka_broker import JVM_OPTIONS_VARIABLE, SHORT_LIVED_JVM_OPTIONS

RAW_LIBRDKAFKA = re.compile(r"rdkafka#|^%\d\|")
OUR_FORMAT = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ \S+ ")
"""``infra.logs.FORMAT``: a line logged through a handler of ours."""


os.environ.setdefault(JVM_OPTIONS_VARIABLE, SHORT_LIVED_JVM_OPTIONS)
"""Every broker the tests start (in this process or a child's) lives minutes at most; a user's default stays."""

FAULT_FILES = frozenset({"test_cluster.py", "test_broker_restart.py", "test_worker_assignment.py",
                         "test_client_logs.py", "test_worker_recovery.py"})
"""Tests that kill and restart brokers, nodes and workers of their own: most of their time is spent waiting
for a JVM to start or a group to rebalance. ``make test`` runs two pytest processes (``-n 2``): these files
run one after another in one of them, never two at once; every other file runs whole in one of the two."""


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> object:
    """Files as units of work, the fault files one unit. (``--dist loadgroup`` would do it by marks, but
    pytest-xdist 3.8 renames the test ids that pytest 9 no longer reads, and the marks are lost.)"""
    from xdist.scheduler import LoadScopeScheduling

    class FaultsInOneStream(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "faults" if path.rsplit("/", 1)[-1] in FAULT_FILES else path

        def _assign_work_unit(self, node: object) -> None:
            """The fault unit, the longest by far, is handed out first: the other process works through the
            rest meanwhile, instead of one process running it alone at the end."""
            if "faults" in self.workqueue:
                self.workqueue.move_to_end("faults", last=False)
            super()._assign_work_unit(node)

    return FaultsInOneStream(config, log)


def raw_librdkafka_lines(text: str) -> list[str]:
    """The lines of ``text`` that librdkafka (or the last-resort handler, with its words) printed raw."""
    return [line for line in text.splitlines() if RAW_LIBRDKAFKA.search(line) and not OUR_FORMAT.match(line)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A phase (setup, call, teardown) that passed fails if its captured stdout or stderr holds a raw line."""
    report: pytest.TestReport = yield
    if report.outcome != "passed":
        return report
    captured = "\n".join(content for title, content in report.sections
                         if title.startswith(("Captured stdout", "Captured stderr"))
                         and title.endswith(f" {call.when}"))
    raw = raw_librdkafka_lines(captured)
    if raw:
        report.outcome = "failed"
        report.longrepr = (f"{len(raw)} raw librdkafka line(s) in the {call.when} phase's captured output "
                           f"(trajbus's clients log through Python logging); the first: {raw[0]}")
    return report
