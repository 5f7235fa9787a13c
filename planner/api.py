"""The planner's Python API: `plan` (search, then a `Plan`) and `estimate` (price one given strategy).

    plan = planner.api.plan(model, example_inputs, "128x8xa100-80gb", global_batch=1536)
    plan = planner.api.plan(chain, None, cluster, global_batch=1536, space=SearchSpace(tp=8))
    est = planner.estimate(chain, cluster, Strategy(dp=8, tp=8, pp=16, microbatch_size=1, num_microbatches=192))

`planner.estimate` solves the tensor-parallel sharding of every layer class (the same `LayerCostTable` the search
uses) and then calls `costmodel.estimate`, so the estimate of a searched plan's strategy is the plan's prediction.

A model of the registry is traced by name, through the trace cache, as `stratagem plan` traces it:

    traced = planner.api.trace_model("gpt3-175b", cache=TraceCache.default())
    plan = planner.api.plan(traced.chain, None, cluster, global_batch=1536, model_name=traced.name,
                            settings=traced.settings, progress=print)

`progress` receives a frozen `planner.progress.PlanProgress` record (phase, candidates priced, best so far,
lower bound, gap) at most every 0.1 s and once at the end.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ir
from costmodel.breakdown import Estimate
from costmodel.context_parallel import cp_problem
from costmodel.estimate import estimate as costmodel_estimate
from costmodel.estimate import recomputes
from costmodel.expert_parallel import ep_problem
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collective_fit import calibrated_cluster
from costmodel.pipeline import schedule_problem, split_backward_problem
from costmodel.profile_db import OpProfile
from costmodel.rank_layout import even_stages
from costmodel.strategy import Strategy
from costmodel.validation import error_band
from ir.graph import Graph
from ir.layer_chain import LayerChain
from planner.errors import UserError
from planner.plan import ModelInfo, ModuleSharding, Plan, SearchInfo, TrainingConfig
from planner.progress import Phase, PlanProgress, ProgressCallback
from planner.search.branch_and_bound import check_fp8, search
from planner.search.candidates import Candidate
from planner.search.device_groups import mixed_type_problem, with_device_groups
from planner.search.layer_costs import LayerCostTable
from planner.search.outcome import DEFAULT_RELATIVE_GAP, SearchOptions, SearchResult
from planner.search.pricing import layer_cost_map, sharding_of
from planner.search.space import Objective, SearchSpace
from planner.search.stage_problem import StageProblemBuilder
from planner.tracing import trace_model

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["as_chain", "as_cluster", "estimate", "estimate_plan", "load_profile", "plan", "plan_top", "settings_of",
           "trace_model", "validate_strategy"]


def as_chain(model_or_chain: nn.Module | Graph | LayerChain, inputs: Any = None, *, model_name: str = "model",
             dtype: str | None = None, progress: ProgressCallback | None = None) -> LayerChain:
    """A `LayerChain` from a chain, a traced graph, or a module and its example inputs (traced here at one sample,
    as `parallelize` and `stratagem plan` trace it: `planner.tracing`)."""
    if isinstance(model_or_chain, LayerChain):
        return model_or_chain
    if isinstance(model_or_chain, Graph):
        return ir.build_layer_chain(model_or_chain)
    # torch is imported here, not at the top: planning a chain (a cached trace) never needs it.
    import torch.nn as nn

    from planner.tracing import trace_one_sample

    if isinstance(model_or_chain, nn.Module):
        if inputs is None:
            raise ValueError("planning an nn.Module needs its example inputs (a tuple of tensors or TensorSpecs, "
                             "or a dict of keyword arguments)")
        if progress is not None:
            progress(PlanProgress(phase=Phase.TRACE))
        return trace_one_sample(model_or_chain, inputs, model_name=model_name, dtype=dtype)
    raise TypeError(f"expected an nn.Module, ir.Graph or ir.LayerChain, got {type(model_or_chain).__name__}")


def as_cluster(cluster: Cluster | str, profile: OpProfile | None = None) -> Cluster:
    """The cluster (parsed from a shorthand or YAML path), with the node links calibrated by the profile's
    collective fits when it has them (`costmodel.hardware.collective_fit.calibrated_cluster`)."""
    cluster = cluster if isinstance(cluster, Cluster) else Cluster.parse(cluster)
    if profile is None or profile.collectives is None:
        return cluster
    return calibrated_cluster(cluster, profile.collectives)


def load_profile(path: str) -> OpProfile:
    """A profile written by `stratagem profile`; every way it can be unreadable is a one-line `UserError`."""
    try:
        return OpProfile.load(path)
    except ValueError as e:
        raise UserError(f"--profile {path}: {' '.join(str(e).split())}") from None
    except OSError as e:
        raise UserError(f"--profile {path}: cannot read it: {e.strerror or e}") from None


def plan(model_or_chain: nn.Module | Graph | LayerChain, inputs_or_spec: Any, cluster: Cluster | str, *,
         global_batch: int, space: SearchSpace | None = None, objective: Objective | str = Objective.TIME,
         time_limit_s: float | None = None, dtype: str = "bfloat16", model_name: str | None = None,
         settings: Sequence[tuple[str, Any]] = (), progress: ProgressCallback | None = None,
         profile: OpProfile | None = None, simplest_tie: bool = True,
         relative_gap: float = DEFAULT_RELATIVE_GAP) -> Plan:
    """The best plan for training the model on `cluster` with `global_batch` samples per step (module docstring).

    Among strategies whose step times tie within the cluster's prediction error band the simplest is returned
    (`planner.search.ranking`); `simplest_tie=False` returns the fastest priced instead, for a plan that stands
    for a configuration tuned by measurement (what a published run left unstated).

    The search stops once the plan is proven within `relative_gap` of the fastest strategy of the space (1%:
    `planner.search.outcome.DEFAULT_RELATIVE_GAP`; 0 proves it optimal); `plan.search` holds the proven gap.
    `time_limit_s` stops the search with the best plan found so far (status "feasible", its proven gap in
    `plan.search`). It is None (no limit) by default, unlike the CLI's 60 s: a plan found within a limit depends
    on the machine's speed, and the ranks of a job that each plan for themselves must find the same plan.
    `progress` is called with `planner.progress.PlanProgress` records (module docstring).

    Raises `planner.errors.InfeasibleError` when nothing fits, `UserError` for an empty search space."""
    return plan_top(model_or_chain, inputs_or_spec, cluster, global_batch=global_batch, top_k=1, space=space,
                    objective=objective, time_limit_s=time_limit_s, dtype=dtype, model_name=model_name,
                    settings=settings, progress=progress, profile=profile, simplest_tie=simplest_tie,
                    relative_gap=relative_gap)[0]


def plan_top(model_or_chain: nn.Module | Graph | LayerChain, inputs_or_spec: Any, cluster: Cluster | str, *,
             global_batch: int, top_k: int = 1, space: SearchSpace | None = None,
             objective: Objective | str = Objective.TIME, time_limit_s: float | None = None,
             dtype: str = "bfloat16", model_name: str | None = None, settings: Sequence[tuple[str, Any]] = (),
             progress: ProgressCallback | None = None, profile: OpProfile | None = None,
             simplest_tie: bool = True, relative_gap: float = DEFAULT_RELATIVE_GAP) -> tuple[Plan, ...]:
    """The `top_k` best distinct strategies as plans, best first (each carries the same search information)."""
    name = model_name or getattr(model_or_chain, "model_name", None) or type(model_or_chain).__name__
    cluster = as_cluster(cluster, profile)
    check_fp8(cluster, (space or SearchSpace()).runtime)
    if (space or SearchSpace()).runtime.ep_overlap:
        raise UserError("ep_overlap (DualPipe's paired all-to-all overlap) is priced for a given strategy only "
                        "(stratagem estimate, planner.api.estimate): the search's DualPipeV partition does not "
                        "price it; search without it, then estimate the plan's strategy with it")
    chain = as_chain(model_or_chain, inputs_or_spec, model_name=name, dtype=dtype, progress=progress)
    options = SearchOptions(objective=Objective(objective), top_k=top_k, time_limit_s=time_limit_s,
                            progress=progress, relative_gap=relative_gap,
                            tie_band=error_band(g.device for g in cluster.groups) if simplest_tie else None)
    result = search(chain, cluster, global_batch=global_batch, space=space, options=options, dtype=dtype,
                    profile=profile)
    info = _model_info(chain, model_name or chain.graph.model_name, settings)
    # With a tie band the search already leads with the simplest tied strategy (planner.search.ranking).
    return tuple(_plan_of(chain, cluster, info, global_batch, dtype, r.strategy, r.sharding, r.estimate,
                          _search_info(result, r.estimate.step_time_s))
                 for r in result.ranked[:top_k])


def estimate(chain: LayerChain, cluster: Cluster | str, strategy: Strategy, *, global_batch: int | None = None,
             dtype: str = "bfloat16", profile: OpProfile | None = None) -> Estimate:
    """`costmodel.estimate` of `strategy`, with the layer classes' sharding solved for its tp (as the search does)."""
    cluster = as_cluster(cluster, profile)
    check_fp8(cluster, strategy.runtime)
    return _estimate_with_sharding(chain, cluster, strategy, global_batch, dtype, profile)[0]



