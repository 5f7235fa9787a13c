"""Per-node sharding strategies over the tensor-parallel axis, one rule per op kind (math in `costmodel.sharding.layout`).

Every node has the replicated strategy (first); the rules add, when shapes divide by tp:
- linear: colwise (R -> S(-1), weight split on output features), rowwise (S(-1) -> P, weight split on input
  features), sequence (S(seq) -> S(seq), weight replicated, gradients all-reduced) under sequence parallelism;
- embedding: vocab (R -> P, table split on rows, as Megatron's vocab-parallel embedding; the rows are what a tied
  LM head splits too, so tied weights stay consistent), sequence under sequence parallelism;
- matmul: split a shared batch-like dim (heads), the rows of A, the columns of B, or the contraction (-> P);
- attention (fused SDPA): head-sharded when the query and key/value head counts divide by tp;
- elementwise: S(d) passes through (broadcast inputs stay R); P passes through ops linear in their inputs;
- norm / softmax: S(d) on dims they do not reduce; reduction: kept dims pass, sum/mean over a split dim -> P;
- view ops: S(d) maps through the op's dim map, P passes; loss: vocab-parallel cross entropy;
- conv, pool, routing, placeholders and unknown ops: replicated only (always feasible).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from costmodel.sharding.dims import (
    DimLabel,
    Labels,
    input_dim_maps,
    is_float,
    norm_dims,
    op_name,
    reduced_dims,
)
from costmodel.sharding.layout import PARTIAL, REPLICATED, Layout, LayoutKind, Move, shard
from ir.graph import Node, OpKind, TensorSpec

VOCAB_PARALLEL_LOSS_ALL_REDUCES = 3
"""Megatron's vocab-parallel cross entropy all-reduces the per-token max, predicted logit and sum of exponentials
(Shoeybi et al. 2019, §3; megatron/core/tensor_parallel/cross_entropy.py), each one fp32 value per token."""

FP32_BYTES = 4

_LINEAR_IN_ALL_INPUTS = frozenset({"add", "iadd", "radd", "sub", "isub"})
"""Elementwise ops that are linear in all inputs at once: P + P -> P (adding a replicated value is not)."""
_LINEAR_IN_ONE_INPUT = frozenset({"mul", "imul", "rmul", "div", "truediv", "itruediv", "neg"})
"""Elementwise ops linear in one input when the others are fixed: P * R -> P (P * P is not)."""
_SUM_LIKE = frozenset({"sum", "mean"})


class Style(enum.StrEnum):
    """Module-level forms a strategy maps to: the style the plan records and the runtime applies per module."""

    REPLICATE = "replicate"
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    SEQUENCE = "sequence"
    VOCAB = "vocab"
    HEADS = "heads"


@dataclass(frozen=True, slots=True)
class NodeStrategy:
    """One way to run a node over the tensor-parallel axis."""

    name: str
    inputs: tuple[Layout, ...]
    """Layout each tensor input must arrive in (one per `Node.input_specs`)."""
    output: Layout
    """Layout of every output."""
    input_grads: tuple[Layout | None, ...]
    """Layout of the gradient the backward produces for each input (None: the input needs no gradient)."""
    work_fraction: float = 1.0
    """Share of the node's FLOPs and bytes one device does."""
    param_dims: tuple[int | None, ...] = ()
    """Per parameter, the dim it is sharded on, or None when replicated."""
    style: Style | None = None
    extra_forward: tuple[tuple[Move, float], ...] = ()
    """Extra communication inside the op in forward: (move, bytes at the traced batch)."""

    @property
    def is_replicated(self) -> bool:
        return self.output == REPLICATED and all(lay == REPLICATED for lay in self.inputs)


@dataclass(frozen=True, slots=True)
class StrategyContext:
    """What strategy rules need beyond the node: the degree, whether sequence dims may be sharded, labels."""

    tp: int
    sequence_parallel: bool
    in_labels: tuple[Labels, ...]
    out_labels: Labels


def can_shard(spec: TensorSpec, labels: Labels, dim: int, ctx: StrategyContext) -> bool:
    """S(dim) is offered when the dim divides evenly, is not the batch (data parallelism's job), and is not the
    sequence unless sequence parallelism is on."""
    if not 0 <= dim < len(spec.shape) or spec.shape[dim] % ctx.tp or spec.shape[dim] < ctx.tp:
        return False
    label = labels[dim] if dim < len(labels) else None
    return label is not DimLabel.BATCH and (label is not DimLabel.SEQ or ctx.sequence_parallel)


