"""Re-planning when the cluster changes: a device slows down or fails, a link gets faster, prices move.

`replan(old_plan, chain, new_cluster)` looks at four kinds of plan and picks one:

- **keep**: the old strategy as it is, priced on the new cluster (when it still has the devices);
- **re-partition**: the old mesh, micro-batching, schedule and ZeRO stage with the stage partition and the
  recomputation solved again for the new speeds (the search's exact partition DP on one candidate);
- **search**: the best strategies of a search on the new cluster. With `ReplanScope.NEIGHBOURHOOD` (the default)
  the search keeps the old plan's intra-layer sharding -- its tensor-, context- and expert-parallel degrees and
  sequence parallelism -- and its schedule family, and is free in everything a slow or failed device calls for:
  data- and pipeline-parallel degrees, the rank order, micro-batching, ZeRO, stages and recomputation.
  `ReplanScope.FULL` searches the whole space.
- **exclude** (on request): when some devices run below nominal speed, the same search on the cluster without
  them (the plan then marks them unavailable: the job leaves them out rather than waiting for them).

The fastest of them sets the bar; the plan chosen is the one closest to the old plan (`plan_distance`) among
those at most `stickiness` slower than the fastest (ties: the faster). So a small gain does not reshuffle a
running job, and a large one does.

Sub-results are reused through a `PlanningSession`: per-class layer prices (with the intra-op sharding ILP's
solutions) depend on the device types and links, not on speeds, failures or prices, so a session keeps one
`LayerCostTable` per *pricing signature* of the cluster (`pricing_signature`) and every later plan on a cluster
with the same signature starts from those prices.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from costmodel.breakdown import Estimate
from costmodel.estimate import estimate as costmodel_estimate
from costmodel.hardware.cluster import Cluster
from costmodel.layer_cost import LayerCost
from costmodel.model_flops import model_flops
from costmodel.pipeline import stage_rank
from costmodel.strategy import Offload, Recompute, RuntimeOptions, Strategy
from ir.layer_chain import LayerChain
from planner.errors import PlanLoadError, UserError
from planner.plan import Alternative, ModuleSharding, Plan, SearchInfo
from planner.progress import ProgressCallback
from planner.search.branch_and_bound import check_fp8, search
from planner.search.candidates import Candidate
from planner.search.device_groups import with_device_groups
from planner.search.layer_costs import LayerCostTable
from planner.search.meshes import compute_lower_bound_s
from planner.search.outcome import SearchOptions, SearchResult
from planner.search.pricing import layer_cost_map, sharding_of, summary_recompute
from planner.search.space import SearchSpace
from planner.search.stage_partition import solve_partition
from planner.search.stage_problem import StageProblemBuilder
from planner.strategy_label import Detail, strategy_label

DEFAULT_STICKINESS = 0.02
"""Accept a plan up to 2% slower than the fastest when it changes less (about the run-to-run noise of a step)."""


class ReplanScope(enum.StrEnum):
    """How much of the search space a re-plan explores."""

    NEIGHBOURHOOD = "neighbourhood"   # keep tp / cp / ep / sp and the schedule family (module docstring)
    FULL = "full"                     # the whole space, as `stratagem plan`


class OptionKind(enum.StrEnum):
    KEEP = "keep"                # the old strategy as it is
    REPARTITION = "repartition"  # the old strategy with its stages and recomputation solved again
    SEARCH = "search"            # a search on the new cluster
    EXCLUDE = "exclude"          # a search on the new cluster without its slowed devices


# ---- sessions: reusable sub-results --------------------------------------------------------------------------


def pricing_signature(cluster: Cluster) -> str:
    """What per-class layer prices depend on: device types, node shapes and links -- the cluster without its
    name, speeds, failures and prices. Two clusters with the same signature price every layer alike."""
    d = cluster.to_dict()
    groups = [{k: v for k, v in g.items() if k not in ("slowdown", "unavailable", "price_per_device_hour", "name")}
              for g in d["groups"]]
    return json.dumps({"groups": groups, "tiers": d["tiers"]}, sort_keys=True)


@dataclass
class PlanningSession:
    """One model's chain planned on cluster after cluster, keeping its layer-price tables between plans.

    Not global state: create one per model (and dtype) and pass it to `replan` / `search_in`."""

    chain: LayerChain
    dtype: str = "bfloat16"
    profile: Any = None
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions)
    """How the plans' trainer runs (its FP8, expert dispatch, weight split and kept inputs): the tables' prices
    hold for one such setting (`LayerCostTable.prices_for`)."""
    tables: dict[str, LayerCostTable] = field(default_factory=dict)
    reused: int = 0
    """How many times a table was found for a cluster (a warm start)."""

    def table_for(self, cluster: Cluster) -> LayerCostTable:
        key = pricing_signature(cluster)
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = LayerCostTable.for_runtime(self.chain, cluster, self.runtime, dtype=self.dtype,
                                                                  profile=self.profile)
        else:
            self.reused += 1
        return table

    def search(self, cluster: Cluster, *, global_batch: int, space: SearchSpace | None = None,
               options: SearchOptions | None = None) -> SearchResult:
        """`planner.search.branch_and_bound.search` with this session's table for the cluster."""
        return search(self.chain, cluster, global_batch=global_batch, space=space, options=options,
                      dtype=self.dtype, profile=self.profile, table=self.table_for(cluster))


