"""What a fusing runtime moves: the graph's memory-bound ops priced as the fused kernels that run them.

An eager PyTorch step launches one kernel per op, and each reads its inputs from and writes its output to HBM:
a residual add, an RMSNorm, the four multiplies of rotary embeddings, SiLU and the gate multiply each cost a
pass over their tensors. A compiled graph (torch.compile / Inductor, as torchtitan runs with `compile.enable`) or a
trainer with hand-fused kernels (Megatron-Core with Transformer Engine: fused bias-GeLU/SwiGLU, bias-dropout-add,
rotary, LayerNorm-linear) runs each connected run of such ops as one kernel that reads what the run takes from
outside and writes what leaves it. That difference is measured: torchtitan's Llama 3.1 8B on 8 H100 runs 2.843 s
per step eager and 2.457 s with torch.compile, same configuration (published_runs.csv), about the share of the
step the model gives to these ops.

Fusion groups. Within one chain segment (a compiler region is one block; pipeline cuts fall between segments),
the connected components of memory-bound nodes -- `FUSIBLE_KINDS`, linked by producer-consumer edges -- each
become one kernel. GEMMs, fused attention, embeddings, routing (gathers and scatters) and the loss bound them.

Bytes. A group moves E = the sum of its nodes' traced bytes when run eagerly, and X = the bytes of the tensors
it reads from outside the group (each once), its parameters, and the outputs read outside the group (or by
nothing: the segment's results) when fused. The fused group is priced at min(E, X): a group of pure views stays
free, and no fusion can cost more than running the ops one by one. Each node keeps the part of X it is the
first to read or writes, so the per-node pricing (and tensor-parallel sharding of each node's bytes) carries over;
every node but the group's first is marked `FUSED_MEMBER_ATTR` and pays no kernel-launch floor of its own.

Saved activations. Inside a fused group, intermediates are not kept for backward: the backward kernel recomputes
them from the group's inputs (Inductor's min-cut partitioner; Megatron's fused bias-SwiGLU saves its input, not
SiLU's output). A group that saved S bytes eagerly saves min(S, X_saved) fused, where X_saved is the bytes of its
external inputs; when X_saved is the smaller, each node saves the external inputs it is first to read. For
SwiGLU that drops SiLU's output (one of the three ffn-wide tensors it kept); an add + RMSNorm group keeps the
norm's input, which is already the smaller of the two.

A GEMM or attention outside the groups that saves a group's output may keep the group's own inputs instead when
they are fewer bytes, the backward rerunning the fused kernel (`rematerialized_saves`): rotary embeddings and the
grouped-query expansion of k and v before attention, whose unexpanded k and v are what flash attention with
native grouped-query heads keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ir.graph import Node, OpKind

FUSIBLE_KINDS = frozenset({OpKind.ELEMENTWISE, OpKind.NORM, OpKind.SOFTMAX, OpKind.VIEW, OpKind.REDUCTION})
"""Memory-bound ops a fusing compiler merges into one kernel with their neighbours."""
FUSED_MEMBER_ATTR = "fused_member"
"""Node attribute: the node runs inside a fused kernel launched by an earlier node of its group."""
FUSED_INPUT_ATTR = "input_from_fused_kernel"
"""Node attribute of a linear layer: a fused memory-bound kernel of its segment writes its input (through views), so
a reduction over that input (an FP8 cast's amax, `costmodel.float8`) can run inside that kernel."""
FUSED_GRAD_ATTR = "grad_from_fused_kernel"
"""Node attribute of a linear layer: only fused memory-bound kernels of its segment read its output (through views),
so their backward writes its output gradient and can reduce over it in the same kernel."""


def fusion_groups(nodes: Sequence[Node]) -> list[list[int]]:
    """Positions in `nodes` of each fusion group (connected fusible nodes), groups and members in node order."""
    where = {n.name: i for i, n in enumerate(nodes)}
    parent = list(range(len(nodes)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, n in enumerate(nodes):
        if n.op_kind not in FUSIBLE_KINDS:
            continue
        for src in n.inputs:
            j = where.get(src)
            if j is not None and nodes[j].op_kind in FUSIBLE_KINDS:
                a, b = root(i), root(j)
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        if n.op_kind in FUSIBLE_KINDS:
            groups.setdefault(root(i), []).append(i)
    return [g for _, g in sorted(groups.items())]


def _external_reads(nodes: Sequence[Node], group: Sequence[int]) -> list[int]:
    """Per member: bytes of the tensors from outside the group that it is the first member to read."""
    inside = {nodes[i].name for i in group}
    seen: set[str] = set()
    out = []
    for i in group:
        n = nodes[i]
        total = 0
        for k, src in enumerate(n.inputs):
            if src in inside or src in seen or k >= len(n.input_specs):
                continue
            seen.add(src)
            total += n.input_specs[k].nbytes
        out.append(total)
    return out


def fuse_nodes(nodes: Sequence[Node], readers: dict[str, set[str]]) -> list[Node]:
    """`nodes` (one segment) with each fusion group's bytes and saved bytes as the fused kernel's (module
    docstring). `readers` maps a node name to the names of every node of the graph that reads it."""
    out = list(nodes)
    groups = fusion_groups(nodes)
    for group in groups:
        if len(group) < 2:
            continue
        inside = {nodes[i].name for i in group}
        reads = _external_reads(nodes, group)
        writes = [sum(s.nbytes for s in nodes[i].output_specs)
                  if not readers.get(nodes[i].name) or readers[nodes[i].name] - inside else 0 for i in group]
        eager = sum(nodes[i].bytes_read + nodes[i].bytes_written for i in group)
        fused = sum(reads) + sum(writes) + sum(nodes[i].param_bytes for i in group)
        eager_saved = sum(nodes[i].saved_bytes for i in group)
        move = fused < eager
        keep = sum(reads) < eager_saved
        for k, i in enumerate(group):
            n = nodes[i]
            changes: dict = {}
            if move:
                changes.update(bytes_read=reads[k] + n.param_bytes, bytes_written=writes[k])
            if keep:
                changes["saved_bytes"] = reads[k]
            if k:
                changes["attrs"] = tuple(sorted((*n.attrs, (FUSED_MEMBER_ATTR, True))))
            out[i] = dataclasses.replace(n, **changes)
    return _mark_linear_neighbours(rematerialized_saves(out, groups), readers)


def _mark_linear_neighbours(nodes: Sequence[Node], readers: dict[str, set[str]]) -> list[Node]:
    """Linear layers tagged `FUSED_INPUT_ATTR` / `FUSED_GRAD_ATTR` where a fused kernel writes their input / their
    output gradient (`nodes`: one segment; `readers`: over the whole graph)."""
    by_name = {n.name: n for n in nodes}

    def producer(name: str) -> Node | None:
        n = by_name.get(name)
        while n is not None and n.op_kind is OpKind.VIEW and n.inputs:
            n = by_name.get(n.inputs[0])
        return n

    def fused_readers(name: str) -> bool:
        names = readers.get(name, set())
        for r in names:
            n = by_name.get(r)
            if n is None or n.op_kind not in FUSIBLE_KINDS:
                return False
            if n.op_kind is OpKind.VIEW and not fused_readers(r):
                return False
        return bool(names)

    out = []
    for n in nodes:
        if n.op_kind is OpKind.LINEAR and n.inputs:
            source = producer(n.inputs[0])
            extra = {FUSED_INPUT_ATTR: source is not None and source.op_kind in FUSIBLE_KINDS,
                     FUSED_GRAD_ATTR: fused_readers(n.name)}
            if any(extra.values()):
                n = dataclasses.replace(n, attrs=tuple(sorted({**dict(n.attrs), **extra}.items())))
        out.append(n)
    return out


def _group_sources(nodes: Sequence[Node], where: dict[str, int], member: dict[str, int], start: str
                   ) -> dict[str, int]:
    """Producer name -> bytes of the tensors from outside its group that group member `start` is computed from
    (`where`: node name -> position in `nodes`; `member`: group member name -> group index)."""
    out: dict[str, int] = {}
    todo, seen = [start], {start}
    while todo:
        n = nodes[where[todo.pop()]]
        for k, src in enumerate(n.inputs):
            if member.get(src) == member[start]:
                if src not in seen:
                    seen.add(src)
                    todo.append(src)
            elif k < len(n.input_specs):
                out.setdefault(src, n.input_specs[k].nbytes)
    return out


def rematerialized_saves(nodes: Sequence[Node], groups: Sequence[Sequence[int]]) -> list[Node]:
    """`nodes` (one segment, fused; `groups` its `fusion_groups`) where a GEMM or attention saves fused-group
    outputs that the group computes from fewer bytes -- rotary embeddings and the grouped-query k/v expansion
    before attention: the node keeps the group's inputs instead and backward reruns the fused kernel (the min-cut
    a compiler takes; flash attention with native grouped-query heads keeps k and v unexpanded)."""
    member = {nodes[i].name: g for g, group in enumerate(groups) for i in group}
    where = {n.name: i for i, n in enumerate(nodes)}
    out = list(nodes)
    for i, n in enumerate(nodes):
        if n.op_kind in FUSIBLE_KINDS or not n.saved_bytes:
            continue
        fed = [(src, n.input_specs[k].nbytes) for k, src in enumerate(n.inputs)
               if src in member and k < len(n.input_specs)]
        held = sum(b for _, b in fed)
        if not fed or held > n.saved_bytes:
            continue
        sources: dict[str, int] = {}
        for src, _ in fed:
            for name, b in _group_sources(nodes, where, member, src).items():
                sources.setdefault(name, b)
        if sum(sources.values()) < held:
            out[i] = dataclasses.replace(n, saved_bytes=n.saved_bytes - held + sum(sources.values()))
    return out


def readers_of(nodes: Sequence[Node]) -> dict[str, set[str]]:
    """Node name -> names of the nodes that read it."""
    out: dict[str, set[str]] = {}
    for n in nodes:
        for src in n.inputs:
            out.setdefault(src, set()).add(n.name)
    return out
