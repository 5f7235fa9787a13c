"""Step time of a training step from per-stage costs: pipeline, data-parallel reduction, ZeRO, optimizer.

These are the closed forms `costmodel.estimate` uses and the planner's search must use too (so that a searched
plan's predicted time equals `estimate` of that plan). Everything here is arithmetic on seconds and bytes except
`data_parallel_comm`, which prices the collectives on a cluster.

Per virtual stage and micro-batch (`StageTime`):
    f = compute_fwd / speed + tp_fwd + dp_fwd
    b = (compute_bwd + recompute) / speed + tp_bwd + dp_bwd
`speed` is the slowest device's speed factor in the stage (a straggler at 0.5 halves everyone's compute, since the
tensor/data-parallel peers wait for it). Recompute is the forward rerun of recomputed segments.

Overlap of a communication of C seconds, split in n equal chunks, with a computation of W seconds that releases
the chunks evenly (gradient buckets released by the backward; ZeRO-3 weight gathers prefetched ahead of the
forward): chunk i is ready at (i+1) W/n and the chunks go one after another, so the exposed time is

    exposed(C, W, n) = max(C / n,  C - W + W / n)          (0 when C == 0)

-- the last chunk can never hide, and when communication outruns compute the rest of it shows.

Data parallelism per rank (Rajbhandari et al. SC'20 for the ZeRO stages; PyTorch DDP / Megatron-LM for buckets).
Gradients are reduced in fp32 (`memory.GRAD_BYTES`), weights gathered in the training dtype:
- ZeRO-0: all-reduce of the rank's gradients in buckets during its last backward;
- ZeRO-1: reduce-scatter of gradients there, then an all-gather of the updated weights, prefetched unit by unit
  ahead of the next step's first forward (FSDP2; Megatron-LM `--overlap-param-gather`): exposed(G, F_1, n) with F_1
  the first micro-batch's forward;
- ZeRO-2: gradients are reduce-scattered during every micro-batch's backward (the unsharded gradient is never
  kept), plus ZeRO-1's weight all-gather;
- ZeRO-3: weights are all-gathered before each segment's forward and again before its backward (prefetched, one
  chunk per segment; without `reshard_after_forward` only before the forward), gradients reduce-scattered during
  every backward.
With pipeline parallelism (torch.distributed.pipelining) ZeRO-2/3 gradients are not reduced per micro-batch:
every backward but the last runs with `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`
(`PipelineStage.backward_maybe_with_nosync`), so gradients accumulate unsharded and are reduce-scattered once
after the last backward, as ZeRO-1's, and gathered weights stay gathered from each backward to the next forward:
the step's first forward gathers them (ZeRO-1's post-step gather) and, under ZeRO-3 with `reshard_after_forward`,
every backward again (`data_parallel_comm(pipelined=True)`; the memory of both is `memory.rank_memory`'s). Without pipelining `planner.runtime.train_step` reduces ZeRO-2/3 gradients every
micro-batch, as priced above.
With `RuntimeOptions.dp_overlap` off nothing overlaps: every term above is its full collective time.
Offloading (`costmodel.offload`): under FSDP2's parameter offload each gather is preceded by the host-to-device
copy of the shard in the same prefetched chain, exposed(G + H, F, n), and each reduce-scatter followed by the
device-to-host copy of the gradient shard (blocking, so exposed, when gradients accumulate over micro-batches);
what this adds over the same terms without the copies is kept apart (`offload_fwd_s` / `offload_bwd_s`) for the
breakdown. The offloaded optimizer's end-of-step copies and CPU step replace the device's optimizer step.
Tensor-parallel collectives are exposed, unless `RuntimeOptions.tp_overlap` pipelines them with the segment's
GEMMs in tp chunks: exposed(C_tp, compute, tp) per segment and pass. With `RuntimeOptions.tp_grad_overlap` the
backward's input-gradient reduction of each column-parallel linear runs during that linear's weight-gradient GEMM
(Megatron-LM): per reduced gradient max(0, C - W), W the weight-gradient GEMMs (`LayerCost.bwd_comm_async_s`
is what hides).
Under ZeRO >= 1 every collective is issued once per FSDP unit (one per segment, as `planner.runtime.apply_fsdp` wraps
each layer), so each of the n pieces pays the collective's latency: n x time(S / n). Measured framework host work
(`costmodel.framework`: FSDP2 / replicate hooks per unit and micro-batch) adds to the per-micro-batch terms.
The end-of-step gradient reduction of rank r can also hide in the pipeline drain after rank r's last backward
(`pipeline.drain_slack`); what is left is exposed. The optimizer step then starts on all ranks (the global gradient
norm synchronizes them) and is memory-bound: Adam reads a 16-bit gradient, reads and writes the fp32 master
weight, m and v, and writes the 16-bit weight: 2 + 3*8 + 2 = 28 bytes per local parameter (fp32 training: 4 + 24 =
28 too), over the local shard (params / dp under ZeRO >= 1), plus a measured framework cost per parameter tensor
(`costmodel.framework`; a DTensor parameter costs far more than a plain one).

With `RuntimeOptions.fp32_grad_pass` (DeepSpeed's BF16_Optimizer) every micro-batch's backward ends with a pass
that upcasts each 16-bit gradient and adds it into the fp32 gradient buffer, `hp.add_(lp.to(fp32))`: read w, write
4 (the upcast copy), read 4 + 4 and write 4 (the add) = w + 16 bytes per local parameter, memory-bound like the
optimizer step, as backward (weight-gradient) work of the chunk.

Default gradient bucket: 25 MiB (torch.nn.parallel.DistributedDataParallel `bucket_cap_mb=25`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from costmodel.breakdown import TimeBreakdown
from costmodel.framework import ZERO_PASS, FrameworkCosts, PassCost
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.memory import PricedSegment
from costmodel.offload import HostCopy
from costmodel.operators import memory_pass_time
from costmodel.pipeline import ChunkWork, chunk_stages, drain_slack, paired_overlap, pipeline_times
from costmodel.strategy import Recompute, Schedule

ADAM_BYTES_PER_PARAM = 28
FP32_GRAD_PASS_EXTRA_BYTES = 16
"""Bytes per parameter of the fp32 gradient pass besides reading the 16-bit gradient (module docstring)."""
DEFAULT_BUCKET_BYTES = 25 * 1024 ** 2


def overlapped_exposed(comm_s: float, window_s: float, num_chunks: int) -> float:
    """Seconds of a C-second communication in n chunks not hidden by a W-second computation (docstring)."""
    if comm_s <= 0:
        return 0.0
    n = max(int(num_chunks), 1)
    return max(comm_s / n, comm_s - window_s + window_s / n)


def optimizer_step_time(local_param_count: int, device: DeviceSpec, *, speed: float = 1.0,
                        host_s: float = 0.0) -> float:
    """Seconds of one Adam step over `local_param_count` parameters: memory-bound (module docstring) plus
    `host_s`, the framework's measured host work for the rank's parameter tensors
    (`costmodel.framework.FrameworkCosts.optimizer_host_s`: a DTensor parameter costs ~0.1 ms per step on CPU
    whatever its size). The host work is measured as the ranks run it, so the device speed does not scale it."""
    if local_param_count <= 0:
        return 0.0
    return memory_pass_time(local_param_count * ADAM_BYTES_PER_PARAM, device) / speed + host_s


def fp32_grad_pass_time(local_param_count: float, device: DeviceSpec, *, dtype_bytes: int, speed: float = 1.0
                        ) -> float:
    """Seconds of one micro-batch's upcast-and-add of `local_param_count` 16-bit gradients into fp32 buffers
    (`RuntimeOptions.fp32_grad_pass`, module docstring)."""
    if local_param_count <= 0:
        return 0.0
    return memory_pass_time(local_param_count * (dtype_bytes + FP32_GRAD_PASS_EXTRA_BYTES), device) / speed


def tp_grad_sync_time(sync_bytes: float, sync_tensors: int, group: CommGroup, cluster: Cluster, *,
                      concurrent: int = 1, per_tensor_s: float = 0.0) -> float:
    """Seconds to all-reduce, over the tensor-parallel `group`, the gradients of replicated weights that
    sequence parallelism leaves partial: the runtime syncs them in one flat buffer
    (`planner.runtime.train_step.sync_partial_gradients`), one all-reduce of all S bytes, plus per tensor its
    flattening and wrapping as the profile measured it (`costmodel.framework`; 0 without a profile)."""
    if sync_bytes <= 0 or group.size <= 1:
        return 0.0
    return (collective_time(Collective.ALL_REDUCE, sync_bytes, group, cluster, concurrent=concurrent)
            + max(sync_tensors, 1) * per_tensor_s)


@dataclass(frozen=True, slots=True)
class StageTime:
    """Seconds of one micro-batch on one virtual stage, by kind (compute already divided by the speed)."""

    compute_fwd_s: float
    compute_bwd_s: float
    recompute_s: float = 0.0
    tp_fwd_s: float = 0.0
    tp_bwd_s: float = 0.0
    dp_fwd_s: float = 0.0
    dp_bwd_s: float = 0.0
    host_fwd_s: float = 0.0
    """Framework host work of the micro-batch's forward (`costmodel.framework`: data-parallel unit hooks,
    pipeline actions, checkpoint machinery), not scaled by the device speed."""
    host_bwd_s: float = 0.0
    wgrad_s: float = 0.0
    """Of `compute_bwd_s`, the weight-gradient work (`LayerCost.weight_grad_share`): W of the zero-bubble
    schedules, which run it apart from the input gradient (B)."""
    offload_fwd_s: float = 0.0
    """Exposed host-to-device copies of offloaded parameters in the forward (`costmodel.offload`)."""
    offload_bwd_s: float = 0.0
    ep_fwd_s: float = 0.0
    """Of `tp_fwd_s`, the expert-parallel all-to-alls (`LayerCost.ep_comm_s`): what DualPipe's pairs can hide."""
    ep_bwd_s: float = 0.0

    @property
    def fwd_s(self) -> float:
        return self.compute_fwd_s + self.tp_fwd_s + self.dp_fwd_s + self.host_fwd_s + self.offload_fwd_s

    @property
    def bwd_s(self) -> float:
        return (self.compute_bwd_s + self.recompute_s + self.tp_bwd_s + self.dp_bwd_s + self.host_bwd_s
                + self.offload_bwd_s)


