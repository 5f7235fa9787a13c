"""Measure a model's operators on the local device and store them as a `costmodel.profile_db.OpProfile`.

What is timed. A model is traced twice from the same module: `ir.trace` gives the IR nodes the cost model prices,
and a torch.fx symbolic trace with the same leaf modules (`ir.op_classify.LEAF_MODULE_TYPES`) gives a runnable
graph whose node names are the IR node names. The fx graph is interpreted on real tensors once per micro-batch
size; at each node, every profile key the cost model may look up for it and that micro-batch is measured on the
node's actual arguments:

- replicated (tp == 1) keys, as `costmodel.layer_pricing.price_segment` asks for them: scales mbs / traced batch;
- sharded keys (tp > 1), as the intra-operator pricer (`costmodel.sharding_cost.build_sharding_model`) asks for
  them: the segment of each layer class is priced with a recording pricer, which yields, per node strategy, the
  exact (flops, bytes, params) scales of its lookup; the strategy's input layouts and parameter dims say which
  tensors to cut, so the op runs on its per-device shard (the first of tp equal chunks). A strategy whose op cannot
  run on the cut tensors (a view with a hard-coded shape) is skipped and reported; the analytical model prices it.

How it is timed. Forward: the op called on leaf copies of its arguments with autograd recording, as in training;
backward: `torch.autograd.backward` from the op's outputs with random output gradients, minus the autograd engine's
fixed cost of starting a backward pass (measured once, `backward_pass_overhead_s` in the profile's meta: in a
training step that cost is paid once per step, not once per op). Each key is run `warmup` times, then the median
of `repeats` timed runs is stored -- or, with `Statistic.MEAN`, the mean over runs that add up to at least
`min_window_s`. Ops whose tensors would exceed `memory_budget_bytes` are skipped and reported.

`concurrent` > 1 runs the same measurement in that many processes at once and keeps the median over them: a
cluster such as `1x4xcpu` runs four ranks on this machine's two cores, which also share caches and memory
bandwidth. On the CPU with one intra-op thread the clock is the thread's CPU time (`compute_clock`): a run is
not charged for the slices other processes take from its core, so ops and whole layers alike measure the speed of
a rank with a core to itself. (The wall clock did so only for runs shorter than a time slice: a whole GPT block
at micro-batch 4 measured up to 2x, and its glue -- block minus ops -- 40x.) A training step pays for sharing
the cores; the cluster states how many a node has (`DeviceGroup.host_cores`). The mean over a wall-clock window
of several slices (other devices, or several threads) pays for the sharing directly -- but also for whatever else
runs on the machine at that moment.

Collectives (`measure_collectives`) are timed in a spawned gloo (CPU) or NCCL (GPU) process group of 2..K ranks at
several sizes, and fitted with `costmodel.collective_fit`.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from costmodel.collective_fit import CollectiveProfile, CollectiveSample
from costmodel.collectives import Collective
from costmodel.operators import has_backward
from costmodel.profile_db import OpProfile, OpTiming, op_signature, segment_signature
from costmodel.sharding import Layout
from costmodel.sharding_cost import Pricer, build_sharding_model
from costmodel.sharding_rules import NodeStrategy
from ir.graph import Graph, Node, OpKind
from ir.layer_chain import LayerChain
from ir.op_classify import LEAF_MODULE_TYPES


class Statistic(enum.StrEnum):
    """How repeated timings of one op become its profile value."""

    MEDIAN = "median"
    """The typical run on a device the process has to itself: outliers (preemption, interrupts) do not count."""
    MEAN = "mean"
    """The expected run when processes share cores: the time slices lost to the others count in proportion."""


def parse_statistic(value: Statistic | str) -> Statistic:
    try:
        return Statistic(value)
    except ValueError:
        raise ValueError(f"unknown statistic {value!r}; valid: {', '.join(s.value for s in Statistic)}") from None


MAX_TIMED_RUNS = 5000
DEFAULT_MEMORY_BUDGET_BYTES = 2 * 1024 ** 3
"""Largest working set (inputs, outputs, parameters and their gradients) of one timed op: 2 GiB keeps several
concurrent profiling processes inside this build machine's 23 GiB."""


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What to measure and how."""

    microbatch_sizes: tuple[int, ...] = (1,)
    """Micro-batch sizes to measure; profile keys are relative to a trace at `traced_batch`."""
    traced_batch: int = 1
    """Batch size of the trace the cost model prices (`stratagem plan` traces at batch 1)."""
    tp_degrees: tuple[int, ...] = (1,)
    """Tensor-parallel degrees whose per-device op shards are measured too (1: replicated only)."""
    warmup: int = 3
    repeats: int = 11
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    dtype: str | None = None
    """The training dtype: the model is traced in it (the keys carry the traced dtypes, as `stratagem plan --dtype`
    traces) and its ops run in it (floating parameters and inputs cast). None keeps the model's own."""
    threads: int | None = 1
    """torch intra-op threads (torchrun gives each rank one); None leaves torch's default."""
    statistic: Statistic = Statistic.MEDIAN
    min_window_s: float = 0.0
    """With the mean: keep timing an op until its runs add up to this many seconds (several scheduler time
    slices, so that sharing the cores is sampled fairly)."""

    def __post_init__(self) -> None:
        for name in ("traced_batch", "warmup", "repeats", "memory_budget_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("microbatch_sizes", "tp_degrees"):
            values = tuple(getattr(self, name))
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise ValueError(f"{name} must be positive integers, got {values!r}")
            object.__setattr__(self, name, tuple(sorted(set(values))))
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        object.__setattr__(self, "statistic", parse_statistic(self.statistic))
        if not 0 <= self.min_window_s < math.inf:
            raise ValueError(f"min_window_s must be a finite number >= 0, got {self.min_window_s!r}")


@dataclass(frozen=True, slots=True)
class SkippedOp:
    """A profile key that was not measured, and why (the analytical model prices it)."""

    node: str
    signature: str
    reason: str


@dataclass(frozen=True)
class ProfileRun:
    """The result of profiling one or more models."""

    profile: OpProfile
    skipped: tuple[SkippedOp, ...] = ()
    measured_ops: int = 0
    seconds: float = 0.0
    models: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------------------
# Runnable fx graph with the IR's node names
# ---------------------------------------------------------------------------------------------------------------


class _LeafTracer(fx.Tracer):
    """Keeps the same torch.nn building blocks whole as `ir.trace` does, so fx node names equal IR node names."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, LEAF_MODULE_TYPES)


def runnable_graph(model: nn.Module, num_inputs: int) -> fx.GraphModule:
    """An fx GraphModule of `model` called with `num_inputs` positional tensors (unused optional arguments are
    specialized to their defaults, as `ir.trace` does)."""
    concrete: dict[str, Any] = {}
    params = [p for p in inspect.signature(model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for p in params[num_inputs:]:
        if p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
    graph = _LeafTracer().trace(model, concrete_args=concrete or None)
    return fx.GraphModule(model, graph)


# ---------------------------------------------------------------------------------------------------------------
# Which keys each node needs
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    """One profile key of one node: its signature and the strategy whose per-device shard it prices."""

    signature: str
    tp: int = 1
    strategy: NodeStrategy | None = None
    """None: the node as traced (replicated)."""


def replicated_variant(node: Node, mbs: int, traced_batch: int) -> Variant:
    scale = mbs / traced_batch
    return Variant(op_signature(node, flops_scale=scale, bytes_scale=scale))


class RecordingPricer:
    """A `Pricer` that records the scales of every node lookup and prices nothing (all zeros)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float, float]] = []

    def node_time(self, node: Node, flops_scale: float, bytes_scale: float, param_scale: float
                  ) -> tuple[float, float]:
        self.calls.append((node.name, flops_scale, bytes_scale, param_scale))
        return 0.0, 0.0

    def pricer(self) -> Pricer:
        return Pricer(node_time=self.node_time, move_time=lambda move, nbytes: 0.0)


