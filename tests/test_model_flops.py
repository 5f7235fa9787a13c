"""Model FLOPs (what MFU counts) of a mixture of experts: each token's k choices through one expert, whatever
capacity the model was traced with (`costmodel.model_flops`)."""

from __future__ import annotations

import json

import pytest

import ir
from costmodel.estimate import estimate
from costmodel.hardware.cluster import Cluster
from costmodel.model_flops import model_flops
from costmodel.strategy import Strategy
from ir.moe_structure import routed_experts
from models.registry import build_model
from planner.cli.main import main

E, K, H, F, SEQ, LAYERS = 4, 2, 128, 256, 64, 2
MOE = (f"layers={LAYERS}", f"hidden={H}", f"ffn_hidden={F}", "heads=4", "kv_heads=4", "vocab=512",
       f"experts={E}", f"top_k={K}", "group_size=16")


def _chain(capacity: float, batch: int = 2) -> ir.LayerChain:
    built = build_model("moe", (*MOE, f"capacity_factor={capacity}"), batch=batch, seq=SEQ, device="meta")
    return ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="moe"))


def _traced(chain: ir.LayerChain) -> int:
    return chain.graph.forward_flops + chain.graph.backward_flops


def _expert_flops(chain: ir.LayerChain) -> int:
    """Traced forward + backward FLOPs of the routed experts' linears, over every block."""
    total = 0
    for seg in chain.segments:
        nodes = chain.nodes_of(seg)
        found = routed_experts(nodes)
        if found is not None:
            total += sum(n.forward_flops + n.backward_flops for n in nodes if n.name in found.linears)
    return total


def test_routed_experts_count_each_token_choice_once():
    """Capacity 1.25 pads each expert's buffer, capacity E / k = 2 gives every expert every token (C = S): the
    traced FLOPs grow with it, the model FLOPs stay the dropless count -- the trace at capacity 1, where every slot
    is one token choice -- and their expert part is the closed form: per token k choices through three h x f
    projections, 2 FLOPs per weight forward and 4 backward."""
    dropless = _chain(1.0)
    assert model_flops(dropless) == _traced(dropless)
    for capacity in (1.25, E / K):
        chain = _chain(capacity)
        assert _traced(chain) > _traced(dropless)
        assert model_flops(chain) == pytest.approx(_traced(dropless), rel=1e-12)
        dense = _traced(chain) - _expert_flops(chain)
        tokens = 2 * SEQ
        assert model_flops(chain) - dense == pytest.approx(LAYERS * tokens * K * 3 * H * F * 6, rel=1e-12)


def test_a_dense_models_model_flops_are_its_traced_flops():
    built = build_model("gpt-tiny", (), batch=1, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="gpt-tiny"))
    assert model_flops(chain) == _traced(chain)


def test_mfu_of_one_strategy_does_not_depend_on_the_traced_capacity():
    """One rank with every expert computes the mean load (k choices per token) however the trace padded the
    buffers, so the same strategy takes the same time and is credited with the same FLOPs: the same MFU."""
    cluster = Cluster.parse("1x8xh100")
    strategy = Strategy(dp=8, tp=1, pp=1, microbatch_size=2, num_microbatches=1)
    padded, dropless = (estimate(_chain(c, batch=1), cluster, strategy) for c in (1.25, 1.0))
    assert padded.step_time_s == pytest.approx(dropless.step_time_s, rel=1e-9)
    assert padded.mfu == pytest.approx(dropless.mfu, rel=1e-9)
    assert padded.model_tflops_per_device == pytest.approx(dropless.model_tflops_per_device, rel=1e-9)


def test_trace_summary_reports_the_model_flops_beside_the_traced_ones(capsys):
    assert main(["trace", "moe-tiny", "--json"]) in (0, None)
    summary = json.loads(capsys.readouterr().out)
    assert summary["model_flops"] < summary["forward_flops"] + summary["backward_flops"]


def test_the_capacity_factor_of_several_layers_is_their_own():
    """Over a whole graph the routers' choices, the expert weights and their FLOPs all sum over the layers; the
    capacity factor is still the per-layer ratio (it was divided by the layer count)."""
    chain = _chain(1.25)
    whole = routed_experts(chain.graph.nodes)
    per_block = {routed_experts(chain.nodes_of(s)).capacity_factor for s in chain.segments
                 if routed_experts(chain.nodes_of(s)) is not None}
    assert whole.layers == LAYERS and len(per_block) == 1
    assert whole.capacity_factor == pytest.approx(per_block.pop(), rel=1e-12)