def estimate_plan(chain: LayerChain, cluster: Cluster | str, strategy: Strategy, *, global_batch: int,
                  dtype: str = "bfloat16", model_name: str | None = None,
                  settings: Sequence[tuple[str, Any]] = (), profile: OpProfile | None = None) -> Plan:
    """A `Plan` for one given strategy (search status "fixed"), for `stratagem estimate`.

    Stages left empty are filled with the even split `costmodel.estimate` would use, so the plan can be applied.
    Raises UserError when the strategy cannot run at all (degrees, divisibility); a strategy that runs out of
    memory is still priced and its `predicted.problems` say by how much."""
    started = time.monotonic()
    cluster = as_cluster(cluster, profile)
    check_fp8(cluster, strategy.runtime)
    strategy = validate_strategy(chain, cluster, strategy, global_batch)
    est, sharding = _estimate_with_sharding(chain, cluster, strategy, global_batch, dtype, profile)
    info = _model_info(chain, model_name or chain.graph.model_name, settings)
    search_info = SearchInfo(time_s=time.monotonic() - started, candidates=1, status="fixed", optimality_gap=0.0,
                             lower_bound_s=est.step_time_s)
    return _plan_of(chain, cluster, info, global_batch, dtype, strategy, sharding, est, search_info)


def validate_strategy(chain: LayerChain, cluster: Cluster, strategy: Strategy, global_batch: int) -> Strategy:
    """The strategy with explicit stages, or UserError saying exactly why it cannot run."""
    n = cluster.num_available
    if strategy.num_devices > n:
        raise UserError(f"dp*tp*pp*cp = {strategy.dp}*{strategy.tp}*{strategy.pp}*{strategy.cp} = "
                        f"{strategy.num_devices} devices, the cluster has {n} available")
    if global_batch != strategy.global_batch:
        raise UserError(f"--batch {global_batch} is not dp*mbs*microbatches = {strategy.dp}*"
                        f"{strategy.microbatch_size}*{strategy.num_microbatches} = {strategy.global_batch}")
    from planner.search.candidates import head_problem

    why = (head_problem(chain, strategy.tp) or mixed_type_problem(cluster, strategy)  # one device type per lockstep group
           or cp_problem(chain, strategy.cp) or ep_problem(chain, strategy.ep))
    if why:
        raise UserError(why)
    segments = len(chain.segments)
    if strategy.pp * strategy.virtual_stages > segments:
        raise UserError(f"pp*virtual_stages = {strategy.pp * strategy.virtual_stages} is more than the "
                        f"{segments} segments of the layer chain (each stage needs one)")
    resharded = strategy.zero_stage == 3 and strategy.runtime.reshard_after_forward
    why = (schedule_problem(strategy.schedule, strategy.pp, strategy.num_microbatches)
           or split_backward_problem(strategy.schedule, recomputed=recomputes(strategy), resharded=resharded))
    if why:
        raise UserError(why)
    if strategy.stages:
        return strategy
    from dataclasses import replace

    stages = even_stages(chain, strategy.pp * strategy.virtual_stages, strategy.recompute)
    return replace(strategy, stages=stages)


