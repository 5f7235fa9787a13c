"""Measure the runtime's framework overheads on this machine: what `costmodel.framework.FrameworkCosts` prices.

The operator profile prices the math and the collective fit prices the wire; neither sees the host work of the
machinery a strategy runs on (`costmodel.framework`). This module times that machinery in a spawned gloo process
group on CPU, one torch thread per rank (as `stratagem run` launches CPU ranks), and subtracts what the other
models already price, so the remainder is the framework's own cost.

Layout. `FrameworkOptions.processes` ranks are spawned once. For each group size g, the ranks are cut into
processes / g groups of consecutive ranks that all measure at once (as `planner.profiling.collectives.measure_collectives`
does with `processes`): that is how the data- and tensor-parallel groups of a CPU cluster share its cores.
Every timed pass starts after a barrier over all ranks and counts the slowest rank's time (a step waits for its
last rank). The variants of one measurement (plain, wrapped, bare collectives) run one after the other inside
every repeat, so a slow spell of the shared machine hits them alike; each repeat yields one difference, and the
value kept is the median of those differences over `repeats` (after `warmup` untimed repeats).

What is measured, per group size g (the g-rank 1-D mesh of the rank's group):

- optimizer: `AdamW.step` (foreach, torch's default) over K tensors, plain and as DTensors (`Replicate` on the
  mesh), at two tensor sizes. Adam's time is linear in the bytes it touches, t = a + c * bytes; the intercept a
  is what does not scale with bytes, and a / K is the per-tensor cost (`step_time.optimizer_step_time` prices the
  bytes). Measured at the largest group size only: the DTensor cost is local dispatch, it does not depend on g.
- data-parallel unit: a stack of `units` reference blocks (LayerNorm, Linear h->4h, GELU, Linear 4h->h,
  residual) and a root LayerNorm, forward and backward timed separately, plain and wrapped as
  `planner.runtime.apply_fsdp` wraps a part: `replicate` on the root (ZeRO-0), or `fully_shard` per block and on the
  root with reshard_after_forward False (ZeRO-1/2) / True (ZeRO-3). Overhead per unit
  = (wrapped - plain - raw collectives) / units, where the raw collectives are the ones the wrapper issues,
  timed bare (`all_gather_into_tensor` / `reduce_scatter_tensor` / `all_reduce` of the same float32 byte
  counts, FSDP2's dim-0 padding included) in the same group right there:
    replicate: 1 unit (the root holds every parameter); backward: one all-reduce of all gradients;
    fsdp: units = blocks + root; forward: one all-gather per unit; backward: one reduce-scatter per unit;
    fsdp_reshard: as fsdp, plus one all-gather per unit in backward (an explicit reshard_after_forward=True
    reshards the root too).
- gradient sync: `planner.runtime.train_step.sync_partial_gradients` then an AdamW step, over K DTensor parameters whose
  gradients are `Partial` over the g-rank mesh (what sequence parallelism leaves on a replicated weight), against
  an AdamW step over replicated gradients and one bare all-reduce of the K tensors' bytes; per tensor = the
  difference / K (flattening, unflattening, DTensor wrapping). `step_time.tp_grad_sync_time` prices the sync as
  one all-reduce of all the bytes plus K times this figure.
- tensor-parallel module: the MLP Linear(h, 4h) -> GELU -> Linear(4h, h) with `ColwiseParallel` on the first
  and `RowwiseParallel` on the second (`planner.runtime.apply_tp`'s pair), input requiring grad as inside a network,
  against the plain MLP; minus the raw all-reduce of the output (forward) and of the input gradient (backward)
  at the same bytes; per sharded module = the difference / 2.
- pipeline action, per pipeline size p (the p-rank group as the pipeline): a real `torch.distributed.pipelining`
  pipeline of p stages, each a Linear(h, h) on (batch, seq, h) micro-batches, driven by the 1F1B schedule and
  loss that `planner.runtime.parallelize` builds (`apply_pipeline.build_schedule`, `parallelize.MicrobatchLoss`).
  1F1B takes (m + p - 1)(F + B) plus a fixed per-step cost for m micro-batches, F and B one stage action's
  forward and backward (compute, host work, send/recv), so the slope between m1 = p and m2 = 3p micro-batches,
  (t2 - t1) / (m2 - m1), is F + B. Minus the plain Linear's forward and backward and the send/recv the cost
  model prices per micro-batch on the slowest stage, it is the host work per forward-backward action pair. The
  wire is timed bare right there (every rank sends the activation to its next stage, then the gradient to its
  previous one) and priced as `costmodel.pipeline` prices it: each hop adds to the receiving stage's forward and
  the sending stage's backward, so an inner stage pays two hops per micro-batch and an end stage one, and the
  slowest stage of p >= 3 pays two, of p = 2 one (`priced_wire_s`). A 1F1B step cannot separate the forward's
  share from the backward's (it always runs both), so the pair is split half and half. The same again for the
  multi-chunk schedules, which torch runs on another engine (its action runtime, every send and receive an
  action of its own): the interleaved schedule with 2 one-Linear chunks per rank, whose slope per micro-batch is
  2 (F + B), less twice the compute and the wire of the busiest rank's min(2p - 1, 4) hops, per chunk
  (`planner.profiling.pipeline_actions`).
- split backward (no communication): a GPT block's backward split as the zero-bubble schedules split it, into
  torch's `stage_backward_input` (it walks the autograd graph to keep what the weight gradients need) and
  `stage_backward_weight` (a second backward from there), less the block's one `stage_backward`, per layer.
- recompute (no communication; every rank measures at once, the figures are the slowest rank's): a GPT block
  (`models.gpt.GPTBlock`: LayerNorm, attention, LayerNorm, MLP) plain, and checkpointed by
  `planner.runtime.apply_recompute` SELECTIVE (the attention module's body, under a per-op Python policy) and FULL (the
  whole block). Forward overhead = checkpointed forward - plain forward; backward overhead = checkpointed
  backward - plain backward - the rerun work the cost model already prices: FULL, the plain forward; SELECTIVE,
  the forward of the attention core (`models.attention.attention_core` on the block's q/k/v shapes), timed alone.

Differences are clamped at 0: where the framework costs less than the noise, the model should price nothing.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from costmodel.framework import DataParallelMode, FrameworkCosts, PassCost
from planner.profiling.framework_passes import (
    Pass,
    ReferenceMLP,
    ReferenceStack,
    Timer,
    all_gathers,
    all_reduce,
    fsdp_padded_numel,
    median_clamped,
    reduce_scatters,
)
from planner.profiling.pipeline_actions import measure_pp_action
from planner.profiling.spawn import divisor_group_sizes, free_port
from planner.runtime.worker_exit import exit_without_teardown, quiesce


@dataclass(frozen=True, kw_only=True)
class FrameworkOptions:
    """What `measure_framework` runs and how often."""

    processes: int = 2
    """Ranks spawned (gloo, CPU); every group size measured must divide it."""
    group_sizes: tuple[int, ...] = ()
    """Data- / tensor-parallel group sizes to measure (each >= 2, dividing `processes`); empty: every such size."""
    warmup: int = 3
    """Untimed runs before each measurement (FSDP2 initializes lazily in its first forward)."""
    repeats: int = 11
    """Timed runs per measurement; the median of the slowest rank's times is kept."""
    hidden: int = 128
    """Hidden size of the reference block and MLP."""
    seq: int = 64
    """Sequence length of the reference input (batch, seq, hidden)."""
    batch: int = 1
    """Micro-batch size of the reference input."""
    units: int = 4
    """Reference blocks in the data-parallel stack (each its own FSDP2 unit), plus the root."""
    optimizer_tensors: int = 48
    """K: parameter tensors the optimizer steps over."""
    optimizer_sides: tuple[int, int] = (32, 128)
    """Side of the square optimizer tensors at the two sizes that separate the per-tensor and per-byte terms."""
    heads: int = 8
    """Attention heads of the recomputation reference block (a GPT block); must divide `hidden`."""

    def __post_init__(self) -> None:
        for name in ("processes", "warmup", "repeats", "hidden", "seq", "batch", "units", "optimizer_tensors",
                     "heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "warmup" else 1):
                raise ValueError(f"{name} must be a {'non-negative' if name == 'warmup' else 'positive'} integer, "
                                 f"got {v!r}")
        if self.processes < 2:
            raise ValueError(f"framework overheads need at least 2 processes, got {self.processes}")
        sides = tuple(self.optimizer_sides)
        if len(sides) != 2 or any(not isinstance(s, int) or s < 1 for s in sides) or sides[0] == sides[1]:
            raise ValueError(f"optimizer_sides must be two different positive integers, got {sides!r}")
        object.__setattr__(self, "optimizer_sides", tuple(sorted(sides)))
        if self.hidden % self.heads:
            raise ValueError(f"heads must divide hidden ({self.hidden}), got {self.heads}")
        valid = divisor_group_sizes(self.processes)
        sizes = tuple(sorted(set(self.group_sizes))) or valid
        bad = [g for g in sizes if g not in valid]
        if bad:
            raise ValueError(f"group sizes {bad} do not divide {self.processes} processes into groups of >= 2; "
                             f"valid: {', '.join(map(str, valid))}")
        object.__setattr__(self, "group_sizes", sizes)


# ---------------------------------------------------------------------------------------------------------------
# The three measurements
# ---------------------------------------------------------------------------------------------------------------


def _adam_step(params: Sequence[nn.Parameter]) -> Pass:
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return Pass(torch.optim.AdamW(params, lr=1e-3).step)


def per_tensor_intercept(small: tuple[int, float], large: tuple[int, float], tensors: int) -> float:
    """Per-tensor seconds from step times at two tensor sizes (elements, seconds): the zero-bytes intercept of
    the line through them, divided by the K tensors stepped (unclamped: a repeat's value, medians come later)."""
    (n1, t1), (n2, t2) = small, large
    return (t1 * n2 - t2 * n1) / (n2 - n1) / tensors


def measure_optimizer(mesh: Any, options: FrameworkOptions, timer: Timer) -> tuple[float, float]:
    """(plain, DTensor) seconds per parameter tensor of one AdamW step."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    passes, numels = [], []
    for side in options.optimizer_sides:
        tensors = [torch.randn(side, side) for _ in range(options.optimizer_tensors)]
        passes += [_adam_step([nn.Parameter(t) for t in tensors]),
                   _adam_step([nn.Parameter(distribute_tensor(t, mesh, [Replicate()])) for t in tensors])]
        numels.append(side * side)
    t = timer.rounds(passes)[:, :, 0]  # (repeats, [plain small, dtensor small, plain large, dtensor large])
    k = options.optimizer_tensors
    plain = [per_tensor_intercept((numels[0], r[0]), (numels[1], r[2]), k) for r in t.tolist()]
    dtensor = [per_tensor_intercept((numels[0], r[1]), (numels[1], r[3]), k) for r in t.tolist()]
    return median_clamped(torch.tensor(plain)), median_clamped(torch.tensor(dtensor))


def _train_pass(model: nn.Module, x: torch.Tensor) -> Pass:
    def reset() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None

    return Pass(lambda: model(x), lambda out: out.sum().backward(), reset)


def _wrap(stack: ReferenceStack, mesh: Any, mode: DataParallelMode) -> nn.Module:
    """Wrap a copy of `stack` as `planner.runtime.apply_fsdp.apply_data_parallel` wraps a part in `mode`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(stack)
    if mode is DataParallelMode.REPLICATE:
        return replicate(model, mesh=mesh)
    reshard = mode is DataParallelMode.FSDP_RESHARD
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


_DP_MODES = (DataParallelMode.REPLICATE, DataParallelMode.FSDP, DataParallelMode.FSDP_RESHARD)


def measure_dp_units(mesh: Any, options: FrameworkOptions, timer: Timer) -> dict[DataParallelMode, PassCost]:
    """Overhead per data-parallel unit and micro-batch, forward and backward, of every wrapping mode."""
    g, group = mesh.size(), mesh.get_group()
    stack = ReferenceStack(options.hidden, options.units)
    x = torch.randn(options.batch, options.seq, options.hidden)
    unit_numels = [fsdp_padded_numel(b, g, recurse=True) for b in stack.blocks]
    unit_numels.append(fsdp_padded_numel(stack, g, recurse=False))
    passes = [_train_pass(stack, x), *(_train_pass(_wrap(stack, mesh, m), x) for m in _DP_MODES),
              Pass(all_gathers(unit_numels, group, g)), Pass(reduce_scatters(unit_numels, group, g)),
              Pass(all_reduce(sum(p.numel() for p in stack.parameters()), group))]
    t = timer.rounds(passes)
    plain, ag, rs, ar = t[:, 0], t[:, 4, 0], t[:, 5, 0], t[:, 6, 0]
    units = len(unit_numels)
    # (wrapped - plain - bare collectives) per repeat; the collectives each mode issues (module docstring)
    net = {DataParallelMode.REPLICATE: (t[:, 1, 0] - plain[:, 0], t[:, 1, 1] - plain[:, 1] - ar, 1),
           DataParallelMode.FSDP: (t[:, 2, 0] - plain[:, 0] - ag, t[:, 2, 1] - plain[:, 1] - rs, units),
           DataParallelMode.FSDP_RESHARD: (t[:, 3, 0] - plain[:, 0] - ag, t[:, 3, 1] - plain[:, 1] - rs - ag, units)}
    return {mode: PassCost(median_clamped(fwd) / n, median_clamped(bwd) / n) for mode, (fwd, bwd, n) in net.items()}


def _partial_grad_step(params: Sequence[nn.Parameter], mesh: Any) -> Pass:
    """The runtime's step over DTensor parameters whose gradients are `Partial` (what sequence parallelism leaves
    on a replicated weight applied to sequence-sharded tokens): `sync_partial_gradients`, then AdamW; the
    gradients are set again before every step."""
    from torch.distributed.tensor import DTensor, Partial

    from planner.runtime.train_step import sync_partial_gradients

    def reset() -> None:
        for p in params:
            p.grad = DTensor.from_local(torch.full_like(p.to_local(), 1e-3), mesh, [Partial()])

    optimizer = torch.optim.AdamW(params, lr=1e-3)

    def step() -> None:
        sync_partial_gradients(params)
        optimizer.step()

    reset()
    return Pass(step, reset=reset)


def measure_grad_sync(mesh: Any, options: FrameworkOptions, timer: Timer) -> float:
    """Seconds per parameter tensor that syncing `Partial` gradients and stepping costs beyond an AdamW step over
    replicated gradients and one all-reduce of all their bytes (the sync's flattening and DTensor wrapping)."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    side = options.optimizer_sides[0]
    tensors = [torch.randn(side) for _ in range(options.optimizer_tensors)]

    def params() -> list[nn.Parameter]:
        return [nn.Parameter(distribute_tensor(t, mesh, [Replicate()])) for t in tensors]

    passes = [_adam_step(params()), _partial_grad_step(params(), mesh),
              Pass(all_reduce(sum(t.numel() for t in tensors), mesh.get_group()))]
    t = timer.rounds(passes)[:, :, 0]
    return median_clamped(t[:, 1] - t[:, 0] - t[:, 2]) / options.optimizer_tensors


def measure_tp_module(mesh: Any, options: FrameworkOptions, timer: Timer) -> PassCost:
    """Overhead per tensor-parallel sharded module call and micro-batch, forward and backward."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp = ReferenceMLP(options.hidden)
    x = torch.randn(options.batch, options.seq, options.hidden, requires_grad=True)
    sharded = parallelize_module(copy.deepcopy(mlp), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    # the output (forward) and the input gradient (backward) are all-reduced; both have x's shape
    t = timer.rounds([_train_pass(mlp, x), _train_pass(sharded, x), Pass(all_reduce(x.numel(), mesh.get_group()))])
    fwd = t[:, 1, 0] - t[:, 0, 0] - t[:, 2, 0]
    bwd = t[:, 1, 1] - t[:, 0, 1] - t[:, 2, 0]
    return PassCost(median_clamped(fwd) / 2, median_clamped(bwd) / 2)


def measure_split_backward(options: FrameworkOptions, timer: Timer) -> PassCost:
    """Backward overhead per layer and micro-batch of a zero-bubble schedule's split backward: a GPT block's
    input-gradient then weight-gradient pass (torch's `stage_backward_input`, `stage_backward_weight`) against
    its one whole backward (`stage_backward`, what the other schedules run), same output gradient."""
    from torch.distributed.pipelining._backward import (
        stage_backward,
        stage_backward_input,
        stage_backward_weight,
    )

    block = gpt_block(options)
    x = torch.randn(options.batch, options.seq, options.hidden, requires_grad=True)
    grad = torch.randn(options.batch, options.seq, options.hidden)

    def split(out: torch.Tensor) -> None:
        _, groups = stage_backward_input([out], [grad], [x], block.parameters())
        stage_backward_weight(block.parameters(), groups)

    def reset() -> None:
        block.zero_grad(set_to_none=True)
        x.grad = None

    t = timer.rounds([Pass(lambda: block(x), lambda out: stage_backward([out], [grad], [x]), reset),
                      Pass(lambda: block(x), split, reset)])
    return PassCost(0.0, median_clamped(t[:, 1, 1] - t[:, 0, 1]))


def _attention_core_pass(options: FrameworkOptions) -> Pass:
    """The attention core alone on a (batch, heads, seq, hidden / heads) q, k, v: what SELECTIVE recomputes."""
    head_dim = options.hidden // options.heads
    q, k, v = (torch.randn(options.batch, options.heads, options.seq, head_dim) for _ in range(3))
    # the zoo's attention core (models.attention, SDPA implementation) without dropout
    return Pass(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                          scale=head_dim ** -0.5))


def gpt_block(options: FrameworkOptions) -> nn.Module:
    """One block of the zoo's GPT (through the model registry) of the options' hidden size, heads and sequence."""
    from models.registry import build_model

    sets = ("vocab=1", f"hidden={options.hidden}", "layers=1", f"heads={options.heads}")
    return build_model("gpt", sets, seq=options.seq, device="cpu").module.blocks[0]


def measure_recompute(options: FrameworkOptions, timer: Timer) -> dict[str, PassCost]:
    """Checkpoint machinery per recomputed layer and micro-batch, "selective" and "full" (module docstring)."""
    from costmodel.strategy import Recompute
    from planner.runtime.apply_recompute import apply_recompute

    block = gpt_block(options)
    wrapped = {mode: copy.deepcopy(block) for mode in (Recompute.SELECTIVE, Recompute.FULL)}
    for mode, layer in wrapped.items():
        apply_recompute([layer], mode)
    x = torch.randn(options.batch, options.seq, options.hidden, requires_grad=True)
    t = timer.rounds([_train_pass(block, x), *(_train_pass(m, x) for m in wrapped.values()),
                      _attention_core_pass(options)])
    plain_f, plain_b, core = t[:, 0, 0], t[:, 0, 1], t[:, 3, 0]
    rerun = {Recompute.SELECTIVE: core, Recompute.FULL: plain_f}
    return {mode.value: PassCost(median_clamped(t[:, j, 0] - plain_f),
                                 median_clamped(t[:, j, 1] - plain_b - rerun[mode]))
            for j, mode in enumerate(wrapped, start=1)}


# ---------------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------------


def _group_mesh(world: int, g: int) -> Any:
    """This rank's g-rank 1-D mesh; the world is cut into world / g groups of consecutive ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world // g, g), mesh_dim_names=("replica", "group"))["group"]


def _pass_json(cost: PassCost) -> list[float]:
    return [cost.forward_s, cost.backward_s]


def _measure_all(meshes: Mapping[int, Any], options: FrameworkOptions, timer: Timer) -> dict[str, Any]:
    """Every measurement, as the JSON `_costs_from_json` reads (group sizes as keys; [forward, backward])."""
    plain, dtensor = measure_optimizer(meshes[max(meshes)], options, timer)
    dp: dict[str, dict[int, list[float]]] = {}
    tp: dict[int, list[float]] = {}
    sync: dict[int, float] = {}
    pp: dict[int, list[float]] = {}
    pp_chunked: dict[int, list[float]] = {}
    for g, mesh in meshes.items():
        sync[g] = measure_grad_sync(mesh, options, timer)
        for mode, cost in measure_dp_units(mesh, options, timer).items():
            dp.setdefault(mode.value, {})[g] = _pass_json(cost)
        tp[g] = _pass_json(measure_tp_module(mesh, options, timer))
        single, chunked = measure_pp_action(mesh, options, timer)
        pp[g], pp_chunked[g] = _pass_json(single), _pass_json(chunked)
    recompute = {mode: _pass_json(cost) for mode, cost in measure_recompute(options, timer).items()}
    split = measure_split_backward(options, timer)
    return {"optimizer": [plain, dtensor], "dp_unit": dp, "tp_module": tp, "grad_sync": sync, "pp_action": pp,
            "pp_chunked_action": pp_chunked, "recompute": recompute, "split_backward": split.backward_s}


def _framework_worker(rank: int, world: int, port: int, options: FrameworkOptions, result_path: str) -> None:
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    timer = Timer(options.warmup, options.repeats)
    try:
        result = _measure_all({g: _group_mesh(world, g) for g in options.group_sizes}, options, timer)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
        quiesce()
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)  # the result is written (the teardown aborted 3 times in ~20 runs here)


def _costs_from_json(d: Mapping[str, Any]) -> FrameworkCosts:
    plain, dtensor = d["optimizer"]
    return FrameworkCosts(
        optimizer_per_tensor_s=float(plain), optimizer_per_dtensor_s=float(dtensor),
        dp_unit={DataParallelMode(mode): {int(g): PassCost(*map(float, c)) for g, c in table.items()}
                 for mode, table in d["dp_unit"].items()},
        tp_module={int(g): PassCost(*map(float, c)) for g, c in d["tp_module"].items()},
        grad_sync={int(g): float(v) for g, v in d.get("grad_sync", {}).items()},
        pp_action={int(g): PassCost(*map(float, c)) for g, c in d.get("pp_action", {}).items()},
        pp_chunked_action={int(g): PassCost(*map(float, c)) for g, c in d.get("pp_chunked_action", {}).items()},
        recompute={str(mode): PassCost(*map(float, c)) for mode, c in d.get("recompute", {}).items()},
        split_backward=PassCost(0.0, float(d.get("split_backward", 0.0))))


def measure_framework(options: FrameworkOptions) -> FrameworkCosts:
    """Spawn `options.processes` gloo ranks and measure the framework overheads (module docstring)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "framework.json")
        try:
            mp.spawn(_framework_worker, args=(options.processes, free_port(), options, path),
                     nprocs=options.processes, join=True)
        except mp.ProcessExitedException:
            if not Path(path).exists():  # a rank died before the measurement was complete
                raise
        return _costs_from_json(json.loads(Path(path).read_text()))


def framework_meta(options: FrameworkOptions) -> dict[str, str]:
    """Profile meta describing a framework measurement (what a reader needs to reproduce it)."""
    return {"framework_processes": str(options.processes),
            "framework_group_sizes": ",".join(map(str, options.group_sizes)),
            "framework_reference": f"hidden={options.hidden},seq={options.seq},batch={options.batch},"
                                   f"units={options.units},optimizer_tensors={options.optimizer_tensors},"
                                   f"heads={options.heads}",
            "framework_repeats": str(options.repeats), "framework_warmup": str(options.warmup)}