# ---- distance between plans ----------------------------------------------------------------------------------

_DEGREES = ("dp", "tp", "pp", "cp", "ep", "microbatch_size", "num_microbatches", "zero_stage", "sequence_parallel")


def _stage_of_segments(strategy: Strategy, num_segments: int) -> list[int]:
    """Pipeline rank of every segment (-1 where the strategy gives no stages)."""
    out = [-1] * num_segments
    for j, st in enumerate(strategy.stages):
        for i in range(st.start, min(st.stop, num_segments)):
            out[i] = stage_rank(strategy.schedule, strategy.pp, j)
    return out


def plan_distance(old: Strategy, new: Strategy, num_segments: int) -> float:
    """How much a switch from `old` to `new` changes: one per changed degree or setting (dp, tp, pp, cp, ep,
    micro-batch size and count, ZeRO stage, sequence parallelism, schedule and its chunks, rank order), plus the
    fraction of layer-chain segments that move to another pipeline rank or change their recomputation."""
    changed = sum(getattr(old, f) != getattr(new, f) for f in _DEGREES)
    changed += (old.schedule, old.virtual_stages) != (new.schedule, new.virtual_stages)
    changed += old.mesh_order != new.mesh_order and old.dp > 1 and old.pp > 1
    a, b = _stage_of_segments(old, num_segments), _stage_of_segments(new, num_segments)
    ra, rb = _recompute_of_segments(old, num_segments), _recompute_of_segments(new, num_segments)
    moved = sum(1 for i in range(num_segments) if a[i] != b[i] or ra[i] != rb[i])
    return changed + moved / max(num_segments, 1)


def _recompute_of_segments(strategy: Strategy, num_segments: int) -> list[str]:
    out = [strategy.recompute.value] * num_segments
    for st in strategy.stages:
        for i in range(st.start, min(st.stop, num_segments)):
            out[i] = st.segment_recompute(i).value
    return out


# ---- the re-plan ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplanOption:
    """One plan the re-plan considered."""

    kind: OptionKind
    strategy: Strategy
    estimate: Estimate
    sharding: tuple[ModuleSharding, ...]
    distance: float
    """`plan_distance` from the old plan."""

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s

    @property
    def label(self) -> str:
        return f"{self.kind.value}: {strategy_label(self.strategy, Detail.CANDIDATE)}"


@dataclass(frozen=True)
class Replan:
    plan: Plan
    """The chosen plan on the new cluster."""
    chosen: ReplanOption
    fastest: ReplanOption
    kept: ReplanOption | None
    """The old strategy priced on the new cluster (None when it cannot run there)."""
    options: tuple[ReplanOption, ...]
    scope: ReplanScope
    stickiness: float
    time_s: float
    warm_start: bool
    """Whether the layer prices came from an earlier plan of the session."""
    search: SearchResult


def _without_device_groups(strategy: Strategy) -> Strategy:
    return dataclasses.replace(strategy, stages=tuple(dataclasses.replace(s, device_group=None)
                                                      for s in strategy.stages))


