"""What `costmodel.estimate` returns: step time, throughput, utilization and memory, with their breakdowns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TimeBreakdown:
    """Seconds of one step on the critical path; the terms add up to the step time."""

    compute_s: float
    recompute_s: float
    tp_comm_s: float
    """Exposed tensor/context/expert-parallel communication."""
    pp_comm_s: float
    """Exposed pipeline send/recv."""
    dp_comm_s: float
    """Exposed data-parallel gradient reduction and ZeRO parameter gathers (the part not hidden by backward)."""
    bubble_s: float
    optimizer_s: float
    framework_s: float = 0.0
    """Framework host work on the bottleneck rank (`costmodel.framework`: data-parallel unit hooks, pipeline
    actions, checkpoint machinery); 0 unless a profile measured it. Optional in plan JSON (older plans)."""
    offload_s: float = 0.0
    """Exposed host-device copies of offloaded model state (`costmodel.offload`); the CPU's optimizer step is in
    `optimizer_s`. In plan JSON only when not 0."""

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.recompute_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s
                + self.bubble_s + self.optimizer_s + self.framework_s + self.offload_s)

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "offload_s" or self.offload_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TimeBreakdown:
        return cls(**{k: float(d[k]) for k in cls.__dataclass_fields__
                      if k in d or k not in ("framework_s", "offload_s")})


@dataclass(frozen=True, slots=True)
class MemoryBreakdown:
    """Peak bytes on one device of a stage."""

    params: int
    grads: int
    optimizer: int
    activations: int
    temporary: int
    overhead: int
    host: int = 0
    """Model state offloaded to host memory (`costmodel.offload`); not part of `total`, the device's peak. In plan
    JSON only when not 0."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.temporary + self.overhead

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "host" or self.host}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MemoryBreakdown:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__ if k in d or k != "host"})


@dataclass(frozen=True, slots=True)
class StageEstimate:
    index: int
    start: int
    stop: int
    """Segment range of the stage (for interleaved schedules: of the first virtual stage on this device)."""
    device: str
    fwd_s: float
    """Forward time of one micro-batch on this stage, communication included."""
    bwd_s: float
    """Backward time of one micro-batch, recomputation and communication included."""
    memory: MemoryBreakdown
    capacity_bytes: int
    in_flight_microbatches: int
    wgrad_s: float = 0.0
    """Of `bwd_s`, the weight-gradient part the zero-bubble schedules run on its own (0 for the others; the JSON
    carries it only when it is not 0)."""

    def to_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "start": self.start, "stop": self.stop, "device": self.device,
               "fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "memory": self.memory.to_dict(),
               "capacity_bytes": self.capacity_bytes, "in_flight_microbatches": self.in_flight_microbatches}
        if self.wgrad_s:
            out["wgrad_s"] = self.wgrad_s
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageEstimate:
        return cls(index=d["index"], start=d["start"], stop=d["stop"], device=d["device"], fwd_s=d["fwd_s"],
                   bwd_s=d["bwd_s"], memory=MemoryBreakdown.from_dict(d["memory"]),
                   capacity_bytes=d["capacity_bytes"], in_flight_microbatches=d["in_flight_microbatches"],
                   wgrad_s=d.get("wgrad_s", 0.0))


@dataclass(frozen=True, slots=True)
class Estimate:
    step_time_s: float
    tokens_per_s: float | None
    """None for models without a sequence dimension (then use samples_per_s)."""
    samples_per_s: float
    model_tflops_per_device: float
    """Model FLOPs (6 x params x tokens style, no recomputation) per device per second, in TFLOP/s."""
    hardware_tflops_per_device: float
    """Including recomputation."""
    mfu: float
    hfu: float
    stages: tuple[StageEstimate, ...]
    breakdown: TimeBreakdown
    fits: bool
    problems: tuple[str, ...] = ()
    """Why the strategy is invalid or does not fit, one sentence each; empty when it is fine."""
    error_band: float = 0.0
    """Relative error of `step_time_s` expected from the validation of its device types against published runs
    (`costmodel.validation.error_band`): predictions closer than this are ties."""

    @property
    def peak_memory_bytes(self) -> tuple[int, ...]:
        return tuple(s.memory.total for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
            "samples_per_s": self.samples_per_s, "tflops_per_device": self.model_tflops_per_device,
            "hardware_tflops_per_device": self.hardware_tflops_per_device, "mfu": self.mfu, "hfu": self.hfu,
            "peak_memory_bytes": list(self.peak_memory_bytes),
            "stages": [s.to_dict() for s in self.stages], "breakdown": self.breakdown.to_dict(),
            "fits": self.fits, "problems": list(self.problems), "error_band": self.error_band,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Estimate:
        return cls(step_time_s=d["step_time_s"], tokens_per_s=d["tokens_per_s"], samples_per_s=d["samples_per_s"],
                   model_tflops_per_device=d["tflops_per_device"],
                   hardware_tflops_per_device=d["hardware_tflops_per_device"], mfu=d["mfu"], hfu=d["hfu"],
                   stages=tuple(StageEstimate.from_dict(s) for s in d["stages"]),
                   breakdown=TimeBreakdown.from_dict(d["breakdown"]), fits=d["fits"],
                   problems=tuple(d["problems"]), error_band=d.get("error_band", 0.0))
