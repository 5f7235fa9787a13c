"""The model zoo: parameter counts against published figures, closed forms against built models, real forwards
of the test-size presets, torch.fx traceability, and the numerics of attention, RoPE, MoE routing and T5 buckets."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from models import dlrm, gpt, llama, moe, t5
from models.attention import Attention, AttnImpl, attention_core
from models.feedforward import SwiGLU
from models.rope import RotaryEmbedding
from models.zoo import FAMILIES, PRESETS

# Published parameter counts: (figure, relative tolerance, source). The tolerance is the rounding of the figure
# as published (e.g. "1.3B" is +-0.05B at best, and GPT-3's Table 2.1 rounds to two significant digits).
PUBLISHED: dict[str, tuple[float, float, str]] = {
    "gpt2": (124e6, 0.005, "GPT-2 small, 124M released checkpoint (Radford et al. 2019 printed 117M)"),
    "gpt3-1.3b": (1.3e9, 0.02, "Brown et al. 2020, Table 2.1 (vocab 51200 adds 1.5M vs 50257)"),
    "gpt3-6.7b": (6.7e9, 0.01, "Brown et al. 2020, Table 2.1"),
    "gpt3-13b": (13.0e9, 0.015, "Brown et al. 2020, Table 2.1"),
    "gpt3-175b": (174.6e9, 0.005, "vocab 51200, seq 2048, tied embeddings -> 174.6B"),
    "gpt-22b": (22e9, 0.005, "Korthikanti et al. 2022, Table 3"),
    "gpt-530b": (530e9, 0.005, "Smith et al. 2022 (MT-NLG)"),
    "gpt-1t": (1008e9, 0.001, "Narayanan et al. SC'21, Table 1"),
    "llama2-7b": (6_738_415_616, 0.0, "Hugging Face meta-llama/Llama-2-7b-hf num_parameters()"),
    "llama3-8b": (8_030_261_248, 0.0, "Hugging Face meta-llama/Meta-Llama-3-8B num_parameters() (8.03B)"),
    "llama3-70b": (70_553_706_496, 0.0, "Hugging Face meta-llama/Meta-Llama-3-70B num_parameters() (70.6B)"),
    "llama3-405b": (405_853_388_800, 0.0, "Hugging Face meta-llama/Llama-3.1-405B num_parameters() (405.9B)"),
    "mixtral-8x7b": (46_702_792_704, 0.0, "Hugging Face mistralai/Mixtral-8x7B-v0.1 num_parameters() (46.7B)"),
    "bert-base": (109_514_298, 0.0, "Hugging Face bert-base-uncased BertForMaskedLM (Devlin et al.: 110M)"),
    "bert-large": (335e6, 0.005, "Hugging Face bert-large-uncased, 335M (Devlin et al. printed 340M)"),
    "bert-tiny": (4.4e6, 0.01, "Turc et al. 2019, BERT-Tiny 4.4M"),
    "t5-small": (60_506_624, 0.0, "Hugging Face t5-small num_parameters() (Raffel et al.: 60M)"),
    "t5-base": (222_903_552, 0.0, "Hugging Face t5-base num_parameters() (Raffel et al.: 220M)"),
    "vit-base": (86_567_656, 0.0, "timm vit_base_patch16_224 (Dosovitskiy et al.: 86M)"),
    "vit-large": (304_326_632, 0.0, "timm vit_large_patch16_224"),
    "vit-tiny": (5_717_416, 0.0, "timm vit_tiny_patch16_224 (DeiT-Ti, Touvron et al. 2021: 5M)"),
    "resnet-50": (25_557_032, 0.0, "torchvision resnet50 (He et al. 2016: 25.6M)"),
    "resnet-101": (44_549_160, 0.0, "torchvision resnet101"),
}

TINY = ("gpt-tiny", "llama-tiny", "moe-tiny", "bert-tiny", "t5-tiny", "vit-tiny", "resnet-tiny", "dlrm-small")
"""One small preset per family, cheap enough for real CPU forwards."""


def unique_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields tied weights once


def build_tiny(name: str, *, seed: int = 0, **overrides):
    preset = PRESETS[name]
    family = FAMILIES[preset.family]
    config = type(preset.config)(**{**preset.config.__dict__, **overrides}) if overrides else preset.config
    torch.manual_seed(seed)
    model = family.build(config, "cpu")
    return family, config, model


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_param_count_matches_published(name: str) -> None:
    figure, tolerance, source = PUBLISHED[name]
    preset = PRESETS[name]
    count = FAMILIES[preset.family].num_params(preset.config)
    assert abs(count / figure - 1) <= tolerance + 1e-12, f"{name}: {count:,} vs {figure:,.0f} ({source})"
    assert preset.published_params is not None and abs(preset.published_params / figure - 1) <= 0.005


def test_gpt3_175b_closed_form() -> None:
    # Narayanan et al. SC'21 eq. (2) without biases/norms: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)), tied head.
    layers, h, v, s = 96, 12288, 51200, 2048
    megatron = 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h))
    count = gpt.num_params(PRESETS["gpt3-175b"].config)
    assert count == pytest.approx(megatron, rel=1e-6)  # the formula's 13h covers biases and norms
    assert round(count / 1e9, 1) == 174.6


def test_dlrm_mlperf_matches_reference_sizes() -> None:
    # facebookresearch/dlrm dlrm_s_pytorch.py, "Criteo Terabyte MLPerf training" (max_ind_range 40M):
    ln_emb = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
              11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]
    ln_bot, ln_top, m_spa = [13, 512, 256, 128], [479, 1024, 1024, 512, 256, 1], 128
    mlp = sum(a * b + b for widths in (ln_bot, ln_top) for a, b in pairwise(widths))
    config = PRESETS["dlrm-mlperf"].config
    assert config.interaction_width == ln_top[0]
    assert dlrm.num_params(config) == sum(ln_emb) * m_spa + mlp == 24_036_595_969


@pytest.mark.parametrize("name", [*FAMILIES, *PRESETS])
def test_closed_form_equals_built_model_on_meta(name: str) -> None:
    if name in FAMILIES:
        family, config = FAMILIES[name], FAMILIES[name].config_type()
    else:
        family, config = FAMILIES[PRESETS[name].family], PRESETS[name].config
    model = family.build(config, "meta")
    assert all(p.is_meta for p in model.parameters())
    assert unique_params(model) == family.num_params(config)


def test_presets_belong_to_their_family() -> None:
    for preset in PRESETS.values():
        assert preset.name not in FAMILIES
        assert type(preset.config) is FAMILIES[preset.family].config_type
    assert {PRESETS[n].family for n in TINY} == set(FAMILIES)


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_on_cpu(name: str) -> None:
    family, config, model = build_tiny(name)
    inputs = family.example_inputs(config, 2, None, "cpu")
    out = model(*inputs)
    expected = {
        "t5": (2, getattr(config, "decoder_seq", 0), getattr(config, "vocab", 0)),
        "vit": (2, getattr(config, "classes", 0)),
        "resnet": (2, getattr(config, "classes", 0)),
        "dlrm": (2, 1),
    }.get(family.name, (2, getattr(config, "seq", 0), getattr(config, "vocab", 0)))  # gpt, llama, moe, bert
    assert tuple(out.shape) == expected
    loss = family.loss(out, inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    if family.name in ("gpt", "llama", "moe", "bert", "t5"):
        # N(0, 0.02) weights give near-zero logits, so cross entropy starts at ln(vocab).
        assert loss.item() == pytest.approx(math.log(config.vocab), abs=0.1)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"parameters without a finite gradient: {missing}"  # unused params break DDP


@pytest.mark.parametrize("name", TINY)
def test_fx_symbolic_trace_reproduces_forward(name: str) -> None:
    family, config, model = build_tiny(name)
    model.eval()
    inputs = family.example_inputs(config, 2, None, "cpu")
    traced = fx.symbolic_trace(model)
    torch.testing.assert_close(traced(*inputs), model(*inputs), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt3-175b", "llama3-70b", "mixtral-8x7b", "t5-base", "dlrm-mlperf"])
def test_fx_traces_large_presets_on_meta(name: str) -> None:
    preset = PRESETS[name]
    family = FAMILIES[preset.family]
    model = family.build(preset.config, "meta")
    graph = fx.symbolic_trace(model).graph
    blocks = {n.target.split(".")[1] for n in graph.nodes if n.op == "call_module" and n.target.startswith("blocks.")}
    if hasattr(model, "blocks"):
        assert len(blocks) == preset.config.layers
    out = model(*family.example_inputs(preset.config, 1, None, "meta"))
    assert out.is_meta


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny", "bert-tiny", "t5-tiny", "vit-tiny"])
def test_math_attention_equals_sdpa(name: str) -> None:
    family, config, sdpa_model = build_tiny(name)
    _, math_config, math_model = build_tiny(name, attn_impl="math")
    assert math_config.attn_impl == AttnImpl.MATH
    math_model.load_state_dict(sdpa_model.state_dict())
    inputs = family.example_inputs(config, 2, None, "cpu")
    torch.testing.assert_close(math_model(*inputs), sdpa_model(*inputs), rtol=1e-4, atol=1e-5)


def test_math_attention_exposes_the_core_ops() -> None:
    family, config, model = build_tiny("gpt-tiny", attn_impl="math")
    targets = [str(n.target) for n in fx.symbolic_trace(model.blocks[0]).graph.nodes]
    assert any("softmax" in t for t in targets) and any("dropout" in t for t in targets)
    assert sum("matmul" in t for t in targets) == 2  # QK^T and AV
    _, _, fused = build_tiny("gpt-tiny")
    fused_targets = [str(n.target) for n in fx.symbolic_trace(fused.blocks[0]).graph.nodes]
    assert any("scaled_dot_product_attention" in t for t in fused_targets)
    assert not any("softmax" in t for t in fused_targets)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_decoders_are_causal(name: str) -> None:
    # Capacity dropping looks at the whole routing group (GShard), so MoE is causal only when dropless.
    family, config, model = build_tiny(name, **({"capacity_factor": 2.0} if name == "moe-tiny" else {}))
    (ids,) = family.example_inputs(config, 2, None, "cpu")
    changed = ids.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % config.vocab
    before, after = model(ids), model(changed)
    # MoE: a token's second choice may land in another slot row of the expert batch (bitwise-different bmm)
    atol = 1e-6 if name == "moe-tiny" else 0.0
    torch.testing.assert_close(after[:, :40], before[:, :40], rtol=0, atol=atol)
    assert (after[:, 40:] - before[:, 40:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny", "t5-tiny", "bert-tiny"])
def test_meta_then_to_empty_equals_direct_build(name: str) -> None:
    family, config, direct = build_tiny(name, seed=3)
    lazy = family.build(config, "meta")
    lazy.to_empty(device="cpu")
    torch.manual_seed(3)
    with torch.no_grad():
        lazy.init_weights()
    inputs = family.example_inputs(config, 2, None, "cpu")
    torch.testing.assert_close(lazy(*inputs), direct(*inputs), rtol=0, atol=0)
    if getattr(config, "tie_embeddings", True):
        assert lazy.lm_head.weight is lazy.tok_embed.weight  # ties restored after to_empty


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny", "bert-tiny", "t5-tiny", "vit-tiny",
                                  "resnet-tiny", "dlrm-small"])
def test_loss_is_invariant_to_batch_splits(name: str) -> None:
    family, config, model = build_tiny(name)
    model.eval()  # BatchNorm uses running statistics, so samples do not interact
    inputs = family.example_inputs(config, 4, None, "cpu")
    whole = family.loss(model(*inputs), inputs)
    halves = [tuple(t[i : i + 2] for t in inputs) for i in (0, 2)]
    split = sum(family.loss(model(*h), h) for h in halves) / 2
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-6)


def test_seq_shorter_than_config_runs_and_longer_is_refused() -> None:
    family, config, model = build_tiny("llama-tiny")
    (ids,) = family.example_inputs(config, 1, 16, "cpu")
    assert tuple(model(ids).shape) == (1, 16, config.vocab)
    with pytest.raises(ValueError, match="exceeds"):
        family.example_inputs(config, 1, config.seq + 1, "cpu")


# --- attention layout: tensor-parallel local modules and grouped-query heads ---------------------------------


@pytest.mark.parametrize("kv_heads", [8, 4, 2])
def test_attention_column_row_split_sums_to_full(kv_heads: int) -> None:
    """Megatron-style tp: q/k/v split by output rows (whole heads), o_proj by input columns; each rank runs the
    same module class with fewer heads (the -1 in view) and the partial outputs sum to the full output."""
    torch.manual_seed(0)
    hidden, heads, tp = 64, 8, 2
    full = Attention(hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, bias=False, causal=True,
                     impl=AttnImpl.SDPA)
    x = torch.randn(2, 10, hidden)
    partial_sum = torch.zeros_like(x)
    hd = hidden // heads
    for rank in range(tp):
        local = Attention(hidden=hidden, num_heads=heads // tp, num_kv_heads=kv_heads // tp, head_dim=hd,
                          bias=False, causal=True, impl=AttnImpl.SDPA)
        q_rows = slice(rank * heads // tp * hd, (rank + 1) * heads // tp * hd)
        kv_rows = slice(rank * kv_heads // tp * hd, (rank + 1) * kv_heads // tp * hd)
        with torch.no_grad():
            local.q_proj.weight.copy_(full.q_proj.weight[q_rows])
            local.k_proj.weight.copy_(full.k_proj.weight[kv_rows])
            local.v_proj.weight.copy_(full.v_proj.weight[kv_rows])
            local.o_proj.weight.copy_(full.o_proj.weight[:, q_rows])
        partial_sum += local(x)
    torch.testing.assert_close(partial_sum, full(x), rtol=1e-5, atol=1e-6)


def test_grouped_query_attention_equals_mha_with_shared_kv_heads() -> None:
    torch.manual_seed(0)
    hidden, heads, kv_heads = 64, 8, 2
    gqa = Attention(hidden=hidden, num_heads=heads, num_kv_heads=kv_heads, bias=False, causal=True,
                    impl=AttnImpl.MATH)
    mha = Attention(hidden=hidden, num_heads=heads, bias=False, causal=True, impl=AttnImpl.MATH)
    hd, group = hidden // heads, heads // kv_heads
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        # query head i reads kv head i // group (consecutive query heads share a kv head)
        for proj in ("k_proj", "v_proj"):
            w = getattr(gqa, proj).weight.view(kv_heads, hd, hidden)
            getattr(mha, proj).weight.copy_(w.repeat_interleave(group, dim=0).reshape(heads * hd, hidden))
    x = torch.randn(2, 12, hidden)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-6)


def test_math_attention_matches_explicit_formula() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    got = attention_core(q, k, v, impl=AttnImpl.MATH, causal=True, scale=0.5, dropout=0.0)
    scores = q @ k.transpose(-1, -2) * 0.5
    scores = scores + torch.triu(torch.full((5, 5), float("-inf")), 1)
    torch.testing.assert_close(got, torch.softmax(scores, -1) @ v)


# --- RoPE ---------------------------------------------------------------------------------------------------


def test_rope_scores_depend_only_on_relative_position() -> None:
    """Su et al. 2021 eq. 16: <R_m q, R_n k> = <q, R_{n-m} k>; rotations also preserve norms."""
    rope = RotaryEmbedding(head_dim=8, max_seq=32, theta=10000.0)
    torch.manual_seed(0)
    q, k = torch.randn(8), torch.randn(8)
    seq = torch.stack([q] * 32).view(1, 1, 32, 8)
    rotated_q = rope(seq)[0, 0]  # row m = R_m q
    rotated_k = rope(torch.stack([k] * 32).view(1, 1, 32, 8))[0, 0]
    torch.testing.assert_close(rotated_q.norm(dim=-1), q.norm().expand(32))
    score = rotated_q @ rotated_k.T  # [m, n]
    for shift in (0, 3, 17):
        diagonal = torch.diagonal(score, offset=shift)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), rtol=1e-5, atol=1e-5)
    # position 0 is the identity; position 1 rotates pair i by theta^(-2i/d)
    torch.testing.assert_close(rotated_q[0], q)
    angle = 10000.0 ** (-torch.arange(4) / 4)
    expected = torch.cat([q[:4] * angle.cos() - q[4:] * angle.sin(), q[4:] * angle.cos() + q[:4] * angle.sin()])
    torch.testing.assert_close(rotated_q[1], expected)


# --- MoE routing -------------------------------------------------------------------------------------------


def reference_moe(layer: moe.MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """GShard capacity dispatch written with loops: per group, first choices take expert slots in token order,
    then second choices; a choice finding its expert full is dropped; kept choices are weighted by the
    renormalized top-k router probabilities."""
    hidden = x.size(-1)
    groups = x.reshape(-1, layer.group_size, hidden)
    out = torch.zeros_like(groups)
    experts = layer.experts
    for g, tokens in enumerate(groups):
        probs = torch.softmax(layer.router(tokens).float(), -1)
        top_p, top_i = probs.topk(layer.top_k, -1)
        gates = top_p / top_p.sum(-1, keepdim=True)
        load = [0] * layer.num_experts
        for choice in range(layer.top_k):
            for s in range(layer.group_size):
                e = int(top_i[s, choice])
                if load[e] >= layer.capacity:
                    continue
                load[e] += 1
                h = F.silu(tokens[s] @ experts.gate_proj[e]) * (tokens[s] @ experts.up_proj[e])
                out[g, s] += gates[s, choice] * (h @ experts.down_proj[e])
    return out.reshape_as(x)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 4.0])
def test_moe_dispatch_matches_loop_reference(capacity_factor: float) -> None:
    config = moe.MoEConfig(vocab=64, hidden=16, layers=1, heads=2, kv_heads=1, ffn_hidden=24, seq=16,
                           experts=4, top_k=2, capacity_factor=capacity_factor, group_size=8)
    assert config.capacity == min(8, math.ceil(2 * capacity_factor * 8 / 4))
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(config)
    layer.experts.init_weights(std=0.3, residual_std=0.3)
    x = torch.randn(2, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


def test_moe_expert_flops_are_top_k_times_capacity_factor() -> None:
    config = PRESETS["moe-tiny"].config
    layer = moe.MoEFeedForward(config)
    x = torch.randn(2, config.seq, config.hidden)
    with FlopCounterMode(display=False) as counter:
        layer(x)
    tokens = 2 * config.seq
    groups = tokens // config.tokens_per_group
    expert_flops = counter.get_flop_counts()["MoEFeedForward.experts"]
    total = sum(expert_flops.values())
    # 3 matmuls of h x f per slot: 2 * 3 * h * f FLOPs; E * C slots per group, C = ceil(k * cf * S / E)
    assert total == groups * config.experts * config.capacity * 6 * config.hidden * config.ffn_hidden
    dense_equivalent = tokens * config.top_k * config.capacity_factor * 6 * config.hidden * config.ffn_hidden
    assert total == pytest.approx(dense_equivalent, rel=0.01)
    assert total < config.experts * tokens * 6 * config.hidden * config.ffn_hidden / 1.5


def test_moe_capacity_dropping_sees_the_whole_group() -> None:
    """With tight capacity a later token can take the slot an earlier token's second choice wanted, so the
    earlier token's output changes: the documented non-causality of capacity routing."""
    family, config, model = build_tiny("moe-tiny")
    assert config.capacity < config.tokens_per_group
    (ids,) = family.example_inputs(config, 2, None, "cpu")
    changed = ids.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % config.vocab
    assert (model(changed)[:, :40] - model(ids)[:, :40]).abs().max() > 1e-3


