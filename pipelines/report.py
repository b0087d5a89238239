"""What the demo prints and draws: a summary table, and reward/throughput per policy version (matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trajbus.pipelines.tables import render


@dataclass
class VersionRecord:
    """One trainer update: the batch it used and what the step reported."""

    version: int
    groups: int
    rows: int
    tokens: int
    reward: float
    loss: float
    nll: float
    staleness: float
    seconds: float
    wait_seconds: float = 0.0
    """Of ``seconds``, the time the trainer waited for the batch to be ready."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def summary_table(records: list[VersionRecord], rewards_by_rollout_version: dict[int, list[float]],
                  drops: dict[str, float], wall_seconds: float) -> str:
    rows: list[list[object]] = [
        [r.version, r.groups, r.rows, r.tokens, f"{r.tokens_per_s:.0f}", f"{r.reward:.3f}", f"{r.loss:+.2e}",
         f"{r.nll:.4f}", f"{r.staleness:.2f}", f"{r.wait_seconds:.1f}"] for r in records]
    groups, tokens = sum(r.groups for r in records), sum(r.tokens for r in records)
    busy = sum(r.seconds for r in records)
    rows.append(["total", groups, sum(r.rows for r in records), tokens, f"{tokens / busy if busy else 0:.0f}",
                 "", "", "", "", f"{sum(r.wait_seconds for r in records):.1f}"])
    lines = [render(["version", "groups", "rows", "tokens", "tok/s", "reward", "policy loss", "nll", "stale",
                     "wait s"], rows),
             f"whole demo: {wall_seconds:.1f} s; the trainer waited {sum(r.wait_seconds for r in records):.1f} s "
             "for batches"]
    lines.append("")
    lines.append("reward by the policy version that generated the rollout: " + ", ".join(
        f"v{v}: {sum(rs) / len(rs):.3f} ({len(rs)} rows)" for v, rs in sorted(rewards_by_rollout_version.items())))
    lines.append("groups dropped by reason: " + (", ".join(f"{k}: {v:.0f}" for k, v in sorted(drops.items()))
                                                 or "none"))
    return "\n".join(lines)


def write_plot(records: list[VersionRecord], path: Path) -> list[Path]:
    """Two panels, x = policy version: mean batch reward, and trainer throughput (tokens/s).

    Saved as PNG (for the terminal user and the README) and SVG (for a browser), next to ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: never a window, never a display
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text (searchable, selectable)
    from matplotlib import pyplot

    versions = [r.version for r in records]
    figure, (reward, throughput) = pyplot.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
    for axes, values, title, ylabel, colour in (
            (reward, [r.reward for r in records], "mean reward of the batch", "reward", "tab:blue"),
            (throughput, [r.tokens_per_s for r in records], "trainer throughput", "tokens/s", "tab:red")):
        axes.plot(versions, values, marker="o", color=colour, gid=ylabel)  # gid: the SVG element's id
        axes.set(title=title, xlabel="policy version", ylabel=ylabel, xticks=versions)
        axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix in (".png", ".svg"):
        target = path.with_suffix(suffix)
        figure.savefig(target, dpi=120)
        written.append(target)
    pyplot.close(figure)
    return written


def drops_from_stats(summary: dict[str, dict[str, Any]], channel: str) -> dict[str, float]:
    row = summary.get(channel, {})
    return {key[len("groups_dropped["):-1]: value for key, value in row.items()
            if key.startswith("groups_dropped[") and value}
