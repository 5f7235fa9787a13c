"""Planner: the strategy search, the Plan type, applying plans, and the CLI."""

# `parallelize` and `train_step` are bound here, after their submodules load, so that `planner.parallelize` /
# `planner.train_step` name the functions (the DESIGN's API) rather than the modules of the same name; likewise
# `planner.plan` is the search function (`planner.api.plan`), the Plan type stays importable from planner.plan.
from planner.api import estimate, estimate_plan, plan, plan_top
from planner.errors import InfeasibleError, PlanLoadError, UserError
from planner.parallelize import ParallelModel, parallelize
from planner.plan import Plan
from planner.train_step import local_batch, train_step

__all__ = ["InfeasibleError", "ParallelModel", "Plan", "PlanLoadError", "UserError", "estimate", "estimate_plan",
           "local_batch", "parallelize", "plan", "plan_top", "train_step"]
