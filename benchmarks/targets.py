"""A benchmark's targets beside its figures: each bound, the figure measured in the same run, met or MISSED.

Every benchmark with a target prints this table last and saves the same rows in its JSON, so a reader
never compares a figure with a bound from another run or another document (compared unrounded).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trajbus.pipelines.tables import print_table


@dataclass(frozen=True)
class Target:
    target: str
    bound: str
    measured: str
    met: bool


def print_targets(targets: list[Target], title: str) -> list[dict]:
    """Print the targets' table; returns them as JSON rows."""
    print()
    print_table(["target", "bound", "measured", "met"],
                [[t.target, t.bound, t.measured, "yes" if t.met else "MISSED"] for t in targets], title=title)
    return [asdict(t) for t in targets]
