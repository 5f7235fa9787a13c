"""Run a traced fx graph on fake tensors and turn every tensor-producing call into an IR `Node`.

Both front ends (torch.fx symbolic tracing and the torch.export fallback) produce an `fx.Graph`; a `Program`
says how its placeholders bind (user inputs, concrete defaults, lifted parameters) and how to read a node's owning
module. `GraphBuilder` then walks the graph once, in order, over the model's state as fake tensors
(`ir.fake_model`):

1. computes each node's value on fake tensors (shape propagation: no memory is allocated, so a 175B-parameter
   model traces on a laptop),
2. names and classifies the call (`ir.op_classify`),
3. measures FLOPs / saved tensors through a cached `OpMeter` and charges saved storages to a graph-wide
   `SavedLedger` (`ir.node_metrics`).

Step 1 is itself cached: a call identical to an earlier one (same op, module config, argument specs and
aliasing: the next block's q_proj) gets its result rebuilt from a `ResultTemplate` (`ir.result_template`:
outputs as inputs, views of an input's storage, or fresh tensors) instead of re-running the op, which is most of
the cost on 100-layer models.

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

from ir.fake_model import FakeModel, dtype_name
from ir.graph import Node, OpKind, TensorSpec
from ir.node_metrics import (
    Leaf,
    OpMeasurement,
    OpMeter,
    Role,
    SavedLedger,
    alias_index,
    attention_measurement,
    gpu_attention_layout,
    indexer_measurement,
    io_bytes,
    is_pure_view,
    module_signature,
    rms_norm_measurement,
    storage_key,
    tensor_outputs,
    value_signature,
)
from ir.op_classify import CallName, classify, name_call
from ir.result_template import ResultTemplate, leaf_signature, rebuild_like


class NodeFailure(Exception):
    """Running one graph node on fake tensors failed; carries where, for the tracer's error message."""

    def __init__(self, node_name: str, module_path: str, target: str, cause: BaseException) -> None:
        super().__init__(f"{target} in module '{module_path}' (node {node_name}): {cause}")
        self.node_name = node_name
        self.module_path = module_path
        self.target = target
        self.cause = cause


def spec_of(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in t.shape), dtype_name(t.dtype))


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
        if name.base == "scaled_dot_product_attention":
            result = gpu_attention_layout(result)
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
               value_signature((_structure(args), _structure(kwargs))), leaf_signature(leaves))
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
        logits = 0  # bytes an op moves beyond its inputs and outputs: the lightning indexer's logits
        if pure_view:
            measured = OpMeasurement(0, 0, ())
        elif classified.op_kind is OpKind.ATTENTION and name.base in ("scaled_dot_product_attention",
                                                                      "windowed_attention", "sparse_attention"):
            q, k, v = leaf_values[:3]
            measured = attention_measurement(q, k, v, outputs[0], any(t.requires_grad for t in (q, k, v)),
                                             window=dict(classified.attrs).get("window"),
                                             saves_indices=name.base == "sparse_attention")
        elif name.base == "lightning_indexer":
            measured, logits = indexer_measurement(*leaf_values[:2])
        else:
            measured = self._measure(node, name, module, args, kwargs, leaves, run)
            if classified.op_kind is OpKind.NORM and name.base == "rms_norm" and leaf_values:
                measured = rms_norm_measurement(measured, leaf_values[0],
                                                int(dict(classified.attrs).get("normalized_ndim", 1)))
        read, written = io_bytes(leaf_values, outputs, pure_view)
        read, written = read + logits, written + logits  # written for the top-k, which reads them back
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


def _replace_tensors(obj: Any, it: Iterator[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return next(it)
    if isinstance(obj, tuple | list):
        return rebuild_like(obj, [_replace_tensors(x, it) for x in obj])
    if isinstance(obj, dict):
        return {k: _replace_tensors(v, it) for k, v in obj.items()}
    return obj


def _rewrite_devices(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.device):
        return device
    if isinstance(obj, tuple | list):
        return rebuild_like(obj, [_rewrite_devices(x, device) for x in obj])
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
