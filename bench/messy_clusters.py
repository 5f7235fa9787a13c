"""Messy clusters: plan quality and search time for two device types, one straggler at 0.5x, two
datacenters and a what-if sweep.

    python bench/messy_clusters.py                 # all four scenarios
    python bench/messy_clusters.py straggler       # one of: mixed | straggler | datacenters | whatif

- mixed: GPT-3 1.3B, global batch 256, on examples/clusters/mixed-a100-v100.yaml (32 A100 + 32 V100). The search
  (stages may sit on either type, a lockstep group never mixes them) against group data parallelism (each type
  trains its own replicas on a share of the batch that balances their step times) and the A100s alone; plus a
  pinned two-stage pipeline A100 -> V100 whose layer split is compared with the speed-proportional split.
- straggler: GPT-3 1.3B, batch 64, on 2 x 8 H100; one GPU drops to 0.5x. A search from scratch on the new cluster
  against `replan` from the old plan (neighbourhood, reusing the session's layer prices) and the full-scope
  replan: search seconds, speed-up, and step time against the scratch optimum.
- datacenters: a 348B GPT (12 layers, hidden 49152: too big for one datacenter) on
  examples/clusters/two-datacenters.yaml (128 H100, the cross-datacenter link at 1/100): which network tier every
  axis's traffic crosses, and the same with the link as fast as inside a datacenter.
- whatif: the interconnect bandwidth of two-datacenters swept (0.5, 5, 50 GB/s) for GPT-3 1.3B, and the cheapest
  device type for GPT-3 1.3B on 4 x 8 GPUs above a 400k tokens/s floor (illustrative list prices).

Prints tables and writes bench/results/messy_clusters.json (machine, torch version, per scenario the numbers).
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
from costmodel.layer_pricing import price_segment
from costmodel.rank_layout import device_map
from models.registry import build_model
from planner import api
from planner.scenarios.group_data_parallel import plan_group_data_parallel, proportional_split, searching
from planner.scenarios.replan import PlanningSession, ReplanScope, replan
from planner.scenarios.variations import parse_vary, scenarios
from planner.scenarios.whatif import WhatIfOptions, render_table, whatif
from planner.search.branch_and_bound import search
from planner.search.device_groups import axis_tiers, with_device_groups
from planner.search.space import Objective, SearchSpace

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "messy_clusters.json"
CLUSTERS = ROOT / "examples" / "clusters"
GPT_348B = ["layers=12", "hidden=49152", "heads=384", "vocab=51200", "seq=2048"]
"""Few but very wide layers: 348B parameters, whose 5.6 TB of Adam state does not fit in one datacenter's 64 x 80 GB
(so both must be used), in a layer chain short enough to search in seconds."""


def chain_of(name: str, sets: list[str] | tuple[str, ...] = ()) -> ir.LayerChain:
    built = build_model(name, list(sets), batch=1, device="meta")
    return ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=built.name))


def _label(strategy) -> str:
    s = strategy
    extra = f" cp={s.cp}" if s.cp > 1 else ""
    return (f"dp={s.dp} tp={s.tp} pp={s.pp}{extra} mbs={s.microbatch_size} m={s.num_microbatches} "
            f"{s.schedule.value}{':' + str(s.virtual_stages) if s.virtual_stages > 1 else ''} zero={s.zero_stage}")


def _blocks(chain: ir.LayerChain, strategy) -> list[int]:
    main = max({s.class_id for s in chain.segments}, key=lambda c: sum(s.class_id == c for s in chain.segments))
    return [sum(1 for seg in chain.segments[st.start:st.stop] if seg.class_id == main) for st in strategy.stages]


# ---- scenarios -------------------------------------------------------------------------------------------------


def mixed() -> dict:
    chain = chain_of("gpt3-1.3b")
    cluster = Cluster.parse(str(CLUSTERS / "mixed-a100-v100.yaml"))
    batch = 256
    t = time.perf_counter()
    searched = search(chain, cluster, global_batch=batch)
    search_s = time.perf_counter() - t
    best = with_device_groups(cluster, searched.best.strategy)
    t = time.perf_counter()
    groups = plan_group_data_parallel(chain, cluster, batch, searching())
    groups_s = time.perf_counter() - t
    a100_only = Cluster.from_dict({**cluster.to_dict(), "groups": [cluster.groups[0].to_dict()]})
    alone = search(chain, a100_only, global_batch=batch).best
    # A two-stage pipeline, A100 stage then V100 stage: blocks against the speed-proportional split.
    pipe = search(chain, cluster, global_batch=batch, space=SearchSpace(pp=2, dp=32, schedule="1f1b")).best
    blocks = _blocks(chain, pipe.strategy)
    per_block = [price_segment(chain, chain.segments[1], g.device, microbatch_size=pipe.strategy.microbatch_size)
                 for g in cluster.groups]
    speeds = [1.0 / (c.fwd_compute_s + c.bwd_compute_s) for c in per_block]
    reference = list(proportional_split(sum(blocks), speeds))
    out = {
        "model": "gpt3-1.3b", "cluster": cluster.name, "global_batch": batch,
        "search": {"step_time_s": searched.best.estimate.step_time_s, "search_s": round(search_s, 3),
                   "plan": _label(best), "stage_groups": [s.device_group for s in best.stages],
                   "devices_used": best.num_devices, "mfu": searched.best.estimate.mfu},
        "group_data_parallel": {"step_time_s": groups.step_time_s, "search_s": round(groups_s, 3),
                                "shares": [{"group": s.group, "samples": s.samples, "plan": _label(s.strategy),
                                            "step_time_s": s.step_time_s} for s in groups.shares],
                                "sync_s": groups.sync_s, "mfu": groups.mfu},
        "a100_only": {"step_time_s": alone.estimate.step_time_s, "plan": _label(alone.strategy)},
        "pipeline_a100_v100": {"step_time_s": pipe.estimate.step_time_s, "blocks": blocks,
                               "speed_proportional_blocks": reference,
                               "devices": [p.devices[0] for p in device_map(cluster, pipe.strategy)]},
    }
    best_time = min(out["search"]["step_time_s"], out["group_data_parallel"]["step_time_s"])
    out["speedup_over_a100_only"] = out["a100_only"]["step_time_s"] / best_time
    print(f"two device types: gpt3-1.3b, batch {batch}, {cluster.name} (32 A100 + 32 V100)")
    print(f"  search (type-aligned meshes)   {out['search']['step_time_s']:.4f} s  in {search_s:6.2f} s   "
          f"{out['search']['plan']}  stages on {out['search']['stage_groups']}")
    print(f"  group data parallelism         {groups.step_time_s:.4f} s  in {groups_s:6.2f} s   {groups.summary()}")
    print(f"  A100s alone                    {alone.estimate.step_time_s:.4f} s               "
          f"{out['a100_only']['plan']}")
    print(f"  pinned pp=2 A100 -> V100: blocks {blocks} (speed-proportional {reference}), "
          f"{pipe.estimate.step_time_s:.4f} s")
    print(f"  best uses both types: {out['speedup_over_a100_only']:.2f}x the A100s alone")
    return out


def straggler() -> dict:
    chain = chain_of("gpt3-1.3b")
    nominal = Cluster.parse("2x8xh100-sxm")
    batch = 64
    session = PlanningSession(chain)
    t = time.perf_counter()
    first = session.search(nominal, global_batch=batch)
    plan_s = time.perf_counter() - t
    old = api._plan_of(chain, nominal, api._model_info(chain, "gpt3-1.3b", ()), batch, "bfloat16",
                       first.best.strategy, first.best.sharding, first.best.estimate,
                       api._search_info(first, first.best.estimate.step_time_s))
    slow = nominal.with_speed(3, 0.5)
    t = time.perf_counter()
    scratch = search(chain, slow, global_batch=batch)
    scratch_s = time.perf_counter() - t
    t = time.perf_counter()
    near = replan(old, chain, slow, session=session)
    near_s = time.perf_counter() - t
    t = time.perf_counter()
    full = replan(old, chain, slow, session=session, scope=ReplanScope.FULL, stickiness=0.0)
    full_s = time.perf_counter() - t
    best = scratch.best.estimate.step_time_s
    out = {
        "model": "gpt3-1.3b", "cluster": "2x8xh100-sxm, rank 3 at 0.5x", "global_batch": batch,
        "nominal": {"step_time_s": old.predicted.step_time_s, "plan": _label(old.strategy),
                    "search_s": round(plan_s, 3)},
        "keep_old_plan": {"step_time_s": near.kept.step_time_s if near.kept else None},
        "scratch": {"step_time_s": best, "search_s": round(scratch_s, 3), "candidates": scratch.candidates,
                    "plan": _label(scratch.best.strategy)},
        "replan": {"step_time_s": near.chosen.step_time_s, "search_s": round(near_s, 3),
                   "candidates": near.search.candidates, "plan": near.chosen.label,
                   "quality_vs_scratch": near.chosen.step_time_s / best, "speedup": scratch_s / near_s,
                   "warm_start": near.warm_start},
        "replan_full": {"step_time_s": full.chosen.step_time_s, "search_s": round(full_s, 3),
                        "candidates": full.search.candidates, "quality_vs_scratch": full.chosen.step_time_s / best,
                        "speedup": scratch_s / full_s},
    }
    print(f"one straggler at 0.5x: gpt3-1.3b, batch {batch}, 2x8 H100 (rank 3 slowed)")
    print(f"  nominal plan                 {old.predicted.step_time_s:.4f} s  ({out['nominal']['plan']})")
    print(f"  old plan on the new cluster  {out['keep_old_plan']['step_time_s']:.4f} s")
    print(f"  {'':28} {'step s':>8} {'search s':>9} {'solved':>7} {'quality':>8} {'speed-up':>9}")
    for name, key in (("search from scratch", "scratch"), ("replan (neighbourhood)", "replan"),
                      ("replan (full, warm)", "replan_full")):
        r = out[key]
        quality = r.get("quality_vs_scratch", 1.0)
        speed = r.get("speedup", 1.0)
        print(f"  {name:<28} {r['step_time_s']:>8.4f} {r['search_s']:>9.2f} {r['candidates']:>7} "
              f"{quality:>8.3f} {speed:>8.1f}x")
    print(f"  replan chose: {near.chosen.label}")
    return out


def datacenters() -> dict:
    chain = chain_of("gpt", GPT_348B)
    cluster = Cluster.parse(str(CLUSTERS / "two-datacenters.yaml"))
    fast = cluster.with_tier("interconnect", bandwidth=cluster.tiers[1].bandwidth, latency=cluster.tiers[1].latency)
    rows = {}
    for name, c in (("link at 1/100", cluster), ("link as fast as inside", fast)):
        t = time.perf_counter()
        result = search(chain, c, global_batch=256)
        elapsed = time.perf_counter() - t
        s = result.best.strategy
        rows[name] = {"step_time_s": result.best.estimate.step_time_s, "search_s": round(elapsed, 3),
                      "plan": _label(s), "mesh_order": [a.value for a in s.mesh_order],
                      "axis_tiers": axis_tiers(c, s), "candidates": result.candidates}
    print(f"two datacenters: GPT 348B ({', '.join(GPT_348B)}), batch 256, {cluster.name} (2 x 64 H100)")
    for name, r in rows.items():
        crossing = [a for a, t in r["axis_tiers"].items() if t == "interconnect"]
        print(f"  {name:<24} {r['step_time_s']:.4f} s  in {r['search_s']:6.2f} s  {r['plan']}  tiers "
              f"{r['axis_tiers']}  crossing the interconnect: {crossing or 'nothing'}")
    return {"model": "gpt 348B", "settings": GPT_348B, "cluster": cluster.name, "global_batch": 256, "runs": rows}


def whatif_sweep() -> dict:
    chain = chain_of("gpt3-1.3b")
    out = {}
    t = time.perf_counter()
    link = whatif(lambda seq: chain, scenarios(str(CLUSTERS / "two-datacenters.yaml"), 256, None,
                                               [parse_vary("tier.interconnect.bandwidth=0.5GB/s,5GB/s,50GB/s")]))
    out["interconnect"] = {"seconds": round(time.perf_counter() - t, 3), **link.to_dict()}
    print("what-if: interconnect bandwidth of two-datacenters, gpt3-1.3b, batch 256")
    print(render_table(link))
    t = time.perf_counter()
    options = WhatIfOptions(objective=Objective.COST, min_throughput=4e5)
    devices = whatif(lambda seq: chain, scenarios("4x8xa100-80gb", 256, None, [parse_vary(
        "device=v100-32gb@3.90,a100-80gb@5.12,h100-sxm@9.80")]), options=options)
    out["device_cost"] = {"seconds": round(time.perf_counter() - t, 3), **devices.to_dict()}
    print("what-if: cheapest device type above 400k tokens/s, gpt3-1.3b, batch 256, up to 4 x 8 GPUs "
          "(illustrative AWS list prices per GPU-hour)")
    print(render_table(devices))
    return out


SCENARIOS = {"mixed": mixed, "straggler": straggler, "datacenters": datacenters, "whatif": whatif_sweep}


def main(argv: list[str]) -> int:
    which = argv or list(SCENARIOS)
    bad = [w for w in which if w not in SCENARIOS]
    if bad:
        print(f"unknown scenario {bad[0]!r}; valid: {', '.join(SCENARIOS)}", file=sys.stderr)
        return 2
    out: dict = json.loads(RESULTS.read_text()) if RESULTS.is_file() and argv else {}
    out.update({"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__})
    for name in which:
        out[name] = SCENARIOS[name]()
        print()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
