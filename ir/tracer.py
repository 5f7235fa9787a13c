"""`ir.trace`: a PyTorch model plus example inputs (or input specs) -> `Graph`.

Front ends, in order:
1. torch.fx symbolic tracing with a tracer that keeps torch.nn building blocks (Linear, LayerNorm, Embedding,
   convolutions, norms, dropout, activations, pooling, losses) and the user's `leaf_modules` as single nodes and
   traces through everything else;
2. if fx cannot trace the model (Python control flow on shapes, unsupported Python on proxies) or its graph does
   not run, `torch.export.export(..., strict=False)` on the ATen level.
`Graph.tracer` records which one produced the graph. If both fail, `TraceError` names the failing module and op
and what to try, instead of an fx traceback.

Shapes and dtypes come from running the graph on fake tensors (`ir.interpreter`): the model's parameters are
replaced by fake tensors, so a model built on the `meta` device traces without allocating its weights. Unused
optional forward arguments (`targets=None`) are specialized away with fx `concrete_args`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ir.attention_core import mark_attention_core, mark_grouped_kv
from ir.errors import TraceError
from ir.export_cast import cast_input, cast_meta_copy
from ir.fake_model import FakeModel, dtype_name, torch_dtype
from ir.graph import Graph, Node, TensorSpec, dtype_bytes
from ir.interpreter import GraphBuilder, NodeFailure, Program
from ir.node_metrics import OpMeter
from ir.op_classify import LEAF_MODULE_TYPES

Inputs = Sequence[Any] | Mapping[str, Any]
LeafSpec = type | str


def trace(
    model: nn.Module,
    inputs: Inputs,
    *,
    model_name: str = "model",
    leaf_modules: Sequence[LeafSpec] = (),
    dtype: str | None = None,
) -> Graph:
    """Trace `model` called with `inputs` into a `Graph`.

    `inputs`: a tuple of tensors (real, meta or fake) or `TensorSpec`s passed positionally, or a dict of keyword
    arguments. `leaf_modules`: module classes, class names ("Gate", "mypkg.moe.Gate") or module paths
    ("blocks.3.moe") to keep as single opaque nodes. `dtype`: trace as if floating parameters and inputs had this
    dtype ("bfloat16" for mixed-precision training); None keeps the model's.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() needs an nn.Module, got {type(model).__name__}")
    cast = None
    if dtype is not None:
        dtype_bytes(dtype)  # validates the name, listing known dtypes
        cast = torch_dtype(dtype)
        if not cast.is_floating_point:
            raise ValueError(f"trace dtype must be a floating-point dtype (float32, bfloat16, float16, ...), "
                             f"got {dtype!r}")
    _check_leaf_names(model, leaf_modules)
    fake = FakeModel.build(model, cast)
    binding = _bind_inputs(model, inputs, model_name)
    fx_error: BaseException | None = None
    try:
        with _disabled_torch_loggers():  # fake-tensor failures log tracebacks; the TraceError says it once
            program = _fx_program(model, binding, fake, leaf_modules)
            nodes = _build(fake, program)
        tracer = "fx"
    except Exception as e:  # fx could not trace or run the model: try torch.export before giving up
        fx_error = e
        try:
            program = _export_program(model, binding, fake)
            nodes = _build(fake, program)
            tracer = "export"
        except Exception as export_error:
            raise _trace_error(model, model_name, leaf_modules, fx_error, export_error) from export_error
    return _graph(model, model_name, fake, nodes, tracer)


# ---------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------


class _Binding:
    """User inputs matched to forward()'s parameters; the rest are specialized to their defaults."""

    def __init__(self, names: list[str], values: dict[str, Any], concrete: dict[str, Any]) -> None:
        self.names = names          # forward parameters, in order (no *args/**kwargs)
        self.values = values        # provided: name -> tensor / TensorSpec / Python value
        self.concrete = concrete    # not provided, has a default: name -> default


