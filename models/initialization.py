"""Construction on a device and weight initialization shared by the zoo's models."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TypeVar

import torch
from torch import nn

from models.feedforward import Experts
from models.rope import RotaryEmbedding

M = TypeVar("M", bound=nn.Module)

RESIDUAL_PROJECTIONS: tuple[str, ...] = ("o_proj", "down_proj")
"""Linears that write into the residual stream; GPT-2 (Radford et al. 2019 §2.3) scales their init by
1/sqrt(number of residual layers) so the stream's variance does not grow with depth."""


def construct(factory: Callable[[], M], device: torch.device | str) -> M:
    """Build `factory()` on the meta device (allocating nothing), then, for a real device, allocate storage
    there and run the model's `init_weights()`. Going through meta always means a model built directly on a
    device and one materialized later with `to_empty()` + `init_weights()` get the same weights for a seed."""
    with torch.device("meta"):
        model = factory()
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights()
    return model


@torch.no_grad()
def init_normal_(
    model: nn.Module,
    *,
    std: float,
    residual_std: float,
    residual_names: Collection[str] = RESIDUAL_PROJECTIONS,
) -> None:
    """Normal(0, std) for linears, embeddings and experts, zero biases, unit norms, recomputed RoPE tables;
    `residual_std` for linears whose attribute name is in `residual_names` and for experts' down_proj."""
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=residual_std if leaf in residual_names else std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.BatchNorm2d)):
            module.reset_parameters()
        elif isinstance(module, RotaryEmbedding):
            module.reset_buffers()
        elif isinstance(module, Experts):
            module.init_weights(std=std, residual_std=residual_std)
