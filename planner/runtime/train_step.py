"""One training step of a `ParallelModel`, pipelined or not, and the data-parallel slice of a global batch.

Semantics are the single-process ones: the step's gradient is the mean-loss gradient over the global batch.
- not pipelined: the local batch is split into the plan's micro-batches and their gradients accumulated
  (each loss divided by the number of micro-batches; FSDP2 reduces gradients only after the last one);
- pipelined: the `torch.distributed.pipelining` schedule runs the micro-batches and averages their gradients;
- data parallel: FSDP2 / replicate average gradients over the dp ranks;
- parameters tied across pipeline stages get their gradient copies summed before the optimizer step;
- gradients that sequence parallelism leaves `Partial` (replicated norm weights applied to sequence shards) are
  all-reduced in one flat buffer per mesh (`sync_partial_gradients`) instead of one collective per tensor, which
  the optimizer step's redistribution would issue.
The returned loss is the global-batch mean (averaged over micro-batches and dp ranks), the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from planner.errors import UserError
from planner.runtime.parallelize import ParallelModel


def local_batch(pm: ParallelModel, global_batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """This rank's data-parallel slice (dim 0) of a global batch given identically on every rank."""
    n = pm.local_batch_size
    expected = n * pm.strategy.dp
    for t in global_batch:
        if t.size(0) != expected:
            raise UserError(f"global batch of {t.size(0)} samples; the plan trains on {expected} "
                            f"(dp={pm.strategy.dp} x micro-batch {pm.strategy.microbatch_size} x "
                            f"{pm.strategy.num_microbatches} micro-batches)")
    start = pm.dp_rank * n
    return tuple(t[start:start + n].to(pm.device) for t in global_batch)


def train_step(pm: ParallelModel, batch: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer) -> float:
    """Forward, backward and optimizer step on this rank's local `batch`; returns the global mean loss."""
    batch = tuple(batch)
    for t in batch:
        if t.size(0) != pm.local_batch_size:
            raise UserError(f"local batch of {t.size(0)} samples; the plan's data-parallel replica trains on "
                            f"{pm.local_batch_size} (micro-batch {pm.strategy.microbatch_size} x "
                            f"{pm.strategy.num_microbatches}); use planner.runtime.train_step.local_batch")
    optimizer.zero_grad(set_to_none=True)
    loss = _pipelined(pm, batch) if pm.pipelined else _accumulated(pm, batch)
    _sum_tied_gradients(pm)
    sync_partial_gradients(p for _, part in sorted(pm.parts.items()) for p in part.parameters())
    if pm.split_experts:
        sync_split_expert_gradients(pm.split_experts, pm.meshes.expert_tp_sum.get_group())
    optimizer.step()
    return _global_mean(pm, loss)


