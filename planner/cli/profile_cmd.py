"""`stratagem profile [--model MODEL ...] [--device cpu|cuda] [--batch B] [--tp T,...] [--collectives] [--framework]
[-o FILE]`.

Times the operators of the traced model(s) on this machine -- or, with no --model, a standard set of GEMM,
normalization and elementwise shapes -- forward and backward, median over repeats, at every micro-batch size up
to --batch and, with --tp, the per-device shards the tensor-parallel pricer looks up; with --collectives also
the collectives of a local process group of 2..--nproc processes at several sizes, fitted to alpha (latency) and
beta (bandwidth); with --framework also the runtime's host overheads (`costmodel.framework`: AdamW per plain and
per DTensor parameter, per FSDP2 / replicate unit, per tensor-parallel module call, per pipeline stage action,
per recomputed layer) in a gloo group of
--framework-processes CPU processes. Writes the profile JSON (`costmodel.profile_db`) that `--profile FILE` makes the cost model use.

Profile keys carry the traced shapes and dtypes: profile with the --set, --seq and --dtype you plan with.
`--concurrent K` times the ops in K processes at once, as a K-process CPU cluster runs them (1x4xcpu: 4), and
with --collectives measures every group size dividing K with all such groups of the K processes running at once
(instead of groups of 2..--nproc processes alone); --framework measures in K processes too, unless
--framework-processes says otherwise.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from planner.cli.common import check_output_path, positive_float, positive_int, write_text
from planner.errors import UserError

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
MAX_SHOWN_SKIPS = 8
MEAN_WINDOW_S = 0.02
"""Timing window per op for the mean: several Linux CFS time slices (a few ms each), so core sharing is sampled."""


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure operators and collectives on this machine",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--model", dest="models", action="append", default=[], metavar="MODEL",
                   help="zoo model or package.module:factory to profile (repeatable; default: the standard set)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field (repeatable; applies to every --model)")
    p.add_argument("--seq", type=positive_int, default=None, help="sequence length (default: the model's)")
    p.add_argument("--batch", type=positive_int, default=1,
                   help="largest micro-batch to measure: 1, 2, 4, ... and B itself (default 1)")
    p.add_argument("--tp", type=_int_list, default=(1,), metavar="T[,T...]",
                   help="tensor-parallel degrees whose per-device op shards are measured too (default 1)")
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where to run the ops (default cpu)")
    p.add_argument("--catalog-device", default=None, metavar="NAME",
                   help="catalog device the entries are for (default: cpu, or the GPU's catalog name)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="training dtype, as on `stratagem plan`: the model is traced and run in it (default "
                        "bfloat16)")
    p.add_argument("--repeats", type=positive_int, default=11, help="timed runs per op, median kept (default 11)")
    p.add_argument("--warmup", type=positive_int, default=3, help="untimed runs per op first (default 3)")
    p.add_argument("--memory-budget", type=positive_float, default=2.0, metavar="GIB",
                   help="skip ops whose working set exceeds this many GiB (default 2)")
    p.add_argument("--concurrent", type=positive_int, default=1, metavar="K",
                   help="time the ops in K CPU processes at once (default 1)")
    p.add_argument("--statistic", choices=("median", "mean"), default="median",
                   help="per-op value: median of the runs (default: a rank's speed with a core to itself), or "
                        f"their mean over a window of at least {MEAN_WINDOW_S * 1e3:g} ms (also counts time lost to "
                        "other processes sharing the cores, this profile's and anyone else's)")
    p.add_argument("--collectives", action="store_true", help="also measure and fit the local collectives")
    p.add_argument("--nproc", type=positive_int, default=2, metavar="K",
                   help="largest process group for --collectives: groups of 2..K (default 2)")
    p.add_argument("--framework", action="store_true",
                   help="also measure the runtime's framework overheads (optimizer per tensor, FSDP2 / replicate per "
                        "unit, tensor-parallel per module, pipeline per stage action, recomputation per layer) on "
                        "CPU ranks over gloo")
    p.add_argument("--framework-processes", type=positive_int, default=None, metavar="N",
                   help="processes for --framework; every group size >= 2 dividing N is measured, all groups at once "
                        "(default: --concurrent K when K > 1, else 2)")
    p.add_argument("-o", "--output", default="profile.json", metavar="FILE",
                   help="profile JSON to write (default profile.json)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    p.set_defaults(func=run)


def microbatch_sizes(batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `batch`, and `batch` itself."""
    sizes, m = [], 1
    while m < batch:
        sizes.append(m)
        m *= 2
    return (*sizes, batch)


