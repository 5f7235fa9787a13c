"""A plan as one self-contained HTML page: summary, device mesh, stages, memory, step-time breakdown, pipeline
timeline, runner-ups and, with a second plan, what changed (`planner.reports.diff`).

Self-contained means viewable offline, forever: CSS inline, charts as inline SVG (`planner.reports.html_charts`),
no script and no external request. Every number is read from the plan file, so the page of a plan is reproducible
anywhere; each section has an `id` (summary, mesh, stages, memory, breakdown, timeline, alternatives, compare) and
machine-readable values sit in `data-*` attributes for tests and scrapers.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from costmodel.strategy import Schedule
from planner.errors import UserError
from planner.plan import Plan
from planner.reports.diff import Change, PlanDiff, diff_plans, format_value
from planner.reports.html_charts import breakdown_svg, memory_svg, mesh_svg, timeline_svg
from planner.reports.render import offload_text
from planner.reports.svg import attr, stage_colour
from planner.reports.timeline import build_timeline, segment_range
from planner.strategy_label import strategy_label

GIB = 1 << 30
MAX_TIMELINE_EVENTS = 20_000
"""Above this many simulated events the timeline is left out (the page would weigh megabytes); the trace JSON of
`stratagem explain --timeline` has them all."""

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;background:#f6f7f9;color:#1d2430}
main{max-width:1120px;margin:0 auto;padding:24px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:0 0 10px}
.sub{color:#5b6472;margin:0 0 18px}
section{background:#fff;border:1px solid #e1e4e8;border-radius:8px;padding:16px 18px;margin:0 0 16px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(160px,1fr));gap:10px}
.card{border:1px solid #e1e4e8;border-radius:6px;padding:8px 10px}
.card .k{font-size:12px;color:#5b6472}.card .v{font-size:17px;font-weight:600}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{border-bottom:1px solid #eceef1;padding:5px 8px;text-align:left;vertical-align:top;overflow-wrap:anywhere}
details summary{cursor:pointer;color:#5b6472;font-size:13px;margin:8px 0}
th{background:#fafbfc;font-weight:600} td.n{text-align:right;font-variant-numeric:tabular-nums}
.swatch{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px}
.bad{color:#b42318;font-weight:600}.good{color:#067647;font-weight:600}
code{background:#f1f3f5;padding:1px 4px;border-radius:3px;font-size:12px}
svg.chart{max-width:100%;height:auto;font-family:inherit} .note{color:#5b6472;font-size:12px}
"""


def render_html(plan: Plan, *, compare: Plan | None = None, title: str | None = None,
                plan_label: str = "plan", compare_label: str = "old") -> str:
    """The page (module docstring); `compare` adds the diff from that plan to this one."""
    name = title or f"Stratagem plan: {plan.model.name} on {plan.cluster.get('name', '?')}"
    parts = [_summary(plan), _section("mesh", "Device mesh", mesh_svg(plan)), _stages(plan),
             _section("memory", "Memory per stage against capacity", memory_svg(plan)),
             _section("breakdown", "Step-time breakdown", breakdown_svg(plan)), _timeline(plan),
             _alternatives(plan)]
    if compare is not None:
        parts.append(_compare(diff_plans(compare, plan, old_label=compare_label, new_label=plan_label)))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"generator\" content=\"stratagem report\"><title>{escape(name)}</title>"
            f"<style>{CSS}</style></head><body><main><h1>{escape(name)}</h1>"
            f"<p class=\"sub\">{escape(strategy_label(plan.strategy))}</p>" + "".join(parts)
            + f"<p class=\"note\">model fingerprint <code>{escape(plan.model.fingerprint[:16])}</code>, plan schema "
              f"{plan.schema_version}; written by <code>stratagem report</code>.</p></main></body></html>\n")


