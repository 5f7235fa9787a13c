"""`stratagem::windowed_attention`: causal attention over the last `window` keys, optionally with attention sinks,
as one traced op.

Sliding-window layers (Gemma 3, GPT-OSS, Mistral) attend each query to the `window` keys up to and including its
own position. transformers expresses the window as a (B, 1, S, S) boolean mask passed to SDPA or to eager attention:
a trace then sees a full S x S attention (and a mask as large as the scores), never the window. This op keeps the
window in the graph: `ir` classifies it as attention with ("window", w) and prices its FLOPs over the band
(`ir.node_metrics.attention_measurement`), with FlashAttention's saved tensors.

Contract the IR reads (by op name and argument order): windowed_attention(query (B, Hq, S, D), key (B, Hkv, S, D),
value (B, Hkv, S, Dv), window, scale, sinks (Hq,) or None) -> (B, Hq, S, Dv); Hkv divides Hq (grouped-query
attention repeats each KV head over Hq / Hkv query heads). Sinks (GPT-OSS) are one extra logit per head in the
softmax whose probability is dropped, as transformers' GPT-OSS eager attention computes them.

It runs as explicit masked attention (`reference`): exact, and fine for the small models the runtime checks on
CPU; its backward recomputes the forward under autograd.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def band_mask(q_length: int, kv_length: int, window: int, device: torch.device) -> torch.Tensor:
    """(S_q, S_kv) bool: key j is visible to query i when i - window < j <= i (queries are the last S_q
    positions)."""
    q = torch.arange(kv_length - q_length, kv_length, device=device).unsqueeze(1)
    k = torch.arange(kv_length, device=device).unsqueeze(0)
    return (k <= q) & (k > q - window)


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, scale: float,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """Explicit masked attention with the op's semantics (module docstring)."""
    groups = query.size(-3) // key.size(-3)
    key = key.repeat_interleave(groups, dim=-3)  # (B, Hq, S, D)
    value = value.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # (B, Hq, S, S)
    visible = band_mask(query.size(-2), key.size(-2), window, query.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), value)
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = F.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs, value)


@torch.library.custom_op("stratagem::windowed_attention", mutates_args=())
def windowed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, scale: float,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    return reference(query, key, value, window, scale, sinks)


@windowed_attention.register_fake
def _fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: int, scale: float,
          sinks: torch.Tensor | None = None) -> torch.Tensor:
    return query.new_empty((*query.shape[:-1], value.size(-1)))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    query, key, value, window, scale, sinks = inputs
    ctx.window, ctx.scale, ctx.has_sinks = window, scale, sinks is not None
    ctx.save_for_backward(query, key, value, *((sinks,) if sinks is not None else ()))


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    saved = [t.detach().requires_grad_() for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = reference(*saved[:3], ctx.window, ctx.scale, saved[3] if ctx.has_sinks else None)
        grads = torch.autograd.grad(out, saved, grad)
    return (*grads[:3], None, None, grads[3] if ctx.has_sinks else None)


windowed_attention.register_autograd(_backward, setup_context=_setup_context)
