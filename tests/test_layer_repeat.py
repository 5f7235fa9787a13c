"""Tracing the first layers of a repeating stack and copying the rest (`ir.layer_repeat`, `models.layer_stack`)
gives the graph that tracing every layer gives: node for node apart from names, the same fingerprint, the same
parameter count as the real model."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from torch import nn

import ir
from ir.layer_repeat import RepeatedStack, repeat_layers
from models.layer_stack import (
    LayerPattern,
    TraceStandIn,
    cut_config_lists,
    find_layer_stack,
    layer_signatures,
    periodic_stack,
)
from models.registry import build_model
from planner.tracing import trace_built

pytest.importorskip("transformers")

_SMALL = ("hidden_size=64", "intermediate_size=128", "num_attention_heads=2", "num_key_value_heads=2",
          "vocab_size=256", "max_position_embeddings=256", "head_dim=32")
_MOE = ("num_experts_per_tok=2", "moe_intermediate_size=32")
_GEMMA_TYPES = json.dumps((["sliding_attention"] * 2 + ["full_attention"]) * 4 + ["sliding_attention"] * 2)

CASES = {
    # name: (MODEL, --set, (prefix, period, traced layers))
    "deepseek_v3 (2 dense layers)": (
        "hf:deepseek_v3",
        (*_SMALL[:-1], *_MOE, "num_hidden_layers=7", "first_k_dense_replace=2", "n_routed_experts=4",
         "n_shared_experts=1", "n_group=2", "topk_group=1", "kv_lora_rank=16", "q_lora_rank=24",
         "qk_rope_head_dim=8", "qk_nope_head_dim=16", "v_head_dim=16"),
        (2, 1, 4)),
    "qwen3_moe (first layer dense)": (
        "hf:qwen3_moe", (*_SMALL[:-1], *_MOE, "num_experts=4", "num_hidden_layers=6", "mlp_only_layers=[0]"), (1, 1, 3)),
    "gemma3_text (2 local, 1 global)": (
        "hf:gemma3_text", (*_SMALL, "num_hidden_layers=14", "sliding_window=16", f"layer_types={_GEMMA_TYPES}"),
        (0, 3, 8)),
    "gpt_oss (alternating windows)": (
        "hf:gpt_oss", (*_SMALL, "num_hidden_layers=10", "num_local_experts=4", "num_experts_per_tok=2",
                       "sliding_window=16"), (0, 2, 6)),
}


def _unnamed(graph: ir.Graph) -> list[ir.Node]:
    return [dataclasses.replace(n, name="", inputs=tuple(str(graph.position(s)) for s in n.inputs))
            for n in graph.nodes]


@pytest.mark.parametrize("case", sorted(CASES))
def test_copied_layers_equal_the_full_trace(case):
    model, sets, (prefix, period, traced) = CASES[case]
    built = build_model(model, sets, seq=32)
    stand_in = built.trace_stand_in()
    assert stand_in is not None
    pattern = stand_in.pattern
    assert (pattern.prefix, pattern.period, pattern.traced) == (prefix, period, traced)
    graph = trace_built(built)
    full = ir.trace(built.module, built.example_inputs, model_name=built.name, dtype="bfloat16")
    assert _unnamed(graph) == _unnamed(full)
    assert ir.fingerprint(graph) == ir.fingerprint(full)
    assert graph.param_count == full.param_count == built.module.num_parameters()
    assert graph.param_bytes == full.param_bytes
    assert [s.to_dict() for s in ir.build_layer_chain(graph).segments] == \
        [s.to_dict() for s in ir.build_layer_chain(full).segments]


def test_a_stack_that_does_not_repeat_is_refused_and_the_model_is_traced_whole():
    model, sets, _ = CASES["deepseek_v3 (2 dense layers)"]
    built = build_model(model, sets, seq=32)
    # Layers 0-2 dense, layer 3 MoE, claimed to repeat from layer 2 on: the trace shows they do not.
    cut = [s for s in sets if not s.startswith(("first_k_dense_replace=", "num_hidden_layers="))]
    short = build_model(model, (*cut, "first_k_dense_replace=3", "num_hidden_layers=4"), seq=32)
    claim = LayerPattern(path="model.layers", total=7, prefix=2, period=1)
    assert claim.traced == 4
    graph = ir.trace(short.module, short.example_inputs, dtype="bfloat16")
    with pytest.raises(ValueError, match="layer model.layers.3"):
        repeat_layers(graph, RepeatedStack(path="model.layers", total=7, traced=4, period=1))
    lying = TraceStandIn(module=short.module, example_inputs=short.example_inputs, pattern=claim, added_params=0)
    traced = trace_built(dataclasses.replace(built, trace_stand_in=lambda: lying))
    full = ir.trace(built.module, built.example_inputs, dtype="bfloat16")
    assert _unnamed(traced) == _unnamed(full)


@pytest.mark.parametrize(("pattern", "expected"), [
    ("aaabbbbbbbbb", (3, 1, 5)),     # dense prefix, uniform tail
    ("abababababab", (0, 2, 6)),     # alternating, even count: the last layer keeps its type
    ("ababababababa", (0, 2, 5)),    # odd count: one more traced layer keeps the last one's type
    ("aaaaaaaa", (0, 1, 3)),         # uniform: one lead layer and two compared layers
    ("aabaabaabaabaab", (0, 3, 9)),  # period 3 (Gemma-like): (15 - 1) % 3 = 2 more layers
])
def test_periodic_stack_traces_the_fewest_layers(pattern, expected):
    stack = periodic_stack("layers", list(pattern))
    assert (stack.prefix, stack.period, stack.traced) == expected
    assert stack.traced < len(pattern) and (stack.total - stack.traced) % stack.period == 0


@pytest.mark.parametrize("pattern", ["abcdefgh", "aaa", "ab", "aaaaaaab"])
def test_no_stand_in_when_nothing_repeats_enough(pattern):
    assert periodic_stack("layers", list(pattern)) is None


def test_per_layer_config_lists_are_cut_and_index_lists_filtered():
    class Config:
        def __init__(self) -> None:
            self.layer_types = ["a", "b"] * 4
            self.mlp_only_layers = [0, 5]
            self.moe_layers = list(range(8))
            self.other = [3, 1]

    cut = cut_config_lists(Config(), 8, 3)
    assert cut == {"layer_types": ["a", "b", "a"], "mlp_only_layers": [0], "moe_layers": [0, 1, 2]}


def test_no_stack_when_two_lists_have_the_layer_count():
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    model.norms = nn.ModuleList(nn.LayerNorm(2) for _ in range(4))
    assert find_layer_stack(model, 4) is None
    assert find_layer_stack(model, 5) is None


def test_a_layer_differing_only_in_a_tuple_attribute_is_its_own_kind():
    class Block(nn.Module):
        def __init__(self, window: tuple[int, int]) -> None:
            super().__init__()
            self.window = window
            self.proj = nn.Linear(4, 4)

    blocks = [Block((8, 0)) for _ in range(6)] + [Block((16, 0))] + [Block((8, 0)) for _ in range(5)]
    signatures = layer_signatures(blocks, config=types.SimpleNamespace())
    assert signatures[0] == signatures[1] and signatures[6] != signatures[0]
    pattern = periodic_stack("blocks", signatures)
    assert pattern is None or pattern.prefix > 6  # never copies a layer over the one that differs
