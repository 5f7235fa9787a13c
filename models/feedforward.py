"""Position-wise feed-forward blocks: the classic two-layer MLP and SwiGLU. Projections are named
`up_proj` / `down_proj` (+ `gate_proj` for SwiGLU) so tensor-parallel styles can be assigned by name."""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F
from torch import nn


class Activation(enum.StrEnum):
    """Nonlinearity of a two-layer MLP."""

    GELU = "gelu"            # exact GELU (Hendrycks & Gimpel 2016): BERT, ViT
    GELU_TANH = "gelu_tanh"  # tanh approximation, as in GPT-2 / GPT-3
    RELU = "relu"            # T5 v1.0 (Raffel et al. 2020)


class MLP(nn.Module):
    """down_proj(act(up_proj(x))), Vaswani et al. 2017 eq. 2."""

    def __init__(self, hidden: int, ffn_hidden: int, *, activation: Activation, bias: bool) -> None:
        super().__init__()
        self.activation = Activation(activation)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)  # (B, T, ffn)
        if self.activation == Activation.RELU:
            h = F.relu(h)
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == Activation.GELU_TANH else "none")
        return self.down_proj(h)  # (B, T, hidden)


class SwiGLU(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), Shazeer 2020 "GLU Variants Improve Transformer" eq. 6."""

    def __init__(self, hidden: int, ffn_hidden: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.up_proj = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.down_proj = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, hidden)


class Experts(nn.Module):
    """`num_experts` SwiGLU MLPs applied as batched matmuls to per-expert token buffers.

    Weights are (num_experts, ...) parameters named like the dense SwiGLU's projections, so expert
    parallelism shards dim 0 and tensor parallelism the ffn dim. x: (E, N, hidden) -> (E, N, hidden).
    """

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.init_weights(std=0.02, residual_std=0.02)  # usable when built directly (a no-op on meta)

    @torch.no_grad()
    def init_weights(self, *, std: float, residual_std: float) -> None:
        nn.init.normal_(self.gate_proj, mean=0.0, std=std)
        nn.init.normal_(self.up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=residual_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(torch.bmm(x, self.gate_proj)) * torch.bmm(x, self.up_proj)  # (E, N, ffn)
        return torch.bmm(h, self.down_proj)  # (E, N, hidden)
