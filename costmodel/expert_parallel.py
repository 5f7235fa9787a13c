r"""Routed experts priced as they run: grouped GEMMs, the busiest rank's load, and expert parallelism (ep).

Layout (GShard, Lepikhin et al. 2021, Sec. 2.2-3; Megatron-Core's expert parallelism with MoE parallel folding,
arXiv 2504.14960): the ep axis reuses tensor- and data-parallel ranks -- a group is ep consecutive ranks of a
stage's tp x dp ranks (`costmodel.strategy.expert_span`: inside a tp group, or whole tp groups of ep_dp = ep / tp
dp coordinates; with tp = 1, ep_dp = ep). Each rank of an ep group holds E / ep of the experts; every rank routes its own tokens, an all-to-all *dispatch* sends each expert's tokens to the rank
that holds the expert, the experts run, and an all-to-all *combine* brings the results back.

The trace (`models.expert_dispatch`) computes per-expert buffers of C slots per routing group: c = the capacity
factor the trace ran with (its expert FLOPs over 2 FLOPs per expert weight per token choice,
`ir.moe_structure.RoutedExperts.capacity_factor`). What a trainer's busiest rank computes differs in two ways:

1. **Load.** Trainers move tokens by index without padding to capacity (Megatron-Core's dropless or
   drop-without-pad dispatch, DeepSeek-V3's no-token-dropping training), so a rank computes the tokens routed to its
   experts, at most C per expert. With every expert on one rank (ep = 1) that is the k choices of every token, the
   mean. Over ep > 1 ranks the all-to-all waits for the busiest rank, which gets `f` times the mean
   (`expert_imbalance`, below). Relative to the trace, every op that runs per expert slot (the expert linears and
   the ops between them, `ir.moe_structure.expert_region`) does lambda of its traced work, and the dispatched
   buffers are lambda of their traced bytes:

       lambda(ep) = min(c, f_ep) / c,     f_1 = 1,  f_ep = f (ep > 1)

2. **Grouped GEMM.** The experts' projections are one grouped GEMM of E / ep GEMMs per rank, each of
   (ep x the rank's tokens per expert) rows: `operators.node_time(gemm_groups = E / ep)` sizes each GEMM on its own
   (`operators.gemm_size_factor`, fitted on measured cuBLAS GEMMs). Expert parallelism makes the GEMMs ep times
   taller -- the same FLOPs at a better efficiency -- which is why fine-grained MoEs train with large ep. Under
   FP8 training whose recipe converts grouped GEMMs (Transformer Engine's, `Float8Recipe.converts_experts`) each
   expert GEMM runs at the FP8 rate with its operand casts (`operators.fp8_grouped_gemm_time`).

These replace the segment's expert-region times (priced before as one GEMM of the whole node at the traced load):
forward, backward, recomputation and saved activations change by the difference, for every ep including 1.

Expert parallelism (ep > 1) adds, per MoE segment and micro-batch:

    forward communication    + 2 * A         dispatch and combine
    backward communication   + 2 * A         their gradients, in reverse
    A = collective_time(ALL_TO_ALL, X, ep group)   X = lambda x the traced bytes of the expert buffers one rank
                                                   sends: the output of the experts' last projection, (E, slots, h)
    peak temporary bytes     >= 2 X          send and receive buffers of one all-to-all, alive together
    parameters               P_dense + P_expert / ep      (`LayerCost.expert_param_count` = P_expert / ep)

The all-to-all is priced over the tiers the ep group spans (`costmodel.hardware.collectives`: NVLink inside a
node, the NIC across nodes, (D_t - 1) P_t / n of the buffer through tier t).

Deduplicated dispatch (`RuntimeOptions.ep_dedup`; DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.2: "each token will be
dispatched to at most 4 nodes ... once we determine the IB target node, the token is forwarded over NVLink to the
GPUs that host its target experts", DeepEP's internode kernels). An ep group of n ranks over N nodes, P = n / N
per node, E experts placed in contiguous blocks (node j holds experts j E/N .. (j+1) E/N - 1), k choices per
token. A plain all-to-all sends each choice that leaves the node: k (N - 1) / N copies of a token over the NIC.
Deduplicated, the token crosses once per other node it reaches, (N - 1) q copies, with q the chance that a given
node holds one of its experts, under uniform routing (every expert, or group, equally likely):

    q = 1 - C(E - E/N, k) / C(E, k)          choices spread over all experts
    q = 1 - C(G - G/N, M) / C(G, M)          group-limited routing whose groups align with nodes (G % N == 0):
                                             the k experts come from M = min(top_groups, k) of G groups, so a
                                             token reaches at most M nodes (transformers' `n_group`, `topk_group`)

and inside the node every copy that lands on another GPU than the one that received it is forwarded over NVLink
(the same for the node's own choices): (P - 1) / P of the buffer. Relative to the plain all-to-all's volumes the
tiers carry

    node tier (NVLink)    x N              (P - 1) / P  S  over  (P - 1) / n  S
    tiers across nodes    x rho = N q / k  (N - 1) q / k  S  over  (N - 1) / N  S

The second counts a chosen group as reached even if none of the k experts lands in it (the report's "at most"),
and the first forwards each choice on its own (DeepEP also merges a token's choices per GPU): both are upper
bounds. DeepSeek-V3 (E 256, k 8, G 8, M 4) on 8 nodes: q = 1/2, rho = 1/2, half the plain all-to-all's NIC bytes;
without the group limit q = 0.66. Combine reduces on the node before sending back: the same volumes.

The router (its h x E linear, softmax / sigmoid, top-k) and the token gathers of dispatch and combine are ordinary
traced ops: a small GEMM and memory-bound passes over the tokens, priced by the roofline like any other.

Everything else follows from where the expert parameters live:

- gradient reduction: dense gradients are reduced over the n = dp * cp ranks, an expert's over the n / ep_dp
  data-parallel ranks holding a copy (and, when ep < tp, the tp / ep ranks of a tp group holding it: the tp sum
  below). A ring over n / ep_dp ranks moves 2 (n/ep_dp - 1) / (n/ep_dp) of the expert bytes per device, which is
  what the n-rank reduction of a buffer (n - ep_dp) / (n - 1) times as large moves, so the data-parallel
  collectives are priced on ``P_dense + P_expert / ep * (n - ep_dp) / (n - 1)`` parameters (`dp_synced_params`;
  0 for the experts when ep_dp = n: each expert has a single owner among the data-parallel ranks);
- ZeRO shards expert state over n / ep_dp ranks instead of n (`model_state_bytes`, `optimizer_params`).

Tensor parallelism (tp > 1) keeps the experts whole on every tp rank (the MoE layer runs replicated on the gathered
sequence), and the tp ranks split every expert's slots: rank r runs 1/tp of them and the results are all-gathered
over the tp group (`planner.runtime.apply_ep.apply_expert_token_split`; the work Megatron-Core splits the same way
with expert tensor parallel size 1). Stacked experts only -- one module per expert runs replicated. Then

    expert region            lambda(ep) / tp of the traced work and saved activations, E / ep GEMMs of 1/tp
    dispatch and combine     A over X / tp                       (the ep group exchanges this rank's slots)
    forward communication    + G,  G = collective_time(ALL_GATHER, X, tp group)   the experts' outputs
    backward communication   + G                                 their input gradients, gathered the same way
    expert gradients         when ep < tp, the tp / ep ranks of a tp group that hold the same experts each have
                             a part: summed after the backward, on the rank's ZeRO shard, priced as an
                             all-reduce over the tp group (`LayerCost.tp_split_expert_params`,
                             `costmodel.estimate`; an upper bound: the subgroup is smaller)

The search's lower bounds take `bound_cost`: the balanced load lambda(1) / tp and one GEMM per projection, below
the price at every ep.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from costmodel.float8 import Float8Recipe
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time, spans
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.layer_pricing import op_policy_kept
from costmodel.memory import GRAD_BYTES, ModelState, expert_shard_ranks
from costmodel.memory import model_state_bytes as _dense_state_bytes
from costmodel.operators import fp8_grouped_gemm_time, node_time, retype_ratio
from costmodel.profile_db import OpProfile
from costmodel.strategy import Offload, expert_tp_replicas
from ir.graph import Node
from ir.layer_chain import LayerChain
from ir.moe_structure import (
    ExpertLayout,
    RoutedExperts,
    expert_region,
    num_routed_experts,
    routed_expert_linears,
    routed_experts,
)

EXPERT_IMBALANCE = 1.25
"""Default routed tokens of the busiest expert-parallel rank over the mean: Switch Transformer's training capacity
factor (Fedus et al. 2022, Sec. 2.2 and Table 1), the per-expert buffer over the mean load that its training runs
sized so that few tokens overflow -- a measured bound on how far the busiest expert's load strays from the mean. A
rank holding several experts averages them, so this is the pessimistic end for ep < E. Set it per job with the
cluster spec's `expert_imbalance` (1 = perfectly balanced routing)."""


