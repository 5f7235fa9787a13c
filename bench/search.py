"""Search time of the planner against layer count and device count.

    python bench/search.py            # both sweeps
    python bench/search.py layers     # one of them: layers | devices

Layer sweep: a GPT-3 13B-wide model (hidden 5120, 40 heads, seq 2048) with 24 .. 128 layers on 16 x 8 A100-80GB,
global batch 512. Device sweep: GPT-3 13B (40 layers) on 1 .. 512 nodes of 8 A100-80GB (8 .. 4096 devices),
global batch 4096. Each search runs in this process after the model is traced (trace time is reported apart).

What keeps growth in layer count small is layer-class reuse: the 24 .. 128 blocks are one class, so the sharding
ILP runs once per (tp, sp, micro-batch) key whatever the depth -- the "ILP solves" column stays flat, while a
planner that solved every layer would need ``segments x keys`` solves ("without reuse", computed, not run).
Stage partitions also reuse per-class-composition prices, so the partition work grows with the number of
distinct stage compositions, not with all (start, stop) pairs.

Prints a table and writes bench/results/search.json (machine, torch version, and per run: layers / devices,
segments, trace s, search s, candidates solved, candidates pruned, ILP solves, predicted step time and plan).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

import ir
from costmodel.hardware.cluster import Cluster
from models.registry import build_model
from planner.search.branch_and_bound import search

RESULTS = Path(__file__).resolve().parent / "results" / "search.json"
WIDE = ["hidden=5120", "heads=40", "vocab=51200", "seq=2048"]


def run_one(sets: list[str], cluster: str, batch: int) -> dict:
    started = time.perf_counter()
    built = build_model("gpt", sets, batch=1, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=built.name))
    traced = time.perf_counter()
    result = search(chain, Cluster.parse(cluster), global_batch=batch)
    done = time.perf_counter()
    best = result.best
    keys = len({(r.candidate.mesh.tp, r.candidate.sequence_parallel, r.candidate.microbatch_size)
                for r in result.ranked}) or 1
    classes = chain.num_classes
    return {
        "cluster": cluster, "devices": Cluster.parse(cluster).num_devices, "batch": batch,
        "settings": sets, "segments": len(chain.segments), "layer_classes": classes,
        "trace_s": round(traced - started, 3), "search_s": round(done - traced, 3),
        "candidates_solved": result.candidates, "candidates_pruned": result.pruned,
        "ilp_solves": result.layer_solves,
        "ilp_solves_without_reuse": result.layer_solves // max(classes, 1) * len(chain.segments),
        "step_time_s": best.estimate.step_time_s, "status": result.status,
        "plan": best.candidate.label, "keys_in_top": keys,
    }


def sweep_layers() -> list[dict]:
    return [run_one([f"layers={n}", *WIDE], "16x8xa100-80gb", 512) for n in (24, 48, 64, 96, 128)]


def sweep_devices() -> list[dict]:
    return [run_one(["layers=40", *WIDE], f"{nodes}x8xa100-80gb", 4096) for nodes in (1, 8, 64, 512)]


def print_table(title: str, rows: list[dict], key: str) -> None:
    print(title)
    print(f"  {key:>8} {'segments':>8} {'trace s':>8} {'search s':>9} {'solved':>7} {'pruned':>8} "
          f"{'ILP solves':>10} {'w/o reuse':>9}  {'step s':>8}  plan")
    for r in rows:
        print(f"  {r[key]:>8} {r['segments']:>8} {r['trace_s']:>8.2f} {r['search_s']:>9.2f} "
              f"{r['candidates_solved']:>7} {r['candidates_pruned']:>8} {r['ilp_solves']:>10} "
              f"{r['ilp_solves_without_reuse']:>9}  {r['step_time_s']:>8.3f}  {r['plan']}")


def main(argv: list[str]) -> int:
    which = argv or ["layers", "devices"]
    bad = [w for w in which if w not in ("layers", "devices")]
    if bad:
        print(f"unknown sweep {bad[0]!r}; valid: layers, devices", file=sys.stderr)
        return 2
    out: dict = {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__}
    if "layers" in which:
        out["layers"] = rows = sweep_layers()
        for r in rows:
            r["layers"] = int(r["settings"][0].split("=")[1])
        print_table("search time vs layer count (GPT 13B-wide on 16x8 A100-80GB, batch 512)", rows, "layers")
    if "devices" in which:
        out["devices"] = rows = sweep_devices()
        print_table("search time vs device count (GPT-3 13B, batch 4096)", rows, "devices")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
