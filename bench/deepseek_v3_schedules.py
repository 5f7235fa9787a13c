"""DeepSeek-V3's published configuration (`tests/published_reference.py`, `deepseek_v3_run`) priced term by term as
the cost model's options are switched on one at a time, and under DualPipeV, the schedule the run used (its
V-shaped form), which the pinned row cannot use: torch's DualPipeV splits the backward, so no stage may recompute,
and this prints what the configuration then needs per GPU -- with the pairs run one after the other, as torch
does, and overlapped, as DeepSeek's DualPipe does (`RuntimeOptions.ep_overlap`).

Each line: the pinned row's strategy (the planner's micro-batch, recomputation and stage split at 1F1B), or
DualPipeV without recomputation on the chunks the search gives this chain of two block classes
(`costmodel.rank_layout.balanced_chunks`); the step time, its breakdown and the
largest stage's memory.

Usage: python bench/deepseek_v3_schedules.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.published_reference import (  # noqa: E402
    build_chain,
    cluster_of,
    deepseek_v3_run,
    predict,
)

GIB = 1024 ** 3
TERMS = ("compute_s", "recompute_s", "tp_comm_s", "pp_comm_s", "dp_comm_s", "bubble_s")


def _line(label: str, step_s: float, breakdown: dict[str, float], memory_gib: float, measured_s: float) -> str:
    terms = " ".join(f"{k[:-2]} {breakdown[k]:.2f}" for k in TERMS)
    return f"{label:44s} {step_s:7.2f} s {step_s / measured_s - 1:+7.1%} | {terms} | {memory_gib:6.1f} GiB"


def pinned_rows() -> list[str]:
    """The row with its runtime options added one at a time (the planner fills in the rest each time)."""
    from costmodel.float8 import Float8Recipe
    from costmodel.strategy import RuntimeOptions

    run, chains, out = deepseek_v3_run(), {}, []
    steps = (("plain all-to-all, bf16", RuntimeOptions()),
             ("+ deduplicated dispatch (ep_dedup)", RuntimeOptions(ep_dedup=True)),
             ("+ FP8 dense linears (torchao rowwise)", RuntimeOptions(ep_dedup=True, fp8=Float8Recipe.ROWWISE)),
             ("+ FP8 experts too (TE's recipe)", RuntimeOptions(ep_dedup=True, fp8=Float8Recipe.DELAYED)),
             ("+ paired all-to-all overlap (the row)", run.runtime))
    for label, runtime in steps:
        pred = predict(dataclasses.replace(run, runtime=runtime), chains)
        out.append(_line(label, pred.step_s, pred.breakdown, pred.memory_gib, run.measured_step_s))
    return out


def dualpipev_row(overlap: bool) -> str:
    """The row's runtime under DualPipeV, 120 micro-batches of 1, no recomputation (what torch's DualPipeV
    allows), the search's chunks (`balanced_chunks`): priced although it does not fit, with the memory it needs.
    `overlap`: the pairs hide the all-to-alls (`RuntimeOptions.ep_overlap`, DeepSeek's DualPipe)."""
    from costmodel.rank_layout import balanced_chunks
    from costmodel.strategy import Schedule, Strategy
    from planner.api import estimate_plan

    run = deepseek_v3_run()
    runtime = dataclasses.replace(run.runtime, ep_overlap=overlap)
    chain = build_chain(run, 1)
    strategy = Strategy(dp=run.dp, pp=run.pp, ep=run.ep, microbatch_size=1, num_microbatches=run.global_batch // run.dp,
                        schedule=Schedule.DUALPIPEV, virtual_stages=2, zero_stage=1,
                        stages=balanced_chunks(chain, 2 * run.pp), runtime=runtime)
    est = estimate_plan(chain, cluster_of(run), strategy, global_batch=run.global_batch).predicted
    label = "DualPipeV + paired overlap (ep_overlap)" if overlap else "DualPipeV, no recompute (does not fit)"
    return _line(label, est.step_time_s, est.breakdown.to_dict(),
                 max(est.peak_memory_bytes) / GIB, run.measured_step_s)


def main() -> int:
    run = deepseek_v3_run()
    print(f"{run.name}: published {run.measured_step_s:.2f} s per step")
    for line in (*pinned_rows(), dualpipev_row(False), dualpipev_row(True)):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
