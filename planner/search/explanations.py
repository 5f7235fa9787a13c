"""Why the search chose what it chose: why each losing mesh lost (`alternatives`), and what to relax when the
space is empty or nothing fits in memory (the messages of `UserError` / `InfeasibleError`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from costmodel.context_parallel import cp_problem
from costmodel.estimate import estimate as costmodel_estimate
from costmodel.expert_parallel import (
    ep_problem,
)
from costmodel.hardware.cluster import Cluster
from costmodel.memory import GIB, framework_overhead_bytes, model_state_bytes
from costmodel.strategy import MeshAxis, Offload, Strategy
from ir.graph import dtype_bytes
from ir.layer_chain import LayerChain
from planner.plan import Alternative
from planner.search.candidates import (
    Candidate,
    enumerate_candidates,
    head_problem,
    node_size,
    offload_options,
)
from planner.search.pricing import layer_cost_map, least_memory_of
from planner.search.space import Objective, SearchSpace
from planner.strategy_label import Detail, strategy_label

if TYPE_CHECKING:
    from planner.search.branch_and_bound import SearchState
    from planner.search.outcome import Found, RankedStrategy


_PHRASES = {
    "compute_s": "slower compute (smaller or less efficient GEMMs per device)",
    "recompute_s": "more recomputation to fit in memory",
    "tp_comm_s": "more tensor-parallel communication",
    "pp_comm_s": "more pipeline send/recv",
    "dp_comm_s": "more exposed data-parallel communication",
    "bubble_s": "a larger pipeline bubble",
    "optimizer_s": "a longer optimizer step",
    "offload_s": "host-device copies of the state it offloads",
    "framework_s": "more framework host work (FSDP2 / DTensor / pipeline / checkpoint machinery)",
}


def _crosses(cluster: Cluster, size: int, stride: int) -> str:
    if size <= 1:
        return ""
    tier = cluster.tier_spanned(size, stride)
    return tier.name if tier is not None and tier.name != cluster.tiers[0].name else ""


def _loss_reason(state: SearchState, best: RankedStrategy, alt: Found) -> str:
    what = "cost" if state.options.objective is Objective.COST else "step time"
    if alt.objective <= best.objective:  # the plan is a tie the ranking preferred as simpler
        pct = 100.0 * (alt.objective - best.objective) / best.objective
        return f"{pct:+.1f}% {what}, within the error band: the plan is simpler"
    costs = layer_cost_map(state.builder, alt.candidate, state.builder.placements(alt.candidate))
    est = costmodel_estimate(state.chain, state.cluster, alt.strategy, layer_costs=costs, dtype=state.dtype,
                             profile=state.builder.table.profile, global_batch=state.global_batch)
    ours, theirs = best.estimate.breakdown.to_dict(), est.breakdown.to_dict()
    worst = max(_PHRASES, key=lambda k: (theirs.get(k, 0.0) - ours.get(k, 0.0), k))
    delta = theirs.get(worst, 0.0) - ours.get(worst, 0.0)
    pct = 100.0 * (alt.objective - best.objective) / best.objective
    if delta <= 0:  # slower as a whole, by less than any one term can show
        return f"+{pct:.1f}% {what}: no single term of the breakdown is larger"
    phrase = _PHRASES[worst]
    m = alt.candidate.mesh
    strides = {a: m.stride(a) for a in (MeshAxis.TP, MeshAxis.DP, MeshAxis.PP)}
    if worst == "optimizer_s" and alt.strategy.runtime.offload is not Offload.NONE:
        phrase = "its optimizer steps on the CPU (offloaded)"
    elif worst == "dp_comm_s" and (tier := _crosses(state.cluster, m.dp, strides[MeshAxis.DP])):
        phrase = f"its gradient all-reduce crosses the {tier} tier"
    elif worst == "tp_comm_s" and (tier := _crosses(state.cluster, m.tp, strides[MeshAxis.TP])):
        phrase = f"its tensor-parallel all-reduces cross the {tier} tier"
    elif worst == "pp_comm_s" and (tier := _crosses(state.cluster, 2, strides[MeshAxis.PP])):
        phrase = f"its pipeline sends cross the {tier} tier"
    return f"+{pct:.1f}% {what}: {phrase} (+{delta:.3g} s)"


def explain_alternatives(state: SearchState, best: RankedStrategy, invalid: Mapping[tuple, str]) -> tuple[Alternative, ...]:
    """Best per distinct (dp, tp, pp) other than the winner's, with why it lost; a fixed order and size."""
    win = (best.candidate.mesh.dp, best.candidate.mesh.tp, best.candidate.mesh.pp)
    rows: list[tuple[tuple, Alternative]] = []
    what = "cost" if state.options.objective is Objective.COST else "step time"
    for key, rec in state.meshes.items():
        if key == win:
            continue
        summary = strategy_label(Strategy(dp=key[0], tp=key[1], pp=key[2]), Detail.DEGREES)
        if rec.best is not None:
            found = rec.best
            rows.append(((0, found.objective, key), Alternative(found.candidate.label, found.step_time_s,
                                                               _loss_reason(state, best, found))))
        elif rec.beyond_slack:
            slack = 100.0 * state.options.explain_slack
            rows.append(((1, rec.lower_bound, key), Alternative(
                summary, None, f"more than +{slack:.0f}% {what} (its best partition was not priced exactly)")))
        elif math.isfinite(rec.lower_bound):
            reason = _unpriced_reason(state, best, rec.lower_bound, what)
            if math.isfinite(rec.memory_need_bytes):  # some of its candidates do not fit; the others may
                reason += f"; some of its settings need at least {rec.memory_need_bytes / GIB:.1f} GiB per device"
            rows.append(((1, rec.lower_bound, key), Alternative(summary, None, reason)))
        elif math.isfinite(rec.memory_need_bytes):
            rows.append(((2, rec.memory_need_bytes, key), Alternative(
                summary, None, f"does not fit: needs at least {rec.memory_need_bytes / GIB:.1f} GiB per device")))
    for key, why in invalid.items():
        degrees = strategy_label(Strategy(dp=key[0], tp=key[1], pp=key[2]), Detail.DEGREES)
        rows.append(((3, 0.0, key), Alternative(degrees, None, why)))
    rows.sort(key=lambda r: r[0])
    return tuple(a for _, a in rows[:state.options.num_alternatives])