def _catalog_device(args: argparse.Namespace) -> str:
    from costmodel.hardware.catalog import get_device

    name = args.catalog_device
    if name is None and args.device == "cuda":
        import torch

        from planner.profiling.machine import catalog_name_of_gpu

        gpu = torch.cuda.get_device_name(0)
        name = catalog_name_of_gpu(gpu)
        if name is None:
            raise UserError(f"cannot tell the catalog name of GPU {gpu.lower()!r}; pass --catalog-device NAME")
    try:
        return get_device(name or "cpu").name
    except ValueError as e:
        raise UserError(f"--catalog-device: {e}") from None


def _check(args: argparse.Namespace) -> None:
    import torch

    if args.framework and args.device != "cpu":
        raise UserError("--framework measures CPU ranks over gloo; use --device cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here; use --device cpu")
    if args.concurrent > 1 and args.device != "cpu":
        raise UserError("--concurrent applies to --device cpu only (one process per GPU is the norm)")
    if args.collectives and args.device == "cuda" and args.nproc > torch.cuda.device_count():
        raise UserError(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPUs here")
    if args.sets and not args.models:
        raise UserError("--set needs --model (the standard set has no config)")
    if args.framework_processes is not None and not args.framework:
        raise UserError("--framework-processes needs --framework")
    if args.framework and framework_processes(args) < 2:
        raise UserError(f"--framework-processes {args.framework_processes}: framework overheads are measured in "
                        "process groups, so at least 2 processes are needed")


def framework_processes(args: argparse.Namespace) -> int:
    """--framework-processes, else the CPU cluster's process count (--concurrent), else 2."""
    if args.framework_processes is not None:
        return int(args.framework_processes)
    return args.concurrent if args.concurrent > 1 else 2


def run(args: argparse.Namespace) -> int:
    import torch

    from planner.profiling.collectives import CollectiveOptions
    from planner.profiling.framework import FrameworkOptions
    from planner.profiling.machine import profile_machine
    from planner.profiling.options import ProfileOptions, Statistic
    from planner.profiling.requests import STANDARD_SET, ModelRequest

    _check(args)
    out = check_output_path(args.output)
    device_name = _catalog_device(args)
    statistic = Statistic(args.statistic)
    options = ProfileOptions(microbatch_sizes=microbatch_sizes(args.batch), tp_degrees=(1, *args.tp),
                             warmup=args.warmup, repeats=args.repeats,
                             memory_budget_bytes=int(args.memory_budget * 1024 ** 3), dtype=args.dtype,
                             statistic=statistic, min_window_s=MEAN_WINDOW_S if statistic is Statistic.MEAN else 0.0)
    requests = [ModelRequest(m, tuple(args.sets), args.seq) for m in args.models] or [ModelRequest(STANDARD_SET)]
    collectives = None
    if args.collectives:
        collectives = CollectiveOptions(max_ranks=max(args.nproc, 2),
                                        processes=args.concurrent if args.concurrent > 1 else None,
                                        statistic=statistic, device_name=device_name, use_cuda=args.device == "cuda")
    framework_options = None
    if args.framework:
        try:
            framework_options = FrameworkOptions(processes=framework_processes(args), warmup=args.warmup,
                                                 repeats=args.repeats)
        except ValueError as e:
            raise UserError(f"--framework: {e}") from None
    try:
        measured = profile_machine(requests, device=torch.device("cuda:0" if args.device == "cuda" else "cpu"),
                                   device_name=device_name, options=options, concurrent=args.concurrent,
                                   collectives=collectives, framework=framework_options)
    except (ValueError, TypeError) as e:
        raise UserError(f"cannot profile: {' '.join(str(e).split())}") from None
    result, profile, framework = measured.ops, measured.profile, measured.framework
    write_text(out, json.dumps(profile.to_dict(), indent=1, sort_keys=True) + "\n")
    summary = _summary(result, profile, str(out), framework)
    print(json.dumps(summary, indent=2, sort_keys=True) if args.json else _text(summary))
    return 0


def _framework_summary(costs: Any) -> dict[str, Any] | None:
    """Framework costs as JSON (seconds; [forward, backward] per group size), None when not measured."""
    if costs is None:
        return None
    return {"optimizer_per_tensor_s": costs.optimizer_per_tensor_s,
            "optimizer_per_dtensor_s": costs.optimizer_per_dtensor_s,
            "dp_unit": {str(mode): {str(g): [c.forward_s, c.backward_s] for g, c in sorted(table.items())}
                        for mode, table in costs.dp_unit.items()},
            "tp_module": {str(g): [c.forward_s, c.backward_s] for g, c in sorted(costs.tp_module.items())},
            "grad_sync": {str(g): v for g, v in sorted(costs.grad_sync.items())},
            "pp_action": {str(g): [c.forward_s, c.backward_s] for g, c in sorted(costs.pp_action.items())},
            "pp_chunked_action": {str(g): [c.forward_s, c.backward_s]
                                  for g, c in sorted(costs.pp_chunked_action.items())},
            "split_backward_s": costs.split_backward.backward_s,
            "recompute": {mode: [c.forward_s, c.backward_s] for mode, c in costs.recompute.items()}}


def _summary(result: Any, profile: Any, path: str, framework: Any = None) -> dict[str, Any]:
    fits = profile.collectives.fits if profile.collectives is not None else ()
    return {
        "framework": _framework_summary(framework),
        "output": path,
        "models": list(result.models),
        "entries": len(profile.entries),
        "skipped": [{"node": s.node, "signature": s.signature, "reason": s.reason} for s in result.skipped],
        "collective_fits": [f.to_dict() for f in fits],
        "meta": dict(profile.meta),
    }


def _framework_text(framework: dict[str, Any] | None, processes: str) -> list[str]:
    if framework is None:
        return []
    lines = [f"framework overheads ({processes} processes), ms forward / backward per call:",
             f"  optimizer per tensor: plain {framework['optimizer_per_tensor_s'] * 1e3:.4f}, "
             f"DTensor {framework['optimizer_per_dtensor_s'] * 1e3:.4f}"]
    for mode, table in framework["dp_unit"].items():
        lines.append(f"  {mode + ' unit':<18}" + "  ".join(f"g={g}: {f * 1e3:.3f} / {b * 1e3:.3f}"
                                                         for g, (f, b) in table.items()))
    lines.append(f"  {'tp module':<18}" + "  ".join(f"g={g}: {f * 1e3:.3f} / {b * 1e3:.3f}"
                                                   for g, (f, b) in framework["tp_module"].items()))
    lines.append(f"  {'partial grad sync':<18}" + "  ".join(f"g={g}: {v * 1e3:.3f} per tensor"
                                                           for g, v in framework["grad_sync"].items()))
    for key, label in (("pp_action", "pipeline action"), ("pp_chunked_action", "chunked action")):
        lines.append(f"  {label:<18}" + "  ".join(f"p={g}: {f * 1e3:.3f} / {b * 1e3:.3f}"
                                                  for g, (f, b) in framework[key].items()))
    lines.append(f"  {'split backward':<18}{framework['split_backward_s'] * 1e3:.3f} per layer (backward)")
    lines.append(f"  {'recompute layer':<18}" + "  ".join(f"{mode}: {f * 1e3:.3f} / {b * 1e3:.3f}"
                                                         for mode, (f, b) in framework["recompute"].items()))
    return lines


def _text(summary: dict[str, Any]) -> str:
    lines = [f"profiled {', '.join(summary['models'])}: {summary['entries']} op entries "
             f"({summary['meta'].get('device', '?')}, dtype {summary['meta'].get('dtype', '?')}, "
             f"micro-batches {summary['meta'].get('microbatch_sizes', '?')}, tp {summary['meta'].get('tp_degrees')})"]
    skipped = summary["skipped"]
    if skipped:
        lines.append(f"skipped {len(skipped)} (the analytical model prices them):")
        lines += [f"  {s['node']}: {s['reason']}" for s in skipped[:MAX_SHOWN_SKIPS]]
        if len(skipped) > MAX_SHOWN_SKIPS:
            lines.append(f"  ... and {len(skipped) - MAX_SHOWN_SKIPS} more (see --json)")
    if summary["collective_fits"]:
        lines.append("collectives: t = steps x alpha + bytes on the wire / bandwidth")
        lines.append(f"  {'kind':<15} {'alpha (us)':>11} {'bandwidth (GB/s)':>17} {'rms resid':>10} {'samples':>8}")
        for f in summary["collective_fits"]:
            bw = f["bandwidth_bytes_per_s"]
            bw_text = f"{bw / 1e9:.3f}" if bw else "inf"
            lines.append(f"  {f['kind']:<15} {f['alpha_s'] * 1e6:>11.1f} {bw_text:>17} "
                         f"{f['rms_rel_residual']:>10.3f} {f['samples']:>8}")
    lines += _framework_text(summary["framework"], summary["meta"].get("framework_processes", "?"))
    lines.append(f"wrote {summary['output']}")
    return "\n".join(lines)
