"""Hand-built plans for the report tests (explain, diff, timeline, plot): every number is chosen here, so tests
can assert exact results. The pipeline part of the step and its busy / bubble / p2p split come from the cost
model's own closed form (`costmodel.pipeline.pipeline_times`, each rank's time split evenly over its v chunks,
`p2p_s` per boundary), then the exposed end-of-step communication and the optimizer step are added, as
`costmodel.step_time.step_breakdown` does."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from costmodel.breakdown import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from costmodel.pipeline import PipelineTime, pipeline_times, stage_rank
from costmodel.sharding.rules import Style
from costmodel.strategy import Recompute, Schedule, StageSpec, Strategy
from planner.plan import Alternative, ModelInfo, ModuleSharding, Plan, SearchInfo, TrainingConfig

GIB = 1 << 30


def pipeline(fwd: Sequence[float], bwd: Sequence[float], schedule: Schedule, m: int, v: int,
             p2p_s: float, wgrad: Sequence[float] | None = None) -> PipelineTime:
    def split(per_rank: Sequence[float]) -> list[float]:
        return [per_rank[stage_rank(schedule, len(per_rank), j)] / v for j in range(len(per_rank) * v)]

    p = len(fwd)
    # No send between two stages on one rank (the tip of a V).
    sends = [0.0 if stage_rank(schedule, p, j) == stage_rank(schedule, p, j + 1) else p2p_s
             for j in range(p * v - 1)]
    return pipeline_times(split(fwd), split(bwd), schedule, m, v, sends, split(wgrad) if wgrad else None)


def make_plan(*, pp: int = 4, dp: int = 2, tp: int = 2, m: int = 8, v: int = 1,
              schedule: Schedule = Schedule.ONE_F_ONE_B, fwd: Sequence[float] | None = None,
              bwd: Sequence[float] | None = None, p2p_s: float = 0.0, end_comm_s: float = 0.05,
              optimizer_s: float = 0.02, tp_frac: float = 0.1, recompute: Recompute = Recompute.NONE,
              recompute_frac: float = 0.0, memory_gib: Sequence[float] | None = None, capacity_gib: float = 80.0,
              alternatives: Sequence[Alternative] = (), model_name: str = "gpt", layers: int = 24,
              wgrad: Sequence[float] | None = None) -> Plan:
    fwd = list(fwd) if fwd is not None else [0.1] * pp
    bwd = list(bwd) if bwd is not None else [0.2] * pp
    wgrad = list(wgrad) if wgrad is not None else [0.0] * pp
    memory_gib = list(memory_gib) if memory_gib is not None else [40.0 + 2 * i for i in range(pp)]
    pipe = pipeline(fwd, bwd, schedule, m, v, p2p_s, wgrad)
    step = pipe.total_s + end_comm_s + optimizer_s
    busiest = pipe.busy_s
    breakdown = TimeBreakdown(
        compute_s=busiest * (1 - tp_frac - recompute_frac), recompute_s=busiest * recompute_frac,
        tp_comm_s=busiest * tp_frac, pp_comm_s=pipe.p2p_s, dp_comm_s=end_comm_s,
        bubble_s=pipe.bubble_s, optimizer_s=optimizer_s)
    per_stage = layers // pp
    stage_estimates = tuple(
        StageEstimate(index=i, start=i * per_stage, stop=(i + 1) * per_stage, device="a100-80gb", fwd_s=fwd[i],
                      bwd_s=bwd[i], memory=_memory(memory_gib[i]), capacity_bytes=int(capacity_gib * GIB),
                      in_flight_microbatches=min(pp - i, m), wgrad_s=wgrad[i])
        for i in range(pp))
    chunk = layers // (pp * v)
    strategy = Strategy(dp=dp, tp=tp, pp=pp, microbatch_size=1, num_microbatches=m, schedule=schedule,
                        virtual_stages=v, zero_stage=1, sequence_parallel=tp > 1, recompute=recompute,
                        stages=tuple(StageSpec(k * chunk, (k + 1) * chunk, recompute) for k in range(pp * v)))
    tokens = dp * m * 2048
    predicted = Estimate(step_time_s=step, tokens_per_s=tokens / step, samples_per_s=dp * m / step,
                         model_tflops_per_device=150.0 * busiest / step, hardware_tflops_per_device=160.0 * busiest / step,
                         mfu=0.48 * busiest / step, hfu=0.51 * busiest / step, stages=stage_estimates,
                         breakdown=breakdown, fits=all(g <= capacity_gib for g in memory_gib))
    return Plan(
        model=ModelInfo(name=model_name, fingerprint="ab12cd34ef567890", params=1_300_000_000,
                        settings=(("layers", layers),)),
        cluster={"name": "4x8xa100-80gb", "groups": [{"device": "a100-80gb", "num_nodes": 4, "devices_per_node": 8}]},
        training=TrainingConfig(global_batch=dp * m, seq_len=2048),
        strategy=strategy,
        sharding=(ModuleSharding("blocks.*.attn.q_proj", Style.COLWISE),
                  ModuleSharding("blocks.*.attn.o_proj", Style.ROWWISE)),
        predicted=predicted,
        search=SearchInfo(time_s=1.5, candidates=120, status="optimal", optimality_gap=0.0, lower_bound_s=step,
                          alternatives=tuple(alternatives)),
    )


def _memory(total_gib: float) -> MemoryBreakdown:
    """A stage's memory split in fixed proportions (params 1/8, grads 1/8, optimizer 1/4, activations 3/8 ...)."""
    total = int(total_gib * GIB)
    params = grads = total // 8
    optimizer = total // 4
    temporary = overhead = total // 16
    return MemoryBreakdown(params=params, grads=grads, optimizer=optimizer,
                           activations=total - params - grads - optimizer - temporary - overhead,
                           temporary=temporary, overhead=overhead)


def with_step_time(plan: Plan, factor: float) -> Plan:
    """The same plan with every predicted time scaled by `factor` (a uniformly slower or faster plan)."""
    p = plan.predicted
    bd = TimeBreakdown(**{k: v * factor for k, v in p.breakdown.to_dict().items()})
    stages = tuple(replace(s, fwd_s=s.fwd_s * factor, bwd_s=s.bwd_s * factor) for s in p.stages)
    predicted = replace(p, step_time_s=p.step_time_s * factor, tokens_per_s=(p.tokens_per_s or 0) / factor,
                        samples_per_s=p.samples_per_s / factor, mfu=p.mfu / factor, hfu=p.hfu / factor,
                        stages=stages, breakdown=bd)
    return replace(plan, predicted=predicted)
