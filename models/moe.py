"""Mixture-of-experts decoder: a Llama block whose MLP is top-k routed SwiGLU experts (Mixtral, Jiang et al.
2024 "Mixtral of Experts"; defaults are Mixtral 8x7B, 46.7B parameters).

Routing is GShard's capacity dispatch (Lepikhin et al. 2021 §2.2, Algorithm 1) built from one-hot masks and
einsums, so shapes are static and torch.fx traces it:
- tokens are cut into groups of S tokens (G = B*T/S groups);
- each expert takes at most C = min(S, ceil(k * capacity_factor * S / E)) tokens per group (Switch
  Transformer, Fedus et al. 2022 eq. 3, with k choices per token); first choices claim slots before second
  choices; tokens past capacity are dropped for that choice (their residual passes through);
- dispatch: expert_in[e, g, c] = x[g, s] for the token s holding slot c of expert e; combine: y[g, s] =
  sum_k gate_k * expert_out[e_k, g, c_k], gates the token's renormalized top-k router probabilities. Both are
  gathers by index (`models.expert_dispatch`), as trainers move tokens, not GShard's one-hot einsums.
With a capacity limit, which choices are dropped depends on the whole group, later tokens included (as in
GShard and Switch), so a decoder is strictly causal only when capacity_factor >= experts / top_k (C = S,
nothing dropped).
Expert FLOPs are then E * C * (6 * h * f) per group = k * capacity_factor * S * 6hf (not E x the dense MLP);
dispatch and combine move tokens without FLOPs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import llama
from models.expert_dispatch import CapacityRoute, capacity_route, combine, dispatch
from models.family import Family
from models.feedforward import Experts
from models.initialization import construct
from models.llama import Llama, LlamaConfig
from models.validation import require_positive, require_positive_number

MAX_GROUP_TOKENS = 1024
"""Default routing-group size bound: GShard's dispatch cost grows with S, and 1024 keeps it a few percent."""


@dataclass(kw_only=True, frozen=True)
class MoEConfig(LlamaConfig):
    """A Llama-style decoder with routed experts. Defaults are Mixtral 8x7B."""

    vocab: int = 32000
    """Vocabulary size (Mixtral: 32000)."""
    seq: int = 4096
    """Context length used for planning (Mixtral was published with a 32K context; override with --seq)."""
    rope_theta: float = 1e6
    """RoPE base (Mixtral: 1e6)."""
    experts: int = 8
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Experts each token is sent to."""
    capacity_factor: float = 1.25
    """Expert buffer size relative to an even split of the k*S routed token-choices (Switch Transformer)."""
    group_size: int | None = None
    """Tokens per routing group S (must divide seq); None: gcd(seq, 1024), the largest power of two dividing
    seq, capped at 1024."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "experts", "top_k")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds experts={self.experts}")
        require_positive_number(self, "capacity_factor")
        if self.group_size is not None:
            require_positive(self, "group_size")
            if self.seq % self.group_size:
                raise ValueError(f"MoEConfig.group_size={self.group_size} must divide seq={self.seq}")

    @property
    def tokens_per_group(self) -> int:
        return self.group_size if self.group_size is not None else math.gcd(self.seq, MAX_GROUP_TOKENS)

    @property
    def capacity(self) -> int:
        """Expert slots per group C = min(S, ceil(k * capacity_factor * S / E))."""
        s = self.tokens_per_group
        return min(s, math.ceil(self.top_k * self.capacity_factor * s / self.experts))


class MoEFeedForward(nn.Module):
    """Router + experts with capacity dispatch. x: (B, T, h) -> (B, T, h); B*T must be a multiple of S."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.experts
        self.top_k = config.top_k
        self.group_size = config.tokens_per_group
        self.capacity = config.capacity
        self.router = nn.Linear(config.hidden, config.experts, bias=False)
        self.experts = Experts(config.experts, config.hidden, config.ffn_hidden)

    def routing(self, xg: torch.Tensor) -> tuple[CapacityRoute, torch.Tensor]:
        """The capacity route and the choices' gates (G, S, k) of tokens xg (G, S, h)."""
        probs = F.softmax(self.router(xg).float(), dim=-1)  # (G, S, E)
        top = torch.topk(probs, self.top_k, dim=-1)
        gates = top[0] / top[0].sum(dim=-1, keepdim=True)  # (G, S, k), Mixtral renormalizes over the top k
        return capacity_route(top[1], self.num_experts, self.capacity), gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xg = x.reshape(-1, self.group_size, x.size(-1))  # (G, S, h)
        route, gates = self.routing(xg)
        expert_out = self.experts(dispatch(xg, route, self.num_experts))  # (E, G*C, h)
        return combine(expert_out, route, gates).reshape_as(x)  # (B, T, h)


class MoETransformer(Llama):
    """A Llama whose blocks' `mlp` is a `MoEFeedForward`. Token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__(config, make_mlp=MoEFeedForward)


example_inputs = llama.example_inputs
loss = llama.loss


def num_params(c: MoEConfig) -> int:
    """Closed form: Llama attention and embeddings, plus per layer a router h*E and E SwiGLU experts."""
    per_layer = llama.attention_params(c) + c.hidden * c.experts + c.experts * 3 * c.hidden * c.ffn_hidden
    return llama.embedding_params(c) + c.layers * (per_layer + 2 * c.hidden)


def build(config: MoEConfig, device: torch.device | str = "meta") -> MoETransformer:
    return construct(lambda: MoETransformer(config), device)


FAMILY = Family(
    name="moe",
    description="Mixtral-style decoder: Llama blocks with top-k routed SwiGLU experts (GShard capacity dispatch)",
    config_type=MoEConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: c.seq,
    seq_field="seq",
)
