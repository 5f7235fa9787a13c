"""The graph-level classification rules of attention.

Explicit ("math") attention, QK^T matmul -> scale/mask -> softmax -> dropout -> AV matmul, is tagged
("attention_core", True) with its heads and head_dim -- the set selective activation recomputation (Korthikanti
et al. 2022, Sec. 5) recomputes (`mark_attention_core`). Fused SDPA calls are tagged by `ir.op_classify`.

Grouped-query attention whose K and V were expanded to the query heads before a fused SDPA call (the zoo's
`repeat_interleave`, transformers' `repeat_kv`: `expand` then `reshape`) gets its true key/value head count
(`mark_grouped_kv`): what leaves the layer's projections, and what context parallelism has to exchange, is the
un-expanded K and V (Megatron-LM and Llama 3's context parallelism pass the KV heads, not the query heads).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ir.graph import Node, OpKind

# Ops allowed between the QK^T matmul and the softmax (scale, mask, bias, cast) and between softmax and the AV
# matmul (dropout, cast).
_CORE_PASS_KINDS = (OpKind.ELEMENTWISE, OpKind.VIEW)


def mark_attention_core(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """Tag explicit attention (QK^T -> softmax -> AV) with ("attention_core", True) and heads/head_dim.

    For each SOFTMAX, walk back through elementwise/view ops on its first input to a MATMUL (the scores) and
    forward through single-consumer elementwise/view ops to a MATMUL that consumes the probabilities (the AV
    product). Only when both are found is the chain tagged, so a softmax elsewhere (a router) is left alone.
    """
    by_name = {n.name: n for n in nodes}
    consumers: dict[str, list[str]] = {}
    for n in nodes:
        for src in dict.fromkeys(n.inputs):
            consumers.setdefault(src, []).append(n.name)
    tagged: dict[str, Node] = {}
    for sm in nodes:
        if sm.op_kind is not OpKind.SOFTMAX or not sm.inputs:
            continue
        back = _walk_back(sm, by_name)
        fwd = _walk_forward(sm, by_name, consumers)
        if back is None or fwd is None:
            continue
        qk, av = by_name[back[-1]], by_name[fwd[-1]]
        heads = _heads(qk)
        for name in (*back, sm.name, *fwd):
            node = tagged.get(name, by_name[name])
            extra = {"attention_core": True}
            if name in (qk.name, av.name) and heads is not None:
                extra.update(num_heads=heads[0], head_dim=heads[1])
            tagged[name] = _with_attrs(node, extra)
    return tuple(tagged.get(n.name, n) for n in nodes)


_REPEAT_TARGETS = ("repeat", "expand")
"""Target-name fragments of the ops that copy each KV head to the query heads of its group."""


def mark_grouped_kv(nodes: Sequence[Node]) -> tuple[Node, ...]:
    """Set ("num_kv_heads", H / g) on fused attention ops whose K and V both come, through view ops that keep
    their element count, from a repeat/expand of a tensor with 1/g of their elements (g > 1 dividing the H query
    heads). Attention already called with fewer KV heads keeps the count `ir.op_classify` read from K."""
    by_name = {n.name: n for n in nodes}
    tagged: dict[str, Node] = {}
    for n in nodes:
        heads = n.attr("num_heads")
        if n.op_kind is not OpKind.ATTENTION or heads is None or n.attr("num_kv_heads") != heads:
            continue
        if len(n.inputs) < 3 or len(n.input_specs) < 3:
            continue
        groups = {_kv_repeat(n.inputs[k], n.input_specs[k].numel, by_name) for k in (1, 2)}
        g = groups.pop() if len(groups) == 1 else 1
        if g > 1 and int(heads) % g == 0:
            tagged[n.name] = _with_attrs(n, {"num_kv_heads": int(heads) // g})
    return tuple(tagged.get(n.name, n) for n in nodes)


def _kv_repeat(name: str, numel: int, by_name: Mapping[str, Node]) -> int:
    """The factor a repeat/expand multiplied the value `name` (of `numel` elements) by, through size-keeping
    view ops; 1 when there is none."""
    cur = by_name.get(name)
    for _ in range(8):
        if cur is None or cur.op_kind is not OpKind.VIEW or not cur.input_specs or not cur.inputs:
            return 1
        before = cur.input_specs[0].numel
        if before != numel:
            repeat = any(t in cur.target.lower() for t in _REPEAT_TARGETS)
            return numel // before if repeat and 0 < before < numel and numel % before == 0 else 1
        cur = by_name.get(cur.inputs[0])
    return 1


def _walk_back(sm: Node, by_name: Mapping[str, Node]) -> list[str] | None:
    path: list[str] = []
    cur = by_name[sm.inputs[0]]
    for _ in range(16):
        if cur.op_kind is OpKind.MATMUL:
            path.append(cur.name)
            return path
        if cur.op_kind not in _CORE_PASS_KINDS or not cur.inputs:
            return None
        path.append(cur.name)
        cur = by_name[cur.inputs[0]]
    return None


def _walk_forward(sm: Node, by_name, consumers) -> list[str] | None:
    path: list[str] = []
    cur = sm
    for _ in range(16):
        users = consumers.get(cur.name, [])
        if len(users) != 1:
            return None
        nxt = by_name[users[0]]
        path.append(nxt.name)
        if nxt.op_kind is OpKind.MATMUL:
            return path
        if nxt.op_kind not in _CORE_PASS_KINDS:
            return None
        cur = nxt
    return None


def _heads(qk: Node) -> tuple[int, int] | None:
    if qk.input_specs and len(qk.input_specs[0].shape) == 4:
        shape = qk.input_specs[0].shape  # (B, heads, S, head_dim)
        return shape[1], shape[3]
    return None


def _with_attrs(node: Node, extra: Mapping[str, Any]) -> Node:
    attrs = dict(node.attrs)
    attrs.update(extra)
    return replace(node, attrs=tuple(sorted(attrs.items())))
