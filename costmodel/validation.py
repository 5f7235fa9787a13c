"""How far a prediction can be trusted: the error band from validating the model against measured runs.

A device type the model was checked on carries its mean relative step-time error (`DeviceSpec.prediction_error`:
for GPUs the leave-one-out error over published training runs, `bench/published_runs.py`; for `cpu` the mean
error of `bench/fidelity.py`'s measured strategies), with its source in the catalog. A prediction is as uncertain
as its least-validated device type: a cluster mixing types takes the largest band of its types, and a type never
checked takes the largest band of any checked type -- nothing says it is modelled better.

Two step times closer than the band are a tie: the validation cannot tell them apart, so a ranking between them
would claim more than the model knows (`planner.search.ranking` picks the simplest of tied plans).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from costmodel.hardware.catalog import list_devices
from costmodel.hardware.device import DeviceSpec


@functools.cache
def unvalidated_band() -> float:
    """The band of a device type never checked: the largest of the checked accelerators' (`cpu` runs are a
    different regime: measured op times on a shared host)."""
    return max((d.prediction_error for d in list_devices() if d.prediction_error is not None and d.name != "cpu"),
               default=0.0)


def error_band(devices: Iterable[DeviceSpec]) -> float:
    """Relative step-time error band of a prediction priced on `devices` (module docstring)."""
    bands = [d.prediction_error if d.prediction_error is not None else unvalidated_band() for d in devices]
    return max(bands, default=unvalidated_band())


def within_band(step_s: float, best_s: float, band: float) -> bool:
    """Whether `step_s` ties with `best_s` under a relative error band `band`."""
    return step_s <= best_s * (1 + band)
