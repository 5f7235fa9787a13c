"""Peak memory of one device: model state, saved activations, temporary buffers and a fixed framework overhead.

Model state, mixed-precision Adam as Megatron-LM and PyTorch FSDP2 keep it (per parameter, d = dp ranks):
- ZeRO-0/1/2: 16-bit weights (2 bytes), fp32 gradient accumulation buffers (4: Megatron-LM turns
  `accumulate_allreduce_grads_in_fp32` on for bf16 and reduces the fp32 "main grads"; FSDP2's recommended
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` does the same), and 12 bytes of fp32 optimizer
  state (master weight, Adam m and v). That is 18 bytes, and 6 + 12/d with the optimizer state sharded (ZeRO-1, the
  distributed optimizer) -- the figures of Megatron-LM's docs/source/api-guide/dist_optimizer.md. ZeRO-2 also
  shards the gradients (2 + 16/d).
- ZeRO-3 (FSDP2 with mixed precision): the fp32 sharded parameter is the master copy, so 4/d weights + 4/d
  gradients + 8/d Adam state = 16/d; the 16-bit copies of the running and prefetched units are temporary.
A trainer that keeps and reduces its gradients in the 16-bit training dtype (`RuntimeOptions.grads_in_training_dtype`:
Megatron-LM `--grad-reduce-in-bf16`, NeMo `grad_sync_dtype: bf16`) holds 2 bytes per gradient instead of 4
(`grad_bytes`): 4 + 12/d under ZeRO-1. Training in fp32 keeps 4 + 4 + 8 (no master copy), sharded the same way.
(Rajbhandari et al., SC'20, Sec. 3.1 count 2 + 2 + 12 with 16-bit gradients: the same total under ZeRO-3, 2 bytes
less without it.)

Offload (`strategy.Offload`) moves model state to host memory (`MemoryBreakdown.host`, checked against the host
memory per device by `costmodel.offload`):
- optimizer (ZeRO-Offload, Ren et al., ATC'21 Sec. 4.1): the fp32 master weight and Adam m and v (12 bytes) and
  the fp32 gradient the CPU step reads (4) live on the host for every parameter this rank updates (its shard under
  ZeRO >= 1): 16 bytes each; the device keeps the training-dtype weights (under ZeRO-3 its shard of them) and its
  gradient buffers, and no optimizer state.
- params (FSDP2 `CPUOffloadPolicy`, ZeRO-3): the sharded fp32 parameter, its gradient and the Adam state are host
  tensors (`torch.distributed.fsdp._fully_shard._fsdp_param`: the padded shard is moved `.cpu()` at init), the
  whole 16/d bytes; the device keeps none of them between uses, only the unit being gathered: its fp32 shard
  copied host-to-device before the all-gather (a temporary, beside the gathered weights).

Activations: for each model chunk on the device, the bytes its segments save for one micro-batch under their
recomputation choice (`LayerCost.saved_bytes_*`, and what the training loss keeps: `kept_bytes`), times the
micro-batches in flight on that chunk at the schedule's peak (`costmodel.pipeline.in_flight_per_chunk`: GPipe m,
1F1B p - rank, interleaved Megatron's count).
Korthikanti et al. 2022 (Sec. 4) give the closed forms this reproduces for a GPT layer:
s*b*h*(34 + 5*a*s/h) bytes without recomputation, 34*s*b*h with selective recomputation, 2*s*b*h with full;
tensor parallelism divides the parts it shards and sequence parallelism the rest (34/t) -- see
`korthikanti_layer_activation_bytes`.

Temporary buffers: the largest transient of any segment (`LayerCost.peak_temp_bytes`, or for the segment that
returns the logits the training loss's buffers, `training_loss.loss_transient_bytes`, if larger), plus the
activations a recomputed segment re-materializes while its backward runs (saved-with-none minus
saved-with-its-choice, for the largest such segment), plus under ZeRO-3 the gathered full weights of the largest
segment twice (the one running and the one prefetched) -- or, without `reshard_after_forward`, the gathered
weights of every segment of the rank; under ZeRO-2/3 also the whole gradient of the largest unit while it is
reduce-scattered (16-bit and its fp32 copy: FSDP2's `reduce_dtype=float32`).

Under pipeline parallelism (`pipelined`: torch.distributed.pipelining runs FSDP's backward without gradient sync
and without resharding for every micro-batch but the last, `step_time.data_parallel_comm(pipelined=True)`) ZeRO-2/3 keep the
rank's whole gradient (4 bytes per parameter, ZeRO-1's) and, under ZeRO-3, the gathered weights of every segment
from a backward to the next forward.

Pipeline buffers (`p2p_buffer_bytes`), under torch.distributed.pipelining (`RuntimeOptions.p2p_transient_buffers`
false; torch/distributed/pipelining/stage.py, torch 2.13): a stage that receives activations allocates a buffer
for each of the step's m micro-batches and keeps them across steps (`_setup_forward_recv_info`); the first op of
the stage saves its input, so the buffers of the micro-batches in flight are already saved activations and m - n
more are kept. A stage that sends allocates m gradient-receive buffers of its output's size
(`_setup_backward_recv_info`) and keeps each in-flight micro-batch's output in `fwd_cache` until its backward:
m + n of them. Measured on this project's runtime (`python bench/pipeline_buffers.py`: gpt-tiny 512 wide, 1,024
tokens, pp2 1F1B, 2 CPU ranks, peak live tensor bytes): from 4 to 16 micro-batches both stages grew 24.09 MiB
(12 boundaries of 2 MiB: 24.00 priced), and the stage peaks are +0.7% / +1.8% off at 16 (-11.9% / -12.3% without
the buffers). Megatron-LM and DeepSpeed keep no such buffers (`RuntimeOptions.p2p_transient_buffers`). Where the
trainer asks the schedule for its outputs (`RuntimeOptions.pp_returns_outputs`, torchtitan), the last stage also
keeps every micro-batch's output, the logits (w bytes per local logit), until the step ends: m of them at the last
backward, beside the loss's own buffers. The concatenation of them after the last backward (m more) is not priced:
it comes once the activations, the gathered weights and the unsharded gradients are freed, so it sets the peak
only where the model state is small beside the logits (the bench above, returning the outputs at 16 micro-batches:
the last stage grew 62.0 MiB, 32.0 priced).

Framework overhead: the CUDA context, cuBLAS/NCCL workspaces: about 0.75 GiB per GPU process (PyTorch forums,
"What is the reason for pytorch's GPU memory floor?" measures 723 MiB, "High gpu memory overhead" ~800 MB, both
the CUDA context). On `cpu`, 230 MiB: the peak RSS of a Python process that imports torch 2.13.0 and runs one
training step of a tiny model (`/usr/bin/time -v`, measured on this project's machine).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.breakdown import MemoryBreakdown
from costmodel.layer_cost import LayerCost
from costmodel.strategy import FP32_BYTES, CrossEntropy, Offload, Recompute
from costmodel.training_loss import loss_saved_bytes, loss_transient_bytes
from ir.graph import dtype_bytes

GIB = 1024 ** 3
MIB = 1024 ** 2
OPTIMIZER_BYTES_MIXED = 12
"""fp32 master weight + Adam m + v per parameter (ZeRO paper Sec. 3.1)."""
OPTIMIZER_BYTES_FP32 = 8
"""Adam m + v in fp32 when the weights themselves are fp32 (or, under ZeRO-3, are the fp32 master shard)."""
GRAD_BYTES = FP32_BYTES
"""Gradients are accumulated and reduced in fp32 whatever the training dtype (module docstring)."""
MASTER_BYTES = 4
GPU_FRAMEWORK_OVERHEAD_BYTES = 768 * MIB
CPU_FRAMEWORK_OVERHEAD_BYTES = 230 * MIB


@dataclass(frozen=True, slots=True)
class ModelState:
    params: int
    grads: int
    optimizer: int
    host: int = 0
    """Bytes of model state offloaded to host memory (not part of `total`, the device's bytes)."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def __add__(self, other: ModelState) -> ModelState:
        return ModelState(self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer,
                          self.host + other.host)


def _validate_zero(zero_stage: int, dp: int) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")


def model_state_bytes(param_count: int, *, zero_stage: int = 0, dp: int = 1, dtype: str = "bfloat16",
                      offload: Offload = Offload.NONE, pipelined: bool = False,
                      grad_bytes: int = GRAD_BYTES) -> ModelState:
    """Weights, gradients and Adam state of `param_count` parameters on one rank, and what `offload` moves to
    the host (see module docstring); `pipelined` keeps ZeRO-2/3 gradients whole (pipelining's no-sync backward);
    `grad_bytes` per gradient (`RuntimeOptions.grad_bytes`: fp32 unless the trainer keeps them 16-bit)."""
    _validate_zero(zero_stage, dp)
    w = dtype_bytes(dtype)
    shard = math.ceil(param_count / dp)
    grads = (shard if zero_stage >= 2 and not pipelined else param_count) * grad_bytes
    if w >= MASTER_BYTES or zero_stage >= 3:
        # The sharded (or only) fp32 weight is the master copy: no separate 12-byte master + moments.
        state = ModelState(params=(shard if zero_stage >= 3 else param_count) * MASTER_BYTES, grads=grads,
                           optimizer=(shard if zero_stage >= 1 else param_count) * OPTIMIZER_BYTES_FP32)
    else:
        state = ModelState(params=param_count * w, grads=grads,
                           optimizer=(shard if zero_stage >= 1 else param_count) * OPTIMIZER_BYTES_MIXED)
    offload = Offload(offload)
    if offload is Offload.PARAMS:
        if zero_stage != 3:
            raise ValueError(f"offload=params needs zero_stage 3, got {zero_stage}")
        return ModelState(0, 0, 0, host=state.total)
    if offload is Offload.OPTIMIZER:
        updated = shard if zero_stage >= 1 else param_count
        return ModelState(params=(shard if zero_stage >= 3 else param_count) * w, grads=state.grads, optimizer=0,
                          host=updated * (MASTER_BYTES + OPTIMIZER_BYTES_FP32 + GRAD_BYTES))
    return state


def saved_bytes(cost: LayerCost, recompute: Recompute) -> int:
    """Activation bytes a segment keeps per micro-batch under `recompute`."""
    if recompute.__class__ is not Recompute:  # the conversion costs more than the lookup, in the search's loops
        recompute = Recompute(recompute)
    if recompute is Recompute.FULL:
        return cost.saved_bytes_full
    if recompute is Recompute.SELECTIVE:
        return cost.saved_bytes_selective
    if recompute is Recompute.OP:
        return cost.saved_bytes_op
    return cost.saved_bytes_none


def kept_bytes(cost: LayerCost, recompute: Recompute, cross_entropy: CrossEntropy, dtype: str) -> float:
    """What a segment keeps per micro-batch in flight: its activations under `recompute` and, on the segment that
    returns the logits, what the loss keeps for backward (`training_loss.loss_saved_bytes`)."""
    saved = saved_bytes(cost, recompute)
    if cost.loss_elements:
        saved += loss_saved_bytes(cost.loss_elements, dtype, cross_entropy)
    return saved


def chunk_kept_bytes(chunk: Sequence[PricedSegment], cross_entropy: CrossEntropy, dtype: str) -> float:
    """What one micro-batch in flight keeps on a chunk of segments (`kept_bytes` of each)."""
    return sum(s.count * kept_bytes(s.cost, s.recompute, cross_entropy, dtype) for s in chunk)


def expert_shard_ranks(dp_size: int, ep_dp: int) -> int:
    """Ranks that ZeRO shards an expert's state over: the data-parallel ranks holding the same experts, dp / ep_dp
    (an expert-parallel group spans ep_dp of the dp coordinates; `costmodel.expert_parallel`)."""
    return max(dp_size // ep_dp, 1)


def framework_overhead_bytes(device_name: str) -> int:
    return CPU_FRAMEWORK_OVERHEAD_BYTES if device_name == "cpu" else GPU_FRAMEWORK_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class PricedSegment:
    """A segment as placed on a device: its cost and its recomputation choice; `count` consecutive segments of
    the chain when they share both (a stage's identical blocks: `runs`). Every sum over segments weighs it, so a
    stage of k identical blocks is priced in one step instead of k."""

    cost: LayerCost
    recompute: Recompute = Recompute.NONE
    count: int = 1


def runs(segments: Sequence[PricedSegment]) -> list[PricedSegment]:
    """`segments` with each run of consecutive equal ones (the same cost object and recomputation) merged into one
    `PricedSegment` of their total count. The estimate and the search both price stages this way, so that they
    add up the same numbers in the same order."""
    merged: list[PricedSegment] = []
    for s in segments:
        last = merged[-1] if merged else None
        if last is not None and last.cost is s.cost and last.recompute == s.recompute:
            merged[-1] = PricedSegment(s.cost, s.recompute, last.count + s.count)
        else:
            merged.append(s)
    return merged


def uniform_runs(costs: Sequence[LayerCost], recompute: Recompute) -> list[PricedSegment]:
    """`runs` of segments priced `costs`, all with `recompute` (one pass that compares the cost objects only)."""
    merged: list[PricedSegment] = []
    start = 0
    for i in range(1, len(costs) + 1):
        if i == len(costs) or costs[i] is not costs[start]:
            merged.append(PricedSegment(costs[start], recompute, i - start))
            start = i
    return merged


def transient_bytes(cost: LayerCost, dtype: str, cross_entropy: CrossEntropy) -> float:
    """The largest buffer a segment holds for a moment while it runs: its own (attention scores, ...) or, on the
    segment that returns the logits (the only one with a loss), the loss's as the trainer's kernel computes it."""
    if not cost.loss_elements:
        return cost.peak_temp_bytes
    return max(cost.peak_temp_bytes, loss_transient_bytes(cost.loss_elements, dtype, cross_entropy))


@dataclass(frozen=True, slots=True)
class ChunkBoundary:
    """The pipeline activations one model chunk exchanges per micro-batch: bytes it receives from the previous
    stage (0 on the first) and sends to the next (0 on the last)."""

    received: int = 0
    sent: int = 0
    returned: int = 0
    """Bytes of the output the schedule keeps per micro-batch until the step ends (the last stage's, when the
    trainer asks for the outputs: `RuntimeOptions.pp_returns_outputs`)."""


def returned_bytes(loss_elements: float, dtype: str) -> int:
    """Bytes of the output a stage ending with `loss_elements` local logits returns per micro-batch (the logits,
    in the training dtype)."""
    return round(loss_elements * dtype_bytes(dtype))


def p2p_buffer_bytes(boundary: ChunkBoundary, num_microbatches: int) -> tuple[int, int]:
    """(bytes with no micro-batch in flight, bytes per micro-batch in flight) of the chunk's pipeline buffers under
    torch.distributed.pipelining (module docstring): m receive buffers of which the n in flight are saved
    activations already, m gradient-receive buffers, the n in-flight outputs, and the m returned outputs."""
    m = num_microbatches
    return m * (boundary.received + boundary.sent + boundary.returned), boundary.sent - boundary.received


def rank_memory(chunks: Sequence[Sequence[PricedSegment]], in_flight: Sequence[int], *, zero_stage: int = 0,
                dp: int = 1, dtype: str = "bfloat16", device_name: str = "gpu", extra_params: int = 0,
                ep_dp: int = 1, reshard_after_forward: bool = True, offload: Offload = Offload.NONE,
                pipelined: bool = False, cross_entropy: CrossEntropy = CrossEntropy.TORCH,
                grad_bytes: int = GRAD_BYTES, boundaries: Sequence[ChunkBoundary] = (),
                num_microbatches: int = 1) -> MemoryBreakdown:
    """Peak bytes on one device holding `chunks` (one per virtual stage) with `in_flight[c]` micro-batches each.

    `extra_params`: parameters the device holds besides its segments' own (a copy of a weight shared with another
    pipeline rank, such as tied embeddings on the last stage), with their gradients and optimizer state.
    `ep_dp`: data-parallel ranks an expert-parallel group spans (`Strategy.ep_dp`); ZeRO shards expert weights
    (`LayerCost.expert_param_count`) over dp / ep_dp ranks.
    `cross_entropy`: the trainer's loss kernel (`RuntimeOptions.cross_entropy`); `grad_bytes`: bytes per gradient
    (`RuntimeOptions.grad_bytes`).
    `boundaries`: per chunk, what it exchanges with its pipeline neighbours, when the runtime keeps pipeline buffers
    (`p2p_buffer_bytes`, for `num_microbatches` per step; empty: none kept)."""
    if len(chunks) != len(in_flight):
        raise ValueError(f"{len(chunks)} chunks but {len(in_flight)} in-flight counts")
    if boundaries and len(boundaries) != len(chunks):
        raise ValueError(f"{len(chunks)} chunks but {len(boundaries)} chunk boundaries")
    segments = [s for chunk in chunks for s in chunk]
    # Expert parallelism (costmodel/expert_parallel.py): expert state is sharded over dp / ep_dp ranks.
    experts = sum(s.count * s.cost.expert_param_count for s in segments)
    # Parameter offload keeps FSDP2's per-micro-batch reduction (`step_time.data_parallel_comm`).
    pipelined = pipelined and Offload(offload) is not Offload.PARAMS
    state = model_state_bytes(sum(s.count * s.cost.param_count for s in segments) + extra_params - experts,
                              zero_stage=zero_stage, dp=dp, dtype=dtype, offload=offload, pipelined=pipelined,
                              grad_bytes=grad_bytes)
    if experts:
        state += model_state_bytes(experts, zero_stage=zero_stage, dp=expert_shard_ranks(dp, ep_dp), dtype=dtype,
                                   offload=offload, pipelined=pipelined, grad_bytes=grad_bytes)
    # With nothing in flight (the search's affine memory terms ask for that first) every product is 0.
    activations = round(sum(n * chunk_kept_bytes(chunk, cross_entropy, dtype)
                            for chunk, n in zip(chunks, in_flight, strict=True) if n))
    for boundary, n in zip(boundaries, in_flight, strict=False):
        base, per_microbatch = p2p_buffer_bytes(boundary, num_microbatches)
        activations += base + n * per_microbatch
    rematerialized, transient = 0, 0.0
    for s in segments:
        rematerialized = max(rematerialized, s.cost.saved_bytes_none - saved_bytes(s.cost, s.recompute))
        transient = max(transient, transient_bytes(s.cost, dtype, cross_entropy))
    temporary = round(transient) + rematerialized
    w = dtype_bytes(dtype)
    if zero_stage >= 2:
        # The unit being reduced has its whole gradient for a moment: in the training dtype, plus the fp32 copy
        # the reduce-scatter sends when training in 16 bits with fp32 reduction.
        unit_grad = w + (grad_bytes if w < grad_bytes else 0)
        temporary += unit_grad * max((s.cost.param_count for s in segments), default=0)
    if zero_stage >= 3:
        kept = pipelined or not reshard_after_forward
        temporary += (sum(s.count * s.cost.param_count * w for s in segments) if kept
                      else 2 * max((s.cost.param_count * w for s in segments), default=0))
    if Offload(offload) is Offload.PARAMS:
        # The fp32 shard of the unit being gathered, copied host-to-device ahead of its all-gather.
        temporary += MASTER_BYTES * math.ceil(max((s.cost.param_count for s in segments), default=0) / dp)
    return MemoryBreakdown(params=state.params, grads=state.grads, optimizer=state.optimizer,
                           activations=activations, temporary=temporary,
                           overhead=framework_overhead_bytes(device_name), host=state.host)


def korthikanti_layer_activation_bytes(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                                       sequence_parallel: bool = False,
                                       recompute: Recompute = Recompute.NONE) -> float:
    """Bytes one GPT layer saves per device (Korthikanti et al. 2022, Table 2; 16-bit, math attention, dropout).

    none: s*b*h*(10 + 24/t + 5*a*s/(h*t)), with SP: s*b*h/t * (34 + 5*a*s/h);
    selective: s*b*h*(10 + 24/t), with SP: 34*s*b*h/t; full: 2*s*b*h (2*s*b*h/t with SP).
    """
    s, b, h, a, t = seq, batch, hidden, heads, tp
    recompute = Recompute(recompute)
    if recompute is Recompute.FULL:
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention = 5 * a * s / h / t if recompute is Recompute.NONE else 0.0
    if sequence_parallel:
        return s * b * h * (34 / t + attention)
    return s * b * h * (10 + 24 / t + attention)
