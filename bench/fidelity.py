"""Fidelity benchmark: the cost model's predicted step time and peak memory against measured runs on this machine.

For a small GPT (the zoo's `gpt-tiny`) trained in float32 with AdamW on the CPU clusters `1x2xcpu` and `1x4xcpu`
(2 and 4 processes over gloo on this machine's cores):

1. Profile (`planner.profiling.ops`): the model's ops timed in as many concurrent processes as the cluster has ranks,
   at every micro-batch size and tensor-parallel shard the planner prices (median of repeats: the speed of a rank
   with a core to itself -- other users of this shared machine preempt single runs, not the median), and the
   collectives of groups of every size dividing the process count with all groups running at once; fitted
   alpha/beta calibrate the node tier, per collective kind (`costmodel.hardware.collective_fit.calibrated_cluster`); and
   the framework overheads (`planner.profiling.framework`: optimizer per tensor, FSDP2 / replicate units, pipeline
   actions, checkpointing, tensor-parallel modules, partial-gradient syncs) in as many processes. The profile is
   saved as `bench/results/fidelity-profile-<N>proc.json`. The ranks share this machine's cores
   (`shared_cores`, a `DeviceGroup.host_cores`): a rank runs at min(1, cores / ranks busy at once), which
   pipeline bubbles lower.
2. Enumerate every valid strategy: each search candidate (dp x tp x pp mesh, micro-batch size and count,
   schedule with interleaving, ZeRO stage, sequence parallelism; `planner.search.branch_and_bound.enumerate_candidates`) times each
   recomputation mode, priced by the planner's search with every dimension pinned (which also solves the stage
   partition and the tensor-parallel sharding), with the profiled model and, for comparison, the analytical one.
3. Run each strategy with `planner.runtime.parallelize` + `planner.runtime.train_step` under torchrun, many strategies per launch:
   a warm-up step, a memory-profiled step, then `TIMED_STEPS` timed steps. Step time: the slowest rank's time
   per step, median over the timed steps. Peak memory: torch's CPU allocator accounting -- the bytes of every
   live tensor storage when the profiled (steady-state) step starts, plus the peak running sum of the allocation
   and free events `torch.profiler` records with `profile_memory=True` during it; max over the ranks of each
   pipeline stage. The prediction it is compared with is the model's per-stage peak without its fixed framework
   overhead (the Python runtime and torch itself are not tensors).
4. Report, per cluster and model: Spearman rank correlation and mean absolute percentage error of predicted
   against measured step time, mean absolute relative error of peak memory, and the regret of the planner's choice
   (measured time of the plan `planner.search.branch_and_bound.search` picks with that model / best measured time).

Usage: python bench/fidelity.py [--clusters 1x2xcpu,1x4xcpu] [--limit N] [--json]
       python bench/fidelity.py --from-results RESULTS.json [--repredict] [--output OUT.json] [--no-doc]
Writes bench/results/fidelity.json and the table in docs/fidelity.md (the numbers in that doc are this output).
Internal: `python -m torch.distributed.run ... bench/fidelity.py --worker PLANS.json RESULTS.jsonl`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the metrics live beside their tests
from fidelity_metrics import (  # noqa: E402
    Case,
    describe,
    peak_during,
    primary_error,
    strategy_key,
    summarize,
)

MODEL = "gpt-tiny"
SETS: tuple[str, ...] = ()
DTYPE = "float32"
"""`stratagem run` trains in float32 on CPU; the model is traced and priced in the same dtype."""
GLOBAL_BATCH = 4
"""Samples per step: micro-batch sizes 1, 2, 4 (the tensor-parallel strategies run eager DTensor ops, whose
per-op overhead makes every extra micro-batch expensive; 4 keeps the whole benchmark under 20 minutes)."""
TIMED_STEPS = 3
CONFIRM_TOP = 3
"""The fastest measured strategies timed again beside every model's choice (`confirm_contenders`)."""
CONFIRM_ROUNDS = 3
SEED = 0
LAUNCH_CHUNK = 48
"""Strategies per torchrun launch: amortizes its start-up, bounds what one crash loses."""
CASE_TIMEOUT_S = 75
"""A launch whose next strategy has not finished after this long (start-up included) is killed as hung."""
PROCESS_GROUP_TIMEOUT_S = 60
CONTROL_TIMEOUT_S = 8
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "fidelity.json"
DOC = ROOT / "docs" / "fidelity.md"
TARGETS = {"spearman": 0.8, "regret": 1.10, "memory_error": 0.20}


