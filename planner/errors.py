"""Errors a user can fix. The CLI prints them as one line and exits 2; anything else is a bug (exit 1)."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the bad value and the valid choices, in one line."""


class PlanLoadError(UserError):
    """A plan file that is corrupt, truncated, of a newer schema, or for another model or world size."""


class InfeasibleError(UserError):
    """No strategy fits; the message says the smallest memory per device that would and what would help."""


class TimeLimitError(UserError):
    """The search's time limit (and its grace for a first plan) passed before any plan was found."""
