"""What torch.export sees when `ir.trace(..., dtype=...)` asks for a dtype: a meta copy cast to that dtype.

torch.export records dtype conversions with the dtypes it saw while tracing: `x.to(weight.dtype)` or
`mask.to(query.dtype)` becomes `aten.to(x, torch.float32)` in the graph. Exporting the float32 model and then
running the graph on bfloat16 fake parameters (as the tracer does) therefore mixes dtypes: most activations stay
float32 and ops such as SDPA with a float mask or an einsum against a bfloat16 weight fail. Hugging Face models
are full of such casts (RMSNorm upcasts and downcasts, masks cast to the query dtype). Exporting a copy whose
floating parameters and buffers already have the trace dtype -- as `FakeModel` casts them -- records the casts
a model trained in that dtype makes.

The copy holds meta tensors, so it allocates nothing, whatever device the model is on.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def cast_meta_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of `model` whose parameters and buffers are meta tensors, floating ones cast to `dtype`.
    Tied parameters stay tied; names, module types and `requires_grad` are kept."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = _meta_like(b, dtype)
    return copy.deepcopy(model, memo)


def cast_input(value: Any, dtype: torch.dtype | None) -> Any:
    """A floating input tensor in the trace dtype (token ids and other integer inputs unchanged)."""
    if dtype is not None and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


def _meta_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out_dtype = dtype if t.is_floating_point() else t.dtype
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=out_dtype, device="meta")
