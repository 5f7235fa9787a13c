"""How an op or module is timed: the clock, warm-up and timed runs, the statistic, the autograd engine's fixed
cost of a backward pass, and the intra-op thread count (see `planner.profiling.ops` for the rationale)."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from planner.profiling.options import MAX_TIMED_RUNS, ProfileOptions, Statistic


def timed_runs(run_once: Callable[[], tuple[float, float]], warmup: int, repeats: int, statistic: Statistic,
               min_window_s: float) -> tuple[float, float, int]:
    """(forward s, backward s, timed runs) of `run_once` after `warmup` untimed runs: the median of `repeats`
    runs, or the mean over at least `repeats` runs that add up to at least `min_window_s`."""
    for _ in range(warmup):
        run_once()
    runs = [run_once() for _ in range(repeats)]
    if statistic is Statistic.MEDIAN:
        return statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs), len(runs)
    total = sum(f + b for f, b in runs)
    while total < min_window_s and len(runs) < MAX_TIMED_RUNS:
        runs.append(run_once())
        total += sum(runs[-1])
    return statistics.fmean(f for f, _ in runs), statistics.fmean(b for _, b in runs), len(runs)


def tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def synchronize(value: Any) -> None:
    ts = tensors_in(value)
    if ts and ts[0].device.type == "cuda":
        torch.cuda.synchronize(ts[0].device)


def compute_clock(device: torch.device, options: ProfileOptions) -> Callable[[], float]:
    """The clock that times compute on `device`: on the CPU with one intra-op thread, the thread's CPU time (time
    slices taken by other processes on the core are not the op's; autograd runs a CPU backward on the calling
    thread); otherwise -- several threads, an accelerator (synchronized by `synchronize`), or a mean over a window
    that is meant to sample the sharing -- the wall clock."""
    if device.type == "cpu" and options.threads == 1 and options.min_window_s == 0:
        return time.thread_time
    return time.perf_counter


def backward_pass_overhead(device: torch.device, repeats: int = 51,
                           clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds the autograd engine spends starting one backward pass, beyond the per-node work: backward of a
    1-node graph minus the per-node cost measured from a 9-node chain (both on one-element tensors)."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain(n: int) -> float:
        y = x
        for _ in range(n):
            y = y * 1.0
        g = torch.ones_like(y)
        t0 = clock()
        y.backward(g)
        synchronize(x)
        return clock() - t0

    for _ in range(5):
        chain(1), chain(9)
    one = statistics.median(chain(1) for _ in range(repeats))
    nine = statistics.median(chain(9) for _ in range(repeats))
    per_node = max((nine - one) / 8, 0.0)
    return max(one - per_node, 0.0)


@contextlib.contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