def recompute_time(segment: PricedSegment) -> float:
    c, r = segment.cost, segment.recompute
    if r.__class__ is not Recompute:  # the conversion costs more than the lookup, in the search's loops
        r = Recompute(r)
    if r is Recompute.FULL:
        return c.recompute_full_s
    if r is Recompute.SELECTIVE:
        return c.recompute_selective_s
    if r is Recompute.OP:
        return c.recompute_op_s
    return 0.0


def host_time(segments: Sequence[PricedSegment], framework: FrameworkCosts, *, zero_stage: int, dp_size: int,
              pipeline_size: int, schedule: Schedule = Schedule.ONE_F_ONE_B) -> PassCost:
    """Framework host work of one micro-batch on a virtual stage made of `segments` (`costmodel.framework`):
    - data parallelism: one unit for ZeRO-0's replicated part, one FSDP2 unit per segment under ZeRO >= 1;
    - pipelining (pp > 1): one schedule action forward and one backward (a multi-chunk `schedule` runs on
      torch's action runtime, measured apart), and under a zero-bubble schedule the split backward per layer;
    - recomputation: the checkpoint machinery per checkpointed segment (selective: segments with an attention
      core to recompute, as `planner.runtime.apply_recompute` checkpoints only those)."""
    if framework.is_zero:
        return ZERO_PASS
    fwd = bwd = 0.0
    if dp_size > 1:
        unit = framework.dp_unit_cost(zero_stage, dp_size)
        units = 1 if zero_stage == 0 else sum(s.count for s in segments)
        fwd += units * unit.forward_s
        bwd += units * unit.backward_s
    if pipeline_size > 1:
        action = framework.pp_action_cost(pipeline_size, chunked=schedule.chunked)
        fwd += action.forward_s
        bwd += action.backward_s
        if schedule.zero_bubble:
            bwd += sum(s.count for s in segments) * framework.split_backward.backward_s
    for s in segments:
        mode = Recompute(s.recompute)
        if mode in (Recompute.FULL, Recompute.OP) or (mode is Recompute.SELECTIVE and s.cost.recompute_selective_s > 0):
            c = framework.recompute_cost(mode.value)
            fwd += s.count * c.forward_s
            bwd += s.count * c.backward_s
    return PassCost(fwd, bwd)


