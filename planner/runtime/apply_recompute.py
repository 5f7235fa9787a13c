"""Activation recomputation (checkpointing) of the plan's layers, without changing parameter names.

Uses the composable `torch.distributed._composable.checkpoint` (hooks, no wrapper module), so FQNs, FSDP2 and
the pipeline split see the original module tree.

- FULL: the whole layer is checkpointed; only its input is kept and its forward is rerun in backward.
- SELECTIVE (Korthikanti et al. 2022, sec. 4): only the attention core -- QK^T, softmax, attention dropout, AV,
  or the fused scaled-dot-product-attention kernel -- is recomputed. Implemented with selective activation
  checkpointing (`torch.utils.checkpoint.create_selective_checkpoint_contexts`) over each attention module of
  the layer (a module with a `q_proj` linear, the zoo's layout, or whose class name ends in "Attention"): the
  outputs of its projection GEMMs (`mm`/`addmm`) are saved and everything between them -- the core, RoPE,
  head reshapes -- is recomputed. The attention module's `forward` body is checkpointed, not the module call,
  so tensor/sequence-parallel layout hooks on it stay outside the region; functional collectives inside it
  (a rowwise o_proj's reduce-scatter) are always saved. When a layer computes attention inline (no such module), the fallback
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


COLLECTIVE_NAMESPACE = "_c10d_functional"
"""Functional collectives (all-gather, reduce-scatter, all-reduce, and their `wait_tensor`) that DTensor's
tensor/sequence-parallel layouts run inside a region: their outputs are always saved, so recomputation sends
nothing and never depends on the other ranks' recomputation."""


def is_collective_op(op: Any) -> bool:
    return getattr(op, "namespace", None) == COLLECTIVE_NAMESPACE or str(op).startswith(COLLECTIVE_NAMESPACE + ".")


def _attention_module_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if _op_name(op) in PROJECTION_OPS or is_collective_op(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _inline_attention_policy(_ctx: Any, op: Any, *_args: Any, **_kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if (is_attention_core_op(op) or _op_name(op) in VIEW_OPS) and not is_collective_op(op):
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


def _checkpoint_forward(module: nn.Module, context_fn: Any) -> None:
    """Checkpoint the body of `module.forward` only, not its hooks.

    The composable `checkpoint` reruns `module(*args)` -- hooks included -- on the arguments its own pre-hook saw.
    Tensor parallelism installs its input/output layout hooks on the attention module before recomputation is
    applied, so in the forward they ran outside the region and in the recomputation they would run again, on
    inputs they had already converted (gathering a gathered sequence twice, and a collective the selective
    policy never recorded). Wrapping the bound `forward` (an instance attribute: parameter names are unchanged)
    keeps every hook outside the region in both passes.
    """
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = forward


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
            _checkpoint_forward(module, partial(create_selective_checkpoint_contexts, _attention_module_policy))
        if not attention:
            checkpoint(layer, context_fn=partial(create_selective_checkpoint_contexts, _inline_attention_policy))
    return len(layers)
