"""Small inline-SVG building blocks for the HTML plan report: no script, no external file, text as real text.

Every chart is a `<svg>` element with a `viewBox`, so it scales with the page; colours come from one palette so
that a stage has the same colour in the mesh, the table and the timeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

STAGE_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                 "#9c755f", "#86bcb6", "#d37295", "#a0cbe8")
"""Tableau 10 and two more: distinguishable, and readable with dark text at 40% tint."""

TERM_COLOURS = {
    "compute_s": "#4e79a7", "recompute_s": "#a0cbe8", "tp_comm_s": "#f28e2b", "pp_comm_s": "#edc948",
    "dp_comm_s": "#e15759", "bubble_s": "#bab0ac", "optimizer_s": "#59a14f", "framework_s": "#b07aa1",
    "offload_s": "#76b7b2",
}
MEMORY_COLOURS = {"params": "#4e79a7", "grads": "#f28e2b", "optimizer": "#59a14f", "activations": "#e15759",
                  "temporary": "#edc948", "overhead": "#bab0ac"}
EVENT_COLOURS = {"forward": "#4e79a7", "backward": "#59a14f", "recompute": "#a0cbe8", "tp_comm": "#f28e2b",
                 "pp_comm": "#edc948", "dp_comm": "#e15759", "optimizer": "#b07aa1", "idle": "#eeeeee",
                 "weight_grad": "#8cd17d"}


def stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def attr(value: object) -> str:
    return escape(str(value), quote=True)


@dataclass(frozen=True, slots=True)
class Segment:
    """One part of a stacked bar."""

    key: str
    label: str
    value: float
    colour: str


def svg(width: float, height: float, body: Sequence[str], *, label: str, css_class: str = "chart") -> str:
    return (f'<svg class="{css_class}" viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'role="img" aria-label="{attr(label)}" xmlns="http://www.w3.org/2000/svg">'
            f'<title>{escape(label)}</title>' + "".join(body) + "</svg>")


def rect(x: float, y: float, w: float, h: float, fill: str, *, title: str = "", extra: str = "") -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0):.2f}" height="{h:.2f}" fill="{fill}" {extra}>'
            f'{tip}</rect>')


def text(x: float, y: float, content: str, *, anchor: str = "start", size: float = 12, extra: str = "") -> str:
    return (f'<text x="{x:.2f}" y="{y:.2f}" text-anchor="{anchor}" font-size="{size:g}" {extra}>'
            f'{escape(content)}</text>')


def stacked_bar(segments: Sequence[Segment], x: float, y: float, width: float, height: float, total: float,
                unit: str) -> list[str]:
    """A horizontal bar of `segments` scaled so that `total` fills `width`; each part names itself on hover."""
    out, pos = [], x
    for s in segments:
        if s.value <= 0:
            continue
        w = width * s.value / total if total > 0 else 0
        out.append(rect(pos, y, w, height, s.colour, title=f"{s.label}: {s.value:.4g} {unit}",
                        extra=f'data-key="{attr(s.key)}" data-value="{s.value!r}"'))
        pos += w
    return out


def legend(items: Sequence[tuple[str, str]], x: float, y: float, *, per_row: int = 4, col_width: float = 190) -> list[str]:
    out = []
    for i, (colour, label) in enumerate(items):
        cx, cy = x + (i % per_row) * col_width, y + (i // per_row) * 18
        out += [rect(cx, cy - 10, 12, 12, colour), text(cx + 17, cy, label, size=11)]
    return out


def time_unit(seconds: float) -> tuple[float, str]:
    """A scale and unit for an axis spanning `seconds`."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def nice_ticks(span: float, count: int = 6) -> list[float]:
    """Round tick positions from 0 to about `span`."""
    if span <= 0:
        return [0.0]
    raw = span / count
    magnitude = 10 ** int(f"{raw:e}".split("e")[1])
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    ticks, t = [], 0.0
    while t <= span * 1.0001:
        ticks.append(t)
        t += step
    return ticks
