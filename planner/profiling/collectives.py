"""Collectives (`measure_collectives`) timed in a spawned gloo (CPU) or NCCL (GPU) process group of 2..K ranks at
several sizes, and fitted with `costmodel.hardware.collective_fit`."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from costmodel.hardware.collective_fit import CollectiveProfile, CollectiveSample
from costmodel.hardware.collectives import Collective
from planner.profiling.options import Statistic, parse_statistic
from planner.profiling.spawn import divisor_group_sizes, free_port

DEFAULT_COLLECTIVE_SIZES: tuple[int, ...] = (4 * 1024, 64 * 1024, 1024 ** 2, 4 * 1024 ** 2, 16 * 1024 ** 2)
"""Bytes per device: from latency-bound (4 KiB) to bandwidth-bound (16 MiB) on gloo."""
DEFAULT_COLLECTIVE_KINDS: tuple[Collective, ...] = (
    Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL,
    Collective.BROADCAST, Collective.SEND_RECV)


@dataclass(frozen=True, kw_only=True)
class CollectiveOptions:
    """What `measure_collectives` times. Default: one process group of every size 2..`max_ranks`, each in its own
    spawn of that many processes. With `processes` = K, K processes are spawned once and every group size n that
    divides K is measured with all K/n groups of consecutive ranks running at once -- how the data- and
    tensor-parallel groups of a K-process CPU cluster share its cores."""

    max_ranks: int = 2
    processes: int | None = None
    sizes: tuple[int, ...] = DEFAULT_COLLECTIVE_SIZES
    kinds: tuple[Collective, ...] = DEFAULT_COLLECTIVE_KINDS
    warmup: int = 2
    repeats: int = 7
    statistic: Statistic = Statistic.MEDIAN
    device_name: str = "cpu"
    use_cuda: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_ranks, int) or self.max_ranks < 2:
            raise ValueError(f"collectives need at least 2 processes, got {self.max_ranks!r}")
        if self.processes is not None and (not isinstance(self.processes, int) or self.processes < 2):
            raise ValueError(f"collectives need at least 2 processes, got {self.processes!r}")
        if not self.sizes or any(s < 16 for s in self.sizes):
            raise ValueError(f"collective sizes must be >= 16 bytes, got {self.sizes!r}")
        object.__setattr__(self, "kinds", tuple(Collective(k) for k in self.kinds))
        object.__setattr__(self, "statistic", parse_statistic(self.statistic))


def _collective_call(kind: Collective, nbytes: int, group: Any, ranks: Sequence[int], rank: int,
                     device: torch.device) -> Callable[[], None]:
    import torch.distributed as dist

    n = len(ranks)
    numel = max(nbytes // 4 // n * n, n)  # float32 elements, divisible by the group size
    x = torch.ones(numel, device=device)
    if kind is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(x, group=group)
    if kind is Collective.ALL_GATHER:  # nbytes is the gathered output
        out, part = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, part, group=group)
    if kind is Collective.REDUCE_SCATTER:  # nbytes is the input
        out = torch.empty(numel // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, x, group=group)
    if kind is Collective.ALL_TO_ALL:
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind is Collective.BROADCAST:
        return lambda: dist.broadcast(x, ranks[0], group=group)

    def send_recv() -> None:  # SEND_RECV: the group's first rank -> its second (the others idle)
        if rank == ranks[0]:
            dist.send(x, ranks[1], group=group)
        elif rank == ranks[1]:
            dist.recv(x, ranks[0], group=group)
    return send_recv


def _group_sizes(world: int, options: CollectiveOptions) -> tuple[int, ...]:
    if options.processes is None:
        return (world,)
    return divisor_group_sizes(world)


def _collective_worker(rank: int, world: int, port: int, options: CollectiveOptions, result_path: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if options.use_cuda else torch.device("cpu")
    if options.use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if options.use_cuda else "gloo", rank=rank, world_size=world)
    rows = []
    try:
        for n in _group_sizes(world, options):
            # every rank creates every group (new_group's contract), then uses the one holding it
            groups = [(dist.new_group(list(range(s, s + n))), list(range(s, s + n))) for s in range(0, world, n)]
            group, ranks = groups[rank // n]
            rows += _time_group(n, group, ranks, rank, options, device)
        if rank == 0:
            Path(result_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _time_group(n: int, group: Any, ranks: Sequence[int], rank: int, options: CollectiveOptions,
                device: torch.device) -> list[dict[str, Any]]:
    import torch.distributed as dist

    rows = []
    for kind in options.kinds:
        for nbytes in options.sizes:
            fn = _collective_call(kind, nbytes, group, ranks, rank, device)
            times = []
            for i in range(options.warmup + options.repeats):
                dist.barrier()
                _sync_device(device)
                t0 = time.perf_counter()
                fn()
                _sync_device(device)
                t = time.perf_counter() - t0
                if i >= options.warmup:
                    times.append(t)
            slowest = torch.tensor(times, dtype=torch.float64).to(device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its last rank is done
            numel = max(nbytes // 4 // n * n, n)
            value = (statistics.median if options.statistic is Statistic.MEDIAN else statistics.fmean)(
                slowest.cpu().tolist())
            rows.append({"kind": kind.value, "group_size": n, "nbytes": numel * 4, "seconds": value})
    return rows


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_collectives(options: CollectiveOptions) -> list[CollectiveSample]:
    """Time every kind x size (median over repeats of the slowest rank's time) in the process groups
    `CollectiveOptions` describes."""
    import torch.multiprocessing as mp

    samples = []
    backend = "nccl" if options.use_cuda else "gloo"
    worlds = range(2, options.max_ranks + 1) if options.processes is None else (options.processes,)
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "collectives.json")
            mp.spawn(_collective_worker, args=(world, free_port(), options, path), nprocs=world, join=True)
            rows = json.loads(Path(path).read_text())
        for r in rows:
            samples.append(CollectiveSample(kind=Collective(r["kind"]), group_size=int(r["group_size"]),
                                            nbytes=float(r["nbytes"]),
                                            seconds=float(r["seconds"]), device=options.device_name,
                                            backend=backend, repeats=options.repeats))
    return samples


def collective_profile(options: CollectiveOptions) -> CollectiveProfile:
    return CollectiveProfile.from_samples(measure_collectives(options))
