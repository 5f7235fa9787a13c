"""The one graph-level classification rule: explicit ("math") attention, QK^T matmul -> scale/mask -> softmax ->
dropout -> AV matmul, tagged ("attention_core", True) with its heads and head_dim -- the set selective activation
recomputation (Korthikanti et al. 2022, Sec. 5) recomputes. Fused SDPA calls are tagged by `ir.op_classify`."""

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
