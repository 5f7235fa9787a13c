"""Measure a model's operators on the local device and store them as a `costmodel.profile_db.OpProfile`.

What is timed. A model is traced twice from the same module: `ir.trace` gives the IR nodes the cost model prices,
and a torch.fx symbolic trace with the same leaf modules (`ir.op_classify.LEAF_MODULE_TYPES`) gives a runnable
graph whose node names are the IR node names. The fx graph is interpreted on real tensors once per micro-batch
size; at each node, every profile key the cost model may look up for it and that micro-batch is measured on the
node's actual arguments:

- replicated (tp == 1) keys, as `costmodel.layer_pricing.price_segment` asks for them: scales mbs / traced batch;
- sharded keys (tp > 1), as the intra-operator pricer (`costmodel.sharding.cost.build_sharding_model`) asks for
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

The pieces: `options` (what to measure, what came out), `variants` (which keys each node needs), `op_runner`
(one op on its possibly cut arguments), `timing` (clock, runs, statistic), `requests` (which models, in how
many processes); collectives are `collectives`, framework overheads `framework`.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from costmodel.profile_db import OpProfile, OpTiming, segment_signature
from ir.graph import Graph, Node, OpKind
from ir.layer_chain import LayerChain
from ir.op_classify import LEAF_MODULE_TYPES
from planner.profiling.op_runner import NodeCall, Runner, is_float, map_values
from planner.profiling.options import ProfileOptions, ProfileRun, SkippedOp
from planner.profiling.timing import (
    backward_pass_overhead,
    compute_clock,
    intra_op_threads,
    synchronize,
    tensors_in,
    timed_runs,
)
from planner.profiling.variants import Variant, replicated_variant, variants_by_node


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

    def __init__(self, gm: fx.GraphModule, graph: Graph, visit: Callable[[NodeCall, Node], None]) -> None:
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

    def _bind(self, n: fx.Node, node: Node) -> NodeCall:
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

        map_values(n.args, visit)
        map_values(n.kwargs, visit)
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
        return NodeCall(n, module, n.args, n.kwargs, activations, ordered, module_names, roles)


@dataclass
class _Accumulator:
    device_name: str
    options: ProfileOptions
    overhead_s: float
    clock: Callable[[], float] = time.perf_counter
    """`compute_clock` of the profiled device."""
    timings: dict[str, OpTiming] = field(default_factory=dict)
    skipped: dict[str, SkippedOp] = field(default_factory=dict)

    def measure(self, call: NodeCall, node: Node, variants: Sequence[Variant]) -> None:
        for v in variants:
            if v.signature in self.timings or v.signature in self.skipped:
                continue
            if v.tp > 1 and len(call.activations) != len(node.input_specs):
                self._skip(node, v, f"the node reads {len(call.activations)} tensors at run time but "
                                    f"{len(node.input_specs)} in the trace")
                continue
            try:
                runner = Runner(call, node, v, self.clock)
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
    with intra_op_threads(options.threads):
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "meta":
            raise ValueError("profile_module needs a model with real weights, not one on the meta device")
        # Keys come from a trace in the training dtype, as `stratagem plan --dtype` traces the model; the ops
        # then run in that dtype too.
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

            def visit(call: NodeCall, node: Node, variants: Mapping[str, list[Variant]] = variants) -> None:
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
    options' statistic as `Runner.measure` applies it to single ops."""
    def leaf(v: Any) -> Any:
        return v.detach().requires_grad_(is_float(v)) if isinstance(v, torch.Tensor) else v

    def run_once() -> tuple[float, float]:
        a = tuple(leaf(v) for v in args)
        k = {n: leaf(v) for n, v in kwargs.items()}
        t0 = clock()
        out = module(*a, **k)
        synchronize(out)
        t1 = clock()
        outs = [t for t in tensors_in(out) if t.requires_grad]
        grads = [torch.randn_like(t) for t in outs]
        t2 = clock()
        torch.autograd.backward(outs, grads)
        synchronize(a)
        t3 = clock()
        module.zero_grad(set_to_none=True)
        return t1 - t0, t3 - t2

    return timed_runs(run_once, options.warmup, options.repeats, options.statistic, options.min_window_s)