def _grads_for(node: Node, inputs: Sequence[Layout], output: Layout) -> tuple[Layout | None, ...]:
    """Gradient layouts by the duality rules of the module docstring."""
    split = output != REPLICATED
    grads: list[Layout | None] = []
    for spec, lay in zip(node.input_specs, inputs, strict=True):
        if not is_float(spec):
            grads.append(None)
        elif lay.is_shard:
            grads.append(lay)
        elif lay.kind is LayoutKind.PARTIAL:
            grads.append(REPLICATED)
        else:
            grads.append(PARTIAL if split else REPLICATED)
    return tuple(grads)


def _strategy(node: Node, name: str, inputs: Sequence[Layout], output: Layout, *, work_fraction: float = 1.0,
              param_dims: Sequence[int | None] | None = None, style: Style | None = None,
              extra_forward: tuple[tuple[Move, float], ...] = ()) -> NodeStrategy:
    dims = tuple(param_dims) if param_dims is not None else tuple(None for _ in node.param_specs)
    return NodeStrategy(name=name, inputs=tuple(inputs), output=output,
                        input_grads=_grads_for(node, inputs, output), work_fraction=work_fraction,
                        param_dims=dims, style=style, extra_forward=extra_forward)


def replicated_strategy(node: Node) -> NodeStrategy:
    style = Style.REPLICATE if node.param_specs else None
    return _strategy(node, "replicate", [REPLICATED] * len(node.input_specs), REPLICATED, style=style)


def node_strategies(node: Node, ctx: StrategyContext) -> tuple[NodeStrategy, ...]:
    """All strategies of a node, the replicated one first; duplicates (same layouts) removed, order kept."""
    found = [replicated_strategy(node)]
    if ctx.tp > 1 and node.output_specs:
        rule = _RULES.get(node.op_kind)
        if rule is not None:
            found.extend(rule(node, ctx))
    unique: dict[tuple[tuple[Layout, ...], Layout, tuple[int | None, ...]], NodeStrategy] = {}
    for s in found:
        if _outputs_valid(node, s.output, ctx.tp):
            unique.setdefault((s.inputs, s.output, s.param_dims), s)
    return tuple(unique.values())


def _outputs_valid(node: Node, layout: Layout, tp: int) -> bool:
    for spec in node.output_specs:
        if layout.is_shard and (layout.dim >= len(spec.shape) or spec.shape[layout.dim] % tp):
            return False
        if layout.kind is LayoutKind.PARTIAL and not is_float(spec):
            return False
    return True


def _tensor_style(node: Node, sharded_dim_label: DimLabel | None) -> Style | None:
    """Style of a parameter-holding norm/elementwise module run on sharded activations."""
    if not node.param_specs:
        return None
    return Style.SEQUENCE if sharded_dim_label is DimLabel.SEQ else None


def _passthrough(node: Node, ctx: StrategyContext, blocked: frozenset[int] = frozenset()) -> list[NodeStrategy]:
    """S(d) on an output dim d flows from every input that has d (broadcast inputs stay R): elementwise, norms
    and softmax over dims other than d."""
    out = node.output_specs[0]
    maps = input_dim_maps(node)
    result = []
    for d in range(len(out.shape)):
        if d in blocked or not can_shard(out, ctx.out_labels, d, ctx):
            continue
        inputs = []
        for spec, dmap in zip(node.input_specs, maps, strict=True):
            src = [k for k, v in dmap.items() if v == d]
            inputs.append(shard(src[0]) if src and spec.shape[src[0]] == out.shape[d] else REPLICATED)
        if all(lay == REPLICATED for lay in inputs):
            continue
        label = ctx.out_labels[d] if d < len(ctx.out_labels) else None
        result.append(_strategy(node, f"S({d})", inputs, shard(d), work_fraction=1.0 / ctx.tp,
                                style=_tensor_style(node, label)))
    return result


def _elementwise_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    result = _passthrough(node, ctx)
    floats = [is_float(s) for s in node.input_specs]
    if not is_float(node.output_specs[0]) or node.param_specs:
        return result
    name = op_name(node.target)
    n = len(node.input_specs)
    if name in _LINEAR_IN_ALL_INPUTS and n >= 2 and all(floats):
        result.append(_strategy(node, "P", [PARTIAL] * n, PARTIAL))
    elif name in _LINEAR_IN_ONE_INPUT and n >= 1 and floats[0]:
        result.append(_strategy(node, "P", [PARTIAL] + [REPLICATED] * (n - 1), PARTIAL))
    return result


def _norm_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    rank = len(node.output_specs[0].shape)
    return _passthrough(node, ctx, blocked=norm_dims(node, rank))


def _softmax_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    rank = len(node.output_specs[0].shape)
    return _passthrough(node, ctx, blocked=reduced_dims(node, rank) if node.attr("dim") is not None
                        else frozenset({rank - 1}))


