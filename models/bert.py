"""BERT encoder with its masked-LM head (Devlin et al. 2019; bert-base 110M, bert-large 340M in the paper).

Post-LayerNorm blocks (x = LN(x + f(x))), bidirectional multi-head attention, exact-GELU MLP of 4 x hidden,
learned positions and token types, and the MLM head (dense + GELU + LN, decoder tied to the word embedding,
with its own bias). The NSP pooler is left out: the synthetic objective does not use it, and an unused
parameter would break data-parallel gradient reduction.

Parameters: V*h + P*h + 2*h (types) + 2*h (emb LN) + L*(4h^2 + 4h + 8h^2 + 5h + 4h) + (h^2 + h + 2h + V)
bert-base-uncased: 109,514,298 (= Hugging Face BertForMaskedLM.num_parameters()).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import Attention, AttnImpl
from models.family import Family
from models.feedforward import MLP, Activation
from models.initialization import construct, init_normal_
from models.synthetic import token_ids
from models.validation import (
    coerce_enum,
    require_divisible,
    require_positive,
    require_positive_number,
    require_probability,
)

MLM_STRIDE = 7
"""The synthetic MLM loss scores every 7th position (~14%, close to BERT's 15% masking rate)."""


@dataclass(kw_only=True, frozen=True)
class BertConfig:
    """A BERT masked-LM. Defaults are bert-base-uncased."""

    vocab: int = 30522
    """WordPiece vocabulary size."""
    hidden: int = 768
    """Model width."""
    layers: int = 12
    """Number of transformer blocks."""
    heads: int = 12
    """Attention heads; hidden must be divisible by heads."""
    ffn_hidden: int | None = None
    """MLP width; None means 4 * hidden."""
    seq: int = 512
    """Sequence length of the examples (at most max_positions)."""
    max_positions: int = 512
    """Size of the learned position table."""
    type_vocab: int = 2
    """Token-type (segment) embeddings."""
    dropout: float = 0.0
    """Dropout on embeddings, attention probabilities and residual branches (BERT used 0.1)."""
    attn_impl: AttnImpl = AttnImpl.SDPA
    """Attention core: "sdpa" (fused) or "math" (explicit ops)."""
    norm_eps: float = 1e-12
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        require_positive(self, "vocab", "hidden", "layers", "heads", "seq", "max_positions", "type_vocab")
        if self.ffn_hidden is not None:
            require_positive(self, "ffn_hidden")
        require_divisible(self, "hidden", "heads")
        if self.seq > self.max_positions:
            raise ValueError(f"BertConfig.seq={self.seq} exceeds max_positions={self.max_positions}")
        require_positive_number(self, "norm_eps")
        require_probability(self, "dropout")
        coerce_enum(self, "attn_impl", AttnImpl)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden


class BertBlock(nn.Module):
    """x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = config
        self.attn = Attention(
            hidden=c.hidden, num_heads=c.heads, bias=True, causal=False, impl=c.attn_impl, dropout=c.dropout
        )
        self.attn_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.mlp = MLP(c.hidden, c.ffn, activation=Activation.GELU, bias=True)
        self.mlp_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x)))  # (B, T, h)
        return self.mlp_norm(x + self.dropout(self.mlp(x)))


class Bert(nn.Module):
    """(token ids (B, T), token types (B, T)) -> MLM logits (B, T, vocab)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = self.config = config
        self.tok_embed = nn.Embedding(c.vocab, c.hidden)
        self.pos_embed = nn.Embedding(c.max_positions, c.hidden)
        self.type_embed = nn.Embedding(c.type_vocab, c.hidden)
        self.embed_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.embed_dropout = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(BertBlock(c) for _ in range(c.layers))
        self.head_dense = nn.Linear(c.hidden, c.hidden)
        self.head_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The MLM decoder shares the word embedding (again after `to_empty`, which unties them)."""
        self.lm_head.weight = self.tok_embed.weight

    def init_weights(self) -> None:
        """N(0, 0.02) weights, zero biases, unit LayerNorms (Devlin et al. 2019, initializer_range 0.02)."""
        self.tie_weights()
        init_normal_(self, std=0.02, residual_std=0.02)

    def forward(self, ids: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)  # (T,)
        x = self.tok_embed(ids) + self.pos_embed(positions) + self.type_embed(token_types)  # (B, T, h)
        x = self.embed_dropout(self.embed_norm(x))
        for block in self.blocks:
            x = block(x)
        x = self.head_norm(F.gelu(self.head_dense(x)))
        return self.lm_head(x)  # (B, T, vocab)


def num_params(c: BertConfig) -> int:
    """Closed form of the built model's unique parameters."""
    h, f = c.hidden, c.ffn
    embeddings = (c.vocab + c.max_positions + c.type_vocab) * h + 2 * h
    block = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 2 * (2 * h)
    head = h * h + h + 2 * h + c.vocab  # dense, LN, decoder bias (decoder weight is tied)
    return embeddings + c.layers * block + head


def build(config: BertConfig, device: torch.device | str = "meta") -> Bert:
    return construct(lambda: Bert(config), device)


def example_inputs(
    config: BertConfig, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Token ids and token types (first half segment 0, second half segment 1, as in a sentence pair)."""
    seq = config.seq if seq is None else seq
    if seq > config.max_positions:
        raise ValueError(f"seq={seq} exceeds max_positions={config.max_positions}")
    ids = token_ids(batch, seq, config.vocab, device)
    types = (torch.arange(seq, device=device) >= seq // 2).long().expand(batch, seq)
    return ids, types


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MLM-style cross entropy at every MLM_STRIDE-th position, target = the token at that position.

    The synthetic inputs are not corrupted with [MASK], so this trains reconstruction rather than BERT's
    denoising objective; its cost (a vocab-sized softmax over ~15% of positions) is the MLM head's.
    """
    ids = inputs[0]
    logits = output[:, ::MLM_STRIDE]  # (B, ceil(T/7), V)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), ids[:, ::MLM_STRIDE].reshape(-1))


FAMILY = Family(
    name="bert",
    description="BERT encoder with MLM head: post-LN, bidirectional MHA, GELU MLP, learned positions",
    config_type=BertConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: c.seq,
    seq_field="seq",
)
