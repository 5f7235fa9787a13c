"""`stratagem run MODEL --plan PLAN.json --steps N [--set ...] [--nproc K] [--check] [--json]`: execute a plan.

Trains N steps of the plan on synthetic data (the model's example batch at the plan's global batch size, fixed
seed, the same batch every step) with `planner.runtime.parallelize` + `planner.runtime.train_step`: gloo on CPU, NCCL when
CUDA is available. Prints the loss of each step, the measured step time and peak memory beside the plan's
predictions. `--check` also trains the unsharded model on one process with the same seed, data and
optimizer and fails (exit 1) when the largest relative loss difference exceeds `--tolerance`.

Run it under torchrun (`torchrun --nproc-per-node K -m planner.cli.main run ...`) or give `--nproc K` and
it launches torchrun itself. The model must be built with the same `--set` options as the plan (the plan's
parameter count and fingerprint are checked). Training runs in float32 unless `--dtype` says otherwise,
whatever dtype the plan was priced for: the point is to check and time the layout, not to reproduce the
planned numerics.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from planner.cli.common import add_model_arguments, positive_float, positive_int
from planner.errors import PlanLoadError, UserError
from planner.plan import Plan
from planner.runtime.worker_exit import exit_without_teardown, quiesce

if TYPE_CHECKING:  # the runtime imports torch.distributed: loaded by the functions that run, not by `stratagem`
    from planner.runtime.measure import MeasuredRun

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
OPTIMIZERS: tuple[str, ...] = ("adamw", "sgd")
DEFAULT_TOLERANCE = 1e-4
"""Largest relative loss difference `--check` accepts by default: float32 sharded vs unsharded runs differ
only by reduction order (about 1e-7 relative on the zoo's tiny presets)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="train N steps of a plan with torch.distributed and time it",
                              description=__doc__.split("\n\n")[1])
    add_model_arguments(p)
    p.add_argument("--plan", required=True, metavar="PLAN.json", help="plan written by `stratagem plan -o`")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    p.add_argument("--nproc", type=positive_int, default=None, metavar="K",
                   help="launch torchrun with K processes (must equal the plan's device count)")
    p.add_argument("--check", action="store_true",
                   help="also train the unsharded model and fail if the losses differ by more than --tolerance")
    p.add_argument("--tolerance", type=positive_float, default=DEFAULT_TOLERANCE,
                   help=f"largest relative loss difference --check accepts (default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights and data (default 0)")
    # Where the ranks that `--nproc` launches leave the check's verdict: they exit 0 on a failed check, so that
    # torchrun does not bury the report under its own tracebacks, and the launcher exits 1.
    p.add_argument("--verdict-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lr", type=positive_float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="optimizer (default adamw)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="training dtype (default float32)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.set_defaults(func=run)


def _under_torchrun() -> bool:
    # torchrun tells its workers who they are through these variables (its launch contract, not a switch)
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def _child_argv(args: argparse.Namespace) -> list[str]:
    argv = [args.model, "--plan", args.plan, "--steps", str(args.steps), "--seed", str(args.seed),
            "--lr", repr(args.lr), "--optimizer", args.optimizer, "--dtype", args.dtype,
            "--tolerance", repr(args.tolerance)]
    for s in args.sets:
        argv += ["--set", s]
    if args.seq is not None:
        argv += ["--seq", str(args.seq)]
    if args.check:
        argv.append("--check")
    if args.json:
        argv.append("--json")
    return argv


def run(args: argparse.Namespace) -> int:

    plan = Plan.load(args.plan)
    world = plan.strategy.num_devices
    from planner.runtime.parallelize import runtime_unsupported

    why = runtime_unsupported(plan.strategy)  # once, before any rank starts
    if why:
        raise UserError(f"stratagem run: {why}")
    if plan.strategy.runtime.fp8 is not None:  # once, before any rank starts
        _check_fp8_here()
    if args.nproc is not None and args.nproc != world:
        from planner.strategy_label import Detail, strategy_label

        raise UserError(f"--nproc {args.nproc} but the plan needs {world} processes "
                        f"({strategy_label(plan.strategy, Detail.DEGREES)})")
    if _under_torchrun():  # the report is out: the rank leaves without the interpreter's teardown
        exit_without_teardown(_run_rank(args, plan))
    if args.nproc is not None and args.nproc > 1:
        _preflight(args, plan)  # a plan for another model fails here, once, not on every rank
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               "-m", "planner.cli.main", "run", *_child_argv(args)]
        # one intra-op thread per process unless the user chose otherwise (torchrun's own default, without
        # its banner about it)
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        with tempfile.TemporaryDirectory(prefix="stratagem-run-") as tmp:
            verdict = Path(tmp) / "verdict"
            code = subprocess.run([*cmd, "--verdict-file", str(verdict)], check=False, env=env).returncode
            failed = verdict.is_file() and verdict.read_text().strip() == "failed"
        return 1 if code == 0 and failed else code
    if world > 1:
        raise UserError(f"the plan needs {world} processes; pass --nproc {world} or launch under torchrun")
    return _run_rank(args, plan)


