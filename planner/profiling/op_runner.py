"""Calling one IR node's op on its actual arguments -- cut to one tensor-parallel shard when the variant says
so -- forward with autograd recording, then backward from random output gradients."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from costmodel.operators import has_backward
from costmodel.sharding.layout import Layout
from ir.graph import Node, OpKind
from planner.profiling.options import Statistic
from planner.profiling.timing import synchronize, tensors_in, timed_runs
from planner.profiling.variants import Variant


@dataclass
class NodeCall:
    """An fx node bound to concrete values: which arguments are IR activation inputs, which are parameters."""

    fx_node: fx.Node
    module: nn.Module | None
    args: Any
    kwargs: Any
    activations: list[torch.Tensor]
    """Tensor inputs produced by IR nodes, in `Node.input_specs` order."""
    params: list[tuple[str, torch.Tensor]]
    """(canonical parameter name, tensor) in `Node.param_names` order."""
    module_param_names: dict[str, str]
    """Canonical name -> the name inside `module` (call_module only)."""
    roles: dict[str, tuple[str, Any]]
    """fx argument node name -> ("act", None) | ("param", canonical name) | ("const", value)."""


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    x = t.detach()
    return x.requires_grad_(grad and is_float(x))


def _cut(t: torch.Tensor, layout: Layout | None, tp: int) -> torch.Tensor:
    if layout is None or not layout.is_shard:
        return t
    d = layout.dim
    if d >= t.dim() or t.shape[d] % tp:
        raise ValueError(f"cannot cut dim {d} of a {tuple(t.shape)} tensor into {tp} equal shards")
    return t.narrow(d, 0, t.shape[d] // tp).contiguous()


def _cut_param(t: torch.Tensor, dim: int | None, tp: int) -> torch.Tensor:
    if dim is None:
        return t
    if t.shape[dim] % tp:
        raise ValueError(f"cannot cut dim {dim} of a {tuple(t.shape)} parameter into {tp} equal shards")
    return t.narrow(dim, 0, t.shape[dim] // tp).contiguous()


class Runner:
    """Builds a call of one node on leaf copies of (cut) tensors and times its forward and backward."""

    def __init__(self, call: NodeCall, node: Node, variant: Variant, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.call, self.node, self.variant, self.clock = call, node, variant, clock
        st, tp = variant.strategy, variant.tp
        if st is not None and len(st.inputs) != len(call.activations):
            raise ValueError(f"strategy {st.name} has {len(st.inputs)} input layouts, the node reads "
                             f"{len(call.activations)} tensors")
        layouts = st.inputs if st is not None else (None,) * len(call.activations)
        dims = st.param_dims if st is not None and st.param_dims else (None,) * len(call.params)
        self.backward = has_backward(node)
        self.acts = [_leaf(_cut(t, lay, tp), self.backward) for t, lay in zip(call.activations, layouts, strict=True)]
        self.params = [(n, _leaf(_cut_param(p, d, tp), self.backward))
                       for (n, p), d in zip(call.params, dims, strict=True)]
        if node.op_kind is OpKind.EMBEDDING and self.params and dims[0] == 0:
            # Vocab-parallel embedding: each device looks up the ids in its row range and zeroes the rest; wrapping
            # the ids into the local table does the same work without indexing out of range.
            rows = self.params[0][1].shape[0]
            self.acts = [a.remainder(rows) if not is_float(a) else a for a in self.acts]
        self.inplace = False

    def working_set_bytes(self) -> int:
        tensors = [*self.acts, *(p for _, p in self.params)]
        return 3 * sum(t.numel() * t.element_size() for t in tensors)

    def _inputs(self) -> list[torch.Tensor]:
        # An in-place op may not write into a leaf that requires grad: give it a non-leaf copy (outside the timing)
        return [a.clone() if self.inplace and a.requires_grad else a for a in self.acts]

    def forward(self, acts: list[torch.Tensor]) -> Any:
        call = self.call
        it = iter(acts)
        pvals = dict(self.params)

        def value(n: fx.Node) -> Any:
            kind, payload = call.roles[n.name]
            if kind == "act":
                return next(it)
            return pvals[payload] if kind == "param" else payload

        args = map_values(call.args, value)
        kwargs = map_values(call.kwargs, value)
        node = call.fx_node
        if node.op == "call_module":
            assert call.module is not None
            state = {call.module_param_names[name]: t for name, t in self.params}
            return torch.func.functional_call(call.module, state, tuple(args), dict(kwargs))
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)  # type: ignore[operator]

    def run_once(self) -> tuple[float, float]:
        acts = self._inputs()
        clock = self.clock
        with torch.enable_grad():
            t0 = clock()
            out = self.forward(acts)
            synchronize(out)
            fwd = clock() - t0
        if not self.backward:
            return fwd, 0.0
        outs = [o for o in tensors_in(out) if o.requires_grad and o.grad_fn is not None]
        if not outs:
            return fwd, 0.0
        grads = [torch.randn_like(o) for o in outs]
        t0 = clock()
        torch.autograd.backward(outs, grads)
        synchronize(outs[0])
        bwd = clock() - t0
        for t in (*self.acts, *(p for _, p in self.params)):
            t.grad = None
        return fwd, bwd

    def measure(self, warmup: int, repeats: int, statistic: Statistic | None = None, min_window_s: float = 0.0
                ) -> tuple[float, float, int]:
        """(forward s, backward s, timed runs): `statistic` over at least `repeats` runs and, for the mean, over
        runs totalling at least `min_window_s` (so that time slices lost to other processes are included in the
        proportion they occur)."""
        statistic = Statistic(statistic or Statistic.MEDIAN)
        try:
            self.run_once()
        except RuntimeError as e:
            if "in-place" not in str(e) and "inplace" not in str(e):
                raise
            self.inplace = True
            self.run_once()
        return timed_runs(self.run_once, max(warmup - 1, 0), repeats, statistic, min_window_s)


def map_values(obj: Any, value: Callable[[fx.Node], Any]) -> Any:
    if isinstance(obj, fx.Node):
        return value(obj)
    if isinstance(obj, tuple):
        items = [map_values(x, value) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [map_values(x, value) for x in obj]
    if isinstance(obj, dict):
        return {k: map_values(v, value) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(map_values(obj.start, value), map_values(obj.stop, value), map_values(obj.step, value))
    return obj