def _linear_params(node: Node) -> tuple[int | None, int | None]:
    """Indexes of the weight (out, in) and bias (out,) among the node's parameters."""
    weight = next((i for i, s in enumerate(node.param_specs) if len(s.shape) == 2), None)
    bias = next((i for i, s in enumerate(node.param_specs) if len(s.shape) == 1), None)
    return weight, bias


def _linear_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    weight, bias = _linear_params(node)
    if weight is None or not node.input_specs:
        return []
    x, out = node.input_specs[0], node.output_specs[0]
    rest = [REPLICATED] * (len(node.input_specs) - 1)
    last_in, last_out = len(x.shape) - 1, len(out.shape) - 1
    n_params = len(node.param_specs)
    result = []

    def dims(weight_dim: int | None, bias_dim: int | None) -> list[int | None]:
        d: list[int | None] = [None] * n_params
        d[weight] = weight_dim
        if bias is not None:
            d[bias] = bias_dim
        return d

    if can_shard(out, ctx.out_labels, last_out, ctx):
        result.append(_strategy(node, "colwise", [REPLICATED, *rest], shard(last_out), work_fraction=1 / ctx.tp,
                                param_dims=dims(0, 0), style=Style.COLWISE))
    if can_shard(x, ctx.in_labels[0], last_in, ctx):
        result.append(_strategy(node, "rowwise", [shard(last_in), *rest], PARTIAL, work_fraction=1 / ctx.tp,
                                param_dims=dims(1, None), style=Style.ROWWISE))
    for d in range(last_in):
        if ctx.in_labels[0][d] is DimLabel.SEQ and can_shard(x, ctx.in_labels[0], d, ctx):
            result.append(_strategy(node, "sequence", [shard(d), *rest], shard(d), work_fraction=1 / ctx.tp,
                                    param_dims=dims(None, None), style=Style.SEQUENCE))
    return result


def _embedding_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    weight, _ = _linear_params(node)
    if weight is None or not node.input_specs:
        return []
    ids, out = node.input_specs[0], node.output_specs[0]
    vocab = node.param_specs[weight].shape[0]
    rest = [REPLICATED] * (len(node.input_specs) - 1)
    n_params = len(node.param_specs)

    def dims(weight_dim: int | None) -> list[int | None]:
        d: list[int | None] = [None] * n_params
        d[weight] = weight_dim
        return d

    result = []
    if vocab % ctx.tp == 0 and vocab >= ctx.tp and is_float(out):
        # every device looks up the ids it owns and writes zeros elsewhere: a full-size partial sum
        result.append(_strategy(node, "vocab", [REPLICATED, *rest], PARTIAL, param_dims=dims(0),
                                style=Style.VOCAB))
    for d in range(len(ids.shape)):
        if ctx.in_labels[0][d] is DimLabel.SEQ and can_shard(ids, ctx.in_labels[0], d, ctx):
            result.append(_strategy(node, "sequence", [shard(d), *rest], shard(d), work_fraction=1 / ctx.tp,
                                    param_dims=dims(None), style=Style.SEQUENCE))
    return result


def _matmul_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    if len(node.input_specs) != 2:
        return []
    a, b = node.input_specs
    out = node.output_specs[0]
    ra, rb, ro = len(a.shape), len(b.shape), len(out.shape)
    if min(ra, rb, ro) < 2:
        return []
    ma, mb = input_dim_maps(node)
    la, lb = ctx.in_labels
    heads_style = Style.HEADS if node.attr("attention_core") else None
    result = []
    for d in range(ro - 2):  # batch-like dims (heads): both operands split the same way
        if not can_shard(out, ctx.out_labels, d, ctx):
            continue
        ins = []
        for m in (ma, mb):
            src = [k for k, v in m.items() if v == d]
            ins.append(shard(src[0]) if src else REPLICATED)
        if all(lay == REPLICATED for lay in ins):
            continue
        result.append(_strategy(node, f"S({d})", ins, shard(d), work_fraction=1 / ctx.tp, style=heads_style))
    if can_shard(out, ctx.out_labels, ro - 2, ctx) and can_shard(a, la, ra - 2, ctx):
        result.append(_strategy(node, "rows", [shard(ra - 2), REPLICATED], shard(ro - 2), work_fraction=1 / ctx.tp))
    if can_shard(out, ctx.out_labels, ro - 1, ctx) and can_shard(b, lb, rb - 1, ctx):
        result.append(_strategy(node, "cols", [REPLICATED, shard(rb - 1)], shard(ro - 1), work_fraction=1 / ctx.tp))
    if can_shard(a, la, ra - 1, ctx) and can_shard(b, lb, rb - 2, ctx) and is_float(out):
        result.append(_strategy(node, "contract", [shard(ra - 1), shard(rb - 2)], PARTIAL,
                                work_fraction=1 / ctx.tp))
    return result


