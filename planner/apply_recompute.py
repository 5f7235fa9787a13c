"""Activation recomputation (checkpointing) of the plan's layers, without changing parameter names.

Uses the composable `torch.distributed._composable.checkpoint` (hooks, no wrapper module), so FQNs, FSDP2 and
the pipeline split see the original module tree.

- FULL: the whole layer is checkpointed; only its input is kept and its forward is rerun in backward.
- SELECTIVE (Korthikanti et al. 2022, sec. 4): only the attention core -- QK^T, softmax, attention dropout, AV,
  or the fused scaled-dot-product-attention kernel -- is recomputed. Implemented with selective activation
  checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) over each attention module of
  the layer (a module with a `q_proj` linear, the zoo's layout, or whose class name ends in "Attention"): the
  outputs of its projection GEMMs (`mm`/`addmm`) are saved and everything between them -- the core, RoPE,
  head reshapes -- is recomputed. When a layer computes attention inline (no such module), the fallback
  checkpoints the whole layer and recomputes only the attention-core ops by name (softmax, masking, dropout,
  batched matmuls, fused attention kernels) and free view ops. A layer without attention recomputes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from torch import nn

from costmodel.strategy import Recompute

# aten ops of the attention core (explicit "math" attention or the fused kernels), matched by op name.
ATTENTION_CORE_OPS: frozenset[str] = frozenset({
    "bmm", "baddbmm", "_softmax", "softmax", "_masked_softmax", "native_dropout", "masked_fill",
})
ATTENTION_CORE_PREFIX = "_scaled_dot_product"  # flash / efficient / cudnn / math-for-cpu variants
VIEW_OPS: frozenset[str] = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "transpose", "permute", "t", "unsqueeze", "squeeze", "split",
    "slice", "select", "alias",
})


def _op_name(op: Any) -> str:
    # OpOverload names print as "aten::bmm" with overloadpacket name "bmm".
    packet = getattr(op, "overloadpacket", None)
    return getattr(packet, "__name__", str(op)).split("::")[-1]


def is_attention_core_op(op: Any) -> bool:
    name = _op_name(op)
    return name in ATTENTION_CORE_OPS or name.startswith(ATTENTION_CORE_PREFIX)


PROJECTION_OPS: frozenset[str] = frozenset({"mm", "addmm", "linear"})
"""2-D GEMMs: the q/k/v/o projections of an attention module, whose outputs selective recomputation keeps."""


def _attention_module_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if _op_name(op) in PROJECTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _inline_attention_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if is_attention_core_op(op) or _op_name(op) in VIEW_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def attention_modules(layer: nn.Module) -> list[nn.Module]:
    """The attention modules inside `layer` (outermost ones only)."""
    found: list[nn.Module] = []
    for _, m in layer.named_modules():
        is_attention = isinstance(getattr(m, "q_proj", None), nn.Linear) or type(m).__name__.endswith("Attention")
        if is_attention and not any(m in set(f.modules()) for f in found):
            found.append(m)
    return found


def apply_recompute(layers: Sequence[nn.Module], mode: Recompute) -> int:
    """Checkpoint each module of `layers` according to `mode`; returns how many were wrapped."""
    from torch.distributed._composable import checkpoint
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    mode = Recompute(mode)
    if mode is Recompute.NONE:
        return 0
    for layer in layers:
        if mode is Recompute.FULL:
            checkpoint(layer)
            continue
        attention = attention_modules(layer)
        for module in attention:
            checkpoint(module, context_fn=partial(create_selective_checkpoint_contexts, _attention_module_policy))
        if not attention:
            checkpoint(layer, context_fn=partial(create_selective_checkpoint_contexts, _inline_attention_policy))
    return len(layers)