def _check_fp8_here() -> None:
    import torch

    from planner.runtime.apply_fp8 import fp8_runtime_problem

    cuda = torch.cuda.is_available()
    if why := fp8_runtime_problem("cuda" if cuda else "cpu", torch.cuda.get_device_capability() if cuda else None):
        raise UserError(why)


def _preflight(args: argparse.Namespace, plan: Any) -> None:
    """Check on the meta device (no weights) that the plan was made for this model."""
    from planner.cli.common import build_model, trace_chain
    from planner.runtime.parallelize import check_plan_matches

    probe = build_model(args.model, args.sets, seq=args.seq if args.seq is not None else plan.training.seq_len)
    _explain_mismatch(plan, lambda: check_plan_matches(probe.module, plan, chain=trace_chain(probe, dtype=plan.training.dtype)))


def _explain_mismatch(plan: Any, check: Any) -> Any:
    try:
        return check()
    except PlanLoadError as e:
        made_for = " ".join([plan.model.name, *(f"--set {k}={v}" for k, v in plan.model.settings)])
        raise PlanLoadError(f"{e} (the plan was made for {made_for})") from None


def _run_rank(args: argparse.Namespace, plan: Any) -> int:
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if _under_torchrun():
            dist.init_process_group("nccl" if use_cuda else "gloo")
        else:  # a one-device plan run directly: a single-rank group needs no launcher
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        with warnings.catch_warnings():
            # FSDP2 warns that a wrapped module returns a view (every nn.Linear on a 3-D input does); the train
            # step never modifies outputs in place, so the warning is noise here
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            code = _train_and_report(args, plan, device)
        quiesce()
        return code
    finally:
        dist.destroy_process_group()


def _build(args: argparse.Namespace, plan: Any, device: Any) -> Any:
    import torch

    from models.registry import build_model as registry_build
    from planner.cli.common import build_model

    torch.manual_seed(args.seed)  # every rank (and the --check reference) starts from the same weights
    seq = args.seq if args.seq is not None else plan.training.seq_len
    try:
        built = registry_build(args.model, args.sets, batch=plan.training.global_batch, seq=seq,
                               device=str(device))
    except ValueError as e:
        raise UserError(f"model {args.model}: {e}") from None
    if args.dtype != "float32":
        built.module.to(getattr(torch, args.dtype))
    probe = build_model(args.model, args.sets, seq=seq)  # meta, batch 1: traced as `stratagem plan` traces
    return built, probe


def _optimizer(args: argparse.Namespace, params: Any) -> Any:
    import torch

    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr)
    return torch.optim.AdamW(params, lr=args.lr)


def _train_and_report(args: argparse.Namespace, plan: Any, device: Any) -> int:
    import torch.distributed as dist

    from planner.cli.common import trace_chain
    from planner.runtime.measure import max_relative_difference, peak_memory_per_stage, token_drop_note

    rank = dist.get_rank()
    reference = _reference(args, plan, device) if args.check and rank == 0 else None
    built, probe = _build(args, plan, device)
    chain = trace_chain(probe, dtype=plan.training.dtype)
    pm = _explain_mismatch(plan, lambda: _parallelize(built, plan, chain))
    measured = _train(args, pm, built, device)
    peaks = peak_memory_per_stage(pm, device)
    diff = None
    if args.check:
        payload = [reference]
        dist.broadcast_object_list(payload, src=0)
        reference = payload[0]
        diff = max_relative_difference(measured.losses, reference.losses)
    passed = diff is None or diff <= args.tolerance
    if rank == 0:
        kind = "cuda_max_allocated" if device.type == "cuda" else "cpu_max_rss"
        report = _report(args, plan, measured, reference, diff, peaks, kind)
        if not passed:
            report["check"]["note"] = token_drop_note(chain)
        print(json.dumps(report, indent=2, sort_keys=True) if args.json else _text(report))
        if args.verdict_file:
            Path(args.verdict_file).write_text("passed" if passed else "failed")
    return 0 if passed or args.verdict_file else 1


