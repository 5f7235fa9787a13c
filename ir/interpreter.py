"""Run a traced fx graph on fake tensors and turn every tensor-producing call into an IR `Node`.

Both front ends (torch.fx symbolic tracing and the torch.export fallback) produce an `fx.Graph`; a `Program`
says how its placeholders bind (user inputs, concrete defaults, lifted parameters) and how to read a node's owning
module. `GraphBuilder` then walks the graph once, in order:

1. computes each node's value on fake tensors (shape propagation: no memory is allocated, so a 175B-parameter
   model traces on a laptop),
2. names and classifies the call (`ir.op_classify`),
3. measures FLOPs / saved tensors through a cached `OpMeter` and charges saved storages to a graph-wide
   `SavedLedger` (`ir.node_metrics`).

Step 1 is itself cached: a call identical to an earlier one (same op, module config, argument specs and
aliasing: the next block's q_proj) gets its result rebuilt from a `ResultTemplate` (outputs as inputs, views of an
input's storage, or fresh tensors) instead of re-running the op, which is most of the cost on 100-layer models.

Parameters, buffers and tensors computed only from them are not graph inputs: a node that reads a parameter
lists it in `param_names` / `param_specs`. Nodes that produce no tensor (``x.size(0)``, assertions) are executed
for their values but not recorded.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ir.graph import Node, OpKind, TensorSpec
from ir.node_metrics import (
    Leaf,
    OpMeasurement,
    OpMeter,
    Role,
    SavedLedger,
    alias_index,
    attention_measurement,
    io_bytes,
    is_pure_view,
    module_signature,
    storage_key,
    tensor_outputs,
    value_signature,
)
from ir.op_classify import CallName, classify, name_call


class NodeFailure(Exception):
    """Running one graph node on fake tensors failed; carries where, for the tracer's error message."""

    def __init__(self, node_name: str, module_path: str, target: str, cause: BaseException) -> None:
        super().__init__(f"{target} in module '{module_path}' (node {node_name}): {cause}")
        self.node_name = node_name
        self.module_path = module_path
        self.target = target
        self.cause = cause


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in t.shape), dtype_name(t.dtype))


