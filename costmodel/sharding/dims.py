"""Dim analysis for sharding: which dims of a segment's tensors are batch / sequence, and how an op maps the dims
of each input onto its output (so that S(d) on an input can become S(d') on the output).

Labels start at the segment's inputs (dim 0 of a tensor with the traced batch size is the batch; dim 1 of a
(batch, seq) or (batch, seq, hidden) tensor is the sequence) and follow each node's dim maps. They decide what may
be sharded (never the batch: that is data parallelism's axis; the sequence only under sequence parallelism) and
which tensors grow with the micro-batch.

Dim maps per op kind: elementwise/norm/softmax broadcast from the right; linear keeps all but the last dim; matmul
keeps batch dims and maps rows of A and columns of B; reshapes group dims that multiply into each other (h ->
heads x head_dim maps h to heads); permutations use the recorded dims when the IR has them, else the shapes where
they are unambiguous; repeat_interleave keeps the repeated dim (grouped-query heads).
"""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Mapping, Sequence

from ir.graph import Node, OpKind, TensorSpec


class DimLabel(enum.StrEnum):
    BATCH = "batch"
    SEQ = "seq"


Labels = tuple[DimLabel | None, ...]
DimMap = Mapping[int, int]
"""Input dim -> output dim such that sharding the input dim evenly shards the output dim the same way."""

_PERMUTE_OPS = frozenset({"permute", "transpose", "t", "swapaxes", "swapdims", "movedim", "moveaxis"})
_RESHAPE_OPS = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
                          "reshape_as", "contiguous", "clone", "to", "type", "float", "half", "bfloat16",
                          "detach", "alias", "identity"})
_EXPAND_OPS = frozenset({"expand", "expand_as", "broadcast_to"})
_REORDERING_KINDS = frozenset({OpKind.VIEW, OpKind.MATMUL})
"""Kinds whose dim 0 may be another tensor's dim (a transpose, a weight-first matmul): labelled by their maps only."""
_INT_DTYPES = frozenset({"int64", "int32", "int16", "int8", "uint8", "bool"})


def op_name(target: str) -> str:
    """The bare op name of a traced target: "operator.add" / "<built-in function add>" / "aten.add.Tensor" /
    "torch.Tensor.add_" all give "add"."""
    t = target.strip()
    m = re.search(r"(?:function|method) '?([A-Za-z_]\w*)'?", t)
    if m:
        name = m.group(1)
    else:
        parts = [p for p in t.split(".") if p]
        name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else (parts[-1] if parts else t)
    return name.lower().strip("_")


def is_float(spec: TensorSpec) -> bool:
    return spec.dtype not in _INT_DTYPES


def _right_aligned_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Broadcasting: src dim i lines up with dst dim i + (len(dst) - len(src)); mapped where sizes agree."""
    off = len(dst) - len(src)
    return {i: i + off for i in range(len(src)) if i + off >= 0 and src[i] == dst[i + off]}


def _same_size_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Ops that keep every dim in place (slicing, concatenation): dims of equal rank and size map to themselves."""
    if len(src) != len(dst):
        return {}
    return {i: i for i in range(len(src)) if src[i] == dst[i]}