def num_experts(nodes: Iterable[Node]) -> int | None:
    """Experts per MoE layer among `nodes` (a top-k router with expert weights of that count,
    `ir.moe_structure`), None when there are none."""
    return num_routed_experts(nodes)


def expert_linears(nodes: Sequence[Node], experts: int) -> list[Node]:
    """Linear ops of the routed experts: stacked (E, ...) weights or one module per expert (`ir.moe_structure`)."""
    return routed_expert_linears(nodes, experts)


def expert_param_numel(nodes: Sequence[Node], experts: int) -> int:
    """Parameters of the expert weights among `nodes` (each counted once)."""
    found = routed_experts(nodes)
    return found.param_numel if found is not None and found.num_experts == experts else 0


def dispatch_bytes(nodes: Sequence[Node], experts: int) -> int:
    """Traced bytes of the expert buffers one rank exchanges per direction: outputs of the expert linears that
    feed no other expert linear (the down projections), (E, tokens per expert, h) each."""
    linears = expert_linears(nodes, experts)
    names = {n.name for n in linears}
    consumers: dict[str, list[str]] = {}
    for n in nodes:
        for src in n.inputs:
            consumers.setdefault(src, []).append(n.name)
    feeds: set[str] = set()   # nodes from which an expert linear is reachable
    for n in reversed(nodes):
        if any(c in names or c in feeds for c in consumers.get(n.name, ())):
            feeds.add(n.name)
    return sum(s.nbytes for n in linears if n.name not in feeds for s in n.output_specs)


