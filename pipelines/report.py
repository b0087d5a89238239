"""What the demo prints and draws: a summary table, and reward/throughput per policy version as SVG.

The plot is plain SVG written by hand: a browser opens it, and no plotting
library is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def summary_table(records: list[VersionRecord], rewards_by_rollout_version: dict[int, list[float]],
                  drops: dict[str, float], wall_seconds: float) -> str:
    lines = [f"{'version':>7} {'groups':>6} {'rows':>5} {'tokens':>7} {'tok/s':>7} {'reward':>7} "
             f"{'policy loss':>11} {'nll':>7} {'stale':>6}"]
    for r in records:
        lines.append(f"{r.version:>7} {r.groups:>6} {r.rows:>5} {r.tokens:>7} {r.tokens_per_s:>7.0f} "
                     f"{r.reward:>7.3f} {r.loss:>+11.2e} {r.nll:>7.4f} {r.staleness:>6.2f}")
    groups, tokens = sum(r.groups for r in records), sum(r.tokens for r in records)
    busy = sum(r.seconds for r in records)
    lines.append(f"{'total':>7} {groups:>6} {sum(r.rows for r in records):>5} {tokens:>7} "
                 f"{tokens / busy if busy else 0:>7.0f}  (whole demo: {wall_seconds:.1f} s)")
    lines.append("")
    lines.append("reward by the policy version that generated the rollout: " + ", ".join(
        f"v{v}: {sum(rs) / len(rs):.3f} ({len(rs)} rows)" for v, rs in sorted(rewards_by_rollout_version.items())))
    lines.append("groups dropped by reason: " + (", ".join(f"{k}: {v:.0f}" for k, v in sorted(drops.items()))
                                                 or "none"))
    return "\n".join(lines)


def _polyline(values: list[float], left: float, top: float, width: float, height: float) -> tuple[str, float, float]:
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    step = width / max(1, len(values) - 1)
    points = " ".join(f"{left + i * step:.1f},{top + height - (v - low) / span * height:.1f}"
                      for i, v in enumerate(values))
    return points, low, high


def write_plot(records: list[VersionRecord], path: Path) -> Path:
    """Two panels, x = policy version: mean batch reward, and trainer throughput (tokens/s)."""
    panels: list[tuple[str, list[float], str]] = [
        ("mean reward of the batch", [r.reward for r in records], "#1f77b4"),
        ("throughput (tokens/s)", [r.tokens_per_s for r in records], "#d62728"),
    ]
    width, height, margin = 360, 220, 40
    parts: list[str] = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height + 30}" '
                        f'font-family="sans-serif" font-size="12">']
    for index, (title, values, colour) in enumerate(panels):
        left = index * width + margin
        points, low, high = _polyline(values, left, 30, width - 2 * margin, height - 2 * margin)
        parts.append(f'<text x="{left}" y="18" font-weight="bold">{title}</text>')
        parts.append(f'<rect x="{left}" y="30" width="{width - 2 * margin}" height="{height - 2 * margin}" '
                     f'fill="none" stroke="#ccc"/>')
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for point, record in zip(points.split(), records):
            x, y = point.split(",")
            parts.append(f'<circle cx="{x}" cy="{y}" r="3" fill="{colour}"/>')
            parts.append(f'<text x="{x}" y="{height - margin + 45}" text-anchor="middle">v{record.version}</text>')
        parts.append(f'<text x="{left - 4}" y="34" text-anchor="end">{high:.3g}</text>')
        parts.append(f'<text x="{left - 4}" y="{height - margin + 30}" text-anchor="end">{low:.3g}</text>')
    parts.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path


def drops_from_stats(summary: dict[str, dict[str, Any]], channel: str) -> dict[str, float]:
    row = summary.get(channel, {})
    return {key[len("groups_dropped["):-1]: value for key, value in row.items()
            if key.startswith("groups_dropped[") and value}