def _trace_chain(sets: Sequence[str] = SETS) -> Any:
    import ir
    from models.registry import build_model

    probe = build_model(MODEL, sets, batch=1, device="meta")
    graph = ir.trace(probe.module, probe.example_inputs, model_name=MODEL, dtype=DTYPE)
    return ir.build_layer_chain(graph)


def profile_path(nproc: int) -> Path:
    """Where the profile of an `nproc`-rank cluster is kept beside the results (`--repredict` reads it back)."""
    return RESULTS.parent / f"fidelity-profile-{nproc}proc.json"


def profile_cluster(nproc: int) -> Any:
    """Ops timed in `nproc` concurrent processes, collectives of every group size dividing `nproc`, and the
    framework overheads (`planner.profiling.framework`) on the same process count; saved to `profile_path`."""
    from costmodel.hardware.collective_fit import CollectiveProfile
    from costmodel.profile_db import OpProfile
    from planner.profiling.collectives import CollectiveOptions, measure_collectives
    from planner.profiling.framework import FrameworkOptions, measure_framework
    from planner.profiling.options import ProfileOptions
    from planner.profiling.requests import ModelRequest, profile_concurrently

    tps = tuple(t for t in range(1, nproc + 1) if nproc % t == 0)
    mbs = tuple(m for m in (1, 2, 4, 8) if m <= GLOBAL_BATCH)
    options = ProfileOptions(microbatch_sizes=mbs, tp_degrees=tps, dtype=DTYPE, warmup=2, repeats=9)
    ops = profile_concurrently([ModelRequest(MODEL, SETS)], concurrent=nproc, device_name="cpu", options=options)
    samples = measure_collectives(CollectiveOptions(processes=nproc, sizes=(4096, 65536, 1 << 20, 4 << 20),
                                                    repeats=9))
    framework = measure_framework(FrameworkOptions(processes=nproc))
    profile = OpProfile(entries={**ops.profile.entries, **framework.entries("cpu")}, meta=ops.profile.meta,
                        collectives=CollectiveProfile.from_samples(samples))
    path = profile_path(nproc)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    return profile, ops


def shared_cores(cluster: Any, cores: int | None = None) -> Any:
    """The cluster as this machine runs it: its ranks share this host's C cores (`DeviceGroup.host_cores`, what a
    cluster YAML can say too), so a rank computes at min(1, C / busy ranks) -- `1x4xcpu` on 2 cores runs data
    parallelism at half speed, but a 4-stage pipeline with one micro-batch one stage at a time, at full speed.
    The profile's ops are the speed of a rank with a core to itself (thread CPU time)."""
    cores = cores or os.cpu_count() or 1
    return dataclasses.replace(cluster, groups=tuple(dataclasses.replace(g, host_cores=cores)
                                                     for g in cluster.groups))


def _pinned_space(cand: Any, recompute: Any) -> Any:
    from planner.search.space import SearchSpace

    return SearchSpace(dp=cand.mesh.dp, tp=cand.mesh.tp, pp=cand.mesh.pp, microbatch_size=cand.microbatch_size,
                       num_microbatches=cand.num_microbatches, schedule=cand.schedule,
                       virtual_stages=cand.virtual_stages, zero_stage=cand.zero_stage,
                       sequence_parallel=cand.sequence_parallel, recompute=recompute)


def _plan_of(ranked: Any, chain: Any, cluster: Any, batch: int = GLOBAL_BATCH) -> dict[str, Any]:
    import ir
    from planner.plan import ModelInfo, Plan, SearchInfo, TrainingConfig

    graph = chain.graph
    plan = Plan(model=ModelInfo(name=MODEL, fingerprint=ir.fingerprint(graph), params=graph.param_count),
                cluster=cluster.to_dict(),
                training=TrainingConfig(global_batch=batch, seq_len=graph.seq_len, dtype=DTYPE,
                                        optimizer="adamw"),
                strategy=ranked.strategy, sharding=ranked.sharding, predicted=ranked.estimate,
                search=SearchInfo(time_s=0.0, candidates=1, status="fixed", optimality_gap=0.0,
                                  lower_bound_s=ranked.estimate.step_time_s))
    return plan.to_dict()


