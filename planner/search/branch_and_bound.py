"""The joint search: meshes x micro-batching x schedule x ZeRO x SP (outer), layer-class sharding (middle), stage
partition with per-stage recomputation (inner). Branch and bound over candidates, exact for the space it covers.

Formulation
-----------
A *candidate* fixes everything but the stage partition and the recomputation: the mesh (dp, tp, pp [, cp, ep]
and their rank order, `planner.search.meshes`), the micro-batch size ``mbs`` and count ``m`` with
``global_batch = dp * mbs * m``, the schedule (1F1B, interleaved with v chunks per rank, GPipe when pinned), the
ZeRO stage and sequence parallelism. The space, for a free dimension:

- device counts (`device_counts`): all available devices, and whole-node subsets (every one for
  ``--objective cost``; 2^i and 3 * 2^i nodes for time, so that a failed device does not rule out most meshes);
  within one node every count;
- meshes: every mesh of `enumerate_meshes` on those counts; tp must divide the attention heads (and relate to
  the kv heads) as `costmodel.estimate` requires;
- ``mbs``: divisors of ``global_batch / dp`` up to `SearchSpace.max_microbatch_size`;
- schedule: 1F1B; when pp > 1 also interleaved with v in 2..max_virtual_stages when the chain's units (the
  embedding, each block, the head) fill p*v chunks of q or q+1 (`planner.search.interleaved_layout`; chunks of
  equal class counts for a chain without one run of blocks) and ``m`` is a multiple of p (Megatron-LM's condition).
  GPipe is searched only when pinned: on the same stages it is never faster than 1F1B (``sum F + (m-1) max F + sum B + (m-1) max B >=
  sum(F+B) + (m-1) max(F+B)``) and keeps all m micro-batches in flight instead of ``min(p - k, m)``, with the same
  drain and tails, so 1F1B is at least as good on every partition (the brute-force tests include GPipe);
- ZeRO 0..3 when dp > 1 (0 otherwise); SP on and off when tp > 1. With pp > 1 and the ZeRO stage free, ZeRO-2 is
  not searched: under torch.distributed.pipelining it keeps whole gradients and reduces them once per step, as
  ZeRO-1 does (`step_time.data_parallel_comm`, `memory.model_state_bytes`), so on the same candidate every term of
  its step time equals ZeRO-1's and its memory only adds the reduced unit's gradient (`memory.rank_memory`): never
  better, and less simple (the brute-force tests price ZeRO-2 too);

Middle level: `LayerCostTable` prices each layer class once per (device, tp, sp, mbs) -- the intra-operator
ILP for tp > 1 -- and the inner level (`planner.search.stage_problem` + `planner.search.stage_partition`) finds the candidate's
best partition and per-stage recomputation exactly, minimizing the same step-time formula as `costmodel.estimate`.

Branch and bound, best first over a heap of lower bounds, each level valid for everything below it:

- level 0, a device count d: the step's model FLOPs at the dense peak of the fastest device, spread over d;
- a mesh: the least level-1 bound of its candidates, from its shapes and settings without listing them
  (`CandidateBounds.mesh_floor`): most meshes of a large job are never expanded into their candidates;
- level 1, a candidate: tp == 1 prices divided by tp (and cp) -- or, once the search has priced its tp, those
  prices' compute and exposed TP communication, whichever is larger --, the pipeline's (m - 1/v)/p share, and the
  optimizer step of an even parameter split (`bounds.cheap_lower_bound`), or where larger the end-of-step
  gradient reduction of that split the drain cannot hide (`bounds.end_reduce_lower_bound`); inf when the
  parameter state alone cannot fit;
- level 2, a candidate with its layer classes priced (the sharding ILP): compute + TP communication, the
  bottleneck of the best contiguous split (`bounds.tight_lower_bound`), or, where it is larger, the same from
  the ZeRO-2/3 collectives each micro-batch issues (`bounds.comm_lower_bound`: a chunk's collectives run one
  after another, so no overlap makes its time less than theirs), or from the end-of-step gradient reduction that
  the last backward and the pipeline's drain cannot hide (`bounds.end_reduce_lower_bound`: seconds behind a slow
  outer tier);
- then the exact partition DP, which itself prunes with the same incumbent; for an interleaved or zero-bubble
  candidate it first takes each rank's least work per micro-batch over the chunk layouts that fit in memory
  (ZeRO traffic, recomputation and sends included: `planner.search.interleaved_pricing`), pricing the first and
  last ranks first and stopping once the ranks priced so far reach the incumbent; such a candidate is never built.

An entry is expanded (a device count, a mesh), refined (level 1) or solved (level 2) only while its bound is below
the K-th best objective found over (1 + g), g the relative gap (`SearchOptions.relative_gap`); when the heap's
smallest bound reaches it, the K best are proven within g of the optimum for this space (optimal for g = 0). Most of
a large search is spent proving that candidates whose bounds lie just under the best cannot beat it by more than the
model's own error: g = 1% (`DEFAULT_RELATIVE_GAP`, the front doors' default) cuts that, and the gap reported is the
proven one. A time limit stops the loop early: the result is then "feasible" and the optimality gap compares the best
plan with the smallest bound not yet explored. Ties are broken by a fixed key, so the result never depends on timing
unless cut short. With a time limit, past a fixed amount of work the schedule families take turns instead of strict
bound order (`planner.search.fair_share`), so that a family with weak bounds cannot use up the limit before the
others have found their plans; the clock is looked at between entries and within a device count's expansion.

Objective: step time, or cost = step time x (sum of the used devices' prices per second).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from costmodel.estimate import estimate as costmodel_estimate
from costmodel.float8 import fp8_problem
from costmodel.hardware.cluster import Cluster
from costmodel.model_flops import model_flops
from costmodel.strategy import Recompute, RuntimeOptions
from ir.layer_chain import LayerChain
from planner.errors import InfeasibleError, TimeLimitError, UserError
from planner.progress import Phase
from planner.search.candidate_bounds import CandidateBounds
from planner.search.candidates import (
    Candidate,
    MeshOptions,
    device_counts,
    enumerate_candidates,
    mesh_options_for,
)
from planner.search.explanations import (
    empty_space_message,
    explain_alternatives,
    nothing_fits_message,
    out_of_time_message,
)
from planner.search.fair_share import FIRST_PLAN_FRACTION, WorkUnits, fair_share
from planner.search.layer_costs import LayerCostTable
from planner.search.meshes import MeshCandidate, compute_lower_bound_s
from planner.search.outcome import Found, MeshRecord, RankedStrategy, SearchOptions, SearchResult
from planner.search.pricing import (
    layer_cost_map,
    least_memory_of,
    price_per_second,
    sharding_of,
    summary_recompute,
)
from planner.search.ranking import TIE_LEADS, TieSet, prefer_simplest, simplicity_floor
from planner.search.reporting import SearchReporter
from planner.search.space import Objective, SearchSpace
from planner.search.stage_partition import partition_lower_bound, solve_partition_until
from planner.search.stage_problem import Beaten, StageProblemBuilder, Unfit

NO_PLAN_GRACE_S = 10.0
"""With a time limit, how long past it the search keeps looking for a first plan before it gives up with a
`TimeLimitError` (one line: a plan or an error, never an open-ended wait)."""

# ---- the search --------------------------------------------------------------------------------------------------

@dataclass
class SearchState:
    chain: LayerChain
    cluster: Cluster
    global_batch: int
    space: SearchSpace
    options: SearchOptions
    dtype: str
    builder: StageProblemBuilder
    started: float
    found: list[Found] = field(default_factory=list)
    meshes: dict[tuple[int, int, int], MeshRecord] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    groups: list[MeshOptions] = field(default_factory=list)
    """The meshes of the expanded device counts, listed into `candidates` when their entry is popped."""
    invalid: dict[tuple, str] = field(default_factory=dict)
    _price: dict[int, float] = field(default_factory=dict)
    solved: int = 0
    pruned: int = 0
    work: float = 0.0
    """Work done so far in `WorkUnits`: a measure of search effort that, unlike the clock, is the same on every run."""
    _unbounded: set[int] = field(default_factory=set)
    """Meshes (`groups`) pushed at their device count's bound by an expansion cut short (`expand`), not yet
    bounded."""
    ties: TieSet | None = None
    unproven_bound: float = math.inf
    """The least lower bound of the candidates whose partition solve the time limit cut (inf: none was)."""

    def __post_init__(self) -> None:
        self.bounds = CandidateBounds(self.chain, self.dtype, self.builder)
        # Model FLOPs of the traced batch (`costmodel.model_flops`): every rank computes at least its share.
        self.traced_model_flops = model_flops(self.chain)
        if self.options.tie_band is not None:
            self.ties = TieSet(self.options.tie_band)

    def kth_best(self) -> float:
        k = self.options.top_k
        return self.found[k - 1].objective if len(self.found) >= k else math.inf

    def target(self) -> float:
        """Bounds at or above this cannot hide a strategy better than the K-th best by more than the relative gap
        (`SearchOptions.relative_gap`): once none is left below it, the K best are proven within the gap."""
        return self.kth_best() / (1 + self.options.relative_gap)

    def cutoff(self) -> float:
        """Bounds at or above this can change nothing: neither the K best (within the gap) nor the simplest tied
        strategy."""
        kth = self.target()
        if self.ties is None or not self.found:
            return kth
        return max(kth, self.ties.cutoff(self.found[0]))

    def may_matter(self, lb: float, depth: int, payload: int) -> bool:
        """Whether a heap entry with bound `lb` below `cutoff` must still be explored: it could be among the K
        best, or become the simplest strategy tied with the best."""
        if lb < self.target() or self.ties is None:
            return True
        if depth == 0:
            return self.ties.may_lead(self.found[0], payload, None)
        if depth == 1:
            return self.ties.may_lead(self.found[0], self.groups[payload].mesh.num_devices, None)
        cand = self.candidates[payload]
        m = cand.mesh
        floor = simplicity_floor(tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, zero_stage=cand.zero_stage,
                                 num_microbatches=cand.num_microbatches, virtual_stages=cand.virtual_stages,
                                 zero_bubble=cand.schedule.zero_bubble, offload=cand.runtime.offload)
        return self.ties.may_lead(self.found[0], m.num_devices, floor)

    def ranked_found(self) -> list[Found]:
        """The K best, then the simplest strategies tied with the best that are not among them."""
        if self.ties is None or not self.found:
            return list(self.found)
        extra = [t for t in self.ties.tied(self.found[0]) if t not in self.found][:TIE_LEADS]
        return [*self.found, *extra]

    def price_factor(self, cand: Candidate) -> float:
        return self.devices_price(cand.mesh.num_devices)

    def devices_price(self, n: int) -> float:
        """What the objective multiplies a step time by on n devices: 1, or their price per second."""
        if self.options.objective is not Objective.COST:
            return 1.0
        if n not in self._price:
            self._price[n] = price_per_second(self.cluster, n)
        return self._price[n]

    def options_for(self) -> tuple[Recompute, ...]:
        return (self.space.recompute,) if self.space.recompute is not None else tuple(Recompute)

    def out_of_time(self, fraction: float = 1.0, extra_s: float = 0.0) -> bool:
        """Whether `fraction` of the time limit, plus `extra_s`, has passed (never without a limit)."""
        limit = self.options.time_limit_s
        return limit is not None and time.monotonic() - self.started > fraction * limit + extra_s

    def first_plan(self, heap: list[tuple[float, int, tuple, int]]) -> None:
        """Find some plan fast, for a time limit that would otherwise pass before the first one.

        Best-first order refines (solves the sharding ILPs of) many tensor-parallel candidates before it solves
        any; within a short limit that can use up all the time. This visits, in bound order, only the candidates
        that need no new sharding solve -- already refined, or tp == 1 -- until one fits. The rest go back to the
        heap, so its smallest bound stays a valid lower bound on everything unexplored."""
        kept = []
        while heap and not self.found and not self.out_of_time(extra_s=NO_PLAN_GRACE_S):
            entry = heapq.heappop(heap)
            lb, depth, _, payload = entry
            if depth == 1:  # listing a mesh's candidates solves nothing
                self._unbounded.discard(payload)
                self.expand_mesh(lb, payload, heap)
            elif depth == 3 or (depth == 2 and self.candidates[payload].mesh.tp == 1):
                # A candidate whose least memory cannot fit is not built (at tp = 1 its floor solves nothing).
                if depth == 3 or self.fits_at_least(self.candidates[payload]):
                    self.visit(self.candidates[payload])
            else:
                kept.append(entry)
        for entry in kept:
            heapq.heappush(heap, entry)

    def bound(self, cand: Candidate) -> float:
        """Level-1 lower bound on the candidate's objective (`CandidateBounds.cheap`); inf when its parameter
        state alone cannot fit, which the mesh's record keeps for the explanation."""
        lb, need = self.bounds.cheap(cand)
        if need is not None:
            return self._does_not_fit(cand.mesh, need)
        return lb * self.price_factor(cand)

    def mesh_bound(self, options: MeshOptions) -> float:
        """Level-1 lower bound of a mesh: the least `bound` of its candidates (`CandidateBounds.mesh_floor`)."""
        lb, need = self.bounds.mesh_floor(options)
        if need is not None:
            self._does_not_fit(options.mesh, need)
        if not math.isfinite(lb):
            return math.inf
        return lb * self.devices_price(options.mesh.num_devices)

    def refine(self, cand: Candidate) -> float:
        """Level-2 lower bound from the candidate's own layer prices (`CandidateBounds.tight`); inf when even its
        least memory cannot fit (`fits_at_least`)."""
        if not self.fits_at_least(cand):
            return math.inf
        return self.bounds.tight(cand) * self.price_factor(cand)

    def fits_at_least(self, cand: Candidate) -> bool:
        """Whether the candidate's least memory (`CandidateBounds.memory_floor`) fits its largest device; when it
        does not, the mesh's record keeps the bytes."""
        need = self.bounds.memory_floor(cand, self.options_for())
        if need > max(pl.device.memory_bytes for pl in self.builder.placements(cand)):
            self._does_not_fit(cand.mesh, need)
            return False
        return True

    def _does_not_fit(self, m: MeshCandidate, need: float) -> float:
        """The bound of a candidate that cannot fit: inf; its mesh's record keeps the least memory seen needed."""
        rec = self.meshes.setdefault((m.dp, m.tp, m.pp), MeshRecord())
        rec.memory_need_bytes = min(rec.memory_need_bytes, need)
        return math.inf

    def visit(self, cand: Candidate) -> None:
        rec = self.meshes.setdefault((cand.mesh.dp, cand.mesh.tp, cand.mesh.pp), MeshRecord())
        factor = self.price_factor(cand)
        mesh_best = rec.best.objective if rec.best is not None else math.inf
        # Solve to beat the K-th best (a plan), or this mesh's best so far within the slack (an alternative).
        kth = self.kth_best()
        bound = max(kth, min(mesh_best, kth * (1 + self.options.explain_slack)), self.cutoff()) / factor
        built = self.builder.build(cand, self.options_for(), upper_bound=bound, partial=self.space.recompute is None,
                                   quick_unfit=True, defer_ties=True)
        if built is None:
            return
        self.solved += 1
        if isinstance(built, Unfit):
            rec.memory_need_bytes = min(rec.memory_need_bytes, built.need_bytes)
            return
        if isinstance(built, Beaten):
            rec.beyond_slack = True
            return
        part, proven = solve_partition_until(built.problem, upper_bound=bound, deadline=self.partition_deadline())
        if part is not None and built.with_preferred is not None:  # the same optimum, with the even split on ties
            part, proven = solve_partition_until(built.with_preferred(), upper_bound=bound,
                                                 deadline=self.partition_deadline())
        if not proven:  # cut by the time limit: the candidate may still hold a better partition
            self.unproven_bound = min(self.unproven_bound, partition_lower_bound(built.problem) * factor)
        if part is None:
            if not built.pruned and not math.isfinite(partition_lower_bound(built.problem)):
                rec.memory_need_bytes = min(rec.memory_need_bytes, least_memory_of(built))
            else:
                rec.beyond_slack = True
            return
        stages = built.stages(part)
        strategy = cand.strategy(stages, summary_recompute(stages))
        found = Found(part.objective * factor, self.solved, cand, part.objective, strategy)
        if rec.best is None or found < rec.best:
            rec.best = found
        if self.ties is not None:
            self.ties.add(found)
        if found.objective < self.kth_best():
            self.found.append(found)
            self.found.sort()
            del self.found[self.options.top_k:]

    def partition_deadline(self) -> float | None:
        """When a partition solve stops with its best so far: the time limit (with the grace for a first plan
        while there is none); None without a limit."""
        limit = self.options.time_limit_s
        if limit is None:
            return None
        return self.started + limit + (0.0 if self.found else NO_PLAN_GRACE_S)

    def device_bound(self, num_devices: int) -> float:
        """Level-0 bound of every candidate on `num_devices` devices: the step's FLOPs at the dense peak of the
        fastest device type (no op runs faster than peak, and a rank's work is at least its share)."""
        flops = self.traced_model_flops * self.global_batch / self.chain.graph.batch_size
        peak = max(g.device.flops(self.dtype) for g in self.cluster.groups)
        lb = compute_lower_bound_s(flops, num_devices, peak)
        if self.options.objective is Objective.COST:
            lb *= price_per_second(self.cluster, num_devices)
        return lb

    def expand_deadline(self) -> float:
        """When a device count's expansion stops bounding its candidates: the limit once a plan is found, before
        that the point where `first_plan` takes over; never without a limit."""
        limit = self.options.time_limit_s
        if limit is None:
            return math.inf
        return self.started + limit * (1.0 if self.found else FIRST_PLAN_FRACTION)

    def expand(self, lb: float, num_devices: int, heap: list[tuple[float, int, tuple, int]],
               deadline: float) -> int:
        """Push the meshes on `num_devices` devices at their level-1 bound (`mesh_bound`).

        Bounding them all can take a while on a large job (hundreds of meshes, each over its shapes), so past
        `deadline` the rest go in at the device count's own bound `lb` (valid for each of them) and are bounded
        when popped. Returns how many it bounded."""
        first = len(self.groups)
        groups = mesh_options_for(num_devices, self.chain, self.cluster, self.global_batch, self.space, self.invalid)
        self.groups.extend(groups)
        for i, options in enumerate(groups):
            if time.monotonic() > deadline:
                for j in range(i, len(groups)):
                    heapq.heappush(heap, (lb, 1, groups[j].sort_key, first + j))
                self._unbounded.update(range(first + i, first + len(groups)))
                return i
            heapq.heappush(heap, (max(lb, self.mesh_bound(options)), 1, options.sort_key, first + i))
        return len(groups)

    def expand_mesh(self, lb: float, index: int, heap: list[tuple[float, int, tuple, int]]) -> int:
        """Push the candidates of mesh `groups[index]` at their level-1 bound (`bound`); returns how many."""
        first = len(self.candidates)
        cands = self.groups[index].candidates()
        self.candidates.extend(cands)
        for i, cand in enumerate(cands):
            heapq.heappush(heap, (max(lb, self.bound(cand)), 2, cand.sort_key, first + i))
        return len(cands)

    def process(self, entry: tuple[float, int, tuple, int], heap: list[tuple[float, int, tuple, int]],
                report: SearchReporter | None) -> float:
        """Expand (a device count or a mesh), refine (a candidate at level 1) or solve (at level 2) one popped
        heap entry, pushing what follows onto `heap`; returns the work it took (`WorkUnits`), also added to
        `work`."""
        lb, depth, key, payload = entry
        solves = self.builder.table.solves
        if depth == 0:
            work = self.expand(lb, payload, heap, self.expand_deadline()) * WorkUnits.BOUND
        elif depth == 1 and payload in self._unbounded:  # left unbounded by an expansion the clock cut short
            self._unbounded.discard(payload)
            heapq.heappush(heap, (max(lb, self.mesh_bound(self.groups[payload])), 1, key, payload))
            work = WorkUnits.BOUND
        elif depth == 1:
            work = self.expand_mesh(lb, payload, heap) * WorkUnits.BOUND
        elif depth == 2 and (again := self.bound(self.candidates[payload])) > lb * (1 + 1e-12):
            # Its level-1 bound has grown since it was pushed (its tp is priced now): back in at it, unrefined.
            heapq.heappush(heap, (again, 2, key, payload))
            work = WorkUnits.BOUND
        elif depth == 2:
            heapq.heappush(heap, (max(lb, self.refine(self.candidates[payload])), 3, key, payload))
            work = WorkUnits.REFINE
        else:
            self.visit(self.candidates[payload])
            work = WorkUnits.VISIT_PER_16_SEGMENTS * max(1.0, len(self.chain.segments) / 16)
        if report:
            report(Phase.SEARCH if depth == 3 else Phase.PRICE, lb)
        work += (self.builder.table.solves - solves) * WorkUnits.LAYER_SOLVE
        self.work += work
        return work

    def stop_for_time(self, lb: float) -> bool:
        """Whether the limit has passed with a plan found (the caller stops); raises `TimeLimitError` when it
        has passed with none within `NO_PLAN_GRACE_S` more. `lb`: the smallest bound still to explore."""
        if self.out_of_time() and self.found:
            return True
        if not self.found and self.out_of_time(extra_s=NO_PLAN_GRACE_S):
            raise TimeLimitError(out_of_time_message(self.options.time_limit_s, NO_PLAN_GRACE_S, self.solved,
                                                     len(self.candidates)))
        return False

    def best_first(self, heap: list[tuple[float, int, tuple, int]], skipped: list[tuple[float, int, tuple, int]],
                   report: SearchReporter | None) -> float | None:
        """Pop the smallest bound until it reaches the cutoff (None) or the time limit passes (the smallest
        bound left, when it is below the K-th best: the result is cut short). Entries that cannot matter go
        to `skipped`."""
        rushed = False
        while heap:
            if not self.found and not rushed and self.out_of_time(FIRST_PLAN_FRACTION):
                rushed = True
                self.first_plan(heap)
                if not heap:
                    break
            lb, depth, key, payload = heap[0]
            if not math.isfinite(lb) or lb >= self.cutoff():
                break
            if self.stop_for_time(lb):
                # Past the K-th best only the search for a simpler tie is cut short: the K best are proven.
                return lb if lb < self.target() else None
            heapq.heappop(heap)
            if not self.may_matter(lb, depth, payload):
                skipped.append((lb, depth, key, payload))
                continue
            self.process((lb, depth, key, payload), heap, report)
        return None

    def run(self, device_counts: Sequence[int]) -> tuple[bool, float]:
        """Best-first branch and bound; returns (cut short, smallest unexplored bound).

        Heap entries are (bound, depth, fixed order, payload), depth 0 a device count, 1 a mesh, 2 and 3 a
        candidate at its level-1 and level-2 bound. A device count popped below the incumbent expands into its
        meshes, a mesh into its candidates at their level-1 bound. A candidate popped at level 1 below the
        incumbent is refined to its level-2 bound (solving its layer sharding) and pushed back; popped at level 2
        below the incumbent, it is solved exactly. Nothing is popped once the smallest bound reaches the K-th
        best objective, which proves the K best optimal."""
        heap: list[tuple[float, int, tuple, int]] = [(self.device_bound(n), 0, (-n,), n) for n in device_counts]
        heapq.heapify(heap)
        report = SearchReporter.of(self)
        skipped: list[tuple[float, int, tuple, int]] = []
        # Under a time limit the families take turns (`fair_share`): the plan found in time is near the best.
        if self.options.time_limit_s is None:
            cut = self.best_first(heap, skipped, report)
        else:
            cut = fair_share(self, heap, skipped, report)
        if cut is not None:
            if report:
                report.done(cut)
            return True, cut
        heap.extend(skipped)
        heapq.heapify(heap)
        self.pruned = 0
        for lb_left, depth_left, _, payload_left in heap:  # what is known of the candidates never solved
            if depth_left == 0:
                continue
            if depth_left == 1:  # a mesh never listed: its candidates are pruned at its bound
                mesh, count = self.groups[payload_left].mesh, self.groups[payload_left].count
            else:
                mesh, count = self.candidates[payload_left].mesh, 1
            self.pruned += count
            rec = self.meshes.setdefault((mesh.dp, mesh.tp, mesh.pp), MeshRecord())
            rec.lower_bound = min(rec.lower_bound, lb_left)
        if report:
            report.done(heap[0][0] if heap else math.inf)
        return False, heap[0][0] if heap else math.inf


