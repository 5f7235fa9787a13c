"""Two transformers extension points that make Hugging Face models plannable from a shape-only trace.

Both are registered under their own names through transformers' public registries (`AttentionInterface`,
`AttentionMaskInterface`, `ExpertsInterface`) and selected only by models that `models.hf` builds, by setting
`config._attn_implementation` / `config._experts_implementation`; every other model keeps transformers' defaults.

1. `ATTENTION` ("stratagem_sdpa"): PyTorch SDPA, with a mask function that leaves the mask implicit for the
   unpadded, unpacked training batches we build. In eager mode transformers already does this (it passes
   `is_causal=True` and no mask, `masking_utils._ignore_causal_mask_sdpa`), but under torch.export it cannot read
   the position ids to prove the batch is unpacked, so it materializes a (B, 1, S, S) boolean mask. That mask is
   not what training runs; priced as an activation it is live across every layer (16 GiB per sample at a 128K
   context) and it hides causality and grouped-query attention from the trace. A sliding window shorter than the
   sequence (Gemma 3, GPT-OSS, Mistral) comes back as a `SlidingWindowMask` that the attention function runs as
   one `stratagem::windowed_attention` op (`models.windowed_attention`: the trace keeps the window, the IR prices
   the band), as it does GPT-OSS's attention sinks. A padding mask, a cache, or a window the layer does not
   declare (Llama 4's chunks) still get transformers' own `sdpa_mask`.

2. `EXPERTS` ("stratagem_capacity"): mixture-of-experts experts with GShard capacity dispatch (Lepikhin et al.
   2021, Sec. 2.2) instead of transformers' default grouped GEMM. Grouped GEMM has data-dependent group sizes
   (`torch.histc` of the routing) that a shape-only trace cannot price, while capacity dispatch has static shapes
   (tokens gathered into per-expert buffers by index, `models.expert_dispatch`), the same as the zoo's `moe`
   family (`models/moe.py`), so the cost model and expert parallelism see the two alike:
   - tokens are cut into groups of S = gcd(N, 1024) tokens (N tokens in the batch);
   - each expert takes C = min(S, ceil(k * capacity_factor * S / E)) token choices per group, first choices
     before second choices; choices past capacity are dropped (that expert adds nothing for the token);
   - expert FLOPs are E * C * (6 * h * f) per group = k * capacity_factor * S * 6hf, forward.
   With `capacity_factor >= E / k`, C = S and nothing is dropped: the output equals transformers' own experts.

3. DeepSeek Sparse Attention (configs with `index_topk`: DeepSeek-V3.2, GLM-MoE-DSA, HY v4, AXK2, dots3): their
   attention slices the mask for its lightning indexer, so the mask function returns an implicit `CausalMask`
   instead of None; `ATTENTION` runs the attention over the indexer's keys as one `stratagem::sparse_attention`
   op, and `use_sparse_indexers` makes each indexer, in a shape-only trace, one `stratagem::lightning_indexer`
   op on its own projections (`models.sparse_attention` says why and how they are priced). Run on real tensors,
   the indexer is the model's own code, so the runtime computes exactly what transformers does.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.expert_dispatch import capacity_route, combine, dispatch
from models.moe import MAX_GROUP_TOKENS
from models.sparse_attention import lightning_indexer, sparse_attention

ATTENTION = "stratagem_sdpa"
"""`config._attn_implementation` of models built by `models.hf` when the model class supports SDPA."""
ATTENTION_BACKEND = "stratagem_attention"
"""The same functions for models that take custom attention functions but not SDPA (GPT-OSS, whose sinks SDPA
cannot do): transformers checks SDPA support for any name containing "sdpa"."""
EXPERTS = "stratagem_capacity"
"""`config._experts_implementation` of mixture-of-experts models built by `models.hf`."""
EXPERT_BUFFERS_ATTR = "expert_buffers_forward"
"""Instance attribute of an experts module: its experts on (E, tokens, h) buffers, the entry point that expert
parallelism (planner/runtime/apply_ep.py) wraps with all-to-alls; `models.hf` binds `expert_buffers_forward` there."""
CAPACITY_FACTOR_ATTR = "stratagem_capacity_factor"
"""Config attribute holding the capacity factor that `EXPERTS` reads."""
DEFAULT_CAPACITY_FACTOR = 1.25
"""Switch Transformer's training capacity factor (Fedus et al. 2022, Sec. 2.2 and Table 1), as in the zoo's moe."""


def register() -> None:
    """Register `ATTENTION` and `EXPERTS` with transformers (idempotent: same names, same functions)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in (ATTENTION, ATTENTION_BACKEND):
        AttentionInterface.register(name, training_attention)
        AttentionMaskInterface.register(name, training_sdpa_mask)
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # transformers releases before the experts interface: their MoE loops stay as they are
        return
    ExpertsInterface.register(EXPERTS, capacity_experts_forward)


