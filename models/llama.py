"""Llama 2 / Llama 3 decoder (Touvron et al. 2023; Dubey et al. 2024 "The Llama 3 Herd of Models", Table 3).

Pre-RMSNorm blocks, rotary positions, grouped-query attention, SwiGLU MLP, no biases, untied LM head.

Parameter count (no biases):
    P = V*h*(1 + untied) + h + L*(2*h*h + 2*h*kv*d + 3*h*f + 2*h)
(h = hidden, d = head_dim = h/heads, kv = kv_heads, f = ffn_hidden). llama3-8b: 8,030,261,248.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from models.attention import Attention, AttnImpl
from models.family import Family
from models.feedforward import SwiGLU
from models.initialization import construct, init_normal_
from models.rope import RotaryEmbedding
from models.synthetic import next_token_loss, token_ids
from models.validation import (
    coerce_enum,
    require_divisible,
    require_positive,
    require_positive_number,
    require_probability,
)


@dataclass(kw_only=True, frozen=True)
class LlamaConfig:
    """A Llama model. Defaults are Llama 3 8B."""

    vocab: int = 128256
    """Vocabulary size (Llama 2: 32000, Llama 3: 128256)."""
    hidden: int = 4096
    """Model width."""
    layers: int = 32
    """Number of transformer blocks."""
    heads: int = 32
    """Query heads; hidden must be divisible by heads."""
    kv_heads: int = 8
    """Key/value heads (grouped-query attention); heads must be divisible by kv_heads."""
    ffn_hidden: int = 14336
    """SwiGLU width (Llama rounds 8h/3 * multiplier up to a multiple; given here as published)."""
    seq: int = 8192
    """Context length used for training / planning (and the RoPE table size)."""
    rope_theta: float = 500000.0
    """RoPE base (Llama 2: 1e4, Llama 3: 5e5)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (Llama trains without)."""
    attn_impl: AttnImpl = AttnImpl.SDPA
    """Attention core: "sdpa" (fused) or "math" (explicit ops, Megatron-LM style)."""
    tie_embeddings: bool = False
    """Share the LM head weight with the token embedding (Llama does not)."""

    def __post_init__(self) -> None:
        require_positive(self, "vocab", "hidden", "layers", "heads", "kv_heads", "ffn_hidden", "seq")
        require_divisible(self, "hidden", "heads")
        require_divisible(self, "heads", "kv_heads")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"{type(self).__name__}: RoPE needs an even head_dim, got hidden/heads="
                             f"{self.hidden}/{self.heads}={self.hidden // self.heads}")
        if self.rope_theta <= 1.0:
            raise ValueError(f"{type(self).__name__}.rope_theta must be > 1, got {self.rope_theta!r}")
        require_positive_number(self, "norm_eps")
        require_probability(self, "dropout")
        coerce_enum(self, "attn_impl", AttnImpl)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)); `mlp` is SwiGLU, or routed experts in the MoE family."""

    def __init__(self, config: LlamaConfig, mlp: nn.Module) -> None:
        super().__init__()
        c = config
        self.attn_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.attn = Attention(
            hidden=c.hidden,
            num_heads=c.heads,
            num_kv_heads=c.kv_heads,
            bias=False,
            causal=True,
            impl=c.attn_impl,
            dropout=c.dropout,
            rotary=RotaryEmbedding(c.head_dim, c.seq, c.rope_theta),
        )
        self.mlp_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.mlp = mlp
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))  # (B, T, h)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def dense_mlp(config: LlamaConfig) -> nn.Module:
    return SwiGLU(config.hidden, config.ffn_hidden)


class Llama(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab).

    `make_mlp(config)` builds each block's feed-forward (the MoE family passes routed experts).
    A pipeline stage may set `tok_embed` or `lm_head` to None and keep a subset of `blocks`; the forward then
    takes / returns hidden states (B, T, h).
    """

    def __init__(self, config: LlamaConfig, *, make_mlp: Callable[[LlamaConfig], nn.Module] = dense_mlp) -> None:
        super().__init__()
        c = self.config = config
        self.tok_embed: nn.Embedding | None = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(LlamaBlock(c, make_mlp(c)) for _ in range(c.layers))
        self.norm: nn.RMSNorm | None = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.lm_head: nn.Linear | None = nn.Linear(c.hidden, c.vocab, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head with the token embedding when configured (again after `to_empty`)."""
        if self.config.tie_embeddings and self.lm_head is not None and self.tok_embed is not None:
            self.lm_head.weight = self.tok_embed.weight

    def init_weights(self) -> None:
        """N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), unit norms, fresh RoPE tables."""
        self.tie_weights()
        init_normal_(self, std=0.02, residual_std=0.02 / (2 * self.config.layers) ** 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embed(ids) if self.tok_embed is not None else ids  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None and self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # (B, T, vocab)
        return x


def attention_params(c: LlamaConfig) -> int:
    """q and o: h x (heads*d); k and v: h x (kv_heads*d); no biases."""
    return 2 * c.hidden * c.heads * c.head_dim + 2 * c.hidden * c.kv_heads * c.head_dim


def embedding_params(c: LlamaConfig) -> int:
    """Token embedding, final norm and (when untied) the LM head."""
    return c.vocab * c.hidden * (1 if c.tie_embeddings else 2) + c.hidden


def num_params(c: LlamaConfig) -> int:
    """Closed form of the built model's unique parameters."""
    per_layer = attention_params(c) + 3 * c.hidden * c.ffn_hidden + 2 * c.hidden
    return embedding_params(c) + c.layers * per_layer


def build(config: LlamaConfig, device: torch.device | str = "meta") -> Llama:
    return construct(lambda: Llama(config), device)


def example_inputs(
    config: LlamaConfig, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    seq = config.seq if seq is None else seq
    if seq > config.seq:
        raise ValueError(f"seq={seq} exceeds the model's RoPE table ({config.seq}); rebuild with seq={seq}")
    return (token_ids(batch, seq, config.vocab, device),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return next_token_loss(output, inputs[0])


FAMILY = Family(
    name="llama",
    description="Llama decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head",
    config_type=LlamaConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: c.seq,
    seq_field="seq",
)