def _bind_inputs(model: nn.Module, inputs: Inputs, model_name: str) -> _Binding:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        sig = None
    if sig is None:
        if isinstance(inputs, Mapping):
            raise TraceError(f"cannot bind keyword inputs for {model_name}: forward() has no inspectable signature")
        names = [f"arg{i}" for i in range(len(inputs))]
        return _Binding(names, dict(zip(names, inputs, strict=True)), {})
    params = [p for p in sig.parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    names = [p.name for p in params]
    if isinstance(inputs, Mapping):
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise TraceError(f"{model_name}.forward() has no argument {unknown[0]!r}; its arguments: "
                             f"{', '.join(names) or '(none)'}")
        values = dict(inputs)
    else:
        inputs = tuple(inputs)
        positional = [p.name for p in params if p.kind is not p.KEYWORD_ONLY]
        if len(inputs) > len(positional):
            raise TraceError(f"{model_name}.forward() takes {len(positional)} positional inputs "
                             f"({', '.join(positional)}), got {len(inputs)}")
        values = dict(zip(positional, inputs, strict=False))
    concrete: dict[str, Any] = {}
    for p in params:
        if p.name in values:
            continue
        if p.default is inspect.Parameter.empty:
            raise TraceError(f"{model_name}.forward() needs argument {p.name!r}; got "
                             f"{', '.join(values) or 'no inputs'}")
        concrete[p.name] = p.default
    return _Binding(names, values, concrete)


# ---------------------------------------------------------------------------------------------------------------
# Front end 1: torch.fx
# ---------------------------------------------------------------------------------------------------------------


class _LeafTracer(fx.Tracer):
    """Keeps torch.nn building blocks and the user's leaf modules whole; traces through everything else
    (including torch.nn containers and composite modules such as TransformerEncoderLayer)."""

    def __init__(self, leaf_modules: Sequence[LeafSpec]) -> None:
        super().__init__()
        self._leaf_types = tuple(x for x in leaf_modules if isinstance(x, type))
        self._leaf_names = {x for x in leaf_modules if isinstance(x, str)}
        self._state_names: dict[int, str] | None = None

    def create_arg(self, a: Any) -> Any:
        # fx looks a parameter/buffer up by scanning root.named_parameters()/named_buffers() on every use, which
        # is quadratic in model size (a RoPE table read by each of 126 layers); index them once instead.
        if isinstance(a, torch.Tensor):
            name = self._state_index().get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def _state_index(self) -> dict[int, str]:
        if self._state_names is None:
            self._state_names = {}
            for name, t in (*self.root.named_parameters(), *self.root.named_buffers()):
                self._state_names.setdefault(id(t), name)
        return self._state_names

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, LEAF_MODULE_TYPES + self._leaf_types):
            return True
        cls = type(m)
        return bool(self._leaf_names & {cls.__name__, f"{cls.__module__}.{cls.__qualname__}", module_qualified_name})