def ep_problem(chain: LayerChain, ep: int) -> str:
    """Why the chain's experts cannot be split over `ep` ranks ('' when they can)."""
    if ep == 1:
        return ""
    experts = num_experts(chain.graph.nodes)
    if experts is None or not expert_linears(chain.graph.nodes, experts):
        return f"ep={ep}: the model has no mixture-of-experts layers"
    if experts % ep:
        return f"ep={ep} does not divide the {experts} experts"
    return ""


def ep_options(chain: LayerChain, dp: int) -> tuple[int, ...]:
    """Expert-parallel degrees the search tries with `dp` data-parallel ranks: divisors of dp that
    `ep_problem` accepts."""
    return tuple(e for e in range(1, dp + 1) if dp % e == 0 and not ep_problem(chain, e))


def expert_load_factor(capacity_factor: float, ep: int, imbalance: float) -> float:
    """lambda(ep): the busiest rank's expert work over the traced work (module docstring)."""
    busiest = imbalance if ep > 1 else 1.0
    return min(capacity_factor, busiest) / capacity_factor


@dataclass(frozen=True, slots=True)
class ExpertSetting:
    """How a segment's experts run: the expert-parallel group and the scale its base cost was priced at."""

    ep: int
    microbatch_size: int
    """Micro-batch (samples) the base cost was priced at."""
    traced_batch: int
    traced_dtype: str
    dtype: str = "bfloat16"
    token_divisor: int = 1
    """The base was priced for 1 / token_divisor of every sample's tokens (a context-parallel rank)."""
    group: CommGroup = CommGroup(1)
    concurrent: int = 1
    imbalance: float = EXPERT_IMBALANCE
    dedup: bool = False
    """Dispatch and combine send a token once per node (`RuntimeOptions.ep_dedup`, module docstring)."""
    tp: int = 1
    """Tensor-parallel ranks that split every expert's slots (module docstring)."""
    tp_group: CommGroup = CommGroup(1)
    tp_concurrent: int = 1
    """tp groups gathering at once."""
    fp8: Float8Recipe | None = None
    """FP8 training's recipe: the expert GEMMs run in FP8 where it converts them (`Float8Recipe.converts_experts`)."""

    @property
    def token_scale(self) -> float:
        """The rank's tokens over the traced batch's."""
        return self.microbatch_size / self.traced_batch / self.token_divisor