def tp_exposed(comm_s: float, compute_s: float, tp_overlap_chunks: int) -> float:
    """Tensor-parallel communication of one segment and pass left exposed (module docstring)."""
    if tp_overlap_chunks <= 1:
        return comm_s
    return overlapped_exposed(comm_s, compute_s, tp_overlap_chunks)


def tp_bwd_exposed(cost: LayerCost, compute_s: float, tp_overlap_chunks: int, grad_overlap: bool) -> float:
    """Backward tensor-parallel communication of one segment left exposed: pipelined with the GEMMs in chunks
    (`RuntimeOptions.tp_overlap`) and/or all of it but what the weight-gradient GEMMs hide
    (`RuntimeOptions.tp_grad_overlap`: `LayerCost.bwd_comm_async_s`), whichever leaves less."""
    exposed = tp_exposed(cost.bwd_comm_s, compute_s, tp_overlap_chunks)
    if grad_overlap:
        exposed = min(exposed, cost.bwd_comm_s - cost.bwd_comm_async_s)
    return exposed


def stage_time(segments: Sequence[PricedSegment], *, speed: float = 1.0, dp_fwd_s: float = 0.0,
               dp_bwd_s: float = 0.0, host: PassCost = ZERO_PASS, tp_overlap_chunks: int = 0,
               tp_grad_overlap: bool = False, offload_fwd_s: float = 0.0, offload_bwd_s: float = 0.0
               ) -> StageTime:
    """`StageTime` of a virtual stage made of `segments` (LayerCosts + recompute choices); `host` is its
    framework host work (`host_time`); `tp_overlap_chunks` > 1 overlaps tensor-parallel collectives with the
    GEMMs in that many chunks (`RuntimeOptions.tp_overlap`); `tp_grad_overlap` hides input-gradient reductions
    behind weight-gradient GEMMs (`RuntimeOptions.tp_grad_overlap`)."""
    if speed <= 0:
        raise ValueError(f"speed factor must be positive, got {speed}")
    n = tp_overlap_chunks
    tp_fwd = sum(s.count * tp_exposed(s.cost.fwd_comm_s, s.cost.fwd_compute_s / speed, n) for s in segments)
    tp_bwd = sum(s.count * tp_bwd_exposed(s.cost, s.cost.bwd_compute_s / speed, n, tp_grad_overlap) for s in segments)
    ep = sum(s.count * s.cost.ep_comm_s for s in segments)
    # Full recomputation reruns the forward communication too; it is part of recompute_full_s (LayerCost).
    return StageTime(
        compute_fwd_s=sum(s.count * s.cost.fwd_compute_s for s in segments) / speed,
        compute_bwd_s=sum(s.count * s.cost.bwd_compute_s for s in segments) / speed,
        recompute_s=sum(s.count * recompute_time(s) for s in segments) / speed,
        tp_fwd_s=tp_fwd,
        tp_bwd_s=tp_bwd,
        ep_fwd_s=min(ep, tp_fwd),  # tp_overlap's chunks may already hide part of it
        ep_bwd_s=min(ep, tp_bwd),
        dp_fwd_s=dp_fwd_s,
        dp_bwd_s=dp_bwd_s,
        host_fwd_s=host.forward_s,
        host_bwd_s=host.backward_s,
        wgrad_s=sum(s.count * s.cost.bwd_compute_s * s.cost.weight_grad_share for s in segments) / speed,
        offload_fwd_s=offload_fwd_s,
        offload_bwd_s=offload_bwd_s,
    )


