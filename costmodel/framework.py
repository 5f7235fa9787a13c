"""Framework overheads: what the training runtime costs around the operators and the wire, measured per device.

The operator model (`costmodel.operators`, or a profile's op timings) prices the math; the collective model
(`costmodel.hardware.collectives`) prices the bytes and the latency of each collective. Neither prices the machinery
the strategy runs on: DTensor dispatch around a tensor-parallel module, the hooks, copy-in/copy-out and
bookkeeping of an FSDP2 / replicate unit, the optimizer's per-tensor work over DTensor parameters. On a GPU with a
large model that host work hides behind the kernels; on CPU ranks or with small layers it is the step time --
`bench/fidelity.py` measured 3-9 ms per layer and micro-batch of it on `gpt-tiny`, against 0.1-1 ms of math.

`stratagem profile --framework` (`planner.profiling.framework`) measures these terms on the local device with the
local process group and stores them as profile entries (`costmodel.profile_db.OpProfile`) under the signatures
below; `FrameworkCosts.from_profile` reads them back. Without entries every term is 0: the analytical model
assumes the host keeps ahead of the device (true for large layers on GPUs, where kernels run asynchronously).

Terms, seconds, all host CPU work measured as the ranks run it -- `planner.profiling.framework` runs as many
processes as the cluster has ranks, so cores shared by several ranks are in the figures, and the step-time model
does not divide them by the device's speed factor (the tensor-parallel term, which joins the node's compute in
the sharding model, is the exception: it is divided with the compute):

- optimizer per parameter tensor, plain tensors and DTensors (FSDP2, replicate and tensor-parallel parameters
  are DTensors), on top of Adam's bytes at memory bandwidth (`step_time.optimizer_step_time`);
- per data-parallel unit and micro-batch, forward and backward, for each wrapping mode (`DataParallelMode`) and
  data-parallel group size: the unit's overhead net of its collectives, which `step_time.data_parallel_comm`
  prices one per unit;
- per parameter tensor whose gradient is partial over the tensor-parallel group (a replicated weight applied to
  sequence-sharded tokens), per group size: its share of the runtime's one flat sync of all such gradients
  (flattening and DTensor wrapping, net of the all-reduce), added to that all-reduce
  (`step_time.tp_grad_sync_time`);
- per pipeline action (one stage's forward or backward of one micro-batch under `torch.distributed.pipelining`),
  per pipeline size: the schedule's host work around the stage call, net of the send/recv on the wire, once for
  the single-stage schedules (GPipe, 1F1B: `pp_action`) and once for the multi-chunk ones (interleaved,
  zero-bubble, V-shaped: `pp_chunked_action`), which torch runs through another engine, its action runtime, with
  each send and receive an action of its own (0.27 ms per action on 2 gloo CPU ranks, ~0 for 1F1B's);
- per layer and micro-batch of a zero-bubble schedule, backward: splitting the backward into its input-gradient
  and weight-gradient passes (torch's `stage_backward_input` walks the autograd graph to keep the weight
  gradients' inputs, `stage_backward_weight` runs a second backward) beyond one whole backward
  (`split_backward`);
- per recomputed (checkpointed) layer and micro-batch, forward and backward, selective and full: the
  checkpoint machinery's own cost beyond rerunning the forward (`recompute`; selective checkpointing calls a
  Python policy per op);
- per tensor-parallel-sharded module call and micro-batch, forward and backward, per tensor-parallel group size:
  DTensor dispatch and the layout hooks around the module, net of the module's collectives
  (`costmodel.sharding.cost` adds it to every node that runs a sharded strategy with parameters).

Entries: ``device = <device type>``, ``forward_s`` / ``backward_s`` as below (`backward_s` 0 where there is
none), signatures::

    framework|optimizer|plain            forward_s = seconds per plain parameter tensor per step
    framework|optimizer|dtensor          forward_s = seconds per DTensor parameter tensor per step
    framework|dp_unit|<mode>|g=<n>       per unit and micro-batch (mode: replicate, fsdp, fsdp_reshard)
    framework|tp_module|g=<n>            per sharded module call and micro-batch
    framework|grad_sync|g=<n>            forward_s = seconds per partial-gradient tensor per step
    framework|pp_action|g=<p>            per pipeline stage action (forward, backward) of one micro-batch
    framework|pp_chunked_action|g=<p>    the same under a multi-chunk schedule
    framework|split_backward             backward_s = seconds per layer and micro-batch of a split backward
    framework|recompute|<mode>           per checkpointed layer and micro-batch (mode: selective, full)

A group size that was not measured uses the nearest measured one below it (else the smallest measured).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from costmodel.profile_db import OpProfile, OpTiming

SIGNATURE_PREFIX = "framework|"
T = TypeVar("T")


class DataParallelMode(enum.StrEnum):
    """How the runtime wraps a data-parallel unit (`planner.runtime.apply_fsdp`)."""

    REPLICATE = "replicate"
    """ZeRO-0: FSDP2-style `replicate` (parameters whole, gradients all-reduced)."""
    FSDP = "fsdp"
    """ZeRO-1/2: `fully_shard(reshard_after_forward=False)`."""
    FSDP_RESHARD = "fsdp_reshard"
    """ZeRO-3: `fully_shard(reshard_after_forward=True)`."""


def dp_mode(zero_stage: int) -> DataParallelMode:
    if zero_stage == 0:
        return DataParallelMode.REPLICATE
    return DataParallelMode.FSDP_RESHARD if zero_stage == 3 else DataParallelMode.FSDP


def optimizer_signature(dtensor: bool) -> str:
    return f"{SIGNATURE_PREFIX}optimizer|{'dtensor' if dtensor else 'plain'}"


def dp_unit_signature(mode: DataParallelMode, group_size: int) -> str:
    return f"{SIGNATURE_PREFIX}dp_unit|{DataParallelMode(mode).value}|g={group_size}"


def tp_module_signature(group_size: int) -> str:
    return f"{SIGNATURE_PREFIX}tp_module|g={group_size}"


def grad_sync_signature(group_size: int) -> str:
    return f"{SIGNATURE_PREFIX}grad_sync|g={group_size}"


def pp_action_signature(pipeline_size: int, chunked: bool = False) -> str:
    return f"{SIGNATURE_PREFIX}{'pp_chunked_action' if chunked else 'pp_action'}|g={pipeline_size}"


SPLIT_BACKWARD_SIGNATURE = f"{SIGNATURE_PREFIX}split_backward"


RECOMPUTE_MODES = ("selective", "full")
"""`costmodel.strategy.Recompute` values that checkpoint (the values of `FrameworkCosts.recompute`'s keys)."""


def recompute_signature(mode: str) -> str:
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode {mode!r} has no framework cost; valid: {', '.join(RECOMPUTE_MODES)}")
    return f"{SIGNATURE_PREFIX}recompute|{mode}"


@dataclass(frozen=True, slots=True)
class PassCost:
    """Seconds of forward and backward of one call (one micro-batch)."""

    forward_s: float = 0.0
    backward_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.forward_s >= 0 and self.backward_s >= 0):
            raise ValueError(f"framework costs must be >= 0 seconds, got {self.forward_s}, {self.backward_s}")

    def __bool__(self) -> bool:
        return self.forward_s > 0 or self.backward_s > 0