# ---------------------------------------------------------------------------------------------------------------
# The model's state as fake tensors
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class FakeModel:
    """The model's parameters and buffers as fake tensors on the trace device, optionally cast to `dtype`.

    Meta-device models are traced as fake *CPU* tensors so kernel selection (e.g. which attention kernel runs)
    is that of a real device; fake tensors never allocate either way.
    """

    model: nn.Module
    fake_mode: FakeTensorMode
    device: torch.device
    dtype: torch.dtype | None
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Canonical (first) parameter name -> fake leaf."""
    param_alias: dict[str, str] = field(default_factory=dict)
    """Every name a parameter is reachable by (tied weights have several) -> canonical name."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    param_name_by_id: dict[int, str] = field(default_factory=dict)
    """id(fake parameter) -> canonical name."""

    @classmethod
    def build(cls, model: nn.Module, dtype: torch.dtype | None) -> FakeModel:
        device = _model_device(model)
        fake = cls(model, FakeTensorMode(allow_non_fake_inputs=True), device, dtype)
        canonical_by_id: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=True):
            canonical_by_id[id(p)] = name
            fake.params[name] = fake._fake_like(p, requires_grad=p.requires_grad)
            fake.param_name_by_id[id(fake.params[name])] = name
        for name, p in model.named_parameters(remove_duplicate=False):
            fake.param_alias[name] = canonical_by_id[id(p)]
        by_id: dict[int, torch.Tensor] = {}
        for name, b in model.named_buffers(remove_duplicate=False):
            if id(b) not in by_id:
                by_id[id(b)] = fake._fake_like(b, requires_grad=False)
            fake.buffers[name] = by_id[id(b)]
        return fake

    def _fake_like(self, t: torch.Tensor, *, requires_grad: bool) -> torch.Tensor:
        dtype = self.dtype if (self.dtype is not None and t.is_floating_point()) else t.dtype
        with self.fake_mode:
            out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=self.device)
        return out.requires_grad_(requires_grad and (dtype.is_floating_point or dtype.is_complex))

    def fake_input(self, x: Any) -> Any:
        """A user input as a fake tensor on the trace device (TensorSpec, real, meta or fake tensors)."""
        if isinstance(x, TensorSpec):
            dt = torch_dtype(x.dtype)
            if self.dtype is not None and dt.is_floating_point:
                dt = self.dtype
            with self.fake_mode:
                return torch.empty(x.shape, dtype=dt, device=self.device)
        if isinstance(x, torch.Tensor):
            return self._fake_like(x, requires_grad=x.requires_grad)
        return x

    def module_state(self, qualname: str, module: nn.Module) -> dict[str, torch.Tensor]:
        """Fake parameters and buffers of a (leaf) module under their local names, for functional_call."""
        prefix = f"{qualname}." if qualname else ""
        state: dict[str, torch.Tensor] = {}
        for local, _ in module.named_parameters(remove_duplicate=False):
            state[local] = self.params[self.param_alias[prefix + local]]
        for local, _ in module.named_buffers(remove_duplicate=False):
            state[local] = self.buffers[prefix + local]
        return state

    def attribute(self, qualname: str) -> Any:
        """A get_attr target: fake parameter / buffer, or a constant attribute converted to fake."""
        if qualname in self.param_alias:
            return self.params[self.param_alias[qualname]]
        if qualname in self.buffers:
            return self.buffers[qualname]
        obj: Any = self.model
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, torch.Tensor):
            return self._fake_like(obj, requires_grad=False)
        return obj


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return torch.device("cpu") if t.device.type == "meta" else t.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# Programs: an fx.Graph plus its bindings
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Program:
    """An fx graph to interpret, with its placeholder bindings."""

    graph: fx.Graph
    placeholder_values: Mapping[str, Any]
    """Placeholder node name -> value (fake user inputs, concrete defaults)."""
    placeholder_attrs: Mapping[str, str] = field(default_factory=dict)
    """Placeholder node name -> parameter/buffer qualname (torch.export lifts them to inputs)."""
    constants: Mapping[str, Any] = field(default_factory=dict)
    """Placeholder node name -> lifted constant tensor (torch.export)."""
    user_outputs: tuple[int, ...] | None = None
    """Indices of user outputs among the output node's values (torch.export also returns buffer mutations)."""
    rewrite_devices: bool = False
    """Replace torch.device arguments with the trace device (torch.export bakes the export device in)."""


_EXPORT_PATH_RE = re.compile(r"\[(\d+)\]|\._modules\['([^']+)'\]|\['([^']+)'\]")


