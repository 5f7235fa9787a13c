"""The charts of the HTML plan report, each an inline SVG built from the plan alone: the device mesh, memory per
stage against capacity, the step-time breakdown and the simulated pipeline timeline (`planner.reports.timeline`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from costmodel.rank_layout import axis_strides, coordinates_of
from costmodel.strategy import MeshAxis, Strategy
from planner.plan import Plan
from planner.reports.svg import (
    EVENT_COLOURS,
    MEMORY_COLOURS,
    TERM_COLOURS,
    Segment,
    legend,
    nice_ticks,
    rect,
    stacked_bar,
    stage_colour,
    svg,
    text,
    time_unit,
)
from planner.reports.timeline import StepTimeline

GIB = 1 << 30
TERM_LABELS = {"compute_s": "compute", "recompute_s": "recomputation", "tp_comm_s": "tensor-parallel comm",
               "pp_comm_s": "pipeline send/recv", "dp_comm_s": "data-parallel comm", "bubble_s": "pipeline bubble",
               "optimizer_s": "optimizer step", "framework_s": "framework host work",
               "offload_s": "host-device copies (offload)"}
MAX_MESH_NODES = 32
"""Nodes drawn in the mesh picture; larger clusters show the first ones (the pattern repeats) and say so."""


def node_layout(cluster: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(group name, devices) of every node in rank order, the cluster's groups one after the other."""
    return [(g["name"], int(g["devices_per_node"])) for g in cluster["groups"] for _ in range(int(g["num_nodes"]))]


def mesh_svg(plan: Plan) -> str:
    """Nodes (rows) x devices (columns): fill = pipeline stage, label = tp/cp/dp position, a frame per tp group."""
    s = plan.strategy
    nodes = node_layout(plan.cluster)
    shown = nodes[:MAX_MESH_NODES]
    width_devices = max(d for _, d in shown)
    cell, gap, left, top = 46, 4, 150, 30
    width = max(left + width_devices * (cell + gap) + 20, 900)
    height = top + len(shown) * (cell + gap) + 60
    body = [text(left, 18, "device (rank)", size=11)]
    rank = 0
    for row, (group, devices) in enumerate(shown):
        y = top + row * (cell + gap)
        body.append(text(left - 8, y + cell / 2 + 4, f"node {row} ({group})", anchor="end", size=11))
        for col in range(devices):
            body += _mesh_cell(s, rank, left + col * (cell + gap), y, cell)
            rank += 1
    body += _tp_frames(s, shown, left, top, cell, gap)
    note = "" if len(shown) == len(nodes) else f" — first {len(shown)} of {len(nodes)} nodes shown"
    stages = [(stage_colour(i), f"stage {i}") for i in range(s.pp)]
    body += legend(stages + [("#dddddd", "unused")], left, height - 32, per_row=8, col_width=90)
    body.append(text(left, height - 8, f"label: t = tensor-parallel, c = context-parallel, d = data-parallel index; "
                                      f"frame: one tensor-parallel group{note}", size=11))
    return svg(width, height, body, label="device mesh: nodes by devices, coloured by pipeline stage")


def _mesh_cell(s: Strategy, rank: int, x: float, y: float, cell: float) -> list[str]:
    if rank >= s.num_devices:
        return [rect(x, y, cell, cell, "#dddddd", title=f"rank {rank}: unused", extra='rx="4"')]
    c = coordinates_of(s, rank)
    stage = c[MeshAxis.PP]
    label = f"t{c[MeshAxis.TP]}" + (f" c{c[MeshAxis.CP]}" if s.cp > 1 else "")
    title = (f"rank {rank}: stage {stage}, tp {c[MeshAxis.TP]}, cp {c[MeshAxis.CP]}, dp {c[MeshAxis.DP]}")
    return [rect(x, y, cell, cell, stage_colour(stage), title=title,
                 extra=f'rx="4" fill-opacity="0.85" data-rank="{rank}" data-stage="{stage}"'),
            text(x + cell / 2, y + 18, label, anchor="middle", size=11, extra='fill="#fff"'),
            text(x + cell / 2, y + 34, f"d{c[MeshAxis.DP]}", anchor="middle", size=11, extra='fill="#fff"')]


