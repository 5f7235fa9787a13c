"""The branch and bound's lower bounds on one candidate, with the caches that let thousands of candidates share
their pieces: level 1 (`cheap`: tp == 1 prices, or the candidate's tp prices once the search has them, no sharding
solve of its own, and whether the parameter state alone fits) and level 2 (`tight`: the candidate's own layer
prices). The formulas are `planner.search.bounds`'; this module gathers what they need from the stage-problem
builder and the cost model, once per distinct key."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from costmodel.context_parallel import ring_attention_s
from costmodel.estimate import optimizer_terms
from costmodel.expert_parallel import expert_param_numel, num_experts, optimizer_params
from costmodel.expert_parallel import model_state_bytes as expert_state_bytes
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.memory import PricedSegment, framework_overhead_bytes, kept_bytes, saved_bytes, transient_bytes
from costmodel.pipeline import in_flight_per_chunk
from costmodel.step_time import optimizer_step_time, tp_exposed
from costmodel.strategy import CrossEntropy, MeshAxis, Offload, Recompute
from ir.graph import dtype_bytes
from ir.layer_chain import LayerChain
from planner.search.bounds import (
    PipelineBound,
    cheap_lower_bound,
    comm_lower_bound,
    end_reduce_lower_bound,
    tight_lower_bound,
)
from planner.search.candidates import Candidate, MeshOptions
from planner.search.end_reduce_floors import EndReduceFloors
from planner.search.layer_costs import AxisSplit
from planner.search.meshes import MeshCandidate
from planner.search.stage_problem import RankPlacement, StageProblemBuilder, segment_work, tp_overlap_chunks


@dataclass(frozen=True, slots=True)
class _PlacementFacts:
    """What the bounds read of one placements tuple (`CandidateBounds._placement_facts`)."""

    kinds: tuple[tuple[DeviceSpec, float], ...]
    """The distinct (device, speed) of the pipeline ranks."""
    order: int
    """An id of the ranks' (device name, speed) in rank order: a key part hashed once, not per candidate."""
    fastest: RankPlacement