def _unpriced_reason(state: SearchState, best: RankedStrategy, lower: float, what: str) -> str:
    """Why a mesh with this lower bound was never priced: it cannot beat the plan; or, below the plan, it can at
    best tie the fastest with a plan that is simpler; or, below the fastest, by no more than the search's gap."""
    pct = 100.0 * (lower - best.objective) / best.objective
    if pct >= 0:
        return f"at least {pct:+.1f}% {what} (lower bound {lower:.4g})"
    fastest = state.found[0].objective
    if lower < fastest:
        return (f"not priced: at most {100 * (1 - lower / fastest):.1f}% less {what} than the fastest found "
                f"(lower bound {lower:.4g}), within the search's {100 * state.options.relative_gap:g}% gap")
    return f"not priced: at best a tie ({pct:+.1f}%, lower bound {lower:.4g}) with a plan that is simpler"


def empty_space_message(chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                         invalid: Mapping[tuple, str]) -> str:
    pins = ", ".join(f"{k}={v}" for k, v in space.pinned().items())
    if invalid and len(set(invalid.values())) == 1:
        return f"no valid strategy: {next(iter(invalid.values()))}" + (f" (pinned: {pins})" if pins else "")
    n, per_node = cluster.num_available, node_size(cluster)
    # Name the first pin that cannot work on its own, else describe the whole space.
    # A pinned cp / ep the model cannot use (costmodel/context_parallel.py, expert_parallel.py).
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


