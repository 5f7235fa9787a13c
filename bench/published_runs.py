"""Predicted against published GPU training runs: step time and peak memory with the published configuration pinned.

For every row of shared/data/published_runs.csv and the Korthikanti et al. 2022 tables (`tests/published_reference.py`
builds the model, cluster and pinned configuration, and converts the published figure to seconds per iteration the
way its source counts it), the planner fills in only what the source leaves unstated (listed per row), prices the
result, and -- as a reference -- plans freely with the same model, cluster and batch. Prints a table and writes
bench/results/published_runs.json.

`--fit` fits `DeviceSpec.training_efficiency` per device class instead: every row is priced at efficiency 1, the
step time is split into what scales with the device (compute, recompute, bubbles, optimizer) and the rest, and the
efficiency minimizing the mean absolute error is found on a 0.005 grid, over all rows of the class and leaving each
row out in turn (the leave-one-out error is the row's error at the efficiency fitted without it). Writes
bench/results/training_efficiency_fit.json.

Rows run in FP8 are priced and shown, but left out of the mean error and of `--fit`: the torchtitan FP8 rows
(bench/data/published_fp8_runs.csv) are priced with FP8 linear layers (`costmodel.float8`); DeepSeek-V3 with FP8
dense linear layers too (rowwise), its FP8 experts and dispatch, which the cost model does not have, in bf16.

`--fp8-rows` prices only the rows priced in FP8, each also without FP8 (what the FP8 pricing moves), writes
bench/results/published_fp8_runs.json and the FP8 block of docs/fidelity.md.

`--moe-rows` prices the published mixture-of-experts runs (tests/published_moe_reference.py: NeMo 25.09 Qwen3-30B-A3B,
Qwen3-235B-A22B and DeepSeek-V3 on DGX-H100) the same way, out of sample, into bench/results/published_moe_runs.json;
their paired all-to-all overlap is priced on the plan the search finds without it (the search does not price it),
so run them with `--no-free`.

`--csv FILE` (repeatable) prices the rows of other tables in published_runs.csv's columns instead -- runs of your
own, or a held-out set -- as out-of-sample rows: the same conversion and pinning, a table on stdout and the JSON in
`--output` (default bench/results/published_runs_<first file's name>.json); the committed results and docs are
left alone. Cells a source leaves empty are completed as `tests/published_reference.py` states (and listed per row
under "inferred"); a row that cannot be read is skipped with its line and the reason.

Usage: python bench/published_runs.py [--only SUBSTRING] [--no-free] [--json] [--fit] [--resume] [--fp8-rows]
                                      [--moe-rows] [--csv FILE ... [--output JSON]]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.published_reference import (  # noqa: E402
    PublishedRun,
    all_runs,
    build_chain,
    cluster_of,
    describe,
    fit_efficiency,
    leave_one_out,
    load_published_runs,
    predict,
    unpaired,
    with_paired_overlap,
)


def free_plan(run: PublishedRun, chains: dict, pinned: dict[str, float], time_limit_s: float
              ) -> tuple[float, str]:
    """The free planner's plan for the run's model, cluster and batch (same runtime options as the source's), and
    where it differs: its label plus the breakdown term it saves the most time on against the pinned config."""
    from planner.api import plan
    from planner.search.space import SearchSpace

    chain = chains.get((run.name, run.microbatch_size or 1)) or build_chain(run, 1)
    space, cluster = SearchSpace(runtime=run.runtime), cluster_of(run)
    paired = run.runtime.ep_overlap  # searched without it, its plan estimated with it, as `predict` does
    p = plan(chain, None, cluster, global_batch=run.global_batch, space=unpaired(space) if paired else space,
             time_limit_s=time_limit_s)
    if paired:
        p = with_paired_overlap(p, chain, cluster, run.global_batch)
    s = p.strategy
    label = describe(s)
    mine = p.predicted.breakdown.to_dict()
    term, saved = max(((k, pinned.get(k, 0.0) - v) for k, v in mine.items()), key=lambda kv: kv[1])
    if saved > 0:
        label += f" (saves {saved:.3g} s of {term.removesuffix('_s').replace('_', ' ')})"
    if p.search.status == "feasible":
        label += f" [search cut at {time_limit_s:.0f} s, gap {p.search.optimality_gap:.1%}]"
    return p.predicted.step_time_s, label


DOC = ROOT / "docs" / "fidelity.md"
BEGIN, END = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"


def markdown_table(result: dict) -> str:
    """The rows as a markdown table (predicted against published step time and memory, the free planner)."""
    head = ("| run | GPUs | published s/step | predicted | error | memory GiB pred / published | pinned strategy "
            "(planner chose: ...) | free plan / expert |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        mem = (f"{r['predicted_memory_gib']:.1f} / {r['measured_memory_gib']:.1f} ({r['memory_error']:+.0%})"
               if r["memory_error"] is not None else "-")
        chose = f" (chose: {r['planner_chose']})" if r["planner_chose"] != "-" else ""
        free = f"{r['free_over_expert']:.2f}: {r['free_strategy']}" if r["free_over_expert"] else "-"
        lines.append(f"| {r['run']} | {r['gpus']} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{r['error']:+.1%} | {mem} | {r['strategy']}{chose} | {free} |")
    s = result["summary"]
    lines.append(f"\nMean |error| {s['mean_abs_error']:.1%}, worst {s['max_abs_error']:.1%} over {s['rows']} rows "
                 f"published in bf16; peak memory mean |error| {(s['mean_abs_memory_error'] or 0):.1%}.")
    if s.get("out_of_sample_rows"):
        lines.append(f"Out of sample (added after the fit, not in it): mean |error| "
                     f"{s['out_of_sample_mean_abs_error']:.1%}, worst {s['out_of_sample_max_abs_error']:.1%} over "
                     f"{s['out_of_sample_rows']} rows.")
    other = [r for r in result["rows"] if r.get("precision", "bf16") != "bf16"]
    if other:
        lines.append("Rows run in FP8 (not in the mean or the fit): "
                     + "; ".join(f"{r['run']} {r['error']:+.1%} (priced in {r.get('priced_in', 'bf16')})"
                                 for r in other) + ".")
    return "\n".join(lines)


FP8_BEGIN, FP8_END = "<!-- published-fp8-runs:begin -->", "<!-- published-fp8-runs:end -->"


def fp8_rows(runs: list[PublishedRun]) -> dict:
    """Price the rows run with FP8 linear layers in FP8 and, for comparison, without; print, write the JSON and
    the FP8 block of docs/fidelity.md."""
    chains: dict = {}
    rows = []
    for run in (r for r in runs if r.runtime.fp8 is not None):
        pred = predict(run, chains)
        bf16 = predict(dataclasses.replace(run, runtime=dataclasses.replace(run.runtime, fp8=None)), chains)
        rows.append({"run": run.name, "gpus": run.num_gpus, "recipe": run.runtime.fp8.value,
                     "measured_step_s": run.measured_step_s, "predicted_step_s": pred.step_s,
                     "error": pred.step_s / run.measured_step_s - 1, "predicted_without_fp8_s": bf16.step_s,
                     "error_without_fp8": bf16.step_s / run.measured_step_s - 1,
                     "measured_memory_gib": run.measured_memory_gib, "predicted_memory_gib": pred.memory_gib,
                     "strategy": pred.strategy, "inferred": list(run.inferred),
                     # torchao's float8 training is the recipe priced; a run with its own recipe (DeepSeek-V3's
                     # block-wise scaling, FP8 experts and dispatch) is shown, not averaged
                     "recipe_as_run": "Float8" in run.framework})
        r = rows[-1]
        print(f"{run.name[:64]:64s} {r['measured_step_s']:8.3f} {r['predicted_step_s']:8.3f} {r['error']:+7.1%}  "
              f"without FP8 {r['predicted_without_fp8_s']:8.3f} {r['error_without_fp8']:+7.1%}", flush=True)
    errs = [abs(r["error"]) for r in rows if r["recipe_as_run"]]
    result = {"rows": rows, "summary": {"rows": len(errs), "mean_abs_error": sum(errs) / len(errs),
                                        "max_abs_error": max(errs)}}
    out = ROOT / "bench" / "results" / "published_fp8_runs.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    _replace_block(FP8_BEGIN, FP8_END, fp8_table(result))
    return result


def fp8_table(result: dict) -> str:
    lines = ["| run | GPUs | published s/step | predicted (FP8) | error | priced without FP8 | error | memory GiB "
             "pred / published | pinned strategy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mem = (f"{r['predicted_memory_gib']:.1f} / {r['measured_memory_gib']:.1f}"
               if r["measured_memory_gib"] is not None else "-")
        lines.append(f"| {r['run']} | {r['gpus']} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
                     f"{r['error']:+.1%} | {r['predicted_without_fp8_s']:.3f} | {r['error_without_fp8']:+.1%} | "
                     f"{mem} | {r['strategy']} fp8 {r['recipe']} |")
    s = result["summary"]
    apart = [r["run"] for r in result["rows"] if not r.get("recipe_as_run", True)]
    lines.append(f"\nFP8 rows run with torchao's float8 recipe: mean |error| {s['mean_abs_error']:.1%}, worst "
                 f"{s['max_abs_error']:.1%} over {s['rows']} rows (not fitted: the training efficiency is the bf16 "
                 f"rows')" + (f"; shown apart, run with a recipe of its own: {', '.join(apart)}." if apart else "."))
    return "\n".join(lines)


def _replace_block(begin: str, end: str, body: str) -> None:
    text = DOC.read_text()
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    DOC.write_text(text)


def update_doc(result: dict) -> None:
    """Replace the generated block of docs/fidelity.md between the published-runs markers."""
    _replace_block(BEGIN, END, markdown_table(result))


def update_fit_doc(fitted: dict) -> None:
    """Replace the efficiency-fit block of docs/fidelity.md with the fitted values and leave-one-out errors."""
    begin, end = "<!-- efficiency-fit:begin -->", "<!-- efficiency-fit:end -->"
    lines = ["| device class | rows | fitted efficiency | leave-one-out mean abs error | worst |", "|---|---|---|---|---|"]
    for device, f in fitted.items():
        lines.append(f"| {device} | {f['rows']} | {f['efficiency']:.3f} | {f['loo_mean_abs_error']:.1%} | "
                     f"{f['loo_max_abs_error']:.1%} |")
    lines += ["", "| row | efficiency fitted without it | its error then |", "|---|---|---|"]
    lines += [f"| {r['run']} | {r['efficiency_without']:.3f} | {r['error']:+.1%} |"
              for f in fitted.values() for r in f["loo"]]
    text = DOC.read_text()
    if begin in text and end in text:
        block = f"{begin}\n" + "\n".join(lines) + f"\n{end}"
        DOC.write_text(text[:text.index(begin)] + block + text[text.index(end) + len(end):])


def fit(runs: list[PublishedRun]) -> dict:
    """Fit the training efficiency per device class, leave-one-out (module docstring); print and return it."""
    chains: dict = {}
    by_device: dict[str, list[tuple[PublishedRun, float, float]]] = {}
    for run in runs:
        pred = predict(run, chains, training_efficiency=1.0)
        by_device.setdefault(run.device, []).append((run, pred.step_s, pred.device_bound_s))
        print(f"{run.name[:52]:52s} measured {run.measured_step_s:8.3f}  at 1.0 {pred.step_s:8.3f}  "
              f"device-bound {pred.device_bound_s / pred.step_s:5.1%}", flush=True)
    out = {}
    for device, rows in by_device.items():
        data = [(s, d, run.measured_step_s) for run, s, d in rows]
        loo = leave_one_out(data)
        errs = [abs(e) for _, e in loo]
        out[device] = {"efficiency": fit_efficiency(data), "rows": len(rows),
                       "loo_mean_abs_error": sum(errs) / len(errs), "loo_max_abs_error": max(errs),
                       "loo": [{"run": run.name, "efficiency_without": f, "error": e}
                               for (run, _, _), (f, e) in zip(rows, loo, strict=True)]}
        print(f"\n{device}: efficiency {out[device]['efficiency']:.3f} over {len(rows)} rows; leave-one-out "
              f"mean |error| {out[device]['loo_mean_abs_error']:.1%}, worst {out[device]['loo_max_abs_error']:.1%}")
        for r in out[device]["loo"]:
            print(f"  {r['run'][:52]:52s} without it {r['efficiency_without']:.3f}  error {r['error']:+.1%}")
    path = ROOT / "bench" / "results" / "training_efficiency_fit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    update_fit_doc(out)
    return out


def _write(out: Path, rows: list[dict], *, complete: bool, free_plans: bool, summary: dict | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    result = {"summary": summary, "rows": rows, "complete": complete, "free_plans": free_plans}
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def _resumed_rows(out: Path, args: argparse.Namespace) -> list[dict]:
    """With --resume, the rows of an unfinished earlier run of the same kind (free plans or not)."""
    if not args.resume or not out.exists():
        return []
    previous = json.loads(out.read_text())
    if previous.get("complete", True) or previous.get("free_plans") != (not args.no_free):
        print(f"nothing to resume in {out}: it is complete or was run {'with' if args.no_free else 'without'} "
              "free plans", flush=True)
        return []
    print(f"resuming: {len(previous['rows'])} rows kept from {out}", flush=True)
    return previous["rows"]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="rows whose name contains this text")
    ap.add_argument("--no-free", action="store_true", help="skip the free planner's reference plans")
    ap.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    ap.add_argument("--fit", action="store_true", help="fit the training efficiency per device class instead")
    ap.add_argument("--free-time-limit", type=float, default=120.0, metavar="SEC",
                    help="time limit of each free-planner reference search (default 120 s; the gap is shown)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of an earlier run that was cut short and price only the rest")
    ap.add_argument("--fp8-rows", action="store_true",
                    help="only the rows priced in FP8, each also without FP8; writes their JSON and docs block")
    ap.add_argument("--csv", action="append", type=Path, default=[], metavar="FILE",
                    help="price the rows of this table (published_runs.csv's columns) instead, as out-of-sample "
                         "rows; repeatable")
    ap.add_argument("--moe-rows", action="store_true",
                    help="price the published mixture-of-experts runs of tests/published_moe_reference.py instead "
                         "(out of sample; bench/results/published_moe_runs.json)")
    ap.add_argument("--output", type=Path, metavar="JSON",
                    help="with --csv: where the JSON goes (default bench/results/published_runs_<name>.json)")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.csv if not p.is_file()]
    if missing:
        ap.exit(2, f"published_runs.py: error: --csv {missing[0]}: no such file\n")
    if args.output is not None and not args.csv:
        ap.exit(2, "published_runs.py: error: --output goes with --csv (the committed tables have a fixed place)\n")
    if args.output is not None and any(args.output.resolve() == p.resolve() for p in args.csv):
        ap.exit(2, f"published_runs.py: error: --output {args.output} is one of the --csv tables; name another file\n")
    if args.moe_rows and (args.csv or args.fit or args.fp8_rows):
        ap.exit(2, "published_runs.py: error: --moe-rows prices its own rows; it does not combine with --csv, --fit "
                   "or --fp8-rows\n")
    if args.csv and (args.fit or args.fp8_rows):
        ap.exit(2, "published_runs.py: error: --csv prices rows; it does not combine with --fit or --fp8-rows\n")
    return args


def _runs_and_output(args: argparse.Namespace) -> tuple[list[PublishedRun], Path, bool]:
    """The rows to price, where their JSON goes, and whether they are the committed tables (which also update the
    docs)."""
    if args.moe_rows:
        sys.path.insert(0, str(ROOT / "tests"))
        from published_moe_reference import nemo_moe_runs

        return nemo_moe_runs(), ROOT / "bench" / "results" / "published_moe_runs.json", False
    if not args.csv:
        return all_runs(), ROOT / "bench" / "results" / "published_runs.json", True
    runs = [run for path in args.csv for run in load_published_runs(path, out_of_sample=True)]
    out = args.output or ROOT / "bench" / "results" / f"published_runs_{args.csv[0].stem}.json"
    return runs, out, False


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    if args.fp8_rows:
        fp8_rows([r for r in all_runs() if args.only.lower() in r.name.lower()])
        return 0
    if args.fit:
        fit([r for r in all_runs() if args.only.lower() in r.name.lower() and r.precision == "bf16"
             and not r.out_of_sample])
        return 0
    runs, out, committed = _runs_and_output(args)
    if not runs:
        print("published_runs.py: error: no row of the --csv tables could be read (see above)", file=sys.stderr)
        return 2
    rows, chains = _resumed_rows(out, args), {}
    done = {r["run"] for r in rows}
    for run in runs:
        if args.only.lower() not in run.name.lower() or run.name in done:
            continue
        started = time.monotonic()
        try:
            pred = predict(run, chains)
        except Exception as e:  # one row the planner cannot price must not end the bench for the others
            print(f"{run.name[:48]:48s} not priced: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        free_s, free_label = ((None, "") if args.no_free
                              else free_plan(run, chains, pred.breakdown, args.free_time_limit))
        err = pred.step_s / run.measured_step_s - 1
        mem_err = (pred.memory_gib / run.measured_memory_gib - 1) if run.measured_memory_gib else None
        rows.append({"run": run.name, "gpus": run.num_gpus, "device": run.device, "counts": run.counts,
                     "measured_step_s": run.measured_step_s, "predicted_step_s": pred.step_s, "error": err,
                     "measured_memory_gib": run.measured_memory_gib, "predicted_memory_gib": pred.memory_gib,
                     "memory_error": mem_err, "predicted_mfu": pred.mfu, "strategy": pred.strategy,
                     "planner_chose": pred.chosen, "inferred": list(run.inferred), "free_step_s": free_s,
                     "free_strategy": free_label, "free_over_expert": free_s / pred.step_s if free_s else None,
                     "precision": run.precision, "out_of_sample": run.out_of_sample,
                     "seconds": time.monotonic() - started,
                     "priced_in": f"fp8 {run.runtime.fp8.value}" if run.runtime.fp8 is not None else "bf16"})
        r = rows[-1]
        if not args.json:
            mem = f"{r['predicted_memory_gib']:.1f}/{run.measured_memory_gib:.1f} ({mem_err:+.0%})" if mem_err is not None else "-"
            free = f"{r['free_over_expert']:.2f}" if free_s else "-"
            print(f"{run.name[:48]:48s} {run.measured_step_s:8.3f} {pred.step_s:8.3f} {err:+7.1%}  mem {mem:22s} "
                  f"mfu {pred.mfu:5.1%} free/exp {free:5s} | {pred.strategy} | free: {free_label}", flush=True)
        if not args.only:  # each row as it finishes: a run cut short keeps what it measured (--resume)
            _write(out, rows, complete=False, free_plans=not args.no_free)
    order = {run.name: i for i, run in enumerate(runs)}  # resumed rows back in the tables' order
    rows.sort(key=lambda r: order.get(r["run"], len(order)))
    summary = _summary(rows)
    result = {"summary": summary, "rows": rows, "complete": True, "free_plans": not args.no_free}
    if not args.only:
        _write(out, rows, complete=True, free_plans=not args.no_free, summary=summary)
        if not args.no_free and committed:
            update_doc(result)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        memory = summary["mean_abs_memory_error"]
        print(f"\nmean |error| {summary['mean_abs_error']:.1%}, worst {summary['max_abs_error']:.1%}; "
              f"memory mean |error| {'-' if memory is None else f'{memory:.1%}'}")
        if summary.get("out_of_sample_rows"):
            print(f"out of sample: mean |error| {summary['out_of_sample_mean_abs_error']:.1%}, worst "
                  f"{summary['out_of_sample_max_abs_error']:.1%} over {summary['out_of_sample_rows']} rows")
    return 0


def _summary(rows: list[dict]) -> dict:
    """Mean and worst error of the calibration rows (bf16, fitted) and, apart, of the out-of-sample rows; FP8 rows
    are reported, not averaged."""
    bf16 = [r for r in rows if r.get("precision", "bf16") == "bf16"] or rows
    priced = [r for r in bf16 if not r.get("out_of_sample")] or bf16
    errs = [abs(r["error"]) for r in priced]
    mems = [abs(r["memory_error"]) for r in priced if r["memory_error"] is not None]
    summary = {"rows": len(priced), "mean_abs_error": sum(errs) / len(errs), "max_abs_error": max(errs),
               "mean_abs_memory_error": sum(mems) / len(mems) if mems else None}
    held = [abs(r["error"]) for r in bf16 if r.get("out_of_sample")]
    if held and len(held) < len(bf16):
        summary.update(out_of_sample_rows=len(held), out_of_sample_mean_abs_error=sum(held) / len(held),
                       out_of_sample_max_abs_error=max(held))
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
