r"""Context parallelism (cp): every sample's sequence is split over cp ranks; attention exchanges K/V in a ring.

Layout (Megatron-LM context parallelism; Liu et al. 2023 "Ring Attention with Blockwise Transformers"; the
load-balanced causal split of Dubey et al. 2024 "The Llama 3 Herd of Models", Sec. 3.3.2): each cp rank holds
S / cp tokens of every sample (two chunks, i and 2cp-1-i, so that causal attention work is even). All ops but
attention are token-wise, so they run on 1/cp of the tokens; attention computes its S / cp queries against all S
keys, which is again 1/cp of the work. Weights are replicated over cp, and their gradients are reduced over the
dp * cp ranks together (`costmodel.rank_layout.dp_group`).

A rank's work for a micro-batch of b samples is then exactly that of b / cp whole samples: the token-wise ops see
b * S / cp tokens either way, and attention does b * (S / cp) * S = (b / cp) * S^2 query-key products. So when cp
divides the micro-batch, the segment's `LayerCost` at micro-batch b / cp (same tp) *is* the rank's compute,
activations and TP communication (`per_rank_base`). Otherwise the cost at b (`base`) is scaled:

    compute, recompute, TP communication            base / cp (FP8 weight casts, per weight: unchanged)
    saved activations, pipeline boundary bytes      base / cp
    peak temporary bytes                            base / cp
    parameters, TP gradient sync                    unchanged

(linear in the tokens: exact in FLOPs and bytes, optimistic only where GEMMs are too small to reach their peak
efficiency, which long sequences -- the reason for cp -- are not). Either way the peak temporary bytes grow by
2 K/V blocks (the block in flight, double-buffered).

plus the ring exchange of each attention op. With kv = bytes of that op's K and V for the whole sequence on one
device (after tensor parallelism shards the kv heads), the ring passes cp - 1 blocks of kv / cp, the volume of an
all-gather with output kv (`collectives.collective_time(ALL_GATHER, kv, cp group)`), C_f seconds. Backward sends
K/V around again and reduce-scatters dK/dV the same way: C_b = 2 C_f. Each transfer overlaps the attention of the
block already there (the first block is local), so with W the attention compute of one direction on one rank
(already divided by cp):

    exposed = (cp - 1) * max(0, C / (cp - 1) - W / cp)          forward: (C_f, W_f), backward: (C_b, W_b)

which is added to the segment's forward / backward communication.

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
from costmodel.operators import node_time, retype_ratio
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
    scaled to the micro-batch, converted to `dtype`, divided over the tensor-parallel ranks that shard kv heads."""
    kv = sum(s.nbytes * retype_ratio(s.dtype, dtype) for s in node.input_specs[1:3])
    kv_heads = int(node.attr("num_kv_heads", node.attr("num_heads", 1)) or 1)
    return kv * scale / min(tp, kv_heads)


def context_parallel_cost(base: LayerCost, nodes: Sequence[Node], device: DeviceSpec, cluster: Cluster, *,
                          cp: int, group: CommGroup, concurrent: int, microbatch_size: int, traced_batch: int,
                          tp: int = 1, dtype: str = "bfloat16", per_rank_base: bool = False) -> LayerCost:
    """The `LayerCost` of a segment whose tokens are split over `cp` ranks (module docstring): from its cost at
    the micro-batch (`base`, same tp), or, with `per_rank_base`, from its cost at micro-batch / cp."""
    if cp == 1:
        return base
    scale = microbatch_size / traced_batch
    fwd_ring = bwd_ring = 0.0
    kv_block = 0.0
    for node in attention_nodes(nodes):
        kv = kv_bytes(node, scale=scale, tp=tp, dtype=dtype)
        w_fwd, w_bwd = node_time(node, device, flops_scale=scale / tp, bytes_scale=scale / tp, dtype=dtype)
        fwd_ring += ring_exchange_s(kv, cp, group, cluster, window_s=w_fwd / cp, concurrent=concurrent)
        bwd_ring += ring_exchange_s(kv, cp, group, cluster, window_s=w_bwd / cp, concurrent=concurrent,
                                    factor=2.0)
        kv_block = max(kv_block, kv / cp)
    if per_rank_base:
        return dataclasses.replace(
            base,
            fwd_comm_s=base.fwd_comm_s + fwd_ring,
            bwd_comm_s=base.bwd_comm_s + bwd_ring,
            recompute_full_s=base.recompute_full_s + fwd_ring,
            recompute_op_s=base.recompute_op_s + fwd_ring,
            peak_temp_bytes=base.peak_temp_bytes + round(2 * kv_block),
        )
    # FP8 weight casts depend on the weights, not the tokens: every cp rank casts all of them.
    cast_f, cast_b = base.fp8_weight_cast_fwd_s, base.fp8_weight_cast_bwd_s
    return dataclasses.replace(
        base,
        fwd_compute_s=(base.fwd_compute_s - cast_f) / cp + cast_f,
        bwd_compute_s=(base.bwd_compute_s - cast_b) / cp + cast_b,
        fwd_comm_s=base.fwd_comm_s / cp + fwd_ring,
        bwd_comm_s=base.bwd_comm_s / cp + bwd_ring,
        bwd_comm_async_s=base.bwd_comm_async_s / cp,
        saved_bytes_none=-(-base.saved_bytes_none // cp),
        saved_bytes_selective=-(-base.saved_bytes_selective // cp),
        saved_bytes_full=-(-base.saved_bytes_full // cp),
        recompute_selective_s=base.recompute_selective_s / cp,
        recompute_full_s=(base.recompute_full_s - cast_f) / cp + cast_f + fwd_ring,
        saved_bytes_op=-(-base.saved_bytes_op // cp),
        recompute_op_s=base.recompute_op_s / cp + fwd_ring,
        boundary_bytes=-(-base.boundary_bytes // cp),
        peak_temp_bytes=-(-base.peak_temp_bytes // cp) + round(2 * kv_block),
    )
