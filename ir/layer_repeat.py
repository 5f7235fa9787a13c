"""`repeat_layers`: the graph of a deep model from the trace of a shorter one with the same repeating layers.

Tracing costs time per layer (torch.export of DeepSeek-V3's 61 layers takes ~20 s here), while a deep model's
layers repeat: past a few distinct layers (DeepSeek-V3's three dense ones), layer i has the structure of layer
i - p for a period p (1 for a uniform stack, 6 for Gemma 3's five local and one global layer). The caller
(`models.layer_stack`) proves that on the modules and traces a model of the same config with T < L layers, where
L - T is a multiple of p; this module turns that graph into the graph of L layers without tracing them, and
checks on the trace itself that doing so is sound.

What the trace must show (else `ValueError`, and the caller traces the whole model): every layer `path.j` owns
one contiguous run of nodes; the runs follow each other with no node in between; each layer u of the last
period [T - p, T) repeats layer u - p node for node (kind, target, relative module path, shapes, FLOPs, bytes,
attrs, and wiring: reads of layer nodes move with the layer, other reads stay the same node). Full layer i >= T
is then a copy of the traced layer j in [T - p, T) with j = i (mod p), moved by d = i - j layers:
- a read of a node in layer u moves to layer u + d, at the same offset (a traced node or an earlier copy); only
  reads of the two compared periods (u >= T - 2p) are moved, since only their layouts are checked;
- a read of a node outside every layer (embeddings, rotary tables) stays: it is shared.
Nodes after the stack read layer u + (L - T) for a layer u of the last period (so the last layer keeps its type).
Copies are named `<template name>_L<i>`; module paths and parameter names under `path.j` become `path.i`, so
the copies' parameters are new, and parameters outside the stack (a tied head) stay shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ir.graph import Graph, Node


@dataclass(frozen=True)
class RepeatedStack:
    """A stack of `total` layers at module path `path`, of which the first `traced` were traced; the layers
    repeat with `period`."""

    path: str
    total: int
    traced: int
    period: int

    def __post_init__(self) -> None:
        if not (self.period >= 1 and 2 * self.period <= self.traced <= self.total
                and (self.total - self.traced) % self.period == 0):
            raise ValueError(f"bad layer stack {self}: need 2 * period <= traced <= total, with total - traced a "
                             f"multiple of the period")

    @property
    def compared(self) -> int:
        """First layer whose reads may be moved: the start of the two compared periods."""
        return self.traced - 2 * self.period


def repeat_layers(graph: Graph, stack: RepeatedStack) -> Graph:
    """The graph of `stack.total` layers from `graph`, traced with `stack.traced` (module docstring)."""
    spans = _layer_spans(graph.nodes, stack.path, stack.traced)
    expander = _Expander(graph.nodes, spans, stack)
    _check_periodic(graph.nodes, spans, stack, expander.position)
    last = spans[-1][1]
    nodes = list(graph.nodes[:last])
    new_params: dict[str, int] = {}
    new_bytes: dict[str, int] = {}
    for i in range(stack.traced, stack.total):
        for node in expander.copy_layer(i):
            nodes.append(node)
            for name, spec in zip(node.param_names, node.param_specs, strict=True):
                if name not in new_params and name.startswith(f"{stack.path}.{i}."):
                    new_params[name], new_bytes[name] = spec.numel, spec.nbytes
    nodes.extend(expander.suffix(graph.nodes[last:]))
    return dataclasses.replace(graph, nodes=tuple(nodes), param_count=graph.param_count + sum(new_params.values()),
                               param_bytes=graph.param_bytes + sum(new_bytes.values()))


def _layer_spans(nodes: Sequence[Node], path: str, layers: int) -> list[tuple[int, int]]:
    """[start, stop) of each traced layer's nodes; raises unless they are contiguous and back to back."""
    owner = [_layer_of(n.module_path, path) for n in nodes]
    spans: list[tuple[int, int]] = []
    for j in range(layers):
        where = [q for q, o in enumerate(owner) if o == j]
        if not where or where[-1] - where[0] + 1 != len(where):
            raise ValueError(f"layer {path}.{j} is not one contiguous run of nodes")
        if spans and spans[-1][1] != where[0]:
            raise ValueError(f"nodes between layers {path}.{j - 1} and {path}.{j}")
        spans.append((where[0], where[-1] + 1))
    if any(o is not None and o >= layers for o in owner):
        raise ValueError(f"the trace has more than {layers} layers under {path}")
    return spans