@dataclass(frozen=True)
class SlidingWindowMask:
    """The mask of an unpadded, uncached batch whose layer sees the last `window` keys of each query: kept
    implicit for `training_attention`; `build()` gives transformers' own boolean mask when it is needed."""

    window: int
    build: Callable[[], torch.Tensor | None]


@dataclass(frozen=True)
class CausalMask:
    """The causal mask of an unpadded, uncached batch, left implicit for a model whose attention slices its mask
    (DeepSeek Sparse Attention hands `mask[:, 0]` to its indexer): slicing keeps it implicit, `build()` gives
    transformers' own boolean mask, sliced the same way, when real code needs it."""

    build: Callable[[], torch.Tensor]

    def __getitem__(self, key: Any) -> CausalMask:
        build = self.build
        return CausalMask(lambda: build()[key])


def training_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | SlidingWindowMask | None:
    """No mask (SDPA's own `is_causal`, or no masking for bidirectional layers) when the batch has no padding,
    no cache offset, and no window shorter than the sequence; a `SlidingWindowMask` when a window is the only
    mask; a `CausalMask` in place of no mask for models with a sparse-attention indexer (`index_topk`);
    transformers' `sdpa_mask` otherwise.

    transformers turns off its own skip (`allow_is_causal_skip=False`) under tracing because it cannot rule out
    packed sequences from the position ids; the inputs `models.hf` builds never pass position ids or padding.
    """
    from transformers.masking_utils import sdpa_mask

    def build() -> torch.Tensor | None:
        return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                         local_size=local_size, **kwargs)

    no_offset = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
    if attention_mask is None and no_offset and q_length == kv_length:
        if local_size is None or kv_length <= local_size:
            sparse = isinstance(getattr(kwargs.get("config"), "index_topk", None), int)
            return CausalMask(build) if sparse else None
        # Sliding window, chunks, or a bidirectional window: `training_attention` runs it as a window only when the
        # layer is causal and declares this window, and builds the mask otherwise.
        return SlidingWindowMask(local_size, build)
    return build()


def training_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention call (q, k, v (B, H, S, D)) -> ((B, S, H, D), None): a declared sliding window or
    attention sinks run as `stratagem::windowed_attention`, a sparse indexer's keys (`indices`) as
    `stratagem::sparse_attention`; everything else is transformers' SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from models.windowed_attention import windowed_attention

    indices = kwargs.pop("indices", None)
    if indices is not None:
        if not isinstance(attention_mask, CausalMask | None) or dropout != 0.0:
            raise ValueError(f"{type(module).__name__}: sparse attention runs on unpadded, uncached batches "
                             f"without dropout only")
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        return sparse_attention(query, key, value, indices, scale).transpose(1, 2).contiguous(), None
    if isinstance(attention_mask, CausalMask):
        attention_mask = None
    window = attention_mask.window if isinstance(attention_mask, SlidingWindowMask) else None
    sinks = kwargs.pop("s_aux", None)
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
    implicit = attention_mask is None or (window is not None and kwargs.get("sliding_window") == window)
    if causal and implicit and dropout == 0.0 and kwargs.get("softcap") is None and (window or sinks is not None):
        scale = scaling if scaling is not None else query.size(-1) ** -0.5
        out = windowed_attention(query, key, value, window or key.size(-2), scale, sinks)
        return out.transpose(1, 2).contiguous(), None
    mask = attention_mask.build() if isinstance(attention_mask, SlidingWindowMask) else attention_mask
    if sinks is not None or kwargs.get("softcap") is not None:  # math SDPA does not do: the model's own eager code
        return _eager_attention(module, query, key, value, mask, dropout, scaling, s_aux=sinks, **kwargs)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def _eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any,
                     dropout: float, scaling: float | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The model's own `eager_attention_forward`, with a boolean mask turned into the additive one it expects."""
    import sys

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ValueError(f"{type(module).__name__}: attention with sinks or soft-capping needs the model's eager "
                         f"attention, which its module does not define")
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
    return eager(module, query, key, value, mask, dropout=dropout,
                 scaling=scaling if scaling is not None else query.size(-1) ** -0.5, **kwargs)


def use_sparse_indexers(model: nn.Module) -> None:
    """Give every DeepSeek Sparse Attention indexer of `model` (a module with `index_topk` and the lightning
    indexer's projections `wq_b`, `wk`, `weights_proj`) the forward of `_indexer_forward`."""
    for module in model.modules():
        if isinstance(getattr(module, "index_topk", None), int) and all(
                isinstance(getattr(module, name, None), nn.Linear) for name in ("wq_b", "wk", "weights_proj")):
            module.forward = types.MethodType(functools.partial(_indexer_forward, type(module).forward), module)