ZERO_PASS = PassCost()


def _by_group(table: Mapping[int, T], group_size: int, default: T) -> T:
    """The entry of `group_size`, else of the nearest measured size below it, else of the smallest; `default`
    when nothing was measured or there is no group."""
    if not table or group_size <= 1:
        return default
    if group_size in table:
        return table[group_size]
    below = [g for g in table if g <= group_size]
    return table[max(below)] if below else table[min(table)]


@dataclass(frozen=True)
class FrameworkCosts:
    """Measured framework overheads of one device type (module docstring); all zero when nothing was measured."""

    optimizer_per_tensor_s: float = 0.0
    optimizer_per_dtensor_s: float = 0.0
    dp_unit: Mapping[DataParallelMode, Mapping[int, PassCost]] = field(default_factory=dict)
    """Mode -> data-parallel group size -> overhead per unit and micro-batch."""
    tp_module: Mapping[int, PassCost] = field(default_factory=dict)
    """Tensor-parallel group size -> overhead per sharded module call and micro-batch."""
    grad_sync: Mapping[int, float] = field(default_factory=dict)
    """Tensor-parallel group size -> seconds per partial-gradient tensor synchronized in the optimizer step."""
    pp_action: Mapping[int, PassCost] = field(default_factory=dict)
    """Pipeline size -> host seconds per stage action (forward, backward) of one micro-batch (GPipe, 1F1B)."""
    pp_chunked_action: Mapping[int, PassCost] = field(default_factory=dict)
    """Pipeline size -> the same under a multi-chunk schedule (torch's action runtime)."""
    split_backward: PassCost = ZERO_PASS
    """Host seconds per layer and micro-batch a zero-bubble schedule's split backward adds."""
    recompute: Mapping[str, PassCost] = field(default_factory=dict)
    """"selective" / "full" -> checkpoint machinery seconds per recomputed layer and micro-batch."""

    def __post_init__(self) -> None:
        if not (self.optimizer_per_tensor_s >= 0 and self.optimizer_per_dtensor_s >= 0):
            raise ValueError("optimizer per-tensor costs must be >= 0 seconds")

    @property
    def is_zero(self) -> bool:
        return (self.optimizer_per_tensor_s == 0 and self.optimizer_per_dtensor_s == 0
                and not any(any(v) for v in self.dp_unit.values()) and not any(self.tp_module.values())
                and not any(self.grad_sync.values()) and not any(self.pp_action.values())
                and not any(self.pp_chunked_action.values()) and not self.split_backward
                and not any(self.recompute.values()))

    def optimizer_host_s(self, plain_tensors: int, dtensors: int) -> float:
        """Host seconds of one optimizer step over that many plain and DTensor parameter tensors."""
        return plain_tensors * self.optimizer_per_tensor_s + dtensors * self.optimizer_per_dtensor_s

    def dp_unit_cost(self, zero_stage: int, group_size: int) -> PassCost:
        return _by_group(self.dp_unit.get(dp_mode(zero_stage), {}), group_size, ZERO_PASS)

    def tp_module_cost(self, group_size: int) -> PassCost:
        return _by_group(self.tp_module, group_size, ZERO_PASS)

    def pp_action_cost(self, pipeline_size: int, chunked: bool = False) -> PassCost:
        """Per stage action; a multi-chunk schedule's where measured (profiles from before it was measured
        price it as a single-stage schedule's)."""
        if chunked and self.pp_chunked_action:
            return _by_group(self.pp_chunked_action, pipeline_size, ZERO_PASS)
        return _by_group(self.pp_action, pipeline_size, ZERO_PASS)

    def recompute_cost(self, mode: str) -> PassCost:
        """Per checkpointed layer and micro-batch; zero for "none" and for modes not measured."""
        return self.recompute.get(mode, ZERO_PASS)

    def grad_sync_per_tensor(self, group_size: int) -> float:
        """Measured seconds per partial-gradient tensor over `group_size` ranks; 0 when not measured."""
        return _by_group(self.grad_sync, group_size, 0.0)

    def entries(self, device: str) -> dict[tuple[str, str], OpTiming]:
        """Profile entries holding these costs for `device` (the inverse of `from_profile`)."""
        out: dict[tuple[str, str], OpTiming] = {}
        if self.optimizer_per_tensor_s:
            out[(device, optimizer_signature(False))] = OpTiming(self.optimizer_per_tensor_s, 0.0)
        if self.optimizer_per_dtensor_s:
            out[(device, optimizer_signature(True))] = OpTiming(self.optimizer_per_dtensor_s, 0.0)
        for mode, table in self.dp_unit.items():
            for g, c in table.items():
                out[(device, dp_unit_signature(mode, g))] = OpTiming(c.forward_s, c.backward_s)
        for g, c in self.tp_module.items():
            out[(device, tp_module_signature(g))] = OpTiming(c.forward_s, c.backward_s)
        for g, v in self.grad_sync.items():
            out[(device, grad_sync_signature(g))] = OpTiming(v, 0.0)
        for chunked, table in ((False, self.pp_action), (True, self.pp_chunked_action)):
            for g, c in table.items():
                out[(device, pp_action_signature(g, chunked))] = OpTiming(c.forward_s, c.backward_s)
        if self.split_backward:
            out[(device, SPLIT_BACKWARD_SIGNATURE)] = OpTiming(0.0, self.split_backward.backward_s)
        for mode, c in self.recompute.items():
            out[(device, recompute_signature(mode))] = OpTiming(c.forward_s, c.backward_s)
        return out

    @classmethod
    def from_profile(cls, profile: OpProfile | None, device: str) -> FrameworkCosts:
        """The costs `profile` holds for `device` (zero for what it does not hold)."""
        if profile is None:
            return NO_FRAMEWORK_COSTS
        plain = profile.lookup(device, optimizer_signature(False))
        dtensor = profile.lookup(device, optimizer_signature(True))
        dp_unit: dict[DataParallelMode, dict[int, PassCost]] = {}
        tp_module: dict[int, PassCost] = {}
        grad_sync: dict[int, float] = {}
        pp_action: dict[str, dict[int, PassCost]] = {"pp_action": {}, "pp_chunked_action": {}}
        recompute: dict[str, PassCost] = {}
        split = profile.lookup(device, SPLIT_BACKWARD_SIGNATURE)
        # Only this device's framework entries (a profile holds thousands of op entries), in a fixed order.
        mine = sorted((sig, t) for (dev, sig), t in profile.entries.items()
                      if dev == device and sig.startswith(SIGNATURE_PREFIX))
        for sig, t in mine:
            parts = sig.split("|")
            if parts[1] == "dp_unit" and len(parts) == 4 and parts[3].startswith("g="):
                dp_unit.setdefault(DataParallelMode(parts[2]), {})[int(parts[3][2:])] = \
                    PassCost(t.forward_s, t.backward_s)
            elif parts[1] == "tp_module" and len(parts) == 3 and parts[2].startswith("g="):
                tp_module[int(parts[2][2:])] = PassCost(t.forward_s, t.backward_s)
            elif parts[1] == "grad_sync" and len(parts) == 3 and parts[2].startswith("g="):
                grad_sync[int(parts[2][2:])] = t.forward_s
            elif parts[1] in pp_action and len(parts) == 3 and parts[2].startswith("g="):
                pp_action[parts[1]][int(parts[2][2:])] = PassCost(t.forward_s, t.backward_s)
            elif parts[1] == "recompute" and len(parts) == 3 and parts[2] in RECOMPUTE_MODES:
                recompute[parts[2]] = PassCost(t.forward_s, t.backward_s)
        if plain is None and dtensor is None and split is None \
                and not (dp_unit or tp_module or grad_sync or any(pp_action.values()) or recompute):
            return NO_FRAMEWORK_COSTS
        return cls(optimizer_per_tensor_s=plain.forward_s if plain else 0.0,
                   optimizer_per_dtensor_s=dtensor.forward_s if dtensor else 0.0,
                   dp_unit=dp_unit, tp_module=tp_module, grad_sync=grad_sync, pp_action=pp_action["pp_action"],
                   pp_chunked_action=pp_action["pp_chunked_action"], recompute=recompute,
                   split_backward=PassCost(0.0, split.backward_s) if split else ZERO_PASS)


NO_FRAMEWORK_COSTS = FrameworkCosts()
"""The analytical model's assumption: the host keeps ahead of the device."""
