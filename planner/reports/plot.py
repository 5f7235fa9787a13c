"""Pictures of a plan: the pipeline schedule as a Gantt chart (from `planner.reports.timeline`) and memory per stage
against device capacity. matplotlib is optional (`pip install matplotlib`, or the `plot` extra) and imported only
here, when a picture is asked for. The object-oriented API (Figure + Agg canvas) is used, never pyplot, so no
global backend or figure state is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.errors import UserError
from planner.plan import Plan
from planner.reports.timeline import EventKind, StepTimeline, build_timeline, plan_title, write_timeline
from planner.search.space import Objective

GIB = 1 << 30

# Colours from matplotlib's "tab10" palette, chosen so that work is blue/green and waiting is grey.
KIND_COLORS: dict[EventKind, str] = {
    EventKind.FORWARD: "#1f77b4",
    EventKind.BACKWARD: "#2ca02c",
    EventKind.RECOMPUTE: "#ff7f0e",
    EventKind.TP_COMM: "#9467bd",
    EventKind.PP_COMM: "#e377c2",
    EventKind.DP_COMM: "#8c564b",
    EventKind.OPTIMIZER: "#bcbd22",
    EventKind.IDLE: "#d9d9d9",
}
MEMORY_COLORS: dict[str, str] = {
    "params": "#1f77b4", "grads": "#aec7e8", "optimizer": "#ff7f0e", "activations": "#2ca02c",
    "temporary": "#98df8a", "overhead": "#7f7f7f",
}


if TYPE_CHECKING:
    from planner.scenarios.whatif import WhatIf


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install matplotlib (or pip install 'stratagem[plot]')") from None
    return Figure, FigureCanvasAgg


def plot_plan(plan: Plan, path: str | Path, *, timeline: StepTimeline | None = None) -> None:
    """Draw the plan's schedule (top) and memory per stage against capacity (bottom) into an image file; the
    format follows the extension (png, svg, pdf, ...)."""
    path = Path(path)
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(12, 7.5), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    formats = canvas.get_supported_filetypes()
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in formats:
        raise UserError(f"--plot {path}: unknown image type {fmt!r}; use one of {', '.join(sorted(formats))}")
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: folder {path.parent} does not exist")
    timeline = timeline or build_timeline(plan)
    gantt, memory = fig.subplots(2, 1, height_ratios=(3, 2))
    _draw_gantt(gantt, timeline)
    _draw_memory(memory, plan)
    fig.suptitle(plan_title(plan), fontsize=11)
    fig.savefig(path, format=fmt)


def _draw_gantt(ax: Any, timeline: StepTimeline) -> None:
    """One row per stage (stage 0 on top); nested parts (recompute, TP comm) as thinner bars inside their op."""
    from matplotlib.patches import Patch

    scale, unit = _time_unit(max(timeline.span_s, timeline.step_time_s))
    bars: dict[tuple[int, EventKind, int], list[tuple[float, float]]] = {}
    for e in timeline.events:
        bars.setdefault((e.stage, e.kind, e.depth), []).append((e.start_s * scale, e.duration_s * scale))
    for (stage, kind, depth), spans in sorted(bars.items()):
        height = 0.8 if depth == 0 else 0.35
        y = stage - height / 2
        ax.broken_barh(spans, (y, height), facecolors=KIND_COLORS[kind],
                       edgecolors="white" if depth == 0 and kind is not EventKind.IDLE else "none",
                       linewidth=0.3)
    ax.set_ylim(timeline.num_stages - 0.5, -0.5)
    ax.set_yticks(range(timeline.num_stages), [f"stage {i}" for i in range(timeline.num_stages)])
    ax.set_xlim(0, max(timeline.span_s, timeline.step_time_s) * scale)
    ax.axvline(timeline.step_time_s * scale, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel(f"time in step ({unit}); dashed line: predicted step time")
    used = sorted({e.kind for e in timeline.events}, key=list(EventKind).index)
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k.value) for k in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.18), ncol=len(used), fontsize=8, frameon=False)
    ax.set_title("pipeline schedule per stage", fontsize=10)


def _time_unit(seconds: float) -> tuple[float, str]:
    """Scale factor and unit name that keep the time axis's numbers readable."""
    if seconds >= 1:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _draw_memory(ax: Any, plan: Plan) -> None:
    """Stacked bars of each stage's peak memory by part, with its device capacity as a red line."""
    stages = plan.predicted.stages
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for part, color in MEMORY_COLORS.items():
        values = [getattr(s.memory, part) / GIB for s in stages]
        ax.bar(xs, values, bottom=bottom, color=color, label=part, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, s in zip(xs, stages, strict=True):
        capacity = s.capacity_bytes / GIB
        ax.hlines(capacity, x - 0.4, x + 0.4, colors="red", linewidth=2)
        ax.annotate(f"{s.memory.total / s.capacity_bytes:.0%}" if s.capacity_bytes else "",
                    (x, max(bottom[x], capacity)), textcoords="offset points", xytext=(0, 3), ha="center",
                    fontsize=8)
    ax.set_xticks(xs, [f"stage {s.index}\n{s.device}" for s in stages])
    ax.set_ylabel("GiB per device")
    top = max([*bottom, *(s.capacity_bytes / GIB for s in stages)], default=1.0)
    ax.set_ylim(0, top * 1.15)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title("peak memory per stage (red: device capacity)", fontsize=10)


def write_pictures(plan: Plan, *, timeline_path: Path | None, plot_path: Path | None) -> None:
    """Write the plan's simulated step as Chrome/Perfetto trace JSON and / or its schedule and memory plot
    (`stratagem plan` and `explain`: `--timeline`, `--plot`)."""
    if timeline_path is not None:
        write_timeline(plan, timeline_path)
    if plot_path is not None:
        plot_plan(plan, plot_path)


def plot_whatif(result: WhatIf, path: str | Path) -> None:
    """Throughput and cost per scenario as bars (matplotlib's object-oriented API, no pyplot state)."""
    path = Path(path)
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(max(6.0, 1.2 * len(result.rows) + 2), 6.5), dpi=100, layout="constrained")
    canvas = FigureCanvasAgg(fig)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in canvas.get_supported_filetypes():
        raise UserError(f"--plot {path}: unknown image type {fmt!r}; use one of "
                        f"{', '.join(sorted(canvas.get_supported_filetypes()))}")
    labels = ["\n".join(f"{k}={v}" for k, v in r.values) or r.cluster for r in result.rows]
    has_cost = any(r.cost_per_million is not None for r in result.rows)
    axes = fig.subplots(2 if has_cost else 1, 1, sharex=True, squeeze=False)[:, 0]
    x = list(range(len(result.rows)))
    colors = ["#2ca02c" if i == result.best else "#1f77b4" for i in x]
    axes[0].bar(x, [r.throughput if r.ok else 0.0 for r in result.rows], color=colors)
    axes[0].set_ylabel(result.throughput_unit)
    if result.min_throughput is not None:
        axes[0].axhline(result.min_throughput, color="#d62728", linestyle="--", label="floor")
        axes[0].legend()
    for i, r in enumerate(result.rows):
        if r.ok:
            axes[0].annotate(f"MFU {100 * r.mfu:.0f}%", (i, r.throughput), ha="center", va="bottom", fontsize=8)
    if has_cost:
        per = "1M tokens" if result.throughput_unit == "tokens/s" else "1M samples"
        axes[1].bar(x, [r.cost_per_million or 0.0 for r in result.rows], color=colors)
        axes[1].set_ylabel(f"cost per {per}")
    axes[-1].set_xticks(x, labels, fontsize=8)
    fig.suptitle("what-if: best plan per scenario (green: " +
                 ("fastest" if result.objective is Objective.TIME else "cheapest") + ")")
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: folder {path.parent} does not exist")
    fig.savefig(path)
