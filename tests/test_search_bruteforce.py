"""The planner's search: mesh enumeration, search-space pins, and the joint search against brute force."""

from __future__ import annotations

import pytest

from costmodel.strategy import MeshAxis, Recompute, Schedule
from planner.search.meshes import (
    DP_INSIDE_PP,
    PP_INSIDE_DP,
    MeshCandidate,
    compute_lower_bound_s,
    divisors,
    enumerate_meshes,
)
from planner.search.space import Objective, SearchSpace


def test_divisors() -> None:
    assert divisors(1) == (1,)
    assert divisors(12) == (1, 2, 3, 4, 6, 12)
    assert divisors(1024) == tuple(2 ** i for i in range(11))
    with pytest.raises(ValueError):
        divisors(0)


def test_meshes_of_16_devices_on_two_nodes() -> None:
    meshes = enumerate_meshes(16, devices_per_node=8, global_batch=32, max_pp=24)
    triples = {(m.dp, m.tp, m.pp) for m in meshes}
    # every ordered factorization dp*tp*pp = 16 with tp in {1, 2, 4, 8} (inside a node): 5+4+3+2 = 14
    assert len(triples) == 14
    assert all(m.dp * m.tp * m.pp == 16 for m in meshes)
    assert (1, 16, 1) not in triples
    # both rank orders only when dp > 1 and pp > 1
    for m in meshes:
        others = [o.mesh_order for o in meshes if (o.dp, o.tp, o.pp) == (m.dp, m.tp, m.pp)]
        assert len(others) == (2 if m.dp > 1 and m.pp > 1 else 1)
    assert len(meshes) == 14 + sum(1 for d, _, p in triples if d > 1 and p > 1)
    # deterministic
    assert meshes == enumerate_meshes(16, devices_per_node=8, global_batch=32, max_pp=24)


def test_mesh_rules_batch_pp_and_pins() -> None:
    meshes = enumerate_meshes(16, devices_per_node=8, global_batch=6, max_pp=4)
    assert {m.dp for m in meshes} <= {1, 2}           # dp must divide the global batch 6
    assert max(m.pp for m in meshes) <= 4
    pinned = enumerate_meshes(16, devices_per_node=8, global_batch=32, max_pp=24, tp=4, pp=2)
    assert {(m.dp, m.tp, m.pp) for m in pinned} == {(2, 4, 2)}
    spanning = enumerate_meshes(16, devices_per_node=8, global_batch=32, max_pp=24, tp_across_nodes=True)
    assert (1, 16, 1) in {(m.dp, m.tp, m.pp) for m in spanning}


def test_strides_follow_mesh_order() -> None:
    m = MeshCandidate(dp=4, tp=8, pp=2, mesh_order=DP_INSIDE_PP)
    assert (m.stride(MeshAxis.TP), m.stride(MeshAxis.DP), m.stride(MeshAxis.PP)) == (1, 8, 32)
    m = MeshCandidate(dp=4, tp=8, pp=2, mesh_order=PP_INSIDE_DP)
    assert (m.stride(MeshAxis.TP), m.stride(MeshAxis.PP), m.stride(MeshAxis.DP)) == (1, 8, 16)


def test_compute_lower_bound() -> None:
    # 6 * 1e9 params * 1e6 tokens FLOPs on 1000 devices at 100 TFLOP/s: 60 s
    assert compute_lower_bound_s(6e15 * 1e3, 1000, 1e14) == pytest.approx(60.0)


def test_search_space_from_fixes() -> None:
    space = SearchSpace.from_fixes(["tp=8", "pp=8", "recompute=full", "schedule=interleaved:2", "zero=1",
                                    "sp=true", "mbs=2", "microbatches=16"])
    assert (space.tp, space.pp, space.recompute, space.schedule, space.virtual_stages) == (
        8, 8, Recompute.FULL, Schedule.INTERLEAVED, 2)
    assert (space.zero_stage, space.sequence_parallel, space.microbatch_size, space.num_microbatches) == (
        1, True, 2, 16)
    assert SearchSpace.from_fixes(["v=4"]).schedule is Schedule.INTERLEAVED


