"""Price one layer-chain segment, replicated (tp == 1), for one micro-batch: a `LayerCost`.

Times are sums of `operators.node_time` over the segment's nodes with FLOPs and activation bytes scaled by
micro-batch size / traced batch size (ops run one after another on one stream).

Saved activations (bytes autograd keeps from forward to backward), per recomputation choice (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4-5):
- none: the sum of every node's `saved_bytes`.
- selective: the recompute region (the attention core: nodes with attr ``attention_core`` plus any node that lies
  on a path between two of them, such as a scale or mask between QK^T and softmax) saves nothing; what the region
  reads from outside (Q, K, V) must be kept to recompute it. For Megatron's math attention this drops the
  5*a*s^2*b term and keeps the 34*s*b*h term; for fused (flash) attention it drops the output and logsumexp.
- full: only the segment input is kept (`Segment.input_bytes`); backward first reruns the whole forward.
- op (torchtitan's per-op policy): the segment input, the outputs of the 1st, 3rd, 5th, ... matmul in forward
  order and the outputs of attention nodes (fused attention keeps its output and logsumexp) are kept; every other
  op is recomputed in backward.
Recompute times: selective = forward time of the region; full = forward time of the segment; op = forward time of
the ops whose outputs are not kept.

`peak_temp_bytes`: twice the largest single tensor a node produces (the tensor and its gradient coexist in
backward) -- the transient working set on top of saved activations, e.g. attention scores or logits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.float8 import Float8Recipe, fp8_weight_share
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.operators import GEMM_KINDS, fp8_weight_cast_times, node_time, retype_ratio
from costmodel.profile_db import OpProfile, OpTiming, segment_signature
from costmodel.training_loss import loss_inputs, with_training_loss
from ir.graph import Node, OpKind
from ir.layer_chain import LayerChain, Segment


def selective_recompute_region(nodes: Sequence[Node]) -> frozenset[str]:
    """Names of the nodes selective recomputation drops and reruns (see module docstring)."""
    core = {n.name for n in nodes if n.attr("attention_core", False)}
    if not core:
        return frozenset()
    # Forward closure: nodes reachable from a core node; backward closure: nodes that reach a core node.
    after = set(core)
    for n in nodes:
        if any(i in after for i in n.inputs):
            after.add(n.name)
    before = set(core)
    for n in reversed(nodes):
        if n.name in before:
            before.update(n.inputs)
    return frozenset(core | (after & before))


def op_policy_kept(nodes: Sequence[Node]) -> frozenset[str]:
    """Nodes whose outputs per-op selective checkpointing keeps (module docstring): every other matmul, counted
    from the first in forward order as torchtitan's policy counts `aten.mm` calls, and attention nodes."""
    kept: set[str] = set()
    matmuls = 0
    for n in nodes:
        if n.op_kind in GEMM_KINDS and n.op_kind is not OpKind.CONV:
            matmuls += 1
            if matmuls % 2:
                kept.add(n.name)
        elif n.op_kind is OpKind.ATTENTION:
            kept.add(n.name)
    return frozenset(kept)


def region_inputs(nodes: Sequence[Node], region: frozenset[str]) -> dict[str, int]:
    """Producer name -> bytes of each tensor that a region node reads from outside the region (deduplicated)."""
    kept: dict[str, int] = {}
    for n in nodes:
        if n.name not in region:
            continue
        for i, src in enumerate(n.inputs):
            if src not in region and src not in kept and i < len(n.input_specs):
                kept[src] = n.input_specs[i].nbytes
    return kept


def saved_bytes_by_recompute(nodes: Sequence[Node], input_bytes: int) -> tuple[int, int, int]:
    """(none, selective, full) saved bytes of a node run at its traced size (no scaling)."""
    none = sum(n.saved_bytes for n in nodes)
    region = selective_recompute_region(nodes)
    if region:
        selective = (sum(n.saved_bytes for n in nodes if n.name not in region)
                     + sum(region_inputs(nodes, region).values()))
        selective = min(selective, none)
    else:
        selective = none
    # Full recomputation keeps the segment input, unless the segment saves less than that anyway.
    return none, selective, min(input_bytes, none)


def owned_param_tensors(chain: LayerChain, segment: Segment) -> int:
    """Parameter tensors first used in `segment` (as `Segment.param_count` counts a tied weight once, where it
    is first used)."""
    first: dict[str, int] = {}
    for seg in chain.segments[:segment.index + 1]:
        for node in chain.nodes_of(seg):
            for i in range(len(node.param_specs)):
                name = node.param_names[i] if i < len(node.param_names) else f"{node.name}.{i}"
                first.setdefault(name, seg.index)
    return sum(1 for index in first.values() if index == segment.index)


