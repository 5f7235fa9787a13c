"""Rotary position embedding (RoPE, Su et al. 2021 "RoFormer", eq. 34), half-split ("rotate_half") layout.

cos/sin tables are precomputed buffers (not persistent: they are a function of the config) so that the forward
pass is plain elementwise math that torch.fx traces. Each attention layer owns its table so that transformer
blocks stay self-contained (a block takes one tensor and returns one), which keeps pipeline cuts simple.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates pairs (x[i], x[i + d/2]) of each head by angle pos * theta^(-2i/d)."""

    def __init__(self, head_dim: int, max_seq: int, theta: float) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_seq = max_seq
        self.theta = theta
        self.half = head_dim // 2
        self.register_buffer("cos", torch.empty(max_seq, self.half), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq, self.half), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute the tables on the buffers' device; call after `to_empty()` from the meta device."""
        device = self.cos.device
        inv_freq = self.theta ** (-torch.arange(0, self.half, device=device, dtype=torch.float32) / self.half)
        angles = torch.outer(torch.arange(self.max_seq, device=device, dtype=torch.float32), inv_freq)
        self.cos.copy_(angles.cos())  # (max_seq, hd/2)
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, nh, T, hd)
        T = x.size(-2)
        # narrow, not [:T]: under torch.fx, T is a Proxy and only torch functions accept it beside a buffer
        cos = torch.narrow(self.cos, 0, 0, T).to(x.dtype)  # (T, hd/2), broadcast over batch and heads
        sin = torch.narrow(self.sin, 0, 0, T).to(x.dtype)
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # (B, nh, T, hd)
