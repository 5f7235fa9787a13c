"""Planner: search a parallelization strategy for a model on a cluster, record it as a `Plan`, apply and run it.

    planner/search/     the search: space, meshes, candidates, layer-cost table, intra-op ILP, stage DP
    planner/scenarios/  re-planning, what-if, data parallelism over groups of mixed device types
    planner/runtime/    apply a plan on this rank (torch.distributed) and train it
    planner/profiling/  measure operators, collectives and framework overheads on this machine
    planner/reports/    explain, diff, timeline, plot and the plan's text rendering
    planner/cli/        the `stratagem` command: argument parsing and printing only

The package exports the Python API's entry points; submodule names are never rebound (`planner.plan` is the
module of the `Plan` type; the search is `planner.api.plan`).

The runtime's entry points are loaded on first use: they import torch.distributed, which planning from a cached
trace never needs (importing torch takes seconds on a loaded machine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from planner.api import estimate, estimate_plan, plan_top
from planner.errors import InfeasibleError, PlanLoadError, UserError
from planner.plan import Plan

if TYPE_CHECKING:
    from planner.runtime.parallelize import ParallelModel, parallelize
    from planner.runtime.train_step import local_batch, train_step

__all__ = ["InfeasibleError", "ParallelModel", "Plan", "PlanLoadError", "UserError", "estimate", "estimate_plan",
           "local_batch", "parallelize", "plan_top", "train_step"]


def __getattr__(name: str) -> Any:
    if name in ("ParallelModel", "parallelize"):
        import planner.runtime.parallelize as module
    elif name in ("local_batch", "train_step"):
        import planner.runtime.train_step as module
    else:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(module, name)