def module_path_of(node: fx.Node) -> str:
    """Owning module of an fx node: the leaf module itself for call_module, else the innermost module on the
    tracer's nn_module_stack ("" at the top level)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _normalize_path(str(path))


def _normalize_path(path: str) -> str:
    path = path.removeprefix("L['self']").removeprefix("L__self__")
    path = _EXPORT_PATH_RE.sub(lambda m: "." + next(g for g in m.groups() if g is not None), path)
    return path.strip(".")


# ---------------------------------------------------------------------------------------------------------------
# The builder
# ---------------------------------------------------------------------------------------------------------------

_ACT, _PARAM, _CONST = "act", "param", "const"


@dataclass(frozen=True, slots=True)
class _ArgLeaf:
    value: torch.Tensor
    producer: str | None


class GraphBuilder:
    """Interprets one `Program` on fake tensors and emits IR nodes (see the module docstring)."""

    def __init__(self, fake: FakeModel, program: Program, meter: OpMeter) -> None:
        self.fake = fake
        self.program = program
        self.meter = meter
        self.env: dict[str, Any] = {}
        self.origin: dict[int, str] = {}
        self.ir_names: set[str] = set()
        self.ledger = SavedLedger()
        self.modules = dict(fake.model.named_modules(remove_duplicate=False))
        self._module_sigs: dict[int, Any] = {}
        self.replays: dict[Any, ResultTemplate] = {}
        """Propagation cache: call signature -> how to rebuild its result from its inputs (see ResultTemplate)."""
        for p in fake.params.values():
            self.origin[id(p)] = _PARAM
            self.ledger.excluded.add(storage_key(p))
        for b in fake.buffers.values():
            self.origin[id(b)] = _CONST
            self.ledger.excluded.add(storage_key(b))

    # -- driver ---------------------------------------------------------------------------------------------

    def run(self) -> tuple[Node, ...]:
        nodes: list[Node] = []
        with self.fake.fake_mode, torch.enable_grad():
            for fx_node in self.program.graph.nodes:
                try:
                    ir_node = self._visit(fx_node)
                except NodeFailure:
                    raise
                except Exception as e:  # any failure: say which node, module and op
                    raise NodeFailure(fx_node.name, module_path_of(fx_node), _target_text(fx_node), e) from e
                if ir_node is not None:
                    nodes.append(ir_node)
                    self.ir_names.add(ir_node.name)
        return tuple(nodes)

    def _visit(self, node: fx.Node) -> Node | None:
        if node.op == "placeholder":
            return self._placeholder(node)
        if node.op == "get_attr":
            self.env[node.name] = self.fake.attribute(str(node.target))
            return None
        if node.op == "output":
            return self._output(node)
        return self._call(node)

    # -- placeholders and outputs -----------------------------------------------------------------------------

    def _placeholder(self, node: fx.Node) -> Node | None:
        name = node.name
        if name in self.program.placeholder_attrs:
            self.env[name] = self.fake.attribute(self.program.placeholder_attrs[name])
            return None
        if name in self.program.constants:
            value = self.fake.fake_input(self.program.constants[name])
            self.origin[id(value)] = _CONST
            self.ledger.excluded.add(storage_key(value))
            self.env[name] = value
            return None
        value = self.program.placeholder_values.get(name, node.args[0] if node.args else None)
        self.env[name] = value
        tensors = tensor_outputs(value)
        if not tensors:
            return None
        for t in tensors:
            self.origin[id(t)] = _ACT
        return Node(
            name=name, op_kind=OpKind.PLACEHOLDER, target="placeholder", module_path="", inputs=(),
            input_specs=(), output_specs=tuple(spec_of(t) for t in tensors),
            attrs=(("arg_name", str(node.target)),),
        )

    def _output(self, node: fx.Node) -> Node:
        values = node.args[0]
        if self.program.user_outputs is not None:
            values = tuple(values[i] for i in self.program.user_outputs)  # type: ignore[index]
        leaves = self._arg_leaves(values)
        ir_leaves = [lf for lf in leaves if lf.producer in self.ir_names]
        return Node(
            name=node.name, op_kind=OpKind.OUTPUT, target="output", module_path="",
            inputs=tuple(lf.producer for lf in ir_leaves),  # type: ignore[misc]
            input_specs=tuple(spec_of(lf.value) for lf in ir_leaves), output_specs=(),
        )

    # -- calls ------------------------------------------------------------------------------------------------

    def _call(self, node: fx.Node) -> Node | None:
        args = fx.node.map_arg(node.args, lambda n: self.env[n.name])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: self.env[n.name])
        if self.program.rewrite_devices:
            args, kwargs = _rewrite_devices((args, kwargs), self.fake.device)
        if _is_assertion(node):
            self.env[node.name] = None
            return None
        module = self.modules[str(node.target)] if node.op == "call_module" else None
        name = name_call(node.op, node.target, module, args)
        leaves = self._arg_leaves((node.args, node.kwargs))
        if module is not None:
            state = self.fake.module_state(str(node.target), module)
            leaves += [_ArgLeaf(t, None) for t in state.values()]
        run = self._runner(node, module)
        result = self._propagate(name, module, args, kwargs, [lf.value for lf in leaves], run)
        self.env[node.name] = result
        outputs = tensor_outputs(result)
        if not outputs:
            return None
        origin = self._origin_of(leaves)
        for o in outputs:
            self.origin[id(o)] = origin
            if origin == _CONST:
                self.ledger.excluded.add(storage_key(o))
        return self._make_node(node, name, module, args, kwargs, leaves, outputs, run)

    def _propagate(self, name: CallName, module: nn.Module | None, args: Any, kwargs: Any,
                   leaves: list[torch.Tensor], run: Callable[[Any, Any, Any], Any]) -> Any:
        """The node's value: replayed from the propagation cache when an identical call was seen, else run."""
        if name.inplace or (name.base == "getitem" and not isinstance(args[0], torch.Tensor)):
            return run(args, kwargs, None)
        key = (name.target, self._module_sig(module),
               value_signature((_structure(args), _structure(kwargs))), _leaf_signature(leaves))
        template = self.replays.get(key)
        if template is not None:
            return template.replay(leaves)
        result = run(args, kwargs, None)
        if key not in self.replays:
            template = ResultTemplate.of(result, leaves)
            if template is not None:
                self.replays[key] = template
        return result

    def _runner(self, node: fx.Node, module: nn.Module | None) -> Callable[[Any, Any, Any], Any]:
        """A function (args, kwargs, state) -> result that performs the node's call; `state` replaces a leaf
        module's parameters and buffers (None: the fake model's own)."""
        if node.op == "call_module":
            assert module is not None
            qualname = str(node.target)

            def call_module(args, kwargs, state):
                state = self.fake.module_state(qualname, module) if state is None else state
                return torch.func.functional_call(module, state, tuple(args), dict(kwargs))

            return call_module
        if node.op == "call_method":
            method = str(node.target)
            return lambda args, kwargs, state: getattr(args[0], method)(*args[1:], **kwargs)
        target = node.target
        return lambda args, kwargs, state: target(*args, **kwargs)  # type: ignore[operator]

    def _make_node(self, node: fx.Node, name: CallName, module: nn.Module | None, args: Any, kwargs: Any,
                   leaves: list[_ArgLeaf], outputs: list[torch.Tensor], run: Callable[[Any, Any, Any], Any]) -> Node:
        path = module_path_of(node)
        is_weight = self._is_weight
        classified = classify(name, module, args, kwargs, outputs, is_weight)
        getitem_of_container = name.base == "getitem" and not isinstance(args[0], torch.Tensor)
        if getitem_of_container:
            # One element of a multi-output node (split, chunk, max(dim)): reads that element, moves nothing.
            producer = node.args[0].name if isinstance(node.args[0], fx.Node) else None
            leaves = [_ArgLeaf(o, producer) for o in outputs]
        ir_leaves = [lf for lf in leaves if lf.producer in self.ir_names]
        ir_inputs = [lf.value for lf in ir_leaves]
        leaf_values = [lf.value for lf in leaves]
        pure_view = is_pure_view(leaf_values, outputs, name.inplace, getitem_of_container)
        if pure_view:
            measured = OpMeasurement(0, 0, ())
        elif classified.op_kind is OpKind.ATTENTION and name.base in ("scaled_dot_product_attention",
                                                                      "windowed_attention"):
            q, k, v = leaf_values[:3]
            measured = attention_measurement(q, k, v, outputs[0], any(t.requires_grad for t in (q, k, v)),
                                             window=dict(classified.attrs).get("window"))
        else:
            measured = self._measure(node, name, module, args, kwargs, leaves, run)
        read, written = io_bytes(leaf_values, outputs, pure_view)
        saved = self.ledger.charge(measured.saved, leaf_values, outputs)
        attrs = dict(classified.attrs)
        alias = alias_index(ir_inputs, outputs) if (pure_view or name.inplace) else None
        if alias is not None:
            attrs["alias_input"] = alias
        params = self._params_of(leaves)
        return Node(
            name=node.name, op_kind=classified.op_kind, target=name.target, module_path=path,
            inputs=tuple(lf.producer for lf in ir_leaves),  # type: ignore[misc]
            input_specs=tuple(spec_of(t) for t in ir_inputs),
            output_specs=tuple(spec_of(o) for o in outputs),
            param_names=tuple(params), param_specs=tuple(spec_of(self.fake.params[p]) for p in params),
            forward_flops=measured.forward_flops, backward_flops=measured.backward_flops,
            bytes_read=read, bytes_written=written, saved_bytes=saved,
            attrs=tuple(sorted(attrs.items())),
        )

    def _measure(self, node: fx.Node, name: CallName, module: nn.Module | None, args: Any, kwargs: Any,
                 leaves: list[_ArgLeaf], run: Callable[[Any, Any, Any], Any]) -> OpMeasurement:
        state_names = list(self.fake.module_state(str(node.target), module)) if module is not None else []
        n_args = len(leaves) - len(state_names)
        key = (name.target, self._module_sig(module), value_signature((_structure(args), _structure(kwargs))))
        meter_leaves = [Leaf(lf.value, self._role(lf.value)) for lf in leaves]

        def call(tensors: Sequence[torch.Tensor]) -> Any:
            it = iter(tensors[:n_args])
            new_args = _replace_tensors(args, it)
            new_kwargs = _replace_tensors(kwargs, it)
            state = dict(zip(state_names, tensors[n_args:], strict=True)) if module is not None else None
            return run(new_args, new_kwargs, state)

        return self.meter.measure(key, meter_leaves, call)

    # -- helpers ----------------------------------------------------------------------------------------------

    def _arg_leaves(self, structure: Any) -> list[_ArgLeaf]:
        """Tensor leaves of an fx argument structure, in the order `_replace_tensors` visits evaluated args."""
        out: list[_ArgLeaf] = []

        def walk(a: Any) -> None:
            if isinstance(a, fx.Node):
                for t in tensor_outputs(self.env[a.name]):
                    out.append(_ArgLeaf(t, a.name))
            elif isinstance(a, torch.Tensor):
                out.append(_ArgLeaf(a, None))
            elif isinstance(a, tuple | list):
                for x in a:
                    walk(x)
            elif isinstance(a, dict):
                for x in a.values():
                    walk(x)

        walk(structure)
        return out

    def _origin_of(self, leaves: Sequence[_ArgLeaf]) -> str:
        origins = {self.origin.get(id(lf.value), _CONST) for lf in leaves}
        if _ACT in origins:
            return _ACT
        return _PARAM if _PARAM in origins else _CONST

    def _role(self, t: torch.Tensor) -> Role:
        origin = self.origin.get(id(t), _CONST)
        return {_ACT: Role.ACTIVATION, _PARAM: Role.PARAM}.get(origin, Role.BUFFER)

    def _is_weight(self, t: torch.Tensor) -> bool:
        return self.origin.get(id(t)) == _PARAM

    def _params_of(self, leaves: Sequence[_ArgLeaf]) -> list[str]:
        names: dict[str, None] = {}
        for lf in leaves:
            pname = self.fake.param_name_by_id.get(id(lf.value))
            if pname is not None:
                names[pname] = None
        return list(names)

    def _module_sig(self, module: nn.Module | None) -> Any:
        if module is None:
            return None
        sig = self._module_sigs.get(id(module))
        if sig is None:
            sig = self._module_sigs[id(module)] = module_signature(module)
        return sig


