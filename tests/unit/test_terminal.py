"""A progress line a person watches: drawn on a terminal only, erased before anything else is printed."""

from __future__ import annotations

import io

from trajbus.infra.terminal import ERASE, ProgressLine
from trajbus.pipelines.topics_table import duration, size


class Terminal(io.StringIO):
    """stderr and stdout of one terminal: everything written, in order."""

    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_line_is_erased_before_a_result_and_drawn_again_below_it():
    screen = Terminal()
    with ProgressLine(screen, interval=0) as progress:
        progress.update("replay t: 1/2 records")
        progress.print("g1  trajectories=2", file=screen)
        progress.update("replay t: 2/2 records")
    assert screen.getvalue() == (ERASE + "replay t: 1/2 records" + ERASE + "g1  trajectories=2\n"
                                 + ERASE + "replay t: 1/2 records" + ERASE + "replay t: 2/2 records" + ERASE)


def test_a_result_printed_with_no_line_on_screen_erases_nothing():
    screen = Terminal()
    with ProgressLine(screen) as progress:
        progress.print("42 groups in the window", file=screen)
    assert screen.getvalue() == "42 groups in the window\n"


def test_redraws_wait_for_the_interval_but_the_final_count_is_drawn():
    screen = Terminal()
    progress = ProgressLine(screen, interval=3600)
    for done in (1, 2, 3):
        progress.update(f"{done}/3", final=done == 3)
    assert screen.getvalue() == ERASE + "1/3" + ERASE + "3/3"


def test_not_a_terminal_no_line_is_drawn_and_results_are_printed_as_they_are():
    log, out = io.StringIO(), io.StringIO()
    with ProgressLine(log, interval=0) as progress:
        progress.update("replay t: 1/1 records", final=True)
        progress.print("g1", file=out)
    assert (log.getvalue(), out.getvalue()) == ("", "g1\n")


def test_topic_configs_are_told_in_the_largest_exact_unit():
    assert [duration(ms) for ms in ("604800000", "21600000", "90000", "1500", "-1")] == \
        ["7 d", "6 h", "90 s", "1500 ms", "forever"]
    assert [size(count) for count in ("16777216", "1073741824", "1000", "-1")] == \
        ["16 MiB", "1 GiB", "1000 B", "unlimited"]