def segment_glue(segment: Segment, device: DeviceSpec, *, microbatch_size: int, dtype: str,
                 profile: OpProfile | None) -> OpTiming:
    """Measured seconds of running the segment's layer whole beyond its ops' own times (`profile_db.
    segment_signature`: module calls and Python between the ops), or zero when the profile has none."""
    found = profile.lookup(device.name, segment_signature(segment.structural_hash, microbatch_size, dtype)) \
        if profile is not None else None
    return found or OpTiming(0.0, 0.0)


def weight_grad_share(nodes: Sequence[Node]) -> float:
    """The fraction of a segment's backward that computes weight gradients, by FLOPs: a GEMM with a weight
    (linear, convolution, expert matmul) spends its forward's FLOPs again on dW = X^T dY, the rest of the backward
    (dX, attention, everything else) is input-gradient work (Qi et al. 2024, Sec. 2: W and B of a linear layer
    cost the same)."""
    backward = sum(n.backward_flops for n in nodes)
    if backward <= 0:
        return 0.0
    weights = sum(n.forward_flops for n in nodes if n.op_kind in GEMM_KINDS and n.param_specs)
    return min(weights / backward, 1.0)


def price_segment(chain: LayerChain, segment: Segment, device: DeviceSpec, *, microbatch_size: int,
                  dtype: str = "bfloat16", profile: OpProfile | None = None,
                  fp8: Float8Recipe | None = None, token_divisor: int = 1) -> LayerCost:
    """`LayerCost` of `segment` replicated on one `device` for a micro-batch of `microbatch_size` samples; `fp8`
    runs its linear layers in FP8 (`costmodel.float8`). `token_divisor`: the device holds that share of every
    sample's tokens (a context-parallel rank, `costmodel.context_parallel`): priced as microbatch_size /
    token_divisor whole samples."""
    if microbatch_size < 1 or token_divisor < 1:
        raise ValueError(f"microbatch_size and token_divisor must be >= 1, got {microbatch_size}, {token_divisor}")
    graph = chain.graph
    scale = microbatch_size / graph.batch_size / token_divisor
    ratio = retype_ratio(graph.dtype, dtype)
    nodes = chain.nodes_of(segment)
    times = [node_time(n, device, flops_scale=scale, bytes_scale=scale, dtype=dtype, profile=profile, fp8=fp8)
             for n in nodes]
    glue = segment_glue(segment, device, microbatch_size=microbatch_size, dtype=dtype, profile=profile)
    fwd = sum(t[0] for t in times) + glue.forward_s
    bwd = sum(t[1] for t in times) + glue.backward_s
    region = selective_recompute_region(nodes)
    recompute_selective = sum(t[0] for n, t in zip(nodes, times, strict=True) if n.name in region)
    none, selective, full = saved_bytes_by_recompute(nodes, segment.input_bytes)
    act = scale * ratio
    out_bytes = [sum(s.nbytes for s in n.output_specs) for n in nodes]
    largest = max(out_bytes, default=0)
    kept = op_policy_kept(nodes)
    loss = loss_inputs(nodes)
    loss_bytes = sum(b for n, b in zip(nodes, out_bytes, strict=True) if n.name in loss) * act
    saved_op = min(segment.input_bytes + sum(b for n, b in zip(nodes, out_bytes, strict=True) if n.name in kept),
                   none)
    cost = with_training_loss(LayerCost(
        fwd_compute_s=fwd,
        bwd_compute_s=bwd,
        fwd_comm_s=0.0,
        bwd_comm_s=0.0,
        param_count=segment.param_count,
        param_bytes=round(segment.param_bytes * ratio),
        saved_bytes_none=round(none * act),
        saved_bytes_selective=round(selective * act),
        saved_bytes_full=round(full * act),
        recompute_selective_s=recompute_selective,
        recompute_full_s=fwd,
        boundary_bytes=round(segment.boundary_bytes * act),
        grad_sync_bytes=0,
        peak_temp_bytes=round(2 * largest * act),
        param_tensors=owned_param_tensors(chain, segment),
        saved_bytes_op=round(saved_op * act),
        recompute_op_s=sum(t[0] for n, t in zip(nodes, times, strict=True) if n.name not in kept),
    ), loss_bytes, device, dtype)
    return dataclasses.replace(cost, weight_grad_share=weight_grad_share(nodes), **fp8_fields(nodes, device, fp8,
                                                                                           param_scale=1.0,
                                                                                           dtype=dtype))


def fp8_fields(nodes: Sequence[Node], device: DeviceSpec, fp8: Float8Recipe | None, *, param_scale: float,
               dtype: str) -> dict[str, float]:
    """The `LayerCost` fields FP8 training sets (the converted weight share and the weight casts' seconds, at
    `param_scale` of each weight); empty without FP8."""
    if fp8 is None:
        return {}
    cast_fwd, cast_bwd = fp8_weight_cast_times(nodes, device, fp8, param_scale=param_scale, dtype=dtype)
    return {"fp8_weight_share": fp8_weight_share(nodes), "fp8_weight_cast_fwd_s": cast_fwd,
            "fp8_weight_cast_bwd_s": cast_bwd}
