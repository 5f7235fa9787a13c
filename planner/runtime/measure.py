"""Measuring a training run: step losses and times (the slowest rank's), peak memory per pipeline stage, the
unsharded reference a sharded run is checked against (`stratagem run`), and how the two compare."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ir.layer_chain import LayerChain
from ir.moe_structure import routed_experts
from planner.runtime.parallelize import LossFn, ParallelModel
from planner.runtime.train_step import train_step


@dataclass(frozen=True)
class MeasuredRun:
    losses: list[float]
    step_times: list[float]


def time_training(pm: ParallelModel, batch: Sequence[torch.Tensor], optimizer: Any, steps: int,
                  device: torch.device) -> MeasuredRun:
    """Train `steps` steps on this rank's `batch`; each step's time is the slowest rank's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        losses.append(train_step(pm, batch, optimizer))  # returns after a collective: all ranks are done
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return MeasuredRun(losses=losses, step_times=max_over_ranks(times))


def train_unsharded(module: nn.Module, loss_fn: LossFn, inputs: Sequence[torch.Tensor], optimizer: Any,
                    steps: int) -> MeasuredRun:
    """The whole model trained on the whole batch in this process (the reference of a sharded run)."""
    losses, times = [], []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(module(*inputs), tuple(inputs))
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach().float().item()))
        times.append(time.perf_counter() - start)
    return MeasuredRun(losses=losses, step_times=times)


def max_over_ranks(values: Iterable[float]) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.cpu()]


def peak_memory_per_stage(pm: Any, device: Any) -> list[int]:
    """Peak bytes per pipeline rank (max over its dp/tp ranks): CUDA allocator peak, or on CPU the process's
    peak resident set size (an upper bound: it includes the Python runtime and torch itself)."""
    import resource

    import torch.distributed as dist

    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
    pp_rank = pm.mesh["pp"].get_local_rank()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pp_rank, peak))
    per_stage = [0] * pm.strategy.pp
    for stage, value in gathered:
        per_stage[stage] = max(per_stage[stage], value)
    return per_stage


def max_relative_difference(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest |loss - reference| / |reference| over the steps (what `stratagem run --check` compares)."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference, strict=True))


def token_drop_note(chain: LayerChain) -> str | None:
    """Why a sharded run of a capacity-limited mixture of experts may not match one process: which token choices
    an expert drops depends on the routing group they share, and a rank may cut its tokens into other groups than
    the single process does (`models.hf_tracing` groups a micro-batch's tokens together). None when the experts
    drop nothing (capacity factor >= E / k) or there are none."""
    found = routed_experts(chain.graph.nodes)
    if found is None:
        return None
    dropless = found.num_experts / found.top_k
    if found.capacity_factor >= dropless * (1 - 1e-9):
        return None
    return (f"the experts drop token choices past their capacity (capacity factor {found.capacity_factor:.3g} < "
            f"experts / top-k = {dropless:g}), and which ones depends on the routing groups, which a rank may cut "
            f"otherwise than one process: plan and run "
            f"with --set capacity_factor={dropless:g} to compare without drops")