def _attention_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    """Fused SDPA over (batch, heads, seq, head_dim): head-sharded when every operand's head count divides, with
    per-head parameters (attention sinks, one logit per head) split with the heads. A leaf attention module with
    its own projections (nn.MultiheadAttention) stays replicated."""
    if len(node.input_specs) < 3:
        return []
    heads_total = node.attr("num_heads")
    if node.param_specs and not all(p.shape == (heads_total,) for p in node.param_specs):
        return []
    q = node.input_specs[0]
    rank = len(q.shape)
    if rank < 4:
        return []
    h = rank - 3
    num_heads = node.attr("num_heads")
    if isinstance(num_heads, int) and num_heads % ctx.tp:
        return []
    ins = []
    for i, spec in enumerate(node.input_specs):
        labels = ctx.in_labels[i]
        if i < 3:
            if len(spec.shape) != rank or not can_shard(spec, labels, h, ctx):
                return []
            ins.append(shard(h))
        else:  # mask / bias: split with the heads when it has them, else broadcast
            has_heads = len(spec.shape) == rank and spec.shape[h] == q.shape[h] and q.shape[h] > 1
            ins.append(shard(h) if has_heads else REPLICATED)
    return [_strategy(node, "heads", ins, shard(h), work_fraction=1 / ctx.tp, style=Style.HEADS,
                      param_dims=[0] * len(node.param_specs))]


def _reduction_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    if not node.input_specs:
        return []
    x = node.input_specs[0]
    rest = [REPLICATED] * (len(node.input_specs) - 1)
    dmap = input_dim_maps(node)[0]
    result = []
    for d_in, d_out in sorted(dmap.items()):
        if can_shard(x, ctx.in_labels[0], d_in, ctx):
            result.append(_strategy(node, f"S({d_out})", [shard(d_in), *rest], shard(d_out),
                                    work_fraction=1 / ctx.tp))
    if op_name(node.target) in _SUM_LIKE and is_float(node.output_specs[0]):
        for d in sorted(reduced_dims(node, len(x.shape))):
            if can_shard(x, ctx.in_labels[0], d, ctx):
                result.append(_strategy(node, f"S({d})->P", [shard(d), *rest], PARTIAL, work_fraction=1 / ctx.tp))
    return result


def _loss_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    """Vocab-parallel cross entropy: logits sharded on the class dim, three per-token fp32 all-reduces."""
    if "cross_entropy" not in node.target.lower() or not node.input_specs:
        return []
    logits = node.input_specs[0]
    if len(logits.shape) < 2:
        return []
    class_dim = 1  # cross_entropy takes (N, C) or (N, C, d1, ...)
    if not can_shard(logits, ctx.in_labels[0], class_dim, ctx):
        return []
    tokens = logits.numel // logits.shape[class_dim]
    comm = ((Move.ALL_REDUCE, float(VOCAB_PARALLEL_LOSS_ALL_REDUCES * tokens * FP32_BYTES)),)
    ins = [shard(class_dim)] + [REPLICATED] * (len(node.input_specs) - 1)
    return [_strategy(node, "vocab", ins, REPLICATED, work_fraction=1 / ctx.tp, extra_forward=comm)]


def _view_rules(node: Node, ctx: StrategyContext) -> list[NodeStrategy]:
    maps = input_dim_maps(node)
    out = node.output_specs[0]
    result = []
    for d in range(len(out.shape)):
        if not can_shard(out, ctx.out_labels, d, ctx):
            continue
        ins = []
        for i, (spec, m) in enumerate(zip(node.input_specs, maps, strict=True)):
            src = [k for k, v in m.items() if v == d]
            if not src or not can_shard(spec, ctx.in_labels[i], src[0], ctx):
                break
            ins.append(shard(src[0]))
        else:
            if ins:
                result.append(_strategy(node, f"S({d})", ins, shard(d), work_fraction=1 / ctx.tp))
    if node.input_specs and all(is_float(s) for s in node.input_specs) and is_float(out):
        result.append(_strategy(node, "P", [PARTIAL] * len(node.input_specs), PARTIAL))
    return result


_RULES: Mapping[OpKind, Callable[[Node, StrategyContext], list[NodeStrategy]]] = {
    OpKind.ELEMENTWISE: _elementwise_rules,
    OpKind.NORM: _norm_rules,
    OpKind.SOFTMAX: _softmax_rules,
    OpKind.LINEAR: _linear_rules,
    OpKind.EMBEDDING: _embedding_rules,
    OpKind.MATMUL: _matmul_rules,
    OpKind.ATTENTION: _attention_rules,
    OpKind.REDUCTION: _reduction_rules,
    OpKind.LOSS: _loss_rules,
    OpKind.VIEW: _view_rules,
}
"""Op kinds without a rule (conv, pool, routing, placeholders, other) are replicated only."""


