"""Routed experts found from the traced graph's structure, not from module class names.

A mixture-of-experts layer is recognized by two things every layout transformers (and the zoo) uses has:

1. a top-k over E scores: the router (ROUTING nodes record ("k", int) and ("num_experts", int) from `topk`);
2. expert weights for those E experts, in either layout:
   - stacked: a LINEAR whose parameter is 3-D with leading dim E (`gate_up_proj` (E, 2f, h) or (E, h, 2f),
     `down_proj` (E, h, f), the zoo's `Experts`), one matmul for all experts;
   - listed: E LINEAR modules whose module paths differ only in one list index that takes E values below the
     layer's own index ("layers.3.mlp.experts.0.gate_proj" ... "experts.7.gate_proj").

A router may run several top-k's: DeepSeek-V3's group-limited routing first picks `topk_group` of `n_group`
groups (a top-k over n_group, and one over the experts of each group) and then `num_experts_per_tok` of all E.
Only a top-k whose width has expert weights of that count is the routing top-k, so E and k come from it. The
group top-k is the router's other top-k over a (tokens, G) score with 1 < G < E and G dividing E (transformers'
`DeepseekV3TopkRouter`: `n_group` = G, `topk_group` = its k); the per-group top-2 before it runs over a
(tokens, G, E / G) tensor, one dimension more than the routing top-k's (tokens, E), and is not it.
Everything else in the layer -- shared experts (DeepSeek, Qwen2-MoE, Llama 4), the router's own linear -- is dense:
replicated or tensor-parallel like any feed-forward, never split over expert-parallel ranks.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ir.graph import Node, OpKind


class ExpertLayout(enum.StrEnum):
    """How the experts' weights are held."""

    STACKED = "stacked"  # one (E, ...) parameter per projection
    LISTED = "listed"    # one module per expert in a list


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """The routed experts among some nodes (a segment, or the whole graph)."""

    num_experts: int
    top_k: int
    layout: ExpertLayout
    linears: tuple[str, ...]
    """Names of the LINEAR nodes that compute the routed experts."""
    param_names: tuple[str, ...]
    """Names of the routed experts' parameters (each once), sorted."""
    param_numel: int
    choices: int = 0
    """Token choices the router makes in the traced batch (tokens x k, summed over the layers among the nodes)."""
    forward_flops: int = 0
    """Traced forward FLOPs of the expert linears."""
    num_groups: int = 1
    """G: routing groups of E / G consecutive experts (DeepSeek-V3's `n_group`); 1 without group-limited routing."""
    top_groups: int = 1
    """Of the G groups, how many a token's k experts are picked from (`topk_group`); 1 when G is 1."""
    layers: int = 1
    """MoE layers among the nodes (their routing top-k's): `param_numel`, `choices` and `forward_flops` sum over
    them."""

    @property
    def capacity_factor(self) -> float:
        """Expert slots the trace computes over the token choices: the experts' FLOPs over what the choices
        cost through one expert each (2 FLOPs per expert weight of their layer). Capacity dispatch gives about its
        capacity factor; experts that run on every token (one module per expert, no dispatch) give E / k. Over
        several layers, their mean (layers of one shape: the same choices and weights each)."""
        per_choice = 2 * self.param_numel / (self.num_experts * self.layers)
        return self.forward_flops / (self.choices * per_choice) if self.choices and per_choice else 1.0


def routed_experts(nodes: Sequence[Node]) -> RoutedExperts | None:
    """The routed experts among `nodes` (see the module docstring); None when there are none."""
    widths = sorted({int(n.attr("num_experts")) for n in nodes
                     if n.op_kind is OpKind.ROUTING and n.attr("num_experts") is not None}, reverse=True)
    for experts in widths:  # widest first: a group top-k is narrower than the routing top-k
        found = _stacked(nodes, experts) or _listed(nodes, experts)
        if found is not None:
            layout, linears, params = found
            routers = [n for n in nodes
                       if n.op_kind is OpKind.ROUTING and n.attr("num_experts") == experts and n.attr("k")]
            top_k = max(int(n.attr("k")) for n in routers)
            choices = sum(n.output_specs[0].numel for n in routers if n.output_specs)
            groups, top_groups = _routing_groups(nodes, routers, experts)
            return RoutedExperts(experts, top_k, layout, tuple(n.name for n in linears),
                                 tuple(sorted(params)), sum(params.values()), choices,
                                 sum(n.forward_flops for n in linears), groups, top_groups, len(routers))
    return None


