"""The joint search: meshes x micro-batching x schedule x ZeRO x SP (outer), layer-class sharding (middle), stage
partition with per-stage recomputation (inner). Branch and bound over candidates, exact for the space it covers.

Formulation
-----------
A *candidate* fixes everything but the stage partition and the recomputation: the mesh (dp, tp, pp [, cp, ep]
and their rank order, `planner.search.meshes`), the micro-batch size ``mbs`` and count ``m`` with
``global_batch = dp * mbs * m``, the schedule (1F1B, interleaved with v chunks per rank, GPipe when pinned), the
ZeRO stage and sequence parallelism. The space, for a free dimension:

- device counts (`device_counts`): all available devices, and whole-node subsets (every one for
  ``--objective cost``; a power-of-two number of nodes for time, so that a failed device does not rule out most
  meshes); within one node every count;
- meshes: every mesh of `enumerate_meshes` on those counts; tp must divide the attention heads (and relate to
  the kv heads) as `costmodel.estimate` requires;
- ``mbs``: divisors of ``global_batch / dp`` up to `SearchSpace.max_microbatch_size`;
- schedule: 1F1B; when pp > 1 also interleaved with v in 2..max_virtual_stages when the repeated layer class
  divides into p*v equal chunks and ``m`` is a multiple of p (Megatron-LM's conditions). GPipe is searched only
  when pinned: on the same stages it is never faster than 1F1B (``sum F + (m-1) max F + sum B + (m-1) max B >=
  sum(F+B) + (m-1) max(F+B)``) and keeps all m micro-batches in flight instead of ``min(p - k, m)``, with the same
  drain and tails, so 1F1B is at least as good on every partition (the brute-force tests include GPipe);
- ZeRO 0..3 when dp > 1 (0 otherwise); SP on and off when tp > 1.

Middle level: `LayerCostTable` prices each layer class once per (device, tp, sp, mbs) -- the intra-operator
ILP for tp > 1 -- and the inner level (`planner.search.stage_problem` + `planner.search.stage_partition`) finds the candidate's
best partition and per-stage recomputation exactly, minimizing the same step-time formula as `costmodel.estimate`.

Branch and bound, best first over a heap of lower bounds, each level valid for everything below it:

- level 0, a device count d: the step's model FLOPs at the dense peak of the fastest device, spread over d;
- level 1, a candidate: tp == 1 prices divided by tp (and cp), the pipeline's (m - 1/v)/p share, and the
  optimizer step of an even parameter split (`stage_problem.cheap_lower_bound`); inf when the parameter state
  alone cannot fit;
- level 2, a candidate with its layer classes priced (the sharding ILP): compute + TP communication, the
  bottleneck of the best contiguous split (`stage_problem.tight_lower_bound`);
- then the exact partition DP, which itself prunes with the same incumbent.

An entry is expanded (0), refined (1) or solved (2) only while its bound is below the K-th best objective found;
when the heap's smallest bound reaches it, the K best are proven optimal for this space. A time limit stops the
loop early: the result is then "feasible" and the optimality gap compares the best plan with the smallest bound
not yet explored. Ties are broken by a fixed key, so the result never depends on timing unless cut short.

Objective: step time, or cost = step time x (sum of the used devices' prices per second).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from costmodel.breakdown import Estimate
from costmodel.cluster import Cluster
from costmodel.context_parallel import cp_options, cp_problem
from costmodel.estimate import estimate as costmodel_estimate
from costmodel.estimate import even_stages
from costmodel.expert_parallel import (
    ep_options,
    ep_problem,
    expert_param_numel,
    num_experts,
    optimizer_params,
)
from costmodel.expert_parallel import model_state_bytes as expert_state_bytes
from costmodel.layer_cost import LayerCost
from costmodel.memory import GIB, framework_overhead_bytes, model_state_bytes
from costmodel.step_time import optimizer_step_time
from costmodel.strategy import MeshAxis, Recompute, Schedule, Strategy
from ir.layer_chain import LayerChain
from planner.errors import InfeasibleError, UserError
from planner.plan import Alternative, ModuleSharding
from planner.search.device_groups import mesh_type_problem
from planner.search.layer_costs import LayerCostTable, module_sharding
from planner.search.meshes import MeshCandidate, compute_lower_bound_s, divisors, enumerate_meshes
from planner.search.space import Objective, SearchSpace
from planner.search.stage_partition import partition_lower_bound, solve_partition
from planner.search.stage_problem import Candidate, StageProblemBuilder, cheap_lower_bound, tight_lower_bound

REL_TOL = 1e-9
"""Relative tolerance when comparing the search objective with `costmodel.estimate` (float summation order)."""

Progress = Callable[[int, int, float | None], None]

FIRST_PLAN_FRACTION = 0.5
"""With a time limit, once this fraction of it has passed without any plan, `_Search.first_plan` looks for one
among the candidates that are cheap to solve, leaving the rest of the limit to improve on it."""


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    objective: Objective = Objective.TIME
    top_k: int = 1
    """How many distinct strategies (different candidates) to return, best first."""
    time_limit_s: float | None = None
    """Stop after this many seconds of search with the best found so far (status "feasible"). The limit is checked
    between candidates; if it passes before any plan is found, the search stops at the first one."""
    progress: Progress | None = None
    """Called as progress(candidates done, candidates total, best objective so far)."""
    num_alternatives: int = 8
    """How many losing meshes (distinct dp, tp, pp) to explain in `alternatives`."""
    explain_slack: float = 0.1
    """Losing meshes within this fraction of the best are priced exactly for `alternatives` (the others get
    their lower bound); it never changes the chosen plans, only how much work goes into explaining them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "objective", Objective(self.objective))
        if not isinstance(self.top_k, int) or self.top_k < 1:
            raise ValueError(f"top must be a positive integer, got {self.top_k!r}")
        if self.time_limit_s is not None and not 0 < self.time_limit_s < math.inf:
            raise ValueError(f"time limit must be a positive number of seconds, got {self.time_limit_s!r}")