def _fx_program(model: nn.Module, binding: _Binding, fake: FakeModel, leaf_modules: Sequence[LeafSpec]) -> Program:
    graph = _LeafTracer(leaf_modules).trace(model, concrete_args=dict(binding.concrete) or None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    values: dict[str, Any] = {}
    for node, name in zip(placeholders, binding.names, strict=False):
        if name in binding.values:
            values[node.name] = fake.fake_input(binding.values[name])
        elif name in binding.concrete:
            values[node.name] = binding.concrete[name]
    return Program(graph=graph, placeholder_values=values)


def _check_leaf_names(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> None:
    names = {x for x in leaf_modules if isinstance(x, str)}
    if not names:
        return
    known: set[str] = set()
    for path, m in model.named_modules():
        cls = type(m)
        known |= {path, cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
    for name in sorted(names - known):
        classes = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise TraceError(f"leaf module {name!r} matches no module class or path of the model; "
                         f"classes in the model: {', '.join(classes)}")


# ---------------------------------------------------------------------------------------------------------------
# Front end 2: torch.export (non-strict)
# ---------------------------------------------------------------------------------------------------------------


def _export_program(model: nn.Module, binding: _Binding, fake: FakeModel) -> Program:
    from torch.export.graph_signature import InputKind, OutputKind

    if fake.dtype is not None:  # export in the trace dtype so the casts it records match (ir/export_cast.py)
        model = cast_meta_copy(model, fake.dtype)
    device = next((t.device for t in (*model.parameters(), *model.buffers())), torch.device("cpu"))
    kwargs = {k: cast_input(_export_input(v, device), fake.dtype) for k, v in binding.values.items()}
    with _quiet_torch_logs():
        exported = torch.export.export(model, (), kwargs, strict=False)
    sig = exported.graph_signature
    flat_user = [fake.fake_input(v) for v in torch.utils._pytree.tree_leaves(
        {k: binding.values[k] for k in kwargs})]
    values: dict[str, Any] = {}
    attrs: dict[str, str] = {}
    constants: dict[str, Any] = {}
    user_index = 0
    for spec in sig.input_specs:
        arg_name = getattr(spec.arg, "name", None)
        if arg_name is None:
            continue
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            attrs[arg_name] = str(spec.target)
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            constants[arg_name] = exported.constants[str(spec.target)]
        elif spec.kind is InputKind.USER_INPUT:
            values[arg_name] = flat_user[user_index] if user_index < len(flat_user) else None
            user_index += 1
    user_outputs = tuple(i for i, s in enumerate(sig.output_specs)
                         if s.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT))
    return Program(graph=exported.graph_module.graph, placeholder_values=values, placeholder_attrs=attrs,
                   constants=constants, user_outputs=user_outputs, rewrite_devices=True)


_NOISY_LOGGERS = ("torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export", "torch._dynamo",
                  "torch._subclasses.fake_tensor")
"""Loggers silenced while exporting. fake_tensor logs every failed fake kernel as ERROR with a full traceback
(dozens of "E... fake_tensor.py" lines for one bad shape) through torch's own stderr handler, which
`redirect_stderr` does not reach, so the loggers are disabled rather than raised in level."""


@contextlib.contextmanager
def _disabled_torch_loggers() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    disabled = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, disabled, strict=True):
            lg.disabled = was


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs as warnings when it gives up; our TraceError says it in one line."""
    # On failure torch.export also prints the partial graph to stderr (torch/export/_trace.py).
    with _disabled_torch_loggers(), contextlib.redirect_stderr(io.StringIO()):
        yield


def _export_input(value: Any, device: torch.device) -> Any:
    """torch.export wants real or meta tensors on the model's device; specs and fake tensors become empties."""
    if isinstance(value, TensorSpec):
        return torch.empty(value.shape, dtype=torch_dtype(value.dtype), device=device)
    if isinstance(value, torch.Tensor):
        if isinstance(value, torch._subclasses.FakeTensor) or value.device != device:
            return torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=device)
        return value
    return value


# ---------------------------------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------------------------------


def _build(fake: FakeModel, program: Program) -> tuple[Node, ...]:
    nodes = GraphBuilder(fake, program, OpMeter(fake.fake_mode)).run()
    return mark_grouped_kv(mark_attention_core(nodes))


def _graph(model: nn.Module, model_name: str, fake: FakeModel, nodes: tuple[Node, ...], tracer: str) -> Graph:
    trainable = [p for p in fake.params.values() if p.requires_grad]
    batch, seq = _batch_and_seq(nodes)
    floating = [p for p in fake.params.values() if p.is_floating_point()]
    graph_dtype = dtype_name(fake.dtype or (floating[0].dtype if floating else torch.float32))
    return Graph(
        model_name=model_name,
        nodes=nodes,
        batch_size=batch,
        seq_len=seq,
        dtype=graph_dtype,
        param_count=sum(p.numel() for p in trainable),
        param_bytes=sum(p.numel() * p.element_size() for p in trainable),
        tracer=tracer,
    )


def _batch_and_seq(nodes: Sequence[Node]) -> tuple[int, int | None]:
    """Batch = leading dim of the first tensor input; seq = its second dim when it holds token ids."""
    for n in nodes:
        if n.op_kind.value == "placeholder" and n.output_specs:
            spec = n.output_specs[0]
            if not spec.shape:
                continue
            is_ids = spec.dtype.startswith(("int", "uint"))
            return spec.shape[0], (spec.shape[1] if is_ids and len(spec.shape) >= 2 else None)
    return 1, None


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


