"""Synthetic inputs and losses for the zoo: deterministic (fixed seeds), shape-only on the meta device.

Every loss is a mean over samples of a per-sample quantity and every label is a function of its own sample,
so splitting a batch across data-parallel ranks or micro-batches does not change what is learned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _is_meta(device: torch.device | str) -> bool:
    return torch.device(device).type == "meta"


def token_ids(batch: int, seq: int, vocab: int, device: torch.device | str, *, seed: int = 0) -> torch.Tensor:
    """Uniform random token ids, (batch, seq) int64."""
    if _is_meta(device):
        return torch.empty(batch, seq, dtype=torch.long, device="meta")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)


def normal(shape: tuple[int, ...], device: torch.device | str, *, seed: int = 0) -> torch.Tensor:
    """Standard normal float32 values (images, dense features)."""
    if _is_meta(device):
        return torch.empty(shape, dtype=torch.float32, device="meta")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(device)


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Causal language-model cross entropy: position t predicts token t+1. logits (B, T, V), ids (B, T)."""
    vocab = logits.size(-1)
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))


def sign_bit_labels(x: torch.Tensor, num_classes: int, *, bits: int = 16) -> torch.Tensor:
    """A class per sample from the signs of its first `bits` values: exact (no float rounding), so a sample
    gets the same label whatever batch it is in. x: (B, ...) -> (B,) int64 in [0, num_classes)."""
    signs = (x.flatten(1)[:, :bits] > 0).long()  # (B, bits)
    weights = 2 ** torch.arange(signs.size(1), device=x.device)  # (bits,)
    return (signs * weights).sum(dim=1) % num_classes