def least_memory(state: SearchState) -> tuple[float, Candidate | None, float | None]:
    """The smallest per-device memory with which some strategy of the space fits, and its candidate.

    Exact: candidates are visited in order of a lower bound on their memory -- the larger of their parameter state
    and `CandidateBounds.memory_floor` (activations included: where they are what does not fit, a long sequence
    say, the parameter state alone bounds nothing and every candidate would be built) -- each priced at its best
    partition and recomputation for memory (`least_memory_of`), until the bound reaches the best found. The third
    value is None when that proof finished, else the bound where the time limit (and its grace for a first plan)
    cut it short: the least memory lies between it and the best found."""
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
        need = model_state_bytes(even, zero_stage=cand.zero_stage, dp=m.dp * m.cp, dtype=state.dtype,
                                 offload=cand.runtime.offload,
                                 grad_bytes=cand.runtime.grad_bytes(dtype_bytes(state.dtype))).total
        floor = max(need + framework_overhead_bytes(placements[0].device.name),
                    state.bounds.memory_floor(cand, options))
        bounded.append((floor, cand.sort_key, cand))
    bounded.sort(key=lambda t: (t[0], t[1]))
    best, arg = math.inf, None
    deadline = state.partition_deadline()
    for lower, _, cand in bounded:
        if lower >= best:
            break
        if deadline is not None and time.monotonic() > deadline:
            return best, arg, lower
        built = state.builder.build(cand, options)
        if built is not None:
            need = least_memory_of(built)
            if need < best:
                best, arg = need, cand
    return best, arg, None


def _digits_to_tell_apart(need: float, capacity: float) -> int:
    """Decimals of GiB that show `need` and `capacity` as different numbers (2 unless they round together)."""
    digits = 2
    while digits < 6 and math.isfinite(need) and f"{need / GIB:.{digits}f}" == f"{capacity / GIB:.{digits}f}":
        digits += 1
    return digits


def nothing_fits_message(state: SearchState, space: SearchSpace) -> str:
    need, cand, cut_at = least_memory(state)
    capacity = max(g.device.memory_bytes for g in state.cluster.groups)
    n = state.cluster.num_available
    # The least device state the searched offloads leave (parameters offload only where FSDP2 shards, n > 1).
    offloads = [o for o in offload_options(space, state.cluster) if o is not Offload.PARAMS or n > 1]
    grads = space.runtime.grad_bytes(dtype_bytes(state.dtype))
    sharded = min(model_state_bytes(-(-state.chain.graph.param_count // n), zero_stage=3, dp=1, dtype=state.dtype,
                                    offload=o, grad_bytes=grads).total for o in offloads or [Offload.NONE])
    if need <= capacity:
        # Only possible when the memory-optimal strategy is outside what the search may return (never for the
        # default space); say so rather than print a contradiction.
        return f"nothing fits in {capacity / GIB:.2f} GiB per device within the search space"
    pins = space.pinned()
    helps = []
    if pins:
        helps.append(f"remove or relax --fix {', '.join(sorted(pins))}")
    overhead = framework_overhead_bytes(state.cluster.device_of(0).name)
    if sharded + overhead > capacity:
        spread = "on the one device" if n == 1 else f"fully sharded over all {n} devices"
        besides = f" besides the framework's {overhead / GIB:.2f} GiB" if sharded < capacity else ""
        helps.append(f"more devices or devices with more memory (the parameter state alone, {spread}, needs "
                     f"{sharded / GIB:.2f} GiB per device{besides})")
    else:
        helps.append("more devices to spread layers and activations over (a larger tp or pp), a shorter sequence "
                     "(--seq), or devices with more memory")
    where = f" ({cand.label}, recompute=full where needed)" if cand is not None else ""
    digits = _digits_to_tell_apart(need, capacity)
    need_text = f"{need / GIB:.{digits}f} GiB per device" if math.isfinite(need) else "more than any device has"
    if cut_at is not None:  # the time limit stopped the proof: what is known
        upper = f" and at most {need / GIB:.{digits}f}" if math.isfinite(need) else ""
        need_text = (f"at least {max(cut_at, capacity) / GIB:.{digits}f}{upper} GiB per device (the time limit cut "
                     "the search for the least short)")
    return (f"nothing fits in {capacity / GIB:.{digits}f} GiB per device: the least memory any strategy needs is "
            f"{need_text}{where}; what would help: {'; '.join(helps)}")


def out_of_time_message(limit_s: float, grace_s: float, priced: int, seen: int) -> str:
    """Why the search stopped without any plan: the time limit and its grace passed first."""
    return (f"no plan found within the time limit of {limit_s:g} s and {grace_s:g} s more for a first one "
            f"({priced:,} of {seen:,} candidates priced, none fits yet); raise --time-limit (0: no limit) or pin "
            "dimensions with --fix")
