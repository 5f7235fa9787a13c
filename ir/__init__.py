"""Graph IR: trace a PyTorch model into `Graph` records and cut it into a `LayerChain`."""

from ir.chain_builder import build_layer_chain
from ir.errors import TraceError
from ir.graph import Graph, Node, OpKind, TensorSpec, dtype_bytes
from ir.graph_fingerprint import fingerprint
from ir.layer_chain import LayerChain, Segment
from ir.tracer import trace

__all__ = [
    "Graph", "LayerChain", "Node", "OpKind", "Segment", "TensorSpec", "TraceError", "build_layer_chain",
    "dtype_bytes", "fingerprint", "trace",
]
