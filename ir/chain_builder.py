"""`build_layer_chain`: cut a traced `Graph` into pipeline-cuttable segments and give identical ones one class.

How the cut is chosen:

1. **Units.** Every node gets a unit from its module path: the path up to and including its first numeric
   component ("blocks.7.attn.q_proj" -> "blocks.7", "encoder.layers.3.mlp" -> "encoder.layers.3",
   "layer2.1.conv1" -> "layer2.1") — a *repeated* unit, an element of a ModuleList/Sequential — or else its first
   component ("wte", "ln_f"). A Sequential element that is one torch.nn leaf ("stem.0", a Conv2d) is not a
   layer: its unit is the container ("stem"). Top-level glue (path "") belongs to the unit before it (the first
   unit at the start), except between a repeated and a non-repeated unit, where it joins the one after (ResNet's
   pooling goes with `fc`, so the last block keeps the class of the others).
2. **Runs.** Each repeated unit is its own run; consecutive non-repeated units merge into one run (the embedding
   prefix "wte+wpe+drop", the head "ln_f+lm_head"). A model with no repeated units keeps one run per unit.
3. **Legality.** A cut between runs is kept only if at most `max_crossing` activation tensors are live across it;
   otherwise the runs on both sides merge. Live means produced before the cut (by a node that depends on a model
   input) and read after it. Model inputs themselves (every stage can be fed them), parameters, buffers and
   tensors computed only from those are not activations. Views share their source's storage and count once.
   Encoder-decoder graphs, where every decoder block also reads the encoder output, therefore still cut between
   decoder blocks with 2+ crossing tensors; `boundary_bytes` counts them all.
4. **Classes.** Each segment gets a structural hash (sha256 of its nodes' kinds, targets, module paths relative to
   the segment, tensor and parameter specs, attributes and *relative* wiring; node names are ignored). Equal
   hashes share a class id; ids are numbered in order of first appearance.

Per-segment sums: FLOPs and saved bytes of its nodes; parameters counted once chain-wide, in the first segment
that uses them (a tied embedding / LM head is counted in the embedding segment).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ir.graph import Graph, Node, OpKind
from ir.layer_chain import LayerChain, Segment

DEFAULT_MAX_CROSSING = 8
"""Most activation tensors a stage boundary may carry (a transformer block boundary carries 1; a T5 decoder block
boundary the hidden state, the encoder output and attention biases/masks)."""


def build_layer_chain(graph: Graph, *, max_crossing: int = DEFAULT_MAX_CROSSING) -> LayerChain:
    """Cut `graph` into segments (see the module docstring)."""
    if max_crossing < 1:
        raise ValueError(f"max_crossing must be >= 1, got {max_crossing}")
    if not graph.nodes:
        raise ValueError(f"graph {graph.model_name!r} has no nodes to cut")
    live = Liveness.of(graph)
    runs = _runs(graph.nodes)
    bounds = _legal_bounds(runs, live, max_crossing)
    return _assemble(graph, bounds, live)


# ---------------------------------------------------------------------------------------------------------------
# Liveness of activations across cuts
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Liveness:
    """For every cut position c (between node c-1 and node c), the activation storages live across it."""

    crossing: tuple[tuple[int, ...], ...]
    """crossing[c]: positions of the storage-owning nodes whose activations cross cut c (c = 0..n)."""
    root_bytes: tuple[int, ...]
    """root_bytes[i]: bytes of the storage node i owns (0 for views and non-activations)."""
    root: tuple[int, ...]
    """root[i]: position of the node owning the storage node i's output lives in (itself unless a view)."""
    is_activation: tuple[bool, ...]
    is_input: tuple[bool, ...]

    @classmethod
    def of(cls, graph: Graph) -> Liveness:
        nodes = graph.nodes
        n = len(nodes)
        depends = [False] * n
        root = list(range(n))
        for i, node in enumerate(nodes):
            srcs = [graph.position(s) for s in node.inputs]
            depends[i] = node.op_kind is OpKind.PLACEHOLDER or any(depends[j] for j in srcs)
            alias = node.attr("alias_input")
            if isinstance(alias, int) and 0 <= alias < len(srcs):
                root[i] = root[srcs[alias]]
        is_input = [node.op_kind is OpKind.PLACEHOLDER for node in nodes]
        is_act = [depends[i] and not is_input[i] and nodes[i].op_kind is not OpKind.OUTPUT for i in range(n)]
        # A storage is live from its owner until the last read of the owner or of any view of it.
        last_use = [-1] * n
        for i, node in enumerate(nodes):
            for s in node.inputs:
                j = graph.position(s)
                if is_act[j]:
                    r = root[j]
                    last_use[r] = max(last_use[r], i)
        root_bytes = [sum(s.nbytes for s in nodes[i].output_specs) if (is_act[i] and root[i] == i) else 0
                      for i in range(n)]
        starts: list[list[int]] = [[] for _ in range(n + 1)]
        for r in range(n):
            if last_use[r] > r and root_bytes[r] > 0:
                starts[r + 1].append(r)
        crossing: list[tuple[int, ...]] = []
        active: set[int] = set()
        for c in range(n + 1):
            active.update(starts[c])
            active = {r for r in active if last_use[r] >= c}
            crossing.append(tuple(sorted(active)))
        return cls(tuple(crossing), tuple(root_bytes), tuple(root), tuple(is_act), tuple(is_input))

    def count(self, cut: int) -> int:
        return len(self.crossing[cut])

    def bytes_at(self, cut: int) -> int:
        return sum(self.root_bytes[r] for r in self.crossing[cut])