def _estimate_with_sharding(chain: LayerChain, cluster: Cluster, strategy: Strategy, global_batch: int | None,
                            dtype: str, profile: Any) -> tuple[Estimate, tuple[ModuleSharding, ...]]:
    chain = strategy.runtime.priced_chain(chain)
    table = LayerCostTable.for_runtime(chain, cluster, strategy.runtime, dtype=dtype, profile=profile)
    builder = StageProblemBuilder(chain, cluster, table, dtype)
    cand = Candidate.of(strategy)
    placements = builder.placements(cand)
    if placements is None:
        raise UserError(f"the strategy needs {strategy.num_devices} devices, the cluster has "
                        f"{cluster.num_available} available")
    costs = layer_cost_map(builder, cand, placements)
    est = costmodel_estimate(chain, cluster, strategy, layer_costs=costs, dtype=dtype, profile=profile,
                             global_batch=global_batch)
    return est, sharding_of(builder, cand, placements)


def _model_info(chain: LayerChain, name: str, settings: Sequence[tuple[str, Any]]) -> ModelInfo:
    return ModelInfo(name=name, fingerprint=ir.fingerprint(chain.graph), params=chain.graph.param_count,
                     settings=tuple(sorted((str(k), v) for k, v in settings)))


def _search_info(result: SearchResult, step_time_s: float) -> SearchInfo:
    # The gap is relative, so it holds for time and cost alike; the bound is reported in seconds of this plan.
    return SearchInfo(time_s=result.time_s, candidates=result.candidates, status=result.status,
                      optimality_gap=result.optimality_gap,
                      lower_bound_s=step_time_s * (1.0 - result.optimality_gap),
                      alternatives=result.alternatives,
                      fastest_s=step_time_s * result.fastest / result.best.objective)


def _plan_of(chain: LayerChain, cluster: Cluster, info: ModelInfo, global_batch: int, dtype: str,
             strategy: Strategy, sharding: Sequence[ModuleSharding], est: Estimate, search_info: SearchInfo) -> Plan:
    # Every stage names the device group it runs on (planner/search/device_groups.py; no-op for one group).
    strategy = with_device_groups(cluster, strategy)
    return Plan(model=info, cluster=cluster.to_dict(),
                training=TrainingConfig(global_batch=global_batch, seq_len=chain.graph.seq_len, dtype=dtype),
                strategy=strategy, sharding=tuple(sharding), predicted=est, search=search_info)


def settings_of(pairs: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple(sorted((str(k), v) for k, v in items))
