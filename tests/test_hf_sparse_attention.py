"""DeepSeek Sparse Attention from Hugging Face configs: traced as the lightning indexer and attention over its top-k
keys (`models.sparse_attention`) and priced over the keys each query sees; `tests/test_hf_structure.py` checks that
it runs exactly as transformers does, and under expert and pipeline parallelism."""

from __future__ import annotations

import pytest
import torch

import ir
from ir.node_metrics import causal_pairs
from models.registry import build_model
from models.sparse_attention import indexer_reference, lightning_indexer, sparse_attention, sparse_reference

transformers = pytest.importorskip("transformers")

_TINY = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512,
         "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
         "n_group": 2, "topk_group": 1, "index_n_heads": 4, "index_head_dim": 32}


def _saved(tmp_path_factory, **extra) -> str:
    folder = tmp_path_factory.mktemp("dsa")
    transformers.DeepseekV32Config(**{**_TINY, **extra}).save_pretrained(folder)
    return f"hf:{folder}"


def test_trace_prices_the_keys_each_query_sees(tmp_path_factory):
    """16 keys per query on 64 tokens: one lightning indexer and one sparse attention per layer, the attention's
    FLOPs the share of causal attention a 16-key window has, the indexer's the causal pairs' dot products, no
    S x S mask anywhere, and every parameter traced."""
    seq, topk, heads, qk, v = 64, 16, 4, 48, 32
    built = build_model(_saved(tmp_path_factory, index_topk=topk), seq=seq)
    graph = ir.trace(built.module, built.example_inputs, model_name="dsa")
    assert graph.param_count == built.module.num_parameters()
    attention = [n for n in graph.nodes if n.op_kind.value == "attention"]
    indexers = [n for n in graph.nodes if "lightning_indexer" in str(n.target)]
    assert len(attention) == len(indexers) == 2
    full = 2 * heads * seq * seq * (qk + v)  # sdpa_flop_count: the causal convention counts every pair
    band = (sum(range(1, topk)) + (seq - topk + 1) * topk) / (seq * (seq + 1) / 2)
    for n in attention:
        assert n.attr("sparse") and n.attr("window") == topk and n.attr("is_causal")
        assert n.forward_flops == int(full * band)
    pairs = causal_pairs(seq, seq)
    assert all(n.forward_flops == pairs * (2 * 4 * 32 + 2 * 4) and n.backward_flops == 0 for n in indexers)
    masks = [s for n in graph.nodes for s in n.output_specs if s.dtype == "bool" and s.shape[-2:] == (seq, seq)]
    assert not masks


def test_sparse_layers_cost_less_than_dense_past_the_top_k(tmp_path_factory):
    """At 256 tokens, 32 keys per query take less attention time than all 256 (the same config with index_topk
    past the sequence), and the trace of the dense one still holds its indexer."""
    def attention_flops(topk: int) -> int:
        built = build_model(_saved(tmp_path_factory, index_topk=topk), seq=256)
        graph = ir.trace(built.module, built.example_inputs, model_name="dsa")
        return sum(n.forward_flops for n in graph.nodes if n.op_kind.value == "attention")

    sparse, dense = attention_flops(32), attention_flops(256)
    assert 0.2 < sparse / dense < 0.3  # 32 of the ~128 keys an average query sees


def test_sparse_attention_op_gradients_and_causality():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    # As an indexer's top-k does, every query keeps a visible key (here itself) among random others.
    indices = torch.stack([torch.randperm(12)[:5] for _ in range(24)]).view(2, 12, 5)
    indices[..., 0] = torch.arange(12)
    indices = indices.to(torch.int32)
    out = sparse_attention(q, k, v, indices, 0.3)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(sparse_reference(q, k, v, indices, 0.3), (q, k, v), grad)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b)
    # Whatever the indexer picked, the first query sees only itself.
    first = torch.zeros(2, 12, 5, dtype=torch.int32)
    torch.testing.assert_close(sparse_attention(q, k, v, first, 0.3)[:, :, 0], v.repeat_interleave(2, dim=1)[:, :, 0])


def test_lightning_indexer_picks_the_highest_visible_scores():
    """Keys scored 0, 1, ..., T-1 (one head, weight 1): each query's top 3 are its 3 latest visible keys."""
    seq = 6
    q = torch.ones(1, seq, 1, 1)
    k = torch.arange(seq, dtype=torch.float32).view(1, seq, 1)
    got = lightning_indexer(q, k, torch.ones(1, seq, 1), 3)
    assert torch.equal(got, indexer_reference(q, k, torch.ones(1, seq, 1), 3))
    for s in range(2, seq):
        assert sorted(got[0, s].tolist()) == [s - 2, s - 1, s]
