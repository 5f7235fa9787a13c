"""The device mesh a plan runs on: one named axis per parallel dimension, outermost first.

`Strategy.mesh_order` lists the axes innermost (fastest-varying rank, fastest network tier) first, as Megatron-LM
orders ranks; `torch.distributed.device_mesh.init_device_mesh` takes dims outermost first (row-major), so the mesh
is built from the reversed order and the innermost axis (tp by default) gets rank stride 1. Expert parallelism
reuses data-parallel ranks and has no axis of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodel.strategy import MeshAxis, Strategy
from planner.errors import PlanLoadError, UserError

SUPPORTED_AXES: tuple[MeshAxis, ...] = (MeshAxis.TP, MeshAxis.DP, MeshAxis.PP)
"""Axes `parallelize` can apply today; a plan with cp > 1 or ep > 1 is refused."""


@dataclass(frozen=True, slots=True)
class MeshLayout:
    """Axis names and sizes of a plan's mesh, outermost first (the order `init_device_mesh` takes)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def size(self, axis: MeshAxis | str) -> int:
        return self.sizes[self.names.index(MeshAxis(axis).value)]

    def coordinates(self, rank: int) -> Mapping[str, int]:
        """Position of a global rank on each axis (row-major, last axis fastest)."""
        coords: dict[str, int] = {}
        for name, size in zip(reversed(self.names), reversed(self.sizes), strict=True):
            coords[name] = rank % size
            rank //= size
        return coords


def mesh_layout(strategy: Strategy) -> MeshLayout:
    """The mesh of `strategy`: tp, dp and pp axes (size 1 included) in `mesh_order`, outermost first."""
    unsupported = [f"{a.value}={getattr(strategy, a.value)}" for a in (MeshAxis.CP, MeshAxis.EP)
                   if getattr(strategy, a.value) > 1]
    if unsupported:
        raise UserError(f"parallelize cannot apply {', '.join(unsupported)} yet; "
                        f"supported axes: {', '.join(a.value for a in SUPPORTED_AXES)}")
    axes = [a for a in reversed(strategy.mesh_order) if a in SUPPORTED_AXES]
    return MeshLayout(names=tuple(a.value for a in axes), sizes=tuple(getattr(strategy, a.value) for a in axes))


def check_world_size(strategy: Strategy, world_size: int) -> None:
    if world_size != strategy.num_devices:
        raise PlanLoadError(
            f"the plan needs {strategy.num_devices} processes (dp={strategy.dp} x tp={strategy.tp} x "
            f"pp={strategy.pp}) but the world size is {world_size}; launch with --nproc-per-node "
            f"{strategy.num_devices} or make a plan for {world_size} devices")


def build_mesh(strategy: Strategy, device_type: str):  # -> DeviceMesh (torch import kept local: CLI start-up)
    """Initialize this process's `DeviceMesh` for `strategy`; the default process group must exist."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise UserError("torch.distributed is not initialized; run under torchrun (or `stratagem run --nproc K`)")
    check_world_size(strategy, dist.get_world_size())
    layout = mesh_layout(strategy)
    return init_device_mesh(device_type, layout.sizes, mesh_dim_names=layout.names)