def test_mixtral_routing_groups() -> None:
    config = PRESETS["mixtral-8x7b"].config
    assert config.tokens_per_group == 1024 and config.capacity == math.ceil(2 * 1.25 * 1024 / 8) == 320
    with pytest.raises(ValueError, match="group_size=3 must divide seq"):
        moe.MoEConfig(group_size=3)
    with pytest.raises(ValueError, match="top_k=3 exceeds experts=2"):
        moe.MoEConfig(experts=2, top_k=3)


# --- T5 relative positions ----------------------------------------------------------------------------------


def test_t5_relative_position_buckets() -> None:
    # Raffel et al. 2020 / Mesh TensorFlow: 32 buckets, max distance 128. Bidirectional: 16 per direction,
    # 8 exact, then 8 log-spaced: bucket(d) = 8 + floor(log(d/8) / log(16) * 8) for 8 <= d < 128.
    rel = torch.tensor([0, -1, 1, -7, -8, -20, -127, -128, -1000, 20])
    bidirectional = t5.relative_position_bucket(rel, bidirectional=True, buckets=32, max_distance=128)
    assert bidirectional.tolist() == [0, 1, 17, 7, 8, 10, 15, 15, 15, 26]
    assert 8 + math.floor(math.log(20 / 8) / math.log(16) * 8) == 10
    causal = t5.relative_position_bucket(rel, bidirectional=False, buckets=32, max_distance=128)
    # one direction: 16 exact, 16 log-spaced over [16, 128); future keys (rel > 0) map to bucket 0
    assert causal.tolist() == [0, 1, 0, 7, 8, 16 + math.floor(math.log(20 / 16) / math.log(8) * 16), 31, 31, 31, 0]


