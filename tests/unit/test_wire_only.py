"""``streams.wire`` says what it is: its docstring names the only things it imports (the imports themselves:
tests/unit/test_import_rules.py), and a header it shares with ``infra`` has one name on both sides."""

from __future__ import annotations

import trajbus.streams.wire as wire
from trajbus.infra import tracing
from trajbus.streams.wire import headers
from tests.unit.test_import_rules import WIRE_THIRD_PARTY


def test_the_wing_says_it_imports_only_the_standard_library_its_codecs_and_itself_and_names_them():
    doc = wire.__doc__ or ""
    assert "imports only the standard library, its codecs and itself" in doc
    assert all(library in doc for library in WIRE_THIRD_PARTY), "the docstring names each third-party library"


def test_the_traceparent_infra_writes_is_the_one_the_wire_names():
    """``infra.tracing`` sits below the wire and writes the W3C header on HTTP and Kafka alike, under its own
    constant: the two must agree."""
    assert tracing.TRACEPARENT == headers.TRACEPARENT
