"""The plan as text, as `stratagem plan` and `stratagem estimate` print it: the device mesh with the network tier
each axis spans, the stage table (segments, devices, recomputation, memory against capacity, micro-batches in
flight), the predicted step and its breakdown, the tensor-parallel sharding, the search status and the
runner-ups."""

from __future__ import annotations

from costmodel.breakdown import Estimate
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.host import host_of
from costmodel.memory import GIB
from costmodel.pipeline import chunk_stages
from costmodel.rank_layout import axis_strides
from costmodel.strategy import CrossEntropy, MeshAxis, Offload, Strategy
from costmodel.validation import within_band
from planner.plan import Plan, SearchInfo


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def mesh_line(plan: Plan, cluster: Cluster) -> str:
    s = plan.strategy
    strides = axis_strides(s)
    parts = []
    for axis in s.mesh_order:
        size = {MeshAxis.TP: s.tp, MeshAxis.CP: s.cp, MeshAxis.DP: s.dp, MeshAxis.PP: s.pp, MeshAxis.EP: s.ep}[axis]
        if size == 1 and axis is not MeshAxis.DP:
            continue
        stride = strides[axis]
        if axis is MeshAxis.EP:  # no ranks of its own: say which tp x dp ranks a group takes, and its tier
            in_tp, over_dp = size // s.ep_dp, s.ep_dp
            ranks = " x ".join(f"{n} {a}" for n, a in ((in_tp, "tp"), (over_dp, "dp")) if n > 1)
            tier = cluster.tier_spanned(size, stride)
            parts.append(f"ep={size} (on {ranks} ranks, {tier.name if tier else 'one device'})")
            continue
        # pp neighbours are `stride` apart; the other axes form groups of `size` ranks `stride` apart.
        tier = cluster.tier_spanned(2 if axis is MeshAxis.PP and size > 1 else size, stride)
        parts.append(f"{axis.value}={size} ({tier.name if tier else 'one device'})")
    used = s.num_devices
    total = cluster.num_devices
    count = f"{used} devices" if used == total else f"{used} of {total} devices"
    return f"mesh: {' x '.join(parts)}  = {count}, innermost first"


def stage_table(plan: Plan) -> list[str]:
    s, est = plan.strategy, plan.predicted
    per_rank = s.tp * s.cp * s.dp
    rows = []
    for r, se in enumerate(est.stages):
        chunks = [s.stages[j] for j in chunk_stages(s.schedule, s.pp, s.virtual_stages, r)] if s.stages else ()
        segs = ", ".join(f"{c.start}-{c.stop - 1}" if c.stop - c.start > 1 else f"{c.start}" for c in chunks) \
            or f"{se.start}-{se.stop - 1}"
        recompute = ",".join(sorted({c.recompute_label for c in chunks})) or s.recompute.value
        mem = f"{_gib(se.memory.total)} / {_gib(se.capacity_bytes)} GiB"
        rows.append((str(r), segs, str(per_rank), recompute, mem, str(se.in_flight_microbatches)))
    head = ("stage", "segments", "devices", "recompute", "memory / capacity", "in flight")
    widths = [max(len(x[i]) for x in (head, *rows)) for i in range(len(head))]
    align = (">", "<", ">", "<", ">", ">")
    return ["  " + "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(row, align, widths, strict=True))
            for row in (head, *rows)]


def render_plan(plan: Plan, cluster: Cluster) -> str:
    s, est, info = plan.strategy, plan.predicted, plan.search
    sched = s.schedule.value + (f" (v={s.virtual_stages})" if s.virtual_stages > 1 else "")
    seq = f", seq {plan.training.seq_len}" if plan.training.seq_len else ""
    lines = [
        f"plan for {plan.model.name} ({plan.model.params / 1e9:.2f}B params) on {cluster.name} "
        f"({cluster.num_devices} devices), global batch {plan.training.global_batch}{seq}",
        mesh_line(plan, cluster),
        f"schedule: {sched}, {s.num_microbatches} micro-batch{'es' if s.num_microbatches > 1 else ''} of "
        f"{s.microbatch_size}, ZeRO-{s.zero_stage}, "
        f"sequence parallel {'on' if s.sequence_parallel else 'off'}, recompute {s.recompute.value}",
        runtime_line(s),
        *filter(None, [offload_text(s, est)]),
        "stages:",
        *stage_table(plan),
    ]
    throughput = (f"{est.tokens_per_s:,.0f} tokens/s" if est.tokens_per_s is not None
                  else f"{est.samples_per_s:,.1f} samples/s")
    lines += [
        f"step time: {est.step_time_s:.4g} s {band_text(est)}   throughput: {throughput}   "
        f"{est.model_tflops_per_device:.1f} TFLOP/s per device   MFU {100 * est.mfu:.1f}%",
        "breakdown: " + ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.3g} s "
                                  f"({100 * v / est.step_time_s:.0f}%)"
                                  for k, v in est.breakdown.to_dict().items() if v > 0),
    ]
    if not est.fits:
        lines.append("DOES NOT FIT: " + "; ".join(est.problems))
    if plan.sharding:
        styles = ", ".join(f"{m.module}={m.style.value}" for m in plan.sharding if m.style.value != "replicate")
        lines.append(f"tensor-parallel sharding: {styles or 'all replicated'}")
    if info.status == "fixed":
        lines.append("search: none (strategy given)")
    else:
        cut = " (cut short by --time-limit)" if info.status == "feasible" else ""
        lines.append(f"search: {info.status}{cut}, {info.candidates} candidates priced in {info.time_s:.2f} s, "
                     f"optimality gap {100 * info.optimality_gap:.1f}% (lower bound {info.lower_bound_s:.4g} s)"
                     + _tie_note(info, est))
    if info.alternatives:
        lines.append("runner-ups:")
        lines += [f"  {a.summary}: {tie_text(a.step_time_s, est)}{a.reason}" for a in info.alternatives]
    return "\n".join(lines)


