"""DeepSeek Sparse Attention (DSA) as two traced ops: the lightning indexer's top-k and attention over those keys.

DeepSeek-V3.2 (DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek Sparse
Attention", Sec. 2.1) and the models built on it (GLM-MoE-DSA, HY v4, AXK2, dots3) attend each query to the
`index_topk` keys its lightning indexer scores highest, instead of to every earlier key:

    I[s, t] = sum_h w[s, h] * relu(q_I[s, h] . k_I[t])     (H_I indexer heads of dimension D_I, one key head)
    keys(s) = top-k_t I[s, t] over t <= s

transformers writes both steps for the eager and SDPA kernels as dense code: the indexer materializes the
(B, S, H_I, S) fp32 scores (4 GiB per sample and layer at 4,096 tokens with 64 heads) and the selection becomes a
(B, 1, S, S) mask on a full S x S attention. A trace would price that dense code, and at long contexts (the reason
DSA exists) it is many times what the fused kernels DeepSeek describes run (an FP8 indexer kernel that writes only
the logits, and a sparse MLA kernel that reads only the selected keys). These ops keep the two steps whole so `ir`
can price them as those kernels do:

- `lightning_indexer(q (B, S, H, D), k (B, T, D), weights (B, S, H), topk) -> (B, S, min(topk, T)) int32`: the
  indices of the top-k scores of each query over the keys t <= s (queries are the last S of T positions; a
  query with fewer than topk visible keys gets arbitrary indices among the masked ones, as transformers' own
  indexer does, and `sparse_attention` masks them). Priced as the scoring GEMM over the causal triangle (the
  kernels skip keys after the query) plus writing and reading the fp32 logits the top-k reads.
- `sparse_attention(query (B, Hq, S, Dqk), key (B, Hkv, T, Dqk), value (B, Hkv, T, Dv), indices (B, S, K),
  scale) -> (B, Hq, S, Dv)`: softmax attention of each query over the keys in its row of `indices` that are not
  after it. Query s sees min(s + 1, K) keys, exactly as many as under a causal sliding window of K keys, so `ir`
  prices it with the window's FLOP count (`ir.node_metrics.window_fraction`) and FlashAttention's saved tensors.

Both run as explicit masked computations (`*_reference`): exact, and fine for the small models the runtime checks on
CPU; attention's backward recomputes the forward under autograd. `models.hf_tracing` routes transformers' DSA
attention here.
"""

from __future__ import annotations

from typing import Any

import torch


def causal_visible(q_length: int, kv_length: int, device: torch.device) -> torch.Tensor:
    """(S_q, S_kv) bool: key t is visible to query s when t <= s (queries are the last S_q positions)."""
    q = torch.arange(kv_length - q_length, kv_length, device=device).unsqueeze(1)
    return torch.arange(kv_length, device=device).unsqueeze(0) <= q


def indexer_reference(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int) -> torch.Tensor:
    """`lightning_indexer`'s semantics (module docstring), in fp32 as transformers computes the scores."""
    scores = torch.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()))
    index = torch.einsum("bsh,bsht->bst", weights.float(), scores)
    index = index.masked_fill(~causal_visible(q.size(1), k.size(1), q.device), float("-inf"))
    return index.topk(min(topk, k.size(1)), dim=-1).indices.to(torch.int32)


@torch.library.custom_op("stratagem::lightning_indexer", mutates_args=())
def lightning_indexer(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int) -> torch.Tensor:
    return indexer_reference(q, k, weights, topk)


@lightning_indexer.register_fake
def _indexer_fake(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, topk: int) -> torch.Tensor:
    return q.new_empty((q.size(0), q.size(1), min(topk, k.size(1))), dtype=torch.int32)


def sparse_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`sparse_attention`'s semantics (module docstring) as masked attention."""
    groups = query.size(-3) // key.size(-3)
    key = key.repeat_interleave(groups, dim=-3)
    value = value.repeat_interleave(groups, dim=-3)
    b, _, s, _ = query.shape
    selected = torch.zeros((b, s, key.size(-2)), dtype=torch.bool, device=query.device)
    selected = selected.scatter(-1, indices.long(), True)
    visible = (selected & causal_visible(s, key.size(-2), query.device)).unsqueeze(1)  # (B, 1, S, T)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1), value)


@torch.library.custom_op("stratagem::sparse_attention", mutates_args=())
def sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor,
                     scale: float) -> torch.Tensor:
    return sparse_reference(query, key, value, indices, scale)


@sparse_attention.register_fake
def _sparse_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, indices: torch.Tensor,
                 scale: float) -> torch.Tensor:
    return query.new_empty((*query.shape[:-1], value.size(-1)))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    query, key, value, indices, scale = inputs
    ctx.scale = scale
    ctx.save_for_backward(query, key, value, indices)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    query, key, value, indices = ctx.saved_tensors
    leaves = [t.detach().requires_grad_() for t in (query, key, value)]
    with torch.enable_grad():
        out = sparse_reference(*leaves, indices, ctx.scale)
        grads = torch.autograd.grad(out, leaves, grad)
    return (*grads, None, None)


sparse_attention.register_autograd(_backward, setup_context=_setup_context)