def _trace_error(model: nn.Module, model_name: str, leaf_modules: Sequence[LeafSpec], fx_error: BaseException,
                 export_error: BaseException) -> TraceError:
    where = _locate(model, fx_error) or _locate(model, export_error)
    failure = next((e for e in (fx_error, export_error) if isinstance(e, NodeFailure)), None)
    if where is None and failure is not None:
        where = _Where(failure.module_path, "", "")
    value_dependent = any(_is_value_dependent(e) for e in (fx_error, export_error))
    location = ""
    if where is not None:
        location = f" in module '{where.path or '<top level>'}'"
        if where.cls:
            location += f" ({where.cls} at {where.source})" if where.source else f" ({where.cls})"
    is_leaf = where is not None and where.path in _leaf_paths(model, leaf_modules)
    cls_name = where.cls.split(".")[0] if where is not None and where.cls else "..."
    if value_dependent:
        why = "Python control flow depends on tensor values, which shape-only tracing cannot follow"
        hint = ("rewrite the branch with torch.where or torch.cond" + (
            "; as a leaf module its forward still runs on shape-only (fake) tensors" if is_leaf else ""))
    else:
        why = "the model's Python cannot be traced"
        hint = (f"pass leaf_modules=[{cls_name!r}] to keep that module as one opaque op, or simplify its "
                "forward() so torch.export can trace it")
    message = (f"cannot trace {model_name}{location}: {why}. torch.fx: {_first_line(fx_error)}; "
               f"torch.export(strict=False) fallback: {_first_line(export_error)}. Try: {hint}.")
    return TraceError(message, module_path=where.path if where else None,
                      op=failure.target if failure is not None else None)


def _leaf_paths(model: nn.Module, leaf_modules: Sequence[LeafSpec]) -> set[str]:
    tracer = _LeafTracer(leaf_modules)
    return {p for p, m in model.named_modules() if p and tracer.is_leaf_module(m, p)}


class _Where:
    def __init__(self, path: str, cls: str, source: str) -> None:
        self.path, self.cls, self.source = path, cls, source


_TORCH_DIR = os.path.dirname(torch.__file__)


def _locate(model: nn.Module, error: BaseException) -> _Where | None:
    """The deepest model module whose own code is on the failing traceback, with the source line."""
    paths = {id(m): p for p, m in model.named_modules()}
    best: _Where | None = None
    seen: set[int] = set()
    err: BaseException | None = error
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb: types.TracebackType | None = err.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            code = frame.f_code
            owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None  # `self`
            filename = frame.f_code.co_filename
            # This file's own frames hold the model too (`_fx_program(model, ...)`): a failure there is torch's
            # or the tracer's, not a line of the model.
            if (isinstance(owner, nn.Module) and id(owner) in paths and filename != __file__
                    and (not filename.startswith(_TORCH_DIR) or frame.f_code.co_name == "forward")):
                line = linecache.getline(filename, tb.tb_lineno).strip()
                short = os.path.basename(filename)
                cls = type(owner).__qualname__
                best = _Where(paths[id(owner)], cls, f"{short}:{tb.tb_lineno}: `{line}`" if line else "")
            tb = tb.tb_next
        err = err.__cause__ or err.__context__
    if best is None and isinstance(error, NodeFailure):
        module = dict(model.named_modules()).get(error.module_path)
        if module is not None:
            best = _Where(error.module_path, type(module).__qualname__, "")
    return best


def _is_value_dependent(error: BaseException) -> bool:
    text = f"{type(error).__name__} {error}"
    cause = error.cause if isinstance(error, NodeFailure) else None
    if cause is not None:
        text += f" {type(cause).__name__} {cause}"
    markers = ("data-dependent", "DataDependent", "GuardOnDataDependent", "DynamicOutputShape",
               "used as inputs to control flow", "Could not guard", "Could not extract specialized integer")
    return any(m in text for m in markers)


def _first_line(error: BaseException) -> str:
    if isinstance(error, NodeFailure):
        cause = error.cause
        detail = _first_line(cause) if str(cause).strip() else ""
        return (f"running {error.target} (module '{error.module_path}') on fake tensors failed: "
                f"{type(cause).__name__}{': ' + detail if detail else ''}")
    text = str(error).strip().splitlines()
    first = next((ln.strip() for ln in text if ln.strip()), type(error).__name__)
    return first if len(first) <= 240 else first[:237] + "..."