@dataclass(frozen=True)
class RankedStrategy:
    """One of the best strategies: what the search predicted and what `costmodel.estimate` says."""

    candidate: Candidate
    strategy: Strategy
    objective: float
    """Search objective (seconds, or cost per step) of this strategy."""
    predicted_step_time_s: float
    """The partition DP's step time (equals estimate.step_time_s up to float summation order)."""
    estimate: Estimate
    sharding: tuple[ModuleSharding, ...]
    layer_costs: Mapping[tuple[int, str], LayerCost]


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[RankedStrategy, ...]
    alternatives: tuple[Alternative, ...]
    status: str
    """"optimal" (the space was exhausted or pruned by bounds) or "feasible" (cut short by the time limit)."""
    cut_short: bool
    lower_bound: float
    """Proven lower bound on the best objective (objective units)."""
    optimality_gap: float
    candidates: int
    """Candidates whose stage partition was solved."""
    pruned: int
    """Candidates skipped by a lower bound (never priced)."""
    layer_solves: int
    """Layer-class pricings (intra-op ILP solves for tp > 1) actually computed."""
    time_s: float

    @property
    def best(self) -> RankedStrategy:
        return self.ranked[0]


@dataclass(order=True)
class _Found:
    objective: float
    order: int
    candidate: Candidate = field(compare=False)
    step_time_s: float = field(compare=False)
    strategy: Strategy = field(compare=False)


@dataclass
class _MeshRecord:
    """What happened to one (dp, tp, pp): its best solved candidate, or why none was."""

    best: _Found | None = None
    lower_bound: float = math.inf
    memory_need_bytes: float = math.inf
    beyond_slack: bool = False
    """Its partition was solved but nothing came within `explain_slack` of the best."""


# ---- the space ---------------------------------------------------------------------------------------------------

def head_problem(chain: LayerChain, tp: int) -> str:
    """Why tensor parallelism of degree tp cannot shard the attention heads ('' when it can)."""
    for n in chain.graph.nodes:
        h = n.attr("num_heads")
        if h is not None and int(h) % tp:
            return f"tp={tp} does not divide heads={h}"
        kv = n.attr("num_kv_heads")
        if kv is not None and int(kv) % tp and tp % int(kv):
            return f"tp={tp} and kv heads={kv}: neither divides the other"
    return ""


def _node_size(cluster: Cluster) -> int:
    return math.gcd(*(g.devices_per_node for g in cluster.groups))


def device_counts(cluster: Cluster, space: SearchSpace, objective: Objective) -> tuple[int, ...]:
    """Device counts to plan for, largest first.

    Always every available device. Also whole-node subsets: for `--objective cost` all of them (fewer devices can
    be cheaper); for time a power-of-two number of nodes, so that a mesh that does not divide the available
    devices (after a failure, say) can still use most of them, and every count up to the node size (the counts
    one node is searched with). So a cluster's counts include those of any cluster with a power-of-two number of
    its nodes, and going from such a cluster to this one never makes the best time worse (from 3 nodes to 4 it
    can: 3 nodes' worth of devices is not searched on 4). With `--objective cost`, counts below a node only within
    one node or with `SearchSpace.whole_nodes_only` False. The level-0 bound prunes the small counts unexpanded
    whenever a larger one already does better, so they cost nothing for a model that needs the devices."""
    n = cluster.num_available
    per_node = _node_size(cluster)
    nodes = n // per_node
    if objective is Objective.COST:
        counts = {n} | {k * per_node for k in range(1, nodes + 1)}
    else:
        counts = {n} | {(1 << i) * per_node for i in range(nodes.bit_length()) if (1 << i) <= nodes}
    if objective is not Objective.COST or not space.whole_nodes_only or n <= per_node:
        counts |= set(range(1, min(n, per_node) + 1))
    return tuple(sorted(counts, reverse=True))


def _main_class_count(chain: LayerChain) -> int:
    counts = Counter(s.class_id for s in chain.segments)
    return max(counts.values())