def _priced(builder: StageProblemBuilder, cluster: Cluster, strategy: Strategy, global_batch: int, dtype: str,
            profile: Any) -> tuple[Estimate, tuple[ModuleSharding, ...], Mapping[tuple[int, str], LayerCost]] | None:
    cand = Candidate.of(strategy)
    placements = builder.placements(cand)
    if placements is None:
        return None
    costs = layer_cost_map(builder, cand, placements)
    try:
        est = costmodel_estimate(builder.chain, cluster, strategy, layer_costs=costs, dtype=dtype, profile=profile,
                                 global_batch=global_batch)
    except ValueError:
        return None
    return est, sharding_of(builder, cand, placements), costs


def _repartitioned(builder: StageProblemBuilder, strategy: Strategy) -> Strategy | None:
    """The old candidate with its stage partition and recomputation solved again (None if nothing fits)."""
    cand = Candidate.of(strategy)
    built = builder.build(cand, tuple(Recompute), partial=True)
    if built is None:
        return None
    part = solve_partition(built.problem)
    if part is None:
        return None
    stages = built.stages(part)
    return cand.strategy(stages, summary_recompute(stages))


def neighbourhood(old: Strategy, space: SearchSpace | None = None) -> SearchSpace:
    """The search space of a `ReplanScope.NEIGHBOURHOOD` re-plan (module docstring), on top of `space`'s pins."""
    base = space or SearchSpace()
    pins: dict[str, Any] = {"tp": old.tp, "cp": old.cp, "ep": old.ep}
    if old.tp > 1:
        pins["sequence_parallel"] = old.sequence_parallel
    pins["schedule"] = old.schedule
    # A pin the caller already gave wins (the caller asked for it explicitly).
    given = base.pinned()
    return base.with_changes(**{k: v for k, v in pins.items() if k not in given})


def replan(old: Plan, chain: LayerChain, cluster: Cluster, *, session: PlanningSession | None = None,
           stickiness: float = DEFAULT_STICKINESS, scope: ReplanScope | str = ReplanScope.NEIGHBOURHOOD,
           space: SearchSpace | None = None, top_k: int = 1, time_limit_s: float | None = None,
           exclude_slowed: bool = False, progress: ProgressCallback | None = None) -> Replan:
    """Re-plan `old` (made for `chain`) on `cluster` (module docstring).

    `top_k`: how many of the search's best strategies to consider (more: more choice for the stickiness, a
    slower search). `exclude_slowed`: also plan without the devices that run below nominal speed (one more
    search; the chosen plan's cluster then marks them unavailable: the job leaves them out). `progress` receives
    the searches' `planner.progress.PlanProgress` records.

    Raises PlanLoadError when the plan is for another model, UserError for a negative stickiness, and what the
    search raises (InfeasibleError, UserError) when nothing runs on the new cluster."""
    started = time.monotonic()
    scope = ReplanScope(scope)
    _check_inputs(old, chain, stickiness)
    check_fp8(cluster, old.strategy.runtime, what="the plan trains linear layers in FP8,")
    dtype = old.training.dtype
    runtime = old.strategy.runtime
    priced = runtime.priced_chain(chain)  # with the kernels the old plan was priced with
    if (session is None or session.chain is not priced
            or LayerCostTable.pricing_key(session.runtime) != LayerCostTable.pricing_key(runtime)):
        session = PlanningSession(priced, dtype=dtype, runtime=runtime)
    # The trainer stays the same: the new plan keeps the old one's runtime options (FP8 also keeps the numerics)
    # unless the caller's space says otherwise; offload is searched again, and DualPipe's all-to-all overlap is
    # priced only for a given strategy.
    space = space or SearchSpace(runtime=dataclasses.replace(runtime, offload=Offload.NONE, ep_overlap=False))
    warm = pricing_signature(cluster) in session.tables
    builder = StageProblemBuilder(priced, cluster, session.table_for(cluster), dtype)
    old_strategy = _without_device_groups(old.strategy)
    found = _Options(old, session.profile)
    kept = found.add_kept(old_strategy, cluster, builder)
    searched_space = neighbourhood(old_strategy, space) if scope is ReplanScope.NEIGHBOURHOOD else space
    result = session.search(cluster, global_batch=old.training.global_batch, space=searched_space,
                            options=SearchOptions.for_users(top_k=top_k, time_limit_s=time_limit_s,
                                                            explain_slack=0.0, progress=progress))
    for r in result.ranked:
        found.add(OptionKind.SEARCH, r.strategy, cluster, builder)
    if exclude_slowed and (without := _search_without_slowed(session, cluster, old.training.global_batch,
                                                             searched_space, time_limit_s, progress)):
        smaller, excluded = without
        found.add(OptionKind.EXCLUDE, excluded.best.strategy, smaller,
                  StageProblemBuilder(priced, smaller, session.table_for(smaller), dtype))
    chosen, fastest = _choose(found.options, stickiness)
    elapsed = time.monotonic() - started
    plan = _plan(old, chain, found.priced_on[id(chosen)], chosen, fastest, found.options, result, scope, elapsed,
                 dtype)
    return Replan(plan=plan, chosen=chosen, fastest=fastest, kept=kept, options=tuple(found.options), scope=scope,
                  stickiness=stickiness, time_s=elapsed, warm_start=warm, search=result)


