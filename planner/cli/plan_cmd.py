"""`stratagem plan MODEL --cluster SPEC --batch B`: search the best parallelization strategy and print the plan.

Prints the device mesh (axes, sizes, the network tier each spans), a table of pipeline stages (layers, devices,
recomputation, memory against capacity), the predicted step time, throughput, TFLOP/s per device, MFU and the
breakdown, the search status and the runner-ups that lost. `--json` prints the Plan JSON (a list of plans with
`--top K` > 1); `-o FILE` writes the best plan. A progress line goes to stderr only when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from costmodel.cluster import Cluster
from costmodel.estimate import axis_strides
from costmodel.memory import GIB
from costmodel.strategy import MeshAxis, Schedule
from planner.api import plan_top
from planner.cli.common import (
    add_cluster_argument,
    add_dtype_argument,
    add_model_arguments,
    add_output_arguments,
    add_profile_argument,
    build_model,
    check_output_path,
    input_paths,
    load_profile,
    parse_cluster,
    positive_float,
    positive_int,
    progress_printer,
    trace_chain,
    write_text,
)
from planner.errors import UserError
from planner.plan import Plan
from planner.search.space import FIX_KEYS, Objective, SearchSpace


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="search the best parallelization strategy for a model on a cluster",
                              description=__doc__.split("\n\n")[1])
    add_model_arguments(p)
    add_cluster_argument(p)
    add_dtype_argument(p)
    add_profile_argument(p)
    p.add_argument("--batch", type=positive_int, required=True, metavar="B", help="global batch (samples per step)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help=f"pin a dimension (repeatable); keys: {', '.join(sorted(set(FIX_KEYS)))}")
    p.add_argument("--top", type=positive_int, default=1, metavar="K", help="return the K best distinct strategies")
    p.add_argument("--time-limit", type=positive_float, default=None, metavar="SEC",
                   help="stop searching after SEC seconds with the best plan so far (status 'feasible')")
    p.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.TIME.value,
                   help="minimize step time (default) or cost per step (needs prices in the cluster YAML)")
    p.add_argument("--max-mbs", type=positive_int, default=SearchSpace().max_microbatch_size, metavar="N",
                   help="largest micro-batch size to try (default %(default)s)")
    p.add_argument("--tp-across-nodes", action="store_true", help="let tensor parallelism span nodes")
    add_output_arguments(p)
    p.add_argument("--timeline", metavar="FILE.json", default=None,
                   help="also write the best plan's simulated step as Chrome/Perfetto trace JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="also draw the best plan's pipeline schedule and memory per stage (matplotlib)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    inputs = input_paths(args.cluster)
    outputs = {flag: check_output_path(path, inputs, flag=flag) for flag, path in
               (("-o", args.output), ("--timeline", args.timeline), ("--plot", args.plot)) if path}
    if len({str(p.resolve()) for p in outputs.values()}) < len(outputs):
        raise UserError("-o, --timeline and --plot must name different files")
    cluster = parse_cluster(args.cluster)
    profile, cluster = load_profile(args.profile, cluster)
    try:
        space = SearchSpace.from_fixes(args.fix, max_microbatch_size=args.max_mbs,
                                       tp_across_nodes=args.tp_across_nodes)
    except ValueError as e:
        raise UserError(str(e)) from None
    built = build_model(args.model, args.sets, seq=args.seq)
    chain = trace_chain(built, dtype=args.dtype)
    plans = plan_top(chain, None, cluster, profile=profile, global_batch=args.batch, dtype=args.dtype,
                     top_k=args.top, space=space,
                     objective=args.objective, time_limit_s=args.time_limit, model_name=built.name,
                     settings=built.settings, progress=progress_printer())
    emit(plans, cluster, args.json, outputs)
    return 0


def emit(plans: Sequence[Plan], cluster: Cluster, as_json: bool, outputs: dict) -> None:
    """Print the plans and write the requested files (shared with `stratagem estimate`)."""
    best = plans[0]
    if "-o" in outputs:
        write_text(outputs["-o"], best.to_json())
    if "--timeline" in outputs or "--plot" in outputs:
        from planner.cli.explain_cmd import write_pictures

        write_pictures(best, timeline_path=outputs.get("--timeline"), plot_path=outputs.get("--plot"))
    if as_json:
        if len(plans) == 1:
            print(best.to_json(), end="")
        else:
            print(json.dumps([p.to_dict() for p in plans], sort_keys=True, indent=2))
        return
    for i, p in enumerate(plans):
        if len(plans) > 1:
            print(f"=== #{i + 1} of {len(plans)} ===")
        print(format_plan(p, cluster))


# ---- readable output -------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def format_mesh(plan: Plan, cluster: Cluster) -> str:
    s = plan.strategy
    strides = axis_strides(s)
    parts = []
    for axis in s.mesh_order:
        size = {MeshAxis.TP: s.tp, MeshAxis.CP: s.cp, MeshAxis.DP: s.dp, MeshAxis.PP: s.pp, MeshAxis.EP: s.ep}[axis]
        if size == 1 and axis is not MeshAxis.DP:
            continue
        if axis is MeshAxis.EP:
            parts.append(f"ep={size} (on dp ranks)")
            continue
        stride = strides[axis]
        # pp neighbours are `stride` apart; the other axes form groups of `size` ranks `stride` apart.
        tier = cluster.tier_spanned(2 if axis is MeshAxis.PP and size > 1 else size, stride)
        parts.append(f"{axis.value}={size} ({tier.name if tier else 'one device'})")
    used = s.num_devices
    total = cluster.num_devices
    count = f"{used} devices" if used == total else f"{used} of {total} devices"
    return f"mesh: {' x '.join(parts)}  = {count}, innermost first"


def format_stages(plan: Plan) -> list[str]:
    s, est = plan.strategy, plan.predicted
    per_rank = s.tp * s.cp * s.dp
    rows = []
    for r, se in enumerate(est.stages):
        chunks = s.stages[r::s.pp] if s.stages else ()
        segs = ", ".join(f"{c.start}-{c.stop - 1}" if c.stop - c.start > 1 else f"{c.start}" for c in chunks) \
            or f"{se.start}-{se.stop - 1}"
        recompute = ",".join(sorted({c.recompute.value for c in chunks})) or s.recompute.value
        mem = f"{_gib(se.memory.total)} / {_gib(se.capacity_bytes)} GiB"
        rows.append((str(r), segs, str(per_rank), recompute, mem, str(se.in_flight_microbatches)))
    head = ("stage", "segments", "devices", "recompute", "memory / capacity", "in flight")
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    align = (">", "<", ">", "<", ">", ">")
    return ["  " + "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True))
            for row in (head, *rows)]


def format_plan(plan: Plan, cluster: Cluster) -> str:
    s, est, info = plan.strategy, plan.predicted, plan.search
    sched = f"interleaved (v={s.virtual_stages})" if s.schedule is Schedule.INTERLEAVED else s.schedule.value
    seq = f", seq {plan.training.seq_len}" if plan.training.seq_len else ""
    lines = [
        f"plan for {plan.model.name} ({plan.model.params / 1e9:.2f}B params) on {cluster.name} "
        f"({cluster.num_devices} devices), global batch {plan.training.global_batch}{seq}",
        format_mesh(plan, cluster),
        f"schedule: {sched}, {s.num_microbatches} micro-batch{'es' if s.num_microbatches > 1 else ''} of "
        f"{s.microbatch_size}, ZeRO-{s.zero_stage}, "
        f"sequence parallel {'on' if s.sequence_parallel else 'off'}",
        "stages:",
        *format_stages(plan),
    ]
    throughput = (f"{est.tokens_per_s:,.0f} tokens/s" if est.tokens_per_s is not None
                  else f"{est.samples_per_s:,.1f} samples/s")
    lines += [
        f"step time: {est.step_time_s:.4g} s   throughput: {throughput}   "
        f"{est.model_tflops_per_device:.1f} TFLOP/s per device   MFU {100 * est.mfu:.1f}%",
        "breakdown: " + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.3g} s "
                                  f"({100 * v / est.step_time_s:.0f}%)"
                                  for k, v in est.breakdown.to_dict().items() if v > 0),
    ]
    if not est.fits:
        lines.append("DOES NOT FIT: " + "; ".join(est.problems))
    if plan.sharding:
        styles = ", ".join(f"{m.module}={m.style.value}" for m in plan.sharding if m.style.value != "replicate")
        lines.append(f"tensor-parallel sharding: {styles or 'all replicated'}")
    if info.status == "fixed":
        lines.append("search: none (strategy given)")
    else:
        cut = " (cut short by --time-limit)" if info.status == "feasible" else ""
        lines.append(f"search: {info.status}{cut}, {info.candidates} candidates priced in {info.time_s:.2f} s, "
                     f"optimality gap {100 * info.optimality_gap:.1f}% (lower bound {info.lower_bound_s:.4g} s)")
    if info.alternatives:
        lines.append("runner-ups:")
        lines += [f"  {a.summary}: {a.reason}" for a in info.alternatives]
    return "\n".join(lines)