def _indexer_forward(original: Callable[..., torch.Tensor], self: nn.Module, hidden_states: torch.Tensor,
                     q_resid: torch.Tensor, position_embeddings: Any, attention_mask: Any, *args: Any,
                     cache: Any = None, **kwargs: Any) -> torch.Tensor:
    """An indexer's forward: with the implicit causal mask in a shape-only trace, its projections and one
    `stratagem::lightning_indexer` (the rotary embedding of a part of q and k is left out: it changes no shape
    and costs O(S) next to the O(S^2) scoring); on real tensors, the model's own forward."""
    implicit = isinstance(attention_mask, CausalMask)
    if not (implicit and cache is None and _shape_only(hidden_states)):
        mask = attention_mask.build() if implicit else attention_mask
        return original(self, hidden_states, q_resid, position_embeddings, mask, *args, cache=cache, **kwargs)
    batch, seq = hidden_states.shape[:2]
    x, q_in = hidden_states.detach(), q_resid.detach()  # the indexer trains apart from the model (Sec. 2.1)
    q = self.wq_b(q_in).view(batch, seq, self.n_heads, self.head_dim)
    k = self.k_norm(self.wk(x).to(self.k_norm.weight.dtype)) if hasattr(self, "k_norm") else self.wk(x)
    weights = self.weights_proj(x.to(self.weights_proj.weight.dtype))
    return lightning_indexer(q.detach(), k.detach(), weights.detach(), self.index_topk)


def _shape_only(t: torch.Tensor) -> bool:
    """Whether `t` is a fake or meta tensor (a trace that prices shapes, never values)."""
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def capacity(tokens_per_group: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Expert slots per routing group: C = min(S, ceil(k * capacity_factor * S / E))."""
    return min(tokens_per_group, math.ceil(top_k * capacity_factor * tokens_per_group / num_experts))


def capacity_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts call: hidden (N, h), top_k_index / top_k_weights (N, k) -> (N, h), with the expert
    weights of `use_experts_implementation` experts (gate_up_proj (E, 2f, h) or transposed, down_proj (E, h, f))."""
    if getattr(self, "has_post_expert_norm", False):
        raise ValueError(f"{type(self).__name__}: experts with a post-expert norm are not supported by {EXPERTS}")
    num_tokens, hidden = hidden_states.shape
    num_experts, top_k = self.num_experts, top_k_index.size(-1)
    group = math.gcd(num_tokens, MAX_GROUP_TOKENS)
    factor = getattr(self.config, CAPACITY_FACTOR_ATTR, DEFAULT_CAPACITY_FACTOR)
    slots = capacity(group, top_k, num_experts, factor)
    route = capacity_route(top_k_index.reshape(-1, group, top_k), num_experts, slots)
    xg = hidden_states.reshape(-1, group, hidden)  # (G, S, h)
    # Expert parallelism (planner/runtime/apply_ep.py) replaces the instance's `expert_buffers_forward` with its
    # all-to-all dispatch around this rank's experts; otherwise every expert runs here.
    run_experts = getattr(self, EXPERT_BUFFERS_ATTR, None) or (lambda x: expert_buffers_forward(self, x))
    out = run_experts(dispatch(xg, route, num_experts))  # (E, G*C, h)
    y = combine(out, route, top_k_weights.reshape(-1, group, top_k))  # (G, S, h)
    return y.reshape(num_tokens, hidden).to(hidden_states.dtype)


def expert_buffers_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts on per-expert token buffers: x (E', N, h) -> (E', N, h) for the module's E' (local) experts."""
    up = self.gate_up_proj if self.has_gate else self.up_proj
    out = _expert_linear(self, x, up, "gate_up_proj_bias" if self.has_gate else "up_proj_bias")
    out = self._apply_gate(out) if self.has_gate else self.act_fn(out)  # (E', N, f)
    return _expert_linear(self, out, self.down_proj, "down_proj_bias")  # (E', N, h)


def _expert_linear(self: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias_name: str) -> torch.Tensor:
    """x (E, N, in) through each expert's weight: (E, out, in), or (E, in, out) when `is_transposed`."""
    # One einsum on the parameter itself (no transposed view in between), so the traced op carries the weight.
    out = torch.einsum("eni,eio->eno" if self.is_transposed else "eni,eoi->eno", x, weight)
    if self.has_bias:
        out = out + getattr(self, bias_name).unsqueeze(1)  # (E, 1, out)
    return out
