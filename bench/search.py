"""Search time of the planner against layer count and device count.

    python bench/search.py            # every sweep
    python bench/search.py layers     # one of them: layers | devices | moe | main | targets

Layer sweep: a GPT-3 13B-wide model (hidden 5120, 40 heads, seq 2048) with 24 .. 128 layers on 16 x 8 A100-80GB,
global batch 512. Device sweep: GPT-3 13B (40 layers) on 1 .. 512 nodes of 8 A100-80GB (8 .. 4096 devices),
global batch 4096. MoE rows: transformers' DeepSeek-V3 (671B, its config class's defaults) on 256 x 8 H100 with a
global batch of 4096 sequences of 4096, and Qwen3-235B-A22B (its published config set on `Qwen3MoeConfig`) on
32 x 8 H100, batch 1024 x 4096; the target is 15 s end to end (trace + search). Each search runs in this process
after the model is traced (trace time is reported apart), proven optimal (no gap), the way the planner traces it: in bfloat16, and with
the first layers only when they repeat (`planner.tracing.trace_built`).

What keeps growth in layer count small is layer-class reuse: the 24 .. 128 blocks are one class, so the sharding
ILP runs once per (tp, sp, micro-batch) key whatever the depth -- the "ILP solves" column stays flat, while a
planner that solved every layer would need ``segments x keys`` solves ("without reuse", computed, not run).
Stage partitions also reuse per-class-composition prices, so the partition work grows with the number of
distinct stage compositions, not with all (start, stop) pairs.

Main rows: the main job (`stratagem plan gpt3-175b --cluster 128x8xa100-80gb --batch 1536`) searched as the CLI
searches it -- the trace from the trace cache, the error band's tie proof (`SearchOptions.tie_band`), the default
1% gap (`DEFAULT_RELATIVE_GAP`), no time limit -- with the search's wall and CPU time (the box is shared: CPU time is the steadier figure).

Target rows (`targets`): each plan of the search-speed targets run as a user runs it, `stratagem plan ... --json` in
a fresh process with an empty trace cache (start-up, model build and tracing included; the default 60 s time limit,
1% gap and tie band), its wall time against the target, and the solver's status and gap; then, from the trace cache the
first plan filled, a second plan of the same model for another batch and for another cluster, and `stratagem
replan` of the main plan onto `examples/clusters/stragglers-1024.yaml` (two throttled GPUs, one failed).

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
from planner.tracing import trace_built

RESULTS = Path(__file__).resolve().parent / "results" / "search.json"
WIDE = ["hidden=5120", "heads=40", "vocab=51200", "seq=2048"]


QWEN3_235B = {"hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
              "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
              "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
              "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": False}
"""Qwen3-235B-A22B's config.json (Qwen/Qwen3-235B-A22B on the Hugging Face hub); saved with Qwen3MoeConfig and
planned as `hf:FOLDER` (head_dim is a config.json field that the config class takes but does not declare)."""


def qwen3_235b_folder() -> str:
    import tempfile

    import transformers

    folder = tempfile.mkdtemp(prefix="qwen3-235b-a22b-")
    transformers.Qwen3MoeConfig(**QWEN3_235B).save_pretrained(folder)
    return f"hf:{folder}"


def run_one(sets: list[str], cluster: str, batch: int, model: str = "gpt", seq: int | None = None) -> dict:
    started = time.perf_counter()
    built = build_model(model, sets, batch=1, seq=seq, device="meta")
    chain = ir.build_layer_chain(trace_built(built))
    traced = time.perf_counter()
    result = search(chain, Cluster.parse(cluster), global_batch=batch)
    done = time.perf_counter()
    best = result.best
    keys = len({(r.candidate.mesh.tp, r.candidate.sequence_parallel, r.candidate.microbatch_size)
                for r in result.ranked}) or 1
    classes = chain.num_classes
    return {
        "model": model, "cluster": cluster, "devices": Cluster.parse(cluster).num_devices, "batch": batch,
        "settings": sets, "segments": len(chain.segments), "layer_classes": classes,
        "trace_s": round(traced - started, 3), "search_s": round(done - traced, 3),
        "candidates_solved": result.candidates, "candidates_pruned": result.pruned,
        "ilp_solves": result.layer_solves,
        "ilp_solves_without_reuse": result.layer_solves // max(classes, 1) * len(chain.segments),
        "step_time_s": best.estimate.step_time_s, "status": result.status,
        "plan": best.candidate.label, "keys_in_top": keys,
    }


def run_planned(model: str, cluster: str, batch: int) -> dict:
    """One plan as `stratagem plan` searches it (module docstring), timed in wall and CPU seconds."""
    from costmodel.validation import error_band
    from planner.search.outcome import DEFAULT_RELATIVE_GAP, SearchOptions
    from planner.trace_cache import TraceCache
    from planner.tracing import trace_model

    started = time.perf_counter()
    chain = trace_model(model, [], cache=TraceCache.default()).chain
    traced, cpu = time.perf_counter(), time.process_time()
    parsed = Cluster.parse(cluster)
    options = SearchOptions(tie_band=error_band(g.device for g in parsed.groups), relative_gap=DEFAULT_RELATIVE_GAP)
    result = search(chain, parsed, global_batch=batch, options=options)
    done, cpu_done = time.perf_counter(), time.process_time()
    return {"model": model, "cluster": cluster, "devices": parsed.num_devices, "batch": batch,
            "trace_s": round(traced - started, 3), "search_s": round(done - traced, 3),
            "search_cpu_s": round(cpu_done - cpu, 3), "candidates_solved": result.candidates,
            "candidates_pruned": result.pruned, "status": result.status,
            "step_time_s": result.best.estimate.step_time_s, "plan": result.best.candidate.label,
            "fastest_step_time_s": result.fastest}


def sweep_main() -> list[dict]:
    return [run_planned("gpt3-175b", "128x8xa100-80gb", 1536)]


def sweep_layers() -> list[dict]:
    return [run_one([f"layers={n}", *WIDE], "16x8xa100-80gb", 512) for n in (24, 48, 64, 96, 128)]


def sweep_devices() -> list[dict]:
    return [run_one(["layers=40", *WIDE], f"{nodes}x8xa100-80gb", 4096) for nodes in (1, 8, 64, 512)]


def sweep_moe() -> list[dict]:
    return [run_one([], "256x8xh100-sxm", 4096, model="hf:deepseek_v3", seq=4096),
            run_one([], "32x8xh100-sxm", 1024, model=qwen3_235b_folder(), seq=4096)]


TARGETS = (
    # (model, cluster, batch, seq, target seconds end to end)
    ("gpt3-175b", "128x8xa100-80gb", 1536, None, 5.0),
    ("gpt3-175b", "examples/clusters/two-datacenters.yaml", 1536, 2048, 15.0),
    ("gpt3-175b", "examples/clusters/mixed-a100-v100-1024.yaml", 1536, None, 15.0),
    ("gpt3-175b", "examples/clusters/stragglers-1024.yaml", 1536, None, 15.0),
    ("llama3-405b", "2048x8xh100-sxm", 2048, 8192, 10.0),
    ("gpt-1t", "384x8xa100-80gb", 1536, None, 10.0),
    ("mixtral-8x7b", "64x8xh100-sxm", 1024, None, 10.0),
)
"""The search-speed targets (end to end, tracing included)."""
SECOND_CALL_TARGET_S = 2.0


def run_cli(args: list[str], cache: Path) -> dict:
    """`stratagem ARGS --json --trace-cache CACHE` in a fresh process: wall seconds and the search record."""
    import subprocess

    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "planner.cli.main", *args, "--json", "--trace-cache", str(cache)],
                          capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1])
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        return {"command": " ".join(args), "wall_s": round(wall, 2), "error": proc.stderr.strip()[-300:]}
    out = json.loads(proc.stdout)
    plan = out.get("plan", out)
    search_info = plan.get("search") or {}
    return {"command": " ".join(args), "wall_s": round(wall, 2), "status": search_info.get("status"),
            "gap": search_info.get("optimality_gap"), "search_s": search_info.get("time_s"),
            "candidates": search_info.get("candidates"),
            "step_time_s": plan.get("predicted", {}).get("step_time_s")}


def sweep_targets() -> list[dict]:
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as tmp:
        main_cache = Path(tmp) / "main"
        for i, (model, cluster, batch, seq, target) in enumerate(TARGETS):
            cache = main_cache if i == 0 else Path(tmp) / f"row{i}"
            args = ["plan", model, "--cluster", cluster, "--batch", str(batch), *(["--seq", str(seq)] if seq else [])]
            if i == 0:
                args += ["-o", str(Path(tmp) / "main-plan.json")]
            rows.append({**run_cli(args, cache), "target_s": target, "kind": "first plan"})
        model, cluster, batch, _, _ = TARGETS[0]
        for kind, args in (
                ("another batch", ["plan", model, "--cluster", cluster, "--batch", str(2 * batch)]),
                ("another cluster", ["plan", model, "--cluster", "64x8xa100-80gb", "--batch", str(batch)]),
                ("replan after stragglers", ["replan", str(Path(tmp) / "main-plan.json"), "--cluster",
                                             "examples/clusters/stragglers-1024.yaml"])):
            rows.append({**run_cli(args, main_cache), "target_s": SECOND_CALL_TARGET_S, "kind": kind})
    return rows


def print_table(title: str, rows: list[dict], key: str) -> None:
    print(title)
    print(f"  {key:>8} {'segments':>8} {'trace s':>8} {'search s':>9} {'solved':>7} {'pruned':>8} "
          f"{'ILP solves':>10} {'w/o reuse':>9}  {'step s':>8}  plan")
    for r in rows:
        print(f"  {r[key]:>8} {r['segments']:>8} {r['trace_s']:>8.2f} {r['search_s']:>9.2f} "
              f"{r['candidates_solved']:>7} {r['candidates_pruned']:>8} {r['ilp_solves']:>10} "
              f"{r['ilp_solves_without_reuse']:>9}  {r['step_time_s']:>8.3f}  {r['plan']}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["choices"]:  # what each schedule family, offload and FP8 buys (bench/plan_choices.py)
        import plan_choices

        return plan_choices.main(argv[1:])
    which = argv or ["layers", "devices", "moe", "main", "targets"]
    bad = [w for w in which if w not in ("layers", "devices", "moe", "main", "targets")]
    if bad:
        print(f"unknown sweep {bad[0]!r}; valid: layers, devices, moe, main, targets, choices", file=sys.stderr)
        return 2
    out: dict = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # sweeps not rerun keep their rows
    out.update({"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__})
    if "layers" in which:
        out["layers"] = rows = sweep_layers()
        for r in rows:
            r["layers"] = int(r["settings"][0].split("=")[1])
        print_table("search time vs layer count (GPT 13B-wide on 16x8 A100-80GB, batch 512)", rows, "layers")
    if "devices" in which:
        out["devices"] = rows = sweep_devices()
        print_table("search time vs device count (GPT-3 13B, batch 4096)", rows, "devices")
    if "moe" in which:
        out["moe"] = rows = sweep_moe()
        for r in rows:
            r["end_to_end_s"] = round(r["trace_s"] + r["search_s"], 3)
        print_table("MoE plans, end to end (target 15 s): DeepSeek-V3 on 2048 H100, Qwen3-235B-A22B on 256 H100",
                    rows, "devices")
        rows[1]["model"] = "Qwen3-235B-A22B"
        for r in rows:
            print(f"  {r['model']}: trace {r['trace_s']:.1f} s + search {r['search_s']:.1f} s = "
                  f"{r['end_to_end_s']:.1f} s")
    if "main" in which:
        out["main"] = rows = sweep_main()
        print("the main job as the CLI searches it (trace cache, tie band, no time limit)")
        for r in rows:
            print(f"  {r['model']} on {r['cluster']} batch {r['batch']}: load {r['trace_s']:.2f} s, search "
                  f"{r['search_s']:.2f} s wall / {r['search_cpu_s']:.2f} s CPU, {r['candidates_solved']} solved, "
                  f"{r['candidates_pruned']} pruned, {r['status']}: {r['plan']}")
    if "targets" in which:
        out["targets"] = rows = sweep_targets()
        print("search-speed targets, end to end as a user runs them (fresh process, empty trace cache first)")
        for r in rows:
            verdict = "error" if "error" in r else ("met" if r["wall_s"] <= r["target_s"] else "missed")
            detail = r.get("error") or (f"search {r['search_s']:.1f} s, {r['status']}, gap {r['gap']:.1%}, "
                                        f"{r['candidates']} candidates")
            print(f"  {r['kind']:24s} {r['wall_s']:6.1f} s (target {r['target_s']:4.1f} s, {verdict})  "
                  f"{r['command']}: {detail}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