def _layer_of(module_path: str, path: str) -> int | None:
    if not module_path.startswith(path + "."):
        return None
    head = module_path[len(path) + 1:].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _check_periodic(nodes: Sequence[Node], spans: list[tuple[int, int]], stack: RepeatedStack,
                    position: dict[str, int]) -> None:
    """Every layer u of the last traced period repeats layer u - p: same nodes apart from names, layer-relative
    paths and wiring moved by p layers. `position`: node name -> index in `nodes`."""
    for u in range(stack.traced - stack.period, stack.traced):
        (a, b), (c, e) = spans[u - stack.period], spans[u]
        if b - a != e - c:
            raise ValueError(f"layer {stack.path}.{u} has {e - c} nodes, layer {u - stack.period} {b - a}")
        shift = c - a
        for earlier, later in zip(nodes[a:b], nodes[c:e], strict=True):
            if _shape(earlier, stack.path, u - stack.period) != _shape(later, stack.path, u):
                raise ValueError(f"{later.name} in layer {stack.path}.{u} differs from {earlier.name}")
            if not _wired_alike(position, earlier, later, shift, (spans[0][0], spans[-1][1])):
                raise ValueError(f"{later.name} in layer {stack.path}.{u} reads differently from {earlier.name}")


def _shape(node: Node, path: str, layer: int) -> tuple[object, ...]:
    own = f"{path}.{layer}"
    return (node.op_kind, node.target, _rebase(node.module_path, own, ""), node.input_specs, node.output_specs,
            tuple(_rebase(p, own, "") for p in node.param_names), node.param_specs, node.forward_flops,
            node.backward_flops, node.bytes_read, node.bytes_written, node.saved_bytes, node.attrs)


def _wired_alike(position: dict[str, int], earlier: Node, later: Node, shift: int, stack: tuple[int, int]) -> bool:
    """Reads of layer nodes move by `shift` positions (as far as the layer moved); other reads stay the same."""
    for src_e, src_l in zip(earlier.inputs, later.inputs, strict=True):
        qe, ql = position[src_e], position[src_l]
        if ql != (qe + shift if stack[0] <= qe < stack[1] else qe):
            return False
    return True


class _Expander:
    """Names and nodes of the copied layers."""

    def __init__(self, nodes: Sequence[Node], spans: list[tuple[int, int]], stack: RepeatedStack) -> None:
        self.nodes, self.spans, self.stack = nodes, spans, stack
        self.position = {n.name: q for q, n in enumerate(nodes)}
        self.layer = {q: u for u, (a, b) in enumerate(spans) for q in range(a, b)}

    def template(self, i: int) -> int:
        """The traced layer that full layer i copies: the one of the last traced period with i's residue."""
        first = self.stack.traced - self.stack.period
        return i if i < self.stack.traced else first + (i - first) % self.stack.period

    def name_at(self, layer: int, offset: int) -> str:
        """Name of the node at `offset` within full layer `layer` (traced, or a copy)."""
        j = self.template(layer)
        name = self.nodes[self.spans[j][0] + offset].name
        return name if layer == j else f"{name}_L{layer}"

    def moved(self, src: str, shift: int) -> str:
        """A read of `src` by a node moved by `shift` layers."""
        q = self.position[src]
        u = self.layer.get(q)
        if u is None:
            return src  # outside every layer: shared
        if u < self.stack.compared:
            raise ValueError(f"a repeated layer reads {src} of layer {self.stack.path}.{u}, before the compared ones")
        return self.name_at(u + shift, q - self.spans[u][0])

    def copy_layer(self, i: int) -> list[Node]:
        j = self.template(i)
        shift = i - j
        own, new = f"{self.stack.path}.{j}", f"{self.stack.path}.{i}"
        a, b = self.spans[j]
        return [dataclasses.replace(
            node, name=f"{node.name}_L{i}", module_path=_rebase(node.module_path, own, new),
            inputs=tuple(self.moved(s, shift) for s in node.inputs),
            param_names=tuple(_rebase(p, own, new) for p in node.param_names))
            for node in self.nodes[a:b]]

    def suffix(self, nodes: Sequence[Node]) -> list[Node]:
        """Nodes after the stack, reading the last layers of the full stack."""
        shift = self.stack.total - self.stack.traced
        for node in nodes:
            for src in node.inputs:
                u = self.layer.get(self.position[src])
                if u is not None and u < self.stack.traced - self.stack.period:
                    raise ValueError(f"{node.name} after the stack reads layer {self.stack.path}.{u}, not the last ones")
        return [dataclasses.replace(node, inputs=tuple(self.moved(s, shift) for s in node.inputs)) for node in nodes]


def _rebase(name: str, own: str, new: str) -> str:
    """`own...` -> `new...` for a module path or parameter name under layer `own`; anything else unchanged."""
    if name == own:
        return new
    return new + name[len(own):] if name.startswith(own + ".") else name
