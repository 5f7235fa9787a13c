"""What each choice buys: the best plan per pipeline-schedule family, with and without offload and FP8.

    python bench/plan_choices.py              # both models (also `python bench/search.py choices`)
    python bench/plan_choices.py gpt3-175b    # one of them

For GPT-3 175B on 1,024 A100 80GB (global batch 1,536 x 2,048) and Llama 3.1 405B on 16,384 H100 (global batch
2,048 x 8,192, Llama 3's 16M tokens), the planner is run once per variant with the variant pinned (`--fix
schedule=...`, `--fix offload=...`, `--fp8`) and everything else free: the table shows each variant's best
predicted step time, MFU, peak memory per device and strategy, and how it compares with the free plan. FP8 needs
FP8 tensor cores (not on A100). Each search has a time limit; a search cut by it reports its proven gap.

Writes bench/results/plan_choices.json (machine, torch version, time limit, per variant: pins, step time, MFU,
memory, strategy, search status and gap, seconds).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "plan_choices.json"
TIME_LIMIT_S = 45.0
GIB = 1024 ** 3


@dataclass(frozen=True)
class Case:
    model: str
    cluster: str
    batch: int
    seq: int
    fp8: bool
    """Whether the cluster's devices have FP8 tensor cores (the FP8 variants are run)."""


CASES = {
    "gpt3-175b": Case("gpt3-175b", "128x8xa100-80gb", 1536, 2048, fp8=False),
    "llama3-405b": Case("llama3-405b", "2048x8xh100-sxm", 2048, 8192, fp8=True),
}
SCHEDULES = ("1f1b", "interleaved", "interleaved-zb", "zbv", "dualpipev")


def variants(case: Case) -> list[tuple[str, tuple[str, ...], str | None]]:
    """(label, --fix pins, FP8 recipe) of every variant of `case`: free, one per schedule family, offload, FP8."""
    out: list[tuple[str, tuple[str, ...], str | None]] = [("free", (), None)]
    out += [(f"schedule={s}", (f"schedule={s}",), None) for s in SCHEDULES]
    out += [("offload=optimizer", ("offload=optimizer",), None), ("offload=none", ("offload=none",), None)]
    if case.fp8:
        out += [("fp8", (), "tensorwise")]
        out += [(f"fp8, schedule={s}", (f"schedule={s}",), "tensorwise") for s in SCHEDULES]
    return out


def run_case(case: Case) -> list[dict]:
    from costmodel.hardware.cluster import Cluster
    from planner.api import plan
    from planner.errors import InfeasibleError, UserError
    from planner.search.space import SearchSpace
    from planner.strategy_label import Detail, strategy_label
    from planner.tracing import trace_model

    started = time.perf_counter()
    traced = trace_model(case.model, seq=case.seq)
    print(f"{case.model}: traced in {time.perf_counter() - started:.1f} s", flush=True)
    cluster = Cluster.parse(case.cluster)
    rows = []
    for label, pins, fp8 in variants(case):
        t0 = time.perf_counter()
        row = {"model": case.model, "cluster": case.cluster, "variant": label, "pins": list(pins), "fp8": fp8}
        try:
            space = SearchSpace.from_fixes(list(pins) + ([f"fp8={fp8}"] if fp8 else []))
            best = plan(traced.chain, None, cluster, global_batch=case.batch, space=space,
                        time_limit_s=TIME_LIMIT_S, model_name=traced.name)
        except (InfeasibleError, UserError, ValueError) as e:
            row.update(status="none", reason=str(e).splitlines()[0], seconds=time.perf_counter() - t0)
        else:
            est = best.predicted
            row.update(status=best.search.status, gap=best.search.optimality_gap, step_s=est.step_time_s,
                       mfu=est.mfu, memory_gib=max(est.peak_memory_bytes) / GIB,
                       strategy=strategy_label(best.strategy, Detail.CANDIDATE), seconds=time.perf_counter() - t0)
        rows.append(row)
        _print_row(row, rows[0])
    return rows


def _print_row(row: dict, free: dict) -> None:
    if row["status"] == "none":
        print(f"  {row['variant']:28s} no plan: {row['reason']}", flush=True)
        return
    ratio = f"{row['step_s'] / free['step_s']:.3f}x" if free.get("step_s") else "-"
    gap = f" gap {100 * row['gap']:.1f}%" if row["status"] != "optimal" else ""
    print(f"  {row['variant']:28s} {row['step_s']:8.2f} s  {ratio:>7s} of free  MFU {100 * row['mfu']:5.1f}%  "
          f"{row['memory_gib']:5.1f} GiB  {row['seconds']:5.1f} s{gap}  {row['strategy']}", flush=True)


def main(argv: list[str]) -> int:
    chosen = argv or list(CASES)
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}", file=sys.stderr)
        return 2
    import torch

    rows = []
    for name in chosen:
        case = CASES[name]
        print(f"{case.model} on {case.cluster}, batch {case.batch} x {case.seq} (time limit {TIME_LIMIT_S:.0f} s "
              f"per search)", flush=True)
        rows += run_case(case)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                   "torch": torch.__version__, "time_limit_s": TIME_LIMIT_S, "rows": rows},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
