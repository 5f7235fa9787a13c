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

from costmodel.hardware.cluster import Cluster
from planner.api import load_profile, plan_top
from planner.cli.common import (
    add_cluster_argument,
    add_dtype_argument,
    add_model_arguments,
    add_output_arguments,
    add_profile_argument,
    build_model,
    check_output_path,
    input_paths,
    parse_cluster,
    positive_float,
    positive_int,
    progress_printer,
    trace_chain,
    write_text,
)
from planner.errors import UserError
from planner.plan import Plan
from planner.reports.render import render_plan
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
    profile = load_profile(args.profile) if args.profile else None
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
        from planner.reports.plot import write_pictures

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
        print(render_plan(p, cluster))
