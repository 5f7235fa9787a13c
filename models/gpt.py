"""GPT-2 / GPT-3 decoder (Radford et al. 2019; Brown et al. 2020, Table 2.1).

Learned absolute positions, pre-LayerNorm blocks, multi-head causal attention, GELU MLP of 4 x hidden,
biases everywhere, LM head tied to the token embedding. `kv_heads` below `heads` gives grouped-query attention
(Megatron-Core's `num_query_groups`, as GPT-style models such as Nemotron-4 and Falcon train with).

Parameter count (tied, with biases), per Narayanan et al. SC'21 eq. (2) plus biases and norms:
    P = V*h + s*h + L*(12*h^2 + 13*h) + 2*h        (h = hidden, s = seq, V = vocab, L = layers, ffn = 4h)
gpt3-175b with V = 51200 (Megatron-LM's padded vocabulary) and s = 2048 gives 174.6e9. With g = kv_heads of
a = heads, the k and v projections are h x (g/a) h each: attention holds 2 h^2 (1 + g/a) instead of 4 h^2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.attention import Attention, AttnImpl
from models.family import Family
from models.feedforward import MLP, Activation
from models.initialization import construct, init_normal_
from models.megatron_kernels import dropout_add
from models.synthetic import next_token_loss, token_ids
from models.validation import (
    coerce_enum,
    require_divisible,
    require_positive,
    require_positive_number,
    require_probability,
)


@dataclass(kw_only=True, frozen=True)
class GPTConfig:
    """A GPT model. Defaults are GPT-2 small (124M)."""

    vocab: int = 50257
    """Vocabulary size (GPT-2 BPE: 50257; Megatron-LM pads it to 51200 for GPT-3 runs)."""
    hidden: int = 768
    """Model width d_model."""
    layers: int = 12
    """Number of transformer blocks."""
    heads: int = 12
    """Attention heads; hidden must be divisible by heads."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means `heads` (multi-head). heads must be divisible by it."""
    seq: int = 1024
    """Context length; also the size of the learned position table."""
    ffn_hidden: int | None = None
    """MLP width; None means 4 * hidden."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches."""
    attn_impl: AttnImpl = AttnImpl.SDPA
    """Attention core: "sdpa" (fused) or "math" (explicit ops, Megatron-LM style)."""
    fused_dropout_add: bool = False
    """Each residual branch's dropout and add as Megatron-LM's one fused kernel (`models.megatron_kernels`)
    instead of two ops."""
    bias: bool = True
    """Biases in linears and LayerNorms (GPT-2/3 have them)."""
    tie_embeddings: bool = True
    """Share the LM head weight with the token embedding."""
    norm_eps: float = 1e-5
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        require_positive(self, "vocab", "hidden", "layers", "heads", "seq")
        if self.ffn_hidden is not None:
            require_positive(self, "ffn_hidden")
        require_divisible(self, "hidden", "heads")
        if self.kv_heads is not None:
            require_positive(self, "kv_heads")
            require_divisible(self, "heads", "kv_heads")
        require_positive_number(self, "norm_eps")
        require_probability(self, "dropout")
        coerce_enum(self, "attn_impl", AttnImpl)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden


class GPTBlock(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = config
        self.attn_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps, bias=c.bias)
        self.attn = Attention(
            hidden=c.hidden, num_heads=c.heads, num_kv_heads=c.kv_heads, bias=c.bias, causal=True,
            impl=c.attn_impl, dropout=c.dropout,
        )
        self.mlp_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps, bias=c.bias)
        self.mlp = MLP(c.hidden, c.ffn, activation=Activation.GELU_TANH, bias=c.bias)
        self.dropout = nn.Dropout(c.dropout)
        self.fused_dropout_add = c.fused_dropout_add

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._residual(self.attn(self.attn_norm(x)), x)  # (B, T, h)
        return self._residual(self.mlp(self.mlp_norm(x)), x)

    def _residual(self, branch: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.fused_dropout_add:
            return _dropout_add(branch, x, self.dropout.p if self.training else 0.0)[0]  # (sum, keep mask)
        return x + self.dropout(branch)


def _dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    return dropout_add(x, residual, p)


# A leaf of torch.fx tracing: one call_function node (the custom op itself is not fx-traceable).
torch.fx.wrap("_dropout_add")


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab).

    A pipeline stage may set `tok_embed` (first stage's input layer) or `lm_head` (last stage's output) to
    None and keep a subset of `blocks`; the forward then takes / returns hidden states (B, T, h).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c = self.config = config
        self.tok_embed: nn.Embedding | None = nn.Embedding(c.vocab, c.hidden)
        self.pos_embed: nn.Embedding | None = nn.Embedding(c.seq, c.hidden)
        self.embed_dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(GPTBlock(c) for _ in range(c.layers))
        self.norm: nn.LayerNorm | None = nn.LayerNorm(c.hidden, eps=c.norm_eps, bias=c.bias)
        self.lm_head: nn.Linear | None = nn.Linear(c.hidden, c.vocab, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the LM head with the token embedding (again after `to_empty`, which unties them)."""
        if self.config.tie_embeddings and self.lm_head is not None and self.tok_embed is not None:
            self.lm_head.weight = self.tok_embed.weight

    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)) (Radford et al. 2019 §2.3)."""
        self.tie_weights()
        init_normal_(self, std=0.02, residual_std=0.02 / (2 * self.config.layers) ** 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        if self.tok_embed is not None and self.pos_embed is not None:
            positions = torch.arange(ids.size(1), device=ids.device)  # (T,)
            x = self.embed_dropout(self.tok_embed(ids) + self.pos_embed(positions))  # (B, T, h)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None and self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # (B, T, vocab)
        return x


def num_params(c: GPTConfig) -> int:
    """Closed form of the built model's unique parameters."""
    h, f = c.hidden, c.ffn
    kv = h // c.heads * (c.kv_heads or c.heads)
    norm = 2 * h if c.bias else h
    attention = 2 * h * h + 2 * h * kv + (2 * h + 2 * kv if c.bias else 0)
    mlp = 2 * h * f + (f + h if c.bias else 0)
    head = 0 if c.tie_embeddings else c.vocab * h
    return c.vocab * h + c.seq * h + c.layers * (attention + mlp + 2 * norm) + norm + head


def build(config: GPTConfig, device: torch.device | str = "meta") -> GPT:
    return construct(lambda: GPT(config), device)


def example_inputs(
    config: GPTConfig, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    seq = config.seq if seq is None else seq
    if seq > config.seq:
        raise ValueError(f"seq={seq} exceeds the model's position table ({config.seq}); rebuild with seq={seq}")
    return (token_ids(batch, seq, config.vocab, device),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return next_token_loss(output, inputs[0])


FAMILY = Family(
    name="gpt",
    description="GPT-2/GPT-3 decoder: learned positions, MHA (or GQA), GELU MLP, LayerNorm, tied embeddings",
    config_type=GPTConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: c.seq,
    seq_field="seq",
)