def _schedules(space: SearchSpace, pp: int, m: int, chain: LayerChain, main_count: int
               ) -> list[tuple[Schedule, int]]:
    if space.schedule is not None and space.schedule is not Schedule.INTERLEAVED:
        return [(space.schedule, 1)]
    # GPipe is not searched unless pinned: for the same stages it is never faster than 1F1B (sum F + (m-1) max F
    # + sum B + (m-1) max B >= sum (F+B) + (m-1) max (F+B)) and it keeps all m micro-batches in flight instead of
    # min(p - k, m), with the same drain and tails; so 1F1B is at least as good on every partition.
    out: list[tuple[Schedule, int]] = []
    if space.schedule is None:
        out = [(Schedule.ONE_F_ONE_B, 1)]
    if pp == 1 or m % pp:
        return out
    v_options = ([space.virtual_stages] if space.virtual_stages is not None
                 else range(2, space.max_virtual_stages + 1))
    for v in v_options:
        if v >= 2 and pp * v <= len(chain.segments) and main_count % (pp * v) == 0:
            out.append((Schedule.INTERLEAVED, v))
    return out


def enumerate_candidates(chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                         objective: Objective = Objective.TIME) -> tuple[list[Candidate], dict[tuple, str]]:
    """Every candidate of the space (module docstring), and the meshes left out with the reason."""
    out: list[Candidate] = []
    invalid: dict[tuple, str] = {}
    for n in device_counts(cluster, space, objective):
        out.extend(candidates_for(n, chain, cluster, global_batch, space, invalid))
    return out, invalid


def candidates_for(num_devices: int, chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                   invalid: dict[tuple, str]) -> list[Candidate]:
    """The candidates on exactly `num_devices` devices; meshes whose tp cannot shard the heads go to `invalid`."""
    out: list[Candidate] = []
    main_count = _main_class_count(chain)
    # Issue 10: context-parallel degrees the chain allows, expert-parallel degrees dividing its experts.
    cps = [c for c in cp_options(chain, num_devices) if space.cp in (None, c)]
    eps = [e for e in ep_options(chain, num_devices) if space.ep in (None, e)]
    meshes = enumerate_meshes(num_devices, devices_per_node=_node_size(cluster), global_batch=global_batch,
                              max_pp=len(chain.segments), dp=space.dp, tp=space.tp, pp=space.pp,
                              tp_across_nodes=space.tp_across_nodes, cp_options=cps, ep_options=eps)
    for mesh in meshes:
        # Issue 7 (planner/search/device_groups.py): a tp/dp group never mixes device types; replicas on different
        # types are planned by group data parallelism, with batch shares that balance them.
        why = head_problem(chain, mesh.tp) or mesh_type_problem(
            cluster, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=mesh.ep, mesh_order=mesh.mesh_order)
        if why:
            invalid[(mesh.dp, mesh.tp, mesh.pp)] = why
            continue
        out.extend(_mesh_candidates(mesh, chain, global_batch, space, main_count))
    return out


def _mesh_candidates(mesh: MeshCandidate, chain: LayerChain, global_batch: int, space: SearchSpace,
                     main_count: int) -> list[Candidate]:
    out = []
    per_replica = global_batch // mesh.dp
    for mbs in divisors(per_replica):
        if space.microbatch_size is not None and mbs != space.microbatch_size:
            continue
        if space.microbatch_size is None and mbs > space.max_microbatch_size:
            continue
        m = per_replica // mbs
        if space.num_microbatches is not None and m != space.num_microbatches:
            continue
        zeros = ([space.zero_stage] if space.zero_stage is not None
                 else [0] if mesh.dp * mesh.cp == 1 else [0, 1, 2, 3])
        sps = ([space.sequence_parallel] if space.sequence_parallel is not None
               else [False] if mesh.tp == 1 else [False, True])
        if mesh.tp == 1 and any(sps):
            continue
        for schedule, v in _schedules(space, mesh.pp, m, chain, main_count):
            for zero in zeros:
                for sp in sps:
                    out.append(Candidate(mesh, mbs, m, schedule, v, zero, sp))
    return out


# ---- pricing helpers ---------------------------------------------------------------------------------------------

def _price_per_second(cluster: Cluster, num_devices: int) -> float:
    """Sum of the prices of ranks 0..num_devices-1, per second."""
    total, rank = 0.0, 0
    for g in cluster.groups:
        take = min(g.num_devices, num_devices - rank)
        if take <= 0:
            break
        if g.price_per_device_hour is None:
            raise UserError(f"--objective cost needs a price for every device; group {g.name!r} has none "
                            f"(set price_per_device_hour in the cluster YAML)")
        total += take * g.price_per_device_hour
        rank += take
    return total / 3600.0


def layer_cost_map(builder: StageProblemBuilder, cand: Candidate, placements) -> dict[tuple[int, str], LayerCost]:
    """`costmodel.estimate`'s layer_costs for a candidate: (class id, device name) -> LayerCost."""
    out: dict[tuple[int, str], LayerCost] = {}
    for pl in placements:
        costs = builder.segment_costs(cand, pl.device)
        for seg, c in zip(builder.chain.segments, costs, strict=True):
            out[(seg.class_id, pl.device.name)] = c
    return out