@dataclass(frozen=True, slots=True)
class DataParallelComm:
    """Data-parallel communication of one virtual stage / rank (seconds, unexposed)."""

    per_microbatch_fwd_s: float = 0.0
    """Exposed ZeRO-3 weight gathers of one micro-batch's forward."""
    per_microbatch_bwd_s: float = 0.0
    """Exposed ZeRO-2/3 gathers + reduce-scatters of one micro-batch's backward."""
    end_reduce_s: float = 0.0
    """ZeRO-0/1 gradient reduction at the end of the step (before overlap with the last backward)."""
    end_reduce_chunks: int = 1
    post_step_s: float = 0.0
    """ZeRO-1/2 all-gather of the updated weights, the part the next step's first forward does not hide."""
    offload_fwd_s: float = 0.0
    """What the host-to-device copies of offloaded parameters add to `per_microbatch_fwd_s` (kept apart)."""
    offload_bwd_s: float = 0.0
    """What the copies (host-to-device before gathers, device-to-host after reduce-scatters) add to the backward."""


def data_parallel_comm(*, zero_stage: int, grad_bytes: float, param_bytes: float, num_segments: int,
                       fwd_window_s: float, bwd_window_s: float, group: CommGroup, cluster: Cluster,
                       concurrent: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True,
                       reshard_after_forward: bool = True, host_copy: HostCopy | None = None,
                       pipelined: bool = False) -> DataParallelComm:
    """Price the data-parallel collectives of one stage (module docstring). Bytes are this rank's unsharded
    gradient and weight bytes (after tensor parallelism).

    Under ZeRO-1..3 every collective goes out once per FSDP unit (a unit per segment), and each piece pays the
    collective's latency: n pieces of S / n bytes. ZeRO-0's gradient all-reduce is one collective over the whole
    part (`replicate` keeps one unit; gradient buckets only pace its overlap with the backward). The units' host
    work is `host_time`'s. `host_copy`: FSDP2's parameter-offload copies of the stage (ZeRO-3 only).
    `pipelined`: the stage runs under torch.distributed.pipelining, which reduces ZeRO-2/3 gradients once per
    step (module docstring; with parameter offload FSDP2 keeps its per-micro-batch reduction)."""
    if group.size <= 1 or grad_bytes <= 0:
        return _host_copy_only(host_copy, num_segments, fwd_window_s, bwd_window_s, overlap,
                               reshard_after_forward)

    def t(kind: Collective, nbytes: float, pieces: int) -> float:
        return pieces * collective_time(kind, nbytes / pieces, group, cluster, concurrent=concurrent)

    def exposed(comm_s: float, window_s: float, pieces: int) -> float:
        return overlapped_exposed(comm_s, window_s, pieces) if overlap else comm_s

    n_seg = max(num_segments, 1)
    buckets = max(math.ceil(grad_bytes / bucket_bytes), 1)
    if zero_stage == 0:
        return DataParallelComm(end_reduce_s=t(Collective.ALL_REDUCE, grad_bytes, 1),
                                end_reduce_chunks=buckets)
    gather = t(Collective.ALL_GATHER, param_bytes, n_seg)
    if zero_stage == 1 or (pipelined and host_copy is None):
        # ZeRO-1, and ZeRO-2/3 under pipelining (module docstring): one reduce-scatter after the last backward and
        # the weights gathered ahead of the step's first forward -- under ZeRO-3 with resharding, again in every
        # backward.
        regather = exposed(gather, bwd_window_s, n_seg) if zero_stage == 3 and reshard_after_forward else 0.0
        return DataParallelComm(per_microbatch_bwd_s=regather,
                                end_reduce_s=t(Collective.REDUCE_SCATTER, grad_bytes, n_seg),
                                end_reduce_chunks=max(buckets, n_seg),
                                post_step_s=exposed(gather, fwd_window_s, n_seg))
    reduce = t(Collective.REDUCE_SCATTER, grad_bytes, n_seg)
    if zero_stage == 2:
        return DataParallelComm(per_microbatch_bwd_s=exposed(reduce, bwd_window_s, n_seg),
                                post_step_s=exposed(gather, fwd_window_s, n_seg))
    backward = gather + reduce if reshard_after_forward else reduce
    fwd, bwd = exposed(gather, fwd_window_s, n_seg), exposed(backward, bwd_window_s, n_seg)
    if host_copy is None:
        return DataParallelComm(per_microbatch_fwd_s=fwd, per_microbatch_bwd_s=bwd)
    h2d, d2h = host_copy.h2d_s, host_copy.d2h_s
    chain = backward + (h2d if reshard_after_forward else 0.0) + (0.0 if host_copy.blocking else d2h)
    return DataParallelComm(
        per_microbatch_fwd_s=fwd, per_microbatch_bwd_s=bwd,
        offload_fwd_s=exposed(gather + h2d, fwd_window_s, n_seg) - fwd,
        offload_bwd_s=exposed(chain, bwd_window_s, n_seg) - bwd + (d2h if host_copy.blocking else 0.0))


