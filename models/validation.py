"""Checks shared by the zoo's config dataclasses; each error names the field, the bad value and what is valid."""

from __future__ import annotations

import enum
from typing import Any


def require_positive(config: Any, *names: str) -> None:
    """Each named integer field must be >= 1."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive integer, got {value!r}")


def require_positive_number(config: Any, *names: str) -> None:
    """Each named real-valued field must be finite and > 0 (epsilons, factors)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{type(config).__name__}.{name} must be a positive number, got {value!r}")


def require_positive_tuple(config: Any, name: str) -> None:
    """A non-empty tuple of positive integers (lists are accepted and stored as a tuple)."""
    value = tuple(getattr(config, name))
    object.__setattr__(config, name, value)  # frozen dataclass: __post_init__ may normalize its own fields
    if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(
            f"{type(config).__name__}.{name} must be a non-empty tuple of positive integers, got {value!r}"
        )


def require_divisible(config: Any, numerator: str, denominator: str) -> None:
    """Field `numerator` must be a multiple of field `denominator` (e.g. hidden of heads)."""
    n, d = getattr(config, numerator), getattr(config, denominator)
    if n % d:
        raise ValueError(
            f"{type(config).__name__}.{numerator}={n} must be divisible by {denominator}={d}"
        )


def require_probability(config: Any, name: str) -> None:
    """A dropout-like rate in [0, 1)."""
    value = getattr(config, name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{type(config).__name__}.{name} must be in [0, 1), got {value!r}")


def coerce_enum(config: Any, name: str, enum_type: type[enum.StrEnum]) -> None:
    """Turn a plain string in a StrEnum-typed field into the enum member, or list the valid values."""
    value = getattr(config, name)
    try:
        member = enum_type(value)
    except ValueError:
        valid = ", ".join(m.value for m in enum_type)
        raise ValueError(f"{type(config).__name__}.{name}={value!r} is not one of {valid}") from None
    object.__setattr__(config, name, member)  # frozen dataclass: __post_init__ may normalize its own fields


MAX_LAYERS = 1024
"""The deepest model the planner takes. It builds and traces every layer (tens of milliseconds each on a 2-core
machine) and prices every one it may cut a pipeline at; the deepest models trained have about 1,000 layers
(DeepNet, Wang et al. 2022), so a deeper one is almost always a typo (`--set layers=100000`) that would otherwise
trace for hours."""


def require_traceable_depth(layers: int) -> None:
    """At most `MAX_LAYERS` layers (transformer blocks, residual blocks) in the whole model."""
    if layers > MAX_LAYERS:
        raise ValueError(f"{layers:,} layers is more than the {MAX_LAYERS:,} the planner traces (it builds and "
                         "traces every layer; the deepest trained models have about 1,000): a typo?")