class _Options:
    """The options a re-plan chooses from, each priced on the cluster it runs on (the new one, or the new one
    without its slowed devices); a strategy found twice on one cluster is kept once."""

    def __init__(self, old: Plan, profile: Any) -> None:
        self.old, self.profile = old, profile
        self.options: list[ReplanOption] = []
        self.priced_on: dict[int, Cluster] = {}
        """id(option) -> the cluster it was priced on."""

    def add(self, kind: OptionKind, strategy: Strategy, on: Cluster, builder: StageProblemBuilder) -> None:
        """Price `strategy` on `on` and keep it when it fits."""
        training = self.old.training
        priced = _priced(builder, on, strategy, training.global_batch, training.dtype, self.profile)
        if priced is None or not priced[0].fits:
            return
        strategy = with_device_groups(on, strategy)
        if any(o.strategy == strategy and self.priced_on[id(o)] is on for o in self.options):
            return  # found twice (the re-partition of a one-stage plan is the plan itself)
        distance = plan_distance(self.old.strategy, strategy, len(builder.chain.segments))
        option = ReplanOption(kind, strategy, priced[0], priced[1], distance)
        self.priced_on[id(option)] = on
        self.options.append(option)

    def add_kept(self, old_strategy: Strategy, cluster: Cluster, builder: StageProblemBuilder
                 ) -> ReplanOption | None:
        """The old strategy as it is and with its stages solved again, when the cluster still has its devices;
        returns the kept option (None when it no longer fits)."""
        if old_strategy.num_devices > cluster.num_available:
            return None
        self.add(OptionKind.KEEP, old_strategy, cluster, builder)
        again = _repartitioned(builder, old_strategy)
        if again is not None:
            self.add(OptionKind.REPARTITION, again, cluster, builder)
        return self.options[0] if self.options and self.options[0].kind is OptionKind.KEEP else None


def _choose(options: Sequence[ReplanOption], stickiness: float) -> tuple[ReplanOption, ReplanOption]:
    """(chosen, fastest): the option nearest the old plan among those within `stickiness` of the fastest."""
    if not options:
        raise UserError("no plan fits on the new cluster")
    fastest = min(options, key=lambda o: (o.step_time_s, o.distance))
    near = [o for o in options if o.step_time_s <= fastest.step_time_s * (1 + stickiness)]
    return min(near, key=lambda o: (o.distance, o.step_time_s)), fastest


def _check_inputs(old: Plan, chain: LayerChain, stickiness: float) -> None:
    if not (stickiness >= 0 and math.isfinite(stickiness)):
        raise UserError(f"stickiness must be a fraction >= 0 (0.02 = 2%), got {stickiness!r}")
    import ir

    if ir.fingerprint(chain.graph) != old.model.fingerprint:
        raise PlanLoadError(f"the plan was made for another model (fingerprint {old.model.fingerprint[:12]}, this "
                            f"model {ir.fingerprint(chain.graph)[:12]}); plan it with `stratagem plan`")


def _search_without_slowed(session: PlanningSession, cluster: Cluster, batch: int, space: SearchSpace | None,
                           time_limit_s: float | None,
                           progress: ProgressCallback | None) -> tuple[Cluster, SearchResult] | None:
    """(the cluster with its slowed devices marked unavailable, the search there), or None when no device is
    slowed, all are, or nothing runs without them."""
    slowed = [r for r in cluster.available_ranks() if cluster.speed_of(r) < 1.0]
    if not slowed or len(slowed) >= cluster.num_available:
        return None
    without = cluster
    for r in slowed:
        without = without.with_speed(r, 0.0)
    try:
        return without, session.search(without, global_batch=batch, space=space,
                                       options=SearchOptions.for_users(time_limit_s=time_limit_s, explain_slack=0.0,
                                                                       progress=progress))
    except UserError:  # nothing runs without them
        return None