def _prediction(ranked: Any) -> dict[str, Any]:
    est = ranked.estimate
    return {"step_time_s": est.step_time_s,
            "memory_bytes": [s.memory.total - s.memory.overhead for s in est.stages],
            "memory_breakdown": [s.memory.to_dict() for s in est.stages],
            "breakdown": est.breakdown.to_dict()}


def enumerate_cases(chain: Any, spec: str, profile: Any, limit: int | None) -> tuple[list[Case], dict[str, Any]]:
    """Every valid strategy on `spec`, priced by the profiled and the analytical model, plus each model's choice."""
    from costmodel.hardware.cluster import Cluster
    from costmodel.hardware.collective_fit import calibrated_cluster
    from costmodel.strategy import Recompute
    from planner.search.branch_and_bound import SearchOptions, search
    from planner.search.candidates import enumerate_candidates
    from planner.search.layer_costs import LayerCostTable
    from planner.search.space import Objective, SearchSpace

    base = Cluster.parse(spec)
    models = {"profiled": (shared_cores(calibrated_cluster(base, profile.collectives)), profile),
              "analytical": (base, None)}
    tables = {name: LayerCostTable(chain, cl, dtype=DTYPE, profile=prof) for name, (cl, prof) in models.items()}
    quiet = SearchOptions(num_alternatives=0)
    cands, _ = enumerate_candidates(chain, base, GLOBAL_BATCH, SearchSpace(), Objective.TIME)
    # The benchmark runs one process per device of the cluster: strategies on fewer devices are not measured.
    cands = [c for c in cands if c.mesh.num_devices == base.num_devices]
    by_key: dict[tuple[Any, ...], dict[str, Any]] = {}
    plans: dict[tuple[Any, ...], dict[str, Any]] = {}
    for cand in cands:
        for rc in Recompute:
            space = _pinned_space(cand, rc)
            for name, (cluster, prof) in models.items():
                try:
                    ranked = search(chain, cluster, global_batch=GLOBAL_BATCH, space=space, dtype=DTYPE,
                                    profile=prof, table=tables[name], options=quiet).best
                except Exception:  # noqa: BLE001 -- a pinned strategy that does not fit: not a valid strategy
                    continue
                key = strategy_key(ranked.strategy)
                by_key.setdefault(key, {})[name] = _prediction(ranked)
                if name == "profiled":
                    plans.setdefault(key, _plan_of(ranked, chain, base))
    choices = {}
    for name, (cluster, prof) in models.items():
        # The search's own choice (it may use fewer devices), and the best strategy on all of them, which is
        # the planner's choice among what this benchmark runs (same formulas: the search's objective is estimate).
        best = search(chain, cluster, global_batch=GLOBAL_BATCH, dtype=DTYPE, profile=prof, table=tables[name]).best
        key = strategy_key(best.strategy)
        if best.strategy.num_devices == base.num_devices and key not in plans:
            plans[key] = _plan_of(best, chain, base)  # a per-stage recompute mix the pinned searches did not try
            by_key.setdefault(key, {})[name] = _prediction(best)
        full = min((k for k in plans if name in by_key[k]), key=lambda k: by_key[k][name]["step_time_s"])
        choices[name] = {"search_choice": describe(key), "search_choice_devices": best.strategy.num_devices,
                         "search_predicted_step_time_s": best.estimate.step_time_s,
                         "key": list(full), "strategy": describe(full),
                         "predicted_step_time_s": by_key[full][name]["step_time_s"]}
    keys = sorted(k for k in plans if "profiled" in by_key[k] and "analytical" in by_key[k])
    if limit is not None:
        chosen = {tuple(c["key"]) for c in choices.values()}
        keys = sorted(set(keys[:: max(1, len(keys) // limit)][:limit]) | (chosen & set(keys)))
    cases = []
    for i, key in enumerate(keys):
        labels = tuple(f"choice:{n}" for n, c in choices.items() if tuple(c["key"]) == key)
        cases.append(Case(id=f"{spec}/{i:03d}", cluster=spec, key=key, plan=plans[key], predicted=by_key[key],
                          labels=labels))
    return cases, choices


# ---------------------------------------------------------------------------------------------------------------
# Driver: run the cases under torchrun
# ---------------------------------------------------------------------------------------------------------------


def run_cases(cases: Sequence[Case], nproc: int, work: Path, graph_json: str) -> dict[str, dict[str, Any]]:
    """Measure every case; a launch that dies loses only the case it died on (the rest are relaunched).
    `graph_json` is the traced graph the plans were made for: the workers use it rather than tracing again."""
    results: dict[str, dict[str, Any]] = {}
    pending = list(cases)
    launch = 0
    while pending:
        chunk = pending[:LAUNCH_CHUNK]
        plans_path = work / f"plans-{nproc}-{launch}.json"
        out_path = work / f"results-{nproc}-{launch}.jsonl"
        plans_path.write_text(json.dumps({"graph": graph_json, "cases": [{"id": c.id, "plan": c.plan}
                                                                         for c in chunk]}))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), "--worker", str(plans_path), str(out_path)]
        log = work / f"launch-{nproc}-{launch}.log"
        rc = _launch(cmd, log, out_path)
        done = {}
        if out_path.exists():
            for line in out_path.read_text().splitlines():
                row = json.loads(line)
                done[row["id"]] = row
        results.update(done)
        rest = [c for c in chunk if c.id not in done]
        if rest and rc != 0:  # the launch died on the first unfinished case: record it, go on with the others
            errors = [json.loads(p.read_text()) for p in sorted(work.glob(f"{out_path.name}.rank*.err"))]
            mine = [e["error"] for e in errors if e["id"] == rest[0].id]
            results[rest[0].id] = {"id": rest[0].id, "error": primary_error(mine) if mine
                                   else f"launch exited with {rc} (hung or crashed)"}
            rest = rest[1:]
        pending = rest + pending[LAUNCH_CHUNK:]
        launch += 1
    return results


def _rows(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _launch(cmd: Sequence[str], log: Path, out_path: Path) -> int:
    """Run one torchrun launch; kill it when no strategy has finished for `CASE_TIMEOUT_S` (a hung collective:
    sub-groups wait up to torch's 30-minute default), so one hang costs a minute, not the benchmark."""
    import signal

    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        rows, last = 0, time.monotonic()
        while proc.poll() is None:
            time.sleep(1.0)
            now_rows = _rows(out_path)
            if now_rows != rows:
                rows, last = now_rows, time.monotonic()
            elif time.monotonic() - last > CASE_TIMEOUT_S:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return -9
        return proc.returncode


# ---------------------------------------------------------------------------------------------------------------
# Worker (under torchrun): run many plans in one process group
# ---------------------------------------------------------------------------------------------------------------


def live_tensor_bytes() -> int:
    """Bytes of every live tensor storage in this process (each storage once; a DTensor counts its local shard)."""
    import torch

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta or type(obj).__name__ == "DTensor":
                continue
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        except (RuntimeError, NotImplementedError):  # tensors without storage (functional wrappers)
            continue
    return sum(v for k, v in seen.items() if k)


def _run_plan(plan_dict: Mapping[str, Any], chain: Any, sets: Sequence[str] = SETS,
              batch: int = GLOBAL_BATCH) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from models.registry import build_model
    from planner.plan import Plan
    from planner.runtime.parallelize import parallelize
    from planner.runtime.train_step import local_batch, train_step

    plan = Plan.from_dict(plan_dict)
    gc.collect()
    dist.barrier()
    torch.manual_seed(SEED)
    built = build_model(MODEL, sets, batch=batch, device="cpu")
    pm = parallelize(built.module, plan, chain=chain, loss_fn=built.loss)
    batch = local_batch(pm, built.example_inputs)
    del built  # the unsharded model: what parallelize did not keep is freed here
    optimizer = _timed_optimizer(list(pm.parameters()))
    train_step(pm, batch, optimizer)  # warm-up: creates the optimizer state, pipeline buffers
    optimizer.zero_grad(set_to_none=True)  # freed before the window, where the profiler could not see it
    gc.collect()
    start = live_tensor_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(pm, batch, optimizer)
    peak = peak_during(prof, start)
    del prof
    times, cpu = [], []
    optimizer.seconds.clear()
    for _ in range(TIMED_STEPS):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(pm, batch, optimizer)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    slowest = torch.tensor(times + [statistics.median(optimizer.seconds), statistics.median(cpu)],
                           dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    optimizer_s, cpu_s = slowest[-2].item(), slowest[-1].item()
    slowest = slowest[:-2]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pm.mesh["pp"].get_local_rank(), peak))
    per_stage = [0] * plan.strategy.pp
    for stage, value in gathered:
        per_stage[stage] = max(per_stage[stage], value)
    return {"step_times_s": slowest.tolist(), "step_time_s": statistics.median(slowest.tolist()),
            "optimizer_s": optimizer_s, "cpu_s": cpu_s, "memory_bytes": per_stage, "load_avg": os.getloadavg()[0]}


def _timed_optimizer(params: list[Any]) -> Any:
    """AdamW that records the seconds of each `step()` (the model's optimizer term is compared with them)."""
    import torch

    class TimedAdamW(torch.optim.AdamW):
        seconds: list[float] = []

        def step(self, closure: Any = None) -> Any:
            t0 = time.perf_counter()
            out = super().step(closure)
            self.seconds.append(time.perf_counter() - t0)
            return out

    opt = TimedAdamW(params, lr=1e-3)
    opt.seconds = []
    return opt


def worker(plans_path: str, out_path: str) -> int:
    import torch
    import torch.distributed as dist

    import ir

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    rank = dist.get_rank()
    payload = json.loads(Path(plans_path).read_text())
    chain = ir.build_layer_chain(ir.Graph.from_json(payload["graph"]))
    cases = payload["cases"]
    # Another benchmark's model settings and batch (bench/pipeline_buffers.py) ride along in the payload.
    sets, batch = tuple(payload.get("sets", SETS)), int(payload.get("batch", GLOBAL_BATCH))
    # A separate group for agreeing on each strategy's outcome, with a short timeout: if a peer is stuck where
    # this rank cannot reach it, the exchange fails fast and the launch ends (the driver relaunches the rest).
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=CONTROL_TIMEOUT_S))
    for case in cases:
        started = time.perf_counter()
        try:
            row = {"id": case["id"], **_run_plan(case["plan"], chain, sets, batch)}
        except Exception as e:  # noqa: BLE001 -- recorded as the strategy's result
            row = {"id": case["id"], "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
        # Process groups are never destroyed here: torch's DeviceMesh reuses the groups of an earlier mesh of the
        # same shape, so a destroyed one would break a later strategy ("Could not resolve the process group").
        outcome: list[Any] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(outcome, row.get("error"), group=control)
        except Exception:  # noqa: BLE001 -- a peer is stuck: end the launch, the driver records the strategy
            Path(f"{out_path}.rank{rank}.err").write_text(json.dumps(
                {"id": case["id"], "error": row.get("error") or "a peer rank hung"}))
            os._exit(3)
        errors = [e for e in outcome if e]
        if errors:
            row = {"id": case["id"], "error": primary_error(errors)}
        row["wall_s"] = time.perf_counter() - started
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def confirm_contenders(cases: Sequence[Case], measured: Mapping[str, Mapping[str, Any]], nproc: int, work: Path,
                       graph_json: str) -> dict[str, float]:
    """Time the contenders for the regret again, side by side: every model's choice and the `CONFIRM_TOP`
    fastest measured strategies, `CONFIRM_ROUNDS` rounds of each in turn within one launch. The first pass
    times each strategy once, minutes apart from the others, so a change of the machine's load between them
    moves their ratio by 10-20% on this shared machine; the rounds interleave them, and the median over the
    rounds is kept. Returns {strategy description: seconds}."""
    ok = [c for c in cases if "error" not in measured.get(c.id, {"error": "missing"})]
    fastest = sorted(ok, key=lambda c: measured[c.id]["step_time_s"])[:CONFIRM_TOP]
    chosen = [c for c in ok if any(label.startswith("choice:") for label in c.labels)]
    contenders = list({c.id: c for c in fastest + chosen}.values())
    rounds = [dataclasses.replace(c, id=f"{c.id}#confirm{r}") for r in range(CONFIRM_ROUNDS) for c in contenders]
    results = run_cases(rounds, nproc, work, graph_json)
    out: dict[str, float] = {}
    for c in contenders:
        times = [results[f"{c.id}#confirm{r}"]["step_time_s"] for r in range(CONFIRM_ROUNDS)
                 if "step_time_s" in results.get(f"{c.id}#confirm{r}", {})]
        if times:
            out[describe(c.key)] = statistics.median(times)
    return out


def strategy_class(key: Sequence[Any]) -> str:
    """What framework machinery a strategy runs on: the overheads the model misses differ by it."""
    dp, tp, pp, _mbs, _m, _sched, _v, zero, sp, rc = key
    parts = []
    if tp > 1:
        parts.append("tp+sp (DTensor)" if sp else "tp (DTensor)")
    if dp > 1:
        parts.append("dp replicate" if zero == 0 else f"dp zero{zero} (FSDP2)")
    if pp > 1:
        parts.append("pp")
    return " + ".join(parts) or "single"


def _least_squares_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Slope of y = k x through the origin (least squares)."""
    sxx = sum(a * a for a in x)
    return sum(a * b for a, b in zip(x, y, strict=True)) / sxx if sxx > 0 else math.nan


def analyze(cases: Sequence[Case], measured: Mapping[str, Mapping[str, Any]], chain_layers: int,
            model: str = "profiled") -> dict[str, Any]:
    """Which term of the model is off, by strategy class (medians over the class's strategies):

    - optimizer: measured `optimizer.step()` seconds (slowest rank) / predicted optimizer term;
    - cpu: measured process CPU seconds per step (slowest rank) / predicted compute + recompute + optimizer of the
      busiest rank -- the work the model knows about against the work the process did;
    - wait: measured wall - CPU seconds (time a rank spent blocked: communication, bubbles, other processes) against
      predicted communication + bubble;
    - per class, the forward/backward CPU the model misses per (micro-batch x layer on the rank):
      (measured CPU - predicted work - the optimizer's miss) / (m x layers / pp), the least-squares constant of a
      per-layer, per-micro-batch framework overhead (DTensor dispatch, FSDP2 hooks).
    """
    rows: dict[str, list[dict[str, float]]] = {}
    for c in cases:
        m = measured.get(c.id, {})
        if "error" in m or not m:
            continue
        b = c.predicted[model]["breakdown"]
        work = b["compute_s"] + b["recompute_s"] + b["optimizer_s"]
        comm = b["tp_comm_s"] + b["pp_comm_s"] + b["dp_comm_s"] + b["bubble_s"]
        micro = c.key[4] * c.key[6]  # micro-batches x virtual stages: per-chunk framework calls
        rows.setdefault(strategy_class(c.key), []).append({
            "time_ratio": m["step_time_s"] / c.predicted[model]["step_time_s"],
            "optimizer_ratio": m["optimizer_s"] / b["optimizer_s"] if b["optimizer_s"] > 0 else math.nan,
            "optimizer_measured_s": m["optimizer_s"], "optimizer_predicted_s": b["optimizer_s"],
            "cpu_ratio": m["cpu_s"] / work if work > 0 else math.nan,
            # forward/backward CPU the model misses, the optimizer's own miss taken out (it has its column)
            "cpu_extra_s": m["cpu_s"] - work - (m["optimizer_s"] - b["optimizer_s"]),
            "calls": micro * chain_layers / c.key[2],
            "wait_measured_s": max(m["step_time_s"] - m["cpu_s"], 0.0), "wait_predicted_s": comm,
        })
    out = {}
    for cls, rs in sorted(rows.items()):
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k not in ("calls",)}
        med["strategies"] = len(rs)
        med["overhead_per_layer_microbatch_s"] = _least_squares_slope([r["calls"] for r in rs],
                                                                      [r["cpu_extra_s"] for r in rs])
        out[cls] = med
    return out


def diagnosis_table(analysis: Mapping[str, Mapping[str, Any]]) -> str:
    rows = ["| strategy class | n | measured / predicted time | optimizer: measured / predicted (ms) | "
            "CPU: measured / predicted work | missed CPU per layer x micro-batch (ms) | "
            "blocked: measured / predicted comm+bubble (ms) |",
            "|---|---|---|---|---|---|---|"]
    for cls, a in analysis.items():
        rows.append(f"| {cls} | {a['strategies']} | {a['time_ratio']:.2f} | {a['optimizer_ratio']:.1f}x "
                    f"({1e3 * a['optimizer_measured_s']:.1f} / {1e3 * a['optimizer_predicted_s']:.1f}) | "
                    f"{a['cpu_ratio']:.2f} | {1e3 * a['overhead_per_layer_microbatch_s']:.2f} | "
                    f"{1e3 * a['wait_measured_s']:.1f} / {1e3 * a['wait_predicted_s']:.1f} |")
    return "\n".join(rows)


def _fmt(x: Any, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.3f}"


def markdown_table(report: Mapping[str, Any]) -> str:
    rows = ["| cluster | model | strategies | Spearman | MAPE (time) | memory error (mean / max) | regret | "
            "regret among runnable | planner's choice (measured) | best measured |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for spec, per in report["clusters"].items():
        for model, s in per["summary"].items():
            rows.append(f"| {spec} | {model} | {s['strategies']} | {_fmt(s['spearman'])} | {_fmt(s['mape'], True)} | "
                        f"{_fmt(s['memory_error'], True)} / {_fmt(s['memory_error_max'], True)} | "
                        f"{_fmt(s['regret'])} (first pass {_fmt(s.get('regret_first_pass'))}) | "
                        f"{_fmt(s['regret_runnable'])} ({s['choice_runnable']}) | "
                        f"{s['choice']} ({_fmt(s['choice_measured_s'])} s) | "
                        f"{s['best']} ({_fmt(s['best_measured_s'])} s) |")
    return "\n".join(rows)


def update_doc(report: Mapping[str, Any]) -> None:
    """Replace the generated block of docs/fidelity.md (between the markers) with this run's table."""
    begin, end = "<!-- fidelity:begin -->", "<!-- fidelity:end -->"
    diag = "\n\n".join(f"Where the time goes, {spec} ({model} model):\n\n{diagnosis_table(per['analysis'][model])}"
                        for spec, per in report["clusters"].items() for model in ("profiled",))
    block = (f"{begin}\n{markdown_table(report)}\n\nRun {report['run']['date']}, {report['run']['wall_s']:.0f} s "
             f"end to end ({report['run']['strategies_run']} strategy runs, {report['run']['failed']} failed; "
             f"load average {report['run']['load_avg']}).\n\n{diag}\n{end}")
    text = DOC.read_text() if DOC.exists() else f"# Cost-model fidelity\n\n{begin}\n{end}\n"
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    DOC.write_text(text)


def _failures(cases: Sequence[Case], measured: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """Error message -> the strategies that failed with it (bugs to file against parallelize / the planner)."""
    out: dict[str, list[str]] = {}
    for c in cases:
        err = measured.get(c.id, {"error": "missing"}).get("error")
        if err:
            out.setdefault(err[:160], []).append(describe(c.key))
    return dict(sorted(out.items()))


def _case_row(c: Case, m: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": c.id, "strategy": describe(c.key), "key": list(c.key), "labels": list(c.labels),
            "predicted": c.predicted, "measured": dict(m)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", default="1x2xcpu,1x4xcpu")
    parser.add_argument("--limit", type=int, default=None, help="run at most N strategies per cluster (smoke run)")
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--no-doc", action="store_true", help="do not update docs/fidelity.md")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--from-results", default=None, metavar="JSON",
                        help="recompute the metrics, the analysis and the doc table from an earlier run's JSON")
    parser.add_argument("--repredict", action="store_true",
                        help="with --from-results: price the earlier run's strategies again with the current model "
                             "and the saved profiles (bench/results/fidelity-profile-*.json); nothing is rerun")
    parser.add_argument("--worker", nargs=2, metavar=("PLANS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(*args.worker)
    if args.from_results:
        return report_again(Path(args.from_results), Path(args.output), doc=not args.no_doc,
                            repredict=args.repredict)

    started = time.perf_counter()
    chain = _trace_chain()
    layers = max(Counter(s.class_id for s in chain.segments).values())  # transformer blocks
    report: dict[str, Any] = {"model": MODEL, "settings": list(SETS), "dtype": DTYPE, "global_batch": GLOBAL_BATCH,
                              "timed_steps": TIMED_STEPS,
                              "memory_measure": "torch.profiler profile_memory: peak live tensor bytes of the "
                                                "second training step, max over the ranks of a stage; predicted "
                                                "= per-stage peak minus the framework overhead",
                              "targets": TARGETS, "clusters": {}}
    total_runs = failed = 0
    with tempfile.TemporaryDirectory(prefix="fidelity-") as tmp:
        work = Path(tmp)
        for spec in [s.strip() for s in args.clusters.split(",") if s.strip()]:
            nproc = int(spec.split("x")[0]) * int(spec.split("x")[1])
            t0 = time.perf_counter()
            profile, ops = profile_cluster(nproc)
            t_profile = time.perf_counter() - t0
            cases, choices = enumerate_cases(chain, spec, profile, args.limit)
            t_enum = time.perf_counter() - t0 - t_profile
            measured = run_cases(cases, nproc, work, chain.graph.to_json())
            confirmed = confirm_contenders(cases, measured, nproc, work, chain.graph.to_json())
            t_run = time.perf_counter() - t0 - t_profile - t_enum
            total_runs += len(cases)
            failed += sum("error" in measured.get(c.id, {"error": 1}) for c in cases)
            fits = [f.to_dict() for f in profile.collectives.fits]
            report["clusters"][spec] = {
                "processes": nproc,
                "seconds": {"profile": t_profile, "enumerate": t_enum, "run": t_run},
                "profile": {"op_entries": len(profile.entries), "skipped_ops": len(ops.skipped),
                            "collective_fits": fits},
                "choices": choices,
                "confirmed": confirmed,
                "summary": {m: summarize(cases, measured, m, confirmed) for m in ("profiled", "analytical")},
                "analysis": {m: analyze(cases, measured, layers, m) for m in ("profiled", "analytical")},
                "failures": _failures(cases, measured),
                "cases": [_case_row(c, measured.get(c.id, {"error": "missing"})) for c in cases],
            }
            print(f"{spec}: {len(cases)} strategies, profile {t_profile:.0f} s, enumerate {t_enum:.0f} s, "
                  f"run {t_run:.0f} s", file=sys.stderr)
    report["run"] = {"date": datetime.date.today().isoformat(), "wall_s": time.perf_counter() - started,
                     "strategies_run": total_runs, "failed": failed, "cpu_count": os.cpu_count(),
                     "load_avg": [round(x, 2) for x in os.getloadavg()]}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(report), indent=1, sort_keys=True) + "\n")
    if not args.no_doc:
        update_doc(report)
    print(json.dumps(_clean({k: v["summary"] for k, v in report["clusters"].items()}), indent=1)
          if args.json else markdown_table(report))
    return 0


def report_again(source: Path, output: Path, *, doc: bool, repredict: bool = False) -> int:
    """Recompute every derived number of a results JSON from its per-strategy rows (no strategy is rerun). With
    `repredict`, the strategies are first priced again by the current model with the saved profiles (so a change
    of the model can be judged against measurements already taken)."""
    report = json.loads(source.read_text())
    chain = _trace_chain()
    layers = max(Counter(s.class_id for s in chain.segments).values())
    for spec, per in report["clusters"].items():
        measured = {r["id"]: r["measured"] for r in per["cases"]}
        if repredict:
            from costmodel.profile_db import OpProfile

            by_key = {tuple(r["key"]): r["measured"] for r in per["cases"]}
            fresh, per["choices"] = enumerate_cases(chain, spec, OpProfile.load(profile_path(per["processes"])),
                                                    None)
            cases = [c for c in fresh if c.key in by_key]
            measured = {c.id: by_key[c.key] for c in cases}
            per["cases"] = [_case_row(c, measured[c.id]) for c in cases]
        else:
            cases = [Case(id=r["id"], cluster=spec, key=tuple(r["key"]), plan={}, predicted=r["predicted"],
                          labels=tuple(r["labels"])) for r in per["cases"]]
        per["summary"] = {m: summarize(cases, measured, m, per.get("confirmed")) for m in ("profiled", "analytical")}
        per["analysis"] = {m: analyze(cases, measured, layers, m) for m in ("profiled", "analytical")}
        per["failures"] = _failures(cases, measured)
    report["run"].setdefault("load_avg", None)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(_clean(report), indent=1, sort_keys=True) + "\n")
    if doc:
        update_doc(report)
    print(markdown_table(report))
    return 0


def _clean(x: Any) -> Any:
    """JSON-ready: NaN/inf -> None (strict JSON has neither), tuples -> lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, Mapping):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
