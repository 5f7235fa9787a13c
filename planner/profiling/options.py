"""Options and results of an operator profile (`planner.profiling.ops.profile_module`)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from costmodel.profile_db import OpProfile


class Statistic(enum.StrEnum):
    """How repeated timings of one op become its profile value."""

    MEDIAN = "median"
    """The typical run on a device the process has to itself: outliers (preemption, interrupts) do not count."""
    MEAN = "mean"
    """The expected run when processes share cores: the time slices lost to the others count in proportion."""


def parse_statistic(value: Statistic | str) -> Statistic:
    try:
        return Statistic(value)
    except ValueError:
        raise ValueError(f"unknown statistic {value!r}; valid: {', '.join(s.value for s in Statistic)}") from None


MAX_TIMED_RUNS = 5000
DEFAULT_MEMORY_BUDGET_BYTES = 2 * 1024 ** 3
"""Largest working set (inputs, outputs, parameters and their gradients) of one timed op: 2 GiB keeps several
concurrent profiling processes inside this build machine's 23 GiB."""


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What to measure and how."""

    microbatch_sizes: tuple[int, ...] = (1,)
    """Micro-batch sizes to measure; profile keys are relative to a trace at `traced_batch`."""
    traced_batch: int = 1
    """Batch size of the trace the cost model prices (`stratagem plan` traces at batch 1)."""
    tp_degrees: tuple[int, ...] = (1,)
    """Tensor-parallel degrees whose per-device op shards are measured too (1: replicated only)."""
    warmup: int = 3
    repeats: int = 11
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    dtype: str | None = None
    """The training dtype: the model is traced in it (the keys carry the traced dtypes, as `stratagem plan --dtype`
    traces) and its ops run in it (floating parameters and inputs cast). None keeps the model's own."""
    threads: int | None = 1
    """torch intra-op threads (torchrun gives each rank one); None leaves torch's default."""
    statistic: Statistic = Statistic.MEDIAN
    min_window_s: float = 0.0
    """With the mean: keep timing an op until its runs add up to this many seconds (several scheduler time
    slices, so that sharing the cores is sampled fairly)."""

    def __post_init__(self) -> None:
        for name in ("traced_batch", "warmup", "repeats", "memory_budget_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("microbatch_sizes", "tp_degrees"):
            values = tuple(getattr(self, name))
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values!r}")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        object.__setattr__(self, "statistic", parse_statistic(self.statistic))
        if not 0 <= self.min_window_s < math.inf:
            raise ValueError(f"min_window_s must be a finite number >= 0, got {self.min_window_s!r}")


@dataclass(frozen=True, slots=True)
class SkippedOp:
    """A profile key that was not measured, and why (the analytical model prices it)."""

    node: str
    signature: str
    reason: str


@dataclass(frozen=True)
class ProfileRun:
    """The result of profiling one or more models."""

    profile: OpProfile
    skipped: tuple[SkippedOp, ...] = ()
    measured_ops: int = 0
    seconds: float = 0.0
    models: tuple[str, ...] = ()
