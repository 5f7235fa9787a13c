"""One search candidate (degrees, micro-batching, schedule, ZeRO, SP) as a stage-partition problem.

This is where the search meets the cost model. Every number comes from costmodel's own public pieces -- the
ones `costmodel.estimate` composes -- so that the partition's objective *is* the estimate of the resulting
strategy (`tests/test_search_bruteforce.py` checks it on every instance):

- a stage ``[a, b)`` with recomputation r: `step_time.stage_time` (compute / speed + TP communication),
  `step_time.data_parallel_comm` (ZeRO gathers and reduce-scatters per micro-batch, the end-of-step gradient
  reduction, the post-step weight gather), `step_time.optimizer_step_time`, and its peak memory
  `memory.rank_memory`, which is affine in the in-flight micro-batches: ``base + n * act``;
- pipeline sends: `collectives.collective_time(SEND_RECV, boundary bytes)` on the pp axis, added to the receiving
  stage's forward and the sending stage's backward as `pipeline.pipeline_times` does;
- the step (`step_time.step_breakdown`): for 1F1B with p stages, ``T = sum_k d_k + (m - 1) max_k d_k`` with
  ``d_k = f_k + b_k`` (sends included); for GPipe ``T = sum F + (m - 1) max F + sum B + (m - 1) max B``; plus the
  largest exposed end-of-step tail ``max_k max(e_k - P_k, 0)`` where ``e_k`` is the rank's exposed gradient
  reduction (`step_time.overlapped_exposed`) plus its tensor-parallel gradient sync and ``P_k`` the drain behind
  it (`pipeline.drain_slack`: the backward and sends of the stages before it), plus the largest optimizer step
  and the largest post-step gather.

For the interleaved schedule the chain is cut into p*v chunks that hold q or q+1 units (the embedding, each block
and the head; `planner.search.interleaved_layout`), and the problem's units are the pipeline ranks: each rank picks
how many of its chunks are the larger ones, whether its lead chunk is, and its recomputation, and
``T = S / v + (m - 1/v) max_k D_k`` plus the same tails (D_k: the rank's chunks, sends included;
`planner.search.interleaved_problem`).

Stage terms depend on the stage's position (first / middle / last / only: who sends and receives) and on the
device and speed of its ranks; each distinct combination is one profile of the `PartitionProblem`. Stages with
the same multiset of layer classes have the same terms, so each distinct class composition is priced once
(the range ``[a, b)`` where it first occurs stands for all of them), and its runs of identical blocks are priced
as one segment with a count (`memory.runs`): a stage of k blocks costs as much to price as one of a single block.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from costmodel.estimate import RankSetting, p2p_time, rank_chunk_times, rank_tail
from costmodel.framework import FrameworkCosts
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import CommGroup, spans
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.memory import (
    ChunkBoundary,
    PricedSegment,
    chunk_kept_bytes,
    p2p_buffer_bytes,
    rank_memory,
    returned_bytes,
)
from costmodel.offload import bytes_to_fit
from costmodel.pipeline import in_flight_per_chunk, stage_rank, zero_bubble_fill
from costmodel.rank_layout import (
    busy_fraction,
    device_map,
    dp_group,
    p2p_group,
    shared_weight_group,
    tp_group,
)
from costmodel.step_time import DataParallelComm, StageTime, data_parallel_comm, tp_bwd_exposed, tp_exposed
from costmodel.strategy import MeshAxis, Offload, Recompute, Schedule, StageSpec, Strategy
from ir.graph import dtype_bytes
from ir.layer_chain import LayerChain
from planner.search.candidates import Candidate
from planner.search.chain_structure import ChainStructure
from planner.search.interleaved_layout import ChainUnits, InterleavedLayout
from planner.search.interleaved_pricing import ChoicePricer, InterleavedCache
from planner.search.interleaved_problem import (
    decode,
    interleaved_problem,
    least_step_time_by_extra,
    step_objective,
    step_weights,
)
from planner.search.layer_costs import AxisSplit, LayerCostTable
from planner.search.meshes import MeshCandidate
from planner.search.recompute_choice import NO_RECOMPUTE, RecomputeChoice, search_choices
from planner.search.stage_partition import (
    Partition,
    PartitionProblem,
    StageChoice,
    StageKind,
    solve_partition,
    stage_kind,
)


@dataclass(frozen=True, slots=True)
class RankPlacement:
    """Pipeline rank k: its physical ranks, the device that prices it and its speed (slowest of its devices)."""

    ranks: tuple[int, ...]
    device: DeviceSpec
    speed: float


@dataclass(frozen=True)
class StageProblem:
    """A built problem plus how to turn its partition into `StageSpec`s."""

    candidate: Candidate
    problem: PartitionProblem
    placements: tuple[RankPlacement, ...]
    layout: InterleavedLayout | None = None
    """Interleaved only: the chunk layouts the DP picks from (one per rank, with its recomputation)."""
    pruned: bool = False
    """Whether stages were left out by the upper bound (then "nothing fits" does not mean out of memory)."""
    rank_costs: tuple[tuple[LayerCost, ...], ...] = ()
    """Per pipeline rank, its segments' costs: which segments partial recomputation picks."""
    classes: tuple[int, ...] = ()
    """Each segment's layer class."""
    with_preferred: Callable[[], PartitionProblem] | None = None
    """`build` with `defer_ties`: `problem` has no preferred partition, and this builds the one that has (the even
    split). The optimum's value is the same; the caller solves this one only once `problem` has a partition below
    its bound, to break ties the way `build` without `defer_ties` does."""

    def stages(self, partition: Partition) -> tuple[StageSpec, ...]:
        if self.layout is None:
            return tuple(RecomputeChoice.parse(s.option).spec(s.start, s.stop, self.rank_costs[k], self.classes)
                         for k, s in enumerate(partition.stages))
        return decode(self.layout, partition, self.rank_costs, self.classes)


