"""Memory terms: model state under ZeRO, saved activations per recomputation choice against Korthikanti et al.'s
closed forms, in-flight activation totals per schedule, temporaries and overhead."""

from __future__ import annotations

import pytest
from costmodel_graphs import A100, GptShape, gpt_chain

from costmodel.layer_cost import LayerCost
from costmodel.layer_pricing import price_segment, selective_recompute_region
from costmodel.memory import (
    CPU_FRAMEWORK_OVERHEAD_BYTES,
    GPU_FRAMEWORK_OVERHEAD_BYTES,
    PricedSegment,
    korthikanti_layer_activation_bytes,
    model_state_bytes,
    rank_memory,
)
from costmodel.pipeline import in_flight_per_chunk
from costmodel.strategy import Recompute


def test_mixed_precision_adam_is_18_bytes_per_parameter():
    """Megatron-LM's distributed-optimizer guide: 18 bytes per parameter with bf16 weights and fp32 gradients,
    6 + 12/d with the optimizer state sharded over d ranks."""
    s = model_state_bytes(1000)
    assert (s.params, s.grads, s.optimizer, s.total) == (2000, 4000, 12000, 18000)
    assert model_state_bytes(1000, zero_stage=1, dp=8).total == 1000 * (6 + 12 / 8)
    fp32 = model_state_bytes(1000, dtype="float32")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4000, 4000, 8000)


@pytest.mark.parametrize("zero,expected", [(0, (2000, 4000, 12000)), (1, (2000, 4000, 1500)),
                                           (2, (2000, 500, 1500)), (3, (500, 500, 1000))])
def test_zero_stages_shard_optimizer_then_grads_then_weights(zero, expected):
    s = model_state_bytes(1000, zero_stage=zero, dp=8)
    assert (s.params, s.grads, s.optimizer) == expected


def test_zero_shards_round_up_and_validate():
    # ZeRO-3 keeps the fp32 shard (the master copy): 16 bytes per parameter over dp, FSDP2 mixed precision.
    assert model_state_bytes(10, zero_stage=3, dp=4).params == 3 * 4
    assert model_state_bytes(1000, zero_stage=3, dp=8).total == 1000 * 16 / 8
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(10, zero_stage=4)


GPT3 = GptShape(layers=2, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1)


@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL])
@pytest.mark.parametrize("mbs", [1, 2])
def test_layer_activations_match_korthikanti(recompute, mbs):
    chain = gpt_chain(GPT3)
    cost = price_segment(chain, chain.segments[1], A100, microbatch_size=mbs)
    saved = {Recompute.NONE: cost.saved_bytes_none, Recompute.SELECTIVE: cost.saved_bytes_selective,
             Recompute.FULL: cost.saved_bytes_full}[recompute]
    expected = korthikanti_layer_activation_bytes(seq=2048, batch=mbs, hidden=12288, heads=96, recompute=recompute)
    assert saved == expected


def test_korthikanti_published_selective_savings():
    """Sec. 5: for GPT-3 (a=96, s=2048, h=12288) 5as/h = 80 and selective recomputation saves 70%; for MT-NLG
    (a=128, h=20480) 5as/h = 64 and it saves 65%."""
    for heads, hidden, saving in ((96, 12288, 0.70), (128, 20480, 0.65)):
        none = korthikanti_layer_activation_bytes(seq=2048, batch=1, hidden=hidden, heads=heads)
        sel = korthikanti_layer_activation_bytes(seq=2048, batch=1, hidden=hidden, heads=heads,
                                                 recompute=Recompute.SELECTIVE)
        assert 1 - sel / none == pytest.approx(saving, abs=0.01)


def test_tensor_and_sequence_parallel_forms():
    kw = dict(seq=2048, batch=1, hidden=12288, heads=96, tp=8)
    sbh = 2048 * 12288
    assert korthikanti_layer_activation_bytes(**kw) == pytest.approx(sbh * (10 + 24 / 8 + 80 / 8))
    assert korthikanti_layer_activation_bytes(**kw, sequence_parallel=True) == pytest.approx(sbh / 8 * (34 + 80))
    assert korthikanti_layer_activation_bytes(**kw, sequence_parallel=True,
                                              recompute=Recompute.SELECTIVE) == pytest.approx(34 * sbh / 8)