def test_t5_decoder_is_causal_and_encoder_is_not() -> None:
    family, config, model = build_tiny("t5-tiny")
    ids, decoder_ids = family.example_inputs(config, 1, None, "cpu")
    base = model(ids, decoder_ids)
    later_target = decoder_ids.clone()
    later_target[:, 8:] = (later_target[:, 8:] + 1) % config.vocab
    torch.testing.assert_close(model(ids, later_target)[:, :8], base[:, :8], rtol=0, atol=0)
    later_source = ids.clone()
    later_source[:, -1] = (later_source[:, -1] + 1) % config.vocab
    assert (model(later_source, decoder_ids)[:, 0] - base[:, 0]).abs().max() > 1e-4  # sees the whole input


# --- configs --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: gpt.GPTConfig(hidden=100, heads=12), "hidden=100 must be divisible by heads=12"),
        (lambda: gpt.GPTConfig(layers=0), "layers must be a positive integer"),
        (lambda: gpt.GPTConfig(dropout=1.0), "dropout must be in"),
        (lambda: gpt.GPTConfig(attn_impl="flash"), "attn_impl='flash' is not one of sdpa, math"),
        (lambda: llama.LlamaConfig(heads=32, kv_heads=5), "heads=32 must be divisible by kv_heads=5"),
        (lambda: llama.LlamaConfig(hidden=96, heads=32, kv_heads=8), "even head_dim"),
        (lambda: dlrm.DLRMConfig(bottom_mlp=(64, 32)), "bottom_mlp must end at embed_dim=128"),
        (lambda: t5.T5Config(buckets=2), "buckets must be >= 4"),
    ],
)
def test_config_validation_names_the_field(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_enum_fields_accept_strings() -> None:
    config = gpt.GPTConfig(attn_impl="math")
    assert config.attn_impl is AttnImpl.MATH


def test_swiglu_formula() -> None:
    torch.manual_seed(0)
    mlp = SwiGLU(8, 16)
    x = torch.randn(3, 8)
    expected = (F.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), expected)


@pytest.mark.parametrize("name", TINY)
def test_direct_construction_gives_finite_weights(name: str) -> None:
    """Constructing the module class directly (no `build`, no `init_weights`) still gives usable weights."""
    preset = PRESETS[name]
    family = FAMILIES[preset.family]
    model_class = type(family.build(preset.config, "meta"))
    torch.manual_seed(0)
    model = model_class(preset.config)
    assert all(torch.isfinite(t).all() for t in [*model.parameters(), *model.buffers()])
    assert torch.isfinite(model.eval()(*family.example_inputs(preset.config, 1, None, "cpu"))).all()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: gpt.GPTConfig(norm_eps=0.0), "norm_eps must be a positive number"),
        (lambda: moe.MoEConfig(capacity_factor=-1.0), "capacity_factor must be a positive number"),
        (lambda: dlrm.DLRMConfig(tables=()), "tables must be a non-empty tuple of positive integers"),
        (lambda: dlrm.DLRMConfig(top_mlp=(64, 2)), "top_mlp must end in 1"),
        (lambda: llama.LlamaConfig(rope_theta=1.0), "rope_theta must be > 1"),
    ],
)
def test_numeric_and_tuple_fields_are_validated(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