@dataclass(frozen=True, slots=True)
class Unfit:
    """A candidate a pipeline rank of which fits in memory with no layout and recomputation (`build` with
    `quick_unfit`): its problem is not built."""

    need_bytes: float
    """A lower bound on the per-device memory the candidate needs: that rank's least peak over its choices."""


@dataclass(frozen=True, slots=True)
class Beaten:
    """An interleaved or zero-bubble candidate whose least work per rank already bounds its step at or above the
    caller's upper bound (`build` with `quick_unfit`): its problem is not built."""

    bound_s: float
    """The lower bound on its step time (seconds) that reached the upper bound."""


@dataclass(frozen=True, slots=True)
class RankContext:
    """What prices pipeline rank k besides its segments: device, speed, and the signature of its prices."""

    index: int
    device: DeviceSpec
    speed: float
    signature: int
    """Numbers everything that changes the rank's prices: device, speed, degrees, and its communication groups (data,
    tensor parallel, shared-weight sync) replaced by what their collectives depend on."""


@dataclass(frozen=True, slots=True)
class _Terms:
    """One rank's terms for one micro-batch and the end of the step (before pipeline sends)."""

    fwd: tuple[float, ...]
    """Per chunk: forward seconds (compute / speed + TP + ZeRO-3 gathers)."""
    bwd: tuple[float, ...]
    wgrad: tuple[float, ...]
    """Per chunk: of `bwd`, the weight-gradient seconds (the zero-bubble schedules' W)."""
    tail: float
    """Exposed end-of-step gradient reduction + TP gradient sync, before the drain hides part of it."""
    tail_const: float
    """Gradient sync of weights shared with another pipeline rank (no drain hides it)."""
    optimizer: float
    post: float
    memory0: float
    """Peak bytes with no micro-batch in flight (`rank_memory` with in_flight 0 / the schedule's counts)."""
    memory1: float
    """Peak bytes with one micro-batch in flight per chunk (contiguous stages only)."""
    chunk_act: tuple[float, ...] = ()
    """Per chunk: the activation bytes one micro-batch saves there; peak memory is memory0 + sum_c n_c chunk_act[c]
    for in-flight counts n_c (`memory.rank_memory` is affine in them)."""


