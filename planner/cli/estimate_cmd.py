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

from costmodel.strategy import SCHEDULE_CHOICES, Recompute, RuntimeOptions, Schedule, Strategy, parse_schedule
from planner.api import estimate_plan, load_profile
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
    positive_int,
    trace_chain,
)
from planner.cli.plan_cmd import emit
from planner.errors import UserError


def schedule_arg(text: str) -> tuple[Schedule, int]:
    """`1f1b`, `gpipe`, `interleaved:V`, `interleaved-zb[:V]`, `zbv`, `dualpipev` -> (schedule, virtual stages)."""
    try:
        schedule, v = parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if schedule is Schedule.INTERLEAVED and v is None:
        raise argparse.ArgumentTypeError(f"interleaved needs :V with V >= 2 chunks per rank, e.g. interleaved:2; "
                                         f"got {text!r}")
    return schedule, v or 1


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
                   metavar="SCHEDULE", help=f"pipeline schedule: {SCHEDULE_CHOICES} (default 1f1b)")
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
    built = build_model(args.model, args.sets, seq=args.seq)
    chain = trace_chain(built, dtype=args.dtype)
    plan = estimate_plan(chain, cluster, strategy, profile=profile, global_batch=args.batch, dtype=args.dtype,
                         model_name=built.name,
                         settings=built.settings)
    emit([plan], cluster, args.json, outputs)
    return 0
