"""The layer chain: the graph cut into an ordered list of segments at legal pipeline-stage boundaries.

A boundary is legal where few activation tensors are live across it (parameters and constants do not count).
Consecutive segments form a pipeline stage. Segments with the same `structural_hash` (same ops, shapes,
parameter shapes and internal wiring, names ignored) share a `class_id`, so later passes (the intra-op sharding
ILP, per-layer pricing) solve each class once: the 96 blocks of GPT-3 175B are one class.

Class ids are assigned in order of first appearance, so they are deterministic for a given graph.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ir.fusion import fuse_nodes, readers_of
from ir.graph import Graph, Node


@dataclass(frozen=True, slots=True)
class Segment:
    """A contiguous run of graph nodes `[start, stop)` (positions in `Graph.nodes`) that a stage can hold whole."""

    index: int
    name: str
    """Readable name, usually the owning module path ("blocks.7", "embed", "head")."""
    start: int
    stop: int
    class_id: int
    structural_hash: str
    forward_flops: int
    backward_flops: int
    param_count: int
    param_bytes: int
    saved_bytes: int
    """Activation bytes autograd saves for backward inside this segment (no recomputation)."""
    input_bytes: int
    """Bytes of the activations entering this segment (what full recomputation keeps)."""
    boundary_bytes: int
    """Bytes of the activations live across the cut after this segment (sent to the next pipeline stage)."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"segment {self.name}: bad node range [{self.start}, {self.stop})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "name": self.name, "start": self.start, "stop": self.stop,
            "class_id": self.class_id, "structural_hash": self.structural_hash,
            "forward_flops": self.forward_flops, "backward_flops": self.backward_flops,
            "param_count": self.param_count, "param_bytes": self.param_bytes,
            "saved_bytes": self.saved_bytes, "input_bytes": self.input_bytes,
            "boundary_bytes": self.boundary_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Segment:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class LayerChain:
    """A graph and its ordered segments; the segments cover every node exactly once, in order."""

    graph: Graph
    segments: tuple[Segment, ...]
    fused: bool = False
    """Whether the nodes carry the bytes and saved bytes of fused kernels (`fused_kernels`), not of eager ops."""

    def __post_init__(self) -> None:
        pos = 0
        for i, seg in enumerate(self.segments):
            if seg.index != i or seg.start != pos:
                raise ValueError(f"segment {i} ({seg.name}) does not continue the chain at node {pos}")
            pos = seg.stop
        if pos != len(self.graph.nodes):
            raise ValueError(f"segments cover {pos} of {len(self.graph.nodes)} nodes")

    def __len__(self) -> int:
        return len(self.segments)

    def nodes_of(self, segment: Segment | int) -> tuple[Node, ...]:
        seg = self.segments[segment] if isinstance(segment, int) else segment
        return self.graph.nodes[seg.start:seg.stop]

    @property
    def num_classes(self) -> int:
        return len({s.class_id for s in self.segments})

    def representative(self, class_id: int) -> Segment:
        """The first segment of a class: the one later passes solve for the whole class."""
        for s in self.segments:
            if s.class_id == class_id:
                return s
        raise KeyError(f"no segment has class {class_id}")

    @functools.cached_property
    def fused_kernels(self) -> LayerChain:
        """This chain as a fusing runtime runs it (`ir.fusion`): same nodes, segments and classes, with each
        segment's memory-bound ops priced as fused kernels. Computed once per chain."""
        if self.fused:
            return self
        readers = readers_of(self.graph.nodes)
        nodes = [n for seg in self.segments for n in fuse_nodes(self.nodes_of(seg), readers)]
        graph = dataclasses.replace(self.graph, nodes=tuple(nodes))
        segments = tuple(dataclasses.replace(seg, saved_bytes=sum(n.saved_bytes for n in nodes[seg.start:seg.stop]))
                         for seg in self.segments)
        return LayerChain(graph=graph, segments=segments, fused=True)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"graph": self.graph.to_dict(), "segments": [s.to_dict() for s in self.segments]}
        if self.fused:
            out["fused"] = True
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerChain:
        return cls(graph=Graph.from_dict(d["graph"]), segments=tuple(Segment.from_dict(s) for s in d["segments"]),
                   fused=bool(d.get("fused", False)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LayerChain:
        return cls.from_dict(json.loads(text))
