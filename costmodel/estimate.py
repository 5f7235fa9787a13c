"""`costmodel.estimate`: step time, throughput, utilization and peak memory of one strategy on one cluster.

How a strategy maps onto the cluster (`costmodel.rank_layout`): mesh axes innermost first in
`strategy.mesh_order`, so pipeline rank r holds the global ranks r * stride(pp) + (the tp/cp/dp offsets); the chain
cut into p*v virtual stages (`strategy.stages`, or `rank_layout.even_stages`), virtual stage j on pipeline rank
j % p. A stage's device is its `device_group`'s device, else that of its first rank; its speed is the slowest of
its ranks (`rank_layout.rank_speeds`). Segment prices come from `layer_costs[(class_id, device name)]` (the
planner's sharding solutions for the strategy's tp and micro-batch), or, for tp == 1, from
`layer_pricing.price_segment`. Then `step_time.stage_time` / `data_parallel_comm` / `step_breakdown` give the
step time and its breakdown, `memory.rank_memory` the peak bytes per pipeline rank (plus copies of weights shared
with another rank: `shared_parameter_copies`) and the host bytes of offloaded state (`costmodel.offload`, checked
against the host memory per device), and:

    model FLOPs per step    = (graph forward + backward FLOPs) * global_batch / traced batch   (no recomputation;
                              routed experts at the token choices they serve: `costmodel.model_flops`)
    hardware FLOPs per step = model FLOPs + recomputed forward FLOPs of every micro-batch of every replica
    TFLOP/s per device      = FLOPs / (step time * devices);   MFU / HFU = that / dense peak of the dtype

Problems (`Estimate.problems`) say exactly why a strategy is invalid or does not fit; the estimate is still priced
so that the caller can see by how much. What cannot be priced at all (more stages than segments, more devices than
the cluster has, tp > 1 without layer costs) raises ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from costmodel.breakdown import Estimate, StageEstimate, TimeBreakdown
from costmodel.context_parallel import cp_problem
from costmodel.expert_parallel import (
    EXPERT_IMBALANCE,
    ExpertSetting,
    dp_synced_params,
    ep_problem,
    expert_cost,
    expert_layer,
    optimizer_params,
)
from costmodel.float8 import FP8_BYTES
from costmodel.framework import FrameworkCosts
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.hardware.device import DeviceSpec
from costmodel.hardware.host import host_of
from costmodel.layer_cost import LayerCost
from costmodel.layer_pricing import op_policy_kept, price_segment, selective_recompute_region
from costmodel.memory import GIB, ChunkBoundary, PricedSegment, rank_memory, returned_bytes, runs
from costmodel.model_flops import counted_flops
from costmodel.model_flops import model_flops as chain_model_flops
from costmodel.offload import HostCopy, host_copy, host_problem, offload_tail
from costmodel.operators import fp8_weight_copy_time
from costmodel.pipeline import (
    PAIRED_SCHEDULES,
    chunk_stages,
    in_flight_per_chunk,
    schedule_problem,
    split_backward_problem,
    stage_rank,
)
from costmodel.profile_db import OpProfile
from costmodel.rank_layout import device_map, dp_group, even_stages, p2p_group, shared_weight_group, tp_group
from costmodel.step_time import (
    DataParallelComm,
    RankTail,
    StageTime,
    data_parallel_comm,
    fp32_grad_pass_time,
    host_time,
    optimizer_step_time,
    stage_time,
    step_breakdown,
    tp_grad_sync_time,
)
from costmodel.strategy import CrossEntropy, Offload, Recompute, Schedule, StageSpec, Strategy
from costmodel.training_loss import loss_time_change, metric_pass_time
from costmodel.validation import error_band
from ir import build_layer_chain
from ir.graph import Graph, dtype_bytes
from ir.layer_chain import LayerChain


def param_tensor_kinds(strategy: Strategy, costs: Sequence[LayerCost],
                       counts: Sequence[int] | None = None) -> tuple[int, int]:
    """(plain, DTensor) parameter tensors of a rank holding segments priced `costs` (`counts[i]` segments of
    `costs[i]`; one each by default): FSDP2 / replicate over the dp (x cp) ranks turn every parameter into a
    DTensor; tensor parallelism alone only those of the modules that run sharded (`planner.parallelize`). The
    optimizer pays a framework cost per tensor of each kind."""
    counts = counts or [1] * len(costs)
    total = sum(n * c.param_tensors for c, n in zip(costs, counts, strict=True))
    if strategy.dp * strategy.cp > 1:
        return 0, total
    dtensors = sum(n * c.dtensor_param_tensors for c, n in zip(costs, counts, strict=True)) if strategy.tp > 1 else 0
    return total - dtensors, dtensors


def p2p_time(strategy: Strategy, boundary: int, nbytes: float, cluster: Cluster) -> float:
    """Seconds a stage waits per micro-batch and direction to move `nbytes` (per device) across virtual-stage
    boundary `boundary`; all tp*cp*dp pairs of the two stages send at once (`concurrent`).

    With `RuntimeOptions.p2p_scatter_gather` and a replicated activation (tp > 1, no sequence parallelism) each
    pair sends 1/tp of it and the receiving stage all-gathers it over its tp group. With `p2p_blocking` the sender
    waits for each transfer as well as the receiver: a stage pays its two transfers of a micro-batch in each
    direction, not one (`tests/test_pipeline_p2p.py` checks this against DeepSpeed's own `TrainSchedule`)."""
    group = p2p_group(strategy, boundary)
    if strategy.pp == 1 or nbytes <= 0 or group.size == 1:
        return 0.0
    runtime, gather = strategy.runtime, 0.0
    if runtime.p2p_scatter_gather and strategy.tp > 1 and not strategy.sequence_parallel:
        receiver = stage_rank(strategy.schedule, strategy.pp, boundary + 1)
        gather = collective_time(Collective.ALL_GATHER, nbytes, tp_group(strategy, receiver), cluster)
        nbytes = nbytes / strategy.tp
    send = collective_time(Collective.SEND_RECV, nbytes, group, cluster,
                           concurrent=strategy.tp * strategy.cp * strategy.dp)
    return (2 * send if runtime.p2p_blocking else send) + gather


def shared_parameter_copies(chain: LayerChain, stages: Sequence[StageSpec], pp: int,
                            schedule: Schedule = Schedule.ONE_F_ONE_B) -> tuple[int, ...]:
    """Per pipeline rank: parameters used there but owned by (first used on) another rank, which it must keep a
    copy of -- the tied LM head of a GPT whose embedding sits on the first stage (Megatron-LM's "word embeddings"
    copy on the last stage; `Segment.param_count` counts a shared weight once, where it is first used). A V-shaped
    schedule has both on rank 0: no copy."""
    owner: dict[str, int] = {}
    used: list[dict[str, int]] = [{} for _ in range(pp)]
    for j, st in enumerate(stages):
        rank = stage_rank(schedule, pp, j)
        for seg in chain.segments[st.start:st.stop]:
            for node in chain.nodes_of(seg):
                for name, spec in zip(node.param_names, node.param_specs, strict=False):
                    owner.setdefault(name, rank)
                    used[rank][name] = spec.numel
    return tuple(sum(n for name, n in used[r].items() if owner[name] != r) for r in range(pp))


def resolve_stages(chain: LayerChain, strategy: Strategy) -> tuple[StageSpec, ...]:
    """The strategy's stages, checked to cover the chain in order, or an even split."""
    num = strategy.pp * strategy.virtual_stages
    if not strategy.stages:
        return even_stages(chain, num, strategy.recompute)
    pos = 0
    for i, st in enumerate(strategy.stages):
        if st.start != pos:
            raise ValueError(f"stage {i} starts at segment {st.start}, expected {pos} (stages must cover the chain "
                             f"in order)")
        pos = st.stop
    if pos != len(chain.segments):
        raise ValueError(f"stages cover segments 0..{pos}, the chain has {len(chain.segments)}")
    return strategy.stages


@dataclass(frozen=True, slots=True)
class _Rank:
    index: int
    device: DeviceSpec
    speed: float


def _group_device(cluster: Cluster, name: str) -> DeviceSpec:
    for g in cluster.groups:
        if g.name == name:
            return g.device
    raise ValueError(f"stage device_group {name!r} is not in the cluster; groups: "
                     f"{', '.join(g.name for g in cluster.groups)}")


def _pipeline_ranks(cluster: Cluster, strategy: Strategy, stages: Sequence[StageSpec]) -> list[_Rank]:
    out = []
    for placement in device_map(cluster, strategy):
        group = stages[placement.pp_rank].device_group
        device = _group_device(cluster, group) if group else cluster.device_of(placement.ranks[0])
        out.append(_Rank(placement.pp_rank, device, placement.speed))
    return out


class _Prices:
    """LayerCost per (class id, device name): given ones first, replicated pricing for tp == 1."""

    def __init__(self, chain: LayerChain, strategy: Strategy, given: Mapping[tuple[int, str], LayerCost] | None,
                 dtype: str, profile: OpProfile | None, cluster: Cluster) -> None:
        self.chain, self.strategy, self.given = chain, strategy, dict(given or {})
        self.dtype, self.profile, self.cluster = dtype, profile, cluster
        self.cache: dict[tuple[int, str], LayerCost] = {}

    def __call__(self, seg_index: int, device: DeviceSpec) -> LayerCost:
        seg = self.chain.segments[seg_index]
        key = (seg.class_id, device.name)
        if key in self.given:
            return self.given[key]
        if key not in self.cache:
            if self.strategy.tp > 1 or self.strategy.cp > 1 or self.strategy.ep > 1:
                raise ValueError(f"no LayerCost for layer class {seg.class_id} on {device.name} at tp="
                                 f"{self.strategy.tp}; use planner.estimate, which solves the sharding")
            rep = self.chain.representative(seg.class_id)
            mbs = self.strategy.microbatch_size
            cost = price_segment(self.chain, rep, device, microbatch_size=mbs, dtype=self.dtype,
                                 profile=self.profile, fp8=self.strategy.runtime.fp8)
            # Routed experts as they run with every expert on this rank (costmodel/expert_parallel.py).
            setting = ExpertSetting(ep=1, microbatch_size=mbs, traced_batch=self.chain.graph.batch_size,
                                    traced_dtype=self.chain.graph.dtype, dtype=self.dtype,
                                    imbalance=self.cluster.expert_imbalance or EXPERT_IMBALANCE,
                                    fp8=self.strategy.runtime.fp8)
            self.cache[key] = expert_cost(cost, expert_layer(self.chain.nodes_of(rep)), device, self.cluster,
                                          setting=setting, segment_params=rep.param_count, profile=self.profile)
        return self.cache[key]


def _validity_problems(chain: LayerChain, strategy: Strategy, global_batch: int | None) -> list[str]:
    problems: list[str] = []
    heads = sorted({int(n.attr("num_heads")) for n in chain.graph.nodes if n.attr("num_heads") is not None})
    for h in heads:
        if h % strategy.tp:
            problems.append(f"tp={strategy.tp} does not divide heads={h}")
    kv = sorted({int(n.attr("num_kv_heads")) for n in chain.graph.nodes if n.attr("num_kv_heads") is not None})
    for h in kv:
        if h % strategy.tp and strategy.tp % h:
            problems.append(f"tp={strategy.tp} and kv heads={h}: neither divides the other")
    if global_batch is not None and global_batch != strategy.global_batch:
        problems.append(f"global batch {global_batch} is not dp*mbs*m = {strategy.dp}*{strategy.microbatch_size}*"
                        f"{strategy.num_microbatches} = {strategy.global_batch}")
    # Context / expert parallelism must fit the model (costmodel/context_parallel.py, expert_parallel.py).
    problems += [p for p in (cp_problem(chain, strategy.cp), ep_problem(chain, strategy.ep)) if p]
    if strategy.runtime.ep_overlap and strategy.schedule not in PAIRED_SCHEDULES:
        problems.append(f"ep_overlap overlaps the all-to-alls of paired forward and backward passes (DualPipeV, "
                        f"Megatron-Core's 1F1B and interleaved 1F1B); the {strategy.schedule.value} schedule runs "
                        f"each pass alone: use schedule dualpipev, 1f1b or interleaved, or ep_overlap=false")
    for why in (schedule_problem(strategy.schedule, strategy.pp, strategy.num_microbatches),
                split_backward_problem(strategy.schedule, recomputed=recomputes(strategy),
                                       resharded=strategy.zero_stage == 3 and strategy.runtime.reshard_after_forward)):
        if why:
            problems.append(why)
    return problems


def pairs_overlap(strategy: Strategy) -> bool:
    """Whether the schedule's F&B pairs hide the expert-parallel all-to-alls (`RuntimeOptions.ep_overlap`)."""
    return strategy.runtime.ep_overlap and strategy.schedule in PAIRED_SCHEDULES


def recomputes(strategy: Strategy) -> bool:
    """Whether any stage of the strategy recomputes activations."""
    modes = ({s.recompute for s in strategy.stages if s.recomputed != ()} if strategy.stages
             else {strategy.recompute})
    return bool(modes - {Recompute.NONE})


def _recompute_flops(chain: LayerChain, seg_index: int, recompute: Recompute,
                     cache: dict[tuple[Recompute, int], float]) -> float:
    """Forward FLOPs (traced batch) that `recompute` reruns in one segment, counted as model FLOPs count them
    (`costmodel.model_flops`: routed experts at the token choices they serve)."""
    seg = chain.segments[seg_index]
    if recompute is Recompute.NONE:
        return 0
    key = (recompute, seg.class_id)
    if key not in cache:
        nodes = chain.nodes_of(seg)
        if recompute is Recompute.FULL:
            only = None
        elif recompute is Recompute.OP:
            kept = op_policy_kept(nodes)
            only = frozenset(n.name for n in nodes if n.name not in kept)
        else:
            only = selective_recompute_region(nodes)
        cache[key] = counted_flops(nodes, backward=False, only=only)
    return cache[key]


def estimate(chain: LayerChain | Graph, cluster: Cluster, strategy: Strategy, *,
             layer_costs: Mapping[tuple[int, str], LayerCost] | None = None, dtype: str = "bfloat16",
             profile: OpProfile | None = None, global_batch: int | None = None) -> Estimate:
    """Price `strategy` for `chain` (a traced `Graph` is cut into its layer chain first) on `cluster`.

    `global_batch`, when given, must equal dp * microbatch_size * num_microbatches (else a problem says so).
    See the module docstring for the model."""
    if isinstance(chain, Graph):
        chain = build_layer_chain(chain)
    chain = strategy.runtime.priced_chain(chain)
    if strategy.num_devices > cluster.num_available:
        raise ValueError(f"strategy needs dp*tp*pp*cp = {strategy.num_devices} devices, the cluster has "
                         f"{cluster.num_available} available")
    stages = resolve_stages(chain, strategy)
    problems = _validity_problems(chain, strategy, global_batch)
    ranks = _pipeline_ranks(cluster, strategy, stages)
    prices = _Prices(chain, strategy, layer_costs, dtype, profile, cluster)
    priced = [runs([PricedSegment(prices(i, ranks[stage_rank(strategy.schedule, strategy.pp, j)].device),
                                  st.segment_recompute(i) if strategy.stages else strategy.recompute)
                    for i in range(st.start, st.stop)]) for j, st in enumerate(stages)]
    # Copies of weights shared across pipeline ranks (tied embeddings), vocabulary-sharded over tp like the head.
    shared = [-(-n // strategy.tp) for n in shared_parameter_copies(chain, stages, strategy.pp, strategy.schedule)]

    stage_times, tails = _step_terms(priced, ranks, shared, strategy, cluster, dtype, profile)
    p2p = [p2p_time(strategy, j, priced[j][-1].cost.boundary_bytes, cluster) for j in range(len(priced) - 1)]
    breakdown = step_breakdown(stage_times, tails, schedule=strategy.schedule,
                               num_microbatches=strategy.num_microbatches, virtual_stages=strategy.virtual_stages,
                               p2p_time=p2p, ep_overlap=pairs_overlap(strategy),
                               p2p_overlap=strategy.runtime.p2p_overlap)
    stage_estimates = _stage_estimates(priced, stage_times, stages, ranks, shared, strategy, dtype, problems)
    return _with_throughput(chain, strategy, stages, priced, ranks, breakdown, tuple(stage_estimates),
                            tuple(problems), dtype)


@dataclass(frozen=True, slots=True)
class RankSetting:
    """What prices pipeline rank `index` besides its segments: its device, speed and measured framework costs."""

    index: int
    device: DeviceSpec
    speed: float
    framework: FrameworkCosts


def rank_step_terms(chunks: Sequence[Sequence[PricedSegment]], shared_params: int, strategy: Strategy,
                    rank: RankSetting, cluster: Cluster, dtype: str, *,
                    dp_comm: Callable[..., DataParallelComm] = data_parallel_comm,
                    chunk_cache: dict | None = None) -> tuple[list[StageTime], RankTail]:
    """One pipeline rank holding `chunks` (its virtual stages, in order) and `shared_params` copied weights:
    each chunk's `StageTime` (ZeRO per-micro-batch communication and framework work included) and what the rank
    does after its last backward (gradient reduction, syncs, optimizer, post-step gathers). Framework host work
    (`step_time.host_time`) joins each chunk's forward and backward.

    This is the one per-rank composition of the model: `estimate` calls it for every rank and the planner's
    partition problem (`planner.search.stage_problem`) for every candidate stage, so the search's objective is the
    estimate. `dp_comm` is `step_time.data_parallel_comm` or a cache of it; `chunk_cache`, when given, keeps each
    chunk's terms by its segments (the caller keeps one per rank setting: a rank's chunks often repeat). The two
    halves, `rank_chunk_times` and `rank_tail`, let a caller price the per-micro-batch times alone first."""
    times, comms = rank_chunk_times(chunks, strategy, rank, cluster, dtype, dp_comm=dp_comm,
                                    chunk_cache=chunk_cache)
    return times, rank_tail(chunks, times, comms, shared_params, strategy, rank, cluster, dtype)


def rank_chunk_times(chunks: Sequence[Sequence[PricedSegment]], strategy: Strategy, rank: RankSetting,
                     cluster: Cluster, dtype: str, *, dp_comm: Callable[..., DataParallelComm] = data_parallel_comm,
                     chunk_cache: dict | None = None) -> tuple[list[StageTime], list[DataParallelComm]]:
    """Per chunk of the rank its `StageTime` and its data-parallel communication (`rank_step_terms`' first half)."""
    group = dp_group(strategy, rank.index)
    times: list[StageTime] = []
    comms: list[DataParallelComm] = []
    for segs in chunks:
        key = tuple((s.cost, s.recompute, s.count) for s in segs) if chunk_cache is not None else None
        hit = chunk_cache.get(key) if chunk_cache is not None else None
        if hit is None:
            hit = _chunk_time(segs, strategy, rank, cluster, dtype_bytes(dtype), group, dp_comm)
            if chunk_cache is not None:
                chunk_cache[key] = hit
        times.append(hit[0])
        comms.append(hit[1])
    return times, comms


def rank_tail(chunks: Sequence[Sequence[PricedSegment]], times: Sequence[StageTime],
              comms: Sequence[DataParallelComm], shared_params: int, strategy: Strategy, rank: RankSetting,
              cluster: Cluster, dtype: str) -> RankTail:
    """What the rank does after its last backward, from its chunks' times and communication (`rank_step_terms`'
    second half)."""
    costs = [s.cost for c in chunks for s in c]
    counts = [s.count for c in chunks for s in c]
    weighted = list(zip(costs, counts, strict=True))
    experts = sum(n * c.expert_param_count for c, n in weighted)  # ZeRO shards expert state over dp*cp/ep_dp
    local_params = optimizer_params(sum(n * c.param_count for c, n in weighted) + shared_params, experts,
                                    zero_stage=strategy.zero_stage, dp_size=strategy.dp * strategy.cp,
                                    ep_dp=strategy.ep_dp)
    r = rank.index
    optimizer_s, copy_s = optimizer_terms(
        local_params, rank.device, strategy.runtime.offload, dtype=dtype, speed=rank.speed,
        host_s=rank.framework.optimizer_host_s(*param_tensor_kinds(strategy, costs, counts)))
    optimizer_s += fp8_weight_copy_time(costs, strategy.runtime.fp8, rank.device, dtype=dtype,
                                        counts=counts) / rank.speed
    return RankTail(
        end_reduce_s=sum(c.end_reduce_s for c in comms),
        end_reduce_chunks=max(sum(c.end_reduce_chunks for c in comms), 1),
        last_bwd_window_s=sum(t.compute_bwd_s + t.recompute_s + t.tp_bwd_s for t in times),
        tp_grad_sync_s=tp_grad_sync_time(
            sum(n * c.grad_sync_bytes for c, n in weighted) + _split_expert_grad_bytes(weighted, strategy, dtype),
            sum(n * c.grad_sync_tensors for c, n in weighted), tp_group(strategy, r),
            cluster, concurrent=strategy.num_devices // strategy.tp,
            per_tensor_s=rank.framework.grad_sync_per_tensor(strategy.tp)),
        shared_sync_s=_shared_sync_time(shared_params, strategy, r, cluster,
                                        strategy.runtime.grad_bytes(dtype_bytes(dtype))),
        optimizer_s=optimizer_s, offload_copy_s=copy_s,
        post_step_s=sum(c.post_step_s for c in comms), overlap=strategy.runtime.dp_overlap)


def _split_expert_grad_bytes(weighted: Sequence[tuple[LayerCost, int]], strategy: Strategy, dtype: str) -> float:
    """Gradient bytes of experts whose slots the tp ranks split (`costmodel.expert_parallel`), summed over the tp
    group after the backward: the rank's shard of them under ZeRO (over dp*cp/ep_dp ranks), else all."""
    params = sum(n * c.tp_split_expert_params for c, n in weighted)
    if not params:
        return 0.0
    shards = max(strategy.dp * strategy.cp // strategy.ep_dp, 1) if strategy.zero_stage >= 1 else 1
    return params / shards * strategy.runtime.grad_bytes(dtype_bytes(dtype))


def optimizer_terms(local_params: int, device: DeviceSpec, offload: Offload, *, dtype: str, speed: float = 1.0,
                    host_s: float = 0.0) -> tuple[float, float]:
    """(seconds of the optimizer step, of which host-device copies) of a rank updating `local_params`: Adam on the
    device (`step_time.optimizer_step_time`), or with `offload` the end-of-step copies and the CPU's Adam
    (`costmodel.offload.offload_tail`); a device without host data is priced without offload (its estimate
    says it cannot offload). `host_s` is the framework's per-tensor host work, paid either way."""
    host = host_of(device.name)
    if Offload(offload) is Offload.NONE or host is None:
        return optimizer_step_time(local_params, device, speed=speed, host_s=host_s), 0.0
    tail = offload_tail(offload, local_params, host, weight_bytes=dtype_bytes(dtype))
    return tail.total_s + host_s, tail.copy_s


def _chunk_time(segs: Sequence[PricedSegment], strategy: Strategy, rank: RankSetting, cluster: Cluster,
                weight_bytes: int, group: CommGroup, dp_comm: Callable[..., DataParallelComm]
                ) -> tuple[StageTime, DataParallelComm]:
    """One virtual stage's `StageTime` on `rank`, with its data-parallel communication over `group`."""
    pp, dp_size, runtime = strategy.pp, strategy.dp * strategy.cp, strategy.runtime
    segs = _fp8_shard_casts(segs, strategy)
    plain = stage_time(segs, speed=rank.speed)
    # Expert weights are reduced over dp*cp/ep_dp ranks (costmodel/expert_parallel.py).
    params = dp_synced_params([s.cost for s in segs], dp_size=dp_size, ep_dp=strategy.ep_dp,
                              counts=[s.count for s in segs])
    # Every (tp, pp) coordinate runs its own data-parallel reduction at the same time. Gradients are reduced
    # in fp32 unless the trainer keeps them 16-bit (`RuntimeOptions.grad_bytes`), weights gathered in the training
    # dtype, FP8 weights in one byte (`costmodel.float8`).
    comm = dp_comm(zero_stage=strategy.zero_stage, grad_bytes=params * runtime.grad_bytes(weight_bytes),
                   param_bytes=params * weight_bytes - _fp8_gather_saving(segs, strategy, weight_bytes),
                   num_segments=sum(s.count for s in segs), fwd_window_s=plain.compute_fwd_s,
                   bwd_window_s=plain.compute_bwd_s + plain.recompute_s, group=group, cluster=cluster,
                   concurrent=strategy.tp * pp, overlap=runtime.dp_overlap,
                   reshard_after_forward=runtime.reshard_after_forward,
                   host_copy=_stage_host_copy(segs, strategy, rank.device), pipelined=pp > 1)
    host = host_time(segs, rank.framework, zero_stage=strategy.zero_stage, dp_size=dp_size, pipeline_size=pp,
                     schedule=strategy.schedule)
    chunk = stage_time(segs, speed=rank.speed, dp_fwd_s=comm.per_microbatch_fwd_s,
                       dp_bwd_s=comm.per_microbatch_bwd_s, host=host,
                       tp_overlap_chunks=strategy.tp if runtime.tp_overlap else 0,
                       tp_grad_overlap=runtime.tp_grad_overlap,
                       offload_fwd_s=comm.offload_fwd_s, offload_bwd_s=comm.offload_bwd_s)
    kernel = runtime.loss_kernel(strategy.tp)
    if kernel is not CrossEntropy.TORCH:
        # The chunk's segments are priced with PyTorch's loss (`training_loss.with_training_loss`).
        changes = [(s.count, loss_time_change(s.cost.loss_elements, weight_bytes, kernel, rank.device))
                   for s in segs]
        fwd, bwd = sum(n * c[0] for n, c in changes), sum(n * c[1] for n, c in changes)
        chunk = replace(chunk, compute_fwd_s=chunk.compute_fwd_s + fwd / rank.speed,
                        compute_bwd_s=chunk.compute_bwd_s + bwd / rank.speed)
    if runtime.metric_passes:
        metrics = runtime.metric_passes * sum(s.count * metric_pass_time(s.cost.loss_elements, weight_bytes,
                                                                                rank.device) for s in segs)
        chunk = replace(chunk, compute_bwd_s=chunk.compute_bwd_s + metrics / rank.speed)
    if runtime.fp32_grad_pass:
        grad_pass = fp32_grad_pass_time(sum(s.count * s.cost.param_count for s in segs), rank.device,
                                        dtype_bytes=weight_bytes, speed=rank.speed)
        chunk = replace(chunk, compute_bwd_s=chunk.compute_bwd_s + grad_pass, wgrad_s=chunk.wgrad_s + grad_pass)
    return chunk, comm


def _stage_host_copy(segs: Sequence[PricedSegment], strategy: Strategy, device: DeviceSpec) -> HostCopy | None:
    """FSDP2's per-micro-batch copies of a stage whose parameters are offloaded (`costmodel.offload`), or None."""
    host = host_of(device.name)
    if strategy.runtime.offload is not Offload.PARAMS or host is None:
        return None
    shard = optimizer_params(sum(s.count * s.cost.param_count for s in segs),
                             sum(s.count * s.cost.expert_param_count for s in segs),
                             zero_stage=strategy.zero_stage, dp_size=strategy.dp * strategy.cp,
                             ep_dp=strategy.ep_dp)
    return host_copy(shard, host, num_microbatches=strategy.num_microbatches)


def _fp8_gathers_weights(strategy: Strategy) -> bool:
    """Whether ZeRO-3 gathers converted weights in FP8 (FSDP's float8 all-gather, tensorwise scaling only)."""
    fp8 = strategy.runtime.fp8
    return fp8 is not None and fp8.fp8_all_gather and strategy.zero_stage == 3 and strategy.dp * strategy.cp > 1


def _fp8_shard_casts(segs: Sequence[PricedSegment], strategy: Strategy) -> Sequence[PricedSegment]:
    """With FP8 all-gathers each rank casts its 1/dp shard of a converted weight before the gather, and the
    linear finds the gathered weight in FP8: the layer's weight casts shrink to that share (`costmodel.float8`)."""
    if not _fp8_gathers_weights(strategy):
        return segs
    gone = 1 - 1 / (strategy.dp * strategy.cp)

    def shard(c: LayerCost) -> LayerCost:
        fwd, bwd = gone * c.fp8_weight_cast_fwd_s, gone * c.fp8_weight_cast_bwd_s
        return replace(c, fwd_compute_s=c.fwd_compute_s - fwd, bwd_compute_s=c.bwd_compute_s - bwd,
                       recompute_full_s=c.recompute_full_s - fwd)
    return [replace(s, cost=shard(s.cost)) for s in segs]


def _fp8_gather_saving(segs: Sequence[PricedSegment], strategy: Strategy, weight_bytes: int) -> float:
    """Bytes a ZeRO-3 gather of these segments saves when tensorwise FP8 gathers converted weights in one byte."""
    if not _fp8_gathers_weights(strategy):
        return 0.0
    converted = sum(s.count * s.cost.fp8_weight_share * (s.cost.param_count - s.cost.expert_param_count) for s in segs)
    return converted * (weight_bytes - FP8_BYTES)


def _shared_sync_time(shared_params: int, strategy: Strategy, pp_rank: int, cluster: Cluster,
                      grad_bytes: int) -> float:
    """The copy of a shared weight has its gradient all-reduced with the owner (the first rank, for a tied
    embedding)."""
    if not shared_params or pp_rank == 0:
        return 0.0
    return collective_time(Collective.ALL_REDUCE, shared_params * grad_bytes,
                           shared_weight_group(strategy, pp_rank), cluster,
                           concurrent=strategy.num_devices // strategy.pp)


def _step_terms(priced: Sequence[Sequence[PricedSegment]], ranks: Sequence[_Rank], shared: Sequence[int],
                strategy: Strategy, cluster: Cluster, dtype: str, profile: OpProfile | None
                ) -> tuple[list[StageTime], list[RankTail]]:
    """Per virtual stage its `StageTime`, per pipeline rank its `RankTail` (`rank_step_terms` of each rank)."""
    framework = {name: FrameworkCosts.from_profile(profile, name) for name in {r.device.name for r in ranks}}
    stage_times: list[StageTime | None] = [None] * len(priced)
    tails = []
    for r, rank in enumerate(ranks):
        setting = RankSetting(r, rank.device, rank.speed, framework[rank.device.name])
        mine = _rank_stages(strategy, r)
        times, tail = rank_step_terms([priced[j] for j in mine], shared[r], strategy, setting, cluster, dtype)
        for j, t in zip(mine, times, strict=True):
            stage_times[j] = t
        tails.append(tail)
    return [t for t in stage_times if t is not None], tails


def _rank_stages(strategy: Strategy, rank: int) -> tuple[int, ...]:
    """The virtual stages of pipeline rank `rank`, in its chunk order (`pipeline.chunk_stages`)."""
    return chunk_stages(strategy.schedule, strategy.pp, strategy.virtual_stages, rank)


def _stage_estimates(priced: Sequence[Sequence[PricedSegment]], stage_times: Sequence[StageTime],
                     stages: Sequence[StageSpec], ranks: Sequence[_Rank], shared: Sequence[int],
                     strategy: Strategy, dtype: str, problems: list[str]) -> list[StageEstimate]:
    """Per pipeline rank: times of one micro-batch and peak memory; appends a problem when it does not fit."""
    pp = strategy.pp
    out = []
    for r, rank in enumerate(ranks):
        counts = in_flight_per_chunk(strategy.schedule, pp, r, strategy.num_microbatches, strategy.virtual_stages)
        mine = [stage_times[j] for j in _rank_stages(strategy, r)]
        memory = rank_memory([priced[j] for j in _rank_stages(strategy, r)], counts,
                             zero_stage=strategy.zero_stage, dp=strategy.dp * strategy.cp,
                             dtype=dtype, device_name=rank.device.name, extra_params=shared[r], ep_dp=strategy.ep_dp,
                             reshard_after_forward=strategy.runtime.reshard_after_forward,
                             offload=strategy.runtime.offload, pipelined=pp > 1,
                             cross_entropy=strategy.runtime.loss_kernel(strategy.tp),
                             grad_bytes=strategy.runtime.grad_bytes(dtype_bytes(dtype)),
                             boundaries=chunk_boundaries(priced, _rank_stages(strategy, r), strategy, dtype),
                             num_microbatches=strategy.num_microbatches)
        capacity = rank.device.memory_bytes
        if memory.total > capacity:
            problems.append(f"stage {r} needs {memory.total / GIB:.1f} GiB > {capacity / GIB:.1f} GiB "
                            f"({rank.device.name})")
        why = host_problem(strategy.runtime.offload, rank.device.name, host_of(rank.device.name), memory.host, r)
        if why and why not in problems:
            problems.append(why)
        zero_bubble = strategy.schedule.zero_bubble
        out.append(StageEstimate(
            index=r, start=stages[r].start, stop=stages[r].stop, device=rank.device.name,
            fwd_s=sum(t.fwd_s for t in mine), bwd_s=sum(t.bwd_s for t in mine), memory=memory,
            capacity_bytes=capacity, in_flight_microbatches=max(counts),
            wgrad_s=sum(t.wgrad_s for t in mine) if zero_bubble else 0.0))
    return out


def chunk_boundaries(priced: Sequence[Sequence[PricedSegment]], mine: Sequence[int], strategy: Strategy,
                     dtype: str) -> tuple[ChunkBoundary, ...]:
    """Per virtual stage in `mine`, the activations it receives and sends per micro-batch (the output of the
    stage before it and its own) and, on the last stage of a schedule asked for its outputs, the logits it
    returns, where the runtime keeps pipeline buffers for them (`memory.p2p_buffer_bytes`); () where it does
    not."""
    if not strategy.runtime.keeps_p2p_buffers(strategy.pp):
        return ()
    last = len(priced) - 1
    returned = strategy.runtime.pp_returns_outputs
    return tuple(ChunkBoundary(received=priced[j - 1][-1].cost.boundary_bytes if j > 0 else 0,
                               sent=priced[j][-1].cost.boundary_bytes if j < last else 0,
                               returned=returned_bytes(sum(s.count * s.cost.loss_elements for s in priced[j]), dtype)
                               if returned and j == last else 0) for j in mine)


def _with_throughput(chain: LayerChain, strategy: Strategy, stages: Sequence[StageSpec],
                     priced: Sequence[Sequence[PricedSegment]], ranks: Sequence[_Rank], breakdown: TimeBreakdown,
                     stage_estimates: tuple[StageEstimate, ...], problems: tuple[str, ...], dtype: str) -> Estimate:
    """The `Estimate`, with throughput and model / hardware FLOP rates (module docstring)."""
    graph = chain.graph
    step = breakdown.total_s
    batch = strategy.global_batch
    model_flops = chain_model_flops(chain) * batch / graph.batch_size
    flops_cache: dict[tuple[Recompute, int], float] = {}
    recompute_flops = sum(
        _recompute_flops(chain, i, mode, flops_cache)
        for st, segs in zip(stages, priced, strict=True)
        for i, mode in zip(range(st.start, st.stop), (s.recompute for s in segs for _ in range(s.count)), strict=True)
    ) * strategy.microbatch_size / graph.batch_size * strategy.num_microbatches * strategy.dp
    peak = sum(r.device.flops(dtype) for r in ranks) / strategy.pp
    model_tflops = model_flops / (step * strategy.num_devices) / 1e12
    hw_tflops = (model_flops + recompute_flops) / (step * strategy.num_devices) / 1e12
    return Estimate(
        step_time_s=step,
        tokens_per_s=batch * graph.seq_len / step if graph.seq_len else None,
        samples_per_s=batch / step,
        model_tflops_per_device=model_tflops,
        hardware_tflops_per_device=hw_tflops,
        mfu=model_tflops * 1e12 / peak,
        hfu=hw_tflops * 1e12 / peak,
        stages=stage_estimates,
        breakdown=breakdown,
        fits=not problems,
        problems=problems,
        error_band=error_band(r.device for r in ranks),
    )