def sharding_of(builder: StageProblemBuilder, cand: Candidate, placements) -> tuple[ModuleSharding, ...]:
    if cand.mesh.tp == 1:
        return ()
    prices = builder.table.prices(placements[0].device, tp=cand.mesh.tp, tp_stride=1,
                                  sequence_parallel=cand.sequence_parallel, microbatch_size=cand.microbatch_size)
    return module_sharding(builder.chain, prices)


def _summary_recompute(stages) -> Recompute:
    used = {s.recompute for s in stages}
    for r in (Recompute.FULL, Recompute.SELECTIVE):
        if r in used:
            return r
    return Recompute.NONE


# ---- the search --------------------------------------------------------------------------------------------------

@dataclass
class _Search:
    chain: LayerChain
    cluster: Cluster
    global_batch: int
    space: SearchSpace
    options: SearchOptions
    dtype: str
    builder: StageProblemBuilder
    started: float
    found: list[_Found] = field(default_factory=list)
    meshes: dict[tuple[int, int, int], _MeshRecord] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    invalid: dict[tuple, str] = field(default_factory=dict)
    _memory_need: dict[tuple, float] = field(default_factory=dict)
    _replicated: dict[tuple, float] = field(default_factory=dict)
    _optimizer: dict[tuple, float] = field(default_factory=dict)
    _price: dict[int, float] = field(default_factory=dict)
    _pipeline_bound: dict[tuple, float] = field(default_factory=dict)
    solved: int = 0
    pruned: int = 0
    _expert_numel: int | None = None

    def kth_best(self) -> float:
        k = self.options.top_k
        return self.found[k - 1].objective if len(self.found) >= k else math.inf

    def price_factor(self, cand: Candidate) -> float:
        if self.options.objective is not Objective.COST:
            return 1.0
        n = cand.mesh.num_devices
        if n not in self._price:
            self._price[n] = _price_per_second(self.cluster, n)
        return self._price[n]

    def options_for(self) -> tuple[Recompute, ...]:
        return (self.space.recompute,) if self.space.recompute is not None else tuple(Recompute)

    def out_of_time(self, fraction: float = 1.0) -> bool:
        """Whether `fraction` of the time limit has passed (never without a limit)."""
        limit = self.options.time_limit_s
        return limit is not None and time.monotonic() - self.started > fraction * limit

    def first_plan(self, heap: list[tuple[float, int, tuple, int]]) -> None:
        """Find some plan fast, for a time limit that would otherwise pass before the first one.

        Best-first order refines (solves the sharding ILPs of) many tensor-parallel candidates before it solves
        any; within a short limit that can use up all the time. This visits, in bound order, only the candidates
        that need no new sharding solve -- already refined, or tp == 1 -- until one fits. The rest go back to the
        heap, so its smallest bound stays a valid lower bound on everything unexplored."""
        kept = []
        while heap and not self.found:
            entry = heapq.heappop(heap)
            _, level, _, payload = entry
            if level == 2 or (level == 1 and self.candidates[payload].mesh.tp == 1):
                self.visit(self.candidates[payload])
            else:
                kept.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)

    def bound(self, cand: Candidate) -> float:
        """Level-1 lower bound on the candidate's objective from tp == 1 prices (no sharding solve); inf when its
        parameter state alone cannot fit. Its pieces are cached: thousands of candidates share them."""
        placements = self.builder.placements(cand)
        if placements is None:
            return math.inf
        m = cand.mesh
        key = (m.tp * m.pp, m.dp * m.cp, m.ep, cand.zero_stage)
        need = self._memory_need.get(key)
        if need is None:
            # Issue 10: experts split over ep hold 1/ep of their weights, ZeRO-sharded over dp*cp/ep ranks.
            even, even_experts = self._even_params(m)
            state = expert_state_bytes(even, even_experts, zero_stage=cand.zero_stage, dp_size=m.dp * m.cp,
                                       ep=m.ep, dtype=self.dtype).total
            need = self._memory_need[key] = state + framework_overhead_bytes(placements[0].device.name)
        if need > max(pl.device.memory_bytes for pl in placements):
            rec = self.meshes.setdefault((m.dp, m.tp, m.pp), _MeshRecord())
            rec.memory_need_bytes = min(rec.memory_need_bytes, need)
            return math.inf
        total = min(self._replicated_total(pl.device, cand.microbatch_size) / pl.speed for pl in placements)
        lb = cheap_lower_bound(cand, total, optimizer_s=self.optimizer_bound(cand, placements))
        return lb * self.price_factor(cand)

    def _replicated_total(self, device, mbs: int) -> float:
        key = (device.name, mbs)
        if key not in self._replicated:
            costs = self.builder.table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False,
                                                     microbatch_size=mbs)
            self._replicated[key] = sum(c.fwd_compute_s + c.bwd_compute_s for c in costs)
        return self._replicated[key]

    def expert_numel(self) -> int:
        """Expert weights in the model, counted once per search (a pass over every graph node)."""
        if self._expert_numel is None:
            nodes = self.chain.graph.nodes
            self._expert_numel = expert_param_numel(nodes, num_experts(nodes) or 0)
        return self._expert_numel

    def _even_params(self, m: MeshCandidate) -> tuple[int, int]:
        """(parameters, of which expert weights) on a rank holding an even 1/(tp*pp) share, experts split ep ways
        (issue 10): the fullest rank holds at least that."""
        experts = self.expert_numel()
        local_experts = -(-experts // m.ep) if m.ep > 1 else 0
        total = self.chain.graph.param_count - experts + local_experts if m.ep > 1 else self.chain.graph.param_count
        return -(-total // (m.tp * m.pp)), local_experts // (m.tp * m.pp)

    def optimizer_bound(self, cand: Candidate, placements) -> float:
        """The optimizer step of the fullest rank is at least that of an even split of the parameters."""
        m = cand.mesh
        fastest = max(placements, key=lambda pl: pl.speed)
        # The speed is in the key: where devices share host cores it changes with the schedule's bubbles.
        key = (m, cand.zero_stage, fastest.device.name, fastest.speed)
        if key not in self._optimizer:
            even, even_experts = self._even_params(m)
            local = optimizer_params(even, even_experts, zero_stage=cand.zero_stage, dp_size=m.dp * m.cp, ep=m.ep)
            self._optimizer[key] = optimizer_step_time(local, fastest.device, speed=fastest.speed)
        return self._optimizer[key]

    def refine(self, cand: Candidate) -> float:
        """Level-2 lower bound from the candidate's own layer prices (solves its layer classes' sharding).

        The bound's pipeline part depends only on (device, tp, sp, mbs, p, schedule, v) and the mesh's sends, so
        it is cached across the ZeRO stages and the other candidates that share it."""
        placements = self.builder.placements(cand)
        m = cand.mesh
        interleaved = cand.schedule is Schedule.INTERLEAVED
        key = (tuple(sorted({(pl.device.name, pl.speed) for pl in placements})), m.tp, m.stride(MeshAxis.TP), cand.sequence_parallel, cand.microbatch_size, m.pp,
               cand.num_microbatches, cand.virtual_stages if interleaved else 1,
               (m.dp, m.cp, m.mesh_order) if interleaved and m.pp > 1 else (),
               # Issue 10: cp / ep change the segment prices (planner/layer_costs.AxisSplit).
               (m.cp, m.stride(MeshAxis.CP), m.ep, m.stride(MeshAxis.DP), m.num_devices))
        pipe = self._pipeline_bound.get(key)
        if pipe is None:
            # Each rank's work priced on its own device and speed; the bound takes the cheapest per segment.
            costs = [(self.builder.segment_costs(cand, device), speed)
                     for device, speed in {(pl.device.name, pl.speed): (pl.device, pl.speed)
                                           for pl in placements}.values()]
            chunks: tuple = ()
            p2p: list[float] = []
            if interleaved:
                chunks = even_stages(self.chain, m.pp * cand.virtual_stages)
                p2p = self.builder.interleaved_p2p(cand, chunks, placements)
            pipe = self._pipeline_bound[key] = tight_lower_bound(cand, costs, optimizer_s=0.0, chunks=chunks,
                                                                 p2p=p2p)
        return (pipe + self.optimizer_bound(cand, placements)) * self.price_factor(cand)

    def visit(self, cand: Candidate) -> None:
        rec = self.meshes.setdefault((cand.mesh.dp, cand.mesh.tp, cand.mesh.pp), _MeshRecord())
        factor = self.price_factor(cand)
        mesh_best = rec.best.objective if rec.best is not None else math.inf
        # Solve to beat the K-th best (a plan), or this mesh's best so far within the slack (an alternative).
        kth = self.kth_best()
        bound = max(kth, min(mesh_best, kth * (1 + self.options.explain_slack))) / factor
        built = self.builder.build(cand, self.options_for(), upper_bound=bound)
        if built is None:
            return
        self.solved += 1
        part = solve_partition(built.problem, upper_bound=bound)
        if part is None:
            if not built.pruned and not math.isfinite(partition_lower_bound(built.problem)):
                rec.memory_need_bytes = min(rec.memory_need_bytes, _least_memory(built))
            else:
                rec.beyond_slack = True
            return
        stages = built.stages(part)
        strategy = cand.strategy(stages, _summary_recompute(stages))
        found = _Found(part.objective * factor, self.solved, cand, part.objective, strategy)
        if rec.best is None or found < rec.best:
            rec.best = found
        if found.objective < self.kth_best():
            self.found.append(found)
            self.found.sort()
            del self.found[self.options.top_k:]

    def device_bound(self, num_devices: int) -> float:
        """Level-0 bound of every candidate on `num_devices` devices: the step's FLOPs at the dense peak of the
        fastest device type (no op runs faster than peak, and a rank's work is at least its share)."""
        graph = self.chain.graph
        flops = (graph.forward_flops + graph.backward_flops) * self.global_batch / graph.batch_size
        peak = max(g.device.flops(self.dtype) for g in self.cluster.groups)
        lb = compute_lower_bound_s(flops, num_devices, peak)
        if self.options.objective is Objective.COST:
            lb *= _price_per_second(self.cluster, num_devices)
        return lb

    def run(self, device_counts: Sequence[int]) -> tuple[bool, float]:
        """Best-first branch and bound; returns (cut short, smallest unexplored bound).

        Heap entries are (bound, level, fixed order, payload). Level 0 is a device count: popped below the
        incumbent, it expands into its candidates at their level-1 bound. A level-1 entry popped below the
        incumbent is refined to its level-2 bound (solving its layer sharding) and pushed back; a level-2 entry
        popped below the incumbent is solved exactly. Nothing is popped once the smallest bound reaches the K-th
        best objective, which proves the K best optimal."""
        heap: list[tuple[float, int, tuple, int]] = [(self.device_bound(n), 0, (-n,), n) for n in device_counts]
        heapq.heapify(heap)
        done = 0
        progress = self.options.progress
        rushed = False
        while heap:
            if not self.found and not rushed and self.out_of_time(FIRST_PLAN_FRACTION):
                rushed = True
                self.first_plan(heap)
                if not heap:
                    break
            lb, level, key, payload = heap[0]
            if not math.isfinite(lb) or lb >= self.kth_best():
                break
            if self.out_of_time() and self.found:
                return True, lb
            heapq.heappop(heap)
            if level == 0:
                for cand in candidates_for(payload, self.chain, self.cluster, self.global_batch, self.space,
                                           self.invalid):
                    self.candidates.append(cand)
                    heapq.heappush(heap, (max(lb, self.bound(cand)), 1, cand.sort_key, len(self.candidates) - 1))
                continue
            cand = self.candidates[payload]
            if level == 1:
                heapq.heappush(heap, (max(lb, self.refine(cand)), 2, key, payload))
                continue
            self.visit(cand)
            done += 1
            if progress:
                progress(done, len(self.candidates), self.found[0].objective if self.found else None)
        self.pruned = sum(1 for entry in heap if entry[1] > 0)
        for lb_left, level_left, _, payload_left in heap:  # what is known of the candidates never solved
            if level_left > 0:
                mesh = self.candidates[payload_left].mesh
                rec = self.meshes.setdefault((mesh.dp, mesh.tp, mesh.pp), _MeshRecord())
                rec.lower_bound = min(rec.lower_bound, lb_left)
        if progress and done:
            progress(len(self.candidates), len(self.candidates), self.found[0].objective if self.found else None)
        return False, heap[0][0] if heap else math.inf


def _least_memory(built) -> float:
    """Smallest per-device capacity with which the candidate would fit (bottleneck over stage memories)."""
    import numpy as np

    problem = built.problem
    p, n = problem.num_stages, problem.num_segments
    best = np.full(n + 1, np.inf)
    best[n] = 0.0
    for k in range(p - 1, -1, -1):
        q = problem.profile[k]
        mem = (problem.base[q] + problem.inflight[k] * problem.act[q]).min(axis=0)  # best option per (a, b)
        a = np.arange(n + 1)[:, None]
        b = np.arange(n + 1)[None, :]
        ok = (b > a) & (a >= k) & (b <= n - (p - 1 - k)) & ((b == n) if k == p - 1 else True)
        cand = np.where(ok, np.maximum(mem, best[None, :]), np.inf)
        new = cand.min(axis=1)
        if k == 0:
            return float(new[0])
        best = new
    return math.inf


def search(chain: LayerChain, cluster: Cluster, *, global_batch: int, space: SearchSpace | None = None,
           options: SearchOptions | None = None, dtype: str = "bfloat16", profile=None,
           table: LayerCostTable | None = None) -> SearchResult:
    """The best strategies for training `chain` on `cluster` with `global_batch` samples per step.

    Raises InfeasibleError when no strategy of the space fits in memory, UserError for an empty space (pins that
    contradict the cluster or batch)."""
    if options is not None and options.time_limit_s is not None:
        # Load the sharding solver (OR-Tools, about a second to import) before the clock starts: a time limit
        # bounds the search, not the one-time loading of its libraries.
        import planner.search.intra_op  # noqa: F401
    started = time.monotonic()
    space = space or SearchSpace()
    options = options or SearchOptions()
    if global_batch < 1:
        raise UserError(f"--batch must be a positive integer, got {global_batch}")
    table = table or LayerCostTable(chain, cluster, dtype=dtype, profile=profile)
    builder = StageProblemBuilder(chain, cluster, table, dtype)
    state = _Search(chain, cluster, global_batch, space, options, dtype, builder, started)
    counts = device_counts(cluster, space, options.objective)
    cut_short, next_bound = state.run(counts)
    if not state.found:
        candidates, invalid = enumerate_candidates(chain, cluster, global_batch, space, options.objective)
        if not candidates:
            raise UserError(_empty_space_message(chain, cluster, global_batch, space, invalid))
        raise InfeasibleError(_nothing_fits_message(state, space))
    ranked = tuple(_finish(state, f) for f in state.found)
    best = ranked[0].objective
    lower = min(best, next_bound) if cut_short else best
    gap = (best - lower) / best if best > 0 else 0.0
    alternatives = _alternatives(state, ranked[0], state.invalid)
    return SearchResult(
        ranked=ranked, alternatives=alternatives, status="feasible" if cut_short else "optimal",
        cut_short=cut_short, lower_bound=lower, optimality_gap=gap, candidates=state.solved, pruned=state.pruned,
        layer_solves=table.solves, time_s=time.monotonic() - started)


def _finish(state: _Search, found: _Found) -> RankedStrategy:
    cand = found.candidate
    placements = state.builder.placements(cand)
    costs = layer_cost_map(state.builder, cand, placements)
    est = costmodel_estimate(state.chain, state.cluster, found.strategy, layer_costs=costs, dtype=state.dtype,
                             profile=state.builder.table.profile, global_batch=state.global_batch)
    return RankedStrategy(candidate=cand, strategy=found.strategy, objective=found.objective,
                          predicted_step_time_s=found.step_time_s, estimate=est,
                          sharding=sharding_of(state.builder, cand, placements), layer_costs=costs)


# ---- explanations ------------------------------------------------------------------------------------------------

_PHRASES = {
    "compute_s": "slower compute (smaller or less efficient GEMMs per device)",
    "recompute_s": "more recomputation to fit in memory",
    "tp_comm_s": "more tensor-parallel communication",
    "pp_comm_s": "more pipeline send/recv",
    "dp_comm_s": "more exposed data-parallel communication",
    "bubble_s": "a larger pipeline bubble",
    "optimizer_s": "a longer optimizer step",
    "framework_s": "more framework host work (FSDP2 / DTensor / pipeline / checkpoint machinery)",
}


def _crosses(cluster: Cluster, size: int, stride: int) -> str:
    if size <= 1:
        return ""
    tier = cluster.tier_spanned(size, stride)
    return tier.name if tier is not None and tier.name != cluster.tiers[0].name else ""


def _loss_reason(state: _Search, best: RankedStrategy, alt: _Found) -> str:
    costs = layer_cost_map(state.builder, alt.candidate, state.builder.placements(alt.candidate))
    est = costmodel_estimate(state.chain, state.cluster, alt.strategy, layer_costs=costs, dtype=state.dtype,
                             profile=state.builder.table.profile, global_batch=state.global_batch)
    ours, theirs = best.estimate.breakdown.to_dict(), est.breakdown.to_dict()
    worst = max(_PHRASES, key=lambda k: (theirs[k] - ours[k], k))
    delta = theirs[worst] - ours[worst]
    pct = 100.0 * (alt.objective - best.objective) / best.objective
    what = "cost" if state.options.objective is Objective.COST else "step time"
    phrase = _PHRASES[worst]
    m = alt.candidate.mesh
    strides = {a: m.stride(a) for a in (MeshAxis.TP, MeshAxis.DP, MeshAxis.PP)}
    if worst == "dp_comm_s" and (tier := _crosses(state.cluster, m.dp, strides[MeshAxis.DP])):
        phrase = f"its gradient all-reduce crosses the {tier} tier"
    elif worst == "tp_comm_s" and (tier := _crosses(state.cluster, m.tp, strides[MeshAxis.TP])):
        phrase = f"its tensor-parallel all-reduces cross the {tier} tier"
    elif worst == "pp_comm_s" and (tier := _crosses(state.cluster, 2, strides[MeshAxis.PP])):
        phrase = f"its pipeline sends cross the {tier} tier"
    return f"+{pct:.1f}% {what}: {phrase} (+{delta:.3g} s)"


def _alternatives(state: _Search, best: RankedStrategy, invalid: Mapping[tuple, str]) -> tuple[Alternative, ...]:
    """Best per distinct (dp, tp, pp) other than the winner's, with why it lost; a fixed order and size."""
    win = (best.candidate.mesh.dp, best.candidate.mesh.tp, best.candidate.mesh.pp)
    rows: list[tuple[tuple, Alternative]] = []
    what = "cost" if state.options.objective is Objective.COST else "step time"
    for key, rec in state.meshes.items():
        if key == win:
            continue
        summary = f"dp={key[0]} tp={key[1]} pp={key[2]}"
        if rec.best is not None:
            found = rec.best
            rows.append(((0, found.objective, key), Alternative(found.candidate.label, found.step_time_s,
                                                               _loss_reason(state, best, found))))
        elif rec.beyond_slack:
            slack = 100.0 * state.options.explain_slack
            rows.append(((1, rec.lower_bound, key), Alternative(
                summary, None, f"more than +{slack:.0f}% {what} (its best partition was not priced exactly)")))
        elif math.isfinite(rec.lower_bound):
            pct = 100.0 * (rec.lower_bound - best.objective) / best.objective
            reason = f"at least {pct:+.1f}% {what} (lower bound {rec.lower_bound:.4g})"
            if math.isfinite(rec.memory_need_bytes):
                reason = f"does not fit: needs at least {rec.memory_need_bytes / GIB:.1f} GiB per device"
            rows.append(((1, rec.lower_bound, key), Alternative(summary, None, reason)))
        elif math.isfinite(rec.memory_need_bytes):
            rows.append(((2, rec.memory_need_bytes, key), Alternative(
                summary, None, f"does not fit: needs at least {rec.memory_need_bytes / GIB:.1f} GiB per device")))
    for key, why in invalid.items():
        rows.append(((3, 0.0, key), Alternative(f"dp={key[0]} tp={key[1]} pp={key[2]}", None, why)))
    rows.sort(key=lambda r: r[0])
    return tuple(a for _, a in rows[:state.options.num_alternatives])


def _empty_space_message(chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                         invalid: Mapping[tuple, str]) -> str:
    pins = ", ".join(f"{k}={v}" for k, v in space.pinned().items())
    if invalid and len(set(invalid.values())) == 1:
        return f"no valid strategy: {next(iter(invalid.values()))}" + (f" (pinned: {pins})" if pins else "")
    n, per_node = cluster.num_available, _node_size(cluster)
    # Name the first pin that cannot work on its own, else describe the whole space.
    # Issue 10: a pinned cp / ep the model cannot use (costmodel/context_parallel.py, expert_parallel.py).
    why = (cp_problem(chain, space.cp) if space.cp is not None else "") or (
        ep_problem(chain, space.ep) if space.ep is not None else "")
    if why:
        return f"no valid strategy: {why}"
    if space.tp is not None:
        if not space.tp_across_nodes and per_node % space.tp:
            return (f"no valid strategy: tp={space.tp} does not divide the {per_node} devices per node (tensor "
                    f"parallelism stays inside a node; --tp-across-nodes lets it span nodes)")
        why = head_problem(chain, space.tp)
        if why:
            return f"no valid strategy: {why}"
    if space.dp is not None and global_batch % space.dp:
        return f"no valid strategy: dp={space.dp} does not divide the global batch {global_batch}"
    if space.pp is not None and space.pp > len(chain.segments):
        return (f"no valid strategy: pp={space.pp} is more than the {len(chain.segments)} segments of the layer "
                f"chain (each stage needs one)")
    hint = f"pinned: {pins}; " if pins else ""
    return (f"no strategy matches: {hint}{n} devices, global batch {global_batch}, {len(chain.segments)} "
            f"layer-chain segments (dp must divide the batch, dp*tp*pp the devices, tp the devices per node)")


def least_memory(state: _Search) -> tuple[float, Candidate | None]:
    """The smallest per-device memory with which some strategy of the space fits, and its candidate.

    Exact: candidates are visited in order of their parameter-state bound, each priced at its best partition
    and recomputation for memory (`_least_memory`), until the bound exceeds the best found."""
    candidates, _ = enumerate_candidates(state.chain, state.cluster, state.global_batch, state.space,
                                         state.options.objective)
    options = state.options_for()
    bounded = []
    for cand in candidates:
        placements = state.builder.placements(cand)
        if placements is None:
            continue
        m = cand.mesh
        even = -(-state.chain.graph.param_count // (m.tp * m.pp))
        need = model_state_bytes(even, zero_stage=cand.zero_stage, dp=m.dp * m.cp, dtype=state.dtype).total
        bounded.append((need + framework_overhead_bytes(placements[0].device.name), cand.sort_key, cand))
    bounded.sort(key=lambda t: (t[0], t[1]))
    best, arg = math.inf, None
    for lower, _, cand in bounded:
        if lower >= best:
            break
        built = state.builder.build(cand, options)
        if built is not None:
            need = _least_memory(built)
            if need < best:
                best, arg = need, cand
    return best, arg


def _digits_to_tell_apart(need: float, capacity: float) -> int:
    """Decimals of GiB that show `need` and `capacity` as different numbers (2 unless they round together)."""
    digits = 2
    while digits < 6 and math.isfinite(need) and f"{need / GIB:.{digits}f}" == f"{capacity / GIB:.{digits}f}":
        digits += 1
    return digits


def _nothing_fits_message(state: _Search, space: SearchSpace) -> str:
    need, cand = least_memory(state)
    capacity = max(g.device.memory_bytes for g in state.cluster.groups)
    n = state.cluster.num_available
    sharded = model_state_bytes(-(-state.chain.graph.param_count // n), zero_stage=3, dp=1,
                                dtype=state.dtype).total
    if need <= capacity:
        # Only possible when the memory-optimal strategy is outside what the search may return (never for the
        # default space); say so rather than print a contradiction.
        return f"nothing fits in {capacity / GIB:.2f} GiB per device within the search space"
    pins = space.pinned()
    helps = []
    if pins:
        helps.append(f"remove or relax --fix {', '.join(sorted(pins))}")
    if sharded + framework_overhead_bytes(state.cluster.device_of(0).name) > capacity:
        spread = "on the one device" if n == 1 else f"fully sharded over all {n} devices"
        helps.append(f"more devices or devices with more memory (the parameter state alone, {spread}, needs "
                     f"{sharded / GIB:.2f} GiB per device)")
    else:
        helps.append("more devices to spread layers and activations over (a larger tp or pp), a shorter sequence "
                     "(--seq), or devices with more memory")
    where = f" ({cand.label}, recompute=full where needed)" if cand is not None else ""
    digits = _digits_to_tell_apart(need, capacity)
    need_text = f"{need / GIB:.{digits}f} GiB" if math.isfinite(need) else "more than any device has"
    return (f"nothing fits in {capacity / GIB:.{digits}f} GiB per device: the least memory any strategy needs is "
            f"{need_text} per device{where}; what would help: {'; '.join(helps)}")
