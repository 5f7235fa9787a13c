"""Graph IR: trace a PyTorch model into `Graph` records and cut it into a `LayerChain`.

`trace` is loaded on first use: the records, the chain and the fingerprint need no torch, so a planner that
reads a cached trace never pays for importing it (seconds on a loaded machine).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ir.chain_builder import build_layer_chain
from ir.errors import TraceError
from ir.graph import Graph, Node, OpKind, TensorSpec, dtype_bytes
from ir.graph_fingerprint import fingerprint
from ir.layer_chain import LayerChain, Segment

if TYPE_CHECKING:
    from ir.tracer import trace

__all__ = [
    "Graph", "LayerChain", "Node", "OpKind", "Segment", "TensorSpec", "TraceError", "build_layer_chain",
    "dtype_bytes", "fingerprint", "trace",
]


def __getattr__(name: str) -> Any:
    if name == "trace":
        from ir.tracer import trace

        return trace
    raise AttributeError(f"module 'ir' has no attribute {name!r}")