@pytest.mark.parametrize(("fix", "message"), [
    ("tpp=8", "unknown key 'tpp'; valid: dp, tp, pp"),
    ("tp", "expected KEY=VALUE"),
    ("tp=0", "positive integer"),
    ("tp=eight", "positive integer"),
    ("schedule=zigzag", "valid: gpipe, 1f1b, interleaved:V, interleaved-zb[:V], zbv, dualpipev"),
    ("schedule=zbv:3", "only interleaved and interleaved-zb take :V"),
    ("schedule=interleaved:1", "interleaved needs :V with V >= 2"),
    ("recompute=some", "valid: none, selective, full"),
    ("zero=4", "valid: 0, 1, 2, 3"),
    ("sp=maybe", "expected true or false"),
    ("schedule=1f1b:2", "only interleaved and interleaved-zb take :V"),
])
def test_bad_fixes_name_the_valid_choices(fix: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SearchSpace.from_fixes([fix])


def test_contradicting_fixes() -> None:
    with pytest.raises(ValueError, match="contradicts"):
        SearchSpace.from_fixes(["tp=2", "tp=4"])
    with pytest.raises(ValueError, match="needs tp > 1"):
        SearchSpace.from_fixes(["tp=1", "sp=1"])
    with pytest.raises(ValueError, match="needs schedule=interleaved"):
        SearchSpace.from_fixes(["schedule=gpipe", "v=2"])


# ---- the joint search against brute force over the same cost model ------------------------------------------

import itertools  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import ir  # noqa: E402
from costmodel.estimate import Estimate, estimate  # noqa: E402
from costmodel.hardware.cluster import Cluster  # noqa: E402
from costmodel.pipeline import stage_rank  # noqa: E402
from costmodel.strategy import RuntimeOptions, StageSpec, Strategy  # noqa: E402
from costmodel.validation import error_band  # noqa: E402
from models.registry import build_model  # noqa: E402
from planner.errors import InfeasibleError, UserError  # noqa: E402
from planner.search.bounds import end_reduce_lower_bound  # noqa: E402
from planner.search.branch_and_bound import SearchOptions, search  # noqa: E402
from planner.search.candidate_bounds import CandidateBounds  # noqa: E402
from planner.search.candidates import Candidate, device_counts, enumerate_candidates, mesh_options_for  # noqa: E402
from planner.search.layer_costs import LayerCostTable  # noqa: E402
from planner.search.pricing import layer_cost_map  # noqa: E402
from planner.search.ranking import prefer_simplest, simplicity_key  # noqa: E402
from planner.search.stage_partition import Partition, StageChoice, evaluate  # noqa: E402
from planner.search.stage_problem import StageProblem, StageProblemBuilder  # noqa: E402

GPT_TINY = ("layers=3", "hidden=256", "heads=8", "vocab=1000", "seq=128")
GPT_INTERLEAVE = ("layers=4", "hidden=256", "heads=8", "vocab=1000", "seq=128")
GPT_UNEVEN = ("layers=7", "hidden=256", "heads=8", "vocab=1000", "seq=128")
"""7 blocks + the embedding + the head = 9 units: 4 chunks of 2 or 3, 6 of 1 or 2, 8 of 1 or 2 on pp=2."""
GPT_MEMORY = ("layers=3", "hidden=1024", "heads=16", "vocab=8000", "seq=512")
GPT_PARTIAL = ("layers=6", "hidden=1024", "heads=16", "vocab=1000", "seq=2048")
"""Activations large against the weights: on 1.8 GB per device, pp=2 fits by recomputing part of stage 0."""
LLAMA_TINY = ("layers=3", "hidden=256", "heads=8", "kv_heads=4", "vocab=1000", "seq=128")
MOE_TINY = ("layers=2", "hidden=256", "ffn_hidden=256", "heads=4", "kv_heads=4", "vocab=1000", "experts=4", "top_k=2",
            "seq=128")
"""Routed experts: candidates with ep 1, 2 and 4, whose all-to-alls the level-1 bound prices before any sharding."""

_CHAINS: dict[tuple, ir.LayerChain] = {}


def chain_of(family: str, sets: tuple[str, ...]) -> ir.LayerChain:
    key = (family, sets)
    if key not in _CHAINS:
        built = build_model(family, sets, batch=1, device="meta")
        _CHAINS[key] = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=built.name))
    return _CHAINS[key]


def yaml_cluster(tmp: Path, name: str, text: str) -> Cluster:
    path = tmp / f"{name}.yaml"
    path.write_text(text)
    return Cluster.parse(str(path))


def small_memory(tmp: Path, memory: str) -> Cluster:
    return yaml_cluster(tmp, f"small-{memory}", f"""name: small-{memory}
groups:
  - device: a100-80gb
    num_nodes: 2
    devices_per_node: 2
    memory: {memory}
""")


def mixed(tmp: Path) -> Cluster:
    return yaml_cluster(tmp, "mixed", """name: mixed
groups:
  - name: a100
    device: a100-80gb
    num_nodes: 1
    devices_per_node: 2
  - name: v100
    device: v100-32gb
    num_nodes: 1
    devices_per_node: 2
""")


def straggler(tmp: Path) -> Cluster:
    return yaml_cluster(tmp, "straggler", """name: straggler
groups:
  - device: h100-sxm
    num_nodes: 1
    devices_per_node: 4
    slowdown: {1: 0.5}
""")


def two_datacenters(tmp: Path) -> Cluster:
    """Two nodes of two H100 joined by a slow, high-latency link (as examples/clusters/two-datacenters.yaml)."""
    return yaml_cluster(tmp, "two-dc", """name: two-dc
groups:
  - device: h100-sxm
    num_nodes: 2
    devices_per_node: 2
tiers:
  - name: node
    size: 2
  - name: interconnect
    size: 4
    aggregate_bandwidth: 2Gbps
    latency: 1ms
""")


def shared_cores(tmp: Path) -> Cluster:
    return yaml_cluster(tmp, "shared-cores", """name: shared-cores
groups:
  - device: cpu
    num_nodes: 1
    devices_per_node: 4
    host_cores: 2
""")


@dataclass(frozen=True)
class BruteResult:
    best: float
    per_candidate: dict          # candidate -> its best fitting step time (GPipe twins included)
    estimates: int
    per_strategy: dict = field(default_factory=dict)   # candidate -> the strategy of that best partition


def interleaved_chunkings(chain: ir.LayerChain, p: int, v: int) -> list[list[tuple[int, int]]]:
    """Every cut of the chain into p*v chunks that hold q or q+1 units (the embedding, each block and the head count
    one unit each): all C(pv, E) choices of the larger chunks, enumerated -- not the search's per-rank reduction."""
    n = len(chain.segments)
    main = Counter(s.class_id for s in chain.segments).most_common(1)[0][0]
    blocks = [s.index for s in chain.segments if s.class_id == main]
    starts = ([0] if blocks[0] > 0 else []) + blocks + ([blocks[-1] + 1] if blocks[-1] + 1 < n else [])
    q, extra = divmod(len(starts), p * v)
    if q == 0:
        return []
    out = []
    for larger in itertools.combinations(range(p * v), extra):
        cuts, unit = [0], 0
        for j in range(p * v):
            unit += q + (j in larger)
            cuts.append(starts[unit] if unit < len(starts) else n)
        out.append(list(itertools.pairwise(cuts)))
    return out