def _reshape_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Group dims that reshape into each other; the outermost non-unit dim of each src group maps to the outermost
    non-unit dim of the matching dst group (splitting h into heads x head_dim maps h to heads)."""
    if math.prod(src) != math.prod(dst) or math.prod(src) == 0:
        return {}
    out: dict[int, int] = {}
    i = j = 0
    while i < len(src) and j < len(dst):
        if src[i] == 1 and dst[j] == 1:  # unit dims in step (a batch of 1) keep their identity
            out[i] = j
            i, j = i + 1, j + 1
            continue
        if src[i] == 1:
            i += 1
            continue
        if dst[j] == 1:
            j += 1
            continue
        gi, gj, pi, pj = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                i += 1
            else:
                pj *= dst[j]
                j += 1
        out[gi] = gj
    return out


def _interleave_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """repeat_interleave along one dim: copies of slice i land next to each other, so an even split of the
    repeated dim (grouped-query k/v heads -> query heads) stays an even split."""
    if len(src) != len(dst):
        return {}
    grown = [d for d in range(len(src)) if src[d] != dst[d]]
    out = {d: d for d in range(len(src)) if src[d] == dst[d]}
    if len(grown) == 1 and src[grown[0]] and dst[grown[0]] % src[grown[0]] == 0:
        out[grown[0]] = grown[0]
    return out


def _permutation_attr(node: Node, rank: int) -> tuple[int, ...] | None:
    for key in ("dims", "perm", "permutation"):
        v = node.attr(key)
        if isinstance(v, (tuple, list)) and sorted(int(d) % rank for d in v) == list(range(rank)):
            return tuple(int(d) % rank for d in v)
    d0, d1 = node.attr("dim0"), node.attr("dim1")
    if isinstance(d0, int) and isinstance(d1, int):
        perm = list(range(rank))
        perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
        return tuple(perm)
    return None


def _permute_map(node: Node, src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Permutations: from the node's attrs when recorded, else inferred from shapes where unambiguous (a transpose
    of two equal-size dims cannot be told from the identity by shapes alone, so such dims stay unmapped)."""
    rank = len(src)
    if rank != len(dst) or rank > 7:
        return {}
    perm = _permutation_attr(node, rank)
    if perm is not None:
        return {perm[k]: k for k in range(rank) if src[perm[k]] == dst[k]}
    candidates = [p for p in itertools.permutations(range(rank)) if all(src[p[k]] == dst[k] for k in range(rank))]
    if op_name(node.target) in ("transpose", "t", "swapaxes", "swapdims"):
        candidates = [p for p in candidates if sum(p[k] != k for k in range(rank)) == 2]
    out: dict[int, int] = {}
    for d in range(rank):
        images = {p.index(d) for p in candidates}
        if len(images) == 1:
            out[d] = images.pop()
    return out


def reduced_dims(node: Node, rank: int) -> frozenset[int]:
    dim = node.attr("dim")
    if dim is None:
        dim = node.attr("dims")
    if dim is None:
        return frozenset(range(rank))
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return frozenset(int(d) % rank for d in dims) if rank else frozenset()


def norm_dims(node: Node, rank: int) -> frozenset[int]:
    """Dims a normalization reduces over (the IR's "norm_type" / "normalized_ndim" / "dim" attrs): layer and RMS
    norms the last `normalized_ndim`; batch and instance norms all but the channels (dim 1) and, for instance
    norm, the batch; an Lp normalize its "dim"; anything else (group norm, unknown) every dim."""
    norm_type = node.attr("norm_type")
    target = node.target.lower()
    if norm_type is None:
        norm_type = "batch" if "batchnorm" in target or "batch_norm" in target else "layer"
    if norm_type in ("layer", "rms"):
        k = int(node.attr("normalized_ndim", 1))
        return frozenset(range(max(rank - k, 0), rank))
    if norm_type == "batch":
        return frozenset(d for d in range(rank) if d != 1)
    if norm_type == "instance":
        return frozenset(d for d in range(rank) if d > 1)
    if norm_type == "lp" and node.attr("dim") is not None:
        return reduced_dims(node, rank)
    return frozenset(range(rank))


def input_dim_maps(node: Node) -> tuple[DimMap, ...]:
    """Per tensor input, how its dims map onto the node's (first) output."""
    if not node.output_specs:
        return tuple({} for _ in node.input_specs)
    out = node.output_specs[0].shape
    ins = [s.shape for s in node.input_specs]
    kind, name = node.op_kind, op_name(node.target)
    if kind in (OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX):
        return tuple(_right_aligned_map(s, out) for s in ins)
    if kind is OpKind.LINEAR:
        return tuple(({d: d for d in range(len(s) - 1)} if i == 0 else {}) for i, s in enumerate(ins))
    if kind is OpKind.EMBEDDING:
        return tuple(({d: d for d in range(len(s))} if i == 0 else {}) for i, s in enumerate(ins))
    if kind is OpKind.MATMUL:
        return _matmul_maps(ins, out)
    if kind is OpKind.ATTENTION:
        return tuple((_right_aligned_map(s[:-1], out[:-1]) if i == 0 else _right_aligned_map(s[:-2], out[:-2]))
                     for i, s in enumerate(ins))
    if kind is OpKind.REDUCTION and ins:
        return (_reduction_map(node, ins[0], out),) + tuple({} for _ in ins[1:])
    if kind is OpKind.VIEW:
        return tuple(_view_map(node, name, s, out) for s in ins)
    return tuple({} for _ in ins)


