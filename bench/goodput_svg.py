"""A small SVG line plot for bench_goodput.py: training progress over wall time per launcher, faults marked.

Written by hand (no plotting library needed): one polyline per series, a dashed vertical line per fault in
the series' colour, axes with a few ticks and a legend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 720, 400
LEFT, RIGHT, TOP, BOTTOM = 60, 160, 30, 45
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass
class Series:
    """One run: (seconds since launch, steps done) points, and the fault times in the same seconds."""

    label: str
    points: list[tuple[float, float]]
    faults: list[float] = field(default_factory=list)
    dashed: bool = False


def _ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to about TOP."""
    if top <= 0:
        return [0.0]
    raw = top / count
    magnitude = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 0.1
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), default=raw)
    ticks, value = [], 0.0
    while value <= top * 1.0001:
        ticks.append(value)
        value += step
    return ticks


def _axes(x_max: float, y_max: float, x_of, y_of, title: str) -> list[str]:
    parts = [f'<text x="{WIDTH / 2:.0f}" y="18" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH - RIGHT}" y2="{HEIGHT - BOTTOM}" stroke="black"/>',
             f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="black"/>']
    for t in _ticks(x_max):
        parts.append(f'<text x="{x_of(t):.1f}" y="{HEIGHT - BOTTOM + 16}" text-anchor="middle" font-size="11">{t:g}</text>')
    for s in _ticks(y_max):
        parts.append(f'<text x="{LEFT - 6}" y="{y_of(s) + 4:.1f}" text-anchor="end" font-size="11">{s:g}</text>')
        parts.append(f'<line x1="{LEFT}" y1="{y_of(s):.1f}" x2="{WIDTH - RIGHT}" y2="{y_of(s):.1f}" stroke="#eee"/>')
    parts.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle" font-size="12">'
                 'wall time since launch (s)</text>')
    parts.append(f'<text x="14" y="{(TOP + HEIGHT - BOTTOM) / 2:.0f}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(TOP + HEIGHT - BOTTOM) / 2:.0f})">steps done</text>')
    return parts


def render(series: list[Series], title: str) -> str:
    """The SVG document for SERIES (an empty plot if there are no points)."""
    x_max = max((x for s in series for x, _ in s.points), default=1.0) or 1.0
    y_max = max((y for s in series for _, y in s.points), default=1.0) or 1.0

    def x_of(x: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * x / x_max

    def y_of(y: float) -> float:
        return HEIGHT - BOTTOM - (HEIGHT - TOP - BOTTOM) * y / y_max

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif">',
             '<rect width="100%" height="100%" fill="white"/>', *_axes(x_max, y_max, x_of, y_of, title)]
    for i, s in enumerate(series):
        color = COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="4 3"' if s.dashed else ""
        coords = " ".join(f"{x_of(x):.1f},{y_of(y):.1f}" for x, y in s.points)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{coords}"/>')
        for t in s.faults:
            parts.append(f'<line x1="{x_of(t):.1f}" y1="{TOP}" x2="{x_of(t):.1f}" y2="{HEIGHT - BOTTOM}" '
                         f'stroke="{color}" stroke-dasharray="2 3" opacity="0.7"/>')
        y = TOP + 14 + 18 * i
        parts.append(f'<line x1="{WIDTH - RIGHT + 10}" y1="{y - 4}" x2="{WIDTH - RIGHT + 30}" y2="{y - 4}" '
                     f'stroke="{color}" stroke-width="2"{dash}/>')
        parts.append(f'<text x="{WIDTH - RIGHT + 34}" y="{y}" font-size="11">{escape(s.label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write(path: Path, series: list[Series], title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(series, title))