@dataclass
class CandidateBounds:
    chain: LayerChain
    dtype: str
    builder: StageProblemBuilder
    _memory_need: dict[tuple, float] = field(default_factory=dict)
    _replicated: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    _optimizer: dict[tuple, float] = field(default_factory=dict)
    _pipeline_bound: dict[tuple, PipelineBound] = field(default_factory=dict)
    _least_saved: dict[tuple, tuple[tuple, int]] = field(default_factory=dict)
    _comm: dict[tuple, np.ndarray | None] = field(default_factory=dict)
    _comm_bound: dict[tuple, float] = field(default_factory=dict)
    _least_saved_on_cache: dict[tuple, tuple[tuple, int]] = field(default_factory=dict)
    _segment_loads_cache: dict[tuple, tuple[tuple, list]] = field(default_factory=dict)
    _heaviest: dict[tuple, tuple[tuple, float]] = field(default_factory=dict)
    _state: dict[tuple, float] = field(default_factory=dict)
    _in_flight_shapes: dict[tuple, tuple[int, int, float]] = field(default_factory=dict)
    _expert_numel: int | None = None
    _placement_kinds: dict[int, tuple[tuple[RankPlacement, ...], _PlacementFacts]] = field(default_factory=dict)
    _orders: dict[tuple, int] = field(default_factory=dict)
    _work: dict[tuple, tuple[Sequence[LayerCost], np.ndarray]] = field(default_factory=dict)
    _all_to_all: dict[tuple, float] = field(default_factory=dict)
    _shape: dict[tuple, tuple[PipelineBound, bool]] = field(default_factory=dict)
    _sharded: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    end_reduce: EndReduceFloors = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.end_reduce = EndReduceFloors(self.builder, self.dtype, lambda m: self._even_params(m, floor=True))

    def cheap(self, cand: Candidate) -> tuple[float, float | None]:
        """(level-1 lower bound on the candidate's step time from tp == 1 prices, no sharding solve; None, or
        the bytes its parameter state needs when that alone cannot fit -- the bound is then inf).

        The bound is a part from the candidate's shape (`Shape`: micro-batching and schedule) -- or, where larger,
        the same shape with the end-of-step gradient reduction of an even parameter split
        (`bounds.end_reduce_lower_bound`, `EndReduceFloors.even_floor`) -- plus the optimizer step of its setting
        (ZeRO stage and offload), each cached: sequence parallelism is in none, and `mesh_floor` takes the least."""
        placements = self.builder.placements(cand)
        if placements is None:
            return math.inf, None
        need = self.state_need(cand, placements)
        if need is not None:
            return math.inf, need
        pipe = self.shape_bound(cand, placements)
        tail = end_reduce_lower_bound(cand, pipe, self.end_reduce.even_floor(cand, placements))
        return max(pipe.value, tail) + self.optimizer_bound(cand, placements), None

    def mesh_floor(self, options: MeshOptions) -> tuple[float, float | None]:
        """(the least `cheap` bound of the mesh's candidates, computed from its shapes and settings without listing
        them; None, or the least bytes needed by the parameter state of those that do not fit, which the search
        records for the mesh as their own bounds would)."""
        mesh, best, least_need = options.mesh, math.inf, math.inf
        # Per (placements, pairs with ZeRO-3): the (end-of-step reduction, optimizer step) of the settings that fit,
        # those no other beats in both.
        floors: dict[tuple[int, bool], list[tuple[float, float]]] = {}
        for shape in options.shapes:
            pairs, settings = options.pairs(shape), options.settings_of(shape)
            if not settings:
                continue
            rep = Candidate(mesh, *shape, *settings[0])
            placements = self.builder.placements(rep)
            if placements is None:
                return math.inf, None
            key = (id(placements), pairs)
            if key not in floors:
                terms = set()
                for zero, _, runtime in settings:
                    cand = Candidate(mesh, *shape, zero, False, runtime)
                    need = self.state_need(cand, placements)
                    if need is None:
                        terms.add((self.end_reduce.even_floor(cand, placements),
                                   self.optimizer_bound(cand, placements)))
                    else:
                        least_need = min(least_need, need)
                floors[key] = [t for t in terms if not any(o != t and o[0] <= t[0] and o[1] <= t[1] for o in terms)]
            pipe = self.shape_bound(rep, placements) if floors[key] else None
            for reduce_s, optimizer_s in floors[key]:
                best = min(best, max(pipe.value, end_reduce_lower_bound(rep, pipe, reduce_s)) + optimizer_s)
        return best, (least_need if math.isfinite(least_need) else None)

    def state_need(self, cand: Candidate, placements: tuple[RankPlacement, ...]) -> float | None:
        """None when the candidate's parameter state (and the framework's overhead) fits on its largest device,
        else the bytes it needs (cached by what it depends on)."""
        m = cand.mesh
        grads = cand.runtime.grad_bytes(dtype_bytes(self.dtype))
        key = (m.tp * m.pp, m.dp * m.cp, m.ep, m.ep_dp, cand.zero_stage, cand.runtime.offload, grads)
        need = self._memory_need.get(key)
        if need is None:
            # Experts split over ep hold 1/ep of their weights, ZeRO-sharded over dp*cp/ep_dp ranks.
            even, even_experts = self._even_params(m)
            state = expert_state_bytes(even, even_experts, zero_stage=cand.zero_stage, dp_size=m.dp * m.cp,
                                       ep_dp=m.ep_dp, dtype=self.dtype, offload=cand.runtime.offload,
                                       grad_bytes=grads).total
            need = self._memory_need[key] = state + framework_overhead_bytes(placements[0].device.name)
        kinds = self._kinds(placements)
        return need if need > max(device.memory_bytes for device, _ in kinds) else None

    def shape_bound(self, cand: Candidate, placements: tuple[RankPlacement, ...]) -> PipelineBound:
        """`bounds.cheap_lower_bound` without the optimizer step: what the candidate's shape, mesh and placements
        decide (cached; the runtime enters only through tensor-parallel overlap).

        Once the search has priced the candidate's tp (both sequence-parallel settings: the bound holds for
        either), a rank's work per micro-batch is at least the least of their sums of compute and exposed TP
        communication (`_sharded_work`), which is far above the tp = 1 time over tp where tensor parallelism
        scales badly (MoE layers at tp = 8: 5x). A bound cached before those prices existed is recomputed when
        they do: the candidates of meshes listed later get it, and so does a candidate popped at level 1, which
        goes back in at it when it has grown (`SearchState.process`)."""
        key = (self._placement_facts(placements).order, cand.mesh, cand.microbatch_size, cand.num_microbatches,
               cand.schedule, cand.virtual_stages, tp_overlap_chunks(cand))
        hit = self._shape.get(key)
        if hit is not None and hit[1]:
            return hit[0]
        sharded = self._sharded_priced(cand, placements)
        if hit is None or sharded:
            kinds = self._kinds(placements)
            totals, forwards = [], []
            for device, speed in kinds:
                t, f = self._replicated_total(device, cand.microbatch_size, cand.mesh.cp)
                work, work_forward = self._sharded_work(cand, device, speed) if sharded else (0.0, 0.0)
                # cheap_lower_bound divides by tp (cp is 1 here): tp times the rank's work holds its bound.
                totals.append(max(t / speed, cand.mesh.tp * work))
                forwards.append(max(f / speed, cand.mesh.tp * work_forward))
            comm, comm_forward = self._all_to_all_floor(cand, kinds)
            complete = sharded or cand.mesh.tp == 1 or cand.mesh.cp > 1
            hit = self._shape[key] = (cheap_lower_bound(cand, min(totals), optimizer_s=0.0, forward_s=min(forwards),
                                                        comm_s=comm, comm_forward_s=comm_forward), complete)
        return hit[0]

    def _sharded_priced(self, cand: Candidate, placements: tuple[RankPlacement, ...]) -> bool:
        """Whether the layer classes are priced at the candidate's tp, with and without sequence parallelism, on
        every device type of its ranks (cp == 1: a context-parallel rank's prices are another table's)."""
        m = cand.mesh
        if m.tp == 1 or m.cp > 1:
            return False
        table, stride = self.builder.table, m.stride(MeshAxis.TP)
        return all(table.is_cached(device, tp=m.tp, tp_stride=stride, sequence_parallel=sp,
                                   microbatch_size=cand.microbatch_size)
                   for device, _ in self._kinds(placements) for sp in (False, True))

    def _sharded_work(self, cand: Candidate, device: DeviceSpec, speed: float) -> tuple[float, float]:
        """(forward + backward, forward) work of one micro-batch of the whole chain on a tp rank of `device` at
        `speed`: compute and the TP communication left exposed (weight-gradient overlap assumed, which only
        hides more), the least over sequence parallelism; routed experts at their price below every ep
        (`LayerCostTable.segment_costs` without a split), their all-to-alls left to `_all_to_all_floor`."""
        m, n = cand.mesh, tp_overlap_chunks(cand)
        key = (device.name, speed, m.tp, m.stride(MeshAxis.TP), cand.microbatch_size, n)
        hit = self._sharded.get(key)
        if hit is None:
            table, sums = self.builder.table, []
            for sp in (False, True):
                costs = table.segment_costs(device, tp=m.tp, tp_stride=m.stride(MeshAxis.TP), sequence_parallel=sp,
                                            microbatch_size=cand.microbatch_size)
                forward = sum(c.fwd_compute_s / speed + tp_exposed(c.fwd_comm_s, c.fwd_compute_s / speed, n)
                              for c in costs)
                sums.append((float(segment_work(costs, speed, n, True).sum()), forward))
            hit = self._sharded[key] = (min(t for t, _ in sums), min(f for _, f in sums))
        return hit

    def _all_to_all_floor(self, cand: Candidate, kinds: tuple[tuple[DeviceSpec, float], ...]) -> tuple[float, float]:
        """(the expert all-to-alls of one micro-batch of the whole chain, their forward part) below the candidate's
        own, without solving its sharding: priced at tp = 1 on the candidate's expert-parallel group, then / tp
        (tp ranks that split the expert slots send 1/tp of the payload each, and a collective's time is at least
        its bytes' share: its latency does not shrink). (0, 0) without ep, or where tensor-parallel overlap may
        hide part of it (`step_time.tp_exposed`)."""
        m = cand.mesh
        if m.ep == 1 or tp_overlap_chunks(cand) > 1:
            return 0.0, 0.0
        split = AxisSplit(cp=m.cp, cp_stride=m.stride(MeshAxis.CP), ep=m.ep, ep_stride=m.stride(MeshAxis.EP),
                          num_devices=m.num_devices)
        key = (tuple(device.name for device, _ in kinds), cand.microbatch_size, split)
        hit = self._all_to_all.get(key)
        if hit is None:
            table = self.builder.table
            # LayerCost.ep_comm_s is a segment's forward all-to-alls (dispatch and combine); its backward repeats them.
            hit = self._all_to_all[key] = min(sum(c.ep_comm_s for c in table.segment_costs(
                device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=cand.microbatch_size,
                split=split)) for device, _ in kinds)
        return 2 * hit / m.tp, hit / m.tp

    def _kinds(self, placements: tuple[RankPlacement, ...]) -> tuple[tuple[DeviceSpec, float], ...]:
        return self._placement_facts(placements).kinds

    def _placement_facts(self, placements: tuple[RankPlacement, ...]) -> _PlacementFacts:
        """Cached per placements, which the builder keeps: tens of thousands of candidates share a few hundred, of
        up to hundreds of ranks each."""
        hit = self._placement_kinds.get(id(placements))
        if hit is None or hit[0] is not placements:
            # By the whole device: two groups of one type may differ in memory (a partitioned or capped GPU).
            kinds = tuple({(id(pl.device), pl.speed): (pl.device, pl.speed) for pl in placements}.values())
            order = self._orders.setdefault(tuple((pl.device.name, pl.speed) for pl in placements), len(self._orders))
            hit = self._placement_kinds[id(placements)] = (placements, _PlacementFacts(
                kinds, order, max(placements, key=lambda pl: pl.speed)))
        return hit[1]

    def memory_floor(self, cand: Candidate, options: Sequence[Recompute]) -> float:
        """A lower bound on the peak bytes of the candidate's fullest pipeline rank, over every partition and
        every per-stage choice among `options` (none but no recomputation under a split backward); what offload
        moves to the host is not counted.

        Rank k holds `O + s_k + sum_j n_kj a_kj` (framework overhead, model state, and per chunk its in-flight
        micro-batches times the bytes one saves; `memory.rank_memory` adds only non-negative terms to this).
        With ``n_k`` the least in-flight count of rank k's chunks, every rank within M means
        ``a_k <= (M - O - s_k) / n_k``; summed over the ranks, with ``sum_k a_k >= A`` (each segment at its
        least-saving option) and ``sum_k s_k >= S`` (the state of an even split, p times), that is
        ``M >= O + (A + S / max_k n_k) / sum_k (1 / n_k)``; and the loads sum to at least ``S + A min_k n_k``,
        so the fullest rank holds at least ``O + (S + A min_k n_k) / p``. And the rank running a segment holds at
        least ``O + min_r (min_k n_k a_sr + e_sr) + t_s``: under each option r what it keeps, a_sr, for that many
        micro-batches and what its recomputation rematerializes, e_sr, and its transient buffer t_s
        (`memory.transient_bytes`); for the last segment the loss's, which is what binds first at long sequences
        over a large vocabulary."""
        placements = self.builder.placements(cand)
        if placements is None:
            return 0.0
        least, most, inverse_sum = self._in_flight_shape(cand)
        allowed = (Recompute.NONE,) if cand.schedule.zero_bubble else tuple(options)
        heaviest = self._heaviest_segment_on(cand, placements, allowed, max(least, 0))
        if least < 1:
            return self._overhead(placements) + heaviest
        saved = self._least_saved_on(cand, placements, allowed)
        state = self._state_floor(cand)
        # Also the average rank: the loads sum to at least S + min_k n_k * A.
        return self._overhead(placements) + max((saved + state / most) / inverse_sum,
                                                (state + least * saved) / cand.mesh.pp, heaviest)

    def _in_flight_shape(self, cand: Candidate) -> tuple[int, int, float]:
        """(min_k n_k, max_k n_k, sum_k 1 / n_k) over the pipeline ranks, n_k the least in-flight micro-batch
        count of rank k's chunks (cached per schedule shape; the sum is 0 where some n_k is 0, and then unused)."""
        v = cand.virtual_stages if cand.schedule.chunked else 1
        key = (cand.schedule, cand.mesh.pp, cand.num_microbatches, v)
        hit = self._in_flight_shapes.get(key)
        if hit is None:
            counts = [min(in_flight_per_chunk(cand.schedule, cand.mesh.pp, k, cand.num_microbatches, v))
                      for k in range(cand.mesh.pp)]
            least = min(counts)
            hit = self._in_flight_shapes[key] = (least, max(counts), sum(1 / n for n in counts) if least >= 1 else 0.0)
        return hit

    def _least_saved_on(self, cand: Candidate, placements: tuple[RankPlacement, ...],
                        allowed: tuple[Recompute, ...]) -> int:
        """`_least_saved_bytes` on the cheapest device type of the candidate's ranks (cached per mesh, micro-batch,
        sequence parallelism and placements: the candidates of one mesh share a few)."""
        key = (cand.mesh, cand.sequence_parallel, cand.microbatch_size, id(placements), allowed)
        hit = self._least_saved_on_cache.get(key)
        if hit is None or hit[0] is not placements:
            saved = min(self._least_saved_bytes(self.builder.segment_costs(cand, device), allowed)
                        for device, _ in self._kinds(placements))
            hit = self._least_saved_on_cache[key] = (placements, saved)
        return hit[1]

    def _heaviest_segment_on(self, cand: Candidate, placements: tuple[RankPlacement, ...],
                             allowed: tuple[Recompute, ...], in_flight: int) -> float:
        """max over segments of what the rank running it holds at least besides the framework: per recomputation
        option, `in_flight` micro-batches of what the segment keeps plus what its backward rematerializes at once
        (`memory.rank_memory`'s temporary bytes), the least over the options, plus its transient buffer; on the
        cheapest device type of the candidate's ranks."""
        return min(self._heaviest_segment(self.builder.segment_costs(cand, device), allowed,
                                          cand.runtime.loss_kernel(cand.mesh.tp), in_flight)
                   for device, _ in self._kinds(placements))

    def _heaviest_segment(self, costs: tuple, allowed: tuple[Recompute, ...], ce: CrossEntropy,
                          in_flight: int) -> float:
        key = (id(costs), allowed, ce, in_flight)
        hit = self._heaviest.get(key)
        if hit is None or hit[0] is not costs:
            most = max(min(in_flight * kept + remat for kept, remat in options) + transient
                       for options, transient in self._segment_loads(costs, allowed, ce))
            hit = self._heaviest[key] = (costs, most)
        return hit[1]

    def _segment_loads(self, costs: tuple, allowed: tuple[Recompute, ...], ce: CrossEntropy
                       ) -> list[tuple[list[tuple[float, int]], float]]:
        """Per distinct segment cost of a table (a layer class's segments share one): per option (kept bytes,
        rematerialized bytes), and its transient bytes (cached per table, which the builder keeps alive)."""
        key = (id(costs), allowed, ce)
        hit = self._segment_loads_cache.get(key)
        if hit is None or hit[0] is not costs:
            distinct = {id(c): c for c in costs}.values()
            loads = [([(kept_bytes(c, rc, ce, self.dtype), c.saved_bytes_none - saved_bytes(c, rc)) for rc in allowed],
                      transient_bytes(c, self.dtype, ce)) for c in distinct]
            hit = self._segment_loads_cache[key] = (costs, loads)
        return hit[1]

    def _state_floor(self, cand: Candidate) -> float:
        """The model state of p even shares (`_state_per_param_share`), cached per what it depends on."""
        m, runtime = cand.mesh, cand.runtime
        key = (m, cand.zero_stage, runtime.offload, runtime.reshard_after_forward, runtime.grads_in_training_dtype)
        hit = self._state.get(key)
        if hit is None:
            total, experts = self._even_params(m, floor=True)
            hit = self._state[key] = m.pp * self._state_per_param_share(cand, total, experts)
        return hit

    def _overhead(self, placements: tuple[RankPlacement, ...]) -> int:
        """The least framework overhead over the ranks' device types."""
        return min(framework_overhead_bytes(device.name) for device, _ in self._kinds(placements))

    def _least_saved_bytes(self, costs: tuple, allowed: tuple[Recompute, ...]) -> int:
        """Activation bytes of one micro-batch of the whole chain, each segment at its least-saving option (cached
        per segment-cost table, which the builder keeps alive and reuses)."""
        key = (id(costs), allowed)
        hit = self._least_saved.get(key)
        if hit is None or hit[0] is not costs:
            hit = self._least_saved[key] = (costs, sum(min(saved_bytes(c, rc) for rc in allowed) for c in costs))
        return hit[1]

    def _state_per_param_share(self, cand: Candidate, params: int, experts: int) -> float:
        """The bytes `memory.rank_memory` charges in proportion to a rank's parameters (model state, as pipelining
        keeps it, and ZeRO-3 weights kept gathered), for `params` of which `experts` are expert weights."""
        m, offload = cand.mesh, cand.runtime.offload
        pipelined = m.pp > 1 and offload is not Offload.PARAMS
        state = expert_state_bytes(params, experts, zero_stage=cand.zero_stage, dp_size=m.dp * m.cp, ep_dp=m.ep_dp,
                                   dtype=self.dtype, offload=offload, pipelined=pipelined,
                                   grad_bytes=cand.runtime.grad_bytes(dtype_bytes(self.dtype))).total
        if cand.zero_stage >= 3 and (pipelined or not cand.runtime.reshard_after_forward):
            state += params * dtype_bytes(self.dtype)
        return state

    def _replicated_total(self, device: DeviceSpec, mbs: int, cp: int = 1) -> tuple[float, float]:
        """(forward + backward, forward) compute of one micro-batch of the whole chain on one `device`; for cp > 1
        with its attention as cp ranks run it at tp 1 (`context_parallel.ring_attention_s`, times cp), so that
        1/(tp cp) of it stays below a rank's compute (the ring's blocks only shrink with tp)."""
        key = (device.name, mbs, cp)
        if key not in self._replicated:
            table = self.builder.table
            costs = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=mbs)
            total = sum(c.fwd_compute_s + c.bwd_compute_s for c in costs)
            forward = sum(c.fwd_compute_s for c in costs)
            if cp > 1:
                scale = mbs / self.chain.graph.batch_size
                per_class = {cid: ring_attention_s(self.chain.nodes_of(self.chain.representative(cid)), device,
                                                   scale=scale, cp=cp, dtype=table.dtype, profile=table.profile)
                             for cid in {s.class_id for s in self.chain.segments}}
                for s in self.chain.segments:
                    (one_f, one_b), (ring_f, ring_b) = per_class[s.class_id]
                    total += cp * (ring_f + ring_b) - (one_f + one_b)
                    forward += cp * ring_f - one_f
            self._replicated[key] = (total, forward)
        return self._replicated[key]

    def expert_numel(self) -> int:
        """Expert weights in the model, counted once per search (a pass over every graph node)."""
        if self._expert_numel is None:
            nodes = self.chain.graph.nodes
            self._expert_numel = expert_param_numel(nodes, num_experts(nodes) or 0)
        return self._expert_numel

    def _even_params(self, m: MeshCandidate, *, floor: bool = False) -> tuple[int, int]:
        """(parameters, of which expert weights) on a rank holding an even 1/(tp*pp) share, experts split ep ways:
        the fullest rank holds at least that; with `floor`, p such shares hold at most the model's."""
        experts = self.expert_numel()
        local_experts = -(-experts // m.ep) if m.ep > 1 else 0
        total = self.chain.graph.param_count - experts + local_experts if m.ep > 1 else self.chain.graph.param_count
        share = total // (m.tp * m.pp) if floor else -(-total // (m.tp * m.pp))
        return share, local_experts // (m.tp * m.pp)

    def optimizer_bound(self, cand: Candidate, placements: Sequence[RankPlacement]) -> float:
        """The optimizer step of the fullest rank is at least that of an even split of the parameters."""
        m = cand.mesh
        fastest = self._placement_facts(placements).fastest
        # The speed is in the key: where devices share host cores it changes with the schedule's bubbles.
        key = (m, cand.zero_stage, fastest.device.name, fastest.speed, cand.runtime.offload)
        if key not in self._optimizer:
            even, even_experts = self._even_params(m)
            local = optimizer_params(even, even_experts, zero_stage=cand.zero_stage, dp_size=m.dp * m.cp,
                                     ep_dp=m.ep_dp)
            if cand.runtime.offload is Offload.NONE:
                self._optimizer[key] = optimizer_step_time(local, fastest.device, speed=fastest.speed)
            else:  # the host CPU's step does not scale with the device's speed: the cheapest host bounds it
                self._optimizer[key] = min(optimizer_terms(local, pl.device, cand.runtime.offload, dtype=self.dtype,
                                                           speed=pl.speed)[0] for pl in placements)
        return self._optimizer[key]

    def tight(self, cand: Candidate) -> float:
        """Level-2 lower bound on the candidate's step time from its own layer prices (solves its layer classes'
        sharding): the largest of the pipeline's (`pipeline_bound`), the ZeRO collectives' of each micro-batch
        (`comm_bound`) and the end-of-step gradient reduction's (`bounds.end_reduce_lower_bound`), plus the
        optimizer step."""
        placements = self.builder.placements(cand)
        interleaved = cand.schedule.chunked and cand.virtual_stages > 1
        pipe = self.pipeline_bound(cand, placements)
        tail = end_reduce_lower_bound(cand, pipe, self.end_reduce.floor(cand, placements))
        return max(pipe.value, tail, self.comm_bound(cand, placements, interleaved)) + self.optimizer_bound(
            cand, placements)

    def pipeline_bound(self, cand: Candidate, placements: Sequence[RankPlacement]) -> PipelineBound:
        """`bounds.tight_lower_bound` of the candidate with no optimizer step. It depends only on (device, tp, sp,
        mbs, p, schedule, v) and the mesh's sends, so it is cached across the ZeRO stages and the other
        candidates that share it."""
        m = cand.mesh
        interleaved = cand.schedule.chunked and cand.virtual_stages > 1
        key = (self._placement_facts(placements).order, m.tp, m.stride(MeshAxis.TP),
               cand.sequence_parallel, cand.microbatch_size, m.pp,
               cand.num_microbatches, cand.virtual_stages if interleaved else 1,
               cand.schedule.zero_bubble, cand.schedule.v_shape,  # the bound's form and the chunks' placement
               (m.dp, m.cp, m.mesh_order, cand.runtime.p2p_overlap) if m.pp > 1 else (),  # the sends
               # cp / ep change the segment prices (planner.search.layer_costs.AxisSplit).
               (m.cp, m.stride(MeshAxis.CP), m.ep, m.stride(MeshAxis.EP), m.num_devices))
        pipe = self._pipeline_bound.get(key)
        if pipe is None:
            # Each rank's work priced on its own device and speed (`bounds.tight_lower_bound`).
            costs = [(self.builder.segment_costs(cand, pl.device), pl.speed) for pl in placements]
            layout = self.builder.layout(cand) if interleaved else None
            p2p = self.builder.interleaved_sends(cand, layout, placements) if layout is not None else []
            sends = self.builder.contiguous_sends(cand, placements) if layout is None and m.pp > 1 else []
            n, grad_overlap = tp_overlap_chunks(cand), cand.runtime.tp_grad_overlap

            def work(segs: Sequence[LayerCost], speed: float) -> np.ndarray:
                hit = self._work.get((id(segs), speed, n, grad_overlap))
                if hit is None or hit[0] is not segs:
                    hit = self._work[id(segs), speed, n, grad_overlap] = (segs, segment_work(segs, speed, n,
                                                                                             grad_overlap))
                return hit[1]

            pipe = self._pipeline_bound[key] = tight_lower_bound(cand, costs, optimizer_s=0.0, layout=layout,
                                                                 p2p=p2p, rank_sends=sends, work=work)
        return pipe

    def comm_bound(self, cand: Candidate, placements: Sequence[RankPlacement], interleaved: bool) -> float:
        """`bounds.comm_lower_bound` of the candidate (0 where no micro-batch communicates), cached per what it
        depends on: the mesh, ZeRO stage, runtime and layer prices, and the schedule's shape."""
        key = (cand.mesh, cand.zero_stage, cand.runtime, cand.num_microbatches, cand.schedule,
               cand.virtual_stages if interleaved else 1, cand.sequence_parallel, cand.microbatch_size)
        hit = self._comm_bound.get(key)
        if hit is None:
            comm = self.comm_per_segment(cand, placements)
            layout = self.builder.layout(cand) if interleaved else None
            hit = self._comm_bound[key] = 0.0 if comm is None else comm_lower_bound(
                cand, comm, layout=layout, num_sends=cand.mesh.pp * cand.virtual_stages - 1)
        return hit

    def comm_per_segment(self, cand: Candidate, placements: Sequence[RankPlacement]) -> np.ndarray | None:
        """Per segment, the least over pipeline ranks of the data-parallel collectives one micro-batch issues for
        it, whole (`bounds.comm_lower_bound`); None where no micro-batch issues any (ZeRO-0/1, and ZeRO-2 or
        ZeRO-3 kept gathered under pipelining, which reduce once per step).

        Priced by the cost model itself, each segment as a chunk of its own with overlap off and offload left
        out (its copies only add; offloaded parameters stay where they decide that the pipeline reduces every
        micro-batch, and their copies are not counted), once per mesh, ZeRO stage, runtime and layer prices."""
        m, runtime = cand.mesh, cand.runtime
        pipelined = m.pp > 1
        # FSDP2 with offloaded parameters reduces every micro-batch, pipelined or not (`data_parallel_comm`).
        offloaded = cand.zero_stage >= 2 and pipelined and runtime.offload is Offload.PARAMS
        per_microbatch = cand.zero_stage == 3 and (runtime.reshard_after_forward or not pipelined) or (
            cand.zero_stage == 2 and not pipelined) or offloaded
        if not per_microbatch or m.dp * m.cp <= 1:
            return None
        bare = replace(cand, runtime=replace(runtime, dp_overlap=False,
                                             offload=Offload.PARAMS if offloaded else Offload.NONE))
        # The sharding solved for (tp, sp, micro-batch size) decides which weights tp splits.
        key = (m, cand.zero_stage, bare.runtime, cand.sequence_parallel, cand.microbatch_size)
        if key in self._comm:
            return self._comm[key]
        least: np.ndarray | None = None
        seen: set[int] = set()
        for k, pl in enumerate(placements):
            ctx = self.builder.context(bare, k, pl)
            if ctx.signature in seen:
                continue
            seen.add(ctx.signature)
            costs = self.builder.segment_costs(bare, pl.device)
            distinct = list({id(c): c for c in costs}.values())  # a layer class's segments share one cost
            _, comms = self.builder.chunk_times_of(bare, ctx, [[PricedSegment(c)] for c in distinct])
            of = {id(c): x.per_microbatch_fwd_s + x.per_microbatch_bwd_s for c, x in zip(distinct, comms, strict=True)}
            row = np.array([of[id(c)] for c in costs])
            least = row if least is None else np.minimum(least, row)
        self._comm[key] = least
        return least
