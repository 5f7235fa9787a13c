"""`stratagem plan MODEL --cluster SPEC --batch B`: search the best parallelization strategy and print the plan.

Prints the device mesh (axes, sizes, the network tier each spans), a table of pipeline stages (layers, devices,
recomputation, memory against capacity), the predicted step time, throughput, TFLOP/s per device, MFU and the
breakdown, the search status and the runner-ups that lost. `--json` prints the Plan JSON (a list of plans with
`--top K` > 1); `-o FILE` writes the best plan. The search stops after `--time-limit` seconds (default 60) with the
best plan found and its proven gap. Progress is drawn on stderr only when it is a terminal and without `--json`;
the traced model is kept in the trace cache (`planner.trace_cache`) for the next plan of the same model.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from costmodel.hardware.cluster import Cluster
from planner.api import load_profile, plan_top
from planner.cli.common import (
    add_cluster_argument,
    add_dtype_argument,
    add_fp8_argument,
    add_model_arguments,
    add_output_arguments,
    add_profile_argument,
    add_time_limit_argument,
    add_trace_cache_arguments,
    check_output_path,
    gap_percent,
    input_paths,
    parse_cluster,
    positive_int,
    time_limit_note,
    time_limit_s,
    trace_cache,
    write_text,
)
from planner.cli.progress import live, search_callback
from planner.errors import UserError
from planner.plan import Plan
from planner.reports.render import render_plan
from planner.search.outcome import DEFAULT_RELATIVE_GAP
from planner.search.space import FIX_KEYS, Objective, SearchSpace
from planner.trace_cache import TracedModel
from planner.tracing import trace_model


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="search the best parallelization strategy for a model on a cluster",
                              description=__doc__.split("\n\n")[1])
    add_model_arguments(p)
    add_cluster_argument(p)
    add_dtype_argument(p)
    add_fp8_argument(p)
    add_profile_argument(p)
    p.add_argument("--batch", type=positive_int, required=True, metavar="B", help="global batch (samples per step)")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help=f"pin a dimension (repeatable); keys: {', '.join(sorted(set(FIX_KEYS)))}")
    p.add_argument("--top", type=positive_int, default=1, metavar="K", help="return the K best distinct strategies")
    add_time_limit_argument(p)
    p.add_argument("--gap", type=gap_percent, default=100 * DEFAULT_RELATIVE_GAP, metavar="PCT",
                   help="stop once the plan is proven within PCT%% of the best strategy of the searched space "
                        "(default %(default)g; 0: prove it optimal)")
    p.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.TIME.value,
                   help="minimize step time (default) or cost per step (needs prices in the cluster YAML)")
    p.add_argument("--max-mbs", type=positive_int, default=SearchSpace().max_microbatch_size, metavar="N",
                   help="largest micro-batch size to try (default %(default)s)")
    p.add_argument("--tp-across-nodes", action="store_true", help="let tensor parallelism span nodes")
    p.add_argument("--baseline", default=None, metavar="TRAINER:FILE",
                   help="price this trainer configuration too (megatron:, torchtitan:, deepspeed:, "
                        "megatron-deepspeed:) and print the plan's predicted gain over it and the diff")
    add_output_arguments(p)
    add_trace_cache_arguments(p)
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
    baseline_cfg = None
    if args.baseline:
        from planner.trainers.convert import read_trainer_config

        baseline_cfg = read_trainer_config(args.baseline, flag="--baseline")  # a bad file fails before the search
    try:
        fixes = [*args.fix, f"fp8={args.fp8}"] if args.fp8 else args.fix
        space = SearchSpace.from_fixes(fixes, max_microbatch_size=args.max_mbs,
                                       tp_across_nodes=args.tp_across_nodes)
    except ValueError as e:
        raise UserError(str(e)) from None
    limit = time_limit_s(args)
    with live(enabled=not args.json) as display:
        progress = search_callback(display)
        traced = trace_model(args.model, args.sets, seq=args.seq, dtype=args.dtype, cache=trace_cache(args),
                             progress=progress)
        plans = plan_top(traced.chain, None, cluster, profile=profile, global_batch=args.batch, dtype=args.dtype,
                         top_k=args.top, space=space, objective=args.objective, time_limit_s=limit,
                         model_name=traced.name, settings=traced.settings, progress=progress,
                         relative_gap=args.gap / 100)
    if baseline_cfg is None:
        emit(plans, cluster, args.json, outputs)
    else:
        baseline = _baseline_plan(args, baseline_cfg, traced.chain, cluster, profile, traced)
        emit_with_baseline(plans[0], baseline, cluster, args, outputs)
    if note := time_limit_note(plans[0].search.status == "feasible", plans[0].search.optimality_gap, limit):
        print(note, file=sys.stderr)
    return 0


def _baseline_plan(args: argparse.Namespace, cfg: object, chain: object, cluster: Cluster, profile: object,
                   traced: TracedModel) -> Plan:
    """The baseline configuration priced on the same model, cluster and batch (as `estimate --from` does)."""
    from planner.api import estimate_plan
    from planner.trainers.convert import imported_strategy
    from planner.trainers.layout import BlockLayout

    imported = imported_strategy(args.baseline, cfg, BlockLayout.of(chain), cluster.num_available)
    if imported.global_batch != args.batch:
        raise UserError(f"--baseline {args.baseline} trains a global batch of {imported.global_batch}, --batch is "
                        f"{args.batch}; compare at the same batch")
    seq = chain.graph.seq_len
    if cfg.seq_len is not None and seq is not None and cfg.seq_len != seq:
        raise UserError(f"--baseline {args.baseline} trains sequences of {cfg.seq_len}, the model has {seq}; "
                        f"pass --seq {cfg.seq_len}")
    for note in cfg.notes:
        print(f"stratagem: warning: {note}", file=sys.stderr)
    return estimate_plan(chain, cluster, imported.strategy, profile=profile, global_batch=args.batch,
                         dtype=args.dtype, model_name=traced.name, settings=traced.settings)


def emit_with_baseline(best: Plan, baseline: Plan, cluster: Cluster, args: argparse.Namespace,
                       outputs: dict) -> None:
    from planner.reports.baseline import gain, render_baseline

    if "-o" in outputs:
        write_text(outputs["-o"], best.to_json())
    if args.json:
        print(json.dumps({"plan": best.to_dict(), "baseline": baseline.to_dict(), "source": args.baseline,
                          "gain": gain(baseline, best)}, sort_keys=True, indent=2))
        return
    print(render_plan(best, cluster))
    print(render_baseline(baseline, best, args.baseline))


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
