"""Trace time and peak memory of the planner's trace (`planner.tracing.trace_built`) + `ir.build_layer_chain`
for the zoo presets, against tracing every layer (`ir.trace` of the whole model).

    python bench/trace.py                      # every preset
    python bench/trace.py gpt3-175b llama3-8b  # some

Each model runs in a fresh Python process (so peak RSS, `ru_maxrss`, is that model's alone and includes torch
itself); models are built on the meta device at batch 1 and their default sequence length, and traced in
bfloat16 as `stratagem trace` does. A model whose layers repeat is traced with its first layers and the rest
are copied (`models.layer_stack`, `ir.layer_repeat`); `full` is the time to trace every layer, measured after
in the same process (so it, not the planner's trace, gets torch's warm caches), and `same` says whether both
graphs have one fingerprint. Prints a table and writes bench/results/trace.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "trace.json"


def measure_one(name: str) -> dict:
    """Build, trace and cut one model in this process; times in seconds, memory in bytes."""
    start = time.perf_counter()
    import ir
    from models.registry import build_model
    from planner.tracing import trace_built

    imported = time.perf_counter()
    built = build_model(name, batch=1, device="meta")
    built_at = time.perf_counter()
    graph = trace_built(built, dtype="bfloat16")
    traced = time.perf_counter()
    chain = ir.build_layer_chain(graph)
    done = time.perf_counter()
    stand_in = built.trace_stand_in() if built.trace_stand_in is not None else None
    full = ir.trace(built.module, built.example_inputs, model_name=name, dtype="bfloat16")
    full_s = time.perf_counter() - done
    return {
        "model": name,
        "params": graph.param_count,
        "nodes": len(graph.nodes),
        "layers": len(chain.segments),
        "classes": chain.num_classes,
        "tracer": graph.tracer,
        "import_s": imported - start,
        "build_s": built_at - imported,
        "trace_s": traced - built_at,
        "chain_s": done - traced,
        "traced_layers": stand_in.pattern.traced if stand_in is not None else None,
        "full_trace_s": full_s,
        "same_graph": ir.fingerprint(full) == ir.fingerprint(graph),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def run_isolated(name: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"model": name, "error": last}
    return json.loads(proc.stdout)


def preset_names() -> list[str]:
    from models.registry import EntryKind, list_models

    return [e.name for e in list_models() if e.kind is EntryKind.PRESET]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--one"]:
        print(json.dumps(measure_one(argv[1])))
        return 0
    names = argv or preset_names()
    header = f"{'model':14s} {'params':>9s} {'nodes':>6s} {'layers':>6s} {'classes':>7s} {'build':>7s} " \
             f"{'trace':>7s} {'chain':>7s} {'traced':>6s} {'full':>7s} {'same':>5s} {'peak RSS':>9s}"
    print(header)
    print("-" * len(header))
    rows = []
    for name in names:
        row = run_isolated(name)
        rows.append(row)
        if "error" in row:
            print(f"{name:14s} FAILED: {row['error']}")
            continue
        print(f"{name:14s} {row['params'] / 1e9:8.2f}B {row['nodes']:6d} {row['layers']:6d} {row['classes']:7d} "
              f"{row['build_s']:6.2f}s {row['trace_s']:6.2f}s {row['chain_s']:6.2f}s "
              f"{row['traced_layers'] or '-'!s:>6s} {row['full_trace_s']:6.2f}s {'yes' if row['same_graph'] else 'NO':>5s} "
              f"{row['peak_rss_bytes'] / 2**30:7.2f}GiB", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    import torch

    machine = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
               "platform": platform.platform()}
    RESULTS.write_text(json.dumps({"machine": machine, "results": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {RESULTS}")
    return 1 if any("error" in r or not r["same_graph"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