def sharded_variants(chain: LayerChain, *, tp: int, mbs: int, dtype: str) -> dict[str, list[Variant]]:
    """Node name -> the keys the intra-operator pricer looks up at this tp and micro-batch, with and without
    sequence parallelism, for the representative segment of every layer class."""
    out: dict[str, list[Variant]] = {}
    for cid in sorted({s.class_id for s in chain.segments}):
        nodes = chain.nodes_of(chain.representative(cid))
        for sp in (False, True):
            rec = RecordingPricer()
            model = build_sharding_model(nodes, tp=tp, sequence_parallel=sp, traced_batch=chain.graph.batch_size,
                                         microbatch_size=mbs, pricer=rec.pricer(), dtype=dtype)
            options = [(n, o) for n, opts in zip(nodes, model.options, strict=True) for o in opts]
            if len(options) != len(rec.calls):
                raise RuntimeError(f"the sharding pricer made {len(rec.calls)} node lookups for {len(options)} "
                                   "options; the recording no longer matches build_sharding_model")
            for (node, option), (name, fs, bs, ps) in zip(options, rec.calls, strict=True):
                if name != node.name:
                    raise RuntimeError(f"sharding pricer lookup order changed ({name} vs {node.name})")
                sig = op_signature(node, flops_scale=fs, bytes_scale=bs, param_scale=ps)
                strategy = None if option.strategy.is_replicated else option.strategy
                out.setdefault(node.name, []).append(Variant(sig, tp, strategy))
    return out