# ---------------------------------------------------------------------------------------------------------------
# Units and runs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Run:
    start: int
    stop: int
    units: tuple[str, ...]
    repeated: bool


def unit_of(module_path: str) -> tuple[str, bool]:
    """(unit, repeated) for a module path; ("", False) for the top level."""
    if not module_path:
        return "", False
    parts = module_path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1]), True
    return parts[0], False


def _node_units(nodes: Sequence[Node]) -> list[tuple[str, bool]]:
    """Each node's (unit, repeated), with top-level glue attached to a neighbouring unit.

    An element of a Sequential that is a single torch.nn leaf ("stem.0" = a Conv2d, "mlp.2" = a ReLU) is not a
    layer of its own: its unit is the container ("stem"), not repeated. Glue (path "") joins the unit before it,
    except between a repeated unit and a non-repeated one (ResNet's pooling before `fc`, T5's hand-over from
    encoder to decoder), where it joins the unit after, so the last block keeps the class of the others.
    """
    raw = [unit_of(n.module_path) for n in nodes]
    members: dict[str, list[Node]] = {}
    for node, (unit, repeated) in zip(nodes, raw, strict=True):
        if repeated:
            members.setdefault(unit, []).append(node)
    # (a top-level Sequential's leaves, "0", "1", ..., have no container but the model: they stay layers)
    primitive = {u for u, ns in members.items() if "." in u and _is_single_leaf(u, ns)}
    units = [(u.rsplit(".", 1)[0], False) if u in primitive else (u, r) for u, r in raw]
    filled: list[tuple[str, bool]] = list(units)
    i = 0
    while i < len(units):
        if units[i][0]:
            i += 1
            continue
        j = i
        while j < len(units) and not units[j][0]:
            j += 1
        before = filled[i - 1] if i > 0 else None
        after = units[j] if j < len(units) else None
        if before is None or (after is not None and before[1] and not after[1]):
            target = after if after is not None else ("model", False)
        else:
            target = before
        for k in range(i, j):
            filled[k] = target
        i = j
    return filled


def _is_single_leaf(unit: str, nodes: Sequence[Node]) -> bool:
    own = [n for n in nodes if n.module_path == unit]
    deeper = any(n.module_path.startswith(unit + ".") for n in nodes)
    return (not deeper and len(own) == 1 and own[0].target.startswith("torch.nn.")
            and not own[0].target.startswith("torch.nn.functional."))


def _runs(nodes: Sequence[Node]) -> list[_Run]:
    filled = _node_units(nodes)
    any_repeated = any(r for _, r in filled)
    runs: list[_Run] = []
    start = 0
    for i in range(1, len(nodes) + 1):
        if i < len(nodes) and filled[i] == filled[i - 1]:
            continue
        unit, repeated = filled[start]
        runs.append(_Run(start, i, (unit,), repeated))
        start = i
    if not any_repeated:
        return runs
    merged: list[_Run] = []
    for run in runs:
        if merged and not run.repeated and not merged[-1].repeated:
            prev = merged.pop()
            units_ = prev.units + tuple(u for u in run.units if u not in prev.units)
            merged.append(_Run(prev.start, run.stop, units_, False))
        else:
            merged.append(run)
    return merged


def _legal_bounds(runs: list[_Run], live: Liveness, max_crossing: int) -> list[_Run]:
    out: list[_Run] = []
    for run in runs:
        if out and live.count(run.start) > max_crossing:
            prev = out.pop()
            units = prev.units + tuple(u for u in run.units if u not in prev.units)
            out.append(_Run(prev.start, run.stop, units, prev.repeated and run.repeated))
        else:
            out.append(run)
    return out


