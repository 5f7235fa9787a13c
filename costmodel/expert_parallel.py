r"""Expert parallelism (ep): the experts of every mixture-of-experts layer are split over ep data-parallel ranks.

Layout (GShard, Lepikhin et al. 2021, Sec. 2.2-3; Megatron-LM's expert parallelism): the ep axis reuses
data-parallel ranks (`Strategy.ep` divides dp * cp; the search uses ep | dp). Each rank of an ep group holds E / ep
of the experts; every rank routes its own tokens, an all-to-all *dispatch* sends each expert's buffer to the rank
that holds the expert, the experts run, and an all-to-all *combine* brings the results back. With balanced
routing a rank computes (E / ep experts) x (ep ranks' tokens) = the same expert FLOPs as with replicated experts.

Per MoE segment, given its `LayerCost` with replicated experts (`base`, at the strategy's tp and micro-batch):

    forward communication    + 2 * A         dispatch and combine
    backward communication   + 2 * A         their gradients, in reverse
    A = collective_time(ALL_TO_ALL, X, ep group)   X = bytes of the expert buffers one rank sends: the output of
                                                   the experts' last projection, (E, tokens-per-expert, h)
    parameters               P_dense + P_expert / ep      (`LayerCost.expert_param_count` = P_expert / ep)

Compute and activations are unchanged. Everything else follows from where the expert parameters live:

- gradient reduction: dense gradients are reduced over the n = dp * cp ranks, an expert's over the n / ep ranks
  holding a copy. A ring over n / ep ranks moves 2 (n/ep - 1) / (n/ep) of the expert bytes per device, which is
  what the n-rank reduction of a buffer (n - ep) / (n - 1) times as large moves, so the data-parallel collectives
  are priced on ``P_dense + P_expert / ep * (n - ep) / (n - 1)`` parameters (`dp_synced_params`; 0 for the
  experts when ep = n: each expert has a single owner);
- ZeRO shards expert state over n / ep ranks instead of n (`model_state_bytes`, `optimizer_params`).

So ep pays when the all-to-alls (4 A per MoE layer and micro-batch) cost less than what replicated experts cost:
their gradient reduction and their optimizer state / step on every rank -- and whenever replicated experts do not
fit at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.layer_cost import LayerCost
from costmodel.memory import ModelState
from costmodel.memory import model_state_bytes as _dense_state_bytes
from costmodel.operators import retype_ratio
from ir.graph import Node
from ir.layer_chain import LayerChain
from ir.moe_structure import num_routed_experts, routed_expert_linears, routed_experts


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


def expert_parallel_cost(base: LayerCost, nodes: Sequence[Node], cluster: Cluster, *, ep: int, group: CommGroup,
                         concurrent: int, segment_params: int, microbatch_size: int, traced_batch: int,
                         traced_dtype: str, dtype: str = "bfloat16") -> LayerCost:
    """The `LayerCost` of a segment whose experts are split over `ep` ranks (module docstring), from its cost
    with replicated experts (`base`). `segment_params`: the segment's unsharded parameter count (the expert
    share of `base.param_count` is taken as the experts' share of the segment's parameters)."""
    experts = num_experts(nodes)
    if ep == 1 or experts is None:
        return base
    numel = expert_param_numel(nodes, experts)
    if numel == 0:
        return base
    local = round(numel * base.param_count / segment_params) if segment_params else numel
    kept = -(-local // ep)
    payload = dispatch_bytes(nodes, experts) * microbatch_size / traced_batch * retype_ratio(traced_dtype, dtype)
    a2a = collective_time(Collective.ALL_TO_ALL, payload, group, cluster, concurrent=concurrent)
    bytes_per_param = base.param_bytes / base.param_count if base.param_count else 0.0
    return dataclasses.replace(
        base,
        fwd_comm_s=base.fwd_comm_s + 2 * a2a,
        bwd_comm_s=base.bwd_comm_s + 2 * a2a,
        recompute_full_s=base.recompute_full_s + 2 * a2a,
        param_count=base.param_count - local + kept,
        param_bytes=round(base.param_bytes - (local - kept) * bytes_per_param),
        expert_param_count=kept,
    )


# ---- what the data-parallel side does with expert parameters ----------------------------------------------------

def dp_synced_params(costs: Iterable[LayerCost], *, dp_size: int, ep: int) -> float:
    """Parameters whose gradients (and ZeRO-3 weights) the n = dp*cp data-parallel collectives move, in units of
    the n-rank group: dense ones, plus expert ones scaled by (n - ep) / (n - 1) (module docstring)."""
    total = 0.0
    for c in costs:
        dense = c.param_count - c.expert_param_count
        total += dense
        if c.expert_param_count:
            total += c.expert_param_count * ((dp_size - ep) / (dp_size - 1) if dp_size > 1 else 1.0)
    return total


def optimizer_params(param_count: int, expert_param_count: int, *, zero_stage: int, dp_size: int, ep: int) -> int:
    """Parameters whose optimizer step runs on one rank: dense / n and experts / (n / ep) under ZeRO >= 1."""
    if zero_stage < 1:
        return param_count
    dense = param_count - expert_param_count
    return -(-dense // dp_size) + -(-expert_param_count // max(dp_size // ep, 1))


def model_state_bytes(param_count: int, expert_param_count: int, *, zero_stage: int, dp_size: int, ep: int,
                      dtype: str) -> ModelState:
    """`memory.model_state_bytes` with expert state sharded over n / ep ranks instead of n."""
    dense = _dense_state_bytes(param_count - expert_param_count, zero_stage=zero_stage, dp=dp_size, dtype=dtype)
    if not expert_param_count:
        return dense
    expert = _dense_state_bytes(expert_param_count, zero_stage=zero_stage, dp=max(dp_size // ep, 1), dtype=dtype)
    return ModelState(params=dense.params + expert.params, grads=dense.grads + expert.grads,
                      optimizer=dense.optimizer + expert.optimizer)