def variants_by_node(graph: Graph, chain: LayerChain | None, *, mbs: int, traced_batch: int,
                     tp_degrees: Sequence[int], dtype: str) -> dict[str, list[Variant]]:
    """Every key to measure per node name at micro-batch `mbs` (first occurrence of a signature wins)."""
    out: dict[str, list[Variant]] = {}
    for node in graph.nodes:
        if node.op_kind in (OpKind.PLACEHOLDER, OpKind.OUTPUT):
            continue
        out[node.name] = [replicated_variant(node, mbs, traced_batch)]
    if chain is not None:
        for tp in tp_degrees:
            if tp == 1:
                continue
            for name, vs in sharded_variants(chain, tp=tp, mbs=mbs, dtype=dtype).items():
                out.setdefault(name, []).extend(vs)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Calling one node on (possibly cut) tensors
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _NodeCall:
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


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    x = t.detach()
    return x.requires_grad_(grad and _is_float(x))


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


class _Runner:
    """Builds a call of one node on leaf copies of (cut) tensors and times its forward and backward."""

    def __init__(self, call: _NodeCall, node: Node, variant: Variant, clock: Callable[[], float] = time.perf_counter
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
            self.acts = [a.remainder(rows) if not _is_float(a) else a for a in self.acts]
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

        args = _map_values(call.args, value)
        kwargs = _map_values(call.kwargs, value)
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
            _sync(out)
            fwd = clock() - t0
        if not self.backward:
            return fwd, 0.0
        outs = [o for o in _tensors(out) if o.requires_grad and o.grad_fn is not None]
        if not outs:
            return fwd, 0.0
        grads = [torch.randn_like(o) for o in outs]
        t0 = clock()
        torch.autograd.backward(outs, grads)
        _sync(outs[0])
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


def timed_runs(run_once: Callable[[], tuple[float, float]], warmup: int, repeats: int, statistic: Statistic,
               min_window_s: float) -> tuple[float, float, int]:
    """(forward s, backward s, timed runs) of `run_once` after `warmup` untimed runs: the median of `repeats`
    runs, or the mean over at least `repeats` runs that add up to at least `min_window_s`."""
    for _ in range(warmup):
        run_once()
    runs = [run_once() for _ in range(repeats)]
    if statistic is Statistic.MEDIAN:
        return statistics.median(f for f, _ in runs), statistics.median(b for _, b in runs), len(runs)
    total = sum(f + b for f, b in runs)
    while total < min_window_s and len(runs) < MAX_TIMED_RUNS:
        runs.append(run_once())
        total += sum(runs[-1])
    return statistics.fmean(f for f, _ in runs), statistics.fmean(b for _, b in runs), len(runs)


def _map_values(obj: Any, value: Callable[[fx.Node], Any]) -> Any:
    if isinstance(obj, fx.Node):
        return value(obj)
    if isinstance(obj, tuple):
        items = [_map_values(x, value) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [_map_values(x, value) for x in obj]
    if isinstance(obj, dict):
        return {k: _map_values(v, value) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(_map_values(obj.start, value), _map_values(obj.stop, value), _map_values(obj.step, value))
    return obj


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _sync(value: Any) -> None:
    ts = _tensors(value)
    if ts and ts[0].device.type == "cuda":
        torch.cuda.synchronize(ts[0].device)


def compute_clock(device: torch.device, options: ProfileOptions) -> Callable[[], float]:
    """The clock that times compute on `device`: on the CPU with one intra-op thread, the thread's CPU time (time
    slices taken by other processes on the core are not the op's; autograd runs a CPU backward on the calling
    thread); otherwise -- several threads, an accelerator (synchronized by `_sync`), or a mean over a window
    that is meant to sample the sharing -- the wall clock."""
    if device.type == "cpu" and options.threads == 1 and options.min_window_s == 0:
        return time.thread_time
    return time.perf_counter


# ---------------------------------------------------------------------------------------------------------------
# The backward-pass overhead
# ---------------------------------------------------------------------------------------------------------------


def backward_pass_overhead(device: torch.device, repeats: int = 51,
                           clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds the autograd engine spends starting one backward pass, beyond the per-node work: backward of a
    1-node graph minus the per-node cost measured from a 9-node chain (both on one-element tensors)."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain(n: int) -> float:
        y = x
        for _ in range(n):
            y = y * 1.0
        g = torch.ones_like(y)
        t0 = clock()
        y.backward(g)
        _sync(x)
        return clock() - t0

    for _ in range(5):
        chain(1), chain(9)
    one = statistics.median(chain(1) for _ in range(repeats))
    nine = statistics.median(chain(9) for _ in range(repeats))
    per_node = max((nine - one) / 8, 0.0)
    return max(one - per_node, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Profiling a model
# ---------------------------------------------------------------------------------------------------------------


def _repeat_batch(inputs: Sequence[torch.Tensor], traced_batch: int, mbs: int) -> tuple[torch.Tensor, ...]:
    """Inputs for a micro-batch of `mbs` samples from inputs of `traced_batch`: tile or cut the leading dim."""
    out = []
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == traced_batch:
            reps = -(-mbs // traced_batch)
            t = t.repeat(reps, *([1] * (t.dim() - 1)))[:mbs].contiguous()
        out.append(t)
    return tuple(out)


def _cast(model: nn.Module, inputs: Sequence[torch.Tensor], dtype: str | None
          ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    if dtype is None:
        return model, tuple(inputs)
    dt = getattr(torch, dtype)
    model = model.to(dt)
    return model, tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)


class _Collector(fx.Interpreter):
    """Interprets the fx graph on real tensors and hands each IR node's bound call to `visit`."""

    def __init__(self, gm: fx.GraphModule, graph: Graph, visit: Callable[[_NodeCall, Node], None]) -> None:
        super().__init__(gm)
        self.ir = {n.name: n for n in graph.nodes}
        self.visit = visit
        self.modules = dict(gm.named_modules(remove_duplicate=False))
        self.canonical: dict[int, str] = {}
        for name, p in gm.named_parameters():
            self.canonical.setdefault(id(p), name)

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        node = self.ir.get(n.name)
        if node is not None and n.op in ("call_function", "call_method", "call_module"):
            self.visit(self._bind(n, node), node)
        return result

    def _bind(self, n: fx.Node, node: Node) -> _NodeCall:
        # How each fx argument is substituted when the node is re-run: activation, parameter or constant value.
        roles: dict[str, tuple[str, Any]] = {}
        activations: list[torch.Tensor] = []
        params: dict[str, torch.Tensor] = {}

        def visit(a: fx.Node) -> Any:
            value = self.env[a]
            if a.op == "get_attr" and isinstance(value, nn.Parameter):
                name = self.canonical.get(id(value), str(a.target))
                roles[a.name] = ("param", name)
                params[name] = value
            elif a.name in self.ir and isinstance(value, torch.Tensor):
                roles[a.name] = ("act", None)
                activations.append(value)
            else:
                roles[a.name] = ("const", value)
            return value

        _map_values(n.args, visit)
        _map_values(n.kwargs, visit)
        module = self.modules[str(n.target)] if n.op == "call_module" else None
        module_names: dict[str, str] = {}
        if module is not None:
            for local, p in module.named_parameters(remove_duplicate=False):
                name = self.canonical.get(id(p), local)
                module_names.setdefault(name, local)
                params.setdefault(name, p)
        ordered = [(name, params[name]) for name in node.param_names if name in params]
        if len(ordered) != len(node.param_names):
            ordered = list(params.items())
        return _NodeCall(n, module, n.args, n.kwargs, activations, ordered, module_names, roles)


@dataclass
class _Accumulator:
    device_name: str
    options: ProfileOptions
    overhead_s: float
    clock: Callable[[], float] = time.perf_counter
    """`compute_clock` of the profiled device."""
    timings: dict[str, OpTiming] = field(default_factory=dict)
    skipped: dict[str, SkippedOp] = field(default_factory=dict)

    def measure(self, call: _NodeCall, node: Node, variants: Sequence[Variant]) -> None:
        for v in variants:
            if v.signature in self.timings or v.signature in self.skipped:
                continue
            if v.tp > 1 and len(call.activations) != len(node.input_specs):
                self._skip(node, v, f"the node reads {len(call.activations)} tensors at run time but "
                                    f"{len(node.input_specs)} in the trace")
                continue
            try:
                runner = _Runner(call, node, v, self.clock)
                if runner.working_set_bytes() > self.options.memory_budget_bytes:
                    self._skip(node, v, f"working set {runner.working_set_bytes() / 2 ** 30:.2f} GiB exceeds the "
                                        f"memory budget {self.options.memory_budget_bytes / 2 ** 30:.2f} GiB")
                    continue
                fwd, bwd, runs = runner.measure(self.options.warmup, self.options.repeats, self.options.statistic,
                                                self.options.min_window_s)
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                if v.strategy is None:
                    raise
                self._skip(node, v, f"{v.strategy.name} at tp={v.tp} does not run on cut tensors: "
                                    f"{' '.join(str(e).split())[:160]}")
                continue
            if bwd > 0:
                bwd = max(bwd - self.overhead_s, 0.0)
            self.timings[v.signature] = OpTiming(fwd, bwd, samples=runs)

    def _skip(self, node: Node, v: Variant, reason: str) -> None:
        self.skipped[v.signature] = SkippedOp(node.name, v.signature, reason)


def _trace(model: nn.Module, inputs: Sequence[torch.Tensor], name: str, dtype: str | None
           ) -> tuple[Graph, LayerChain | None]:
    import ir

    graph = ir.trace(model, tuple(inputs), model_name=name, dtype=dtype)
    try:
        chain = ir.build_layer_chain(graph)
    except ValueError:
        chain = None
    return graph, chain


def profile_module(model: nn.Module, example_inputs: Sequence[torch.Tensor], *, name: str, device_name: str,
                   options: ProfileOptions, overhead_s: float | None = None) -> ProfileRun:
    """Profile `model` (on a real device, weights materialized) whose `example_inputs` hold
    `options.traced_batch` samples. Returns the measured `OpProfile` keyed by `device_name`."""
    started = time.perf_counter()
    with _threads(options.threads):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "meta":
            raise ValueError("profile_module needs a model with real weights, not one on the meta device")
        # Keys come from a trace in the training dtype, as `stratagem plan --dtype` traces (planner.cli.common.
        # trace_chain); the ops then run in that dtype too.
        graph, chain = _trace(model, example_inputs, name, options.dtype)
        model, example_inputs = _cast(model, example_inputs, options.dtype)
        gm = runnable_graph(model, len(example_inputs))
        missing = sorted(n.name for n in graph.nodes
                         if n.op_kind not in (OpKind.PLACEHOLDER, OpKind.OUTPUT)
                         and n.name not in {x.name for x in gm.graph.nodes})
        if missing:
            raise ValueError(f"the fx graph of {name} lacks IR nodes {missing[:5]}; the model was traced with "
                             "torch.export, which the profiler cannot re-run")
        clock = compute_clock(device, options)
        overhead = backward_pass_overhead(device, clock=clock) if overhead_s is None else overhead_s
        acc = _Accumulator(device_name, options, overhead, clock)
        dtype = graph.dtype
        for mbs in options.microbatch_sizes:
            scale = mbs / options.traced_batch
            held = scale * sum(s.nbytes for n in graph.nodes for s in n.output_specs)
            variants = variants_by_node(graph, chain, mbs=mbs, traced_batch=options.traced_batch,
                                        tp_degrees=options.tp_degrees, dtype=dtype)
            if held > options.memory_budget_bytes:
                for node in graph.nodes:
                    for v in variants.get(node.name, ()):
                        acc._skip(node, v, f"micro-batch {mbs}: the forward's activations ({held / 2 ** 30:.2f} GiB) "
                                           "exceed the memory budget")
                continue
            inputs = _repeat_batch(example_inputs, options.traced_batch, mbs)

            def visit(call: _NodeCall, node: Node, variants: Mapping[str, list[Variant]] = variants) -> None:
                acc.measure(call, node, variants.get(node.name, ()))

            with torch.no_grad():
                _Collector(gm, graph, visit).run(*inputs)
            if chain is not None:
                _measure_segment_glue(model, chain, inputs, mbs=mbs, traced_batch=options.traced_batch,
                                      acc=acc, dtype=dtype)
        meta = {"model": name, "traced_batch": str(options.traced_batch),
                "microbatch_sizes": ",".join(map(str, options.microbatch_sizes)),
                "tp_degrees": ",".join(map(str, options.tp_degrees)), "dtype": options.dtype or graph.dtype,
                "statistic": options.statistic.value, "min_window_s": f"{options.min_window_s:g}",
                "backward_pass_overhead_s": f"{overhead:.6g}"}
    profile = OpProfile.from_timings(((device_name, s, t) for s, t in acc.timings.items()), meta=meta)
    return ProfileRun(profile=profile, skipped=tuple(acc.skipped[k] for k in sorted(acc.skipped)),
                      measured_ops=sum(1 for k in acc.timings if not k.startswith("segment|")), seconds=time.perf_counter() - started, models=(name,))


def _segment_module(model: nn.Module, name: str) -> nn.Module | None:
    """The module a segment is named after ("blocks.3"), when it is a proper submodule of `model`."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return module if module is not model and isinstance(module, nn.Module) else None


def _measure_segment_glue(model: nn.Module, chain: LayerChain, inputs: Sequence[torch.Tensor], *, mbs: int,
                          traced_batch: int, acc: _Accumulator, dtype: str) -> None:
    """Per layer class whose segment is one module: its forward and backward run whole, minus the sum of its
    ops' profiled (replicated) times at this micro-batch: the glue between the ops that per-op timing misses
    (module calls, reshapes in Python, autograd bookkeeping; ~1 ms per layer and micro-batch on CPU for a small
    GPT block). Stored under `profile_db.segment_signature`, clamped at 0."""
    for cid in sorted({s.class_id for s in chain.segments}):
        segment = chain.representative(cid)
        key = segment_signature(segment.structural_hash, mbs, dtype)
        module = _segment_module(model, segment.name)
        if module is None or key in acc.timings:
            continue
        sigs = [replicated_variant(n, mbs, traced_batch).signature for n in chain.nodes_of(segment)
                if n.op_kind not in (OpKind.PLACEHOLDER, OpKind.OUTPUT)]
        if any(sig not in acc.timings for sig in sigs if sig not in acc.skipped):
            continue
        captured: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def grab(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: list[tuple[tuple[Any, ...], dict[str, Any]]] = captured) -> None:
            out.append((args, kwargs))

        handle = module.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                model(*inputs)
        finally:
            handle.remove()
        if len(captured) != 1:  # called more than once (shared module) or not at all: not one segment
            continue
        whole = _time_module(module, *captured[0], acc.options, acc.clock)
        ops_f = sum(acc.timings[sig].forward_s for sig in sigs if sig in acc.timings)
        ops_b = sum(acc.timings[sig].backward_s for sig in sigs if sig in acc.timings)
        acc.timings[key] = OpTiming(max(whole[0] - ops_f, 0.0), max(whole[1] - acc.overhead_s - ops_b, 0.0),
                                    samples=whole[2])


def _time_module(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], options: ProfileOptions,
                 clock: Callable[[], float] = time.perf_counter) -> tuple[float, float, int]:
    """Forward and backward seconds of `module` on leaf copies of `args` (random output gradients), with the
    options' statistic as `_Runner.measure` applies it to single ops."""
    def leaf(v: Any) -> Any:
        return v.detach().requires_grad_(_is_float(v)) if isinstance(v, torch.Tensor) else v

    def run_once() -> tuple[float, float]:
        a = tuple(leaf(v) for v in args)
        k = {n: leaf(v) for n, v in kwargs.items()}
        t0 = clock()
        out = module(*a, **k)
        _sync(out)
        t1 = clock()
        outs = [t for t in _tensors(out) if t.requires_grad]
        grads = [torch.randn_like(t) for t in outs]
        t2 = clock()
        torch.autograd.backward(outs, grads)
        _sync(a)
        t3 = clock()
        module.zero_grad(set_to_none=True)
        return t1 - t0, t3 - t2

    return timed_runs(run_once, options.warmup, options.repeats, options.statistic, options.min_window_s)


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------------------
# The standard set (no model given)
# ---------------------------------------------------------------------------------------------------------------


class StandardOps(nn.Module):
    """GEMMs and elementwise / normalization ops of a transformer MLP at one width: what `stratagem profile`
    measures when no model is given (a width sweep shows the device's GEMM efficiency curve)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        return x + self.down(self.act(self.up(self.norm(x))))


STANDARD_WIDTHS: tuple[int, ...] = (128, 256, 512, 1024)
STANDARD_TOKENS = 256


def standard_modules(device: torch.device) -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for h in STANDARD_WIDTHS:
        torch.manual_seed(h)
        module = StandardOps(h).to(device)
        x = torch.randn(1, STANDARD_TOKENS, h, generator=gen).to(device)
        out.append((f"standard-mlp-{h}", module, (x,)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------------------------------------------

DEFAULT_COLLECTIVE_SIZES: tuple[int, ...] = (4 * 1024, 64 * 1024, 1024 ** 2, 4 * 1024 ** 2, 16 * 1024 ** 2)
"""Bytes per device: from latency-bound (4 KiB) to bandwidth-bound (16 MiB) on gloo."""
DEFAULT_COLLECTIVE_KINDS: tuple[Collective, ...] = (
    Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL,
    Collective.BROADCAST, Collective.SEND_RECV)


@dataclass(frozen=True, kw_only=True)
class CollectiveOptions:
    """What `measure_collectives` times. Default: one process group of every size 2..`max_ranks`, each in its own
    spawn of that many processes. With `processes` = K, K processes are spawned once and every group size n that
    divides K is measured with all K/n groups of consecutive ranks running at once -- how the data- and
    tensor-parallel groups of a K-process CPU cluster share its cores."""

    max_ranks: int = 2
    processes: int | None = None
    sizes: tuple[int, ...] = DEFAULT_COLLECTIVE_SIZES
    kinds: tuple[Collective, ...] = DEFAULT_COLLECTIVE_KINDS
    warmup: int = 2
    repeats: int = 7
    statistic: Statistic = Statistic.MEDIAN
    device_name: str = "cpu"
    use_cuda: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_ranks, int) or self.max_ranks < 2:
            raise ValueError(f"collectives need at least 2 processes, got {self.max_ranks!r}")
        if self.processes is not None and (not isinstance(self.processes, int) or self.processes < 2):
            raise ValueError(f"collectives need at least 2 processes, got {self.processes!r}")
        if not self.sizes or any(s < 16 for s in self.sizes):
            raise ValueError(f"collective sizes must be >= 16 bytes, got {self.sizes!r}")
        object.__setattr__(self, "kinds", tuple(Collective(k) for k in self.kinds))
        object.__setattr__(self, "statistic", parse_statistic(self.statistic))


def free_port() -> int:
    """A free local TCP port for a spawned process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collective_call(kind: Collective, nbytes: int, group: Any, ranks: Sequence[int], rank: int,
                     device: torch.device) -> Callable[[], None]:
    import torch.distributed as dist

    n = len(ranks)
    numel = max(nbytes // 4 // n * n, n)  # float32 elements, divisible by the group size
    x = torch.ones(numel, device=device)
    if kind is Collective.ALL_REDUCE:
        return lambda: dist.all_reduce(x, group=group)
    if kind is Collective.ALL_GATHER:  # nbytes is the gathered output
        out, part = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, part, group=group)
    if kind is Collective.REDUCE_SCATTER:  # nbytes is the input
        out = torch.empty(numel // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, x, group=group)
    if kind is Collective.ALL_TO_ALL:
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind is Collective.BROADCAST:
        return lambda: dist.broadcast(x, ranks[0], group=group)

    def send_recv() -> None:  # SEND_RECV: the group's first rank -> its second (the others idle)
        if rank == ranks[0]:
            dist.send(x, ranks[1], group=group)
        elif rank == ranks[1]:
            dist.recv(x, ranks[0], group=group)
    return send_recv


def divisor_group_sizes(processes: int) -> tuple[int, ...]:
    """Every group size >= 2 that divides `processes` (all groups of that size run at once)."""
    return tuple(g for g in range(2, processes + 1) if processes % g == 0)


def _group_sizes(world: int, options: CollectiveOptions) -> tuple[int, ...]:
    if options.processes is None:
        return (world,)
    return divisor_group_sizes(world)


def _collective_worker(rank: int, world: int, port: int, options: CollectiveOptions, result_path: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    device = torch.device(f"cuda:{rank}") if options.use_cuda else torch.device("cpu")
    if options.use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if options.use_cuda else "gloo", rank=rank, world_size=world)
    rows = []
    try:
        for n in _group_sizes(world, options):
            # every rank creates every group (new_group's contract), then uses the one holding it
            groups = [(dist.new_group(list(range(s, s + n))), list(range(s, s + n))) for s in range(0, world, n)]
            group, ranks = groups[rank // n]
            rows += _time_group(n, group, ranks, rank, options, device)
        if rank == 0:
            Path(result_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _time_group(n: int, group: Any, ranks: Sequence[int], rank: int, options: CollectiveOptions,
                device: torch.device) -> list[dict[str, Any]]:
    import torch.distributed as dist

    rows = []
    for kind in options.kinds:
        for nbytes in options.sizes:
            fn = _collective_call(kind, nbytes, group, ranks, rank, device)
            times = []
            for i in range(options.warmup + options.repeats):
                dist.barrier()
                _sync_device(device)
                t0 = time.perf_counter()
                fn()
                _sync_device(device)
                t = time.perf_counter() - t0
                if i >= options.warmup:
                    times.append(t)
            slowest = torch.tensor(times, dtype=torch.float64).to(device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its last rank is done
            numel = max(nbytes // 4 // n * n, n)
            value = (statistics.median if options.statistic is Statistic.MEDIAN else statistics.fmean)(
                slowest.cpu().tolist())
            rows.append({"kind": kind.value, "group_size": n, "nbytes": numel * 4, "seconds": value})
    return rows


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_collectives(options: CollectiveOptions) -> list[CollectiveSample]:
    """Time every kind x size (median over repeats of the slowest rank's time) in the process groups
    `CollectiveOptions` describes."""
    import torch.multiprocessing as mp

    samples = []
    backend = "nccl" if options.use_cuda else "gloo"
    worlds = range(2, options.max_ranks + 1) if options.processes is None else (options.processes,)
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "collectives.json")
            mp.spawn(_collective_worker, args=(world, free_port(), options, path), nprocs=world, join=True)
            rows = json.loads(Path(path).read_text())
        for r in rows:
            samples.append(CollectiveSample(kind=Collective(r["kind"]), group_size=int(r["group_size"]),
                                            nbytes=float(r["nbytes"]),
                                            seconds=float(r["seconds"]), device=options.device_name,
                                            backend=backend, repeats=options.repeats))
    return samples


def collective_profile(options: CollectiveOptions) -> CollectiveProfile:
    return CollectiveProfile.from_samples(measure_collectives(options))


# ---------------------------------------------------------------------------------------------------------------
# Concurrent op profiling (several processes at once)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRequest:
    """A model to build in a worker process: a zoo / registry name with overrides, or the standard set."""

    name: str
    sets: tuple[str, ...] = ()
    seq: int | None = None


def build_request(request: ModelRequest, batch: int, device: torch.device
                  ) -> list[tuple[str, nn.Module, tuple[torch.Tensor, ...]]]:
    if request.name == STANDARD_SET:
        return standard_modules(device)
    from models.registry import build_model

    torch.manual_seed(0)
    built = build_model(request.name, request.sets, batch=batch, seq=request.seq, device=str(device))
    return [(request.name, built.module, tuple(built.example_inputs))]


STANDARD_SET = "standard"
"""`ModelRequest.name` of the standard GEMM / elementwise set."""


def profile_requests(requests: Sequence[ModelRequest], *, device: torch.device, device_name: str,
                     options: ProfileOptions) -> ProfileRun:
    """Profile every requested model in this process and merge the results."""
    started = time.perf_counter()
    profile = OpProfile()
    skipped: list[SkippedOp] = []
    measured = 0
    names: list[str] = []
    with _threads(options.threads):
        overhead = backward_pass_overhead(device, clock=compute_clock(device, options))
    for req in requests:
        for name, module, inputs in build_request(req, options.traced_batch, device):
            run = profile_module(module, inputs, name=name, device_name=device_name, options=options,
                                 overhead_s=overhead)
            profile = profile.merged(OpProfile(entries={k: v for k, v in run.profile.entries.items()
                                                        if k not in profile.entries}))
            skipped += run.skipped
            measured += run.measured_ops
            names.append(name)
    meta = {**run_meta(device, options), "models": ",".join(names), "backward_pass_overhead_s": f"{overhead:.6g}"}
    return ProfileRun(profile=OpProfile(entries=profile.entries, meta=meta), skipped=tuple(skipped),
                      measured_ops=measured, seconds=time.perf_counter() - started, models=tuple(names))


def run_meta(device: torch.device, options: ProfileOptions) -> dict[str, str]:
    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "device": str(device), "threads": str(options.threads or torch.get_num_threads()),
            "traced_batch": str(options.traced_batch),
            "microbatch_sizes": ",".join(map(str, options.microbatch_sizes)),
            "tp_degrees": ",".join(map(str, options.tp_degrees)), "dtype": options.dtype or "as built",
            "warmup": str(options.warmup), "repeats": str(options.repeats),
            "statistic": options.statistic.value, "min_window_s": f"{options.min_window_s:g}"}


def _profile_worker(rank: int, requests: Sequence[ModelRequest], device_name: str, options: ProfileOptions,
                    out_dir: str) -> None:
    run = profile_requests(requests, device=torch.device("cpu"), device_name=device_name, options=options)
    run.profile.save(os.path.join(out_dir, f"rank{rank}.json"))
    Path(out_dir, f"rank{rank}.skipped.json").write_text(json.dumps(
        [[s.node, s.signature, s.reason] for s in run.skipped]))


def profile_concurrently(requests: Sequence[ModelRequest], *, concurrent: int, device_name: str,
                         options: ProfileOptions) -> ProfileRun:
    """Run `profile_requests` in `concurrent` CPU processes at once; each key's time is the median over them."""
    import torch.multiprocessing as mp

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_profile_worker, args=(tuple(requests), device_name, options, tmp), nprocs=concurrent, join=True)
        runs = [OpProfile.load(os.path.join(tmp, f"rank{r}.json")) for r in range(concurrent)]
        skipped_rows = json.loads(Path(tmp, "rank0.skipped.json").read_text())
    keys = sorted(set.intersection(*(set(p.entries) for p in runs)))
    entries = {}
    for k in keys:
        ts = [p.entries[k] for p in runs]
        entries[k] = OpTiming(statistics.median(t.forward_s for t in ts), statistics.median(t.backward_s for t in ts),
                              samples=sum(t.samples for t in ts))
    meta = {**runs[0].meta, "concurrent_processes": str(concurrent)}
    return ProfileRun(profile=OpProfile(entries=entries, meta=meta),
                      skipped=tuple(SkippedOp(*row) for row in skipped_rows), measured_ops=len(entries),
                      seconds=time.perf_counter() - started,
                      models=tuple(filter(None, runs[0].meta.get("models", "").split(","))))

