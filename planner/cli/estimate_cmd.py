"""`stratagem estimate MODEL --cluster SPEC --batch B --tp T --pp P --dp D --mbs M [--cp C --ep E]`: price one
given strategy.

Prints the same report as `stratagem plan` for the strategy the flags describe (search status "fixed"); `--json`
prints its Plan JSON and `-o FILE` writes it. A strategy that cannot run (degrees that do not fit the cluster, a
batch that does not divide, tp that does not divide the heads) is an error that says why (exit 2); one that runs
out of memory is still priced and reported as not fitting, with the memory each stage needs.

These flags price the strategy as another trainer runs it (`costmodel.strategy.RuntimeOptions`): `--no-dp-overlap`
(data-parallel communication after the backward, as Megatron-LM before its overlap flags or DeepSpeed's pipeline
engine), `--keep-gathered` (ZeRO-3 keeps gathered weights from forward to backward: FSDP2
`reshard_after_forward=False`), `--tp-overlap` (Megatron-Core / Transformer Engine `--tp-comm-overlap`), `--tp-grad-overlap` (each
column-parallel linear's input-gradient all-reduce runs during its weight-gradient GEMM: Megatron-LM's default),
`--p2p-scatter-gather` (pipeline sends of 1/tp of a replicated activation, all-gathered by the receiver:
Megatron-LM before Megatron-Core, DeepSpeed's pipeline engine) and `--p2p-blocking` (each pipeline send and
receive blocks both ends: DeepSpeed's pipeline engine); `--fused-kernels`, `--fp32-grad-pass`,
`--tp-sharded-weights`, `--cross-entropy torch|inplace|fused|loss-parallel` and `--metric-passes N` are the other
`RuntimeOptions` of the same name.
`--offload optimizer|params` keeps model state in host memory (`costmodel.offload`): the optimizer state alone
(ZeRO-Offload) or, under `--zero 3`, the sharded parameters, gradients and optimizer state (FSDP2
`CPUOffloadPolicy`).

`--from TRAINER:FILE` prices the configuration a team runs today instead of the flags: a Megatron-LM or
Megatron-DeepSpeed argument file, a torchtitan TOML job config or a DeepSpeed JSON config
(`planner.trainers`); the data-parallel degree is what the cluster leaves, the sequence length and dtype are the
file's unless --seq / --dtype say otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from costmodel.strategy import (
    SCHEDULE_CHOICES,
    CrossEntropy,
    Offload,
    Recompute,
    RuntimeOptions,
    Schedule,
    Strategy,
    parse_schedule,
)
from planner.api import estimate_plan, load_profile
from planner.cli.common import (
    add_cluster_argument,
    add_dtype_argument,
    add_fp8_argument,
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
    add_dtype_argument(p, default=None)
    add_fp8_argument(p)
    add_profile_argument(p)
    p.add_argument("--from", dest="from_", default=None, metavar="TRAINER:FILE",
                   help="price a trainer's configuration instead of the flags below: megatron:ARGS, "
                        "torchtitan:TOML, deepspeed:JSON or megatron-deepspeed:ARGS")
    p.add_argument("--batch", type=positive_int, default=None, metavar="B", help="global batch (samples per step)")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree")
    p.add_argument("--pp", type=positive_int, default=None, help="pipeline-parallel degree")
    p.add_argument("--dp", type=positive_int, default=None, help="data-parallel degree")
    p.add_argument("--cp", type=positive_int, default=None,
                   help="context-parallel degree: each sample's sequence split over cp ranks (default 1)")
    p.add_argument("--ep", type=positive_int, default=None,
                   help="expert-parallel degree: routed experts split over ep of the data-parallel ranks (default 1)")
    p.add_argument("--mbs", type=positive_int, default=None, help="micro-batch size")
    p.add_argument("--schedule", type=schedule_arg, default=None,
                   metavar="SCHEDULE", help=f"pipeline schedule: {SCHEDULE_CHOICES} (default 1f1b)")
    p.add_argument("--recompute", choices=[r.value for r in Recompute], default=None,
                   help="activation recomputation of every stage (default none)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default 0)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs tp > 1)")
    p.add_argument("--no-dp-overlap", action="store_true",
                   help="data-parallel communication does not overlap compute (another trainer's behaviour)")
    p.add_argument("--keep-gathered", action="store_true",
                   help="ZeRO-3 keeps gathered weights from forward to backward (no reshard after forward)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="tensor-parallel collectives overlap the GEMMs (Megatron-Core --tp-comm-overlap)")
    p.add_argument("--tp-grad-overlap", action="store_true",
                   help="the input-gradient all-reduce of each column-parallel linear runs during its "
                        "weight-gradient GEMM (Megatron-LM's asynchronous tensor-parallel all-reduce, its default), "
                        "and its sequence-parallel input is kept as the shard and gathered again in backward")
    p.add_argument("--p2p-scatter-gather", action="store_true",
                   help="pipeline sends carry 1/tp of a replicated activation, all-gathered by the receiver "
                        "(Megatron-LM before Megatron-Core, DeepSpeed's pipeline engine)")
    p.add_argument("--p2p-blocking", action="store_true",
                   help="each pipeline send and receive blocks both ends (DeepSpeed's pipeline engine)")
    p.add_argument("--p2p-overlap", action="store_true",
                   help="the interleaved schedule's pipeline sends overlap other chunks' compute and wait only in "
                        "the fill and drain (Megatron-Core's overlap_p2p_comm, Megatron-LM's default)")
    p.add_argument("--p2p-transient-buffers", action="store_true",
                   help="pipeline receive buffers live only for their transfer and sent activations are freed "
                        "(Megatron-LM, DeepSpeed's pipeline engine); default: torch.distributed.pipelining's, one "
                        "per micro-batch of the step, kept")
    p.add_argument("--pp-returns-outputs", action="store_true",
                   help="the pipeline schedule returns the last stage's outputs, which keeps every micro-batch's "
                        "logits to the end of the step (torchtitan's trainer); default: not returned")
    p.add_argument("--tp-sharded-weights", action="store_true",
                   help="every linear layer's and the token embedding's weight split over tp (column / row / "
                        "vocab parallel), as the tensor-parallel plans of Megatron-LM and torchtitan run them")
    p.add_argument("--fp32-grad-pass", action="store_true",
                   help="each micro-batch's 16-bit gradients are upcast and added into fp32 buffers in a pass of "
                        "their own (DeepSpeed's BF16_Optimizer: bf16 with ZeRO 0-1, its pipeline engine)")
    p.add_argument("--grads-in-training-dtype", action="store_true",
                   help="gradient buffers kept and reduced in the 16-bit training dtype instead of fp32 "
                        "(Megatron-LM --grad-reduce-in-bf16, NeMo grad_sync_dtype: bf16)")
    p.add_argument("--cross-entropy", choices=[c.value for c in CrossEntropy], default=None,
                   help="the loss kernel: torch (PyTorch's cross_entropy, the default), inplace (Megatron-LM's "
                        "vocab-parallel cross-entropy), fused (flash-attn's, llm-foundry's default) or loss-parallel "
                        "(PyTorch's under loss_parallel(), torchtitan's with tp > 1)")
    p.add_argument("--metric-passes", type=int, default=None, metavar="N",
                   help="forward passes of PyTorch's cross-entropy over the logits per micro-batch for training "
                        "metrics (MosaicML Composer with llm-foundry's MPT: 2); default 0")
    p.add_argument("--fused-kernels", action="store_true",
                   help="the memory-bound ops run as fused kernels (torch.compile, Megatron-Core with Transformer "
                        "Engine) instead of one eager kernel each")
    p.add_argument("--offload", choices=[o.value for o in Offload], default=None,
                   help="model state in host memory: optimizer (ZeRO-Offload) or params (FSDP2 CPUOffloadPolicy, "
                        "needs --zero 3); default none")
    add_output_arguments(p)
    add_trace_cache_arguments(p)
    p.set_defaults(func=run)


STRATEGY_FLAGS = ("batch", "tp", "pp", "dp", "cp", "ep", "mbs", "schedule", "recompute", "zero", "sp", "no_dp_overlap",
                  "keep_gathered", "tp_overlap", "tp_grad_overlap", "p2p_scatter_gather", "p2p_blocking", "p2p_overlap",
                  "p2p_transient_buffers", "pp_returns_outputs", "fused_kernels", "fp32_grad_pass",
                  "tp_sharded_weights", "grads_in_training_dtype", "cross_entropy", "metric_passes", "offload")


def run(args: argparse.Namespace) -> int:
    inputs = input_paths(args.cluster)
    outputs = {"-o": check_output_path(args.output, inputs)} if args.output else {}
    given = [f"--{f.replace('_', '-')}" for f in STRATEGY_FLAGS if getattr(args, f) not in (None, False)]
    if args.from_ is not None and given:
        raise UserError(f"--from sets the strategy; drop {', '.join(given)}")
    if args.from_ is None:
        missing = [f"--{f}" for f in ("batch", "tp", "pp", "dp", "mbs") if getattr(args, f) is None]
        if missing:
            raise UserError(f"the following arguments are required: {', '.join(missing)} (or --from TRAINER:FILE)")
    cluster = parse_cluster(args.cluster)
    profile = load_profile(args.profile) if args.profile else None
    if args.from_ is not None:
        plan = _estimate_imported(args, cluster, profile)
    else:
        plan = _estimate_flags(args, cluster, profile)
    emit([plan], cluster, args.json, outputs)
    return 0


def _estimate_flags(args: argparse.Namespace, cluster: Any, profile: Any) -> Any:
    per_step = args.dp * args.mbs
    if args.batch % per_step:
        raise UserError(f"--batch {args.batch} is not a multiple of dp*mbs = {args.dp}*{args.mbs} = {per_step}")
    schedule, v = args.schedule or (Schedule.ONE_F_ONE_B, 1)
    try:
        strategy = Strategy(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp or 1, ep=args.ep or 1,
                            microbatch_size=args.mbs,
                            num_microbatches=args.batch // per_step, schedule=schedule, virtual_stages=v,
                            zero_stage=args.zero or 0, sequence_parallel=args.sp,
                            recompute=Recompute(args.recompute or Recompute.NONE.value),
                            runtime=RuntimeOptions(dp_overlap=not args.no_dp_overlap,
                                                   reshard_after_forward=not args.keep_gathered,
                                                   tp_overlap=args.tp_overlap,
                                                   tp_grad_overlap=args.tp_grad_overlap,
                                                   p2p_scatter_gather=args.p2p_scatter_gather,
                                                   p2p_blocking=args.p2p_blocking,
                                                   p2p_overlap=args.p2p_overlap,
                                                   p2p_transient_buffers=args.p2p_transient_buffers,
                                                   pp_returns_outputs=args.pp_returns_outputs,
                                                   fused_kernels=args.fused_kernels,
                                                   fp32_grad_pass=args.fp32_grad_pass,
                                                   tp_sharded_weights=args.tp_sharded_weights,
                                                   grads_in_training_dtype=args.grads_in_training_dtype,
                                                   cross_entropy=CrossEntropy(args.cross_entropy or "torch"),
                                                   metric_passes=args.metric_passes or 0,
                                                   offload=Offload(args.offload or Offload.NONE.value),
                                                   fp8=args.fp8))
    except ValueError as e:
        raise UserError(f"invalid strategy: {e}") from None
    dtype = args.dtype or "bfloat16"
    traced = trace_model(args.model, args.sets, seq=args.seq, dtype=dtype, cache=trace_cache(args))
    return estimate_plan(traced.chain, cluster, strategy, profile=profile, global_batch=args.batch, dtype=dtype,
                         model_name=traced.name, settings=traced.settings)


def _estimate_imported(args: argparse.Namespace, cluster: Any, profile: Any) -> Any:
    """The plan of a trainer's configuration file (`--from`): the same `estimate_plan` the flags go through."""
    from planner.trainers.convert import imported_strategy, read_trainer_config
    from planner.trainers.layout import BlockLayout

    cfg = read_trainer_config(args.from_)
    dtype = args.dtype or cfg.dtype or "bfloat16"
    traced = _trace_with_seq(args, args.seq or cfg.seq_len, dtype)
    imported = imported_strategy(args.from_, cfg, BlockLayout.of(traced.chain), cluster.num_available)
    for note in cfg.notes:
        print(f"stratagem: warning: {note}", file=sys.stderr)
    strategy = imported.strategy
    if args.fp8:  # on top of the file's configuration, as for --dtype
        strategy = dataclasses.replace(strategy, runtime=dataclasses.replace(strategy.runtime, fp8=args.fp8))
    return estimate_plan(traced.chain, cluster, strategy, profile=profile,
                         global_batch=imported.global_batch, dtype=dtype, model_name=traced.name,
                         settings=traced.settings)


def _trace_with_seq(args: argparse.Namespace, seq: int | None, dtype: str) -> Any:
    """The model traced at the trainer file's sequence length; a model without one ignores it."""
    from models.registry import ModelError

    cache = trace_cache(args)
    try:
        return trace_model(args.model, args.sets, seq=seq, dtype=dtype, cache=cache)
    except ModelError as e:
        if args.seq is None and seq is not None and "--seq does not apply" in str(e):
            return trace_model(args.model, args.sets, seq=None, dtype=dtype, cache=cache)
        raise