def _section(sid: str, heading: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{escape(heading)}</h2>{body}</section>'


def _card(key: str, label: str, value: str, raw: object) -> str:
    return (f'<div class="card" data-key="{attr(key)}" data-value="{attr(raw)}"><div class="k">{escape(label)}</div>'
            f'<div class="v">{escape(value)}</div></div>')


def _summary(plan: Plan) -> str:
    p, s, t = plan.predicted, plan.strategy, plan.training
    band = f" ± {100 * p.error_band:.0f}%" if p.error_band > 0 else ""
    rate = (f"{p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s is not None else f"{p.samples_per_s:,.1f} samples/s")
    schedule = f"interleaved:{s.virtual_stages}" if s.schedule is Schedule.INTERLEAVED else s.schedule.value
    cards = [_card("step_time_s", "step time", f"{_time(p.step_time_s)}{band}", p.step_time_s),
             _card("throughput", "throughput", rate, p.tokens_per_s or p.samples_per_s),
             _card("mfu", "MFU", f"{100 * p.mfu:.1f}%", p.mfu),
             _card("tflops_per_device", "TFLOP/s per device", f"{p.model_tflops_per_device:.1f}",
                   p.model_tflops_per_device),
             _card("peak_memory_bytes", "peak memory per device", f"{max(p.peak_memory_bytes) / GIB:.1f} GiB",
                   max(p.peak_memory_bytes)),
             _card("devices", "devices", f"{s.num_devices}", s.num_devices),
             _card("global_batch", "global batch", f"{t.global_batch}" + (f" x {t.seq_len}" if t.seq_len else ""),
                   t.global_batch),
             _card("schedule", "schedule", f"{schedule}, {s.num_microbatches} x {s.microbatch_size}", schedule),
             _card("fits", "fits in memory", "yes" if p.fits else "NO", p.fits),
             _card("search", "search", _search_text(plan), plan.search.status)]
    offloaded = offload_text(s, p)
    if offloaded:
        cards.append(_card("offload", "offload to host", s.runtime.offload.value, s.runtime.offload.value))
    problems = "".join(f'<p class="bad">{escape(x)}</p>' for x in p.problems)
    note = f'<p class="note">{escape(offloaded)}</p>' if offloaded else ""
    return _section("summary", "Summary", f'<div class="cards">{"".join(cards)}</div>{note}{problems}')


def _search_text(plan: Plan) -> str:
    info = plan.search
    if info.status == "fixed":
        return "given (estimate)"
    return f"{info.status}, gap {100 * info.optimality_gap:.1f}%"


def _stages(plan: Plan) -> str:
    s = plan.strategy
    head = ("<tr><th>stage</th><th>segments</th><th>device</th><th>recompute</th><th>forward / micro-batch</th>"
            "<th>backward / micro-batch</th><th>memory / capacity</th><th>in flight</th></tr>")
    rows = []
    for se in plan.predicted.stages:
        chunks = s.stages[se.index::s.pp] if s.stages else ()
        segs = ", ".join(segment_range(c.start, c.stop) for c in chunks) or segment_range(se.start, se.stop)
        recompute = ",".join(sorted({c.recompute_label for c in chunks})) or s.recompute.value
        share = se.memory.total / se.capacity_bytes if se.capacity_bytes else 0.0
        cls = ' class="n bad"' if share > 1 else ' class="n"'
        rows.append(f'<tr data-stage="{se.index}"><td><span class="swatch" style="background:'
                    f'{stage_colour(se.index)}"></span>{se.index}</td><td>{escape(segs)}</td>'
                    f"<td>{escape(se.device)}</td><td>{escape(recompute)}</td>"
                    f'<td class="n" data-value="{se.fwd_s!r}">{_time(se.fwd_s)}</td>'
                    f'<td class="n" data-value="{se.bwd_s!r}">{_time(se.bwd_s)}</td>'
                    f'<td{cls} data-value="{se.memory.total}">{se.memory.total / GIB:.1f} / '
                    f"{se.capacity_bytes / GIB:.1f} GiB ({100 * share:.0f}%)</td>"
                    f'<td class="n">{se.in_flight_microbatches}</td></tr>')
    return _section("stages", "Stages", f"<table>{head}{''.join(rows)}</table>")


def _time(seconds: float) -> str:
    return f"{seconds:.4g} s" if seconds >= 1 else f"{seconds * 1e3:.4g} ms"


def _timeline(plan: Plan) -> str:
    try:
        timeline = build_timeline(plan)
    except UserError as e:
        return _section("timeline", "Pipeline timeline", f'<p class="note">no timeline: {escape(str(e))}</p>')
    if len(timeline.events) > MAX_TIMELINE_EVENTS:
        return _section("timeline", "Pipeline timeline",
                        f'<p class="note">{len(timeline.events):,} simulated events: too many to draw here; '
                        f"<code>stratagem explain PLAN --timeline step.json</code> writes them for Perfetto.</p>")
    note = (f'<p class="note">simulated step of {timeline.step_time_s:.4g} s (the prediction); one micro-batch '
            f"forward F and backward B per box, idle time is the bubble.</p>")
    return _section("timeline", "Pipeline timeline", timeline_svg(timeline) + note)


def _alternatives(plan: Plan) -> str:
    alts = plan.search.alternatives
    if not alts:
        return _section("alternatives", "Runner-ups", '<p class="note">none recorded (a given strategy).</p>')
    best = plan.predicted.step_time_s
    rows = []
    for a in alts:
        rel = f"{100 * (a.step_time_s / best - 1):+.1f}%" if a.step_time_s else "-"
        rows.append(f'<tr><td><code>{escape(a.summary)}</code></td><td class="n" data-value="{a.step_time_s!r}">'
                    f'{_time(a.step_time_s) if a.step_time_s else "-"}</td><td class="n">{rel}</td>'
                    f"<td>{escape(a.reason)}</td></tr>")
    head = "<tr><th>strategy</th><th>step time</th><th>vs plan</th><th>why it lost</th></tr>"
    return _section("alternatives", "Runner-ups", f"<table>{head}{''.join(rows)}</table>")


def _compare(diff: PlanDiff) -> str:
    if diff.is_empty:
        return _section("compare", f"Changes from {diff.old_label}", '<p class="note">the plans are the same.</p>')
    change = diff.new_step_time_s / diff.old_step_time_s - 1 if diff.old_step_time_s else 0.0
    verdict = (f'<p class="{"good" if change < 0 else "bad"}" data-key="step_time_change" data-value="{change!r}">'
               f"predicted step time {diff.old_step_time_s:.4g} s -> {diff.new_step_time_s:.4g} s "
               f"({100 * change:+.1f}%)</p>")
    head = (f"<tr><th>section</th><th>field</th><th>{escape(diff.old_label)}</th><th>{escape(diff.new_label)}</th>"
            f"<th>change</th></tr>")
    named = f"<table>{head}{_change_rows(diff.named)}</table>"
    details = (f"<details><summary>{len(diff.details)} more changed values</summary><table>{head}"
               f"{_change_rows(diff.details)}</table></details>" if diff.details else "")
    return _section("compare", f"Changes from {diff.old_label}", verdict + named + details)


def _change_rows(changes: Sequence[Change]) -> str:
    rows = []
    for c in changes:
        pct = f"{c.pct:+.1f}%" if c.pct is not None else ""
        rows.append(f'<tr data-section="{attr(c.section)}"><td>{escape(c.section)}</td><td>{escape(c.field)}</td>'
                    f"<td>{escape(format_value(c.old, c.unit))}</td><td>{escape(format_value(c.new, c.unit))}</td>"
                    f'<td class="n">{pct}</td></tr>')
    return "".join(rows)