def _routing_groups(nodes: Sequence[Node], routers: Sequence[Node], experts: int) -> tuple[int, int]:
    """(G, top groups) of group-limited routing (module docstring), (1, 1) without it: a top-k in a routing
    top-k's module over a score of the same rank whose last dimension G divides E."""
    shapes = {(n.module_path, len(n.input_specs[0].shape)) for n in routers if n.input_specs}
    found = [(int(n.attr("num_experts")), int(n.attr("k"))) for n in nodes
             if n.op_kind is OpKind.ROUTING and n.attr("k") and n.input_specs
             and (n.module_path, len(n.input_specs[0].shape)) in shapes
             and 1 < int(n.attr("num_experts")) < experts and experts % int(n.attr("num_experts")) == 0]
    return max(found) if found else (1, 1)


def expert_region(nodes: Sequence[Node], found: RoutedExperts) -> frozenset[str]:
    """The expert linears and every node on a path between two of them (activations, gates, biases): the ops
    that run once per expert slot, so their work follows the experts' load."""
    linears = set(found.linears)
    after = set(linears)
    for n in nodes:
        if any(i in after for i in n.inputs):
            after.add(n.name)
    before = set(linears)
    for n in reversed(nodes):
        if n.name in before:
            before.update(n.inputs)
    return frozenset(linears | (after & before))


def num_routed_experts(nodes: Iterable[Node]) -> int | None:
    """Experts per MoE layer, None for a dense model."""
    found = routed_experts(tuple(nodes))
    return found.num_experts if found is not None else None


def routed_expert_linears(nodes: Sequence[Node], experts: int) -> list[Node]:
    """The LINEAR nodes of routed experts, for a model with `experts` experts per layer."""
    found = _stacked(nodes, experts) or _listed(nodes, experts)
    return list(found[1]) if found is not None else []


def _stacked(nodes: Sequence[Node], experts: int) -> tuple[ExpertLayout, list[Node], dict[str, int]] | None:
    linears: list[Node] = []
    params: dict[str, int] = {}
    for n in nodes:
        if n.op_kind is not OpKind.LINEAR:
            continue
        stacked = {name: spec.numel for name, spec in zip(n.param_names, n.param_specs, strict=False)
                   if len(spec.shape) == 3 and spec.shape[0] == experts}
        if stacked:
            linears.append(n)
            params.update(stacked)
    return (ExpertLayout.STACKED, linears, params) if linears else None


_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def _listed(nodes: Sequence[Node], experts: int) -> tuple[ExpertLayout, list[Node], dict[str, int]] | None:
    """Linears under a list whose index (past the layer's own, the first index of the path) takes `experts`
    values: "a.3.b.experts.5.c" groups as ("a.3.b.experts.*.c") with index 5."""
    groups: dict[str, dict[int, list[Node]]] = {}
    for n in nodes:
        if n.op_kind is not OpKind.LINEAR or not n.param_names:
            continue
        indices = list(_INDEX.finditer(n.module_path))
        for m in indices[1:]:
            key = n.module_path[:m.start()] + ".*" + n.module_path[m.end():]
            groups.setdefault(key, {}).setdefault(int(m.group(1)), []).append(n)
    linears = [n for by_index in groups.values() if len(by_index) == experts for ns in by_index.values() for n in ns]
    if not linears:
        return None
    params = {name: spec.numel for n in linears for name, spec in zip(n.param_names, n.param_specs, strict=False)}
    return ExpertLayout.LISTED, linears, params
