"""Planner: the strategy search, the Plan type, applying plans, and the CLI."""

from planner.errors import InfeasibleError, PlanLoadError, UserError
from planner.plan import Plan

__all__ = ["InfeasibleError", "Plan", "PlanLoadError", "UserError"]
