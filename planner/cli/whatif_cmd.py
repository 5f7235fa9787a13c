"""`stratagem whatif MODEL --cluster SPEC --batch B --vary KEY=V1,V2,...`: re-plan for each value of a knob.

Keys: tier.NAME.bandwidth (also aggregate_bandwidth, latency, efficiency), device (`h100-sxm@9.8` sets a price),
nodes, group.NAME.{device,num_nodes,price_per_device_hour,memory}, speed.RANK, batch, seq, and cluster (candidate
cluster files or shorthands, instead of --cluster). Several --vary make every combination. Prints a table of the
best step time, throughput, MFU and cost per scenario, marking the fastest -- or, with `--objective cost`, the
cheapest that reaches `--min-throughput` (tokens/s; samples/s for models without a sequence). `--plot FILE.png`
draws it; `--json` prints {"keys", "objective", "min_throughput", "throughput_unit", "best", "rows"}.
"""

from __future__ import annotations

import argparse
import json

from ir.layer_chain import LayerChain
from planner.cli.common import (
    add_model_arguments,
    add_time_limit_argument,
    add_trace_cache_arguments,
    check_output_path,
    input_paths,
    positive_float,
    positive_int,
    time_limit_s,
    trace_cache,
)
from planner.cli.progress import live, scenario_callback
from planner.errors import UserError
from planner.search.space import FIX_KEYS, Objective, SearchSpace
from planner.tracing import trace_model


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("whatif", help="re-plan for each value of a cluster or training knob (and cost)",
                              description=__doc__.split("\n\n")[1])
    add_model_arguments(p)
    p.add_argument("--cluster", default=None, metavar="SPEC",
                   help="NODESxGPUSxDEVICE or a cluster YAML file (or vary cluster=...)")
    p.add_argument("--batch", type=positive_int, default=None, metavar="B",
                   help="global batch (samples per step); required unless --vary batch=...")
    p.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2,...",
                   help="a knob and its values (repeatable: every combination)")
    p.add_argument("--objective", choices=[o.value for o in Objective], default=Objective.TIME.value,
                   help="mark the fastest scenario (time, default) or the cheapest per token (cost)")
    p.add_argument("--min-throughput", type=positive_float, default=None, metavar="X",
                   help="with --objective cost: tokens/s (samples/s without a sequence) a plan must reach")
    p.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help=f"pin a dimension in every scenario; keys: {', '.join(sorted(set(FIX_KEYS)))}")
    p.add_argument("--top", type=positive_int, default=8, metavar="K",
                   help="cost objective: cheapest strategies per scenario checked against the floor (default 8)")
    add_time_limit_argument(p, per="per scenario: ")
    add_trace_cache_arguments(p)
    p.add_argument("--plot", default=None, metavar="FILE.png", help="draw throughput and cost per scenario")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.reports.plot import plot_whatif
    from planner.scenarios.variations import parse_vary, scenarios
    from planner.scenarios.whatif import WhatIfOptions, render_table, whatif

    plot = check_output_path(args.plot, input_paths(args.cluster)) if args.plot else None
    try:
        variations = [parse_vary(v) for v in args.vary]
        space = SearchSpace.from_fixes(args.fix)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.min_throughput is not None and args.objective != Objective.COST.value:
        raise UserError("--min-throughput needs --objective cost (the floor picks the cheapest plan reaching it)")
    scenario_list = scenarios(args.cluster, args.batch, args.seq, variations)
    built_models: dict[int | None, LayerChain] = {}
    cache = trace_cache(args)

    def chain_for(seq: int | None) -> LayerChain:
        if seq not in built_models:
            built_models[seq] = trace_model(args.model, args.sets, seq=seq, cache=cache).chain
        return built_models[seq]

    options = WhatIfOptions(objective=Objective(args.objective), min_throughput=args.min_throughput,
                            space=space, top_k=args.top, time_limit_s=time_limit_s(args))
    with live(enabled=not args.json) as display:
        result = whatif(chain_for, scenario_list, options=options,
                        progress=scenario_callback(display))
    if plot is not None:
        plot_whatif(result, plot)
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True, indent=2))
    else:
        batch = f", global batch {args.batch}" if args.batch else ""
        print(f"what-if for {args.model}{batch}: {len(result.rows)} scenario(s)")
        print(render_table(result))
    return 0