def _host_copy_only(host_copy: HostCopy | None, num_segments: int, fwd_window_s: float, bwd_window_s: float,
                    overlap: bool, reshard_after_forward: bool) -> DataParallelComm:
    """A single data-parallel rank with offloaded parameters: only the copies, prefetched as the gathers are."""
    if host_copy is None:
        return DataParallelComm()
    n = max(num_segments, 1)
    h2d, d2h = host_copy.h2d_s, host_copy.d2h_s
    chain = (h2d if reshard_after_forward else 0.0) + (0.0 if host_copy.blocking else d2h)
    if not overlap:
        return DataParallelComm(offload_fwd_s=h2d, offload_bwd_s=chain + (d2h if host_copy.blocking else 0.0))
    return DataParallelComm(offload_fwd_s=overlapped_exposed(h2d, fwd_window_s, n),
                            offload_bwd_s=overlapped_exposed(chain, bwd_window_s, n)
                            + (d2h if host_copy.blocking else 0.0))


@dataclass(frozen=True, slots=True)
class RankTail:
    """What one pipeline rank does after its last backward."""

    end_reduce_s: float = 0.0
    end_reduce_chunks: int = 1
    last_bwd_window_s: float = 0.0
    """Backward seconds of the rank's last micro-batch (all its chunks), the overlap window of the reduction."""
    tp_grad_sync_s: float = 0.0
    """All-reduce over tp of gradients of weights replicated in the tp group (exposed)."""
    shared_sync_s: float = 0.0
    """All-reduce of gradients of weights shared with another pipeline rank (tied embeddings: Megatron-LM keeps a
    copy on the last stage); it waits for both ranks, so no drain hides it."""
    optimizer_s: float = 0.0
    """The optimizer step: on the device, or with offloading the end-of-step copies and the CPU step."""
    offload_copy_s: float = 0.0
    """Of `optimizer_s`, the host-device copies of an offloaded optimizer (`costmodel.offload.OffloadTail`)."""
    post_step_s: float = 0.0
    overlap: bool = True
    """Whether the end-of-step gradient reduction overlaps the last backward (`RuntimeOptions.dp_overlap`)."""

    def exposed_end_reduce(self) -> float:
        """Seconds of the end-of-step gradient reduction the last backward does not hide."""
        if not self.overlap:
            return self.end_reduce_s
        return overlapped_exposed(self.end_reduce_s, self.last_bwd_window_s, self.end_reduce_chunks)


