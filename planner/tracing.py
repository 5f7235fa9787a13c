"""The one way the planner traces a user's module: one sample, shapes only, in the training dtype.

`planner.api.plan`, `planner.parallelize` and `stratagem plan` all trace the model at a batch of one sample, so a
plan made from example inputs of any batch size carries the fingerprint that `parallelize` recomputes from
example inputs of any other (the cost model scales the traced sample to every micro-batch size it prices). The
first dimension of every input tensor is the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import ir
from ir.graph import TensorSpec
from ir.layer_chain import LayerChain


def one_sample(value: Any) -> Any:
    """`value` (a tensor, `TensorSpec`, tuple / list / dict of them) with every batch dimension set to 1, as
    `TensorSpec`s; other values unchanged."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value
        return TensorSpec(shape=(1, *value.shape[1:]), dtype=str(value.dtype).removeprefix("torch."))
    if isinstance(value, TensorSpec):
        return TensorSpec(shape=(1, *value.shape[1:]), dtype=value.dtype) if value.shape else value
    if isinstance(value, Mapping):
        return {k: one_sample(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return tuple(one_sample(v) for v in value)
    return value


def trace_one_sample(model: nn.Module, example_inputs: Any, *, dtype: str | None = None,
                     model_name: str = "model") -> LayerChain:
    """The layer chain of `model` called with `example_inputs` (a tuple of tensors or `TensorSpec`s, or a dict of
    keyword arguments), traced at one sample in `dtype` (module docstring)."""
    graph = ir.trace(model, one_sample(example_inputs), model_name=model_name, dtype=dtype)
    return ir.build_layer_chain(graph)
