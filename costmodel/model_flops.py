"""Model FLOPs as MFU counts them: the traced FLOPs, with routed experts counted at the token choices they serve.

MFU divides the model's FLOPs per step -- each token through every layer once, forward and backward, no
recomputation -- by the time and the dense peak (Narayanan et al. 2021; PaLM, Chowdhery et al. 2022, App. B). For a
mixture of experts that is each token's k choices through one expert each (Megatron-Core counts the routed experts
as k x the expert MLP per token). The trace computes every expert slot it builds instead: capacity dispatch pads
each expert to C slots, c = the capacity factor (`ir.moe_structure.RoutedExperts.capacity_factor`, about 1.25 for
the zoo's GShard dispatch), and experts that run densely on every token compute E / k times the choices. So per
segment (one block: the capacity factor is a per-layer ratio) the routed experts' linears count 1 / max(c, 1) of
their traced FLOPs; a trace that dropped choices (c < 1) computed only what it counts. Dense models are unchanged.

What a rank executes is priced apart (`costmodel.expert_parallel`: the busiest rank's load, at most the trace's
slots); these are the FLOPs the step is credited with, for MFU and for the search's level-0 bound (every rank
computes at least its share of them, so FLOPs / (devices x peak) stays below any step).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from ir.graph import Node
from ir.layer_chain import LayerChain
from ir.moe_structure import routed_experts


def counted_flops(nodes: Sequence[Node], *, backward: bool = True, only: Container[str] | None = None) -> float:
    """FLOPs of one block's `nodes` (those named in `only`, when given) as model FLOPs count them (module
    docstring): forward, plus backward unless `backward` is off."""
    found = routed_experts(nodes)
    c = found.capacity_factor if found is not None else 1.0
    linears = frozenset(found.linears) if found is not None and c > 1.0 else frozenset()
    dense = experts = 0  # integer sums: a dense model's count is exactly the traced one
    for n in nodes:
        if only is not None and n.name not in only:
            continue
        flops = n.forward_flops + (n.backward_flops if backward else 0)
        if n.name in linears:
            experts += flops
        else:
            dense += flops
    return dense + experts / c if experts else dense


def model_flops(chain: LayerChain) -> float:
    """Forward + backward model FLOPs of one traced batch (`chain.graph.batch_size` samples)."""
    per_class: dict[int, float] = {}
    total: float = 0
    for seg in chain.segments:
        if seg.class_id not in per_class:  # blocks of one class are the same ops
            per_class[seg.class_id] = counted_flops(chain.nodes_of(seg))
        total += per_class[seg.class_id]
    return total
