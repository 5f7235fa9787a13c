"""T5 encoder-decoder (Raffel et al. 2020, "Exploring the Limits of Transfer Learning", v1.0 checkpoints).

Pre-RMSNorm blocks without biases, ReLU MLP, relative position buckets (one learned scalar per bucket and head,
shared by all layers of a stack), unscaled attention scores (the 1/sqrt(d) is folded into the init), one
embedding shared by encoder input, decoder input and the LM head (logits scaled by hidden^-0.5).
The graph is not a simple chain: every decoder block's cross-attention reads the encoder's output.

Parameters: V*h + 2*E + L_enc*(4*h*i + 2*h*f + 2h) + h + L_dec*(8*h*i + 2*h*f + 3h) + h,
i = heads * head_dim, E = buckets * heads. t5-small: 60,506,624; t5-base: 222,903,552 (Hugging Face
T5ForConditionalGeneration.num_parameters(); the paper rounds them to 60M and 220M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import Attention, AttnImpl
from models.family import Family
from models.feedforward import MLP, Activation
from models.initialization import construct, init_normal_
from models.synthetic import token_ids
from models.validation import coerce_enum, require_positive, require_positive_number, require_probability


@dataclass(kw_only=True, frozen=True)
class T5Config:
    """A T5 model. Defaults are t5-base."""

    vocab: int = 32128
    """SentencePiece vocabulary (32000, padded to 32128)."""
    hidden: int = 768
    """d_model."""
    heads: int = 12
    """Attention heads."""
    head_dim: int = 64
    """d_kv: per-head width (heads * head_dim need not equal hidden)."""
    ffn_hidden: int = 3072
    """d_ff."""
    layers: int = 12
    """Encoder blocks."""
    decoder_layers: int | None = None
    """Decoder blocks; None means the same as layers."""
    seq: int = 512
    """Encoder (input) length."""
    decoder_seq: int = 128
    """Decoder (target) length (T5 pre-training used 512 inputs and 114 targets)."""
    buckets: int = 32
    """Relative-position buckets."""
    max_distance: int = 128
    """Distance beyond which positions share the last bucket."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches (T5 used 0.1)."""
    attn_impl: AttnImpl = AttnImpl.SDPA
    """Attention core: "sdpa" (fused) or "math" (explicit ops)."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        require_positive(
            self, "vocab", "hidden", "heads", "head_dim", "ffn_hidden", "layers", "seq", "decoder_seq",
            "buckets", "max_distance",
        )
        if self.decoder_layers is not None:
            require_positive(self, "decoder_layers")
        if self.buckets < 4:
            raise ValueError(f"T5Config.buckets must be >= 4 (half per direction, half exact), got {self.buckets}")
        require_positive_number(self, "norm_eps")
        require_probability(self, "dropout")
        coerce_enum(self, "attn_impl", AttnImpl)

    @property
    def num_decoder_layers(self) -> int:
        return self.layers if self.decoder_layers is None else self.decoder_layers


def relative_position_bucket(
    relative: torch.Tensor, *, bidirectional: bool, buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket of key_pos - query_pos (Raffel et al. 2020 §2.1; the Mesh TensorFlow function): half the buckets
    are exact small distances, the rest logarithmically spaced up to max_distance; bidirectional attention
    spends half the buckets on each direction, causal attention only looks back."""
    bucket = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        bucket = bucket + (relative > 0).long() * buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)
    exact = buckets // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (buckets - exact)).long()).clamp(max=buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """Additive attention bias (1, heads, T, S) from a learned scalar per (bucket, head)."""

    def __init__(self, config: T5Config, *, bidirectional: bool) -> None:
        super().__init__()
        self.bidirectional = bidirectional
        self.buckets = config.buckets
        self.max_distance = config.max_distance
        self.table = nn.Embedding(config.buckets, config.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, h), only its length and device are used
        positions = torch.arange(x.size(1), device=x.device)  # (T,)
        relative = positions[None, :] - positions[:, None]  # (T, T): key - query
        bucket = relative_position_bucket(
            relative, bidirectional=self.bidirectional, buckets=self.buckets, max_distance=self.max_distance
        )
        bias = self.table(bucket).permute(2, 0, 1).unsqueeze(0)  # (1, heads, T, T)
        if not self.bidirectional:
            causal = torch.ones_like(relative, dtype=torch.bool).triu(1)  # (T, T), future keys
            bias = bias.masked_fill(causal, float("-inf"))
        return bias


