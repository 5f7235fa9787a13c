"""`stratagem estimate MODEL --cluster SPEC --batch B --tp T --pp P --dp D --mbs M`: price one given strategy.

Prints the same report as `stratagem plan` for the strategy the flags describe (search status "fixed"); `--json`
prints its Plan JSON and `-o FILE` writes it. A strategy that cannot run (degrees that do not fit the cluster, a
batch that does not divide, tp that does not divide the heads) is an error that says why (exit 2); one that runs
out of memory is still priced and reported as not fitting, with the memory each stage needs.

Three flags price the strategy as another trainer runs it (`costmodel.strategy.RuntimeOptions`): `--no-dp-overlap`
(data-parallel communication after the backward, as Megatron-LM before its overlap flags or DeepSpeed's pipeline
engine), `--keep-gathered` (ZeRO-3 keeps gathered weights from forward to backward: FSDP2
`reshard_after_forward=False`) and `--tp-overlap` (Megatron-Core / Transformer Engine `--tp-comm-overlap`).
"""

from __future__ import annotations

import argparse

from costmodel.strategy import Recompute, RuntimeOptions, Schedule, Strategy
from planner.api import estimate_plan, load_profile
from planner.cli.common import (
    add_cluster_argument,
    add_dtype_argument,
    add_model_arguments,
    add_output_arguments,
    add_profile_argument,
    add_trace_cache_arguments,
    check_output_path,
    input_paths,
    parse_cluster,
    positive_int,
    trace_cache,
)
from planner.cli.plan_cmd import emit
from planner.errors import UserError
from planner.tracing import trace_model


def schedule_arg(text: str) -> tuple[Schedule, int]:
    """`1f1b`, `gpipe` or `interleaved:V` -> (schedule, virtual stages)."""
    name, _, v = text.strip().lower().partition(":")
    valid = "1f1b, gpipe, interleaved:V"
    try:
        schedule = Schedule(name)
    except ValueError:
        raise argparse.ArgumentTypeError(f"unknown schedule {text!r}; valid: {valid}") from None
    if schedule is Schedule.INTERLEAVED:
        if not v.isdigit() or int(v) < 2:
            raise argparse.ArgumentTypeError(f"interleaved needs :V with V >= 2 chunks per rank, e.g. "
                                             f"interleaved:2; got {text!r}")
        return schedule, int(v)
    if v:
        raise argparse.ArgumentTypeError(f"only interleaved takes :V, got {text!r}; valid: {valid}")
    return schedule, 1


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("estimate", help="predict step time and memory of one given strategy",
                              description=__doc__.split("\n\n")[1])
    add_model_arguments(p)
    add_cluster_argument(p)
    add_dtype_argument(p)
    add_profile_argument(p)
    p.add_argument("--batch", type=positive_int, required=True, metavar="B", help="global batch (samples per step)")
    p.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel degree")
    p.add_argument("--pp", type=positive_int, required=True, help="pipeline-parallel degree")
    p.add_argument("--dp", type=positive_int, required=True, help="data-parallel degree")
    p.add_argument("--mbs", type=positive_int, required=True, help="micro-batch size")
    p.add_argument("--schedule", type=schedule_arg, default=(Schedule.ONE_F_ONE_B, 1),
                   metavar="1f1b|gpipe|interleaved:V", help="pipeline schedule (default 1f1b)")
    p.add_argument("--recompute", choices=[r.value for r in Recompute], default=Recompute.NONE.value,
                   help="activation recomputation of every stage (default none)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage (default 0)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    p.add_argument("--no-dp-overlap", action="store_true",
                   help="data-parallel communication does not overlap compute (another trainer's behaviour)")
    p.add_argument("--keep-gathered", action="store_true",
                   help="ZeRO-3 keeps gathered weights from forward to backward (no reshard after forward)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="tensor-parallel collectives overlap the GEMMs (Megatron-Core --tp-comm-overlap)")
    add_output_arguments(p)
    add_trace_cache_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    inputs = input_paths(args.cluster)
    outputs = {"-o": check_output_path(args.output, inputs)} if args.output else {}
    cluster = parse_cluster(args.cluster)
    profile = load_profile(args.profile) if args.profile else None
    per_step = args.dp * args.mbs
    if args.batch % per_step:
        raise UserError(f"--batch {args.batch} is not a multiple of dp*mbs = {args.dp}*{args.mbs} = {per_step}")
    schedule, v = args.schedule
    try:
        strategy = Strategy(dp=args.dp, tp=args.tp, pp=args.pp, microbatch_size=args.mbs,
                            num_microbatches=args.batch // per_step, schedule=schedule, virtual_stages=v,
                            zero_stage=args.zero, sequence_parallel=args.sp, recompute=Recompute(args.recompute),
                            runtime=RuntimeOptions(dp_overlap=not args.no_dp_overlap,
                                                   reshard_after_forward=not args.keep_gathered,
                                                   tp_overlap=args.tp_overlap))
    except ValueError as e:
        raise UserError(f"invalid strategy: {e}") from None
    traced = trace_model(args.model, args.sets, seq=args.seq, dtype=args.dtype, cache=trace_cache(args))
    plan = estimate_plan(traced.chain, cluster, strategy, profile=profile, global_batch=args.batch, dtype=args.dtype,
                         model_name=traced.name, settings=traced.settings)
    emit([plan], cluster, args.json, outputs)
    return 0