def _run_name(run: _Run) -> str:
    units = [u for u in run.units if u] or ["model"]
    if len(units) <= 3:
        return "+".join(units)
    return f"{units[0]}..{units[-1]}"


# ---------------------------------------------------------------------------------------------------------------
# Segments, sums and classes
# ---------------------------------------------------------------------------------------------------------------


def _assemble(graph: Graph, runs: list[_Run], live: Liveness) -> LayerChain:
    nodes = graph.nodes
    seen_params: set[str] = set()
    class_of: dict[str, int] = {}
    readers = last_readers(graph)
    segments: list[Segment] = []
    for index, run in enumerate(runs):
        seg_nodes = nodes[run.start:run.stop]
        name = _run_name(run)
        h = segment_hash(graph, run.start, run.stop, name, readers, live.is_activation)
        class_id = class_of.setdefault(h, len(class_of))
        params = 0
        pbytes = 0
        for node in seg_nodes:
            for pname, spec in zip(node.param_names, node.param_specs, strict=True):
                if pname not in seen_params:
                    seen_params.add(pname)
                    params += spec.numel
                    pbytes += spec.nbytes
        segments.append(Segment(
            index=index, name=name, start=run.start, stop=run.stop, class_id=class_id, structural_hash=h,
            forward_flops=sum(n.forward_flops for n in seg_nodes),
            backward_flops=sum(n.backward_flops for n in seg_nodes),
            param_count=params, param_bytes=pbytes,
            saved_bytes=sum(n.saved_bytes for n in seg_nodes),
            input_bytes=_input_bytes(graph, run.start, run.stop, live),
            boundary_bytes=live.bytes_at(run.stop) if run.stop < len(nodes) else 0,
        ))
    return LayerChain(graph=graph, segments=tuple(segments))


def _input_bytes(graph: Graph, start: int, stop: int, live: Liveness) -> int:
    """Bytes of the storages the segment reads that it does not compute: activations produced before it and
    model inputs (including the placeholders at the start of the first segment)."""
    roots: set[int] = set()
    for node in graph.nodes[start:stop]:
        for s in node.inputs:
            j = graph.position(s)
            if (j < start and live.is_activation[j]) or live.is_input[j]:
                roots.add(live.root[j])
    total = 0
    for r in sorted(roots):
        node = graph.nodes[r]
        total += sum(s.nbytes for s in node.output_specs)
    return total


def _relative_path(path: str, prefix: str) -> str:
    if path == prefix:
        return ""
    if prefix and path.startswith(prefix + "."):
        return path[len(prefix) + 1:]
    return path


def segment_hash(graph: Graph, start: int, stop: int, prefix: str = "",
                 last_reader: Sequence[int] | None = None, is_activation: Sequence[bool] | None = None) -> str:
    """sha256 of the structure of nodes [start, stop): names ignored, wiring relative to the segment,
    module paths relative to `prefix`, plus which local values are read after the segment.
    `last_reader[i]` (position of node i's last consumer) may be passed to avoid rescanning the graph.
    With `is_activation` (`Liveness.is_activation`), only activations count as read after the segment: torch.export
    chains per-layer casts of constants (Llama 4's rotary table: layer i casts layer i-1's cast), which would
    otherwise set every layer but the last apart."""
    nodes = graph.nodes
    if last_reader is None:
        last_reader = last_readers(graph)
    external: dict[str, int] = {}
    records = []
    for node in nodes[start:stop]:
        wiring = []
        for s in node.inputs:
            j = graph.position(s)
            if j >= start:
                wiring.append(("L", j - start))
            else:
                wiring.append(("X", external.setdefault(s, len(external))))
        records.append(_node_record(node, _relative_path(node.module_path, prefix), wiring))
    escapes = [i - start for i in range(start, stop)
               if last_reader[i] >= stop and (is_activation is None or is_activation[i])]
    payload = json.dumps({"nodes": records, "escapes": escapes}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def last_readers(graph: Graph) -> list[int]:
    """Position of each node's last consumer (-1 if none)."""
    last = [-1] * len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        for s in node.inputs:
            j = graph.position(s)
            last[j] = max(last[j], i)
    return last


def _node_record(node: Node, path: str, wiring: list[tuple[str, int]]) -> list:
    return [
        node.op_kind.value, node.target, path, wiring,
        [[list(s.shape), s.dtype] for s in node.input_specs],
        [[list(s.shape), s.dtype] for s in node.output_specs],
        [[list(s.shape), s.dtype] for s in node.param_specs],
        [[k, v] for k, v in node.attrs if k != "arg_name"],
    ]