def _attention(c: T5Config) -> Attention:
    # The bias carries position and causality, so the core is never told causal=True; scale 1 (see docstring).
    return Attention(
        hidden=c.hidden, num_heads=c.heads, head_dim=c.head_dim, bias=False, causal=False,
        impl=c.attn_impl, dropout=c.dropout, scale=1.0,
    )


class T5EncoderBlock(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        c = config
        self.attn_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.attn = _attention(c)
        self.mlp_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.mlp = MLP(c.hidden, c.ffn_hidden, activation=Activation.RELU, bias=False)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), bias=position_bias))  # (B, T, h)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class T5DecoderBlock(nn.Module):
    def __init__(self, config: T5Config) -> None:
        super().__init__()
        c = config
        self.attn_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.attn = _attention(c)
        self.cross_attn_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.cross_attn = _attention(c)
        self.mlp_norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.mlp = MLP(c.hidden, c.ffn_hidden, activation=Activation.RELU, bias=False)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor, encoded: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), bias=position_bias))  # (B, Td, h)
        x = x + self.dropout(self.cross_attn(self.cross_attn_norm(x), context=encoded))  # attends (B, T, h)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class T5Stack(nn.Module):
    """Encoder or decoder: blocks in `blocks`, one relative-position table for the stack, final RMSNorm."""

    def __init__(self, config: T5Config, *, decoder: bool) -> None:
        super().__init__()
        c = config
        self.position_bias = RelativePositionBias(c, bidirectional=not decoder)
        block = T5DecoderBlock if decoder else T5EncoderBlock
        num_blocks = c.num_decoder_layers if decoder else c.layers
        self.blocks = nn.ModuleList(block(c) for _ in range(num_blocks))
        self.norm = nn.RMSNorm(c.hidden, eps=c.norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, encoded: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.position_bias(x)  # (1, heads, T, T)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, bias) if encoded is None else block(x, bias, encoded)
        return self.dropout(self.norm(x))


class T5(nn.Module):
    """(input ids (B, T), decoder input ids (B, Td)) -> logits (B, Td, vocab)."""

    def __init__(self, config: T5Config) -> None:
        super().__init__()
        c = self.config = config
        self.tok_embed = nn.Embedding(c.vocab, c.hidden)
        self.encoder = T5Stack(c, decoder=False)
        self.decoder = T5Stack(c, decoder=True)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """One embedding for encoder, decoder and LM head (again after `to_empty`, which unties them)."""
        self.lm_head.weight = self.tok_embed.weight

    def init_weights(self) -> None:
        """N(0, 0.02) everywhere, unit norms (a uniform simplification of T5's per-matrix scaled init)."""
        self.tie_weights()
        init_normal_(self, std=0.02, residual_std=0.02)

    def forward(self, ids: torch.Tensor, decoder_ids: torch.Tensor) -> torch.Tensor:
        encoded = self.encoder(self.tok_embed(ids))  # (B, T, h)
        x = self.decoder(self.tok_embed(decoder_ids), encoded)  # (B, Td, h)
        return self.lm_head(x * self.config.hidden**-0.5)  # (B, Td, vocab), tied-head rescaling


def num_params(c: T5Config) -> int:
    """Closed form of the built model's unique parameters."""
    h, inner, f = c.hidden, c.heads * c.head_dim, c.ffn_hidden
    attention = 4 * h * inner
    mlp = 2 * h * f
    encoder = c.layers * (attention + mlp + 2 * h) + h
    decoder = c.num_decoder_layers * (2 * attention + mlp + 3 * h) + h
    return c.vocab * h + 2 * c.buckets * c.heads + encoder + decoder


def build(config: T5Config, device: torch.device | str = "meta") -> T5:
    return construct(lambda: T5(config), device)


def example_inputs(
    config: T5Config, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Encoder ids (B, seq) and decoder ids (B, decoder_seq)."""
    seq = config.seq if seq is None else seq
    return (
        token_ids(batch, seq, config.vocab, device, seed=0),
        token_ids(batch, config.decoder_seq, config.vocab, device, seed=1),
    )


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Teacher-forced cross entropy: decoder position t predicts decoder token t+1."""
    decoder_ids = inputs[1]
    vocab = output.size(-1)
    return F.cross_entropy(output[:, :-1].reshape(-1, vocab).float(), decoder_ids[:, 1:].reshape(-1))


FAMILY = Family(
    name="t5",
    description="T5 encoder-decoder: RMSNorm, relative position buckets, ReLU MLP, shared embedding",
    config_type=T5Config,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: c.seq,
    seq_field="seq",
)
