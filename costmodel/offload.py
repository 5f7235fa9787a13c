"""Offloading model state to host memory: the host-device copies and the CPU optimizer step it costs per step.

What moves and what it saves on the device is `costmodel.memory` (`model_state_bytes(offload=...)`); the host's
link, memory and CPU come from `costmodel.hardware.host` (measured or cited per device type). With P the
parameters a rank updates (its shard under ZeRO >= 1), w the training dtype's bytes and B_h2d, B_d2h the link's
measured copy rates, R the host CPU's Adam rate per device:

Optimizer offload (ZeRO-Offload, Ren et al., ATC'21; DeepSpeed `offload_optimizer`, Megatron-LM
`--optimizer-cpu-offload`), at the end of each step, one after another (the step needs every gradient and the
next forward every weight):

    d2h = 4 P / B_d2h        the fp32 gradient shard to the host
    cpu = P / R              Adam over the fp32 master, m and v
    h2d = w P / B_h2d        the updated weights back (then ZeRO-1/2 all-gather them as without offload)

ZeRO-Offload overlaps the gradient copy with the backward bucket by bucket and can delay the parameter update by
one step (DPU) to hide the CPU step; neither is priced here, so the tail is an upper bound of what DeepSpeed does.

Parameter offload (FSDP2 `CPUOffloadPolicy`, ZeRO-3), per FSDP unit (a segment) and micro-batch, as torch 2.13
runs it (`torch/distributed/fsdp/_fully_shard/_fsdp_param.py`, `_fsdp_collectives.py`):
- before each all-gather the unit's fp32 shard is copied host-to-device (`all_gather_inputs`: `.to(device,
  non_blocking=True)` in the all-gather stream): 4 S / B_h2d for a shard of S parameters, in the same prefetched
  chain as the all-gather, so it overlaps the previous unit's compute exactly as the gather does
  (`step_time.overlapped_exposed` of gather + copy); with `reshard_after_forward` again before the backward;
- after each reduce-scatter the fp32 gradient shard is copied device-to-host: 4 S / B_d2h. `foreach_reduce`
  copies it non-blocking only when no gradient is accumulated yet; from the second micro-batch on it must add to
  the host gradient and copies blocking, so with more than one micro-batch the copy is priced exposed on every
  micro-batch (the first's is overlapped in truth: at most one copy of over-pricing), with one micro-batch it joins
  the overlapped reduce-scatter chain. The host-side add is not priced;
- the optimizer steps on the CPU over the host shard: P / R at the end of the step, exposed; no device step.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.breakdown import MemoryBreakdown
from costmodel.hardware.host import HostSpec, host_of
from costmodel.memory import GIB, GRAD_BYTES, MASTER_BYTES
from costmodel.strategy import Offload


@dataclass(frozen=True, slots=True)
class HostCopy:
    """Host-device copies of one virtual stage's FSDP2 units per micro-batch (parameter offload), seconds."""

    h2d_s: float
    """Copy of the stage's fp32 parameter shards to the device, once per all-gather."""
    d2h_s: float
    """Copy of the stage's reduce-scattered fp32 gradient shards to the host."""
    blocking: bool
    """Whether the gradient copy blocks (gradient accumulation over micro-batches: module docstring)."""


@dataclass(frozen=True, slots=True)
class OffloadTail:
    """What offloading adds at the end of a step on one rank, seconds (module docstring)."""

    d2h_s: float = 0.0
    cpu_step_s: float = 0.0
    h2d_s: float = 0.0

    @property
    def copy_s(self) -> float:
        return self.d2h_s + self.h2d_s

    @property
    def total_s(self) -> float:
        return self.d2h_s + self.cpu_step_s + self.h2d_s


def host_copy(shard_params: int, host: HostSpec, *, num_microbatches: int) -> HostCopy:
    """Per-micro-batch copies of a stage whose FSDP2 units hold `shard_params` parameters on this rank."""
    return HostCopy(h2d_s=MASTER_BYTES * shard_params / host.host_to_device_bandwidth,
                    d2h_s=GRAD_BYTES * shard_params / host.device_to_host_bandwidth,
                    blocking=num_microbatches > 1)


def offload_tail(offload: Offload, updated_params: int, host: HostSpec, *, weight_bytes: int) -> OffloadTail:
    """The end-of-step copies and CPU Adam step of a rank that updates `updated_params` parameters."""
    offload = Offload(offload)
    if offload is Offload.NONE or updated_params <= 0:
        return OffloadTail()
    cpu = updated_params / host.adam_params_per_s
    if offload is Offload.PARAMS:
        return OffloadTail(cpu_step_s=cpu)
    return OffloadTail(d2h_s=GRAD_BYTES * updated_params / host.device_to_host_bandwidth, cpu_step_s=cpu,
                       h2d_s=weight_bytes * updated_params / host.host_to_device_bandwidth)


HOST_OVERFLOW_BYTES = 2.0 ** 60
"""Added to the device bytes of a stage whose offloaded state overflows its host (`bytes_to_fit`)."""


def bytes_to_fit(memory: MemoryBreakdown, offload: Offload, device_name: str) -> float:
    """The device bytes a stage must fit in: its peak, plus `HOST_OVERFLOW_BYTES` when its host cannot take what
    it offloads -- far above any device's memory, so the stage does not fit, and small enough that the difference
    of two such values keeps its bytes (float64 spacing at 2^60 is 256), as a search's affine memory terms need."""
    overflow = host_problem(offload, device_name, host_of(device_name), memory.host, 0)
    return memory.total + (HOST_OVERFLOW_BYTES if overflow else 0.0)


def host_problem(offload: Offload, device_name: str, host: HostSpec | None, host_bytes: int, stage: int) -> str:
    """Why pipeline rank `stage` cannot offload `host_bytes` to its host ('' when it can)."""
    if Offload(offload) is Offload.NONE:
        return ""
    if host is None:
        return (f"offload={Offload(offload).value}: the catalog has no host link data for {device_name} "
                f"(costmodel/hardware/data/host.csv); valid: offload=none")
    if not host.host_memory_bytes:
        return (f"offload={Offload(offload).value}: no host memory size is known for {device_name} "
                f"(costmodel/hardware/data/host.csv); valid: offload=none")
    if host_bytes > host.host_memory_bytes:
        return (f"stage {stage} offloads {host_bytes / GIB:.1f} GiB to the host > {host.host_memory_bytes / GIB:.1f} "
                f"GiB host memory per device ({device_name})")
    return ""