def test_selective_region_includes_nodes_between_core_nodes():
    chain = gpt_chain(GptShape(layers=1))
    nodes = chain.nodes_of(chain.segments[1])
    region = selective_recompute_region(nodes)
    assert region == {"blocks.0.qk", "blocks.0.softmax", "blocks.0.attn_drop", "blocks.0.av"}
    # A scale node between QK^T and softmax, not marked, is recomputed too.
    from dataclasses import replace
    moved = []
    for n in nodes:
        if n.name == "blocks.0.softmax":
            moved.append(replace(n, attrs=(("dim", -1),)))  # unmark softmax: it sits between qk and dropout
        else:
            moved.append(n)
    assert "blocks.0.softmax" in selective_recompute_region(moved)


def test_flash_attention_selective_drops_only_output():
    shape = GptShape(layers=1, hidden=256, heads=4, seq=128, batch=2)
    chain = gpt_chain(shape, attention="flash")
    cost = price_segment(chain, chain.segments[1], A100, microbatch_size=2)
    sbh = 128 * 2 * 256
    # flash saves q, k, v, out (8sbh); selective keeps q, k, v (6sbh) read from outside the region.
    assert cost.saved_bytes_none - cost.saved_bytes_selective == 2 * sbh


def _cost(saved: int, params: int = 100, temp: int = 10) -> LayerCost:
    return LayerCost(fwd_compute_s=1, bwd_compute_s=2, fwd_comm_s=0, bwd_comm_s=0, param_count=params,
                     param_bytes=2 * params, saved_bytes_none=saved, saved_bytes_selective=saved // 2,
                     saved_bytes_full=saved // 10, recompute_selective_s=0.1, recompute_full_s=1,
                     boundary_bytes=5, peak_temp_bytes=temp)


def test_rank_memory_terms():
    segs = [PricedSegment(_cost(1000)), PricedSegment(_cost(1000), Recompute.FULL)]
    mem = rank_memory([segs], [4], zero_stage=1, dp=2, device_name="a100-80gb")
    assert mem.params == 400 and mem.grads == 800 and mem.optimizer == 12 * 100
    assert mem.activations == 4 * (1000 + 100)
    # largest transient + the full-recompute segment re-materializing its activations in backward
    assert mem.temporary == 10 + 900
    assert mem.overhead == GPU_FRAMEWORK_OVERHEAD_BYTES
    z3 = rank_memory([segs], [4], zero_stage=3, dp=2, device_name="cpu")
    # ... plus under ZeRO-3 two gathered units and the reduce-scattered unit's whole gradient (bf16 + fp32 copy)
    assert z3.params == 400 and z3.temporary == 10 + 900 + 2 * 200 + (2 + 4) * 100
    three = segs + [PricedSegment(_cost(1000, params=300))]
    z3 = rank_memory([three], [4], zero_stage=3, dp=2, device_name="cpu")
    kept = rank_memory([three], [4], zero_stage=3, dp=2, device_name="cpu", reshard_after_forward=False)
    # Resharding after forward: the largest unit twice (running, prefetched); without: every unit held.
    assert kept.temporary - z3.temporary == 2 * (100 + 100 + 300) - 2 * 2 * 300
    assert z3.overhead == CPU_FRAMEWORK_OVERHEAD_BYTES
    # Under pipelining the whole fp32 gradient stays (no-sync backward) and every gathered unit is held.
    piped = rank_memory([three], [4], zero_stage=3, dp=2, device_name="cpu", pipelined=True)
    assert piped.grads == 4 * 500 and z3.grads == 4 * 250
    assert piped.temporary == kept.temporary and piped.params == z3.params
    assert rank_memory([segs], [4], zero_stage=2, dp=2, device_name="cpu", pipelined=True).grads == 4 * 200
    with pytest.raises(ValueError, match="in-flight"):
        rank_memory([segs], [1, 2])


def test_first_stage_holds_all_layers_worth_of_activations_under_1f1b():
    """Korthikanti et al. eq. 5: the first 1F1B stage holds p micro-batches of L/p layers = L layers' worth,
    whatever p is; interleaving multiplies that by 1 + (p-1)/(p*v)."""
    layers = 24
    per_layer = 1000
    for p in (1, 2, 4, 8):
        chunk = [PricedSegment(_cost(per_layer))] * (layers // p)
        mem = rank_memory([chunk], in_flight_per_chunk("1f1b", p, 0, 32), device_name="a100-80gb")
        assert mem.activations == layers * per_layer
    p, v = 4, 3
    chunks = [[PricedSegment(_cost(per_layer))] * (layers // (p * v))] * v
    mem = rank_memory(chunks, in_flight_per_chunk("interleaved", p, 0, 32, v), device_name="a100-80gb")
    assert mem.activations == pytest.approx(layers * per_layer * (1 + (p - 1) / (p * v)))
