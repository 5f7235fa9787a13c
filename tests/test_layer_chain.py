"""ir.build_layer_chain: cut points, liveness (against a brute-force reference), sums and class sharing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ir_models import TinyEncoderDecoder, TinyGPT
from torch import nn

import ir
from ir.chain_builder import Liveness, segment_hash
from ir.graph import Graph, Node, OpKind, TensorSpec

B, T, V, H, L, A = 2, 16, 96, 32, 4, 4


def _gpt_chain(dtype: str = "float32") -> ir.LayerChain:
    torch.manual_seed(0)
    model = TinyGPT(vocab=V, seq=T, hidden=H, layers=L, heads=A)
    return ir.build_layer_chain(ir.trace(model, (torch.randint(0, V, (B, T)),), dtype=dtype))


def test_gpt_chain_segments_and_classes() -> None:
    chain = _gpt_chain()
    assert [s.name for s in chain.segments] == ["wte+wpe+drop", *(f"blocks.{i}" for i in range(L)), "ln_f"]
    assert [s.class_id for s in chain.segments] == [0, *([1] * L), 2]
    assert chain.num_classes == 3 and chain.representative(1).name == "blocks.0"
    hashes = {s.structural_hash for s in chain.segments[1:-1]}
    assert len(hashes) == 1


def test_gpt_chain_sums() -> None:
    chain = _gpt_chain()
    graph = chain.graph
    d = 4
    # parameters: each counted once; the tied embedding/head weight in the embedding segment
    assert sum(s.param_count for s in chain.segments) == graph.param_count
    assert chain.segments[0].param_count == V * H + T * H
    block = 4 * (H * H + H) + (H * 4 * H + 4 * H) + (4 * H * H + H) + 2 * 2 * H
    assert all(s.param_count == block for s in chain.segments[1:-1])
    assert chain.segments[-1].param_count == 2 * H  # ln_f only: the head's weight is wte.weight
    assert chain.segments[-1].param_bytes == 2 * H * d
    # FLOPs and saved bytes are node sums
    for s in chain.segments:
        nodes = chain.nodes_of(s)
        assert s.forward_flops == sum(n.forward_flops for n in nodes)
        assert s.saved_bytes == sum(n.saved_bytes for n in nodes)
    assert sum(s.forward_flops for s in chain.segments) == graph.forward_flops
    # one residual-stream tensor crosses each cut; the first segment reads the token ids
    assert [s.boundary_bytes for s in chain.segments] == [B * T * H * d] * (L + 1) + [0]
    assert chain.segments[0].input_bytes == B * T * 8
    assert all(s.input_bytes == B * T * H * d for s in chain.segments[1:])


def test_boundary_bytes_follow_dtype() -> None:
    chain = _gpt_chain("bfloat16")
    assert chain.segments[1].boundary_bytes == B * T * H * 2


def test_encoder_decoder_chain_carries_the_encoder_output() -> None:
    torch.manual_seed(0)
    model = TinyEncoderDecoder(vocab=64, hidden=H, layers=3, heads=A)
    src, tgt = torch.randint(0, 64, (B, T)), torch.randint(0, 64, (B, 8))
    graph = ir.trace(model, (src, tgt))
    chain = ir.build_layer_chain(graph)
    names = [s.name for s in chain.segments]
    assert names == ["embed", "encoder.0", "encoder.1", "encoder.2", "enc_norm+embed", "decoder.0", "decoder.1",
                     "decoder.2", "dec_norm+head"]
    live = Liveness.of(graph)
    dec = chain.segments[5:8]
    hidden, memory = B * 8 * H * 4, B * T * H * 4
    # between decoder blocks: the decoder stream and the encoder output (2 tensors)
    assert [live.count(s.stop) for s in dec[:-1]] == [2, 2]
    assert [s.boundary_bytes for s in dec] == [hidden + memory, hidden + memory, hidden]
    assert dec[0].class_id == dec[1].class_id == dec[2].class_id
    enc = chain.segments[1:4]
    assert enc[0].class_id == enc[1].class_id == enc[2].class_id != dec[0].class_id
    # with at most one crossing tensor allowed, the decoder blocks cannot be cut apart
    strict = ir.build_layer_chain(graph, max_crossing=1)
    assert [s.name for s in strict.segments] == ["embed", "encoder.0", "encoder.1", "encoder.2",
                                                 "enc_norm..decoder.2", "dec_norm+head"]


def test_zoo_t5_decoder_blocks_share_a_class() -> None:
    from models.registry import build_model

    built = build_model("t5-small", batch=1)
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs))
    decoder = [s for s in chain.segments if s.name.startswith("decoder.blocks.")]
    encoder = [s for s in chain.segments if s.name.startswith("encoder.blocks.")]
    assert len(decoder) == len(encoder) == built.config.layers
    assert len({s.class_id for s in decoder[1:]}) == 1 and len({s.class_id for s in encoder[1:]}) == 1
    # between decoder blocks: the encoder output (seq x hidden) and the decoder stream (decoder_seq x hidden)
    c = built.config
    assert [seg.boundary_bytes for seg in decoder] == [4 * c.hidden * (c.seq + c.decoder_seq)] * (c.layers - 1) + [
        4 * c.hidden * c.decoder_seq]


def test_zoo_resnet_stem_blocks_and_head() -> None:
    from models.registry import build_model

    built = build_model("resnet-50", batch=1)
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs))
    names = [s.name for s in chain.segments]
    assert names[0] == "stem" and names[-1] == "fc" and len(names) == 2 + 16  # 3 + 4 + 6 + 3 bottlenecks
    # the first block of each stage (with its downsample) is a class of its own; the rest share one per stage
    classes = [s.class_id for s in chain.segments[1:-1]]
    stage_sizes = (3, 4, 6, 3)
    start = 0
    for size in stage_sizes:
        stage = classes[start:start + size]
        assert stage[0] not in stage[1:] and len(set(stage[1:])) == 1
        start += size
    assert chain.num_classes == 2 + 2 * len(stage_sizes)


def test_sequential_of_leaves_is_one_segment_per_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    chain = ir.build_layer_chain(ir.trace(model, (torch.randn(3, 8),)))
    assert [s.name for s in chain.segments] == ["0", "1", "2", "3", "4"]
    assert chain.segments[1].class_id == chain.segments[3].class_id  # the two ReLUs
    assert [s.boundary_bytes for s in chain.segments] == [3 * 16 * 4] * 4 + [0]


def test_structural_hash_ignores_names_but_not_shapes() -> None:
    graph = _gpt_chain().graph
    seg = (7, 30)
    renamed_nodes = tuple(dataclasses.replace(n, name=f"x{i}", inputs=tuple(f"x{graph.position(s)}" for s in n.inputs))
                          for i, n in enumerate(graph.nodes))
    renamed = dataclasses.replace(graph, nodes=renamed_nodes)
    assert segment_hash(renamed, *seg) == segment_hash(graph, *seg)
    nodes = list(graph.nodes)
    i = seg[0] + 3
    nodes[i] = dataclasses.replace(nodes[i], output_specs=(TensorSpec((1, 2, 3), "float32"),))
    changed = dataclasses.replace(graph, nodes=tuple(nodes))
    assert segment_hash(changed, *seg) != segment_hash(graph, *seg)


def test_bad_arguments() -> None:
    graph = _gpt_chain().graph
    with pytest.raises(ValueError, match="max_crossing must be >= 1, got 0"):
        ir.build_layer_chain(graph, max_crossing=0)


# ---------------------------------------------------------------------------------------------------------------
# Liveness against a brute-force reference on random graphs
# ---------------------------------------------------------------------------------------------------------------


@st.composite
def random_graphs(draw: st.DrawFn) -> Graph:
    n = draw(st.integers(3, 24))
    nodes: list[Node] = []
    for i in range(n):
        if i == 0 or (i < 3 and draw(st.booleans())):
            nodes.append(Node(f"n{i}", OpKind.PLACEHOLDER, "placeholder", "", (), (),
                              (TensorSpec((draw(st.integers(1, 5)),), "float32"),)))
            continue
        k = draw(st.integers(0, min(3, i)))
        srcs = tuple(sorted(set(draw(st.lists(st.integers(0, i - 1), min_size=k, max_size=k)))))
        kind = draw(st.sampled_from([OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.LINEAR]))
        attrs = (("alias_input", 0),) if kind is OpKind.VIEW and srcs else ()
        nodes.append(Node(f"n{i}", kind, "t", "", tuple(f"n{j}" for j in srcs),
                          tuple(nodes[j].output_specs[0] for j in srcs),
                          (TensorSpec((draw(st.integers(1, 5)),), "float32"),), attrs=attrs))
    return Graph("g", tuple(nodes), 1, None, "float32", 0, 0)


def _reference_crossing(graph: Graph, cut: int) -> set[int]:
    """Storages live across `cut`, by definition: an activation (depends on a model input, is not one) produced
    before the cut and read at or after it, mapped to the node owning its storage (through views). What counts is
    the storage: a view of a model input is a model input (every stage can be fed it), a view of a constant a
    constant."""
    nodes = graph.nodes
    pos = {n.name: i for i, n in enumerate(nodes)}
    is_input = [n.op_kind is OpKind.PLACEHOLDER for n in nodes]
    depends: list[bool] = []
    for n in nodes:
        depends.append(n.op_kind is OpKind.PLACEHOLDER or any(depends[pos[s]] for s in n.inputs))

    def root(i: int) -> int:
        alias = nodes[i].attr("alias_input")
        return root(pos[nodes[i].inputs[alias]]) if alias is not None else i

    out = set()
    for j in range(cut, len(nodes)):
        for s in nodes[j].inputs:
            i = pos[s]
            r = root(i)
            if i < cut and depends[r] and not is_input[r]:
                out.add(r)
    return out


@settings(max_examples=50, deadline=None)
@given(random_graphs())
def test_liveness_matches_brute_force(graph: Graph) -> None:
    live = Liveness.of(graph)
    for cut in range(len(graph.nodes) + 1):
        expected = _reference_crossing(graph, cut)
        assert set(live.crossing[cut]) == expected
        assert live.bytes_at(cut) == sum(sum(s.nbytes for s in graph.nodes[r].output_specs) for r in expected)
    chain = ir.build_layer_chain(graph)
    assert chain.segments[0].start == 0 and chain.segments[-1].stop == len(graph.nodes)