@dataclass(frozen=True, slots=True)
class ExpertLayer:
    """The structure of one segment's routed experts that pricing needs (found once per layer class)."""

    found: RoutedExperts
    region: tuple[Node, ...]
    """The expert region's nodes in graph order (`ir.moe_structure.expert_region`)."""
    op_kept: frozenset[str]
    """Nodes whose outputs per-op checkpointing keeps (`layer_pricing.op_policy_kept`)."""
    dispatch_bytes: int


def expert_layer(nodes: Sequence[Node]) -> ExpertLayer | None:
    """The routed experts among a segment's nodes, None when it has none."""
    found = routed_experts(nodes)
    if found is None or not found.choices:
        return None
    region = expert_region(nodes, found)
    return ExpertLayer(found, tuple(n for n in nodes if n.name in region), op_policy_kept(nodes),
                       dispatch_bytes(nodes, found.num_experts))


@dataclass(frozen=True, slots=True)
class _RegionDelta:
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_op_s: float = 0.0
    saved: float = 0.0
    saved_op: float = 0.0


def _region_delta(layer: ExpertLayer, device: DeviceSpec, setting: ExpertSetting, load: float, groups: int,
                  profile: OpProfile | None) -> _RegionDelta:
    """What the expert region's price changes by, from one GEMM per node at the traced load to `groups` GEMMs
    per expert linear at `load` times the traced work."""
    linears = set(layer.found.linears)
    scale = setting.token_scale
    ratio = retype_ratio(setting.traced_dtype, setting.dtype)
    fwd = bwd = recompute_op = saved = saved_op = 0.0
    fp8 = setting.fp8 if setting.fp8 is not None and setting.fp8.converts_experts else None
    for n in layer.region:
        # Linears of one module per expert are FP8 in the base already where the recipe converts them.
        old = node_time(n, device, flops_scale=scale, bytes_scale=scale, dtype=setting.dtype, profile=profile,
                        fp8=setting.fp8)
        expert = n.name in linears  # holds E / ep of the stacked expert weights
        if expert and fp8 is not None:
            new = fp8_grouped_gemm_time(n, device, fp8, flops_scale=scale * load, bytes_scale=scale * load,
                                        param_scale=1 / setting.ep, gemm_groups=groups, dtype=setting.dtype)
        else:
            new = node_time(n, device, flops_scale=scale * load, bytes_scale=scale * load, dtype=setting.dtype,
                            profile=profile, gemm_groups=groups if expert else 1,
                            param_scale=1 / setting.ep if expert else 1.0, fp8=setting.fp8)
        d_fwd, d_bwd = new[0] - old[0], new[1] - old[1]
        fwd, bwd = fwd + d_fwd, bwd + d_bwd
        if n.name not in layer.op_kept:
            recompute_op += d_fwd
        saved += n.saved_bytes * scale * ratio * (load - 1)
        if n.name in layer.op_kept:
            saved_op += sum(s.nbytes for s in n.output_specs) * scale * ratio * (load - 1)
    return _RegionDelta(fwd, bwd, recompute_op, saved, saved_op)


def _with_region(base: LayerCost, d: _RegionDelta) -> LayerCost:
    return dataclasses.replace(
        base,
        fwd_compute_s=base.fwd_compute_s + d.fwd_s,
        bwd_compute_s=base.bwd_compute_s + d.bwd_s,
        recompute_full_s=base.recompute_full_s + d.fwd_s,
        recompute_op_s=base.recompute_op_s + d.recompute_op_s,
        saved_bytes_none=max(0, round(base.saved_bytes_none + d.saved)),
        saved_bytes_selective=max(0, round(base.saved_bytes_selective + d.saved)),
        saved_bytes_op=max(0, round(base.saved_bytes_op + d.saved_op)),
    )


