"""Two transformers extension points that make Hugging Face models plannable from a shape-only trace.

Both are registered under their own names through transformers' public registries (`AttentionInterface`,
`AttentionMaskInterface`, `ExpertsInterface`) and selected only by models that `models.hf` builds, by setting
`config._attn_implementation` / `config._experts_implementation`; every other model keeps transformers' defaults.

1. `ATTENTION` ("stratagem_sdpa"): PyTorch SDPA, with a mask function that leaves the mask implicit for the
   unpadded, unpacked training batches we build. In eager mode transformers already does this (it passes
   `is_causal=True` and no mask, `masking_utils._ignore_causal_mask_sdpa`), but under torch.export it cannot read
   the position ids to prove the batch is unpacked, so it materializes a (B, 1, S, S) boolean mask. That mask is
   not what training runs; priced as an activation it is live across every layer (16 GiB per sample at a 128K
   context) and it hides causality and grouped-query attention from the trace. A padding mask, a sliding window
   shorter than the sequence, or a cache still get transformers' own `sdpa_mask`.

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
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from models.expert_dispatch import capacity_route, combine, dispatch
from models.moe import MAX_GROUP_TOKENS

ATTENTION = "stratagem_sdpa"
"""`config._attn_implementation` of models built by `models.hf` (when the model class supports SDPA)."""
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
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(ATTENTION, training_sdpa_mask)
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # transformers releases before the experts interface: their MoE loops stay as they are
        return
    ExpertsInterface.register(EXPERTS, capacity_experts_forward)


def training_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """No mask (SDPA's own `is_causal`, or no masking for bidirectional layers) when the batch has no padding,
    no cache offset, and no sliding window shorter than the sequence; transformers' `sdpa_mask` otherwise.

    transformers turns off its own skip (`allow_is_causal_skip=False`) under tracing because it cannot rule out
    packed sequences from the position ids; the inputs `models.hf` builds never pass position ids or padding.
    """
    from transformers.masking_utils import sdpa_mask

    unwindowed = local_size is None or kv_length < local_size
    no_offset = isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
    if attention_mask is None and no_offset and q_length == kv_length and unwindowed:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                     local_size=local_size, **kwargs)


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
