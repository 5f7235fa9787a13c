"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", Table 1).

Non-overlapping patches embedded by a strided convolution, a learned [class] token, learned positions,
pre-LayerNorm encoder blocks with bidirectional attention and an exact-GELU MLP, a linear classifier on the
[class] token. Parameters: 3*p^2*h + h (patch conv) + h (cls) + (N+1)*h + L*(12h^2 + 13h) + 2h + h*K + K.
vit-base (ViT-B/16 at 224): 86,567,656 (timm vit_base_patch16_224; the paper rounds to 86M).
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
from models.synthetic import normal, sign_bit_labels
from models.validation import (
    coerce_enum,
    require_divisible,
    require_positive,
    require_positive_number,
    require_probability,
)


@dataclass(kw_only=True, frozen=True)
class ViTConfig:
    """A ViT classifier. Defaults are ViT-B/16 at 224 x 224."""

    image_size: int = 224
    """Input height and width in pixels."""
    patch: int = 16
    """Patch side in pixels; image_size must be divisible by it."""
    channels: int = 3
    """Input channels."""
    hidden: int = 768
    """Model width."""
    layers: int = 12
    """Number of transformer blocks."""
    heads: int = 12
    """Attention heads; hidden must be divisible by heads."""
    ffn_hidden: int | None = None
    """MLP width; None means 4 * hidden."""
    classes: int = 1000
    """Output classes (ImageNet-1k)."""
    dropout: float = 0.0
    """Dropout on attention probabilities and residual branches."""
    attn_impl: AttnImpl = AttnImpl.SDPA
    """Attention core: "sdpa" (fused) or "math" (explicit ops)."""
    norm_eps: float = 1e-6
    """LayerNorm epsilon."""

    def __post_init__(self) -> None:
        require_positive(self, "image_size", "patch", "channels", "hidden", "layers", "heads", "classes")
        if self.ffn_hidden is not None:
            require_positive(self, "ffn_hidden")
        require_divisible(self, "image_size", "patch")
        require_divisible(self, "hidden", "heads")
        require_positive_number(self, "norm_eps")
        require_probability(self, "dropout")
        coerce_enum(self, "attn_impl", AttnImpl)

    @property
    def ffn(self) -> int:
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.hidden

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def tokens(self) -> int:
        """Sequence length seen by the blocks: patches plus the [class] token."""
        return self.num_patches + 1


class ViTBlock(nn.Module):
    """x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = config
        self.attn_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.attn = Attention(
            hidden=c.hidden, num_heads=c.heads, bias=True, causal=False, impl=c.attn_impl, dropout=c.dropout
        )
        self.mlp_norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.mlp = MLP(c.hidden, c.ffn, activation=Activation.GELU, bias=True)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))  # (B, N+1, h)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class ViT(nn.Module):
    """Images (B, C, H, W) -> class logits (B, classes)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        c = self.config = config
        self.patch_embed = nn.Conv2d(c.channels, c.hidden, kernel_size=c.patch, stride=c.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.hidden))  # init_weights draws the real values
        self.pos_embed = nn.Parameter(torch.zeros(1, c.tokens, c.hidden))
        self.blocks = nn.ModuleList(ViTBlock(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.hidden, eps=c.norm_eps)
        self.head = nn.Linear(c.hidden, c.classes)

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) for linears, positions and the class token (timm's trunc_normal std), default conv."""
        init_normal_(self, std=0.02, residual_std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)
        self.patch_embed.reset_parameters()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, h)
        cls = self.cls_token.expand(x.size(0), -1, -1)  # (B, 1, h)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, N+1, h)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])  # (B, classes)


def num_params(c: ViTConfig) -> int:
    """Closed form of the built model's unique parameters."""
    h, f = c.hidden, c.ffn
    embed = c.channels * c.patch**2 * h + h + h + c.tokens * h
    block = (4 * h * h + 4 * h) + (2 * h * f + f + h) + 2 * (2 * h)
    return embed + c.layers * block + 2 * h + h * c.classes + c.classes


def build(config: ViTConfig, device: torch.device | str = "meta") -> ViT:
    return construct(lambda: ViT(config), device)


def example_inputs(
    config: ViTConfig, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    if seq is not None and seq != config.tokens:
        raise ValueError(f"ViT's sequence length is fixed by image_size and patch ({config.tokens} tokens), "
                         f"got seq={seq}; set image_size or patch instead")
    return (normal((batch, config.channels, config.image_size, config.image_size), device),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross entropy against a per-image synthetic class (see `sign_bit_labels`)."""
    return F.cross_entropy(output.float(), sign_bit_labels(inputs[0], output.size(-1)))


FAMILY = Family(
    name="vit",
    description="Vision Transformer classifier: patch embedding, class token, pre-LN encoder",
    config_type=ViTConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: c.tokens,
    seq_field=None,
)