def _parallelize(built: Any, plan: Any, chain: Any) -> Any:
    from planner.runtime.parallelize import parallelize

    return parallelize(built.module, plan, chain=chain, loss_fn=built.loss)


def _train(args: argparse.Namespace, pm: Any, built: Any, device: Any) -> MeasuredRun:
    from planner.runtime.measure import time_training
    from planner.runtime.train_step import local_batch

    optimizer = _optimizer(args, list(pm.parameters()))
    return time_training(pm, local_batch(pm, built.example_inputs), optimizer, args.steps, device)


def _reference(args: argparse.Namespace, plan: Any, device: Any) -> MeasuredRun:
    """The unsharded model trained on the whole global batch in this one process."""
    from planner.runtime.measure import train_unsharded

    built, _ = _build(args, plan, device)
    optimizer = _optimizer(args, built.module.parameters())
    return train_unsharded(built.module, built.loss, built.example_inputs, optimizer, args.steps)


def _report(args: argparse.Namespace, plan: Any, measured: MeasuredRun, reference: MeasuredRun | None,
            diff: float | None, peaks: Sequence[int], memory_kind: str) -> dict[str, Any]:
    """The run's report; `diff`: the largest relative loss difference from `reference` (None without a check)."""
    steps = [{"step": i + 1, "loss": loss, "time_s": t}
             for i, (loss, t) in enumerate(zip(measured.losses, measured.step_times, strict=True))]
    if reference is not None:
        for row, ref in zip(steps, reference.losses, strict=True):
            row["reference_loss"] = ref
    # the first step includes one-off costs (pipeline shape inference, allocator warm-up)
    steady = measured.step_times[1:] or measured.step_times
    check = None
    if diff is not None:
        check = {"max_rel_loss_diff": diff, "tolerance": args.tolerance, "passed": diff <= args.tolerance}
    s = plan.strategy
    return {
        "model": plan.model.name,
        "world_size": s.num_devices,
        "strategy": {"dp": s.dp, "tp": s.tp, "pp": s.pp, "cp": s.cp, "ep": s.ep,
                     "microbatch_size": s.microbatch_size, "num_microbatches": s.num_microbatches,
                     "schedule": s.schedule.value, "zero_stage": s.zero_stage},
        "dtype": args.dtype,
        "steps": steps,
        "predicted": {"step_time_s": plan.predicted.step_time_s,
                      "peak_memory_bytes": list(plan.predicted.peak_memory_bytes), "dtype": plan.training.dtype},
        "measured": {"step_time_s": statistics.median(steady), "peak_memory_bytes": list(peaks),
                     "memory_kind": memory_kind},
        "check": check,
    }


def _text(report: dict[str, Any]) -> str:
    s = report["strategy"]
    extra = "".join(f" {k}={s[k]}" for k in ("cp", "ep") if s[k] > 1)
    lines = [f"{report['model']}: dp={s['dp']} tp={s['tp']} pp={s['pp']}{extra} micro-batch {s['microbatch_size']} x "
             f"{s['num_microbatches']} ({s['schedule']}, ZeRO-{s['zero_stage']}) on {report['world_size']} "
             f"processes, {report['dtype']}"]
    has_ref = report["check"] is not None
    lines.append(f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'time_s':>9}" if has_ref
                 else f"{'step':>4}  {'loss':>12}  {'time_s':>9}")
    for row in report["steps"]:
        ref = f"  {row['reference_loss']:>12.6f}" if has_ref else ""
        lines.append(f"{row['step']:>4}  {row['loss']:>12.6f}{ref}  {row['time_s']:>9.4f}")
    pred, meas = report["predicted"], report["measured"]
    lines.append(f"step time: predicted {pred['step_time_s']:.4g} s ({pred['dtype']}), "
                 f"measured {meas['step_time_s']:.4g} s (median after the first step)")
    lines.append(f"peak memory per stage: predicted {_gib(pred['peak_memory_bytes'])}, "
                 f"measured {_gib(meas['peak_memory_bytes'])} ({meas['memory_kind']})")
    if has_ref:
        c = report["check"]
        verdict = "OK" if c["passed"] else "FAILED"
        lines.append(f"check: largest relative loss difference {c['max_rel_loss_diff']:.3g} "
                     f"(tolerance {c['tolerance']:g}): {verdict}")
        if c.get("note"):
            lines.append(f"note: {c['note']}")
    return "\n".join(lines)


def _gib(values: Sequence[int]) -> str:
    return "[" + ", ".join(f"{v / 2**30:.3f} GiB" for v in values) + "]"
