"""The building blocks of the framework profile (`planner.profiling.framework`): the reference modules, passes
timed in lockstep with the variants of one measurement interleaved, and bare collectives at a wrapper's byte
counts."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class ReferenceBlock(nn.Module):
    """A transformer-like block without attention: the parameters and calls of one FSDP2 unit."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = ReferenceMLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return x + self.mlp(self.norm(x))


class ReferenceMLP(nn.Module):
    """Linear h->4h, GELU, Linear 4h->h: the colwise/rowwise pair of tensor parallelism."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return self.down(self.act(self.up(x)))


class ReferenceStack(nn.Module):
    """`units` blocks and a root LayerNorm: the root keeps parameters of its own, as a model's final norm does."""

    def __init__(self, hidden: int, units: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ReferenceBlock(hidden) for _ in range(units))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


# ---------------------------------------------------------------------------------------------------------------
# Timing in lockstep, the variants of one measurement interleaved
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pass:
    """One timed variant: `forward()`, then `backward(forward's result)` if any; `reset` runs untimed first."""

    forward: Callable[[], Any]
    backward: Callable[[Any], Any] | None = None
    reset: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class Timer:
    """Times variants on every rank at once, each pass started after a barrier over all ranks.

    The variants of one measurement (plain, wrapped, bare collectives) run one after the other within every
    repeat, so a slow spell of the machine (other processes on the shared cores) hits all of them alike and
    cancels in their per-repeat difference; the median is taken over those differences."""

    warmup: int
    repeats: int

    def rounds(self, passes: Sequence[Pass]) -> torch.Tensor:
        """Slowest-rank seconds, shape (repeats, len(passes), 2): forward, backward (0 without one)."""
        import torch.distributed as dist

        times = torch.zeros(self.repeats, len(passes), 2, dtype=torch.float64)
        for i in range(self.warmup + self.repeats):
            for j, p in enumerate(passes):
                row = _run_pass(p)
                if i >= self.warmup:
                    times[i - self.warmup, j] = torch.tensor(row, dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step waits for its slowest rank
        return times


def _run_pass(p: Pass) -> tuple[float, float]:
    import torch.distributed as dist

    if p.reset is not None:
        p.reset()
    dist.barrier()
    start = time.perf_counter()
    out = p.forward()
    forward_s = time.perf_counter() - start
    if p.backward is None:
        return forward_s, 0.0
    dist.barrier()
    start = time.perf_counter()
    p.backward(out)
    return forward_s, time.perf_counter() - start


def median_clamped(values: torch.Tensor) -> float:
    """Median over repeats (dim 0), clamped at 0: a framework cost below the noise is priced as none."""
    return max(statistics.median(values.tolist()), 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Bare collectives at the wrapper's byte counts
# ---------------------------------------------------------------------------------------------------------------


def fsdp_padded_numel(module: nn.Module, g: int, recurse: bool) -> int:
    """Float32 elements FSDP2 all-gathers for `module`'s parameters: each padded on dim 0 to a multiple of g."""
    total = 0
    for p in module.parameters(recurse=recurse):
        rows = p.shape[0] if p.dim() else 1
        total += math.ceil(rows / g) * g * (p.numel() // max(rows, 1))
    return total


def all_gathers(numels: Sequence[int], group: Any, g: int) -> Callable[[], None]:
    """One all-gather per unit, back to back (FSDP2 gathers unit after unit)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    buffers = [(torch.empty(n), torch.ones(n // g)) for n in numels]

    def run() -> None:
        for out, shard in buffers:
            gather(out, shard, group=group)
    return run


def reduce_scatters(numels: Sequence[int], group: Any, g: int) -> Callable[[], None]:
    """One reduce-scatter per unit, back to back."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    buffers = [(torch.empty(n // g), torch.ones(n)) for n in numels]

    def run() -> None:
        for out, full in buffers:
            scatter(out, full, group=group)
    return run


def all_reduce(numel: int, group: Any) -> Callable[[], None]:
    import torch.distributed as dist

    x = torch.ones(numel)
    return lambda: dist.all_reduce(x, group=group)
