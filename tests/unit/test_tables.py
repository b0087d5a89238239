"""Tables a person reads: titles never run together, numbers line up on the right, nothing is cut."""

from __future__ import annotations

import io
import re

from trajbus.pipelines.report import VersionRecord, summary_table
from trajbus.pipelines.tables import print_table, render


def test_titles_wider_than_their_values_stay_apart():
    text = render(["channel", "policy", "gw in flight"], [["train", 0, 12]])
    header, rule, row = text.splitlines()
    assert re.split(r"\s{2,}", header.strip()) == ["channel", "policy", "gw in flight"]
    assert row.split() == ["train", "0", "12"]
    assert row.index("12") + 2 == header.index("gw in flight") + len("gw in flight"), "numbers end where titles do"


def test_a_long_cell_is_never_cut_when_not_on_a_terminal():
    configs = " ".join(f"config.number.{i}=value" for i in range(20))
    out = io.StringIO()
    print_table(["topic", "configs"], [["trajbus.steps.train", configs]], title="topics", file=out)
    assert configs in out.getvalue() and out.getvalue().splitlines()[0] == "topics"


def test_the_demo_summary_is_one_table_with_a_total():
    records = [VersionRecord(1, 2, 16, 3000, 0.5, -1.2e-3, 0.7, 0.5, 2.0, 0.3)]
    lines = summary_table(records, {0: [0.5]}, {}, 10.0).splitlines()
    assert re.split(r"\s{2,}", lines[0].strip())[:7] == ["version", "groups", "rows", "tokens", "tok/s", "reward",
                                                         "policy loss"]
    assert lines[2].split()[:7] == ["1", "2", "16", "3000", "1500", "0.500", "-1.20e-03"]
    assert lines[3].split()[:4] == ["total", "2", "16", "3000"]
