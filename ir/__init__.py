"""Graph IR: trace a PyTorch model into `Graph` records and cut it into a `LayerChain`."""

from ir.graph import Graph, Node, OpKind, TensorSpec, dtype_bytes
from ir.layer_chain import LayerChain, Segment

__all__ = ["Graph", "LayerChain", "Node", "OpKind", "Segment", "TensorSpec", "dtype_bytes"]