def step_breakdown(stages: Sequence[StageTime], tails: Sequence[RankTail], *, schedule: Schedule,
                   num_microbatches: int, virtual_stages: int = 1,
                   p2p_time: float | Sequence[float] = 0.0, ep_overlap: bool = False,
                   p2p_overlap: bool = False) -> TimeBreakdown:
    """The step's critical path split by kind; `total_s` is the step time.

    `stages`: one per virtual stage in pipeline order (p*v); `tails`: one per pipeline rank (p). `ep_overlap`:
    the schedule's F&B pairs hide expert-parallel all-to-alls (`pipeline.paired_overlap`; what they hide leaves the
    communication term). `p2p_overlap`: the interleaved schedule's sends wait only in the fill and drain
    (`RuntimeOptions.p2p_overlap`).
    """
    pp = len(stages) // virtual_stages
    if len(tails) != pp:
        raise ValueError(f"need one RankTail per pipeline rank ({pp}), got {len(tails)}")
    fwd = [s.fwd_s for s in stages]
    bwd = [s.bwd_s for s in stages]
    hidden = None
    if ep_overlap:
        work = [ChunkWork(s.compute_fwd_s, s.compute_bwd_s + s.recompute_s, s.ep_fwd_s, s.ep_bwd_s) for s in stages]
        hidden = paired_overlap(work, pp, num_microbatches, schedule, virtual_stages)
    pipe = pipeline_times(fwd, bwd, schedule, num_microbatches, virtual_stages, p2p_time,
                          [s.wgrad_s for s in stages], hidden, p2p_overlap=p2p_overlap)
    # Busy time of the bottleneck rank, split by kind.
    mine = [stages[j] for j in chunk_stages(schedule, pp, virtual_stages, pipe.bottleneck_rank)]
    m = num_microbatches
    compute = m * sum(s.compute_fwd_s + s.compute_bwd_s for s in mine)
    recompute = m * sum(s.recompute_s for s in mine)
    tp = m * sum(s.tp_fwd_s + s.tp_bwd_s for s in mine) - pipe.hidden_s
    dp = m * sum(s.dp_fwd_s + s.dp_bwd_s for s in mine)
    host = m * sum(s.host_fwd_s + s.host_bwd_s for s in mine)
    offload = m * sum(s.offload_fwd_s + s.offload_bwd_s for s in mine)
    # End of step: gradient reduction hidden by the last backward and the drain, then optimizer, then gathers.
    slack = drain_slack(bwd, pp, p2p_time, schedule)
    tail_tp = tail_dp = 0.0
    for r, tail in enumerate(tails):
        exposed = tail.exposed_end_reduce()
        left = max(exposed + tail.tp_grad_sync_s - slack[r], 0.0) + tail.shared_sync_s
        if left > tail_tp + tail_dp:
            tail_tp = min(tail.tp_grad_sync_s, left)
            tail_dp = left - tail_tp
    slowest = max(tails, key=lambda t: t.optimizer_s)
    post = max(t.post_step_s for t in tails)
    return TimeBreakdown(compute_s=compute, recompute_s=recompute, tp_comm_s=tp + tail_tp, pp_comm_s=pipe.p2p_s,
                         dp_comm_s=dp + tail_dp + post, bubble_s=pipe.bubble_s,
                         optimizer_s=slowest.optimizer_s - slowest.offload_copy_s, framework_s=host,
                         offload_s=offload + slowest.offload_copy_s)
