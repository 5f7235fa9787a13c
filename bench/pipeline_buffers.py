"""Pipeline buffers of torch.distributed.pipelining, measured against the memory model.

A stage that receives activations keeps a receive buffer for every micro-batch of the step, and a stage that
sends keeps a gradient-receive buffer for every micro-batch plus the outputs of those in flight
(`costmodel.memory`, "Pipeline buffers"). So a stage's peak grows with the number of micro-batches m even where
the micro-batches in flight, and so the saved activations, do not. This runs one pipeline-parallel strategy of a
small GPT with `planner.runtime.parallelize` on CPU ranks under torchrun at two values of m, measures each stage's
peak live tensor bytes the way `bench/fidelity.py` does (its worker runs the plans), and prints them beside the
model's prediction with the buffers and without them (`RuntimeOptions.p2p_transient_buffers`, as Megatron-LM
frees them). Then the largest m again with the schedule asked for its outputs (`return_outputs=True`, as torchtitan
calls it: `RuntimeOptions.pp_returns_outputs`), where the last stage keeps every micro-batch's logits.

Usage: python bench/pipeline_buffers.py [--set hidden=512 ...] [--microbatches 4,16] [--json]
Writes bench/results/pipeline_buffers.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import fidelity  # noqa: E402 -- the worker that runs and measures plans

RESULTS = ROOT / "bench" / "results" / "pipeline_buffers.json"
CLUSTER = "1x2xcpu"
DEFAULT_SETS = ("hidden=512", "heads=8", "layers=4", "seq=1024")
MIB = 2 ** 20


def _strategy_plan(chain: Any, m: int, returns: bool) -> tuple[dict[str, Any], list[int], list[int]]:
    """The plan of pp2 1F1B with m micro-batches of 1 (the schedule asked for its outputs if `returns`), and per
    stage its predicted bytes (without the fixed framework overhead, as `bench/fidelity.py` compares) with the
    buffers and with them freed per transfer."""
    from costmodel.estimate import estimate
    from costmodel.hardware.cluster import Cluster
    from costmodel.strategy import Recompute, RuntimeOptions, Schedule
    from planner.search.branch_and_bound import SearchOptions, search
    from planner.search.space import SearchSpace

    cluster = Cluster.parse(CLUSTER)
    space = SearchSpace(dp=1, tp=1, pp=2, microbatch_size=1, num_microbatches=m, schedule=Schedule.ONE_F_ONE_B,
                        virtual_stages=1, zero_stage=0, sequence_parallel=False, recompute=Recompute.NONE,
                        runtime=RuntimeOptions(pp_returns_outputs=returns))
    ranked = search(chain, cluster, global_batch=m, space=space, dtype=fidelity.DTYPE,
                    options=SearchOptions(num_alternatives=0)).best
    st = ranked.strategy
    freed = estimate(chain, cluster, dataclasses.replace(
        st, runtime=dataclasses.replace(st.runtime, p2p_transient_buffers=True)), dtype=fidelity.DTYPE)

    def tensors(stages: Sequence[Any]) -> list[int]:
        return [s.memory.total - s.memory.overhead for s in stages]

    return fidelity._plan_of(ranked, chain, cluster, m), tensors(ranked.estimate.stages), tensors(freed.stages)


def _measure(chain: Any, plan: dict[str, Any], sets: Sequence[str], m: int, work: Path, name: str) -> list[int]:
    plans, out = work / f"plans-{name}.json", work / f"results-{name}.jsonl"
    plans.write_text(json.dumps({"graph": chain.graph.to_json(), "sets": list(sets), "batch": m,
                                 "cases": [{"id": f"m{m}", "plan": plan}]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "bench" / "fidelity.py"), "--worker", str(plans), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"torchrun failed for m={m}:\n{proc.stderr[-3000:]}")
    row = json.loads(out.read_text().splitlines()[0])
    if "error" in row:
        raise SystemExit(f"m={m}: {row['error']}")
    return [int(x) for x in row["memory_bytes"]]


def run(sets: Sequence[str], microbatches: Sequence[int]) -> dict[str, Any]:
    chain = fidelity._trace_chain(sets)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m, returns in [*((m, False) for m in microbatches), (microbatches[-1], True)]:
            plan, with_buffers, freed = _strategy_plan(chain, m, returns)
            measured = _measure(chain, plan, sets, m, Path(tmp), f"{m}-{returns}")
            rows.append({"microbatches": m, "returns_outputs": returns, "measured_bytes": measured,
                         "predicted_bytes": with_buffers, "predicted_without_buffers_bytes": freed})
    return {"model": fidelity.MODEL, "settings": list(sets), "cluster": CLUSTER, "dtype": fidelity.DTYPE,
            "strategy": "dp1 tp1 pp2 1f1b, micro-batches of 1, no recomputation",
            "memory_measure": "peak live tensor bytes per stage, as bench/fidelity.py measures it", "rows": rows}


def table(report: dict[str, Any]) -> str:
    lines = ["| micro-batches | outputs returned | stage | measured MiB | predicted MiB (error) | without buffers MiB "
             "(error) |", "|---|---|---|---|---|---|"]
    for row in report["rows"]:
        for k, (meas, pred, freed) in enumerate(zip(row["measured_bytes"], row["predicted_bytes"],
                                                    row["predicted_without_buffers_bytes"], strict=True)):
            lines.append(f"| {row['microbatches']} | {'yes' if row['returns_outputs'] else 'no'} | {k} | "
                         f"{meas / MIB:.1f} | {pred / MIB:.1f} "
                         f"({(pred - meas) / meas:+.1%}) | {freed / MIB:.1f} ({(freed - meas) / meas:+.1%}) |")
    plain = [r for r in report["rows"] if not r["returns_outputs"]]
    first, last, returned = plain[0], plain[-1], report["rows"][-1]
    lines.append("")
    for name in ("measured_bytes", "predicted_bytes", "predicted_without_buffers_bytes"):
        growth = [(b - a) / MIB for a, b in zip(first[name], last[name], strict=True)]
        lines.append(f"growth from {first['microbatches']} to {last['microbatches']} micro-batches, "
                     f"{name.removesuffix('_bytes').replace('_', ' ')}: "
                     + ", ".join(f"stage {k} {g:+.2f} MiB" for k, g in enumerate(growth)))
    for name in ("measured_bytes", "predicted_bytes"):
        more = [(b - a) / MIB for a, b in zip(last[name], returned[name], strict=True)]
        lines.append(f"outputs returned at {last['microbatches']} micro-batches, {name.removesuffix('_bytes')}: "
                     + ", ".join(f"stage {k} {g:+.2f} MiB" for k, g in enumerate(more)))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", action="append", dest="sets", metavar="KEY=VALUE",
                        help=f"gpt-tiny settings (default {' '.join(DEFAULT_SETS)})")
    parser.add_argument("--microbatches", default="4,16", help="micro-batch counts to compare (default 4,16)")
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.microbatches.split(",")]
    except ValueError:
        parser.error(f"--microbatches takes integers separated by commas, got {args.microbatches!r}")
    if len(counts) < 2 or min(counts) < 2:
        parser.error("--microbatches needs two or more counts of at least 2 (pp2 with 1F1B)")
    report = run(tuple(args.sets or DEFAULT_SETS), counts)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