def _accumulated(pm: ParallelModel, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    from torch.distributed.fsdp import FSDPModule

    model = pm.parts[0]
    m = pm.strategy.num_microbatches
    chunks = [t.tensor_split(m) for t in batch]
    total = torch.zeros((), device=pm.device)
    for i in range(m):
        micro = tuple(c[i] for c in chunks)
        if isinstance(model, FSDPModule):
            # ZeRO-0/1 reduce once, after the last micro-batch (their whole gradient is kept anyway); ZeRO-2/3
            # reduce-scatter every micro-batch so that no rank holds an unsharded gradient, as the cost model
            # prices them (`costmodel.step_time` module docstring).
            model.set_requires_gradient_sync(i == m - 1 or pm.strategy.zero_stage >= 2)
        loss = pm.loss_fn(model(*micro), micro)
        (loss / m).backward()
        total += loss.detach().float()
    return total / m


def _pipelined(pm: ParallelModel, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    assert pm.microbatch_loss is not None  # set by parallelize for every pipelined model
    pm.microbatch_loss.batch = batch
    losses: list[torch.Tensor] = []
    sample_ids = torch.arange(pm.local_batch_size, device=pm.device)
    try:
        pm.schedule.step(*batch, target=sample_ids, losses=losses,
                         return_outputs=pm.strategy.runtime.pp_returns_outputs)
    finally:
        pm.microbatch_loss.batch = ()
    # The mean over micro-batches, once per parameter: torch's schedules would divide per stage, twice for a
    # parameter two stages of this rank share (the tied embedding and head on a V-shaped schedule's rank 0).
    with torch.no_grad():
        for p in pm.parameters():
            if p.grad is not None:
                p.grad.div_(pm.strategy.num_microbatches)
    if not pm.holds_last_stage:
        return torch.zeros((), device=pm.device)
    return torch.stack([loss.detach().float() for loss in losses]).mean()


def _sum_tied_gradients(pm: ParallelModel) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for tied in pm.tied:
        if tied.group is None:
            continue
        for index, name in sorted(tied.names.items()):
            if index not in pm.parts:
                continue
            p = pm.parts[index].get_parameter(name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if isinstance(p.grad, DTensor):
                # autograd may leave a gradient in another layout than its parameter (the vocab-sharded
                # embedding's gradient comes back replicated); the peer stage's copy has the parameter's layout
                if p.grad.placements != p.placements:
                    p.grad = p.grad.redistribute(p.device_mesh, p.placements)
                grad = p.grad.to_local()
            else:
                grad = p.grad
            dist.all_reduce(grad, group=tied.group)


def sync_partial_gradients(params: Iterable[nn.Parameter]) -> int:
    """All-reduce the `Partial` gradients of replicated DTensor parameters on 1-D meshes, one flat buffer per
    (mesh, dtype) in parameter order, and give each its parameter's placement; returns how many were synced.

    Every rank of a mesh holds the same modules, so the buffers line up. Other gradients (sharded, 2-D meshes with
    FSDP2, plain tensors) are left to their owners."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    buckets: dict[tuple[int, torch.dtype], tuple[Any, list[nn.Parameter]]] = {}
    for p in params:
        g = p.grad
        if not (isinstance(p, DTensor) and isinstance(g, DTensor) and g.device_mesh.ndim == 1
                and g.device_mesh == p.device_mesh and p.placements == (Replicate(),)
                and isinstance(g.placements[0], Partial) and g.placements[0].reduce_op == "sum"):
            continue
        buckets.setdefault((id(g.device_mesh), g.dtype), (g.device_mesh, []))[1].append(p)
    for mesh, ps in buckets.values():
        summed = _all_reduce_flat([p.grad.to_local() for p in ps], mesh.get_group())
        for p, t in zip(ps, summed, strict=True):
            p.grad = DTensor.from_local(t, mesh, p.placements, run_check=False)
    return sum(len(ps) for _, ps in buckets.values())


def sync_split_expert_gradients(modules: Sequence[nn.Module], group: Any) -> None:
    """Sum, over `group` (`PlanMeshes.expert_tp_sum`), the gradients of experts whose slots the tp ranks split
    (`apply_ep.apply_expert_token_split`), one flat buffer per dtype; the modules and so the buffers are the same
    on every rank of the group."""
    from torch.distributed.tensor import DTensor

    buckets: dict[torch.dtype, list[torch.Tensor]] = {}
    for module in modules:
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                buckets.setdefault(g.dtype, []).append(g)
    for grads in buckets.values():
        for g, summed in zip(grads, _all_reduce_flat(grads, group), strict=True):
            g.copy_(summed)


def _all_reduce_flat(tensors: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Sum `tensors` (one dtype) over `group` with one all-reduce of their concatenation; views of the result,
    shaped as the inputs."""
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def _global_mean(pm: ParallelModel, loss: torch.Tensor) -> float:
    """Average the loss over the ranks that computed it (the last pipeline stage of every dp/tp coordinate)."""
    import torch.distributed as dist

    value = loss.detach().float().reshape(1).clone()
    dist.all_reduce(value)
    holders = dist.get_world_size() // pm.strategy.pp
    return float(value.item() / holders)
