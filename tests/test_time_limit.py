"""Time limits: `--time-limit 1` returns within 1.5 s (unloaded) with the best plan found so far and says so.

The instance is GPT-3 175B on 128 DGX A100 nodes (1024 GPUs, global batch 1536, the Megatron-LM setting of
Narayanan et al., SC'21, Table 1): thousands of candidates over meshes, micro-batch sizes, schedules and ZeRO
stages, whose full search takes several seconds, so a one-second limit must cut it short. The model is traced
on the meta device.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

import ir
import planner.api
import planner.search.intra_op  # noqa: F401  (the solver's one-time import is not search time; see planner.search.branch_and_bound)
from costmodel.hardware.cluster import Cluster
from costmodel.validation import within_band
from ir.layer_chain import LayerChain
from models.registry import build_model

REPO = Path(__file__).resolve().parents[1]
MODEL, CLUSTER, BATCH = "gpt3-175b", "128x8xa100-80gb", 1536
LIMIT_S = 1.0
GRACE_S = 0.5
"""How far past the limit the search may return, in seconds of its own CPU time: the clock is checked between heap
entries and between the meshes of a device count's expansion (`planner.search.branch_and_bound.SearchState.expand`;
a mesh's own candidates are listed and bounded at once, a few milliseconds)."""


def allowed_wall_s(wall_s: float, cpu_s: float) -> float:
    """The wall-clock bound for a call that took `wall_s` while its process used `cpu_s` of CPU.

    The limit is wall-clock time and is honoured at the next clock check; the work between two checks is CPU work,
    which a machine with more runnable processes than cores stretches by wall / cpu. So the grace is scaled by the
    slowdown the call itself saw: unloaded (cpu ~ wall) the bound is the plain limit + grace; the limit's semantics
    (stop at the first check past it) are not loosened.
    """
    slowdown = max(1.0, wall_s / max(cpu_s, 1e-9))
    return LIMIT_S + GRACE_S * slowdown


@cache
def gpt3_chain() -> LayerChain:
    built = build_model(MODEL, batch=1, device="meta")
    return ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=MODEL))


def _timed_plan() -> tuple[planner.Plan, float, float]:
    chain, cluster = gpt3_chain(), Cluster.parse(CLUSTER)
    start, cpu_start = time.monotonic(), time.process_time()
    plan = planner.api.plan(chain, None, cluster, global_batch=BATCH, time_limit_s=LIMIT_S, model_name=MODEL)
    return plan, time.monotonic() - start, time.process_time() - cpu_start


@cache
def limited_plan() -> tuple[planner.Plan, float, float]:
    return _timed_plan()


def test_one_second_limit_returns_in_time_with_a_plan() -> None:
    plan, wall, cpu = limited_plan()
    if wall > allowed_wall_s(wall, cpu):
        # Another process can take the core for a moment without the load showing in this call's own CPU time
        # (seen once in a full run here at load 1.1, 1.64 s, where 9 runs alone took 1.05-1.07 s): one more try.
        first = wall
        plan, wall, cpu = _timed_plan()
        assert wall <= allowed_wall_s(wall, cpu), (
            f"a {LIMIT_S:g} s limit took {first:.2f} s, then {wall:.2f} s wall for {cpu:.2f} s CPU "
            f"(load average {_load()})")
    assert plan.search.time_s <= wall
    # cut short, and it says so: not proven optimal, with the gap to the best unexplored bound
    assert plan.search.status == "feasible"
    assert 0 < plan.search.optimality_gap < 1
    assert plan.search.lower_bound_s < plan.predicted.step_time_s
    # the best plan so far is a real one: it fits and trains the whole batch on at most the 1024 GPUs
    s = plan.strategy
    assert plan.predicted.fits
    assert s.dp * s.microbatch_size * s.num_microbatches == BATCH
    assert s.num_devices <= 1024


@pytest.mark.slow
def test_full_search_takes_longer_and_is_no_worse() -> None:
    """The instance is big enough: without a limit the search runs past the limit and proves optimality, and
    the cut-short plan is never better than the optimum, nor below its own stated lower bound."""
    limited, _, _ = limited_plan()
    start = time.monotonic()
    full = planner.api.plan(gpt3_chain(), None, Cluster.parse(CLUSTER), global_batch=BATCH, model_name=MODEL)
    assert time.monotonic() - start > LIMIT_S + GRACE_S
    # Proven: its lower bound is the fastest strategy's time (the plan itself may be a simpler tie within the band).
    assert full.search.status == "optimal"
    optimum = full.search.lower_bound_s
    assert within_band(full.predicted.step_time_s, optimum, full.predicted.error_band)
    assert optimum <= limited.predicted.step_time_s * (1 + 1e-9)
    assert limited.search.lower_bound_s <= optimum * (1 + 1e-9)


def _cli_plan(out: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run `stratagem plan` with the limit; returns the process, its wall time and its CPU time."""
    start, children_cpu = time.monotonic(), _children_cpu_s()
    proc = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "plan", MODEL, "--cluster", CLUSTER, "--batch", str(BATCH),
         "--time-limit", str(LIMIT_S), "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    # The whole run (start-up, tracing, search) sees the same load as its search: its wall / CPU is the slowdown.
    return proc, time.monotonic() - start, _children_cpu_s() - children_cpu


def test_cli_says_it_was_cut_short(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc, wall, cpu = _cli_plan(out)
    if proc.returncode == 0 and json.loads(out.read_text())["search"]["time_s"] > allowed_wall_s(wall, cpu):
        # A shared CI host once charged a 7 s stall to this run's search as CPU time (wall == CPU, 12.03 s), where
        # the same command alone returns in 1.02-1.08 s: one more try, as for the API call above.
        proc, wall, cpu = _cli_plan(out)
    assert proc.returncode == 0, proc.stderr
    assert "cut short by --time-limit" in proc.stdout
    # one line says the limit was reached, with the proven gap (stdout carries the plan and the same gap)
    gap = json.loads(out.read_text())["search"]["optimality_gap"]
    assert proc.stderr == (f"stratagem: note: time limit of {LIMIT_S:g} s reached; the plan is the best found, "
                           f"proven within {100 * gap:.1f}% of the optimum (--time-limit 0 searches to the end)\n")
    assert f"optimality gap {100 * gap:.1f}%" in proc.stdout
    search = json.loads(out.read_text())["search"]
    assert search["status"] == "feasible"
    slowed = allowed_wall_s(wall, cpu)
    assert search["time_s"] <= slowed, (f"search took {search['time_s']:.2f} s, allowed {slowed:.2f} s for a run of "
                                        f"{wall:.2f} s wall, {cpu:.2f} s CPU (load average {_load()})")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load() -> str:
    """The limit is wall-clock time: on a machine with more runnable processes than cores it stretches."""
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())