def check_fp8(cluster: Cluster, runtime: RuntimeOptions, what: str = "--fp8") -> None:
    """Raise UserError when `runtime` trains in FP8 on a cluster with a device without FP8 tensor cores; `what`
    names where the FP8 setting came from."""
    if runtime.fp8 is not None and (why := fp8_problem(g.device for g in cluster.groups)):
        raise UserError(f"{what} {runtime.fp8.value}: {why}")


def search(chain: LayerChain, cluster: Cluster, *, global_batch: int, space: SearchSpace | None = None,
           options: SearchOptions | None = None, dtype: str = "bfloat16", profile=None,
           table: LayerCostTable | None = None) -> SearchResult:
    """The best strategies for training `chain` on `cluster` with `global_batch` samples per step.

    Raises InfeasibleError when no strategy of the space fits in memory, UserError for an empty space (pins that
    contradict the cluster or batch)."""
    if options is not None and options.time_limit_s is not None and (space is None or space.tp != 1):
        # Load the sharding solver (OR-Tools, about a second to import) before the clock starts: a time limit
        # bounds the search, not the one-time loading of its libraries. With tp pinned to 1 (a re-plan's
        # neighbourhood of a plan without tensor parallelism) nothing is sharded: it is never loaded.
        import planner.search.intra_op  # noqa: F401
    started = time.monotonic()
    space = space or SearchSpace()
    check_fp8(cluster, space.runtime)
    options = options or SearchOptions()
    if global_batch < 1:
        raise UserError(f"--batch must be a positive integer, got {global_batch}")
    runtime = space.runtime  # a table's prices hold for one chain and one FP8, dispatch and weight-split setting
    chain = runtime.priced_chain(chain)
    if table is None or table.chain is not chain or not table.prices_for(runtime):
        table = LayerCostTable.for_runtime(chain, cluster, runtime, dtype=dtype, profile=profile)
    builder = StageProblemBuilder(chain, cluster, table, dtype)
    state = SearchState(chain, cluster, global_batch, space, options, dtype, builder, started)
    counts = device_counts(cluster, space, options.objective)
    cut_short, next_bound = state.run(counts)
    if math.isfinite(state.unproven_bound):
        cut_short, next_bound = True, min(next_bound, state.unproven_bound)
    if not state.found:
        candidates, invalid = enumerate_candidates(chain, cluster, global_batch, space, options.objective)
        if not candidates:
            raise UserError(empty_space_message(chain, cluster, global_batch, space, invalid))
        raise InfeasibleError(nothing_fits_message(state, space))
    ranked = tuple(_finish(state, f) for f in state.ranked_found())
    fastest = ranked[0].objective
    if options.tie_band is not None:  # the plan is the simplest strategy tied with the fastest
        ranked = tuple(prefer_simplest(ranked))
    best = ranked[0].objective
    # Without a cut the bounds left are at least the fastest over (1 + gap): proven within the gap.
    lower = min(fastest, next_bound)
    gap = (best - lower) / best if best > 0 else 0.0
    alternatives = explain_alternatives(state, ranked[0], state.invalid)
    return SearchResult(
        ranked=ranked, alternatives=alternatives, status="feasible" if cut_short else "optimal",
        cut_short=cut_short, lower_bound=lower, optimality_gap=gap, candidates=state.solved, pruned=state.pruned,
        layer_solves=table.solves, time_s=time.monotonic() - started)


def _finish(state: SearchState, found: Found) -> RankedStrategy:
    cand = found.candidate
    placements = state.builder.placements(cand)
    costs = layer_cost_map(state.builder, cand, placements)
    est = costmodel_estimate(state.chain, state.cluster, found.strategy, layer_costs=costs, dtype=state.dtype,
                             profile=state.builder.table.profile, global_batch=state.global_batch)
    return RankedStrategy(candidate=cand, strategy=found.strategy, objective=found.objective,
                          predicted_step_time_s=found.step_time_s, estimate=est,
                          sharding=sharding_of(state.builder, cand, placements), layer_costs=costs)
