"""Where every rank of a strategy sits: the one rank layout that the cost model prices and the runtime builds.

Rank order. The mesh axes are laid out innermost first in `Strategy.mesh_order` (default tp, cp, ep, dp, pp, as
Megatron-LM orders ranks): the rank at coordinates (t, c, d, p) is

    t * stride(tp) + c * stride(cp) + d * stride(dp) + p * stride(pp)

where the stride of an axis is the product of the sizes of the axes inside it (`mesh_axes`, `axis_strides`).
Expert parallelism has no axis of its own: an ep group is `ep` consecutive ranks of the stage's tp x dp ranks, tp
fastest (`strategy.expert_span`): inside one tp group when ep divides tp (the tp stride), else whole tp groups of
ep / tp consecutive dp coordinates, priced as one group of stride dp stride / tp -- the ranks themselves when tp
and dp are adjacent in the mesh order (stride 1, the default with cp = 1), the same span and ranks per node as the
true group (tp consecutive ranks every dp stride) otherwise. With tp = 1 that is the dp stride. `planner.runtime.device_mesh` builds its `DeviceMesh` from `mesh_axes` reversed (row-major, outermost
first), so the ranks it communicates over are the ones priced here.

Groups. A collective runs over ranks start, start + stride, ... (`CommGroup`). Priced are the groups of the first
device of each pipeline rank (`tp_group`, `cp_group`, `ep_group`, and `dp_group`, the gradient reduction over
dp x cp); every other coordinate runs the same collective at the same time over a group of the same shape. Stage
boundaries send over `p2p_group`, copies of a weight shared with the first pipeline rank sync over
`shared_weight_group`.

Stages. The chain is cut into p * v virtual stages, the strategy's own or `even_stages`; virtual stage j runs on
pipeline rank j % p, or for the V-shaped schedules on rank j and 2p - 1 - j (`pipeline.stage_rank`;
`stage_ranks` are a pipeline rank's devices).

Devices. Logical rank i runs on the i-th available device of the cluster (`Cluster.available_ranks`: failed
devices are skipped). A pipeline rank runs at the pace of its slowest device (`rank_speeds`: `Cluster.speed_of`,
and where devices share host cores, their share at the strategy's `busy_fraction`); `device_map` lists what each
pipeline rank runs on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import CommGroup
from costmodel.pipeline import bubble_fraction, stage_rank
from costmodel.strategy import MeshAxis, Recompute, StageSpec, Strategy
from ir.layer_chain import LayerChain

# ---- rank order -------------------------------------------------------------------------------------------------


def axis_sizes(strategy: Strategy) -> dict[MeshAxis, int]:
    """Degree of every mesh axis, ep included (it rides on dp and multiplies no device count)."""
    return {MeshAxis.TP: strategy.tp, MeshAxis.CP: strategy.cp, MeshAxis.EP: strategy.ep, MeshAxis.DP: strategy.dp,
            MeshAxis.PP: strategy.pp}


def mesh_axes(strategy: Strategy) -> tuple[tuple[MeshAxis, int], ...]:
    """(axis, size) of the axes that have ranks of their own -- tp, cp, dp, pp, size 1 included -- innermost
    first."""
    sizes = axis_sizes(strategy)
    return tuple((a, sizes[a]) for a in strategy.mesh_order if a is not MeshAxis.EP)


def strides_of(sizes: Mapping[MeshAxis, int], order: Sequence[MeshAxis]) -> dict[MeshAxis, int]:
    """Rank stride of each axis of `order` (innermost first) with these sizes; ep's as its group is priced (module
    docstring)."""
    strides: dict[MeshAxis, int] = {}
    stride = 1
    for axis in order:
        if axis is MeshAxis.EP:
            continue
        strides[axis] = stride
        stride *= sizes[axis]
    tp, ep = sizes[MeshAxis.TP], sizes[MeshAxis.EP]
    if ep > 1 and tp % ep == 0:
        strides[MeshAxis.EP] = strides[MeshAxis.TP]
    else:  # ep 1 has no group; tp = 1 gives the dp stride
        strides[MeshAxis.EP] = max(strides[MeshAxis.DP] // tp, 1) if ep > 1 else strides[MeshAxis.DP]
    return strides


def axis_strides(strategy: Strategy) -> dict[MeshAxis, int]:
    """Rank stride of each mesh axis of `strategy` (ep's as its group is priced)."""
    return strides_of(axis_sizes(strategy), strategy.mesh_order)


def rank_of(strategy: Strategy, coordinates: Mapping[MeshAxis, int]) -> int:
    """Global (logical) rank at these tp, cp, dp and pp coordinates (a missing axis is at 0)."""
    strides = axis_strides(strategy)
    sizes = axis_sizes(strategy)
    rank = 0
    for axis, index in coordinates.items():
        if axis is MeshAxis.EP:
            raise ValueError("ep has no coordinate of its own: give the dp coordinate")
        if not 0 <= index < sizes[axis]:
            raise ValueError(f"{axis.value} coordinate {index} is outside 0..{sizes[axis] - 1}")
        rank += index * strides[axis]
    return rank


def coordinates_of(strategy: Strategy, rank: int) -> dict[MeshAxis, int]:
    """Position of global (logical) `rank` on the tp, cp, dp and pp axes: the inverse of `rank_of`."""
    if not 0 <= rank < strategy.num_devices:
        raise ValueError(f"rank {rank} is outside 0..{strategy.num_devices - 1}")
    strides = axis_strides(strategy)
    return {axis: (rank // strides[axis]) % size for axis, size in mesh_axes(strategy)}


def stage_ranks(strategy: Strategy, pp_rank: int) -> list[int]:
    """Global ranks of pipeline rank `pp_rank` (all its tp x cp x dp devices), ascending."""
    return _stage_rank_array(strategy, pp_rank).tolist()


def _stage_rank_array(strategy: Strategy, pp_rank: int) -> np.ndarray:
    """`stage_ranks` as a sorted int64 array (a pipeline rank of a large mesh holds thousands of devices)."""
    return _stage_rank_matrix(strategy, (pp_rank,))[0]


def _stage_rank_matrix(strategy: Strategy, pp_ranks: Sequence[int]) -> np.ndarray:
    """`stage_ranks` of each of `pp_ranks`, one sorted row each (one array operation for all of them)."""
    st = axis_strides(strategy)
    offsets = np.zeros(1, dtype=np.int64)
    for axis, size in ((MeshAxis.TP, strategy.tp), (MeshAxis.CP, strategy.cp), (MeshAxis.DP, strategy.dp)):
        offsets = (offsets[:, None] + np.arange(size, dtype=np.int64) * st[axis]).ravel()
    offsets.sort()  # every row is the same offsets from its first rank: sorted once
    return np.asarray(pp_ranks, dtype=np.int64)[:, None] * st[MeshAxis.PP] + offsets[None, :]


# ---- communication groups ---------------------------------------------------------------------------------------


def tp_group(strategy: Strategy, pp_rank: int) -> CommGroup:
    """The tensor-parallel group of the first device of pipeline rank `pp_rank`."""
    st = axis_strides(strategy)
    return CommGroup(strategy.tp, stride=st[MeshAxis.TP], start=pp_rank * st[MeshAxis.PP])


def cp_group(strategy: Strategy, pp_rank: int) -> CommGroup:
    """The context-parallel ring of the first device of pipeline rank `pp_rank`."""
    st = axis_strides(strategy)
    return CommGroup(strategy.cp, stride=st[MeshAxis.CP], start=pp_rank * st[MeshAxis.PP])


def ep_group(strategy: Strategy, pp_rank: int) -> CommGroup:
    """The expert-parallel group of the first device of pipeline rank `pp_rank` (module docstring)."""
    st = axis_strides(strategy)
    return CommGroup(strategy.ep, stride=st[MeshAxis.EP], start=pp_rank * st[MeshAxis.PP])


def dp_group(strategy: Strategy, pp_rank: int) -> CommGroup:
    """The data-parallel (x context-parallel) group of the first device of pipeline rank `pp_rank`.

    When cp > 1 the gradient reduction spans dp*cp ranks at the inner of the two strides (exact when the two axes
    are adjacent in the mesh order, as in the default and in every order the search tries)."""
    st = axis_strides(strategy)
    stride = min(st[MeshAxis.DP], st[MeshAxis.CP]) if strategy.cp > 1 else st[MeshAxis.DP]
    return CommGroup(strategy.dp * strategy.cp, stride=stride, start=pp_rank * st[MeshAxis.PP])


def p2p_group(strategy: Strategy, boundary: int) -> CommGroup:
    """The pair that carries virtual-stage boundary `boundary` (stage j -> j+1): pipeline rank j % pp to the next,
    or from the last rank back to the first between interleaved chunks; on a V-shaped schedule the ranks of the
    two stages (`pipeline.stage_rank`), a group of one where both are on the same rank (nothing is sent)."""
    pp, stride = strategy.pp, axis_strides(strategy)[MeshAxis.PP]
    a, b = (stage_rank(strategy.schedule, pp, j) for j in (boundary, boundary + 1))
    if a == b:
        return CommGroup(1, stride=stride, start=a * stride)
    return CommGroup(2, stride=stride * abs(b - a), start=min(a, b) * stride)


def shared_weight_group(strategy: Strategy, pp_rank: int) -> CommGroup:
    """The pair that all-reduces the gradient of a weight pipeline rank `pp_rank` (> 0) shares with the first
    pipeline rank, which owns it (a tied embedding and LM head)."""
    if pp_rank < 1:
        raise ValueError(f"pipeline rank {pp_rank} owns its shared weights; only ranks 1.. sync a copy")
    return CommGroup(2, stride=pp_rank * axis_strides(strategy)[MeshAxis.PP])


def type_group(cluster: Cluster, device_name: str, size: int, stride: int) -> CommGroup:
    """The group of `size` ranks `stride` apart that starts at the first device of type `device_name`: a type's
    collectives run over its own nodes' links (a V100 node's NVLink 2, not the NVLink 3 of the A100 node at rank
    0). From rank 0 when no group has the type or the group would not fit after it."""
    for i, g in enumerate(cluster.groups):
        if g.device.name == device_name:
            start = cluster.group_ranks(i).start
            if start + (size - 1) * stride < cluster.num_devices:
                return CommGroup(size, stride, start)
            break
    return CommGroup(size, stride)


# ---- stages -----------------------------------------------------------------------------------------------------


def even_stages(chain: LayerChain, num_stages: int, recompute: Recompute = Recompute.NONE) -> tuple[StageSpec, ...]:
    """Split the chain into `num_stages` contiguous stages, dividing the repeated layer class evenly.

    The most frequent class (the transformer block) is spread as evenly as possible (the last stages take the
    remainder: they hold fewer in-flight micro-batches); segments before its first and after its last occurrence
    (embedding, final norm and head) join the first and last stage, as Megatron-LM places them. Chains that are
    not one run of blocks (a repeated class outside the run, as DeepSeek-V3's dense first blocks or a T5 decoder
    after its encoder, or blocks of two classes interleaved) get the FLOP-balanced cut of `balanced_chunks`, the
    chunks the search gives them; a run with fewer blocks than stages is split by segment count. This is the split
    of a strategy that lists no stages, for the estimate, the search and the runtime alike.
    """
    n = len(chain.segments)
    if not 1 <= num_stages <= n:
        raise ValueError(f"pp*virtual_stages={num_stages} must be between 1 and the {n} segments of the layer chain")
    run = block_run(chain)
    if run is None:
        return balanced_chunks(chain, num_stages, recompute)
    first, total = (run.start, len(run)) if len(run) >= num_stages else (0, n)
    bounds = [first]
    for size in even_shares(total, num_stages):
        bounds.append(bounds[-1] + size)
    bounds[0], bounds[-1] = 0, n
    return tuple(StageSpec(start=bounds[i], stop=bounds[i + 1], recompute=recompute) for i in range(num_stages))


def block_run(chain: LayerChain) -> range | None:
    """The segments of the most frequent layer class (the transformer blocks) when they are one contiguous run and
    no other class repeats outside it (the embedding and the head hold no repeated layer); None otherwise, as for
    DeepSeek-V3's dense first blocks before its MoE blocks or a T5 decoder after its encoder."""
    counts = Counter(s.class_id for s in chain.segments)
    main, count = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
    idx = [s.index for s in chain.segments if s.class_id == main]
    run = range(idx[0], idx[-1] + 1)
    if len(run) != count or any(counts[s.class_id] > 1 for s in chain.segments if s.index not in run):
        return None
    return run


def balanced_chunks(chain: LayerChain, num_chunks: int, recompute: Recompute = Recompute.NONE
                    ) -> tuple[StageSpec, ...]:
    """The chain cut into `num_chunks` chunks by `balanced_cuts` of its segments' forward + backward FLOPs."""
    return stages_between(balanced_cuts(segment_flops(chain), num_chunks), recompute)


def segment_flops(chain: LayerChain) -> tuple[int, ...]:
    """Forward + backward FLOPs per segment: the work `balanced_cuts` balances."""
    return tuple(s.forward_flops + s.backward_flops for s in chain.segments)


def stages_between(bounds: Sequence[int], recompute: Recompute = Recompute.NONE) -> tuple[StageSpec, ...]:
    """The stages between consecutive `bounds` (0 first, the segment count last)."""
    return tuple(StageSpec(start=a, stop=b, recompute=recompute) for a, b in zip(bounds, bounds[1:], strict=False))


def balanced_cuts(weights: Sequence[int], num_chunks: int) -> tuple[int, ...]:
    """Bounds (0 first, len(weights) last) of `num_chunks` non-empty contiguous chunks (at most len(weights))
    whose largest sum is least; of those cuts, the one with the later chunks as full as that allows (as
    `even_stages` gives the remainder to the last stages: they hold fewer micro-batches).

    The least largest sum is the least cap C at which packing from the last weight, each chunk as full as C
    allows, needs at most `num_chunks` chunks (packing greedily from one end never needs more chunks than any
    other cut within C); cutting more where a chunk holds two weights or more keeps every chunk within C."""
    n = len(weights)
    if not 1 <= num_chunks <= n:
        raise ValueError(f"{num_chunks} chunks of {n} segments")
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        cap = (lo + hi) // 2
        if _chunks_within(weights, cap) <= num_chunks:
            hi = cap
        else:
            lo = cap + 1
    bounds, stop = [n], n
    for left in range(num_chunks - 1, 0, -1):  # `left` chunks are still to fill before this one
        start, total = stop - 1, weights[stop - 1]
        while start > left and total + weights[start - 1] <= lo:
            start -= 1
            total += weights[start]
        bounds.append(start)
        stop = start
    return (0, *reversed(bounds))


def _chunks_within(weights: Sequence[int], cap: int) -> int:
    """Chunks of packing `weights` from the last, each as full as `cap` allows (every weight is at most `cap`)."""
    chunks, total = 1, 0
    for w in reversed(weights):
        if total + w > cap:
            chunks, total = chunks + 1, 0
        total += w
    return chunks


def even_shares(total: int, parts: int) -> tuple[int, ...]:
    """`total` split into `parts` integers as equal as possible; the last parts take the remainder (they hold fewer
    in-flight micro-batches). The split of `even_stages`, and of the layers a trainer's even pipeline split gets."""
    base, extra = divmod(total, parts)
    return tuple(base + (1 if i >= parts - extra else 0) for i in range(parts))


# ---- devices and speeds -----------------------------------------------------------------------------------------


def busy_fraction(strategy: Strategy) -> float:
    """Fraction of the step a pipeline rank computes with equal stages: 1 / (1 + bubble fraction)."""
    return 1.0 / (1.0 + bubble_fraction(strategy.schedule, strategy.pp, strategy.num_microbatches,
                                        strategy.virtual_stages))


def rank_speeds(cluster: Cluster, strategy: Strategy) -> tuple[float, ...]:
    """Per logical rank the speed of its device running `strategy` (`Cluster.compute_speeds`: devices that share
    host cores compute faster when pipeline bubbles leave some of them idle)."""
    physical = cluster.available_ranks()[:strategy.num_devices]
    return cluster.compute_speeds(physical, busy_fraction(strategy))


@dataclass(frozen=True, slots=True)
class StagePlacement:
    """Pipeline rank `pp_rank`: the physical devices it runs on, their device groups and types, and its pace."""

    pp_rank: int
    ranks: tuple[int, ...]
    """Physical (cluster) ranks, ascending; unavailable devices are never among them."""
    groups: tuple[str, ...]
    """Names of the device groups these ranks belong to, in cluster order."""
    devices: tuple[str, ...]
    """Device types (catalog names) of these ranks, sorted."""
    speed: float
    """Slowest speed factor among the ranks: the lockstep group's pace."""

    @property
    def group(self) -> str | None:
        """The device group when the rank lies in exactly one, else None."""
        return self.groups[0] if len(self.groups) == 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"pp_rank": self.pp_rank, "ranks": list(self.ranks), "groups": list(self.groups),
                "devices": list(self.devices), "speed": self.speed}


def device_map(cluster: Cluster, strategy: Strategy) -> tuple[StagePlacement, ...]:
    """Per pipeline rank: its physical devices, groups, device types and pace."""
    physical = cluster.available_ranks()
    if strategy.num_devices > len(physical):
        raise ValueError(f"strategy needs {strategy.num_devices} devices, cluster {cluster.name!r} has "
                         f"{len(physical)} available")
    logical = _stage_rank_matrix(strategy, range(strategy.pp))
    uniform = None if cluster.shares_host_cores else cluster.uniform_speed
    if uniform is not None:  # every device available at one speed: logical rank i is device i
        mapped, paces = logical, [float(uniform)] * strategy.pp
    else:
        speeds = np.asarray(rank_speeds(cluster, strategy), dtype=float)
        # `physical` ascends, so the mapped ranks stay sorted.
        mapped = np.asarray(physical[:strategy.num_devices], dtype=np.int64)[logical]
        paces = speeds[logical].min(axis=1).tolist()
    out = []
    for k, row in enumerate(mapped.tolist()):
        group_ids = cluster.group_indices_of(row, ascending=True)
        out.append(StagePlacement(
            pp_rank=k, ranks=tuple(row), groups=tuple(cluster.groups[g].name for g in group_ids),
            devices=tuple(sorted({cluster.groups[g].device.name for g in group_ids})), speed=paces[k]))
    return tuple(out)