def partial_stage(chain: ir.LayerChain, a: int, b: int, rc: tuple[Recompute, int], costs: dict, device: str
                  ) -> StageSpec:
    """Stage [a, b) with `rc` = (mode, quarters): with fewer than 4 quarters, full recomputation of
    ceil(q K / 4) of its K segments that full recomputation saves bytes in, the largest saving first, then the lower
    class, then the earlier segment."""
    mode, quarters = rc
    if quarters == 4:
        return StageSpec(a, b, mode)
    saving = {i: costs[(chain.segments[i].class_id, device)].saved_bytes_none
              - costs[(chain.segments[i].class_id, device)].saved_bytes_full for i in range(a, b)}
    order = sorted((i for i in range(a, b) if saving[i] > 0),
                   key=lambda i: (-saving[i], chain.segments[i].class_id, i))
    return StageSpec(a, b, mode, recomputed=tuple(order[:-(-quarters * len(order) // 4)]))


def brute_force(chain: ir.LayerChain, cluster: Cluster, batch: int, space: SearchSpace) -> BruteResult:
    """Every candidate of the space, GPipe twins of the 1F1B ones and ZeRO-2 twins of the pipelined ZeRO-1 ones,
    every partition and every recomputation per stage (per rank for interleaved), each priced by
    `costmodel.estimate`: the fitting minimum."""
    table = LayerCostTable(chain, cluster)
    builder = StageProblemBuilder(chain, cluster, table)
    cands, _ = enumerate_candidates(chain, cluster, batch, space)
    twins = [replace(c, schedule=Schedule.GPIPE) for c in cands
             if c.schedule is Schedule.ONE_F_ONE_B and c.mesh.pp > 1 and space.schedule is None]
    # The search leaves out ZeRO-2 under pipelining (ZeRO-1 is never worse): brute force prices it.
    twins += [replace(c, zero_stage=2) for c in cands
              if c.zero_stage == 1 and c.mesh.pp > 1 and space.zero_stage is None]
    whole = [(space.recompute, 4)] if space.recompute is not None else [(r, 4) for r in Recompute]
    # Partial recomputation is searched only when the recomputation is free; on a rank where no recomputation fits
    # it cannot win (it only adds recomputation), so it is enumerated on the other ranks.
    partial = [(Recompute.FULL, q) for q in (1, 2, 3)] if space.recompute is None else []
    n = len(chain.segments)
    per: dict = {}
    strategies: dict = {}
    count = 0
    for cand in cands + twins:
        placements = builder.placements(cand)
        if placements is None:
            continue
        costs = layer_cost_map(builder, cand, placements)
        p = cand.mesh.pp
        if cand.virtual_stages > 1:  # interleaved, interleaved-zb:V, zbv, dualpipev: every chunking, rc per rank
            bases = interleaved_chunkings(chain, p, cand.virtual_stages)
        else:
            bases = [list(itertools.pairwise((0, *cuts, n))) for cuts in itertools.combinations(range(1, n), p - 1)]
        for chunks in bases:
            ranks = [stage_rank(cand.schedule, p, j) for j in range(len(chunks))]

            def price(rc: tuple) -> tuple[Estimate, Strategy]:
                stages = [partial_stage(chain, a, b, rc[r], costs, placements[r].device.name)  # noqa: B023
                          for (a, b), r in zip(chunks, ranks, strict=True)]  # noqa: B023
                return estimate(chain, cluster, cand.strategy(stages), layer_costs=costs,  # noqa: B023
                                global_batch=batch), cand.strategy(stages)  # noqa: B023

            tried = list(itertools.product(whole, repeat=p))
            if partial:
                plain, _ = price(((Recompute.NONE, 4),) * p)
                tried += [rc for rc in itertools.product(*[whole + (partial if st.memory.total > st.capacity_bytes
                                                                     else []) for st in plain.stages])
                          if any(q < 4 for _, q in rc)]
            for rc in tried:
                est, strategy = price(rc)
                count += 1
                if est.fits and est.step_time_s < per.get(cand, math.inf):
                    per[cand] = est.step_time_s
                    strategies[cand] = strategy
    return BruteResult(min(per.values(), default=math.inf), per, count, strategies)


def _instances(tmp: Path) -> list[tuple[str, ir.LayerChain, Cluster, int, SearchSpace]]:
    space = SearchSpace(max_microbatch_size=2, max_virtual_stages=2)
    gpt, llama = chain_of("gpt", GPT_TINY), chain_of("llama", LLAMA_TINY)
    inter, memory = chain_of("gpt", GPT_INTERLEAVE), chain_of("gpt", GPT_MEMORY)
    return [
        ("gpt 1x4 a100 b8", gpt, Cluster.parse("1x4xa100-80gb"), 8, space),
        ("gpt 2x2 h100 b4", gpt, Cluster.parse("2x2xh100"), 4, space),
        ("llama-gqa 2x2 a100 b8", llama, Cluster.parse("2x2xa100-80gb"), 8, space),
        ("gpt-4-layers interleaved pp=2", inter, Cluster.parse("1x4xa100-80gb"), 8, space.with_changes(pp=2)),
        ("gpt 1.2GB zero=0 (recompute)", memory, small_memory(tmp, "1.2GB"), 8, space.with_changes(zero_stage=0)),
        ("gpt 1.3GB", memory, small_memory(tmp, "1.3GB"), 8, space),
        ("gpt mixed a100+v100", gpt, mixed(tmp), 8, space),
        ("llama straggler h100", llama, straggler(tmp), 4, space),
        ("gpt 4 cpu ranks on 2 host cores", gpt, shared_cores(tmp), 4, space),
        ("gpt 2x2 h100, tp overlap, no dp overlap", gpt, Cluster.parse("2x2xh100"), 4,
         space.with_changes(runtime=RuntimeOptions(tp_overlap=True, dp_overlap=False, reshard_after_forward=False))),
        ("gpt-7-layers uneven interleaved pp=2 v<=4", chain_of("gpt", GPT_UNEVEN), Cluster.parse("1x4xa100-80gb"), 8,
         space.with_changes(pp=2, schedule=Schedule.INTERLEAVED, max_virtual_stages=4, max_microbatch_size=1)),
        # every schedule: 1f1b, interleaved:2, interleaved-zb:1 and :2, zbv and dualpipev (V-shaped placement)
        ("gpt-7-layers all schedules pp=2", chain_of("gpt", GPT_UNEVEN), Cluster.parse("1x4xa100-80gb"), 8,
         space.with_changes(pp=2, max_microbatch_size=1)),
        ("gpt 1.3GB zero-bubble pp=2 (memory)", memory, small_memory(tmp, "1.3GB"), 8,
         space.with_changes(pp=2, schedule=Schedule.ZBV, max_microbatch_size=1)),
        # nothing fits without offloading: the optimizer state (ZeRO-0), the parameters too (ZeRO-3)
        ("gpt 1.2GB zero=0 dp=4 (optimizer offload)", memory, small_memory(tmp, "1.2GB"), 8,
         space.with_changes(zero_stage=0, pp=1, tp=1)),
        ("gpt 1.06GB zero=3 dp=4 (parameter offload)", memory, small_memory(tmp, "1.06GB"), 8,
         space.with_changes(zero_stage=3, pp=1, tp=1)),
        # Megatron-LM's input-gradient reductions hidden behind weight-gradient GEMMs
        ("llama-gqa 2x2 a100 b8, tp grad overlap", llama, Cluster.parse("2x2xa100-80gb"), 8,
         space.with_changes(runtime=RuntimeOptions(tp_grad_overlap=True))),
        # a slow outer tier: sends and gradient reductions across it cost more than the compute
        ("gpt two datacenters (slow outer tier)", gpt, two_datacenters(tmp), 4, space),
        # Megatron-Core's overlapped interleaved sends, across the slow tier: they wait only in the fill and drain
        ("gpt-7-layers interleaved, overlapped sends, two datacenters", chain_of("gpt", GPT_UNEVEN),
         two_datacenters(tmp), 8, space.with_changes(pp=2, schedule=Schedule.INTERLEAVED, max_virtual_stages=4,
                                                     max_microbatch_size=1, runtime=RuntimeOptions(p2p_overlap=True))),
        # expert parallelism, its all-to-alls within a node or across the slow tier
        ("moe two datacenters (all-to-all across the slow tier)", chain_of("moe", MOE_TINY), two_datacenters(tmp), 8,
         space),
    ]


def test_partial_recompute_is_searched_and_priced_exactly(tmp_path: Path) -> None:
    """Where recomputing every layer of a stage costs more than needed, the search recomputes part of them, and
    its optimum is the brute force's (which picks the recomputed segments with its own code)."""
    chain = chain_of("gpt", GPT_PARTIAL)
    cluster = small_memory(tmp_path, "1.8GB")
    space = SearchSpace(zero_stage=0, tp=1, pp=2, cp=1, schedule=Schedule.ONE_F_ONE_B, max_microbatch_size=1)
    result = search(chain, cluster, global_batch=8, space=space)
    partial = [st for st in result.best.strategy.stages if st.recomputed is not None]
    assert partial and all(0 < len(st.recomputed) < st.num_segments for st in partial)
    assert result.best.estimate.fits
    assert result.best.estimate.step_time_s == pytest.approx(brute_force(chain, cluster, 8, space).best, rel=1e-9)
    pinned = search(chain, cluster, global_batch=8, space=space.with_changes(recompute=Recompute.FULL))
    assert all(st.recomputed is None for st in pinned.best.strategy.stages)  # a pinned mode is every layer's
    assert result.best.estimate.step_time_s < pinned.best.estimate.step_time_s


def _check_level_one_bound(name: str, chain: ir.LayerChain, cluster: Cluster, brute: BruteResult) -> int:
    """`CandidateBounds.cheap` (no sharding solved: tp 1 prices, the expert all-to-alls) is below each candidate's
    best partition and recomputation that brute force found."""
    table = LayerCostTable(chain, cluster)
    bounds = CandidateBounds(chain, "bfloat16", StageProblemBuilder(chain, cluster, table))
    searched = {cand: best for cand, best in brute.per_candidate.items()
                if cand.schedule is not Schedule.GPIPE and not (cand.zero_stage == 2 and cand.mesh.pp > 1)}
    weak = {}  # (gpipe and ZeRO-2 under pipelining: brute force's twins, not candidates of the search)
    for cand, best in searched.items():
        lb, need = bounds.cheap(cand)
        assert need is None and lb <= best * (1 + 1e-9), (name, cand.label, lb, best)
        weak[cand] = lb
    # Once the search has priced a candidate's tp (both sequence-parallel settings), its level-1 bound uses those
    # prices: still below its brute-force optimum.
    for cand in searched:
        for device in {pl.device.name: pl.device for pl in bounds.builder.placements(cand) or ()}.values():
            for sp in (False, True) if cand.mesh.tp > 1 else ():
                table.prices(device, tp=cand.mesh.tp, tp_stride=cand.mesh.stride(MeshAxis.TP), sequence_parallel=sp,
                             microbatch_size=cand.microbatch_size)
    stronger = 0
    for cand, best in searched.items():
        lb, _ = bounds.cheap(cand)
        assert weak[cand] <= lb <= best * (1 + 1e-9), (name, cand.label, lb, best)
        stronger += lb > weak[cand] * (1 + 1e-9)
    return stronger


def _check_level_two_bound(name: str, chain: ir.LayerChain, cluster: Cluster, brute: BruteResult) -> int:
    """`CandidateBounds.tight` (the candidate's own layer prices: the pipeline's bottleneck, the ZeRO collectives
    of each micro-batch, the end-of-step gradient reduction the drain cannot hide) is below each candidate's
    brute-force optimum. Returns how many the end-of-step reduction raises above the other two."""
    table = LayerCostTable(chain, cluster)
    bounds = CandidateBounds(chain, "bfloat16", StageProblemBuilder(chain, cluster, table))
    raised = 0
    for cand, best in brute.per_candidate.items():
        if cand.schedule is Schedule.GPIPE or (cand.zero_stage == 2 and cand.mesh.pp > 1):
            continue  # brute force's twins, not candidates of the search (`_check_level_one_bound`)
        lb = bounds.tight(cand)
        assert lb <= best * (1 + 1e-9), (name, cand.label, lb, best)
        placements = bounds.builder.placements(cand)
        tail = end_reduce_lower_bound(cand, bounds.pipeline_bound(cand, placements),
                                      bounds.end_reduce.floor(cand, placements))
        raised += tail >= lb - bounds.optimizer_bound(cand, placements) > 0
    return raised


def _check_mesh_floors(name: str, chain: ir.LayerChain, cluster: Cluster, batch: int, space: SearchSpace) -> int:
    """`CandidateBounds.mesh_floor` (the level-1 bound of a mesh, from its shapes and settings) is exactly the least
    `cheap` bound of the candidates the mesh lists, with the least bytes needed by those that do not fit. Returns
    how many meshes fit with no candidate."""
    unfit = 0
    bounds = CandidateBounds(chain, "bfloat16", StageProblemBuilder(chain, cluster, LayerCostTable(chain, cluster)))
    for n in device_counts(cluster, space, Objective.TIME):
        for options in mesh_options_for(n, chain, cluster, batch, space, {}):
            cheap = [bounds.cheap(c) for c in options.candidates()]
            assert len(cheap) == options.count > 0, name
            floor, need = bounds.mesh_floor(options)
            assert floor == min(lb for lb, _ in cheap), (name, options.mesh)
            needs = [x for _, x in cheap if x is not None]
            assert need == (min(needs) if needs else None), (name, options.mesh)
            unfit += math.isinf(floor) and need is not None
    return unfit


def test_a_mesh_where_nothing_fits_is_bounded_by_the_least_state_its_candidates_need(tmp_path: Path) -> None:
    """On 1.2 GB per device the one-device mesh holds no candidate's parameter state: its floor is inf and it
    reports the least bytes of them, as its candidates' own bounds do (the grid's meshes all fit somewhere)."""
    chain = chain_of("gpt", GPT_PARTIAL)
    assert _check_mesh_floors("partial", chain, small_memory(tmp_path, "1.2GB"), 8,
                              SearchSpace(max_microbatch_size=2)) >= 1


def _check_grid(instances) -> tuple[int, int, int, int]:
    checked = estimates = stronger = raised = 0
    for name, chain, cluster, batch, space in instances:
        brute = brute_force(chain, cluster, batch, space)
        stronger += _check_level_one_bound(name, chain, cluster, brute)
        raised += _check_level_two_bound(name, chain, cluster, brute)
        _check_mesh_floors(name, chain, cluster, batch, space)
        result = search(chain, cluster, global_batch=batch, space=space)
        got = result.best.estimate
        assert got.fits, name
        assert result.status == "optimal" and result.optimality_gap == 0.0
        # The search's objective is the estimate of its plan, and it equals the brute-force optimum.
        assert result.best.predicted_step_time_s == pytest.approx(got.step_time_s, rel=1e-9), name
        assert got.step_time_s == pytest.approx(brute.best, rel=1e-9), name
        assert result.lower_bound == pytest.approx(got.step_time_s, rel=1e-9)
        checked += 1
        estimates += brute.estimates
    return checked, estimates, stronger, raised


def test_search_matches_brute_force(tmp_path: Path) -> None:
    """A quick slice of the grid: plain, memory-bound (recomputation decides), a straggler, ranks sharing host
    cores (speeds that change with the schedule's bubbles), uneven virtual stages, every schedule (zero-bubble ones
    included), a memory-bound V-shaped one, two that fit only by offloading to the host and one with the input-gradient
    reductions hidden behind weight-gradient GEMMs, two datacenters behind a slow link, interleaved sends
    overlapped across it, and routed experts whose all-to-alls cross it. On each, the level-1 bound of every
    candidate is below its brute-force optimum."""
    instances = _instances(tmp_path)
    checked, estimates, stronger, raised = _check_grid([instances[i] for i in (0, 4, 7, 8, 10, 11, 12, 13, 14, 15,
                                                                                16, 17, 18)])
    print(f"search == brute force on {checked} instances ({estimates} brute-force estimates); "
          f"{stronger} level-1 bounds stronger with their tp priced; {raised} level-2 bounds set by the end-of-step "
          f"gradient reduction")
    assert checked == 13 and stronger > 0 and raised > 0


@pytest.mark.exhaustive
def test_search_matches_brute_force_on_the_full_grid(tmp_path: Path) -> None:
    """Models (GPT with tied embeddings, Llama with GQA, memory-bound GPT) x clusters (one node, two nodes, small
    memory, mixed device types, a straggler, two datacenters) x global batches: the search's optimum is the brute-force optimum."""
    instances = _instances(tmp_path)
    more = [(f"{name} b{2 * batch}", chain, cluster, 2 * batch, space)
            for name, chain, cluster, batch, space in instances]
    checked, estimates, _, _ = _check_grid(instances + more)
    print(f"search == brute force on {checked} instances ({estimates} brute-force estimates)")
    assert checked == 2 * len(instances)


def test_top_k_are_the_k_best_candidates(tmp_path: Path) -> None:
    chain, cluster, space = chain_of("gpt", GPT_TINY), Cluster.parse("1x4xa100-80gb"), SearchSpace(
        max_microbatch_size=2, max_virtual_stages=2)
    brute = brute_force(chain, cluster, 8, space)
    searched = {c: t for c, t in brute.per_candidate.items() if c.schedule is not Schedule.GPIPE}
    expected = sorted(searched.values())[:4]
    result = search(chain, cluster, global_batch=8, space=space, options=SearchOptions(top_k=4))
    got = [r.estimate.step_time_s for r in result.ranked]
    assert got == pytest.approx(expected, rel=1e-9)
    assert len({r.candidate for r in result.ranked}) == 4


def test_a_relative_gap_stops_within_it_of_the_brute_force_optimum(tmp_path: Path) -> None:
    """With a relative gap the search stops once no bound is left below its best over 1 + gap: its plan is within
    the gap of the brute-force optimum, the lower bound it reports is at most that optimum (so its gap is at most
    gap / (1 + gap)), and it prices no more candidates than the exact search (fewer on some instance)."""
    instances = _instances(tmp_path)
    fewer = 0
    for name, chain, cluster, batch, space in [instances[i] for i in (0, 16)]:
        optimum = brute_force(chain, cluster, batch, space).best
        exact = search(chain, cluster, global_batch=batch, space=space)
        for gap in (0.01, 0.05):
            loose = search(chain, cluster, global_batch=batch, space=space, options=SearchOptions(relative_gap=gap))
            step = loose.best.estimate.step_time_s
            assert loose.status == "optimal", name
            assert optimum * (1 - 1e-9) <= step <= optimum * (1 + gap) * (1 + 1e-9), name
            assert loose.lower_bound <= optimum * (1 + 1e-9), name
            assert loose.optimality_gap <= gap / (1 + gap) + 1e-9, name
            assert loose.candidates <= exact.candidates, name
            fewer += loose.candidates < exact.candidates
    assert fewer >= 1


def test_a_relative_gap_is_a_fraction_below_one() -> None:
    for bad in (-0.01, 1.0, math.inf):
        with pytest.raises(ValueError, match="relative gap"):
            SearchOptions(relative_gap=bad)


@pytest.mark.parametrize("cluster_spec", ["1x4xa100-80gb", "1x4xcpu"])
def test_the_simplest_tied_strategy_is_the_brute_force_one(cluster_spec: str) -> None:
    """With a tie band the search proves, beyond the best, every candidate that could be simpler and tied: its
    lead after `prefer_simplest` is the simplest of all candidates within the band of the optimum."""
    chain, cluster = chain_of("gpt", GPT_TINY), Cluster.parse(cluster_spec)
    space = SearchSpace(max_microbatch_size=2, max_virtual_stages=2)
    brute = brute_force(chain, cluster, 8, space)
    band = error_band(g.device for g in cluster.groups)
    searched = {c: t for c, t in brute.per_candidate.items() if c.schedule is not Schedule.GPIPE}
    best = min(searched.values())
    n_best = next(c for c, t in searched.items() if t == best).mesh.num_devices
    tied = [(simplicity_key(brute.per_strategy[c]), t) for c, t in searched.items()
            if t <= best * (1 + band) and c.mesh.num_devices == n_best]
    result = search(chain, cluster, global_batch=8, space=space, options=SearchOptions(tie_band=band))
    lead = prefer_simplest(result.ranked)[0]
    key, step = min(tied)
    assert simplicity_key(lead.strategy) == key and lead.estimate.step_time_s == pytest.approx(step, rel=1e-9)
    assert len(tied) > 1, "the instance should have ties to choose from"


def test_fixed_dimensions_are_respected_and_optimal() -> None:
    chain, cluster = chain_of("gpt", GPT_TINY), Cluster.parse("1x4xa100-80gb")
    space = SearchSpace.from_fixes(["tp=2", "pp=2", "recompute=full", "mbs=1"], max_virtual_stages=2)
    result = search(chain, cluster, global_batch=8, space=space)
    s = result.best.strategy
    assert (s.tp, s.pp, s.microbatch_size) == (2, 2, 1)
    assert {st.recompute for st in s.stages} == {Recompute.FULL}
    assert result.best.estimate.step_time_s == pytest.approx(brute_force(chain, cluster, 8, space).best, rel=1e-9)


def random_partition(built: StageProblem, cand: Candidate, rng: random.Random
                     ) -> tuple[float, Strategy, list[StageChoice]]:
    """A random partition of a built problem (random cuts, or per rank a random chunk layout, and random
    recomputation): its objective, strategy and stages."""
    problem = built.problem
    if built.layout is not None:
        layout, p = built.layout, problem.num_stages
        while True:  # per rank a random number of larger chunks and lead choice, until they are a layout
            extras = [rng.randint(0, cand.virtual_stages) for _ in range(p)]
            options = [rng.choice(problem.options) for _ in range(p)]
            if sum(extras) == layout.extra and all(
                    layout.fixed or layout.rank_units(k, e, o.endswith("+lead")) is not None
                    for k, (e, o) in enumerate(zip(extras, options, strict=True))):
                break
        starts = [k + sum(extras[:k]) for k in range(p + 1)]
        stages = [StageChoice(starts[k], starts[k + 1], options[k]) for k in range(p)]
    else:
        cuts = sorted(rng.sample(range(1, problem.num_segments), problem.num_stages - 1))
        bounds = [0, *cuts, problem.num_segments]
        stages = [StageChoice(bounds[i], bounds[i + 1], rng.choice(problem.options))
                  for i in range(problem.num_stages)]
    value = evaluate(problem, stages)[0]
    return value, cand.strategy(built.stages(Partition(tuple(stages), value, (), (), 0))), stages


def plain_where_left_out(built: StageProblem, stages: list[StageChoice]) -> float:
    """The objective of the contiguous partition with recomputing nothing on every stage whose entry the problem
    left out (priced only where recomputing nothing does not fit: `stage_problem.recompute_only_adds`)."""
    problem = built.problem
    plain = []
    for k, st in enumerate(stages):
        entry = problem.memory_base[problem.stage_profile[k]][problem.options.index(st.option), st.start, st.stop]
        plain.append(st if math.isfinite(entry) else replace(st, option=Recompute.NONE.value))
    return evaluate(problem, plain)[0]


def test_search_objective_equals_estimate_on_random_partitions(tmp_path: Path) -> None:
    """The partition problem's objective for any partition is `costmodel.estimate` of that strategy."""
    rng = random.Random(11)
    checked = dominated = interleaved = 0
    cases = [(chain_of("gpt", GPT_INTERLEAVE), Cluster.parse("2x4xa100-80gb")),
             (chain_of("gpt", GPT_UNEVEN), Cluster.parse("1x8xa100-80gb")),
             (chain_of("llama", LLAMA_TINY), mixed(tmp_path)),
             (chain_of("gpt", GPT_TINY), yaml_cluster(tmp_path, "dc", """name: dc
groups:
  - device: h100-sxm
    num_nodes: 4
    devices_per_node: 2
tiers:
  - name: node
  - name: datacenter
    size: 4
    bandwidth: 50GB/s
  - name: wan
    bandwidth: 0.5GB/s
    latency: 1ms
"""))]
    for chain, cluster in cases:
        builder = StageProblemBuilder(chain, cluster, LayerCostTable(chain, cluster))
        cands, _ = enumerate_candidates(chain, cluster, 16, SearchSpace(max_microbatch_size=4))
        cands += [replace(c, schedule=Schedule.GPIPE) for c in cands
                  if c.schedule is Schedule.ONE_F_ONE_B and c.mesh.pp > 1]
        # The last stage keeping its returned logits (torchtitan's schedule call) moves its memory terms too.
        cands += [replace(c, runtime=replace(c.runtime, pp_returns_outputs=True)) for c in cands if c.mesh.pp > 1]
        for cand in rng.sample(cands, min(40, len(cands))):
            built = builder.build(cand, tuple(Recompute))
            for _ in range(3):
                value, strategy, stages = random_partition(built, cand, rng)
                est = estimate(chain, cluster, strategy, layer_costs=layer_cost_map(builder, cand, built.placements),
                               global_batch=16)
                if est.fits and not math.isfinite(value) and built.layout is None:
                    # Left out as dominated: recomputing nothing there fits and is at least as fast.
                    assert plain_where_left_out(built, stages) <= est.step_time_s * (1 + 1e-9), cand.label
                    dominated += 1
                    continue
                assert est.fits == math.isfinite(value), (cand.label, est.problems)
                if est.fits:
                    assert value == pytest.approx(est.step_time_s, rel=1e-9), cand.label
                    checked += 1
                    assert stage_peaks(built, stages) == pytest.approx(
                        [s.memory.total for s in est.stages], rel=1e-6), cand.label
                    interleaved += built.layout is not None
    assert checked > 150 and dominated > 10 and interleaved > 100


def stage_peaks(built: StageProblem, stages: list[StageChoice]) -> list[float]:
    """Per pipeline rank of a partition, the peak bytes its problem's memory terms give (pipeline buffers included:
    they depend on the stage's boundaries, which the terms of its layers alone do not know)."""
    problem = built.problem
    out = []
    for k, st in enumerate(stages):
        q, o = problem.stage_profile[k], problem.options.index(st.option)
        out.append(problem.memory_base[q][o, st.start, st.stop]
                   + problem.in_flight[k] * problem.memory_per_microbatch[q][o, st.start, st.stop])
    return out


def test_zero2_under_pipelining_is_zero1_with_more_memory() -> None:
    """Why the search leaves ZeRO-2 out when pp > 1: on the same strategy, every step-time term equals ZeRO-1's
    and every rank holds at least as many bytes."""
    chain, cluster = chain_of("gpt", GPT_INTERLEAVE), Cluster.parse("2x4xa100-80gb")
    builder = StageProblemBuilder(chain, cluster, LayerCostTable(chain, cluster))
    cands, _ = enumerate_candidates(chain, cluster, 16, SearchSpace(max_microbatch_size=4, zero_stage=1))
    rng, checked = random.Random(5), 0
    for cand in [c for c in cands if c.mesh.pp > 1]:
        built = builder.build(cand, tuple(Recompute))
        _, strategy, _ = random_partition(built, cand, rng)
        costs = layer_cost_map(builder, cand, built.placements)
        one = estimate(chain, cluster, strategy, layer_costs=costs, global_batch=16)
        two = estimate(chain, cluster, replace(strategy, zero_stage=2), layer_costs=costs, global_batch=16)
        assert two.step_time_s == one.step_time_s, cand.label
        assert all(b.memory.total >= a.memory.total for a, b in zip(one.stages, two.stages, strict=True))
        assert any(b.memory.total > a.memory.total for a, b in zip(one.stages, two.stages, strict=True))
        checked += 1
    assert checked > 20


def test_search_is_deterministic() -> None:
    chain, cluster = chain_of("gpt", GPT_TINY), Cluster.parse("2x2xh100")
    space = SearchSpace(max_microbatch_size=2)
    a = search(chain, cluster, global_batch=8, space=space, options=SearchOptions(top_k=3))
    b = search(chain, cluster, global_batch=8, space=space, options=SearchOptions(top_k=3))
    assert [r.strategy for r in a.ranked] == [r.strategy for r in b.ranked]
    assert a.alternatives == b.alternatives
    assert (a.candidates, a.pruned, a.status) == (b.candidates, b.pruned, b.status)


def test_nothing_fits_says_the_memory_that_would(tmp_path: Path) -> None:
    chain = chain_of("gpt", GPT_MEMORY)
    # 1.0GB fits by offloading (the parameters, or the optimizer with tp and dp): 0.9GB does not
    with pytest.raises(InfeasibleError, match=r"nothing fits in 0\.84 GiB per device: the least memory any "
                                              r"strategy needs is \d+\.\d\d GiB per device \(dp=") as err:
        search(chain, small_memory(tmp_path, "0.9GB"), global_batch=8)
    assert "what would help: more devices to spread layers" in str(err.value)
    # ...and with that much memory (rounded up to the printed 0.01 GiB) it does fit, with a little less it does not.
    need = float(str(err.value).split("needs is ")[1].split(" GiB")[0])
    assert search(chain, small_memory(tmp_path, f"{(need + 0.01) * 2**30:.0f}"), global_batch=8).best.estimate.fits
    with pytest.raises(InfeasibleError):
        search(chain, small_memory(tmp_path, f"{(need - 0.01) * 2**30:.0f}"), global_batch=8)


def test_empty_space_is_a_user_error() -> None:
    chain, cluster = chain_of("gpt", GPT_TINY), Cluster.parse("1x4xa100-80gb")
    with pytest.raises(UserError, match="no valid strategy: tp=3 does not divide heads=8"):
        search(chain, Cluster.parse("1x3xa100-80gb"), global_batch=8, space=SearchSpace(tp=3))
    with pytest.raises(UserError, match="no valid strategy: dp=3 does not divide the global batch 8"):
        search(chain, cluster, global_batch=8, space=SearchSpace(dp=3))
    with pytest.raises(UserError, match="no strategy matches: pinned: tp=4, pp=2; 4 devices"):
        search(chain, cluster, global_batch=8, space=SearchSpace(tp=4, pp=2))


def test_time_limit_returns_the_best_so_far() -> None:
    chain, cluster = chain_of("gpt", GPT_INTERLEAVE), Cluster.parse("4x8xa100-80gb")
    full = search(chain, cluster, global_batch=64)
    cut = search(chain, cluster, global_batch=64, options=SearchOptions(time_limit_s=1e-9))
    assert cut.status == "feasible" and cut.cut_short
    assert cut.best.estimate.fits
    assert cut.best.objective >= full.best.objective
    assert 0.0 <= cut.optimality_gap < 1.0
    assert cut.lower_bound <= full.best.objective * (1 + 1e-9)


def test_cost_objective_prices_devices_and_may_use_fewer(tmp_path: Path) -> None:
    chain = chain_of("gpt", GPT_TINY)
    cluster = yaml_cluster(tmp_path, "priced", """name: priced
groups:
  - device: a100-80gb
    num_nodes: 4
    devices_per_node: 2
    price_per_device_hour: 3.6
""")
    space = SearchSpace(max_microbatch_size=2, recompute=Recompute.NONE)
    fastest = search(chain, cluster, global_batch=8, space=space)
    cheapest = search(chain, cluster, global_batch=8, space=space, options=SearchOptions(objective="cost"))
    best = cheapest.best
    # cost = step time x devices used x $3.6 per device-hour = step time x devices / 1000 $ per second
    assert best.objective == pytest.approx(best.estimate.step_time_s * best.strategy.num_devices * 1e-3, rel=1e-9)
    fast_cost = fastest.best.estimate.step_time_s * fastest.best.strategy.num_devices * 1e-3
    assert best.objective <= fast_cost * (1 + 1e-9)
    assert best.strategy.num_devices <= fastest.best.strategy.num_devices
    # Exact over its space: no candidate on any whole-node count is cheaper (brute force, per device count).
    brute = brute_force(chain, cluster, 8, space)  # the time objective's space covers 8, 4, 2 and 1 devices
    cheapest_brute = min(t * c.mesh.num_devices * 1e-3 for c, t in brute.per_candidate.items()
                         if c.mesh.num_devices % 2 == 0)  # whole nodes, as the cost objective rents them
    assert best.objective <= cheapest_brute * (1 + 1e-9)
