"""The fidelity benchmark's metrics (`bench/fidelity.py`): rank correlation, error, regret of the planner's choice,
the allocator peak of a profiled window, and which of the ranks' errors caused the others. Pure functions, tested
in tests/test_profile.py."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def ranks_of(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation: Pearson correlation of the (tie-averaged) ranks."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two equally long sequences of >= 2 values, got {len(x)} and {len(y)}")
    rx, ry = ranks_of(x), ranks_of(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else math.nan


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean of |predicted - measured| / measured."""
    return statistics.fmean(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))


# ---------------------------------------------------------------------------------------------------------------
# Driver: profile, enumerate, predict
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One strategy to run, with what each model predicts for it."""

    id: str
    cluster: str
    key: tuple[Any, ...]
    plan: dict[str, Any]
    predicted: Mapping[str, Mapping[str, Any]]
    """Model name ("profiled", "analytical") -> {"step_time_s", "memory_bytes" (per stage), "breakdown"}."""
    labels: tuple[str, ...] = ()
    """"choice:<model>" when this is the plan the search picks with that model."""


def strategy_key(strategy: Any) -> tuple[Any, ...]:
    st = strategy
    rc = sorted({s.recompute.value for s in st.stages}) if st.stages else [st.recompute.value]
    return (st.dp, st.tp, st.pp, st.microbatch_size, st.num_microbatches, st.schedule.value, st.virtual_stages,
            st.zero_stage, st.sequence_parallel, "+".join(rc))


def describe(key: Sequence[Any]) -> str:
    dp, tp, pp, mbs, m, sched, v, zero, sp, rc = key
    parts = [f"dp{dp}", f"tp{tp}{'+sp' if sp else ''}", f"pp{pp}", f"mbs{mbs}x{m}"]
    if pp > 1:
        parts.append(sched + (f":{v}" if v > 1 else ""))
    if zero:
        parts.append(f"zero{zero}")
    if rc != "none":
        parts.append(f"rc:{rc}")
    return " ".join(parts)


def peak_during(prof: Any, live_at_start: int) -> int:
    """Peak live tensor bytes during a profiled window that started with `live_at_start` bytes live: the start
    plus the largest running sum of the allocation (+) and free (-) events the profiler recorded. Frees of blocks
    allocated before the window are not reported, so the caller frees what it can (gradients) before the window."""
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return live_at_start + peak


SECONDARY_ERRORS = ("Could not resolve the process group", "Connection closed by peer", "Timed out waiting")
"""Errors a rank gets because a peer failed first (and closed the strategy's process groups)."""


def primary_error(errors: Sequence[str]) -> str:
    """The error that caused the others: the first one that is not a consequence of a peer's failure."""
    first = [e for e in errors if not any(s in e for s in SECONDARY_ERRORS)]
    return (first or list(errors))[0]


def summarize(cases: Sequence[Case], measured: Mapping[str, Mapping[str, Any]], model: str,
              confirmed: Mapping[str, float] | None = None) -> dict[str, Any]:
    ok = [c for c in cases if "error" not in measured.get(c.id, {"error": "missing"})]
    pred = [c.predicted[model]["step_time_s"] for c in ok]
    meas = [measured[c.id]["step_time_s"] for c in ok]
    mem_err = []
    for c in ok:
        p = max(c.predicted[model]["memory_bytes"])
        m = max(measured[c.id]["memory_bytes"])
        mem_err.append(abs(p - m) / m)
    best = min(meas) if meas else math.nan
    chosen = [c for c in ok if f"choice:{model}" in c.labels]
    chosen_time = measured[chosen[0].id]["step_time_s"] if chosen else math.nan
    # When the planner's choice did not run (a bug in applying it), the fastest-predicted strategy that ran
    runnable = min(ok, key=lambda c: c.predicted[model]["step_time_s"]) if ok else None
    first_pass = chosen_time / best if chosen else math.nan
    regret = first_pass
    if confirmed and chosen and describe(chosen[0].key) in confirmed:
        # the contenders timed again side by side (`confirm_contenders`)
        regret = confirmed[describe(chosen[0].key)] / min(confirmed.values())
    return {
        "strategies": len(ok),
        "spearman": spearman(pred, meas) if len(ok) > 1 else math.nan,
        "mape": mape(pred, meas) if ok else math.nan,
        "memory_error": statistics.fmean(mem_err) if mem_err else math.nan,
        "memory_error_max": max(mem_err) if mem_err else math.nan,
        "regret": regret,
        "regret_first_pass": first_pass,
        "choice": describe(chosen[0].key) if chosen else None,
        "choice_measured_s": chosen_time,
        "regret_runnable": measured[runnable.id]["step_time_s"] / best if runnable else math.nan,
        "choice_runnable": describe(runnable.key) if runnable else None,
        "best": describe(ok[meas.index(best)].key) if ok else None,
        "best_measured_s": best,
    }
