"""What to profile -- models by registry name (built in each worker) or the standard GEMM / elementwise set -- in
this process or in several at once (the median over processes per key)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from costmodel.profile_db import OpProfile, OpTiming
from planner.profiling.ops import profile_module
from planner.profiling.options import ProfileOptions, ProfileRun, SkippedOp
from planner.profiling.timing import backward_pass_overhead, compute_clock, intra_op_threads


class StandardOps(nn.Module):
    """GEMMs and elementwise / normalization ops of a transformer MLP at one width: what `stratagem profile`
    measures when no model is given (a width sweep shows the device's GEMM efficiency curve)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return x + self.down(self.act(self.up(self.norm(x))))


STANDARD_WIDTHS: tuple[int, ...] = (128, 256, 512, 1024)
STANDARD_TOKENS = 256


def standard_modules(device: torch.device) -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for h in STANDARD_WIDTHS:
        torch.manual_seed(h)
        module = StandardOps(h).to(device)
        x = torch.randn(1, STANDARD_TOKENS, h, generator=gen).to(device)
        out.append((f"standard-mlp-{h}", module, (x,)))
    return out


@dataclass(frozen=True)
class ModelRequest:
    """A model to build in a worker process: a zoo / registry name with overrides, or the standard set."""

    name: str
    sets: tuple[str, ...] = ()
    seq: int | None = None


def build_request(request: ModelRequest, batch: int, device: torch.device
                  ) -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]]:
    if request.name == STANDARD_SET:
        return standard_modules(device)
    from models.registry import build_model

    torch.manual_seed(0)
    built = build_model(request.name, request.sets, batch=batch, seq=request.seq, device=str(device))
    return [(request.name, built.module, tuple(built.example_inputs))]


STANDARD_SET = "standard"
"""`ModelRequest.name` of the standard GEMM / elementwise set."""


def profile_requests(requests: Sequence[ModelRequest], *, device: torch.device, device_name: str,
                     options: ProfileOptions) -> ProfileRun:
    """Profile every requested model in this process and merge the results."""
    started = time.perf_counter()
    profile = OpProfile()
    skipped: list[SkippedOp] = []
    measured = 0
    names: list[str] = []
    with intra_op_threads(options.threads):
        overhead = backward_pass_overhead(device, clock=compute_clock(device, options))
    for req in requests:
        for name, module, inputs in build_request(req, options.traced_batch, device):
            run = profile_module(module, inputs, name=name, device_name=device_name, options=options,
                                 overhead_s=overhead)
            profile = profile.merged(OpProfile(entries={k: v for k, v in run.profile.entries.items()
                                                        if k not in profile.entries}))
            skipped += run.skipped
            measured += run.measured_ops
            names.append(name)
    meta = {**run_meta(device, options), "models": ",".join(names), "backward_pass_overhead_s": f"{overhead:.6g}"}
    return ProfileRun(profile=OpProfile(entries=profile.entries, meta=meta), skipped=tuple(skipped),
                      measured_ops=measured, seconds=time.perf_counter() - started, models=tuple(names))


def run_meta(device: torch.device, options: ProfileOptions) -> dict[str, str]:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "device": str(device), "threads": str(options.threads or torch.get_num_threads()),
            "traced_batch": str(options.traced_batch),
            "microbatch_sizes": ",".join(map(str, options.microbatch_sizes)),
            "tp_degrees": ",".join(map(str, options.tp_degrees)), "dtype": options.dtype or "as built",
            "warmup": str(options.warmup), "repeats": str(options.repeats),
            "statistic": options.statistic.value, "min_window_s": f"{options.min_window_s:g}"}


def _profile_worker(rank: int, requests: Sequence[ModelRequest], device_name: str, options: ProfileOptions,
                    out_dir: str) -> None:
    run = profile_requests(requests, device=torch.device("cpu"), device_name=device_name, options=options)
    run.profile.save(os.path.join(out_dir, f"rank{rank}.json"))
    Path(out_dir, f"rank{rank}.skipped.json").write_text(json.dumps(
        [[s.node, s.signature, s.reason] for s in run.skipped]))


def profile_concurrently(requests: Sequence[ModelRequest], *, concurrent: int, device_name: str,
                         options: ProfileOptions) -> ProfileRun:
    """Run `profile_requests` in `concurrent` CPU processes at once; each key's time is the median over them."""
    import torch.multiprocessing as mp

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_profile_worker, args=(tuple(requests), device_name, options, tmp), nprocs=concurrent, join=True)
        runs = [OpProfile.load(os.path.join(tmp, f"rank{r}.json")) for r in range(concurrent)]
        skipped_rows = json.loads(Path(tmp, "rank0.skipped.json").read_text())
    keys = sorted(set.intersection(*(set(p.entries) for p in runs)))
    entries = {}
    for k in keys:
        ts = [p.entries[k] for p in runs]
        entries[k] = OpTiming(statistics.median(t.forward_s for t in ts), statistics.median(t.backward_s for t in ts),
                              samples=sum(t.samples for t in ts))
    meta = {**runs[0].meta, "concurrent_processes": str(concurrent)}
    return ProfileRun(profile=OpProfile(entries=entries, meta=meta),
                      skipped=tuple(SkippedOp(*row) for row in skipped_rows), measured_ops=len(entries),
                      seconds=time.perf_counter() - started,
                      models=tuple(filter(None, runs[0].meta.get("models", "").split(","))))