def _structure(obj: Any) -> Any:
    """The argument structure with tensors replaced by a marker (their specs are part of the meter's key)."""
    if isinstance(obj, torch.Tensor):
        return "<T>"
    if isinstance(obj, tuple | list):
        return tuple(_structure(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _structure(v) for k, v in obj.items()}
    return obj


def _rebuild(obj: tuple | list, items: list[Any]) -> Any:
    """A list/tuple like `obj` holding `items`: named tuples and torch's structseqs (`torch.max(x, 1)`'s
    `(values, indices)`) keep their type, so `.values` still works downstream."""
    if isinstance(obj, list):
        return items
    if type(obj) is tuple or isinstance(obj, torch.Size):
        return tuple(items)
    if hasattr(obj, "_fields"):  # collections.namedtuple
        return type(obj)(*items)
    return type(obj)(items)  # structseq (torch.return_types.*)


def _replace_tensors(obj: Any, it: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, tuple | list):
        return _rebuild(obj, [_replace_tensors(x, it) for x in obj])
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, it) for k, v in obj.items()}
    return obj


def _rewrite_devices(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.device):
        return device
    if isinstance(obj, tuple | list):
        return _rebuild(obj, [_rewrite_devices(x, device) for x in obj])
    if isinstance(obj, dict):
        return {k: _rewrite_devices(v, device) for k, v in obj.items()}
    return obj


