"""Reproduce Korthikanti et al. 2022 with Stratagem's cost model: predicted against published iteration times.

The published runs, the Megatron-LM reference layout and the predictions are in tests/korthikanti_reference.py
(shared with tests/test_korthikanti.py); this prints them as a table.

Usage: python bench/costmodel_validation.py [--json] [--models 22B,175B]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from korthikanti_reference import (  # noqa: E402
    LAYER_22B_MS,
    ROWS,
    SHARDINGS,
    Prediction,
    build_chain,
    layer_times_22b,
    predict_row,
)


def _table(preds: Sequence[Prediction]) -> str:
    lines = [f"{'model':<6} {'config':<13} {'predicted s':>11} {'published s':>11} {'error':>7}  "
             f"{'MFU':>6} {'HFU':>6}  breakdown (s)"]
    for p in preds:
        b = p.estimate.breakdown
        lines.append(
            f"{p.model:<6} {p.mode:<13} {p.predicted_s:>11.2f} {p.published_s:>11.2f} {100 * p.error:>+6.1f}%  "
            f"{100 * p.estimate.mfu:>5.1f}% {100 * p.estimate.hfu:>5.1f}%  compute {b.compute_s:.2f}, recompute "
            f"{b.recompute_s:.2f}, tp {b.tp_comm_s:.2f}, pp {b.pp_comm_s:.2f}, dp {b.dp_comm_s:.2f}, bubble "
            f"{b.bubble_s:.2f}, optimizer {b.optimizer_s:.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--models", default=",".join(r.model for r in ROWS),
                        help="comma-separated subset of " + ", ".join(r.model for r in ROWS))
    parser.add_argument("--sharding", choices=SHARDINGS, default="ilp",
                        help="tp=8 layer prices from the planner's ILP (default) or the Megatron reference layout")
    parser.add_argument("-o", "--output", type=Path, help="also write the JSON results here")
    args = parser.parse_args(argv)
    wanted = args.models.split(",")
    unknown = sorted(set(wanted) - {r.model for r in ROWS})
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; valid: {', '.join(r.model for r in ROWS)}")
    preds: list[Prediction] = []
    layer: dict[str, tuple[float, float]] = {}
    timings: dict[str, float] = {}
    for row in ROWS:
        if row.model not in wanted:
            continue
        t0 = time.perf_counter()
        chain = build_chain(row)
        t1 = time.perf_counter()
        preds.extend(predict_row(row, chain, sharding=args.sharding))
        timings[row.model] = time.perf_counter() - t1
        print(f"# {row.model}: traced in {t1 - t0:.1f} s, priced in {timings[row.model]:.1f} s", file=sys.stderr)
        if row.model == "22B":
            layer = layer_times_22b(chain, sharding=args.sharding)
    result = {
        "iteration_time": [{"model": p.model, "config": p.mode, "predicted_s": p.predicted_s,
                            "published_s": p.published_s, "error": p.error, "mfu": p.estimate.mfu,
                            "hfu": p.estimate.hfu, "breakdown": p.estimate.breakdown.to_dict()} for p in preds],
        "layer_22b_ms": [{"setting": k, "predicted_fwd_ms": v[0], "predicted_bwd_ms": v[1],
                          "published_fwd_ms": LAYER_22B_MS[k][0], "published_bwd_ms": LAYER_22B_MS[k][1]}
                         for k, v in layer.items()],
    }
    if args.output:
        args.output.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
        return 0
    print(_table(preds))
    if layer:
        print("\n22B layer at tp=8, micro-batch 4 (Table 4): predicted / published ms")
        for k, (f, b) in layer.items():
            pf, pb = LAYER_22B_MS[k]
            print(f"  {k:<32} fwd {f:5.1f} / {pf:4.1f} ({100 * (f - pf) / pf:+5.1f}%)   "
                  f"bwd {b:5.1f} / {pb:4.1f} ({100 * (b - pb) / pb:+5.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
