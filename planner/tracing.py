"""The one way the planner traces a model: one sample, shapes only, in the training dtype.

`planner.api.plan`, `planner.parallelize` and `stratagem plan` all trace the model at a batch of one sample, so a
plan made from example inputs of any batch size carries the fingerprint that `parallelize` recomputes from
example inputs of any other (the cost model scales the traced sample to every micro-batch size it prices). The
first dimension of every input tensor is the batch.

`trace_model` traces a model of the registry by name (what the CLI plans), through the trace cache
(`planner.trace_cache`) when given one. torch is imported by the functions that trace, not by this module: a
cache hit never loads it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ir
from ir.graph import TensorSpec
from ir.layer_chain import LayerChain
from ir.layer_repeat import RepeatedStack, repeat_layers
from planner.errors import UserError
from planner.progress import Phase, PlanProgress, ProgressCallback
from planner.trace_cache import TraceCache, TracedModel, trace_key

if TYPE_CHECKING:
    from torch import nn

    from models.registry import BuiltModel


def one_sample(value: Any) -> Any:
    """`value` (a tensor, `TensorSpec`, tuple / list / dict of them) with every batch dimension set to 1, as
    `TensorSpec`s; other values unchanged."""
    import torch

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


def trace_model(model: str, sets: Sequence[str] = (), *, seq: int | None = None, dtype: str = "bfloat16",
                cache: TraceCache | None = None, progress: ProgressCallback | None = None) -> TracedModel:
    """MODEL (a zoo family or preset, `hf:...`, `package.module:factory`) with `--set` overrides, built on the meta
    device and traced at one sample in `dtype`; read from `cache` when it holds it, and stored there after
    tracing. Raises the registry's `ModelError` for a bad name or setting, `UserError` when tracing fails."""
    key = trace_key(model, sets, seq=seq, dtype=dtype) if cache is not None else None
    if key is not None and cache is not None and (hit := cache.load(key)) is not None:
        return hit
    if progress is not None:
        progress(PlanProgress(phase=Phase.TRACE))
    started = time.monotonic()
    from models.registry import build_model  # imports torch and the zoo

    try:
        built = build_model(model, sets, batch=1, seq=seq, device="meta")
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"model {model}: {_one_line(e)}") from None
    try:
        chain = ir.build_layer_chain(trace_built(built, dtype=dtype))
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"cannot trace {built.name}: {_one_line(e)}") from None
    traced = TracedModel(name=built.name, settings=json_settings(built.settings), chain=chain)
    if key is not None and cache is not None:
        cache.store(key, traced)
    if progress is not None:
        progress(PlanProgress(phase=Phase.TRACE, elapsed_s=time.monotonic() - started))
    return traced


def trace_built(built: BuiltModel, *, dtype: str = "bfloat16") -> ir.Graph:
    """The graph of a registry model. When its layers repeat (`models.layer_stack`), a stand-in with the
    first layers is traced and the rest are copied in the graph (`ir.layer_repeat`): the same graph, with the
    same fingerprint, as tracing every layer, in the time of a few. A stand-in whose trace does not repeat as its
    modules do is dropped, and the model is traced whole."""
    stand_in = built.trace_stand_in() if built.trace_stand_in is not None else None
    if stand_in is not None:
        short = ir.trace(stand_in.module, stand_in.example_inputs, model_name=built.name, dtype=dtype)
        pattern = stand_in.pattern
        try:
            graph = repeat_layers(short, RepeatedStack(path=pattern.path, total=pattern.total, traced=pattern.traced,
                                                       period=pattern.period))
        except ValueError:
            graph = None
        if graph is not None and graph.param_count == short.param_count + stand_in.added_params:
            return graph
    return ir.trace(built.module, built.example_inputs, model_name=built.name, dtype=dtype)


def json_settings(settings: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """The settings as a plan's JSON holds them (enums as their values, tuples as lists), sorted by key: a model
    read from the trace cache and one traced now record the same settings."""
    return tuple(sorted((str(k), json.loads(json.dumps(v, default=str))) for k, v in settings))


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split())