def _tie_note(info: SearchInfo, est: Estimate) -> str:
    """Why a proven search shows a gap: the plan is the simplest of the strategies tied with the fastest (the
    rest of the gap is what the search leaves unproven, within its relative gap)."""
    if info.status != "optimal" or info.optimality_gap <= 0:
        return ""
    faster = info.optimality_gap if info.fastest_s is None else 1 - info.fastest_s / est.step_time_s
    if faster <= 1e-9:
        return ""
    return f"; the fastest strategy is {100 * faster:.1f}% faster, a tie within {band_text(est)}: this plan is simpler"


def runtime_line(s: Strategy) -> str:
    """How the trainer runs it (`RuntimeOptions`): the behaviours that frameworks differ on and that are priced."""
    r = s.runtime
    parts = [f"data-parallel overlap {'on' if r.dp_overlap else 'off'}"]
    if s.zero_stage == 3:
        parts.append("reshard after forward" if r.reshard_after_forward else "weights kept gathered to backward")
    if s.tp > 1:
        parts.append(f"tensor-parallel overlap {'on' if r.tp_overlap else 'off'}")
        if r.tp_grad_overlap:
            parts.append("input-gradient all-reduce during the weight-gradient GEMM")
        if r.tp_sharded_weights:
            parts.append("linear and embedding weights split over tp")
    if s.pp > 1 and (r.p2p_scatter_gather or r.p2p_blocking or r.p2p_overlap):
        how = [w for w, on in (("scatter/gather", r.p2p_scatter_gather), ("blocking", r.p2p_blocking),
                               ("overlapped (interleaved)", r.p2p_overlap)) if on]
        parts.append(f"pipeline sends {' and '.join(how)}")
    if r.fused_kernels:
        parts.append("fused kernels")
    if r.fp32_grad_pass:
        parts.append("fp32 gradient pass per micro-batch")
    if r.grads_in_training_dtype:
        parts.append("gradients kept and reduced in the training dtype")
    if r.cross_entropy is not CrossEntropy.TORCH:
        parts.append(f"{r.cross_entropy.value} cross-entropy")
    if r.metric_passes:
        parts.append(f"{r.metric_passes} cross-entropy metric pass{'es' if r.metric_passes > 1 else ''} per micro-batch")
    if r.offload is not Offload.NONE:
        parts.append(f"offload {r.offload.value}")
    if r.fp8 is not None:
        gather = ", gathered in FP8 by ZeRO-3" if r.fp8.fp8_all_gather and s.zero_stage == 3 else ""
        parts.append(f"FP8 linear layers ({r.fp8.value} scaling, output layer and routers not converted{gather})")
    return "runtime: " + ", ".join(parts)


_OFFLOADED = {Offload.OPTIMIZER: "optimizer state (fp32 master weights, Adam moments, gradient copy)",
              Offload.PARAMS: "parameters, gradients and optimizer state (FSDP2 CPUOffloadPolicy)"}


def offload_text(s: Strategy, est: Estimate) -> str:
    """What the plan offloads to host memory and what it costs ('' when nothing): host bytes per device against
    the host's memory, the exposed host-device copies and the CPU's optimizer step per step."""
    offload = s.runtime.offload
    if offload is Offload.NONE:
        return ""
    host_bytes = max((st.memory.host for st in est.stages), default=0)
    hosts = [host_of(st.device) for st in est.stages]
    capacity = min((h.host_memory_bytes for h in hosts if h is not None), default=0)
    of = f" of {_gib(capacity)} GiB" if capacity else ""
    bd = est.breakdown
    return (f"offload: {_OFFLOADED[offload]} in host memory, {_gib(host_bytes)} GiB per device{of}; "
            f"per step {bd.offload_s:.3g} s of host-device copies exposed, optimizer step on the CPU "
            f"{bd.optimizer_s:.3g} s")


def band_text(est: Estimate) -> str:
    """"± 12%": the validated error band of the prediction (`costmodel.validation`)."""
    return f"± {100 * est.error_band:.0f}%" if est.error_band > 0 else ""


def tie_text(step_time_s: float | None, est: Estimate) -> str:
    """"tie (within ± 12%): " for an alternative the validation cannot tell from the plan, else ""."""
    if step_time_s is None or est.error_band <= 0:
        return ""
    low, high = sorted((step_time_s, est.step_time_s))
    return f"tie (within ± {100 * est.error_band:.0f}%): " if within_band(high, low, est.error_band) else ""
