"""Multi-head attention shared by the zoo's transformers: separate q/k/v/o projections, grouped-query heads.

Layout rules other packages rely on (tensor-parallel styles, selective recomputation):
- projections are `q_proj`, `k_proj`, `v_proj`, `o_proj` (`nn.Linear`);
- head counts are recovered with `-1` in `view`, so a module whose projections were sharded column-wise
  over tp ranks (heads/tp local heads) runs unchanged;
- `AttnImpl.MATH` spells out the attention core as Megatron-LM does (QK^T, scale, mask, softmax, dropout, AV)
  so that its seq x seq intermediates are visible in the traced graph; `AttnImpl.SDPA` uses the fused kernel.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn

from models.megatron_kernels import scale_causal_softmax


class AttnImpl(enum.StrEnum):
    """How the attention core is computed."""

    SDPA = "sdpa"  # F.scaled_dot_product_attention: fused, never materializes the seq x seq scores
    MATH = "math"  # explicit ops as in Korthikanti et al. 2022 Fig. 4 (what selective recomputation recomputes)
    FUSED_SOFTMAX = "fused_softmax"
    """Explicit attention with Megatron-LM's kernels (`FusedScaleMaskSoftmax`): causal self-attention runs its
    scale, mask and softmax as one kernel (`models.megatron_kernels`), one pass over the seq x seq scores where `math`
    makes five (scale, mask, fp32 cast, softmax, cast back); other masks keep the scale folded into q, the mask and
    a softmax with fp32 in registers only (two passes). Then dropout. What 2021-22 Megatron-LM runs priced as."""


def _scale_causal_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    return scale_causal_softmax(scores, scale)


# A leaf of torch.fx tracing: one call_function node (the custom op itself is not fx-traceable).
torch.fx.wrap("_scale_causal_softmax")


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    impl: AttnImpl,
    causal: bool,
    scale: float,
    dropout: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + bias [+ causal mask]) v, with dropout on the probabilities.

    q: (B, nh, T, hd); k, v: (B, nh, S, hd); bias: additive, broadcastable to (B, nh, T, S).
    Returns (B, nh, T, hd). `dropout` is the rate to apply now (callers pass 0.0 in eval mode).
    """
    if causal and bias is not None:
        # SDPA rejects is_causal together with attn_mask; callers fold the causal mask into the bias instead.
        raise ValueError("pass either causal=True or an additive bias with the causal mask folded in, not both")
    if impl == AttnImpl.SDPA:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, dropout_p=dropout, is_causal=causal, scale=scale
        )
    if impl == AttnImpl.FUSED_SOFTMAX and causal and bias is None:
        # Megatron-LM's GPT path: one kernel scales, masks and normalizes the scores (models.megatron_kernels).
        probs = _scale_causal_softmax(torch.matmul(q, k.transpose(-2, -1)), scale)
        return torch.matmul(F.dropout(probs, p=dropout, training=dropout > 0.0), v)
    if impl == AttnImpl.FUSED_SOFTMAX:
        scores = torch.matmul(q * scale, k.transpose(-2, -1))  # (B, nh, T, S)
    else:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, nh, T, S)
    if bias is not None:
        scores = scores + bias
    if causal:
        # built from the scores (not from sizes) so that torch.fx traces it as an ordinary op
        mask = torch.ones_like(scores[0, 0], dtype=torch.bool).triu(1)  # (T, S), True above the diagonal
        scores = scores.masked_fill(mask, float("-inf"))
    if impl == AttnImpl.FUSED_SOFTMAX:
        probs = F.softmax(scores, dim=-1)  # the fused kernel's fp32 lives in registers: one pass in the dtype
    else:
        probs = F.softmax(scores.float(), dim=-1).to(q.dtype)  # fp32 softmax, materialized
    probs = F.dropout(probs, p=dropout, training=dropout > 0.0)
    return torch.matmul(probs, v)  # (B, nh, T, hd)


class Attention(nn.Module):
    """Multi-head (or grouped-query, when `num_kv_heads < num_heads`) attention.

    Self-attention by default; pass `context` to attend to another sequence (T5's cross-attention).
    A `rotary` module, when given, rotates q and k (RoPE, Su et al. 2021) before the core.
    """

    def __init__(
        self,
        *,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool,
        causal: bool,
        impl: AttnImpl,
        dropout: float = 0.0,
        scale: float | None = None,
        rotary: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_dim = head_dim or hidden // num_heads
        if num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        # Query heads per key/value head (GQA, Ainslie et al. 2023); unchanged when tp shards both evenly.
        self.kv_groups = num_heads // self.num_kv_heads
        self.causal = causal
        self.impl = AttnImpl(impl)
        self.dropout = dropout
        self.scale = self.head_dim**-0.5 if scale is None else scale  # Vaswani et al. 2017 eq. 1
        self.q_proj = nn.Linear(hidden, num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden, bias=bias)
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.size()
        source = x if context is None else context
        S = source.size(1)
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(source).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        v = self.v_proj(source).view(B, S, -1, self.head_dim).transpose(1, 2)  # (B, nkv, S, hd)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        if self.kv_groups > 1:
            # Each kv head serves `kv_groups` consecutive query heads. Expanded explicitly (not SDPA's
            # enable_gqa) so FLOP counting and every backend see ordinary multi-head shapes.
            k = k.repeat_interleave(self.kv_groups, dim=1)  # (B, nh, S, hd)
            v = v.repeat_interleave(self.kv_groups, dim=1)
        y = attention_core(
            q, k, v,
            impl=self.impl,
            causal=self.causal,
            scale=self.scale,
            dropout=self.dropout if self.training else 0.0,
            bias=bias,
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hd)
        return self.o_proj(y)
