"""End-to-end time of `stratagem` with the trace cache: a first plan (traces), a second plan of the same model on
another cluster and with another batch, and a re-plan after a straggler (both read the cached trace).

    python bench/trace_cache.py                   # gpt3-13b and gpt3-175b
    python bench/trace_cache.py gpt3-13b          # one model

Every command is its own `stratagem` process (what a user waits for: start-up, imports, cache, search, printing)
in a fresh temporary cache folder. Wall time depends on the machine's load (this is a shared 2-core box), so the
table also gives the process's CPU time (user + system, children included). Prints a table and writes
bench/results/trace_cache.json.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "trace_cache.json"
SCENARIOS = {
    # model: (first cluster, batch), (other cluster), (other batch)
    "gpt3-13b": ("2x8xh100-sxm", 256, "4x8xa100-80gb", 512),
    "gpt3-175b": ("128x8xa100-80gb", 1536, "64x8xh100-sxm", 3072),
}


def timed(argv: list[str], cache: Path) -> dict:
    """Run `stratagem ARGV` once; wall and CPU seconds, exit code and the search line of its output."""
    exe = shutil.which("stratagem") or sys.executable
    cmd = [exe, *argv] if exe != sys.executable else [exe, "-m", "planner.cli.main", *argv]
    env = {**os.environ, "STRATAGEM_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    search = next((ln for ln in proc.stdout.splitlines() if ln.startswith("search:")), proc.stderr.strip()[-200:])
    return {"argv": argv, "exit": proc.returncode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "search": search}


def straggler_of(spec: str, folder: Path) -> Path:
    """The shorthand cluster `spec` with GPU 3 at half speed, as a cluster YAML (examples/clusters/README.md)."""
    nodes, gpus, device = spec.split("x", 2)
    path = folder / f"{spec}-straggler.yaml"
    path.write_text(f"name: {spec}-straggler\ngroups:\n  - device: {device}\n    num_nodes: {nodes}\n"
                    f"    devices_per_node: {gpus}\n    slowdown:\n      3: 0.5\n")
    return path


def run_model(model: str, folder: Path) -> list[dict]:
    first_cluster, batch, other_cluster, other_batch = SCENARIOS[model]
    plan = folder / f"{model}.json"
    cache = folder / "cache"
    straggler = straggler_of(first_cluster, folder)
    steps = [
        ("first plan (traces)", ["plan", model, "--cluster", first_cluster, "--batch", str(batch), "-o", str(plan)]),
        ("another cluster (cached)", ["plan", model, "--cluster", other_cluster, "--batch", str(batch)]),
        ("another batch (cached)", ["plan", model, "--cluster", first_cluster, "--batch", str(other_batch)]),
        ("replan after a straggler (cached)", ["replan", str(plan), "--cluster", str(straggler)]),
    ]
    return [{"model": model, "step": name, **timed(argv, cache)} for name, argv in steps]


def main(models: list[str]) -> None:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            rows += run_model(model, Path(tmp))
    print(f"{'model':<10} {'step':<36} {'wall s':>7} {'cpu s':>6}  search")
    for r in rows:
        print(f"{r['model']:<10} {r['step']:<36} {r['wall_s']:>7.2f} {r['cpu_s']:>6.2f}  {r['search'][:90]}")
    RESULTS.write_text(json.dumps({"machine": platform.platform(), "cpus": os.cpu_count(),
                                   "load_average": os.getloadavg(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:] or list(SCENARIOS))
