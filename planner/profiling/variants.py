"""Which profile keys each IR node needs: its replicated key per micro-batch size and, for tp > 1, one key per
sharding strategy the intra-operator pricer may look up (recorded by pricing each layer class's segment)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.profile_db import op_signature
from costmodel.sharding.cost import build_sharding_model
from costmodel.sharding.model import Pricer
from costmodel.sharding.rules import NodeStrategy
from ir.graph import Graph, Node, OpKind
from ir.layer_chain import LayerChain


@dataclass(frozen=True, slots=True)
class Variant:
    """One profile key of one node: its signature and the strategy whose per-device shard it prices."""

    signature: str
    tp: int = 1
    strategy: NodeStrategy | None = None
    """None: the node as traced (replicated)."""


def replicated_variant(node: Node, mbs: int, traced_batch: int) -> Variant:
    scale = mbs / traced_batch
    return Variant(op_signature(node, flops_scale=scale, bytes_scale=scale))


class RecordingPricer:
    """A `Pricer` that records the scales of every node lookup and prices nothing (all zeros)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float, float]] = []

    def node_time(self, node: Node, flops_scale: float, bytes_scale: float, param_scale: float
                  ) -> tuple[float, float]:
        self.calls.append((node.name, flops_scale, bytes_scale, param_scale))
        return 0.0, 0.0

    def pricer(self) -> Pricer:
        return Pricer(node_time=self.node_time, move_time=lambda move, nbytes: 0.0)


def sharded_variants(chain: LayerChain, *, tp: int, mbs: int, dtype: str) -> dict[str, list[Variant]]:
    """Node name -> the keys the intra-operator pricer looks up at this tp and micro-batch, with and without
    sequence parallelism, for the representative segment of every layer class."""
    out: dict[str, list[Variant]] = {}
    for cid in sorted({s.class_id for s in chain.segments}):
        nodes = chain.nodes_of(chain.representative(cid))
        for sp in (False, True):
            rec = RecordingPricer()
            model = build_sharding_model(nodes, tp=tp, sequence_parallel=sp, traced_batch=chain.graph.batch_size,
                                         microbatch_size=mbs, pricer=rec.pricer(), dtype=dtype)
            options = [(n, o) for n, opts in zip(nodes, model.options, strict=True) for o in opts]
            if len(options) != len(rec.calls):
                raise RuntimeError(f"the sharding pricer made {len(rec.calls)} node lookups for {len(options)} "
                                   "options; the recording no longer matches build_sharding_model")
            for (node, option), (name, fs, bs, ps) in zip(options, rec.calls, strict=True):
                if name != node.name:
                    raise RuntimeError(f"sharding pricer lookup order changed ({name} vs {node.name})")
                sig = op_signature(node, flops_scale=fs, bytes_scale=bs, param_scale=ps)
                strategy = None if option.strategy.is_replicated else option.strategy
                out.setdefault(node.name, []).append(Variant(sig, tp, strategy))
    return out


def variants_by_node(graph: Graph, chain: LayerChain | None, *, mbs: int, traced_batch: int,
                     tp_degrees: Sequence[int], dtype: str) -> dict[str, list[Variant]]:
    """Every key to measure per node name at micro-batch `mbs` (first occurrence of a signature wins)."""
    out: dict[str, list[Variant]] = {}
    for node in graph.nodes:
        if node.op_kind in (OpKind.PLACEHOLDER, OpKind.OUTPUT):
            continue
        out[node.name] = [replicated_variant(node, mbs, traced_batch)]
    if chain is not None:
        for tp in tp_degrees:
            if tp == 1:
                continue
            for name, vs in sharded_variants(chain, tp=tp, mbs=mbs, dtype=dtype).items():
                out.setdefault(name, []).extend(vs)
    return out