def _plan(old: Plan, chain: LayerChain, cluster: Cluster, chosen: ReplanOption, fastest: ReplanOption,
          options: Sequence[ReplanOption], result: SearchResult, scope: ReplanScope, elapsed: float,
          dtype: str) -> Plan:
    """The chosen option as a `Plan`; the other options are its alternatives, with why they lost."""
    alternatives = []
    for o in sorted(options, key=lambda o: (o.step_time_s, o.distance, o.label)):
        if o is chosen:
            continue
        pct = 100.0 * (o.step_time_s - chosen.step_time_s) / chosen.step_time_s
        if o.step_time_s < chosen.step_time_s:
            reason = (f"{pct:+.1f}% step time but changes more (distance {o.distance:.2f} vs "
                      f"{chosen.distance:.2f}; within the stickiness)")
        else:
            reason = f"{pct:+.1f}% step time (distance {o.distance:.2f})"
        alternatives.append(Alternative(o.label, o.step_time_s, reason))
    if scope is ReplanScope.FULL and not result.cut_short:
        status, lower = "optimal", fastest.step_time_s * (1 - result.optimality_gap)
    else:
        # A neighbourhood is not the whole space: the only proven bound is perfect scaling of the model FLOPs.
        graph = chain.graph
        flops = model_flops(chain) * old.training.global_batch / graph.batch_size
        best_rate = max(g.device.flops(dtype) * g.device.matmul_efficiency for g in cluster.groups)
        status, lower = "feasible", compute_lower_bound_s(flops, cluster.num_available, best_rate)
    lower = min(lower, chosen.step_time_s)
    gap = (chosen.step_time_s - lower) / chosen.step_time_s
    info = SearchInfo(time_s=elapsed, candidates=result.candidates + sum(o.kind is not OptionKind.SEARCH
                                                                         for o in options),
                      status=status, optimality_gap=gap, lower_bound_s=lower, alternatives=tuple(alternatives[:8]))
    return Plan(model=old.model, cluster=cluster.to_dict(), training=old.training, strategy=chosen.strategy,
                sharding=chosen.sharding, predicted=chosen.estimate, search=info)


# ---- what changed in the cluster -----------------------------------------------------------------------------


def cluster_changes(old: Cluster, new: Cluster) -> list[str]:
    """Readable differences between two clusters: devices, speeds, failures, links and prices."""
    out: list[str] = []
    if [(g.name, g.device.name, g.num_nodes, g.devices_per_node) for g in old.groups] != \
            [(g.name, g.device.name, g.num_nodes, g.devices_per_node) for g in new.groups]:
        def shape(c: Cluster) -> str:
            return " + ".join(f"{g.num_nodes}x{g.devices_per_node}x{g.device.name}" for g in c.groups)
        out.append(f"devices: {shape(old)} -> {shape(new)}")
        return out
    for r in range(new.num_devices):
        a, b = old.speed_of(r), new.speed_of(r)
        if a != b:
            what = {0.0: "unavailable"}
            out.append(f"rank {r} ({new.group_of(r).name} #{new.local_index(r)}): "
                       f"{what.get(a, f'speed {a:g}')} -> {what.get(b, f'speed {b:g}')}")
    for ta, tb in zip(old.tiers, new.tiers, strict=False):
        for f in ("bandwidth", "latency", "efficiency", "size"):
            if getattr(ta, f) != getattr(tb, f):
                out.append(f"tier {tb.name}: {f} {getattr(ta, f):.4g} -> {getattr(tb, f):.4g}")
    if [t.name for t in old.tiers] != [t.name for t in new.tiers]:
        out.append(f"tiers: {', '.join(t.name for t in old.tiers)} -> {', '.join(t.name for t in new.tiers)}")
    for ga, gb in zip(old.groups, new.groups, strict=True):
        if ga.price_per_device_hour != gb.price_per_device_hour:
            out.append(f"group {gb.name}: price {ga.price_per_device_hour} -> {gb.price_per_device_hour} per hour")
    return out
