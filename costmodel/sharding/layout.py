"""Intra-operator sharding over the tensor-parallel axis: the layout algebra (this module) and the model it sets.

Files: layouts, moves and gradient duals here; which tensor dims are batch/sequence and how dims map through an op
in `dims`; the strategies of each op kind in `rules`; the integer problem and its reference objective in
`problem`; a segment priced per strategy in `model` (built by `cost`), which turns into that problem and prices
a chosen assignment as a `LayerCost`. The ILP that solves the problem is `planner.search.intra_op`.

Layouts
-------
Over a tensor-parallel group of ``t`` devices a tensor is held in one of three layouts (as DTensor's placements):

* ``R``    replicated: every device holds the whole tensor;
* ``S(d)`` sharded on dim ``d``: device ``i`` holds the ``i``-th of ``t`` equal contiguous chunks (needs
  ``shape[d] % t == 0``);
* ``P``    partial sum: every device holds a full-size tensor and the true value is their sum (what a
  row-parallel linear produces before its all-reduce).

Strategies
----------
A node's *strategy* fixes the layout of each tensor input, of its output(s), and of the gradient its backward
produces for each input; it also says how much of the node's work one device does (``1/t`` when split) and which
parameters are sharded. The rules per op kind (``node_strategies``) follow Megatron-LM (Shoeybi et al. 2019, §3)
and DTensor's op strategies; every node also has the replicated strategy, so every graph has a feasible
assignment. Strategies whose module form has a ``torch.distributed.tensor.parallel`` style carry it
(``colwise``/``rowwise``/``sequence``/``vocab``/``heads``/``replicate``) so that a plan can be applied.

Gradient layouts (the duals)
----------------------------
The gradient of a tensor that is ``S(d)`` in forward is ``S(d)``; of a ``P`` tensor it is ``R`` (each partial
summand has the same derivative); of an ``R`` input read by a node whose output is split (``S`` or ``P``) it is
``P`` (each device back-propagates only its share, as for the input of a column-parallel linear), otherwise ``R``.
A producer expects the gradient of its output in ``dual(out) = R if out is P else out``.

Resharding
----------
An edge from a producer that writes layout ``a`` to a reader that wants layout ``l`` costs ``move(a -> l)`` in
forward, and ``move(g -> dual(a))`` in backward, where ``g`` is the gradient layout the reader produces:

    P -> R all-reduce         P -> S(d) reduce-scatter      S(d) -> R all-gather     S(a) -> S(b) all-to-all
    R -> S(d) local slice     R -> P local scale            S(d) -> P all-gather + local scale    x -> x free

so the four Megatron cases come out as duals: column input (fwd R -> R free, bwd P -> R all-reduce), row output
(fwd P -> R all-reduce, bwd R -> R free), and with sequence parallelism (Korthikanti et al. 2022, §4.2.2) the
all-gather S(1) -> R whose backward is the reduce-scatter P -> S(1), and the reduce-scatter P -> S(1) whose
backward is the all-gather S(1) -> R.

A tensor read by several nodes is moved once per distinct target layout in forward, and in backward the
gradients that arrive in the same layout are summed locally and moved once per distinct layout (so the three
column-parallel q/k/v projections reading one norm output cost one all-reduce in backward, as a fused QKV does).

Between two ops of a segment only the collectives torch's parallel styles make at module boundaries are allowed
in forward (all-reduce, reduce-scatter, all-gather: ``INTERNAL_MOVES``): an applied plan runs on local tensors in
between, where nothing would slice a replicated tensor or exchange shards. The slice R -> S(1) is allowed into
the segment boundary, where the applier splits the sequence for sequence parallelism.

Pricing (``cost.build_sharding_model``)
----------------------------------------
Per node and strategy: compute ``node_time`` with the node's FLOPs and bytes scaled by micro-batch / traced batch
and by the work fraction; the gradient all-reduce of replicated parameters whose gradients are partial (the node
runs on a sharded token dim), divided by the number of micro-batches since it happens once per step; and a memory
term ``memory_weight * (16 bytes x parameters per device + activation bytes saved per device)``. Per tensor: the
moves above, priced with ``collective_time`` over the tensor-parallel group (local moves at memory bandwidth).

The result, a ``ShardingModel``, holds the float prices and an integer ``ShardingProblem`` (picoseconds) that the
planner's CP-SAT model minimizes; ``ShardingProblem.objective`` evaluates any assignment directly (the reference
the ILP is tested against), and ``ShardingModel.layer_cost`` turns the chosen assignment into a ``LayerCost``.

Segment boundaries: tensors entering a segment from outside, and the tensors it hands on, are in the chain's
boundary layout: ``S(1)`` (sequence-sharded) for ``(batch, seq, hidden)`` activations under sequence parallelism,
``R`` otherwise, so segments solved separately compose.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ir.graph import Node


class LayoutKind(enum.StrEnum):
    REPLICATE = "R"
    SHARD = "S"
    PARTIAL = "P"


@dataclass(frozen=True, slots=True, order=True)
class Layout:
    """How one tensor is laid out over the tensor-parallel axis; ``dim`` is the sharded dim (>= 0) for S."""

    kind: LayoutKind
    dim: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayoutKind(self.kind))
        if (self.kind is LayoutKind.SHARD) != (self.dim >= 0):
            raise ValueError(f"layout {self.kind}: dim must be >= 0 exactly for S, got {self.dim}")

    @property
    def is_shard(self) -> bool:
        return self.kind is LayoutKind.SHARD

    def __str__(self) -> str:
        return f"S({self.dim})" if self.is_shard else self.kind.value

    @classmethod
    def parse(cls, text: str) -> Layout:
        m = re.fullmatch(r"\s*(R|P|S\((\d+)\))\s*", text)
        if not m:
            raise ValueError(f"bad layout {text!r}; valid: R, P, S(<dim>)")
        if m.group(2) is not None:
            return cls(LayoutKind.SHARD, int(m.group(2)))
        return cls(LayoutKind(m.group(1)))


REPLICATED = Layout(LayoutKind.REPLICATE)
PARTIAL = Layout(LayoutKind.PARTIAL)


def shard(dim: int) -> Layout:
    return Layout(LayoutKind.SHARD, dim)


def grad_layout_of(forward: Layout) -> Layout:
    """The layout in which a producer needs the gradient of an output it wrote in ``forward``."""
    return REPLICATED if forward.kind is LayoutKind.PARTIAL else forward


class Move(enum.StrEnum):
    """One step of a redistribution. Collectives run over the tensor-parallel group; LOCAL_* touch memory only."""

    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    LOCAL_SLICE = "local_slice"
    LOCAL_SCALE = "local_scale"


def redistribution(src: Layout, dst: Layout) -> tuple[Move, ...]:
    """The moves that turn a tensor held in ``src`` into ``dst`` (empty when nothing needs to happen)."""
    if src == dst:
        return ()
    k_src, k_dst = src.kind, dst.kind
    if k_src is LayoutKind.REPLICATE:
        return (Move.LOCAL_SLICE,) if k_dst is LayoutKind.SHARD else (Move.LOCAL_SCALE,)
    if k_src is LayoutKind.PARTIAL:
        return (Move.ALL_REDUCE,) if k_dst is LayoutKind.REPLICATE else (Move.REDUCE_SCATTER,)
    if k_dst is LayoutKind.REPLICATE:
        return (Move.ALL_GATHER,)
    if k_dst is LayoutKind.SHARD:
        return (Move.ALL_TO_ALL,)
    return (Move.ALL_GATHER, Move.LOCAL_SCALE)


INTERNAL_MOVES = frozenset({Move.ALL_REDUCE, Move.REDUCE_SCATTER, Move.ALL_GATHER})
"""Moves allowed between two ops inside a segment: the ones torch's tensor-parallel styles make at module
boundaries (the all-reduce or reduce-scatter of a row-parallel output, the all-gather into a column-parallel
input or of an unpaired column-parallel output). A plan runs on local tensors between those modules, so slicing a
replicated tensor, turning it into a partial sum, or an all-to-all between shardings would not happen there;
they are allowed only into the segment boundary (the applier splits the sequence at the first block)."""


def allowed_inside(src: Layout, dst: Layout) -> bool:
    """Whether a tensor written in ``src`` may be read in ``dst`` by another op of the same segment."""
    return all(m in INTERNAL_MOVES for m in redistribution(src, dst))


def local_fraction(layout: Layout, tp: int) -> float:
    """Share of a tensor's bytes one device holds."""
    return 1.0 / tp if layout.is_shard else 1.0


# ----------------------------------------------------------------------------------------------------------------
# Module paths
# ----------------------------------------------------------------------------------------------------------------

def module_prefix(nodes: Sequence[Node]) -> str:
    """The longest dotted module path that owns every node of the segment ("blocks.3"), "" if none."""
    paths = [n.module_path.split(".") for n in nodes if n.module_path]
    if not paths:
        return ""
    prefix: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return ".".join(prefix)


def relative_module(path: str, prefix: str) -> str:
    if not prefix:
        return path
    if path == prefix:
        return ""
    return path[len(prefix) + 1:] if path.startswith(prefix + ".") else path