def _tp_frames(s: Strategy, nodes: Sequence[tuple[str, int]], left: float, top: float, cell: float,
               gap: float) -> list[str]:
    """A frame around each run of consecutive ranks of one tensor-parallel group (tp innermost: a row segment)."""
    if s.tp == 1 or axis_strides(s)[MeshAxis.TP] != 1:
        return []
    out, rank = [], 0
    for row, (_, devices) in enumerate(nodes):
        for col in range(0, devices, s.tp):
            if rank + col >= s.num_devices or col + s.tp > devices:
                break
            x, y = left + col * (cell + gap) - 2, top + row * (cell + gap) - 2
            out.append(rect(x, y, s.tp * (cell + gap) - gap + 4, cell + 4, "none",
                            extra='stroke="#222" stroke-width="2" rx="6" class="tp-group"'))
        rank += devices
    return out


def memory_svg(plan: Plan) -> str:
    """Per stage: stacked bar of its memory terms against a capacity line."""
    stages = plan.predicted.stages
    top_value = max(max(st.memory.total, st.capacity_bytes) for st in stages)
    left, bar, gap, width = 90, 22, 12, 640
    height = 20 + len(stages) * (bar + gap) + 50
    body = []
    for i, st in enumerate(stages):
        y = 20 + i * (bar + gap)
        # Offloaded state sits in host memory: not a part of the device's bar.
        parts = [Segment(k, k, v / GIB, MEMORY_COLOURS[k]) for k, v in st.memory.to_dict().items() if k != "host"]
        body.append(text(left - 8, y + bar / 2 + 4, f"stage {st.index}", anchor="end", size=12))
        body += stacked_bar(parts, left, y, width, bar, top_value / GIB, "GiB")
        cap_x = left + width * st.capacity_bytes / top_value
        body.append(rect(cap_x - 1, y - 4, 2, bar + 8, "#222", title=f"capacity {st.capacity_bytes / GIB:.1f} GiB"))
        body.append(text(left + width + 8, y + bar / 2 + 4,
                         f"{st.memory.total / GIB:.1f} / {st.capacity_bytes / GIB:.1f} GiB", size=11))
    body += legend([(c, k) for k, c in MEMORY_COLOURS.items()] + [("#222", "capacity")], left, height - 20,
                   per_row=7, col_width=100)
    return svg(left + width + 130, height, body, label="memory per stage against device capacity")


def breakdown_svg(plan: Plan) -> str:
    """The predicted step as one bar split into the breakdown's terms."""
    bd = plan.predicted.breakdown.to_dict()
    total = plan.predicted.step_time_s
    scale, unit = time_unit(total)
    parts = [Segment(k, TERM_LABELS[k], v * scale, TERM_COLOURS[k]) for k, v in bd.items() if v > 0]
    body = stacked_bar(parts, 10, 10, 760, 30, total * scale, unit)
    items = [(TERM_COLOURS[k], f"{TERM_LABELS[k]} {v * scale:.3g} {unit} ({100 * v / total:.0f}%)")
             for k, v in bd.items() if v > 0]
    body += legend(items, 10, 62, per_row=3, col_width=260)
    return svg(780, 62 + 18 * ((len(items) + 2) // 3) + 6, body, label="step-time breakdown")


def timeline_svg(timeline: StepTimeline) -> str:
    """Gantt chart of the simulated step: one row per pipeline stage, nested parts drawn thinner inside."""
    span = timeline.step_time_s
    scale, unit = time_unit(span)
    left, row, width = 80, 34, 900
    height = 30 + timeline.num_stages * row + 60
    body = []
    for t in nice_ticks(span * scale):
        x = left + width * t / (span * scale)
        body += [rect(x, 20, 0.6, timeline.num_stages * row, "#ccc"),
                 text(x, 14, f"{t:g} {unit}", anchor="middle", size=10)]
    for d in range(timeline.num_stages):
        body.append(text(left - 8, 20 + d * row + row / 2 + 4, f"stage {d}", anchor="end", size=12))
    for e in timeline.events:
        x = left + width * e.start_s / span
        w = width * e.duration_s / span
        y = 20 + e.stage * row + (4 if e.depth == 0 else 16)
        h = row - 8 if e.depth == 0 else row - 20
        body.append(rect(x, y, w, h, EVENT_COLOURS[e.kind.value],
                         title=f"{e.name}: {e.start_s * scale:.4g}-{e.end_s * scale:.4g} {unit}",
                         extra=f'data-kind="{e.kind.value}"'))
    body += legend([(c, k.replace("_", " ")) for k, c in EVENT_COLOURS.items()], left,
                   20 + timeline.num_stages * row + 30, per_row=8, col_width=110)
    return svg(left + width + 20, height, body, label="simulated pipeline timeline of one step")
