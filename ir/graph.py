"""The graph IR: one record per traced operation, with shapes, FLOPs, bytes, parameters and saved activations.

A `Graph` is what `ir.trace` returns. It is a flat, topologically ordered tuple of `Node`s; edges are named
by the producing node's name in `Node.inputs`. Everything is a frozen dataclass so that graphs can be hashed,
cached and compared, and every record serializes to JSON and back without loss (`to_dict` / `from_dict`).

Units: FLOPs are floating-point operations (a multiply-add counts 2, as in torch's FlopCounterMode);
bytes are bytes for the traced dtype; counts are plain integers.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import networkx as nx

_DTYPE_BYTES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as torch prints it without the `torch.` prefix."""
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(_DTYPE_BYTES))}") from None


class OpKind(enum.StrEnum):
    """What an operation does, as far as pricing and sharding care."""

    LINEAR = "linear"            # nn.Linear / F.linear / addmm: y = x W^T (+ b)
    MATMUL = "matmul"            # matmul / bmm / einsum between two activations
    ATTENTION = "attention"      # fused scaled-dot-product attention
    SOFTMAX = "softmax"
    NORM = "norm"                # layer norm, RMS norm, batch norm, group norm
    ELEMENTWISE = "elementwise"  # activations, add, mul, dropout, casts
    EMBEDDING = "embedding"
    REDUCTION = "reduction"      # sum / mean / max over dims, losses
    VIEW = "view"                # view / reshape / transpose / permute / split / cat / slicing / contiguous
    CONV = "conv"
    POOL = "pool"
    ROUTING = "routing"          # mixture-of-experts top-k, gather/scatter/index
    LOSS = "loss"
    PLACEHOLDER = "placeholder"  # graph inputs
    OUTPUT = "output"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Shape and dtype of one tensor. `shape` is concrete (tracing fixes batch and sequence)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if any(d < 0 for d in self.shape):
            raise ValueError(f"negative dimension in shape {self.shape}")
        dtype_bytes(self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        return cls(shape=tuple(int(x) for x in d["shape"]), dtype=str(d["dtype"]))


@dataclass(frozen=True, slots=True)
class Node:
    """One operation of the traced graph.

    `inputs` names the producing nodes of this node's tensor arguments, in argument order; parameters are not
    inputs but are described by `param_specs`. `target` is a stable text name of what ran ("aten.mm",
    "torch.nn.functional.gelu", "torch.nn.Linear"). `module_path` is the dotted path of the owning module
    ("blocks.3.attn.c_proj"), "" at the top level.
    """

    name: str
    op_kind: OpKind
    target: str
    module_path: str
    inputs: tuple[str, ...]
    input_specs: tuple[TensorSpec, ...]
    output_specs: tuple[TensorSpec, ...]
    param_names: tuple[str, ...] = ()
    param_specs: tuple[TensorSpec, ...] = ()
    forward_flops: int = 0
    backward_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    saved_bytes: int = 0
    """Bytes autograd keeps from this node's forward for its backward (inputs or outputs it saves)."""
    attrs: tuple[tuple[str, Any], ...] = ()
    """Op-specific facts needed by sharding rules, as sorted (key, value) pairs of JSON scalars or tuples
    (e.g. ("dim", -1) for softmax, ("num_heads", 12) for attention, ("is_causal", True))."""

    @property
    def param_count(self) -> int:
        return sum(s.numel for s in self.param_specs)

    @property
    def param_bytes(self) -> int:
        return sum(s.nbytes for s in self.param_specs)

    def attr(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op_kind": self.op_kind.value,
            "target": self.target,
            "module_path": self.module_path,
            "inputs": list(self.inputs),
            "input_specs": [s.to_dict() for s in self.input_specs],
            "output_specs": [s.to_dict() for s in self.output_specs],
            "param_names": list(self.param_names),
            "param_specs": [s.to_dict() for s in self.param_specs],
            "forward_flops": self.forward_flops,
            "backward_flops": self.backward_flops,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "saved_bytes": self.saved_bytes,
            "attrs": [[k, _jsonable(v)] for k, v in self.attrs],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Node:
        return cls(
            name=d["name"],
            op_kind=OpKind(d["op_kind"]),
            target=d["target"],
            module_path=d["module_path"],
            inputs=tuple(d["inputs"]),
            input_specs=tuple(TensorSpec.from_dict(s) for s in d["input_specs"]),
            output_specs=tuple(TensorSpec.from_dict(s) for s in d["output_specs"]),
            param_names=tuple(d["param_names"]),
            param_specs=tuple(TensorSpec.from_dict(s) for s in d["param_specs"]),
            forward_flops=int(d["forward_flops"]),
            backward_flops=int(d["backward_flops"]),
            bytes_read=int(d["bytes_read"]),
            bytes_written=int(d["bytes_written"]),
            saved_bytes=int(d["saved_bytes"]),
            attrs=tuple((k, _from_jsonable(v)) for k, v in d["attrs"]),
        )


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return {"tuple": [_jsonable(x) for x in v]}
    return v


def _from_jsonable(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"tuple"}:
        return tuple(_from_jsonable(x) for x in v["tuple"])
    return v


@dataclass(frozen=True)
class Graph:
    """A traced model: nodes in topological order plus what the trace was made for."""

    model_name: str
    nodes: tuple[Node, ...]
    batch_size: int
    seq_len: int | None
    dtype: str
    param_count: int
    """Unique trainable parameters (shared/tied parameters counted once)."""
    param_bytes: int
    tracer: str = "fx"
    """Which front end produced the graph: "fx" or "export"."""
    _index: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError("duplicate node names in graph")
        self._index.update({n: i for i, n in enumerate(names)})
        for node in self.nodes:
            for src in node.inputs:
                if self._index.get(src, len(names)) >= self._index[node.name]:
                    raise ValueError(f"node {node.name} reads {src}, which is not an earlier node")

    def node(self, name: str) -> Node:
        return self.nodes[self._index[name]]

    def position(self, name: str) -> int:
        return self._index[name]

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def forward_flops(self) -> int:
        return sum(n.forward_flops for n in self.nodes)

    @property
    def backward_flops(self) -> int:
        return sum(n.backward_flops for n in self.nodes)

    def to_networkx(self) -> nx.DiGraph:
        """A DiGraph whose nodes are node names carrying the `Node` as attribute "node"; edges carry "bytes"."""
        import networkx as nx  # only this view needs it; planning from a cached trace never loads it

        g = nx.DiGraph()
        for n in self.nodes:
            g.add_node(n.name, node=n)
        for n in self.nodes:
            for i, src in enumerate(n.inputs):
                spec = n.input_specs[i] if i < len(n.input_specs) else None
                g.add_edge(src, n.name, bytes=spec.nbytes if spec else 0)
        return g

    def to_dict(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "tracer": self.tracer,
            "nodes": [n.to_dict() for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Graph:
        return cls(
            model_name=d["model_name"],
            nodes=tuple(Node.from_dict(n) for n in d["nodes"]),
            batch_size=int(d["batch_size"]),
            seq_len=None if d["seq_len"] is None else int(d["seq_len"]),
            dtype=d["dtype"],
            param_count=int(d["param_count"]),
            param_bytes=int(d["param_bytes"]),
            tracer=d.get("tracer", "fx"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Graph:
        return cls.from_dict(json.loads(text))