def bound_cost(base: LayerCost, layer: ExpertLayer | None, device: DeviceSpec, setting: ExpertSetting,
               profile: OpProfile | None = None) -> LayerCost:
    """A lower bound on the segment's price at every ep: the balanced load lambda(1), one GEMM per projection."""
    if layer is None:
        return base
    load = expert_load_factor(layer.found.capacity_factor, 1, setting.imbalance) / slot_split(layer.found, setting)
    return _with_region(base, _region_delta(layer, device, setting, load, 1, profile))


def slot_split(found: RoutedExperts, setting: ExpertSetting) -> int:
    """Ranks that split every expert's slots: the tp ranks for stacked experts, else 1 (module docstring)."""
    return setting.tp if found.layout is ExpertLayout.STACKED else 1


def expert_cost(base: LayerCost, layer: ExpertLayer | None, device: DeviceSpec, cluster: Cluster, *,
                setting: ExpertSetting, segment_params: int, profile: OpProfile | None = None) -> LayerCost:
    """The `LayerCost` of a segment whose routed experts (`layer`, from `expert_layer`) run as the module
    docstring says (grouped GEMMs, the busiest rank's load, and for ep > 1 the all-to-alls and E / ep of the
    expert weights), from its cost priced with one GEMM per expert projection at the traced load (`base`).
    `segment_params`: the segment's unsharded parameter count (the expert share of `base.param_count` is the
    experts' share of the segment's parameters)."""
    if layer is None:
        return base
    found, ep = layer.found, setting.ep
    load = expert_load_factor(found.capacity_factor, ep, setting.imbalance)
    split = slot_split(found, setting)
    # Stacked weights run one grouped GEMM of E / ep experts; one module per expert is one GEMM per node already.
    groups = max(found.num_experts // ep, 1) if found.layout is ExpertLayout.STACKED else 1
    cost = _with_region(base, _region_delta(layer, device, setting, load / split, groups, profile))
    payload = layer.dispatch_bytes * setting.token_scale * retype_ratio(setting.traced_dtype, setting.dtype) * load
    if split > 1:
        gather = collective_time(Collective.ALL_GATHER, payload, setting.tp_group, cluster,
                                 concurrent=setting.tp_concurrent)
        cost = dataclasses.replace(cost, fwd_comm_s=cost.fwd_comm_s + gather, bwd_comm_s=cost.bwd_comm_s + gather,
                                   recompute_full_s=cost.recompute_full_s + gather,
                                   peak_temp_bytes=max(cost.peak_temp_bytes, round(payload)))
    if not found.param_numel:
        return cost
    # Experts are whole on every tp rank: the segment's share of them is all of them unless tp sharded the rest.
    local = (min(found.param_numel, base.param_count) if split > 1 else
             round(found.param_numel * base.param_count / segment_params) if segment_params else found.param_numel)
    kept = -(-local // ep)
    # The tp ranks holding the same experts (ep < tp; 1 when ep groups take whole tp groups) each hold a part.
    partial = expert_tp_replicas(split, ep) > 1
    if ep == 1:
        return dataclasses.replace(cost, tp_split_expert_params=local if partial else 0)
    payload /= split
    scale = dedup_tier_scale(found, setting.group, cluster) if setting.dedup else ()
    a2a = collective_time(Collective.ALL_TO_ALL, payload, setting.group, cluster, concurrent=setting.concurrent,
                          tier_scale=scale)
    bytes_per_param = base.param_bytes / base.param_count if base.param_count else 0.0
    return dataclasses.replace(
        cost,
        fwd_comm_s=cost.fwd_comm_s + 2 * a2a,
        bwd_comm_s=cost.bwd_comm_s + 2 * a2a,
        recompute_full_s=cost.recompute_full_s + 2 * a2a,
        ep_comm_s=cost.ep_comm_s + 2 * a2a,
        param_count=base.param_count - local + kept,
        param_bytes=round(base.param_bytes - (local - kept) * bytes_per_param),
        expert_param_count=kept,
        tp_split_expert_params=kept if partial else 0,
        peak_temp_bytes=max(cost.peak_temp_bytes, round(2 * payload)),
    )


def node_reach(found: RoutedExperts, nodes: int) -> float:
    """q: the chance that one of `nodes` nodes (holding E / N experts each) receives a token, under uniform
    routing, group-limited when the groups align with the nodes (module docstring)."""
    groups, top = found.num_groups, min(found.top_groups, found.top_k)
    if groups > 1 and groups % nodes == 0:
        return 1 - math.comb(groups - groups // nodes, top) / math.comb(groups, top)
    experts = found.num_experts
    return 1 - math.comb(experts - experts // nodes, found.top_k) / math.comb(experts, found.top_k)


def dedup_tier_scale(found: RoutedExperts, group: CommGroup, cluster: Cluster) -> tuple[float, ...]:
    """Per tier, the deduplicated dispatch's bytes over the plain all-to-all's (module docstring): N on the node
    tier, N q / k on the tiers across nodes; () when the group is inside one node (nothing to deduplicate) or its
    nodes do not each hold whole experts."""
    across = [s for s in spans(group, cluster) if s.index >= 1]
    if not across:
        return ()
    nodes = round(group.size / across[0].ranks_per_domain)
    if found.num_experts % nodes:
        return ()
    rho = nodes * node_reach(found, nodes) / found.top_k
    return (float(nodes), *(rho,) * max(s.index for s in across))


# ---- what the data-parallel side does with expert parameters ----------------------------------------------------

def dp_synced_params(costs: Sequence[LayerCost], *, dp_size: int, ep_dp: int,
                     counts: Sequence[int] | None = None) -> float:
    """Parameters whose gradients (and ZeRO-3 weights) the n = dp*cp data-parallel collectives move, in units of
    the n-rank group: dense ones, plus expert ones scaled by (n - ep_dp) / (n - 1) (module docstring); `counts[i]`
    segments of `costs[i]` (one each by default)."""
    return sum(n * synced_params(c.param_count - c.expert_param_count, c.expert_param_count, dp_size=dp_size,
                                 ep_dp=ep_dp)
               for c, n in zip(costs, counts or [1] * len(costs), strict=True))


def synced_params(dense: float, experts: float, *, dp_size: int, ep_dp: int) -> float:
    """`dp_synced_params` of `dense` dense and `experts` expert parameters."""
    return dense + (experts * (dp_size - ep_dp) / (dp_size - 1) if experts and dp_size > 1 else experts)


def optimizer_params(param_count: int, expert_param_count: int, *, zero_stage: int, dp_size: int,
                     ep_dp: int) -> int:
    """Parameters whose optimizer step runs on one rank: dense / n and experts / (n / ep_dp) under ZeRO >= 1."""
    if zero_stage < 1:
        return param_count
    dense = param_count - expert_param_count
    return -(-dense // dp_size) + -(-expert_param_count // expert_shard_ranks(dp_size, ep_dp))


def model_state_bytes(param_count: int, expert_param_count: int, *, zero_stage: int, dp_size: int, ep_dp: int,
                      dtype: str, offload: Offload = Offload.NONE, pipelined: bool = False,
                      grad_bytes: int = GRAD_BYTES) -> ModelState:
    """`memory.model_state_bytes` with expert state sharded over n / ep_dp ranks instead of n."""
    dense = _dense_state_bytes(param_count - expert_param_count, zero_stage=zero_stage, dp=dp_size, dtype=dtype,
                               offload=offload, pipelined=pipelined, grad_bytes=grad_bytes)
    if not expert_param_count:
        return dense
    return dense + _dense_state_bytes(expert_param_count, zero_stage=zero_stage, dp=expert_shard_ranks(dp_size, ep_dp),
                                      dtype=dtype, offload=offload, pipelined=pipelined, grad_bytes=grad_bytes)
