"""Pipeline actions for the framework profile (`planner.profiling.framework`, where the method is described):
real `torch.distributed.pipelining` steps of one-Linear stages under 1F1B and under the interleaved schedule, the
bare send/recv between the stages, and the host work per stage action that remains once the compute and the
priced wire are taken out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from costmodel.framework import PassCost
from costmodel.strategy import Schedule
from planner.profiling.framework_passes import Pass, Timer, median_clamped

if TYPE_CHECKING:
    from planner.profiling.framework import FrameworkOptions


PIPELINE_MICROBATCHES = (1, 3)
"""Micro-batch counts of the two pipeline steps, in multiples of the pipeline size p (m1 = p, m2 = 3p): 1F1B's
steady state needs m >= p, and the slope between them is one forward-backward action pair."""


def _mean_loss(output: torch.Tensor, _batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return output.mean()


def _pipeline_step(mesh: Any, modules: Sequence[nn.Module], x: torch.Tensor, microbatches: int,
                   schedule: Schedule) -> Pass:
    """One `schedule.step` over `x` cut into `microbatches`, a stage per module on every rank (rank r holds
    virtual stages r, r + p, ...), built as `planner.runtime.parallelize` builds a pipeline."""
    from torch.distributed.pipelining import PipelineStage

    from planner.runtime.apply_pipeline import build_schedule
    from planner.runtime.parallelize import MicrobatchLoss

    rank, p = mesh.get_local_rank(), mesh.size()
    stages = [PipelineStage(m, rank + i * p, p * len(modules), torch.device("cpu"), group=mesh.get_group())
              for i, m in enumerate(modules)]
    loss = MicrobatchLoss(_mean_loss)
    loss.batch = (x,)
    runner = build_schedule(stages, schedule, microbatches, loss)
    sample_ids = torch.arange(x.shape[0])

    def step() -> None:
        runner.step(x, target=sample_ids, losses=[], return_outputs=False)

    def reset() -> None:
        for m in modules:
            m.zero_grad(set_to_none=True)

    return Pass(step, reset=reset)


def _p2p_chain(x: torch.Tensor, mesh: Any, downstream: bool) -> Callable[[], None]:
    """Every rank of the pipeline group sends `x` to its next stage and receives one from its previous stage
    (`downstream`, an activation) or the reverse (a gradient), batched as the schedule batches them."""
    import torch.distributed as dist

    group, rank, p = mesh.get_group(), mesh.get_local_rank(), mesh.size()
    send_to, recv_from = (rank + 1, rank - 1) if downstream else (rank - 1, rank + 1)
    ops = []
    if 0 <= send_to < p:
        ops.append(dist.P2POp(dist.isend, x, dist.get_global_rank(group, send_to), group))
    if 0 <= recv_from < p:
        ops.append(dist.P2POp(dist.irecv, torch.empty_like(x), dist.get_global_rank(group, recv_from), group))

    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return run


def priced_wire_s(pipeline_size: int, activation_s: float, gradient_s: float, chunks: int = 1) -> float:
    """Send/recv seconds per micro-batch that `costmodel.pipeline` puts on the busiest rank of a pipeline whose
    ranks hold `chunks` virtual stages each: it adds one hop (of the activation, and of its gradient back) to the
    forward of the receiving chunk and the backward of the sending one, so an inner chunk carries two hops and
    the first and last chunk of the model one: min(p x chunks - 1, 2 x chunks) hops on the busiest rank."""
    hops = min(pipeline_size * chunks - 1, 2 * chunks)
    return hops * (activation_s + gradient_s) / 2


def action_pair_overhead(step_times: tuple[float, float], microbatches: tuple[int, int], compute_s: float,
                         p2p_s: float, chunks: int = 1) -> float:
    """Host seconds of one forward-backward action pair: the step's slope per micro-batch, (t2 - t1) /
    (m2 - m1) = chunks x (F + B), less the rank's compute and its priced send/recv, per chunk (unclamped: a
    repeat's value)."""
    (t1, t2), (m1, m2) = step_times, microbatches
    return ((t2 - t1) / (m2 - m1) - compute_s - p2p_s) / chunks


PIPELINE_CHUNKS = 2
"""Virtual stages per rank of the multi-chunk pipeline that measures `pp_chunked_action` (interleaved 1F1B)."""


def measure_pp_action(mesh: Any, options: FrameworkOptions, timer: Timer) -> tuple[PassCost, PassCost]:
    """Host overhead per pipeline stage action and micro-batch (forward, backward; half of a pair each), under
    1F1B and under the interleaved schedule of `PIPELINE_CHUNKS` chunks per rank (module docstring)."""
    h = options.hidden
    single = nn.Linear(h, h)
    chunks = [nn.Linear(h, h) for _ in range(PIPELINE_CHUNKS)]
    x = torch.randn(options.batch, options.seq, h)
    counts = tuple(k * mesh.size() for k in PIPELINE_MICROBATCHES)
    batch = torch.randn(counts[1] * options.batch, options.seq, h)
    plain_x = x.clone().requires_grad_(True)  # a stage's received input requires grad
    grad = torch.ones_like(x)
    activations, gradients = _p2p_chain(x, mesh, downstream=True), _p2p_chain(grad, mesh, downstream=False)
    passes = [Pass(lambda: single(plain_x), lambda out: out.backward(grad),
                   lambda: single.zero_grad(set_to_none=True)),
              *(_pipeline_step(mesh, [single], batch[:m * options.batch], m, Schedule.ONE_F_ONE_B) for m in counts),
              Pass(activations, lambda _: gradients()),
              *(_pipeline_step(mesh, chunks, batch[:m * options.batch], m, Schedule.INTERLEAVED) for m in counts)]
    t = timer.rounds(passes).tolist()
    costs = []
    for first, v in ((1, 1), (4, PIPELINE_CHUNKS)):
        pair = [action_pair_overhead((r[first][0], r[first + 1][0]), counts, v * (r[0][0] + r[0][1]),
                                     priced_wire_s(mesh.size(), r[3][0], r[3][1], v), v) for r in t]
        net = median_clamped(torch.tensor(pair))
        costs.append(PassCost(net / 2, net / 2))
    return costs[0], costs[1]