def _matmul_maps(ins: Sequence[Sequence[int]], out: Sequence[int]) -> tuple[DimMap, ...]:
    if len(ins) != 2 or len(ins[0]) < 2 or len(ins[1]) < 2 or len(out) < 2:
        return tuple({} for _ in ins)
    a, b = ins
    ma = _right_aligned_map(a[:-2], out[:-2])
    ma[len(a) - 2] = len(out) - 2
    mb = _right_aligned_map(b[:-2], out[:-2])
    mb[len(b) - 1] = len(out) - 1
    return ma, mb


def _reduction_map(node: Node, src: Sequence[int], out: Sequence[int]) -> dict[int, int]:
    reduced = reduced_dims(node, len(src))
    keep = len(out) == len(src)
    result: dict[int, int] = {}
    k = 0
    for d in range(len(src)):
        if d in reduced:
            k += 1 if keep else 0
            continue
        if k < len(out) and out[k] == src[d]:
            result[d] = k
        k += 1
    return result


def _view_map(node: Node, name: str, src: Sequence[int], out: Sequence[int]) -> dict[int, int]:
    if tuple(src) == tuple(out) and name not in _PERMUTE_OPS:
        return {d: d for d in range(len(src))}
    if name in _PERMUTE_OPS:
        return _permute_map(node, src, out)
    if name in _RESHAPE_OPS:
        return _reshape_map(src, out)
    if name in _EXPAND_OPS:
        return _right_aligned_map(src, out)
    if name == "repeat_interleave":
        return _interleave_map(src, out)
    return _same_size_map(src, out)  # slicing, getitem, split, chunk, cat, narrow, select(keepdim)...


def external_labels(spec: TensorSpec, traced_batch: int) -> Labels:
    """Labels of a tensor entering the segment: dim 0 is the batch when it has the traced batch size, and dim 1
    of a (batch, seq) or (batch, seq, hidden) tensor is the sequence."""
    labels: list[DimLabel | None] = [None] * len(spec.shape)
    if spec.shape and spec.shape[0] == traced_batch:
        labels[0] = DimLabel.BATCH
        if len(spec.shape) in (2, 3):
            labels[1] = DimLabel.SEQ
    return tuple(labels)


def propagate_labels(nodes: Sequence[Node], traced_batch: int) -> dict[str, Labels]:
    """Labels of every node's (first) output, propagated from the segment's inputs through each node's dim maps."""
    labels: dict[str, Labels] = {}
    for node in nodes:
        if not node.output_specs:
            continue
        out_rank = len(node.output_specs[0].shape)
        if node.op_kind is OpKind.PLACEHOLDER:
            labels[node.name] = external_labels(node.output_specs[0], traced_batch)
            continue
        result: list[DimLabel | None] = [None] * out_rank
        for i, dmap in enumerate(input_dim_maps(node)):
            src = input_labels(node, i, labels, traced_batch)
            for d_in, d_out in sorted(dmap.items()):
                if d_in < len(src) and src[d_in] is not None and result[d_out] is None:
                    result[d_out] = src[d_in]
            # ops without a dim map (routing, other) still keep a leading batch dim of the same size
            if (out_rank and result[0] is None and src and src[0] is DimLabel.BATCH
                    and node.input_specs[i].shape[0] == node.output_specs[0].shape[0]
                    and node.op_kind not in _REORDERING_KINDS):
                result[0] = DimLabel.BATCH
        labels[node.name] = tuple(result)
    return labels


def input_labels(node: Node, i: int, labels: Mapping[str, Labels], traced_batch: int) -> Labels:
    spec = node.input_specs[i]
    known = labels.get(node.inputs[i]) if i < len(node.inputs) else None
    if known is not None and len(known) == len(spec.shape):
        return known
    return external_labels(spec, traced_batch)

