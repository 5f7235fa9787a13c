"""Graph and LayerChain JSON round-trips on real traces, the networkx view, and fingerprints."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from ir_models import ShapeBranch, TinyConvNet, TinyGPT

import ir


def _gpt(layers: int = 2, hidden: int = 32) -> tuple[TinyGPT, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return TinyGPT(vocab=64, seq=8, hidden=hidden, layers=layers, heads=4), (torch.randint(0, 64, (2, 8)),)


def _traces() -> dict[str, ir.Graph]:
    model, inputs = _gpt()
    torch.manual_seed(0)
    math_model = TinyGPT(vocab=64, seq=8, hidden=32, layers=2, heads=4, math_attention=True, dropout=0.1)
    return {
        "gpt-fx": ir.trace(model, inputs, dtype="bfloat16"),
        "gpt-math": ir.trace(math_model, inputs),
        "conv": ir.trace(TinyConvNet(), (torch.randn(2, 3, 8, 8),)),
        "export": ir.trace(ShapeBranch(), (torch.randn(2, 6, 8),)),
    }


@pytest.fixture(scope="module")
def traces() -> dict[str, ir.Graph]:
    return _traces()


@pytest.mark.parametrize("key", ["gpt-fx", "gpt-math", "conv", "export"])
def test_graph_json_round_trip_is_lossless(traces: dict[str, ir.Graph], key: str) -> None:
    graph = traces[key]
    text = graph.to_json()
    back = ir.Graph.from_json(text)
    assert back == graph
    assert back.to_json() == text
    assert ir.fingerprint(back) == ir.fingerprint(graph)
    # attribute tuples (kernel sizes, reduction dims) come back as tuples, not lists
    for a, b in zip(graph.nodes, back.nodes, strict=True):
        assert a.attrs == b.attrs and all(type(x[1]) is type(y[1]) for x, y in zip(a.attrs, b.attrs, strict=True))
    json.loads(text)  # plain JSON


@pytest.mark.parametrize("key", ["gpt-fx", "gpt-math", "conv", "export"])
def test_chain_json_round_trip_is_lossless(traces: dict[str, ir.Graph], key: str) -> None:
    chain = ir.build_layer_chain(traces[key])
    back = ir.LayerChain.from_json(chain.to_json())
    assert back == chain
    assert back.to_json() == chain.to_json()
    assert ir.build_layer_chain(back.graph) == chain


def test_conv_attrs_keep_tuples(traces: dict[str, ir.Graph]) -> None:
    back = ir.Graph.from_json(traces["conv"].to_json())
    conv = next(n for n in back.nodes if n.op_kind is ir.OpKind.CONV)
    assert conv.attr("kernel_size") == (3, 3) and conv.attr("stride") == (1, 1)


def test_networkx_view(traces: dict[str, ir.Graph]) -> None:
    graph = traces["gpt-fx"]
    g = graph.to_networkx()
    assert g.number_of_nodes() == len(graph.nodes)
    assert g.number_of_edges() == len({(s, n.name) for n in graph.nodes for s in n.inputs})
    q = graph.node("blocks_0_attn_q_proj")
    assert g.edges["blocks_0_ln1", q.name]["bytes"] == 2 * 8 * 32 * 2  # bf16 activation (B, T, h)
    assert g.nodes[q.name]["node"] is q


def test_fingerprint_is_structural() -> None:
    model, inputs = _gpt()
    a = ir.trace(model, inputs, model_name="first")
    b = ir.trace(model, inputs, model_name="second")
    fp = ir.fingerprint(a)
    assert len(fp) == 64 and int(fp, 16) >= 0
    assert ir.fingerprint(b) == fp  # the display name is not structure
    renamed = dataclasses.replace(a, tracer="export")
    assert ir.fingerprint(renamed) == fp
    deeper, deeper_inputs = _gpt(layers=3)
    assert ir.fingerprint(ir.trace(deeper, deeper_inputs)) != fp
    wider, wider_inputs = _gpt(hidden=64)
    assert ir.fingerprint(ir.trace(wider, wider_inputs)) != fp
    assert ir.fingerprint(ir.trace(model, inputs, dtype="bfloat16")) == fp  # dtype belongs to the plan's training config