def _is_assertion(node: fx.Node) -> bool:
    """Runtime checks torch.export inserts (dtype/shape asserts) hold for the original dtype only; skip them."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1].startswith("_assert")
    return False


def _target_text(node: fx.Node) -> str:
    if node.op in ("call_function",) and not isinstance(node.target, str):
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


# ---------------------------------------------------------------------------------------------------------------
# Propagation cache
# ---------------------------------------------------------------------------------------------------------------


def _leaf_signature(leaves: Sequence[torch.Tensor]) -> Any:
    """Specs of the call's tensor arguments and which of them share a storage (views of one buffer)."""
    keys = [storage_key(t) for t in leaves]
    first = {}
    shared = tuple(first.setdefault(k, i) for i, k in enumerate(keys))
    specs = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad) for t in leaves)
    return specs, shared


@dataclass(frozen=True)
class _Out:
    """How to rebuild one tensor output: the input itself, a view of an input's storage, or a new tensor."""

    kind: str  # "input" | "view" | "new"
    leaf: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """For views: storage offset relative to the input's."""
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class ResultTemplate:
    """A call's result with tensors described relative to the call's inputs, so an identical later call (the next
    transformer block's q_proj) gets a result with the right shapes, strides, aliasing and requires_grad without
    running the op again on fake tensors. Only calls whose every output is an input, a view of an input's storage
    or a fresh tensor are cached; in-place calls never are."""

    structure: Any
    outs: tuple[_Out, ...]

    @classmethod
    def of(cls, result: Any, leaves: Sequence[torch.Tensor]) -> ResultTemplate | None:
        outs: list[_Out] = []
        keys = {}
        for i, t in enumerate(leaves):
            keys.setdefault(storage_key(t), i)
        ids = {id(t): i for i, t in enumerate(leaves)}

        def describe(t: torch.Tensor) -> str | None:
            base = dict(shape=tuple(t.shape), stride=tuple(t.stride()), dtype=t.dtype, device=t.device,
                        requires_grad=t.requires_grad)
            if id(t) in ids:
                outs.append(_Out("input", ids[id(t)], offset=0, **base))
                return "<T>"
            k = keys.get(storage_key(t))
            if k is None and not t._is_view():
                outs.append(_Out("new", -1, offset=0, **base))
                return "<T>"
            src = leaves[k] if k is not None else None
            if src is not None and t._is_view() and t.dtype == src.dtype and t.requires_grad == src.requires_grad:
                outs.append(_Out("view", k, offset=t.storage_offset() - src.storage_offset(), **base))
                return "<T>"
            return None

        structure = _template(result, describe)
        if structure is _UNCACHEABLE:
            return None
        return cls(structure, tuple(outs))

    def replay(self, leaves: Sequence[torch.Tensor]) -> Any:
        it = iter(self.outs)
        return _fill(self.structure, lambda: _rebuild_tensor(next(it), leaves))


