r"""Context parallelism (cp): every sample's sequence is split over cp ranks; attention exchanges K/V in a ring.

Layout (Megatron-LM context parallelism; Liu et al. 2023 "Ring Attention with Blockwise Transformers"; the
load-balanced causal split of Dubey et al. 2024 "The Llama 3 Herd of Models", Sec. 3.3.2): each cp rank holds
S / cp tokens of every sample (two chunks, i and 2cp-1-i, so that causal attention work is even). All ops but
attention are token-wise, so they run on 1/cp of the tokens; attention computes its S / cp queries against all S
keys, which is again 1/cp of the work. Weights are replicated over cp, and their gradients are reduced over the
dp * cp ranks together (`costmodel.rank_layout.dp_group`).

A rank's work for a micro-batch of b samples is then exactly that of b / cp whole samples: the token-wise ops see
b * S / cp tokens either way, and attention does b * (S / cp) * S = (b / cp) * S^2 query-key products. So the
segment's `LayerCost` priced for b / cp samples (same tp; `planner.search.layer_costs.LayerCostTable.rank_prices`:
at b / cp samples when cp divides b, else at b samples with 1 / cp of their tokens, which also chooses the
tensor-parallel sharding for the tokens a rank really holds) *is* the rank's compute, activations and TP
communication, with parameters, TP gradient sync and FP8 weight casts whole on every rank. The peak temporary
bytes grow by 2 K/V blocks (the block in flight, double-buffered),

plus the ring exchange of each attention op. With kv = bytes of that op's K and V for the whole sequence on one
device (its KV heads only, however many query heads the model expanded them to; after tensor parallelism shards
the kv heads), the ring passes cp - 1 blocks of kv / cp, the volume of an
all-gather with output kv (`collectives.collective_time(ALL_GATHER, kv, cp group)`), C_f seconds. Backward sends
K/V around again and reduce-scatters dK/dV the same way: C_b = 2 C_f. Each transfer overlaps the attention of the
block already there (the first block is local), so with W the attention compute of one direction on one rank
(already divided by cp):

    exposed = (cp - 1) * max(0, C / (cp - 1) - W / cp)          forward: (C_f, W_f), backward: (C_b, W_b)

which is added to the segment's forward / backward communication.

Causal attention on a cp rank is not one causal kernel over the whole sequence: with the load-balanced split, a
rank's two query chunks (of c = S / (2 cp) tokens) meet 2cp - 1 key chunks wholly below the diagonal, computed as
unmasked c x c blocks (ring steps, or the blocks of Llama 3's all-gathered K/V), and 2 chunks on the diagonal,
computed as causal c x c kernels. Against the unmasked attention of the same queries (4cp blocks), the rank saves

    speedup(cp) = 4 cp / (2 cp - 1 + 2 / CAUSAL_SPEEDUP)        (1.93 at cp = 2, 1.99 at cp = 16)

where one causal kernel over the whole sequence saves CAUSAL_SPEEDUP (1.75, `costmodel.operators`: a causal
FlashAttention kernel skips the tiles above the diagonal but runs below the unmasked kernel's rate). The ring runs
a rank's attention as cp kernels (one per step) of (S / cp) x (S / cp): each is priced at its own size on the GEMM
size curve (`operators.node_time` with cp groups), which is what makes short sequences split thin cost more than
their FLOPs. So a rank's attention -- forward, backward and what recomputation reruns -- is

    t_ring = t(its 1/cp of the queries, in cp kernels) * CAUSAL_SPEEDUP / speedup(cp)     (causal)
    t_ring = t(its 1/cp of the queries, in cp kernels)                                    (unmasked)

in place of the one-kernel price of `base`, and each ring transfer overlaps 1/cp of t_ring (W / cp above).
Windowed (sliding-window) attention keeps its one-kernel band price.

Which chains can use cp (`cp_options`): every attention op is a fused SDPA without an explicit mask (a mask or
position bias of S x S would have to be split too), the sequence divides into 2 * cp chunks, and each rank keeps
at least `MIN_TOKENS_PER_RANK` tokens (below that the ring's latency-bound steps dominate; Megatron-LM documents
cp for long sequences, >= 8K tokens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.layer_pricing import selective_recompute_region
from costmodel.operators import CAUSAL_SPEEDUP, node_time, retype_ratio
from costmodel.profile_db import OpProfile
from ir.graph import Node, OpKind
from ir.layer_chain import LayerChain

MIN_TOKENS_PER_RANK = 1024
"""Fewest tokens of a sample one cp rank may hold (a FlashAttention block row is 128; 1024 keeps ring steps
bandwidth-bound on NVLink)."""


def attention_nodes(nodes: Sequence[Node]) -> list[Node]:
    return [n for n in nodes if n.op_kind is OpKind.ATTENTION]


def cp_problem(chain: LayerChain, cp: int) -> str:
    """Why the chain cannot be split over `cp` context-parallel ranks ('' when it can)."""
    if cp == 1:
        return ""
    seq = chain.graph.seq_len
    attention = attention_nodes(chain.graph.nodes)
    if seq is None or not attention:
        return "context parallelism needs a token sequence with fused attention"
    if any(n.attr("has_mask", False) for n in attention):
        return "context parallelism needs attention without an explicit mask or position bias"
    if seq % (2 * cp):
        return f"cp={cp}: the sequence ({seq} tokens) does not split into 2*cp={2 * cp} equal chunks"
    if seq // cp < MIN_TOKENS_PER_RANK:
        return f"cp={cp}: {seq // cp} tokens per rank, fewer than {MIN_TOKENS_PER_RANK}"
    return ""


def cp_options(chain: LayerChain, num_devices: int) -> tuple[int, ...]:
    """Context-parallel degrees the search tries on `num_devices` devices: 1 and every divisor that
    `cp_problem` accepts."""
    return tuple(c for c in range(1, num_devices + 1) if num_devices % c == 0 and not cp_problem(chain, c))


def ring_exchange_s(kv_bytes: float, cp: int, group: CommGroup, cluster: Cluster, *, window_s: float,
                    concurrent: int = 1, factor: float = 1.0) -> float:
    """Exposed seconds of passing `factor` x `kv_bytes` around a cp ring while attention runs for `window_s`."""
    if cp == 1 or kv_bytes <= 0:
        return 0.0
    comm = factor * collective_time(Collective.ALL_GATHER, kv_bytes, group, cluster, concurrent=concurrent)
    return (cp - 1) * max(0.0, comm / (cp - 1) - window_s / cp)


def kv_bytes(node: Node, *, scale: float, tp: int, dtype: str) -> float:
    """Bytes of an attention op's K and V for the whole sequence on one device: traced K, V (inputs 1 and 2)
    scaled to the micro-batch, converted to `dtype`, cut to the true KV heads where the model expanded them to
    the query heads before attention (grouped-query attention, `ir.attention_core.mark_grouped_kv`: the ring
    passes each KV head once), divided over the tensor-parallel ranks that shard kv heads."""
    specs = node.input_specs[1:3]
    kv = sum(s.nbytes * retype_ratio(s.dtype, dtype) for s in specs)
    kv_heads = int(node.attr("num_kv_heads", node.attr("num_heads", 1)) or 1)
    traced_heads = specs[0].shape[-3] if specs and len(specs[0].shape) >= 3 else kv_heads
    return kv * scale * min(kv_heads / traced_heads, 1.0) / min(tp, kv_heads)


def ring_causal_speedup(cp: int) -> float:
    """How many times less a cp rank's causal attention takes than the unmasked attention of its queries (module
    docstring): CAUSAL_SPEEDUP for one kernel over the whole sequence (cp = 1)."""
    if cp == 1:
        return CAUSAL_SPEEDUP
    return 4 * cp / (2 * cp - 1 + 2 / CAUSAL_SPEEDUP)


def ring_node_time(node: Node, device: DeviceSpec, *, scale: float, cp: int, dtype: str = "bfloat16",
                   profile: OpProfile | None = None) -> tuple[float, float] | None:
    """(forward, backward) seconds of one rank's share of attention `node` at `scale` (already the rank's 1/cp of
    the queries, and 1/tp of the heads) as the ring runs it: cp kernels at their own size, causal ones saving
    `ring_causal_speedup(cp)` (module docstring). None for windowed attention, which keeps its one-kernel price."""
    if node.attr("window") is not None:
        return None
    blocks = node_time(node, device, flops_scale=scale, bytes_scale=scale, dtype=dtype, profile=profile,
                       gemm_groups=cp)
    factor = CAUSAL_SPEEDUP / ring_causal_speedup(cp) if node.attr("is_causal", False) else 1.0
    return factor * blocks[0], factor * blocks[1]


def ring_attention_s(nodes: Sequence[Node], device: DeviceSpec, *, scale: float, cp: int, dtype: str = "bfloat16",
                     profile: OpProfile | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
    """((forward, backward) of the attention among `nodes` priced as one kernel each at `scale`, (forward,
    backward) of one of `cp` ranks running it as the ring does at tensor-parallel degree 1): the part of a
    segment that `context_parallel_cost` reprices. Windowed attention is left out (it keeps its price)."""
    one, ring = [0.0, 0.0], [0.0, 0.0]
    for node in attention_nodes(nodes):
        rank = ring_node_time(node, device, scale=scale / cp, cp=cp, dtype=dtype, profile=profile)
        if rank is None:
            continue
        whole = node_time(node, device, flops_scale=scale, bytes_scale=scale, dtype=dtype, profile=profile)
        for i in (0, 1):
            one[i] += whole[i]
            ring[i] += rank[i]
    return (one[0], one[1]), (ring[0], ring[1])


def context_parallel_cost(base: LayerCost, nodes: Sequence[Node], device: DeviceSpec, cluster: Cluster, *,
                          cp: int, group: CommGroup, concurrent: int, microbatch_size: int, traced_batch: int,
                          tp: int = 1, dtype: str = "bfloat16", profile: OpProfile | None = None) -> LayerCost:
    """The `LayerCost` of a segment whose tokens are split over `cp` ranks (module docstring), from its cost for
    one rank's share of the micro-batch (`base`, priced for microbatch_size / cp samples at the same tp): its
    causal attention run as the ring's blocks, plus the ring exchange of each attention op and its K/V blocks in
    flight."""
    if cp == 1:
        return base
    scale = microbatch_size / traced_batch
    region = selective_recompute_region(nodes)
    fwd_ring = bwd_ring = kv_block = 0.0
    saved_fwd = saved_bwd = saved_selective = 0.0
    for node in attention_nodes(nodes):
        kv = kv_bytes(node, scale=scale, tp=tp, dtype=dtype)
        # the rank's attention as `base` prices it (its 1/cp of the queries against every key, one kernel), and
        # as the ring runs it
        own = node_time(node, device, flops_scale=scale / (tp * cp), bytes_scale=scale / (tp * cp), dtype=dtype,
                        profile=profile)
        ring = ring_node_time(node, device, scale=scale / (tp * cp), cp=cp, dtype=dtype, profile=profile) or own
        saved_fwd += own[0] - ring[0]
        saved_bwd += own[1] - ring[1]
        saved_selective += own[0] - ring[0] if node.name in region else 0.0
        fwd_ring += ring_exchange_s(kv, cp, group, cluster, window_s=ring[0], concurrent=concurrent)
        bwd_ring += ring_exchange_s(kv, cp, group, cluster, window_s=ring[1], concurrent=concurrent, factor=2.0)
        kv_block = max(kv_block, kv / cp)
    bwd = base.bwd_compute_s - saved_bwd
    return dataclasses.replace(
        base,
        fwd_compute_s=base.fwd_compute_s - saved_fwd,
        bwd_compute_s=bwd,
        # attention computes no weight gradient: the deferred weight-gradient work stays what it was
        weight_grad_share=base.weight_grad_share * base.bwd_compute_s / bwd if bwd > 0 else 0.0,
        fwd_comm_s=base.fwd_comm_s + fwd_ring,
        bwd_comm_s=base.bwd_comm_s + bwd_ring,
        recompute_full_s=base.recompute_full_s - saved_fwd + fwd_ring,
        recompute_selective_s=base.recompute_selective_s - saved_selective,
        recompute_op_s=base.recompute_op_s + fwd_ring,
        peak_temp_bytes=base.peak_temp_bytes + round(2 * kv_block),
    )
