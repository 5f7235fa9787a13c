"""The device mesh a plan runs on: one named axis per parallel dimension, outermost first, and the 1-D meshes
derived from it that `parallelize` communicates over.

`Strategy.mesh_order` lists the axes innermost (fastest-varying rank, fastest network tier) first, as Megatron-LM
orders ranks; `torch.distributed.device_mesh.init_device_mesh` takes dims outermost first (row-major), so the mesh
is built from the reversed order and the innermost axis (tp by default) gets rank stride 1.

Expert parallelism reuses tensor- and data-parallel ranks and has no axis of its own: a group is ep consecutive
ranks of the stage's tp x dp ranks, tp fastest (`costmodel.strategy.expert_span`, the group
`costmodel.rank_layout.ep_group` prices). When ep divides tp the tp axis is split into (tp / ep, ep); otherwise
the dp axis into (dp / ep_dp, ep_dp) and the group is ep_dp x tp flattened. Derived meshes (`PlanMeshes`):
- `replicas`: the ranks over which dense parameters are data-parallel: dp, or dp x cp flattened when cp > 1
  (context-parallel ranks hold the same weights and see different tokens of the same samples);
- `ep`: the expert-parallel group (all-to-all dispatch and combine);
- `expert_replicas`: the data-parallel ranks holding the same experts: (dp / ep_dp) x cp;
- `expert_tp_sum`: the ranks of a tp group holding the same experts, which split their slots
  (`apply_ep.apply_expert_token_split`) and sum their gradients: the tp group when ep = 1, tp / ep ranks when ep
  divides tp, none when ep groups take whole tp groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from costmodel.rank_layout import mesh_axes
from costmodel.strategy import MeshAxis, Strategy, expert_tp_replicas
from planner.errors import PlanLoadError, UserError
from planner.strategy_label import Detail, strategy_label

EXPERT_REPLICA_AXIS = "edp"
"""Name of the outer part of dp when ep > 1: ranks with the same ep coordinate hold the same experts
("expert data parallel" in Megatron-Core)."""
EXPERT_TP_AXIS = "etp_rep"
"""Name of the outer part of tp when ep divides tp: ranks with the same ep coordinate hold the same experts."""


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
    """The mesh of `strategy`: `costmodel.rank_layout.mesh_axes` (tp, cp, dp and pp, size 1 included), outermost
    first, so that a rank's coordinates are the ones the cost model priced."""
    outermost_first = tuple(reversed(mesh_axes(strategy)))
    return MeshLayout(names=tuple(a.value for a, _ in outermost_first), sizes=tuple(n for _, n in outermost_first))


def check_world_size(strategy: Strategy, world_size: int) -> None:
    if world_size != strategy.num_devices:
        raise PlanLoadError(
            f"the plan needs {strategy.num_devices} processes ({strategy_label(strategy, Detail.DEGREES)}) but the world size "
            f"is {world_size}; launch with --nproc-per-node {strategy.num_devices} or make a plan for "
            f"{world_size} devices")


@dataclass(frozen=True)
class PlanMeshes:
    """The root mesh and the 1-D meshes `parallelize` uses. Flattened meshes are kept here, not looked up by
    name on the root (torch deprecates slicing flattened dims from the root mesh)."""

    root: Any
    tp: Any
    cp: Any
    dp: Any
    pp: Any
    replicas: Any
    """Data-parallel mesh of dense parameters: dp, or dp x cp flattened."""
    ep: Any = None
    """Expert-parallel mesh (None when ep == 1)."""
    expert_replicas: Any = None
    """Data-parallel mesh of expert parameters: (dp / ep_dp) x cp (None when ep == 1)."""
    expert_tp_sum: Any = None
    """Ranks of a tp group holding the same experts, whose expert gradients are summed (module docstring)."""


def build_mesh(strategy: Strategy, device_type: str):  # -> DeviceMesh (torch import kept local: CLI start-up)
    """Initialize this process's root `DeviceMesh` for `strategy`; the default process group must exist."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise UserError("torch.distributed is not initialized; run under torchrun (or `stratagem run --nproc K`)")
    check_world_size(strategy, dist.get_world_size())
    layout = mesh_layout(strategy)
    return init_device_mesh(device_type, layout.sizes, mesh_dim_names=layout.names)


def derive_meshes(root: Any, strategy: Strategy) -> PlanMeshes:
    """The 1-D meshes of `strategy` on `root` (built by `build_mesh` or given by the caller). Every rank must call
    this, in the same order: flattening and splitting axes create process groups."""
    names = tuple(root.mesh_dim_names)
    dp_cp = [n for n in names if n in (MeshAxis.DP.value, MeshAxis.CP.value)]  # root order
    replicas = root[tuple(dp_cp)]._flatten("dp_cp") if strategy.cp > 1 else root[MeshAxis.DP.value]
    ep = expert_replicas = tp_sum = None
    tp_ranks, ep_dp = expert_tp_replicas(strategy.tp, strategy.ep), strategy.ep_dp
    if strategy.ep > 1 and ep_dp == 1:  # inside a tp group
        split = root._unflatten(MeshAxis.TP.value, (tp_ranks, strategy.ep), (EXPERT_TP_AXIS, MeshAxis.EP.value))
        ep, expert_replicas = split[MeshAxis.EP.value], replicas
        tp_sum = split[EXPERT_TP_AXIS] if tp_ranks > 1 else None
    elif strategy.ep > 1:  # whole tp groups of ep_dp consecutive dp coordinates
        split = root._unflatten(MeshAxis.DP.value, (strategy.dp // ep_dp, ep_dp), (EXPERT_REPLICA_AXIS, "ep_dp"))
        ep = split[("ep_dp", MeshAxis.TP.value)]._flatten(MeshAxis.EP.value) if strategy.tp > 1 else split["ep_dp"]
        outer = [n for n in split.mesh_dim_names if n in (EXPERT_REPLICA_AXIS, MeshAxis.CP.value)]
        expert_replicas = (split[tuple(outer)]._flatten("edp_cp") if strategy.cp > 1
                           else split[EXPERT_REPLICA_AXIS])
    elif strategy.tp > 1:
        tp_sum = root[MeshAxis.TP.value]
    return PlanMeshes(root=root, tp=root[MeshAxis.TP.value], cp=root[MeshAxis.CP.value],
                      dp=root[MeshAxis.DP.value], pp=root[MeshAxis.PP.value], replicas=replicas, ep=ep,
                      expert_replicas=expert_replicas, expert_tp_sum=tp_sum)
