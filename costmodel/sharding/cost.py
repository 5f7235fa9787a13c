"""Pricing intra-operator sharding: a segment's nodes and tensors priced per strategy (`build_sharding_model`)
into a `costmodel.sharding.model.ShardingModel`, whose integer problem the ILP solves (`ShardingModel.problem`)
and which prices a chosen assignment as a `LayerCost`.

Per node and strategy: `node_time` with FLOPs scaled by micro-batch / traced batch times the work fraction,
activation bytes by the share of them one device touches, parameter bytes by the share it holds; the gradient
all-reduce of replicated parameters whose gradients are partial (their node runs on a split token dim), spread
over the step's micro-batches; and `memory_weight * (16 bytes x parameters + saved activation bytes)` per device
(16 bytes per parameter: mixed-precision Adam, Rajbhandari et al. 2020, ZeRO §3.1). Per tensor: the moves of each
(written, wanted) and (produced gradient, expected gradient) layout pair, with `collective_time` over the
tensor-parallel group. Bytes are converted from the traced dtype to the priced one, as `layer_pricing` does.

The chosen assignment's `LayerCost` follows `costmodel.layer_pricing.price_segment` (so tp = 1 gives its numbers)
with every tensor at its per-device share: saved bytes with no / selective / full recomputation (selective drops
the attention-core region and keeps what it reads; full keeps the segment inputs), the forward time of the
recomputed part, forward and backward communication, and `grad_sync_bytes` for the estimator's per-step sync.
An input that a node saves whole after it was all-gathered from a shard (the column-parallel inputs under
sequence parallelism) is counted whole, as DTensor's matmul keeps it; `LayerCost.regathered_bytes_*` record what
Megatron-LM, which keeps the shard (Korthikanti et al. 2022, §4.2.2), does not keep (`LayerCost.regathered`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from costmodel.float8 import Float8Recipe, converted_node
from costmodel.framework import NO_FRAMEWORK_COSTS, FrameworkCosts
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_pricing import op_policy_kept, selective_recompute_region
from costmodel.operators import fp8_cast_times, node_time, retype_ratio
from costmodel.profile_db import OpProfile
from costmodel.sharding.dims import DimLabel, Labels, input_labels, is_float, op_name, propagate_labels
from costmodel.sharding.layout import (
    REPLICATED,
    Layout,
    Move,
    allowed_inside,
    grad_layout_of,
    local_fraction,
    module_prefix,
    redistribution,
    relative_module,
    shard,
)
from costmodel.sharding.model import Flow, NodeOption, Pricer, Reader, ShardingModel
from costmodel.sharding.problem import FIXED
from costmodel.sharding.rules import (
    NodeStrategy,
    StrategyContext,
    Style,
    node_strategies,
    replicated_strategy,
)
from costmodel.training_loss import loss_inputs
from ir.graph import Node, OpKind, TensorSpec
from ir.moe_structure import ExpertLayout, expert_region, routed_experts

DEFAULT_MEMORY_WEIGHT = 1e-15
"""Seconds of objective per byte of per-device memory: 1 GB ~ 1 us. Small enough never to trade speed for
memory at realistic sizes, large enough to break ties toward the layout that stores less; raise it when memory
is tight."""


# ----------------------------------------------------------------------------------------------------------------
# Building a segment's model
# ----------------------------------------------------------------------------------------------------------------

def boundary_layout(spec: TensorSpec, labels: Labels, tp: int, sequence_parallel: bool) -> Layout:
    """The agreed layout of activations crossing a segment boundary: S(1) for (batch, seq, hidden) under sequence
    parallelism, R otherwise."""
    if (sequence_parallel and len(spec.shape) == 3 and is_float(spec) and labels[1] is DimLabel.SEQ
            and spec.shape[1] % tp == 0):
        return shard(1)
    return REPLICATED


def default_outputs(nodes: Sequence[Node]) -> tuple[str, ...]:
    """Nodes nothing in the list reads (the segment's results), the graph's OUTPUT node excluded."""
    read = {src for n in nodes for src in n.inputs}
    return tuple(n.name for n in nodes if n.name not in read and n.output_specs and n.op_kind is not OpKind.OUTPUT)


def saved_inputs(node: Node) -> tuple[bool, ...] | None:
    """Which inputs a node saves for backward, when its saved bytes are exactly its inputs' (a linear, a GELU);
    None when they are not (outputs, masks, statistics)."""
    total = sum(s.nbytes for s in node.input_specs)
    return (True,) * len(node.input_specs) if total and total == node.saved_bytes else None


def saved_fraction(node: Node, strategy: NodeStrategy, tp: int) -> float:
    """Share of the node's saved activations one device keeps: the saved tensors are the inputs, the outputs or
    both (whichever group's bytes equal `saved_bytes`), each kept at its layout's local share; when no group
    matches (e.g. a dropout mask), the byte-weighted share of all of them."""
    ins = [(s.nbytes, lay) for s, lay in zip(node.input_specs, strategy.inputs, strict=True)]
    outs = [(s.nbytes, strategy.output) for s in node.output_specs]
    for group in (ins, outs, ins + outs):
        total = sum(b for b, _ in group)
        if total and total == node.saved_bytes:
            return sum(b * local_fraction(lay, tp) for b, lay in group) / total
    group = ins + outs
    total = sum(b for b, _ in group)
    return sum(b * local_fraction(lay, tp) for b, lay in group) / total if total else 1.0


def activation_fraction(node: Node, strategy: NodeStrategy, tp: int) -> float:
    """Share of the node's activation bytes (inputs read, outputs written) one device touches."""
    group = [(s.nbytes, lay) for s, lay in zip(node.input_specs, strategy.inputs, strict=True)]
    group += [(s.nbytes, strategy.output) for s in node.output_specs]
    total = sum(b for b, _ in group)
    return sum(b * local_fraction(lay, tp) for b, lay in group) / total if total else 1.0


def fp8_cast_shares(strategy: NodeStrategy, tp: int, sequence_parallel: bool) -> tuple[float, float]:
    """(input, output gradient) shares one device casts to FP8 for a converted linear under `strategy`.

    Each operand is cast where it is local (torchao/float8/float8_tensor_parallel.py): the input in the layout it
    arrives in, the output gradient in the layout the module hands its output on. A column-parallel linear's
    output is sharded (1/tp); a row-parallel one's is reduced, whole on every rank without sequence
    parallelism. Under sequence parallelism the tensors between modules are sequence-sharded:
    `Float8ColwiseParallel` casts its input shard before the all-gather, and `Float8RowwiseParallel` casts the
    output gradient shard before the all-gather that backs its reduce-scatter (both collectives then move
    FP8), so 1/tp of each."""
    x = local_fraction(strategy.inputs[0], tp) if strategy.inputs else 1.0
    dy = local_fraction(strategy.output, tp)
    if sequence_parallel and not strategy.is_replicated:
        x, dy = min(x, 1.0 / tp), min(dy, 1.0 / tp)
    return x, dy


@dataclass(frozen=True, slots=True)
class _Setting:
    tp: int
    sequence_parallel: bool
    batch_scale: float
    memory_weight: float
    num_microbatches: int
    pricer: Pricer
    dtype: str
    traced_dtype: str

    def ratio(self, dtype: str) -> float:
        """Bytes per traced byte of a tensor of `dtype` once priced: tensors in the trace's own dtype take the
        priced dtype; others (an explicit fp32 upcast in a bf16 trace, indices, masks) keep theirs."""
        return retype_ratio(self.traced_dtype, self.dtype) if dtype == self.traced_dtype else 1.0

    def bytes_of(self, spec: TensorSpec) -> float:
        return spec.nbytes * self.ratio(spec.dtype)


def _price_option(node: Node, st: NodeStrategy, scale: float, cfg: _Setting) -> NodeOption:
    locals_ = tuple(spec.numel if d is None else spec.numel // cfg.tp
                    for spec, d in zip(node.param_specs, st.param_dims, strict=True))
    param_scale = sum(locals_) / node.param_count if node.param_count else 1.0
    fwd, bwd = cfg.pricer.node_time(node, scale * st.work_fraction, scale * activation_fraction(node, st, cfg.tp),
                                    param_scale)
    if cfg.pricer.fp8_cast_time is not None:
        shares = fp8_cast_shares(st, cfg.tp, cfg.sequence_parallel)
        cast_fwd, cast_bwd = cfg.pricer.fp8_cast_time(node, scale * shares[0], scale * shares[1], param_scale)
        fwd, bwd = fwd + cast_fwd, bwd + cast_bwd
    if node.param_specs and not st.is_replicated:
        fwd += cfg.pricer.sharded_module.forward_s
        bwd += cfg.pricer.sharded_module.backward_s
    extra = sum(cfg.pricer.move_time(m, nbytes * scale) for m, nbytes in st.extra_forward)
    local_bytes = tuple(n / max(spec.numel, 1) * cfg.bytes_of(spec)
                        for n, spec in zip(locals_, node.param_specs, strict=True))
    partial_grads = st.output.is_shard  # replicated weights applied to a sharded token dim: partial gradients
    sync = round(sum(cfg.bytes_of(spec) for spec, d in zip(node.param_specs, st.param_dims, strict=True)
                     if d is None and partial_grads))
    sync_s = 0.0
    if sync:  # one flat all-reduce per step (`step_time.tp_grad_sync_time`); this node's bytes and tensors
        synced = sum(1 for d in st.param_dims if d is None)
        sync_s = (cfg.pricer.move_time(Move.ALL_REDUCE, float(sync))
                  + synced * cfg.pricer.grad_sync_per_tensor_s) / cfg.num_microbatches
    # the largest transient: an output and its gradient alive together in backward (as layer_pricing counts it)
    out_bytes = 2 * sum(cfg.bytes_of(s) for s in node.output_specs) * scale * local_fraction(st.output, cfg.tp)
    specs = node.output_specs or node.input_specs
    retype = cfg.ratio(specs[0].dtype) if specs else 1.0
    whole = saved_inputs(node) or (False,) * len(node.input_specs)
    kept_whole = tuple(cfg.bytes_of(spec) * scale if saved and lay == REPLICATED else 0.0
                       for spec, lay, saved in zip(node.input_specs, st.inputs, whole, strict=True))
    return NodeOption(
        strategy=st, fwd_s=fwd, bwd_s=bwd, extra_fwd_comm_s=extra, param_locals=locals_,
        param_local_bytes=local_bytes, saved_bytes=round(node.saved_bytes * scale * retype
                                                          * saved_fraction(node, st, cfg.tp)),
        grad_sync_bytes=sync, grad_sync_s=sync_s, out_bytes=round(out_bytes), memory_weight=cfg.memory_weight,
        saved_whole_inputs=kept_whole)


def _has_batch(labels: Sequence[Labels]) -> bool:
    return any(lab is DimLabel.BATCH for labs in labels for lab in labs)


def folded_batch_nodes(nodes: Sequence[Node], labels: Mapping[str, Labels], traced_batch: int) -> frozenset[str]:
    """Nodes without a batch dim in their labels that are computed from the batch: their tensors hold the batch's
    tokens after a reshape folded the batch dim away (a mixture of experts' routing groups (G, S, h) and
    per-expert buffers (E, slots, h)), so their work and bytes grow with the micro-batch like a batch dim's."""
    batched: set[str] = set()
    folded: set[str] = set()
    for node in nodes:
        # Input labels only where the output has no batch dim: the few nodes that can be folded.
        if DimLabel.BATCH in labels.get(node.name, ()) or _has_batch(
                [input_labels(node, i, labels, traced_batch) for i in range(len(node.input_specs))]):
            batched.add(node.name)
        elif any(i in batched or i in folded for i in node.inputs):
            folded.add(node.name)
    return frozenset(folded)


_SHAPE_ONLY_OPS = frozenset({"ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like",
                             "randint_like", "size", "dim", "numel"})
"""Ops that read only their input's shape (and dtype), never its values."""


def shape_only_reads(nodes: Sequence[Node], outputs: set[str]) -> set[tuple[int, int]]:
    """(node, input) reads that carry no data: into a shape-only op, or into a node whose own value is dead
    (read only through such reads, and not a segment output), e.g. the `scores[0, 0]` a tracer inserts to size a
    causal mask built with `ones_like`. Such a read puts no constraint on the layout it reads."""
    position = {n.name: i for i, n in enumerate(nodes)}
    data_readers: dict[str, int] = {n.name: 0 for n in nodes}
    dead: set[int] = set()
    free: set[tuple[int, int]] = set()
    for j in range(len(nodes) - 1, -1, -1):
        node = nodes[j]
        if node.name not in outputs and node.output_specs and data_readers[node.name] == 0:
            dead.add(j)
        for k, src in enumerate(node.inputs):
            if j in dead or op_name(node.target) in _SHAPE_ONLY_OPS:
                free.add((j, k))
            elif src in position:
                data_readers[src] += 1
    return free


def _needs_grad(nodes: Sequence[Node], index: Mapping[str, int]) -> dict[str, bool]:
    """Whether a gradient flows into each value: float, and derived from a parameter or a float segment input."""
    needs: dict[str, bool] = {}
    for node in nodes:
        if not node.output_specs or not is_float(node.output_specs[0]):
            needs[node.name] = False
            continue
        from_inputs = any(
            needs.get(src, False) if src in index else is_float(spec)
            for src, spec in zip(node.inputs, node.input_specs, strict=False))
        needs[node.name] = bool(node.param_specs) or from_inputs
    return needs


def weight_splitting(node: Node, strategies: Sequence[NodeStrategy], in_labels: Sequence[Labels]
                     ) -> Sequence[NodeStrategy]:
    """The strategies that split the node's weight over the tp ranks, when it has any, as the tensor-parallel plans
    of Megatron-LM and torchtitan run them: a linear colwise or rowwise, an embedding looked up with per-sample ids
    (a batch dim: the token embedding) vocabulary-parallel. Ids shared by the batch keep every strategy; a learned
    position embedding whose ids the model expands over the batch is split too, where Megatron-LM replicates that
    small table (the difference is one partial sum in the embedding's all-reduce)."""
    token_embedding = (node.op_kind is OpKind.EMBEDDING and bool(in_labels)
                       and DimLabel.BATCH in in_labels[0])
    if not node.param_specs or not (node.op_kind is OpKind.LINEAR or token_embedding):
        return strategies
    split = [s for s in strategies if any(d is not None for d in s.param_dims)]
    return split or strategies


def stacked_expert_region(nodes: Sequence[Node]) -> frozenset[str]:
    """The nodes that run once per slot of routed experts with stacked (E, ...) weights (`ir.moe_structure`)."""
    found = routed_experts(tuple(nodes))
    if found is None or found.layout is not ExpertLayout.STACKED:
        return frozenset()
    return expert_region(nodes, found)


def _runtime_strategies(node: Node, strategies: Sequence[NodeStrategy], sequence_parallel: bool
                        ) -> Sequence[NodeStrategy]:
    """The strategies the runtime can run: under sequence parallelism `planner.runtime.apply_tp` runs every norm on its
    sequence shard (a replicated norm fed a shard would leave its weight gradients unreduced), so a norm with
    parameters that has a sequence-sharded strategy gets only those -- with their partial-gradient sync."""
    if not (sequence_parallel and node.op_kind is OpKind.NORM and node.param_specs):
        return strategies
    sequence = [s for s in strategies if s.style is Style.SEQUENCE]
    return sequence or strategies


def build_sharding_model(nodes: Sequence[Node], *, tp: int, sequence_parallel: bool, traced_batch: int,
                         microbatch_size: int, pricer: Pricer, memory_weight: float = DEFAULT_MEMORY_WEIGHT,
                         outputs: Sequence[str] | None = None, num_microbatches: int = 1,
                         dtype: str = "bfloat16", traced_dtype: str | None = None,
                         sequence_norms: bool = True, token_divisor: int = 1,
                         sharded_weights: bool = False) -> ShardingModel:
    """Price every strategy of every node and every move of every tensor of a segment (see module docstring).
    `sequence_norms`: under sequence parallelism, give norms only their sequence-sharded strategies, as the
    runtime runs them (`_runtime_strategies`); False offers every strategy (when forcing leaves none feasible).
    `token_divisor`: the tensor-parallel group holds that share of every sample's tokens (context parallelism):
    activations, their moves and token work are priced at microbatch_size / token_divisor samples.
    `sharded_weights`: a linear or token embedding whose weight can be split gets only the strategies that split
    it (`RuntimeOptions.tp_sharded_weights`)."""
    _validate(nodes, tp, sequence_parallel, traced_batch, microbatch_size, memory_weight, num_microbatches,
              token_divisor)
    nodes = tuple(nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    out_names = default_outputs(nodes) if outputs is None else tuple(outputs)
    unknown = [o for o in out_names if o not in index]
    if unknown:
        raise ValueError(f"outputs {unknown} are not nodes of the segment; its nodes: {', '.join(index)}")
    labels = propagate_labels(nodes, traced_batch)
    cfg = _Setting(tp, sequence_parallel, microbatch_size / traced_batch / token_divisor, memory_weight,
                   num_microbatches, pricer,
                   dtype, traced_dtype or infer_traced_dtype(nodes))
    options = []
    in_scales: list[tuple[float, ...]] = []
    experts = stacked_expert_region(nodes) if tp > 1 else frozenset()
    folded = folded_batch_nodes(nodes, labels, traced_batch)
    for node in nodes:
        in_labels = tuple(input_labels(node, i, labels, traced_batch) for i in range(len(node.input_specs)))
        out_labels = labels.get(node.name, ())
        ctx = StrategyContext(tp, sequence_parallel, in_labels, out_labels)
        scale = cfg.batch_scale if _has_batch((*in_labels, out_labels)) or node.name in folded else 1.0
        strategies = _runtime_strategies(node, node_strategies(node, ctx), sequence_parallel and sequence_norms)
        if node.name in experts:  # whole on every tp rank, which splits their slots (`costmodel.expert_parallel`)
            strategies = (replicated_strategy(node),)
        elif sharded_weights:
            strategies = weight_splitting(node, strategies, in_labels)
        options.append(tuple(_price_option(node, st, scale, cfg) for st in strategies))
        in_scales.append(tuple(cfg.batch_scale if DimLabel.BATCH in labs or src in folded else 1.0
                               for labs, src in zip(in_labels, node.inputs, strict=False)))
    flows, inputs_saved, boundary = _build_flows(nodes, index, options, labels, set(out_names), cfg, traced_batch,
                                                 folded)
    region, kept, loss = selective_recompute_region(nodes), op_policy_kept(nodes), loss_inputs(nodes)
    return ShardingModel(nodes=nodes, tp=tp, sequence_parallel=sequence_parallel, options=tuple(options),
                         flows=flows, inputs_saved_bytes=round(inputs_saved), boundary_bytes=round(boundary),
                         recompute_region=frozenset(i for i, n in enumerate(nodes) if n.name in region),
                         op_kept=frozenset(i for i, n in enumerate(nodes) if n.name in kept),
                         loss_inputs=frozenset(i for i, n in enumerate(nodes) if n.name in loss),
                         region_reads=_region_reads(nodes, region, in_scales, cfg))


def _region_reads(nodes: Sequence[Node], region: frozenset[str], in_scales: Sequence[Sequence[float]],
                  cfg: _Setting) -> tuple[tuple[int, int, float], ...]:
    """What the selective-recompute region reads from outside, once per tensor (`layer_pricing.region_inputs`)."""
    seen: set[str] = set()
    reads = []
    for i, node in enumerate(nodes):
        if node.name not in region:
            continue
        for k, (src, spec) in enumerate(zip(node.inputs, node.input_specs, strict=False)):
            if src not in region and src not in seen:
                seen.add(src)
                reads.append((i, k, cfg.bytes_of(spec) * in_scales[i][k]))
    return tuple(reads)


def infer_traced_dtype(nodes: Sequence[Node]) -> str:
    """The dtype the segment was traced in: its parameters' (most common, ties by name), else its float
    activations', else float32."""
    for specs in ([p for n in nodes for p in n.param_specs],
                  [o for n in nodes for o in n.output_specs if is_float(o)]):
        if specs:
            counts: dict[str, int] = {}
            for spec in specs:
                counts[spec.dtype] = counts.get(spec.dtype, 0) + 1
            return min(counts, key=lambda d: (-counts[d], d))
    return "float32"


def _validate(nodes: Sequence[Node], tp: int, sp: bool, traced_batch: int, mbs: int, memory_weight: float,
              num_microbatches: int, token_divisor: int) -> None:
    for name, v in (("tp", tp), ("traced_batch", traced_batch), ("microbatch_size", mbs),
                    ("num_microbatches", num_microbatches), ("token_divisor", token_divisor)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if sp and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1")
    if not memory_weight >= 0:
        raise ValueError(f"memory_weight must be >= 0 seconds per byte, got {memory_weight!r}")
    if not nodes:
        raise ValueError("a segment needs at least one node")


def _build_flows(nodes: Sequence[Node], index: Mapping[str, int], options: Sequence[Sequence[NodeOption]],
                 labels: Mapping[str, Labels], out_names: set[str], cfg: _Setting,
                 traced_batch: int, folded: frozenset[str] = frozenset()) -> tuple[tuple[Flow, ...], float, float]:
    readers: dict[str, list[Reader]] = {}
    external: dict[str, tuple[TensorSpec, Labels]] = {}
    shape_only = shape_only_reads(nodes, out_names)
    for j, node in enumerate(nodes):
        for k, spec in enumerate(node.input_specs):
            if k >= len(node.inputs):
                break
            if (j, k) in shape_only:  # no data flows: any layout will do, nothing moves
                continue
            src = node.inputs[k]
            readers.setdefault(src, []).append(Reader(
                node=j, input_index=k, layouts=tuple(o.strategy.inputs[k] for o in options[j]),
                grads=tuple(o.strategy.input_grads[k] for o in options[j])))
            if src not in index and src not in external:
                external[src] = (spec, input_labels(node, k, labels, traced_batch))
    needs = _needs_grad(nodes, index)
    flows: list[Flow] = []
    inputs_saved = boundary = 0.0
    for name, (spec, labs) in external.items():  # first-read order: deterministic
        lay = boundary_layout(spec, labs, cfg.tp, cfg.sequence_parallel)
        nbytes = cfg.bytes_of(spec) * (cfg.batch_scale if DimLabel.BATCH in labs else 1.0)
        inputs_saved += nbytes * local_fraction(lay, cfg.tp)
        flows.append(_flow(name, nbytes, FIXED, (lay,), is_float(spec), readers[name], cfg))
    for i, node in enumerate(nodes):
        rs = list(readers.get(node.name, ()))
        if not node.output_specs or (not rs and node.name not in out_names):
            continue
        spec, labs = node.output_specs[0], labels.get(node.name, ())
        nbytes = cfg.bytes_of(spec) * (cfg.batch_scale if DimLabel.BATCH in labs or node.name in folded else 1.0)
        if node.op_kind is OpKind.PLACEHOLDER:  # a model input (replicated): kept by full recomputation too
            inputs_saved += nbytes
        if node.name in out_names:
            lay = boundary_layout(spec, labs, cfg.tp, cfg.sequence_parallel)
            rs.append(Reader(node=FIXED, input_index=0, layouts=(lay,), grads=(lay if needs[node.name] else None,)))
            boundary += nbytes * local_fraction(lay, cfg.tp)
        flows.append(_flow(node.name, nbytes, i, tuple(o.strategy.output for o in options[i]), needs[node.name],
                           rs, cfg))
    return tuple(flows), inputs_saved, boundary


def _flow(name: str, nbytes: float, source: int, source_layouts: tuple[Layout, ...], needs_grad: bool,
          readers: Sequence[Reader], cfg: _Setting) -> Flow:
    written = sorted(set(source_layouts))
    wanted = sorted({lay for r in readers for lay in r.layouts})
    produced = sorted({g for r in readers for g in r.grads if g is not None})
    expected = sorted({grad_layout_of(a) for a in written})

    def price(src: Layout, dst: Layout) -> float:
        return sum(cfg.pricer.move_time(m, nbytes) for m in redistribution(src, dst))

    fwd = tuple((a, lay, price(a, lay)) for a in written for lay in wanted if a != lay)
    bwd = tuple((g, e, price(g, e)) for g in produced for e in expected if g != e) if needs_grad else ()
    inside = sorted({lay for r in readers if r.node != FIXED for lay in r.layouts})
    forbidden = tuple((a, lay) for a in written for lay in inside if not allowed_inside(a, lay))
    return Flow(name=name, nbytes=nbytes, source=source, source_layouts=source_layouts, needs_grad=needs_grad,
                readers=tuple(readers), forward_s=fwd, backward_s=bwd, forbidden=forbidden)



# ----------------------------------------------------------------------------------------------------------------
# Structural identity (for caching solutions of identical layers)
# ----------------------------------------------------------------------------------------------------------------

def structural_key(nodes: Sequence[Node]) -> str:
    """Hex digest of what prices a segment: ops, shapes, params, attrs, wiring and module paths relative to the
    segment's own prefix. Node names are left out, so the blocks of a transformer share one key."""
    index = {n.name: i for i, n in enumerate(nodes)}
    external: dict[str, int] = {}
    prefix = module_prefix(nodes)
    rows = []
    for n in nodes:
        wires = []
        for src in n.inputs:
            if src in index:
                wires.append(f"n{index[src]}")
            else:
                wires.append(f"x{external.setdefault(src, len(external))}")
        rows.append([n.op_kind.value, n.target, relative_module(n.module_path, prefix), wires,
                     [s.to_dict() for s in n.input_specs], [s.to_dict() for s in n.output_specs],
                     [s.to_dict() for s in n.param_specs], n.forward_flops, n.backward_flops, n.bytes_read,
                     n.bytes_written, n.saved_bytes, [[k, repr(v)] for k, v in n.attrs]])
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()



# ----------------------------------------------------------------------------------------------------------------
# The real pricer: costmodel.operators.node_time and costmodel.hardware.collectives.collective_time
# ----------------------------------------------------------------------------------------------------------------

def make_pricer(cluster: Cluster, device: DeviceSpec, tp_group: CommGroup, *, dtype: str = "bfloat16",
                profile: OpProfile | None = None, framework: FrameworkCosts | None = None,
                fp8: Float8Recipe | None = None) -> Pricer:
    """Price nodes with `node_time` on `device` (linear layers in FP8 with `fp8`) and moves with `collective_time`
    over `tp_group` of `cluster`.

    Collective byte conventions (`collective_time`'s): all-reduce the buffer, all-gather the gathered output,
    reduce-scatter the input, all-to-all what one device sends in total -- its whole shard, bytes/t, of which
    `collective_time` moves the (t-1)/t that leaves the device. Local slices copy the shard and local scales rewrite the tensor, at the device's
    achievable memory bandwidth (read + write).
    """
    tp = tp_group.size
    local_bw = device.memory_bandwidth * device.memory_efficiency
    collective_of = {Move.ALL_REDUCE: Collective.ALL_REDUCE, Move.REDUCE_SCATTER: Collective.REDUCE_SCATTER,
                     Move.ALL_GATHER: Collective.ALL_GATHER, Move.ALL_TO_ALL: Collective.ALL_TO_ALL}

    def node_cost(node: Node, flops_scale: float, bytes_scale: float, param_scale: float) -> tuple[float, float]:
        return node_time(node, device, flops_scale=flops_scale, bytes_scale=bytes_scale, param_scale=param_scale,
                         dtype=dtype, profile=profile, fp8=fp8, fp8_casts=False)

    def cast_cost(node: Node, input_scale: float, output_scale: float, param_scale: float) -> tuple[float, float]:
        if fp8 is None or not converted_node(node):
            return 0.0, 0.0
        return fp8_cast_times(node, device, fp8, bytes_scale=0.0, param_scale=param_scale, dtype=dtype,
                              input_scale=input_scale, output_scale=output_scale)

    def move_cost(move: Move, nbytes: float) -> float:
        if nbytes <= 0 or tp == 1:
            return 0.0
        if move is Move.LOCAL_SLICE:
            return 2 * nbytes / tp / local_bw
        if move is Move.LOCAL_SCALE:
            return 2 * nbytes / local_bw
        sent = nbytes / tp if move is Move.ALL_TO_ALL else nbytes
        return collective_time(collective_of[move], sent, tp_group, cluster)

    framework = framework or NO_FRAMEWORK_COSTS
    return Pricer(node_time=node_cost, move_time=move_cost, sharded_module=framework.tp_module_cost(tp),
                  grad_sync_per_tensor_s=framework.grad_sync_per_tensor(tp),
                  fp8_cast_time=cast_cost if fp8 is not None else None)