@dataclass
class StageProblemBuilder:
    """Builds `StageProblem`s for one chain and cluster, sharing layer prices and class compositions."""

    chain: LayerChain
    cluster: Cluster
    table: LayerCostTable
    dtype: str = "bfloat16"
    structure: ChainStructure = field(init=False, repr=False)
    terms: dict[tuple, _Terms] = field(default_factory=dict, repr=False)
    _p2p_cache: dict[tuple, float] = field(default_factory=dict, repr=False)
    _sig_cache: dict[CommGroup, tuple] = field(default_factory=dict, repr=False)
    _placements: dict[tuple[MeshCandidate, float], tuple[RankPlacement, ...] | None] = field(default_factory=dict,
                                                                                              repr=False)
    _strategies: dict[tuple, Strategy] = field(default_factory=dict, repr=False)
    _p2p_sig: dict[tuple, tuple] = field(default_factory=dict, repr=False)
    _framework: dict[str, FrameworkCosts] = field(default_factory=dict, repr=False)
    _layouts: dict[tuple[int, int, Schedule], InterleavedLayout | None] = field(default_factory=dict, repr=False)
    _units: ChainUnits | None = field(default=None, repr=False)
    _chunk_cache: dict[tuple, dict] = field(default_factory=dict, repr=False)
    """`costmodel.estimate.rank_chunk_times`' chunk terms per rank signature (a rank's chunks repeat; they do not
    depend on the micro-batch count or the schedule)."""
    memory_cache: dict[tuple, tuple[float, tuple[float, ...]]] = field(default_factory=dict, repr=False)
    _masks: dict[tuple[StageKind, int], list[np.ndarray]] = field(default_factory=dict, repr=False)
    _signatures: dict[tuple, int] = field(default_factory=dict, repr=False)
    _segment_costs: dict[tuple, tuple[LayerCost, ...]] = field(default_factory=dict, repr=False)
    interleaved: InterleavedCache = field(default_factory=InterleavedCache, repr=False)
    _sends: dict[tuple, list[float]] = field(default_factory=dict, repr=False)
    _dp_comm_cache: dict[tuple, DataParallelComm] = field(default_factory=dict, repr=False)
    """`step_time.data_parallel_comm` results by what they depend on (the group through `collectives.spans`)."""

    def __post_init__(self) -> None:
        self.structure = ChainStructure(self.chain)

    # -- placement -------------------------------------------------------------------------------------------
    def placements(self, cand: Candidate) -> tuple[RankPlacement, ...] | None:
        """Per pipeline rank its devices, device type and speed (logical rank i runs on the i-th available
        device, and runs at `costmodel.rank_layout.rank_speeds`, as `estimate` maps them); None if the mesh needs
        more devices than are available. Where devices share host cores their speed depends on the schedule's
        bubbles too, so placements are per (mesh, busy fraction); otherwise per mesh."""
        busy = busy_fraction(self.strategy_of(cand)) if self.cluster.shares_host_cores else 1.0
        key = (cand.mesh, busy)
        if key not in self._placements:
            self._placements[key] = self._place(cand)
        return self._placements[key]

    def _place(self, cand: Candidate) -> tuple[RankPlacement, ...] | None:
        if cand.mesh.num_devices > self.cluster.num_available:
            return None
        return tuple(RankPlacement(pl.ranks, self.cluster.device_of(pl.ranks[0]), pl.speed)
                     for pl in device_map(self.cluster, self.strategy_of(cand)))

    def strategy_of(self, cand: Candidate) -> Strategy:
        """The candidate's strategy without stages (cached: building a Strategy validates it)."""
        key = (cand.mesh, cand.microbatch_size, cand.num_microbatches, cand.schedule, cand.virtual_stages,
               cand.zero_stage, cand.sequence_parallel, cand.runtime)
        hit = self._strategies.get(key)
        if hit is None:
            hit = self._strategies[key] = cand.strategy()
        return hit

    def segment_costs(self, cand: Candidate, device: DeviceSpec) -> tuple[LayerCost, ...]:
        m = cand.mesh
        key = (device.name, m.tp, m.stride(MeshAxis.TP), cand.sequence_parallel, cand.microbatch_size, m.cp,
               m.stride(MeshAxis.CP), m.ep, m.stride(MeshAxis.EP), m.num_devices)
        hit = self._segment_costs.get(key)
        if hit is None:
            # Context / expert parallelism priced on top of the tp prices (planner.search.layer_costs.AxisSplit).
            split = AxisSplit(cp=m.cp, cp_stride=m.stride(MeshAxis.CP), ep=m.ep, ep_stride=m.stride(MeshAxis.EP),
                              num_devices=m.num_devices)
            hit = self._segment_costs[key] = self.table.segment_costs(
                device, tp=m.tp, tp_stride=m.stride(MeshAxis.TP), sequence_parallel=cand.sequence_parallel,
                microbatch_size=cand.microbatch_size, split=split)
        return hit

    # -- ranks -------------------------------------------------------------------------------------------------
    def group_signature(self, group: CommGroup | None) -> tuple:
        """What a collective over `group` depends on: its size and the tiers it spans (`collectives.spans`)."""
        if group is None:
            return ()
        if group not in self._sig_cache:
            self._sig_cache[group] = (group.size, spans(group, self.cluster))
        return self._sig_cache[group]

    def context(self, cand: Candidate, k: int, placement: RankPlacement) -> RankContext:
        strategy = self.strategy_of(cand)
        dpg, tpg = dp_group(strategy, k), tp_group(strategy, k)
        shared = shared_weight_group(strategy, k) if k > 0 else None
        m = cand.mesh
        # The schedule changes a rank's prices only through measured host work (`step_time.host_time`: the
        # multi-chunk engine, the split backward); left out otherwise so that the schedules share the terms.
        host_schedule = (cand.schedule.chunked, cand.schedule.zero_bubble) \
            if m.pp > 1 and not self.framework(placement.device).is_zero else None
        signature = (placement.device.name, placement.speed, m.tp, m.pp, m.dp, m.cp, m.ep, cand.sequence_parallel,
                     cand.microbatch_size, cand.zero_stage, self.group_signature(dpg), self.group_signature(tpg),
                     self.group_signature(shared), cand.runtime, host_schedule)
        # A small number stands for the signature in the cache keys (a long tuple is slow to hash).
        return RankContext(k, placement.device, placement.speed,
                            self._signatures.setdefault(signature, len(self._signatures)))

    def framework(self, device: DeviceSpec) -> FrameworkCosts:
        """The measured framework overheads of `device`'s type in the table's profile (cached)."""
        hit = self._framework.get(device.name)
        if hit is None:
            hit = self._framework[device.name] = FrameworkCosts.from_profile(self.table.profile, device.name)
        return hit

    def _dp_comm(self, **kw) -> DataParallelComm:
        """`step_time.data_parallel_comm`, cached by what it depends on (the group through `collectives.spans`)."""
        key = (kw["zero_stage"], kw["grad_bytes"], kw["param_bytes"], kw["num_segments"], kw["fwd_window_s"],
               kw["bwd_window_s"], self.group_signature(kw["group"]), kw["concurrent"], kw["overlap"],
               kw["reshard_after_forward"], kw.get("host_copy"), kw.get("pipelined", False))
        hit = self._dp_comm_cache.get(key)
        if hit is None:
            hit = self._dp_comm_cache[key] = data_parallel_comm(**kw)
        return hit

    def chunk_times_of(self, cand: Candidate, ctx: RankContext, chunks: Sequence[Sequence[PricedSegment]]
                     ) -> tuple[list[StageTime], list[DataParallelComm]]:
        """Per chunk its `StageTime` and data-parallel communication (`costmodel.estimate.rank_chunk_times`)."""
        setting = RankSetting(ctx.index, ctx.device, ctx.speed, self.framework(ctx.device))
        return rank_chunk_times(chunks, self.strategy_of(cand), setting, self.cluster, self.dtype,
                                dp_comm=self._dp_comm, chunk_cache=self._chunk_cache.setdefault(ctx.signature, {}))

    def memory_terms(self, cand: Candidate, ctx: RankContext, chunks: Sequence[Sequence[PricedSegment]],
                     shared: int, boundaries: Sequence[ChunkBoundary] = ()) -> tuple[float, tuple[float, ...]]:
        """(peak bytes with no micro-batch in flight, per chunk the bytes one more micro-batch in flight adds
        there): `memory.rank_memory` is affine in the in-flight counts. `boundaries`: per chunk, where the runtime
        keeps pipeline buffers (`RuntimeOptions.keeps_p2p_buffers`)."""
        mem0 = self._rank_memory(cand, ctx, chunks, shared, [0] * len(chunks), boundaries)
        kernel = cand.runtime.loss_kernel(cand.mesh.tp)
        slopes = [p2p_buffer_bytes(b, cand.num_microbatches)[1] for b in boundaries] or [0] * len(chunks)
        return mem0, tuple(float(chunk_kept_bytes(chunk, kernel, self.dtype)) + slope
                           for chunk, slope in zip(chunks, slopes, strict=True))

    def _rank_memory(self, cand: Candidate, ctx: RankContext, chunks: Sequence[Sequence[PricedSegment]],
                     shared: int, counts: Sequence[int], boundaries: Sequence[ChunkBoundary] = ()) -> float:
        m, offload = cand.mesh, cand.runtime.offload
        return bytes_to_fit(rank_memory(chunks, counts, zero_stage=cand.zero_stage, dp=m.dp * m.cp, dtype=self.dtype,
                                        device_name=ctx.device.name, extra_params=shared, ep_dp=m.ep_dp,
                                        reshard_after_forward=cand.runtime.reshard_after_forward, offload=offload,
                                        pipelined=m.pp > 1, cross_entropy=cand.runtime.loss_kernel(m.tp),
                                        grad_bytes=cand.runtime.grad_bytes(dtype_bytes(self.dtype)),
                                        boundaries=boundaries, num_microbatches=cand.num_microbatches),
                            offload, ctx.device.name)

    def rank_terms_of(self, cand: Candidate, ctx: RankContext, chunks: Sequence[Sequence[PricedSegment]],
                    shared: int, times: tuple[list[StageTime], list[DataParallelComm]] | None = None,
                    memory: tuple[float, tuple[float, ...]] | None = None) -> _Terms:
        """Terms of one pipeline rank holding `chunks`: `costmodel.estimate.rank_step_terms`, the composition
        `estimate` uses (its halves, when the caller priced them already), plus the memory terms."""
        chunk_times, comms = times or self.chunk_times_of(cand, ctx, chunks)
        mem0, act = memory or self.memory_terms(cand, ctx, chunks, shared)
        setting = RankSetting(ctx.index, ctx.device, ctx.speed, self.framework(ctx.device))
        tail = rank_tail(chunks, chunk_times, comms, shared, self.strategy_of(cand), setting, self.cluster,
                         self.dtype)
        # The contiguous problem's slope: one micro-batch in flight adds its kept bytes (`rank_memory` rounds them).
        mem1 = mem0 + round(act[0]) if len(chunks) == 1 else mem0
        return _Terms(tuple(t.fwd_s for t in chunk_times), tuple(t.bwd_s for t in chunk_times),
                      tuple(t.wgrad_s for t in chunk_times), tail.exposed_end_reduce() + tail.tp_grad_sync_s,
                      tail.shared_sync_s, tail.optimizer_s, tail.post_step_s, mem0, mem1, act)

    def _p2p(self, cand: Candidate, boundary: int, nbytes: float) -> float:
        """`costmodel.estimate.p2p_time`, cached by what the send depends on."""
        if cand.mesh.pp == 1 or nbytes <= 0:
            return 0.0
        m = cand.mesh
        # The pair of a boundary depends on the mesh and on the ranks of its two stages.
        position = (stage_rank(cand.schedule, m.pp, boundary), stage_rank(cand.schedule, m.pp, boundary + 1))
        if position[0] == position[1]:  # the tip of a V: both stages on one rank
            return 0.0
        sig_key = (m, position)
        sig = self._p2p_sig.get(sig_key)
        if sig is None:
            sig = self._p2p_sig[sig_key] = self.group_signature(p2p_group(self.strategy_of(cand), boundary))
        runtime = cand.runtime
        # A scatter/gather send also all-gathers over the receiving rank's tp group.
        gathered = runtime.p2p_scatter_gather and m.tp > 1 and not cand.sequence_parallel
        gather_sig = self.group_signature(tp_group(self.strategy_of(cand), position[1])) if gathered else None
        key = (sig, nbytes, m.tp * m.cp * m.dp, runtime.p2p_blocking, gather_sig)
        if key not in self._p2p_cache:
            self._p2p_cache[key] = p2p_time(self.strategy_of(cand), boundary, nbytes, self.cluster)
        return self._p2p_cache[key]

    def layout(self, cand: Candidate) -> InterleavedLayout | None:
        """The interleaved chunk layouts of the candidate's p and v (cached; None: the chain has none)."""
        key = (cand.mesh.pp, cand.virtual_stages, cand.schedule)
        if key not in self._layouts:
            self._units = self._units or ChainUnits.of(self.chain)
            self._layouts[key] = InterleavedLayout.of(self.chain, *key[:2], units=self._units, schedule=key[2])
        return self._layouts[key]

    def interleaved_sends(self, cand: Candidate, layout: InterleavedLayout,
                          placements: Sequence[RankPlacement]) -> list[float]:
        """Send seconds of each boundary between interleaved chunks, by position: each carries the output of a
        block (unit layouts) or of the fixed chunk's last segment, priced on the sending rank's device."""
        # Neither the ZeRO stage nor the micro-batch count changes a send: candidates share them.
        key = ("interleaved", cand.mesh, cand.schedule, cand.virtual_stages, cand.microbatch_size,
               cand.sequence_parallel, cand.runtime, tuple(pl.device.name for pl in placements))
        hit = self._sends.get(key)
        if hit is None:
            p, n = cand.mesh.pp, cand.mesh.pp * cand.virtual_stages
            costs = {pl.device.name: self.segment_costs(cand, pl.device) for pl in placements}
            last = ([c.stop - 1 for c in layout.fixed] if layout.fixed else [layout.pre] * n)
            # A send depends on its boundary only through the ranks on either side (`_p2p`): with p ranks and
            # v chunks each, n - 1 boundaries have at most 2p pairs.
            by_pair: dict[tuple[int, int, float], float] = {}
            hit = []
            for j in range(n - 1):
                sender = stage_rank(cand.schedule, p, j)
                nbytes = costs[placements[sender].device.name][last[j]].boundary_bytes
                pair = (sender, stage_rank(cand.schedule, p, j + 1), nbytes)
                if pair not in by_pair:
                    by_pair[pair] = self._p2p(cand, j, nbytes)
                hit.append(by_pair[pair])
            self._sends[key] = hit
        return list(hit)

    def contiguous_sends(self, cand: Candidate, placements: Sequence[RankPlacement]) -> list[float]:
        """Per pipeline rank of a contiguous schedule, the least its stage's receive plus send can take: over every
        segment a stage may end with (`_profile_arrays` prices the exact ones)."""
        key = ("contiguous", cand.mesh, cand.schedule, cand.microbatch_size, cand.sequence_parallel, cand.runtime,
               tuple(pl.device.name for pl in placements))
        hit = self._sends.get(key)
        if hit is None:
            p, out = cand.mesh.pp, []
            for k, pl in enumerate(placements):
                sizes = {c.boundary_bytes for c in self.segment_costs(cand, pl.device)[:-1]}
                out.append((min(self._p2p(cand, k - 1, x) for x in sizes) if k > 0 else 0.0)
                           + (min(self._p2p(cand, k, x) for x in sizes) if k < p - 1 else 0.0))
            hit = self._sends[key] = out
        return list(hit)

    # -- problems --------------------------------------------------------------------------------------------
    def build(self, cand: Candidate, options: Sequence[Recompute], upper_bound: float = math.inf,
              partial: bool = False, quick_unfit: bool = False, defer_ties: bool = False
              ) -> StageProblem | Unfit | Beaten | None:
        """The candidate's partition problem, or None when the mesh does not fit the available devices. With
        `partial`, stages may also recompute part of their layers (`planner.search.recompute_choice`).

        With a finite `upper_bound` (seconds), stages that cannot be part of any partition beating it are left
        out unpriced (marked as not fitting): their compute and TP communication alone reach the bound. With
        `quick_unfit`, an interleaved candidate with a rank that fits with no choice is `Unfit`, with a bound on
        the memory it needs, instead of a problem whose partitions all say how much (what `least_memory_of`
        needs for the exact figure), and one whose ranks' least work already reaches `upper_bound` is `Beaten`
        (ranks priced heaviest-first, stopping as soon as the bound is reached). With `defer_ties`, the even split
        that wins an interleaved candidate's ties is solved only on demand (`StageProblem.with_preferred`): most
        candidates have no partition below the bound at all."""
        placements = self.placements(cand)
        if placements is None:
            return None
        if cand.schedule.zero_bubble:  # no recomputation with a split backward (`pipeline.recompute_problem`)
            options = tuple(o for o in options if o is Recompute.NONE) or (Recompute.NONE,)
        choices = search_choices(options, partial)
        if cand.schedule.chunked and (cand.virtual_stages > 1 or cand.schedule is Schedule.INTERLEAVED):
            built = self._build_interleaved(cand, choices, placements, upper_bound, quick_unfit, defer_ties)
        else:
            built = self._build_contiguous(cand, choices, placements, upper_bound)
        if built is None or isinstance(built, Unfit | Beaten):
            return built
        costs = tuple(self.segment_costs(cand, pl.device) for pl in placements)
        return replace(built, rank_costs=costs, classes=self.structure.classes)

    def _build_contiguous(self, cand: Candidate, options: Sequence[RecomputeChoice],
                          placements: tuple[RankPlacement, ...], upper_bound: float) -> StageProblem:
        n, p, m = len(self.chain.segments), cand.mesh.pp, cand.num_microbatches
        gpipe = cand.schedule is Schedule.GPIPE
        contexts = [self.context(cand, k, pl) for k, pl in enumerate(placements)]
        profile, reps = self._stage_profiles(cand, contexts)
        arrays: dict[str, list[np.ndarray]] = {}
        pruned = False
        cheapest = np.min([segment_work(self.segment_costs(cand, pl.device), pl.speed, tp_overlap_chunks(cand),
                                        cand.runtime.tp_grad_overlap)
                           for pl in placements], axis=0)
        total = float(cheapest.sum())
        windows = least_windows(cheapest)
        sends = self.contiguous_sends(cand, placements) if p > 1 else [0.0]
        total += sum(sends)  # every stage receives and sends once per micro-batch
        in_flight = tuple(in_flight_per_chunk(cand.schedule, p, k, m, 1)[0] for k in range(p))
        capacity = tuple(float(pl.device.memory_bytes) for pl in placements)
        for q, k in enumerate(reps):
            # Partial recomputation where recomputing nothing does not fit on the profile's fullest rank.
            fullest = max((in_flight[j], -capacity[j]) for j in range(p) if profile[j] == q)
            terms, cut = self._profile_arrays(cand, k, contexts[k], options, upper_bound, total,
                                              (fullest[0], -fullest[1]), sends[k], windows)
            pruned = pruned or cut
            for name, arr in terms.items():
                arrays.setdefault(name, []).append(arr)
        objective = _gpipe_objective(m) if gpipe else step_objective(cand.schedule, m, 1)
        nu = arrays["bottleneck"][0].shape[-1]
        weights = _gpipe_weights(m) if gpipe else step_weights(cand.schedule, m, 1, nu)
        problem = PartitionProblem(num_segments=n, num_stages=p, options=tuple(o.value for o in options),
                                   stage_profile=tuple(profile), in_flight=in_flight, capacity=capacity,
                                   objective=objective, weights=weights,
                                   **{name: tuple(arrs) for name, arrs in arrays.items()})
        return StageProblem(cand, problem, placements, pruned=pruned)

    def _stage_profiles(self, cand: Candidate, contexts: Sequence[RankContext]) -> tuple[list[int], list[int]]:
        """(the profile of each pipeline rank, the first rank of each profile): ranks in the same position, on
        the same device and speed, with the same sends, share their stage terms."""
        p = cand.mesh.pp
        strategy = self.strategy_of(cand)
        profile_index: dict[tuple, int] = {}
        profile: list[int] = []
        reps: list[int] = []
        for k, ctx in enumerate(contexts):
            key = (stage_kind(k, p), ctx.signature,
                   self.group_signature(p2p_group(strategy, k - 1)) if k > 0 else (),
                   self.group_signature(p2p_group(strategy, k)) if k < p - 1 else ())
            if key not in profile_index:
                profile_index[key] = len(profile_index)
                reps.append(k)
            profile.append(profile_index[key])
        return profile, reps

    def _profile_arrays(self, cand: Candidate, k: int, ctx: RankContext, options: Sequence[RecomputeChoice],
                        upper_bound: float, total: float, fullest: tuple[int, float], least_sends: float = 0.0,
                        windows: np.ndarray | None = None) -> tuple[dict[str, np.ndarray], bool]:
        """The `PartitionProblem` arrays of pipeline rank k's profile (every stage [a, b) it may hold, with
        every recomputation option), and whether the upper bound pruned some stages. A partial recomputation is
        priced only on the stages that do not fit recomputing nothing with `fullest` = (in-flight micro-batches,
        capacity) of the profile's fullest rank: elsewhere recomputing nothing fits and takes less time, and
        with contiguous stages the step never gets longer when a stage gets shorter (`recompute_choice`). Where
        recomputation only adds time (`recompute_only_adds`), every other whole mode is priced on those stages
        alone too.
        `total`: a lower bound on the sum of every stage's forward + backward; `least_sends`: on the profile's
        ranks, on a stage's receive and send; `windows`: `least_windows` of the cheapest rank's segment work."""
        n, p, m = len(self.chain.segments), cand.mesh.pp, cand.num_microbatches
        gpipe, zero_bubble = cand.schedule is Schedule.GPIPE, cand.schedule.zero_bubble
        ns, nu = (2, 4) if gpipe else (1, 3)
        shape = (len(options), n + 1, n + 1)
        kind = stage_kind(k, p)
        costs = self.segment_costs(cand, ctx.device)
        # recv[a]: the send into a stage starting at a (boundary after segment a-1); send[b]: out of one
        # ending at b. Index 0 is never used by a stage that receives.
        sizes = [c.boundary_bytes for c in costs]
        recv = np.array([0.0] + [self._p2p(cand, k - 1, x) if k > 0 else 0.0 for x in sizes])
        send = np.array([0.0] + [self._p2p(cand, k, x) if k < p - 1 else 0.0 for x in sizes])
        # The same boundaries' bytes where the runtime keeps pipeline buffers (`memory.p2p_buffer_bytes`), and
        # the logits the last stage returns (it always ends with the chain).
        buffers = cand.runtime.keeps_p2p_buffers(p)
        boundary = np.array([0.0, *sizes], dtype=float)
        received = boundary if buffers and k > 0 else np.zeros(n + 1)
        sent = boundary if buffers and k < p - 1 else np.zeros(n + 1)
        returned = np.zeros(n + 1)
        if buffers and k == p - 1 and cand.runtime.pp_returns_outputs:
            returned[n] = returned_bytes(sum(c.loss_elements for c in costs), self.dtype)
        additive, bottleneck = np.zeros(shape + (ns,)), np.zeros(shape + (nu,))
        tail, tail_const, drain, per_microbatch = (np.zeros(shape) for _ in range(4))
        memory_base = np.full(shape, np.inf)  # a stage left unpriced never fits
        # Lower bounds: this stage's compute + TP communication at its own speed, and the whole chain's at
        # the cheapest rank (another rank may be faster than this one).
        prefix = np.concatenate([[0.0], np.cumsum(segment_work(costs, ctx.speed, tp_overlap_chunks(cand),
                                                                  cand.runtime.tp_grad_overlap))])
        pruned = False
        kept: list[tuple[tuple[int, ...], int, int, np.ndarray, np.ndarray]] = []
        for (comp, a0, b0, aa, bb), shape_mask in zip(self.structure.compositions(), self._shape_masks(kind, p),
                                                      strict=True):
            keep = shape_mask.copy()
            if math.isfinite(upper_bound):
                # A stage's f + b is at least its compute and TP communication, and the bottleneck stage
                # costs (m - 1) times that on top of the total (m times it, with a zero-bubble schedule's fill
                # and drain, which can be less than the total): stages that alone reach the bound are useless.
                # So are stages so short that the p - 1 others, holding the rest, must reach it: one of them
                # holds at least ceil((n - len) / (p - 1)) segments.
                stage = prefix[bb] - prefix[aa] + least_sends
                if windows is not None and p > 1:
                    stage = np.maximum(stage, windows[-(-(n - (bb - aa)) // (p - 1))])
                useful = (m * stage if zero_bubble else total + (m - 1) * stage) < upper_bound
                pruned = pruned or bool((keep & ~useful).any())
                keep &= useful
            if keep.any():
                kept.append((comp, a0, b0, aa[keep], bb[keep]))
        if not kept:
            return {"additive": additive, "bottleneck": bottleneck, "memory_base": memory_base,
                    "memory_per_microbatch": per_microbatch, "tail": tail, "tail_const": tail_const,
                    "drain": drain}, pruned
        # All the stages of every kept composition at once: each composition's terms repeated over its ranges
        # (the ranges of different compositions never overlap).
        everywhere = kept
        plain = options.index(NO_RECOMPUTE) if NO_RECOMPUTE in options else None
        dominated = recompute_only_adds(cand)
        for r, rc in enumerate(options):
            kept = everywhere
            if plain is not None and r > plain and (rc.partial or dominated):
                need = memory_base[plain] + fullest[0] * per_microbatch[plain]
                kept = [(comp, a0, b0, aa[over], bb[over]) for comp, a0, b0, aa, bb in everywhere
                        for over in [need[aa, bb] > fullest[1]] if over.any()]
            if not kept:
                continue
            lengths = [len(aa) for _, _, _, aa, _ in kept]
            aa, bb = np.concatenate([x[3] for x in kept]), np.concatenate([x[4] for x in kept])
            terms = [self._composition_terms(cand, ctx, costs, rc, comp, a0, b0) for comp, a0, b0, _, _ in kept]

            def column(values: list[float], lengths: list[int] = lengths) -> np.ndarray:
                return np.repeat(np.array(values, dtype=float), lengths)

            fwd = column([t.fwd[0] for t in terms]) + recv[aa]   # the send into this stage delays its forward
            bwd = column([t.bwd[0] for t in terms]) + send[bb]   # the gradient coming back delays its backward
            s, u = _pipeline_terms(cand.schedule, m, fwd, bwd, column([t.wgrad[0] for t in terms]),
                                   column([t.post for t in terms]), column([t.optimizer for t in terms]))
            additive[r, aa, bb], bottleneck[r, aa, bb] = s, u
            memory0 = column([t.memory0 for t in terms])
            memory_base[r, aa, bb] = memory0 + m * (received[aa] + sent[bb] + returned[bb])
            per_microbatch[r, aa, bb] = column([t.memory1 for t in terms]) - memory0 + sent[bb] - received[aa]
            tail[r, aa, bb] = column([t.tail for t in terms])
            tail_const[r, aa, bb] = column([t.tail_const for t in terms])
            # The drain behind it: its backward and the send (none: W fills it, `pipeline.drain_slack`).
            drain[r, aa, bb] = 0.0 if zero_bubble else bwd
        return {"additive": additive, "bottleneck": bottleneck, "memory_base": memory_base,
                "memory_per_microbatch": per_microbatch, "tail": tail, "tail_const": tail_const,
                "drain": drain}, pruned

    def _shape_masks(self, kind: StageKind, p: int) -> list[np.ndarray]:
        """`_stage_shape_mask` of every composition's ranges, per (kind, p) (cached: candidates share them)."""
        key = (kind, p)
        if key not in self._masks:
            n = len(self.chain.segments)
            self._masks[key] = [_stage_shape_mask(kind, aa, bb, n, p) for _, _, _, aa, bb in
                                self.structure.compositions()]
        return self._masks[key]

    def _composition_terms(self, cand: Candidate, ctx: RankContext, costs: Sequence[LayerCost],
                           rc: RecomputeChoice, comp: tuple[int, ...], a0: int, b0: int) -> _Terms:
        """The terms of a stage holding the class composition `comp` (first seen as segments [a0, b0)) with
        recomputation `rc` on this rank, priced once per (rank signature, rc, composition)."""
        cache_key = (ctx.signature, rc, comp)
        t = self.terms.get(cache_key)
        if t is None:
            segs = rc.priced(costs[a0:b0], self.structure.classes[a0:b0])
            shared = -(-self.structure.shared_params(a0, b0) // cand.mesh.tp)
            t = self.terms[cache_key] = self.rank_terms_of(cand, ctx, [segs], shared)
        return t

    def _build_interleaved(self, cand: Candidate, options: Sequence[RecomputeChoice],
                           placements: tuple[RankPlacement, ...], upper_bound: float, quick_unfit: bool = False,
                           defer_ties: bool = False) -> StageProblem | Unfit | Beaten | None:
        m = cand.num_microbatches
        layout = self.layout(cand)
        if layout is None:
            return None
        sends = self.interleaved_sends(cand, layout, placements)
        chooser = ChoicePricer(self, cand, layout, placements, sends, upper_bound)
        overlap = cand.runtime.p2p_overlap
        capacity = tuple(float(pl.device.memory_bytes) for pl in placements)
        by_extra: list[tuple[float, ...]] = [(0.0,) * (cand.virtual_stages + 1)] * cand.mesh.pp

        def beaten() -> float | None:
            """The bound from the least work of each rank per count of larger chunks (ranks not priced yet at 0:
            still a lower bound), when it reaches `upper_bound`; inf (no layout fits) is left to the full problem,
            whose partitions say how much memory is missing."""
            bound = least_step_time_by_extra(cand.schedule, m, cand.virtual_stages, layout.extra, by_extra)
            return bound if math.isfinite(bound) and bound > upper_bound * (1 + 1e-9) else None

        for k in _heaviest_first(cand.mesh.pp):
            by_extra[k] = chooser.least_work(k, options)
            if not quick_unfit:
                continue
            if not math.isfinite(min(by_extra[k])):
                return Unfit(chooser.least_peaks[k])
            if (bound := beaten()) is not None:
                return Beaten(bound)
        least = [min(row) for row in by_extra]
        if not all(math.isfinite(x) for x in least):  # some rank fits with no choice: the memory alone says why
            problem = interleaved_problem(layout, options, chooser.memory_only, sends, capacity, m,
                                          choices=chooser.choices, p2p_overlap=overlap)
            return StageProblem(cand, problem, placements, layout=layout)
        if beaten() is not None:
            problem = interleaved_problem(layout, options, None, sends, capacity, m, p2p_overlap=overlap)
            return StageProblem(cand, problem, placements, layout=layout, pruned=True)
        chooser.set_least_work(least)

        def problem(preferred: tuple[StageChoice, ...] | None = None) -> PartitionProblem:
            return interleaved_problem(layout, options, chooser.price, sends, capacity, m, preferred=preferred,
                                       choices=chooser.choices, p2p_overlap=overlap)

        def with_preferred() -> PartitionProblem:
            # Ties go to the even split (what an estimate without stages prices): its best recomputation first.
            even, preferred = layout.even_picks(), None
            if even is not None:
                best = solve_partition(interleaved_problem(layout, options, chooser.price, sends, capacity, m,
                                                           only=even, choices=chooser.choices,
                                                           p2p_overlap=overlap))
                preferred = best.stages if best is not None else None
            return problem(preferred)

        if defer_ties:
            plain = problem()
            return StageProblem(cand, plain, placements, layout=layout, pruned=chooser.pruned,
                                with_preferred=with_preferred)
        return StageProblem(cand, with_preferred(), placements, layout=layout, pruned=chooser.pruned)



def least_windows(work: np.ndarray) -> np.ndarray:
    """Per length L = 0..n, the least total of `work` over any L consecutive segments."""
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    n = len(work)
    return np.array([0.0] + [float(np.min(prefix[length:] - prefix[:n + 1 - length])) for length in range(1, n + 1)])


def _heaviest_first(pp: int) -> list[int]:
    """Pipeline ranks in the order `_build_interleaved` prices them: the first (the most micro-batches in flight,
    so the most recomputation forced on it) and the last (the head and the loss) before the middle ones."""
    return [0, *([pp - 1] if pp > 1 else []), *range(1, pp - 1)]


def _pipeline_terms(schedule: Schedule, m: int, fwd: np.ndarray, bwd: np.ndarray, wgrad: np.ndarray,
                    post: np.ndarray, opt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(additive, bottleneck) columns of contiguous stages with these forward / backward seconds (sends
    included) and weight-gradient, post-step and optimizer seconds: GPipe (F, B | F, B, post, opt); 1F1B (F + B
    | F + B, post, opt); a zero-bubble schedule with one chunk (E_r | m D_r - E_r, post, opt;
    `pipeline.zero_bubble_fill`)."""
    if schedule is Schedule.GPIPE:
        return np.stack([fwd, bwd], axis=-1), np.stack([fwd, bwd, post, opt], axis=-1)
    if schedule.zero_bubble:
        fill = np.array([zero_bubble_fill(schedule, x, y - w, w) for x, y, w in zip(fwd, bwd, wgrad, strict=True)])
        return fill[:, None], np.stack([m * (fwd + bwd) - fill, post, opt], axis=-1)
    return (fwd + bwd)[:, None], np.stack([fwd + bwd, post, opt], axis=-1)


def segment_work(costs: Sequence[LayerCost], speed: float, tp_overlap_chunks: int = 0,
                 tp_grad_overlap: bool = False) -> np.ndarray:
    """Per segment: (forward + backward compute) / speed + the forward and backward TP communication left exposed
    (`step_time.tp_exposed` / `tp_bwd_exposed`: all of it unless the runtime overlaps it), seconds."""
    n = tp_overlap_chunks
    return np.array([(c.fwd_compute_s + c.bwd_compute_s) / speed + tp_exposed(c.fwd_comm_s, c.fwd_compute_s / speed, n)
                     + tp_bwd_exposed(c, c.bwd_compute_s / speed, n, tp_grad_overlap) for c in costs])


def recompute_only_adds(cand: Candidate) -> bool:
    """Whether, on a contiguous stage where recomputing nothing fits, every other mode gives a step at least as
    long. Recomputing r seconds lengthens the stage's backward by r, so the step's sum grows by r, while the
    end-of-step reduction it hides (its own, by a window r longer, or a later stage's, by a drain r longer)
    shrinks by at most r. That holds unless the longer backward also hides collectives or copies issued every
    micro-batch: ZeRO-2/3 gathers and reduce-scatters, parameter-offload copies (`step_time.data_parallel_comm`)."""
    return cand.zero_stage <= 1 and cand.runtime.offload is not Offload.PARAMS


def tp_overlap_chunks(cand: Candidate) -> int:
    """Chunks tensor-parallel communication is overlapped in (`RuntimeOptions.tp_overlap`), 0 for none."""
    return cand.mesh.tp if cand.runtime.tp_overlap else 0


def _stage_shape_mask(kind: StageKind, aa: np.ndarray, bb: np.ndarray, n: int, p: int) -> np.ndarray:
    """Which ranges [a, b) can be a stage of `kind`: the first starts at 0, the last ends at n, and every stage
    leaves at least one segment to each of the others."""
    keep = (bb - aa) <= n - p + 1
    if kind in (StageKind.FIRST, StageKind.ONLY):
        keep &= aa == 0
    if kind in (StageKind.LAST, StageKind.ONLY):
        keep &= bb == n
    if kind in (StageKind.MIDDLE, StageKind.LAST):
        keep &= aa >= 1
    if kind in (StageKind.FIRST, StageKind.MIDDLE):
        keep &= bb <= n - 1
    return keep


def _gpipe_objective(m: int):
    """T = (sum F + (m-1) max F) + (sum B + (m-1) max B) + U_post + U_opt + tail."""
    def phi(s, u):
        return s[0] + (m - 1) * u[0] + s[1] + (m - 1) * u[1] + u[2] + u[3] + u[4]
    return phi


def _gpipe_weights(m: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`_gpipe_objective` as the linear form of `PartitionProblem.weights`."""
    return (1.0, 1.0), (m - 1.0, m - 1.0, 1.0, 1.0, 1.0)