_UNCACHEABLE = object()


def _template(obj: Any, describe: Callable[[torch.Tensor], str | None]) -> Any:
    if isinstance(obj, torch.Tensor):
        marker = describe(obj)
        return _UNCACHEABLE if marker is None else _TensorSlot()
    if obj is None or isinstance(obj, bool | int | float | str | torch.dtype | torch.device | torch.Size):
        return obj
    if isinstance(obj, tuple | list):
        items = [_template(x, describe) for x in obj]
        if any(x is _UNCACHEABLE for x in items):
            return _UNCACHEABLE
        return _rebuild(obj, items)
    return _UNCACHEABLE


class _TensorSlot:
    """Placeholder for a tensor in a cached result structure."""


def _fill(obj: Any, make: Callable[[], torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return make()
    if isinstance(obj, tuple | list) and not isinstance(obj, torch.Size):
        return _rebuild(obj, [_fill(x, make) for x in obj])
    return obj


def _rebuild_tensor(out: _Out, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    if out.kind == "input":
        return leaves[out.leaf]
    if out.kind == "view":
        src = leaves[out.leaf]
        return src.as_strided(out.shape, out.stride, src.storage_offset() + out.offset)
    t = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device=out.device)
    if out.requires_grad:
        # not a leaf, like the op's own output: later in-place ops on it must stay legal
        t = t.requires_grad_(True).clone()
    return t
