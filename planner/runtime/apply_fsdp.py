"""Data parallelism over the plan's dp axis with FSDP2 (`fully_shard`) or FSDP2-style replication (`replicate`).

ZeRO stages (Rajbhandari et al. SC'20) map onto FSDP2 as follows:
- ZeRO-3: `fully_shard(reshard_after_forward=True)` per layer and on the root: parameters, gradients and
  optimizer state sharded; parameters all-gathered again in backward -- unless the plan's
  `RuntimeOptions.reshard_after_forward` is off: then they stay gathered from forward to backward.
- ZeRO-1 / ZeRO-2: `fully_shard(reshard_after_forward=False)`: parameters stay gathered from forward to
  backward (no second all-gather, as in ZeRO-1/2) while gradients and optimizer state are sharded. FSDP2 has no
  mode that shards optimizer state but keeps full gradients, so ZeRO-1 runs as ZeRO-2 (same memory or less,
  the same communication volume: one reduce-scatter plus one all-gather per step).
- ZeRO-0: `replicate` (DDP semantics on FSDP2's machinery, composes with DTensor tensor parallelism and with
  pipelining): every rank keeps everything, gradients all-reduced.
Gradients are averaged over the dp ranks, so a mean loss per rank gives the global-batch mean gradient.

Parameter offload (`Offload.PARAMS`, ZeRO-3 only) passes `offload_policy=CPUOffloadPolicy()` to every
`fully_shard`: the sharded parameters, their gradients and so the optimizer state live on the host, and the
optimizer built over `parameters()` steps on the CPU (FSDP2 requires it). Pinned memory needs an accelerator, so
on CPU devices the policy is built with `pin_memory=False`; there FSDP2's host-device copies are no-ops (the
device is the host) and a gloo run checks the plan-to-runtime mapping and the numerics, not the copies' speed.

With context parallelism the mesh is dp x cp flattened (`PlanMeshes.replicas`, see planner/runtime/apply_cp.py). With
expert parallelism each experts module is wrapped first, on its own mesh (`PlanMeshes.expert_replicas`: the
ranks that hold the same experts), so that the part's wrapper leaves its parameters alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from costmodel.strategy import Offload


def apply_data_parallel(part: nn.Module, layers: Sequence[nn.Module], dp_mesh: Any, *, zero_stage: int,
                        experts: Sequence[nn.Module] = (), experts_mesh: Any = None,
                        reshard_after_forward: bool = True, offload: Offload = Offload.NONE) -> nn.Module:
    """Wrap one model part (the whole model or one pipeline stage) for data parallelism over `dp_mesh`; the
    `experts` modules inside it over `experts_mesh`."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if experts and experts_mesh is None:
        raise ValueError("experts modules given without their data-parallel mesh")
    if zero_stage == 0:
        for module in experts:
            replicate(module, mesh=experts_mesh)
        replicate(part, mesh=dp_mesh)
        return part
    kwargs = fsdp_kwargs(zero_stage, reshard_after_forward=reshard_after_forward, offload=offload,
                         device_type=dp_mesh.device_type)
    for module in experts:
        fully_shard(module, mesh=experts_mesh, **kwargs)
    for layer in layers:  # one all-gather unit per layer, so only one layer's parameters are unsharded at a time
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    fully_shard(part, mesh=dp_mesh, **kwargs)
    return part


def fsdp_kwargs(zero_stage: int, *, reshard_after_forward: bool, offload: Offload, device_type: str
                ) -> dict[str, Any]:
    """The keyword arguments every `fully_shard` of a ZeRO-1..3 plan gets (module docstring)."""
    offload = Offload(offload)
    if offload is Offload.OPTIMIZER:
        raise ValueError("offload=optimizer (ZeRO-Offload) has no FSDP2 form; export the plan to DeepSpeed or "
                         "Megatron-LM, or plan with offload=params or none")
    if offload is Offload.PARAMS and zero_stage != 3:
        raise ValueError(f"offload=params needs zero_stage 3, got {zero_stage}")
    kwargs: dict[str, Any] = {"reshard_after_forward": zero_stage == 3 and reshard_after_forward}
    if offload is Offload.PARAMS:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type != "cpu")
    return kwargs
