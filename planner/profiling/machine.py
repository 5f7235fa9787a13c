"""Profile this machine into one `OpProfile`: the requested models' operators (in one process or several at
once), and optionally the collectives' alpha-beta fits and the framework overheads (`stratagem profile`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from costmodel.framework import FrameworkCosts
from costmodel.profile_db import OpProfile
from planner.profiling.collectives import CollectiveOptions, collective_profile
from planner.profiling.framework import FrameworkOptions, framework_meta, measure_framework
from planner.profiling.options import ProfileOptions, ProfileRun
from planner.profiling.requests import ModelRequest, profile_concurrently, profile_requests

GPU_CATALOG_NAMES: tuple[tuple[str, str], ...] = (
    ("h200", "h200"), ("h800", "h800"), ("h100", "h100-sxm"), ("b200", "b200"), ("a100", "a100-80gb"), ("l4", "l4"), ("a10g", "a10g"),
    ("t4", "t4"), ("v100", "v100-32gb"), ("mi300", "mi300x"), ("mi250", "mi250x"))
"""(substring of the GPU's name as the driver reports it, device catalog name), first match wins."""


def catalog_name_of_gpu(gpu_name: str) -> str | None:
    """The device catalog's name for a GPU the driver calls `gpu_name`, None when none matches."""
    gpu = gpu_name.lower()
    return next((name for key, name in GPU_CATALOG_NAMES if key in gpu), None)


@dataclass(frozen=True)
class MachineProfile:
    ops: ProfileRun
    """The operator measurements (with what was skipped, and why)."""
    profile: OpProfile
    """Operators, collective fits and framework overheads together: what `--profile` reads."""
    framework: FrameworkCosts | None


def profile_machine(requests: Sequence[ModelRequest], *, device: torch.device, device_name: str,
                    options: ProfileOptions, concurrent: int = 1, collectives: CollectiveOptions | None = None,
                    framework: FrameworkOptions | None = None) -> MachineProfile:
    """Measure the requested models' operators (in `concurrent` CPU processes at once when > 1), then the
    collectives and the framework overheads when their options are given, into one profile."""
    if concurrent > 1:
        ops = profile_concurrently(requests, concurrent=concurrent, device_name=device_name, options=options)
    else:
        ops = profile_requests(requests, device=device, device_name=device_name, options=options)
    profile = ops.profile
    if collectives is not None:
        profile = OpProfile(entries=profile.entries, meta=profile.meta, collectives=collective_profile(collectives))
    costs = None
    if framework is not None:
        costs = measure_framework(framework)
        profile = profile.merged(OpProfile(entries=costs.entries(device_name), meta=framework_meta(framework)))
    return MachineProfile(ops=ops, profile=profile, framework=costs)
