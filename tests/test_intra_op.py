"""The intra-operator sharding ILP: against brute force, and on traced GPT and Llama blocks (Megatron layouts)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from costmodel.hardware.catalog import get_device
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import CommGroup
from costmodel.layer_pricing import price_segment
from costmodel.sharding.cost import build_sharding_model, make_pricer
from costmodel.sharding.dims import propagate_labels
from costmodel.sharding.layout import Move
from costmodel.sharding.model import Pricer
from costmodel.sharding.problem import FIXED, NO_GRAD, ProblemFlow, ShardingProblem
from costmodel.sharding.rules import StrategyContext, node_strategies
from ir import build_layer_chain, trace
from ir.graph import Node, OpKind, TensorSpec
from models.registry import build_model
from planner.search.intra_op import (
    IntraOpInfeasibleError,
    LayerSharding,
    ShardingCache,
    SolveStatus,
    _build,
    _minimize,
    solve_layer_sharding,
    solve_problem,
    structure_of,
)

# ------------------------------------------------------------------------------------------------ brute force


def brute_force(problem: ShardingProblem) -> int | None:
    """The least objective over every feasible assignment; None when none is feasible."""
    values = [problem.objective(a) for a in itertools.product(*(range(len(c)) for c in problem.node_costs))
              if problem.feasible(a)]
    return min(values, default=None)


def _table(rng: np.random.Generator, n_options: int, n_layouts: int, grads: bool) -> tuple[int, ...]:
    values = rng.integers(0, n_layouts, size=n_options)
    if grads:
        values = np.where(rng.random(n_options) < 0.2, NO_GRAD, values)
    return tuple(int(v) for v in values)


def _pairs(rng: np.random.Generator, n_layouts: int) -> tuple[tuple[int, int, int], ...]:
    return tuple((a, b, int(rng.integers(1, 30))) for a in range(n_layouts) for b in range(n_layouts)
                 if a != b and rng.random() < 0.8)


def random_problem(rng: np.random.Generator) -> ShardingProblem:
    """A random DAG: each node writes a flow read by random later nodes; some flows come from outside (FIXED
    source) or leave the segment (FIXED reader). Small integer costs make ties common."""
    n = int(rng.integers(1, 8))
    options = [int(rng.integers(1, 4)) for _ in range(n)]
    costs = tuple(tuple(int(c) for c in rng.integers(0, 40, size=k)) for k in options)
    k_layouts = int(rng.integers(2, 5))
    flows = []
    sources = [(FIXED, 1)] * int(rng.integers(0, 3)) + [(i, options[i]) for i in range(n)]
    for src, k in sources:
        later = [j for j in range(n) if j > src]
        readers = [j for j in later if rng.random() < 0.5]
        if src == FIXED or rng.random() < 0.3:
            readers.append(FIXED)
        if not readers:
            continue
        def opts(r: int) -> int:
            return 1 if r == FIXED else options[r]
        flows.append(ProblemFlow(
            source=src, source_layouts=_table(rng, k, k_layouts, False),
            source_grads=_table(rng, k, k_layouts, False),
            readers=tuple(readers),
            reader_layouts=tuple(_table(rng, opts(r), k_layouts, False) for r in readers),
            reader_grads=tuple(_table(rng, opts(r), k_layouts, True) for r in readers),
            forward=_pairs(rng, k_layouts), backward=_pairs(rng, k_layouts),
            forbidden=tuple((a, b) for a in range(k_layouts) for b in range(k_layouts) if rng.random() < 0.1)))
    return ShardingProblem(node_costs=costs, flows=tuple(flows))


def test_ilp_matches_brute_force_on_random_problems() -> None:
    rng = np.random.default_rng(20240607)
    checked = infeasible = 0
    for _ in range(200):
        problem = random_problem(rng)
        best = brute_force(problem)
        checked += 1
        if best is None:
            infeasible += 1
            with pytest.raises(IntraOpInfeasibleError, match="no sharding"):
                solve_problem(problem)
            continue
        solution = solve_problem(problem)
        assert solution.objective == best
        assert problem.feasible(solution.assignment)
        assert problem.objective(solution.assignment) == solution.objective
        assert solution.status in (SolveStatus.OPTIMAL, SolveStatus.TRIVIAL)
    print(f"checked {checked} random instances against brute force ({infeasible} infeasible)")
    assert 0 < infeasible < checked // 2


def test_objective_pays_each_layout_pair_once() -> None:
    # one flow from a fixed source read by three nodes wanting layout 1: the forward move 0 -> 1 is paid once
    flow = ProblemFlow(source=FIXED, source_layouts=(0,), source_grads=(0,), readers=(0, 1, 2),
                       reader_layouts=((0, 1),) * 3, reader_grads=((0, 2),) * 3,
                       forward=((0, 1, 100),), backward=((2, 0, 7),))
    problem = ShardingProblem(node_costs=((50, 0),) * 3, flows=(flow,))
    assert problem.objective((1, 1, 1)) == 100 + 7
    assert problem.objective((0, 0, 0)) == 150
    assert solve_problem(problem).assignment == (1, 1, 1)


# ------------------------------------------------------------------------------------------------ hand-built graphs

BF16 = "bfloat16"


def spec(*shape: int, dtype: str = BF16) -> TensorSpec:
    return TensorSpec(tuple(shape), dtype)


def linear(name: str, src: str, x: TensorSpec, out_features: int, flops: int) -> Node:
    out = spec(*x.shape[:-1], out_features)
    return Node(name=name, op_kind=OpKind.LINEAR, target="torch.nn.Linear", module_path=name, inputs=(src,),
                input_specs=(x,), output_specs=(out,), param_names=(f"{name}.weight",),
                param_specs=(spec(out_features, x.shape[-1]),), forward_flops=flops, backward_flops=2 * flops,
                bytes_read=x.nbytes, bytes_written=out.nbytes, saved_bytes=x.nbytes)


def pointwise(name: str, srcs: tuple[str, ...], x: TensorSpec, target: str) -> Node:
    return Node(name=name, op_kind=OpKind.ELEMENTWISE, target=target, module_path="", inputs=srcs,
                input_specs=(x,) * len(srcs), output_specs=(x,), forward_flops=x.numel, backward_flops=x.numel,
                bytes_read=len(srcs) * x.nbytes, bytes_written=x.nbytes, saved_bytes=x.nbytes)


def pricer(ar: float = 2e-9) -> Pricer:
    rates = {Move.ALL_REDUCE: ar, Move.REDUCE_SCATTER: ar / 2, Move.ALL_GATHER: ar / 2, Move.ALL_TO_ALL: ar / 4,
             Move.LOCAL_SLICE: 1e-12, Move.LOCAL_SCALE: 2e-12}

    def node_time(n: Node, fs: float, bs: float, ps: float) -> tuple[float, float]:
        return 1e-6 + n.forward_flops * fs * 1e-12, 1e-6 + n.backward_flops * fs * 1e-12

    return Pricer(node_time=node_time, move_time=lambda m, b: rates[m] * b)


def small_graphs() -> dict[str, tuple[Node, ...]]:
    x, wide = spec(2, 8, 16), spec(2, 8, 64)
    mlp = (linear("up", "x", x, 64, 10**8), pointwise("act", ("up",), wide, "torch.nn.functional.gelu"),
           linear("down", "act", wide, 16, 10**8), pointwise("res", ("x", "down"), x, "operator.add"))
    fan = (linear("a", "x", x, 64, 10**8), linear("b", "x", x, 64, 10**8),
           pointwise("ab", ("a", "b"), wide, "operator.mul"), linear("c", "ab", wide, 16, 10**8),
           pointwise("out", ("c", "x"), x, "operator.add"))
    chain = (linear("l1", "x", x, 16, 10**6), linear("l2", "l1", x, 16, 10**6), linear("l3", "l2", x, 16, 10**6),
             pointwise("s", ("l3", "l1"), x, "operator.add"), linear("l4", "s", x, 16, 10**6))
    return {"mlp": mlp, "fan": fan, "chain": chain}


@pytest.mark.parametrize("name", ["mlp", "fan", "chain"])
@pytest.mark.parametrize(("tp", "sp"), [(2, False), (4, False), (4, True), (8, True)])
@pytest.mark.parametrize("memory_weight", [0.0, 1e-9])
def test_ilp_matches_brute_force_on_priced_graphs(name: str, tp: int, sp: bool, memory_weight: float) -> None:
    nodes = small_graphs()[name]
    model = build_sharding_model(nodes, tp=tp, sequence_parallel=sp, traced_batch=2, microbatch_size=2,
                                 pricer=pricer(), memory_weight=memory_weight)
    problem = model.problem()
    solution = solve_problem(problem)
    assert solution.objective == brute_force(problem)
    assert model.objective_s(solution.assignment) == pytest.approx(solution.objective * 1e-12, abs=1e-9)


def test_memory_weight_trades_time_for_memory() -> None:
    """A small linear with slow links stays replicated on time alone; when memory is expensive it is split."""
    x = spec(2, 8, 16)
    nodes = (linear("fc", "x", x, 16, 10**3),)
    slow = pricer(ar=1e-6)
    fast = build_sharding_model(nodes, tp=4, sequence_parallel=False, traced_batch=2, microbatch_size=2,
                                pricer=slow, memory_weight=0.0)
    assert fast.choices(solve_problem(fast.problem()).assignment) == (("fc", "replicate"),)
    tight = build_sharding_model(nodes, tp=4, sequence_parallel=False, traced_batch=2, microbatch_size=2,
                                 pricer=slow, memory_weight=1e-3)
    assert tight.choices(solve_problem(tight.problem()).assignment) != (("fc", "replicate"),)


def test_sharded_weights_keep_only_the_strategies_that_split_a_weight() -> None:
    """`tp_sharded_weights` (Megatron-LM's and torchtitan's TP plans): a linear is colwise or rowwise, never
    replicated or sequence-sharded with its weight whole; ops without weights keep every strategy."""
    nodes = small_graphs()["mlp"]
    free = build_sharding_model(nodes, tp=4, sequence_parallel=True, traced_batch=2, microbatch_size=2,
                                pricer=pricer())
    split = build_sharding_model(nodes, tp=4, sequence_parallel=True, traced_batch=2, microbatch_size=2,
                                 pricer=pricer(), sharded_weights=True)
    for node, before, after in zip(nodes, free.options, split.options, strict=True):
        names = {o.strategy.name for o in after}
        if node.op_kind is OpKind.LINEAR:
            assert {o.strategy.name for o in before} >= {"replicate", "sequence"}
            assert names and names <= {"colwise", "rowwise"}
        else:
            assert names == {o.strategy.name for o in before}
    chosen = dict(split.choices(solve_problem(split.problem()).assignment))
    assert {chosen[n.name] for n in nodes if n.op_kind is OpKind.LINEAR} == {"colwise", "rowwise"}


def test_too_small_a_time_limit_raises_a_user_error() -> None:
    model = build_sharding_model(small_graphs()["mlp"], tp=4, sequence_parallel=True, traced_batch=2,
                                 microbatch_size=2, pricer=pricer())
    with pytest.raises(IntraOpInfeasibleError, match="raise the time limit"):
        solve_problem(model.problem(), time_limit=0.0)


# ------------------------------------------------------------------------------------------------ traced blocks

CLUSTER = "1x8xa100-80gb"
GPT = ("layers=2", "hidden=2048", "heads=16", "seq=2048", "vocab=50304")
LLAMA = ("layers=2", "hidden=2048", "heads=16", "kv_heads=8", "ffn_hidden=5632", "seq=2048", "vocab=32000")


def _chain(name: str, sets: tuple[str, ...]):
    built = build_model(name, sets, batch=1)
    return build_layer_chain(trace(built.module, built.example_inputs, model_name=name))


@pytest.fixture(scope="module")
def gpt_chain():
    return _chain("gpt", GPT)


@pytest.fixture(scope="module")
def gpt_math_chain():
    return _chain("gpt", (*GPT, "attn_impl=math"))


@pytest.fixture(scope="module")
def llama_chain():
    return _chain("llama", LLAMA)


@pytest.fixture(scope="module")
def a100():
    return Cluster.parse(CLUSTER), get_device("a100-80gb")


def solve_block(chain, a100, tp: int, sp: bool | None, segment: int = 1, **kw) -> LayerSharding:
    cluster, device = a100
    return solve_layer_sharding(chain.nodes_of(segment), cluster, device, tp=tp, tp_group=CommGroup(tp),
                                microbatch_size=1, traced_batch=chain.graph.batch_size, sequence_parallel=sp, **kw)


def assert_megatron(ls: LayerSharding, sp: bool, mlp: tuple[str, ...]) -> None:
    styles = dict(ls.styles)
    for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", *mlp):
        assert styles[m] == "colwise", (m, ls.explain())
    assert styles["attn.o_proj"] == "rowwise" and styles["mlp.down_proj"] == "rowwise", ls.explain()
    assert styles["attn"] == "heads"
    norm = "sequence" if sp else "replicate"
    assert styles["attn_norm"] == norm and styles["mlp_norm"] == norm, ls.explain()
    for direction in ("forward", "backward"):
        if sp:  # Korthikanti et al. 2022 Fig. 5: g = all-gather / reduce-scatter, g-bar its dual
            counts = (ls.count("all_gather", direction), ls.count("reduce_scatter", direction),
                      ls.count("all_reduce", direction))
            assert counts == (2, 2, 0), ls.explain()
        else:  # Shoeybi et al. 2019 Fig. 3: one all-reduce per attention and per MLP, each way
            counts = (ls.count("all_reduce", direction), ls.count("all_gather", direction),
                      ls.count("reduce_scatter", direction))
            assert counts == (2, 0, 0), ls.explain()
    assert ls.status is SolveStatus.OPTIMAL


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_block_gets_the_megatron_layout(gpt_chain, a100, tp: int, sp: bool) -> None:
    ls = solve_block(gpt_chain, a100, tp, sp)
    assert ls.sequence_parallel is sp
    assert_megatron(ls, sp, mlp=("mlp.up_proj",))
    assert ls.choice("scaled_dot_product_attention") == "heads"


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_block_with_explicit_attention_gets_the_megatron_layout(gpt_math_chain, a100, tp: int,
                                                                     sp: bool) -> None:
    """Megatron's own attention (QK^T, scale, causal mask, softmax, dropout, AV as separate ops): every op of
    the core runs on its heads shard, and the mask built from the scores' shape costs no communication."""
    ls = solve_block(gpt_math_chain, a100, tp, sp)
    assert_megatron(ls, sp, mlp=("mlp.up_proj",))
    core = [n for n in gpt_math_chain.nodes_of(1) if n.attr("attention_core")]
    assert len(core) >= 5 and all(ls.choice(n.name) == "S(1)" for n in core), ls.explain()


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_llama_block_gets_the_megatron_layout(llama_chain, a100, tp: int, sp: bool) -> None:
    ls = solve_block(llama_chain, a100, tp, sp)
    assert_megatron(ls, sp, mlp=("mlp.gate_proj", "mlp.up_proj"))


def test_megatron_block_memory_matches_korthikanti(gpt_chain, a100) -> None:
    """Per-device activations of a GPT block (flash attention, no dropout), in bf16 elements of s*b*h (b = 1):
    Korthikanti et al. 2022 eq. 2 keeps the norm inputs and the q/k/v and MLP inputs replicated (here 4sbh: no
    dropout masks) and shards the rest (here 12sbh/t: q, k, v, attention output, GELU input and output; no
    5as^2b score term, which flash attention does not store). With sequence parallelism everything is split
    (eq. 4: 16sbh/t), the column-parallel inputs too: Megatron's linear keeps their all-gathered input as the
    shard (§4.2.2, `LayerCost.regathered`); DTensor keeps the two gathered inputs whole (2sbh more, less 2sbh/t)."""
    s, h = 2048, 2048
    for tp in (2, 8):
        plain = solve_block(gpt_chain, a100, tp, False).cost
        with_sp = solve_block(gpt_chain, a100, tp, True).cost
        # small fp32 terms: SDPA's logsumexp (heads x seq, split with the heads) and each LayerNorm's mean and
        # rstd (2 x seq, split only under SP); the trace is fp32, so everything is converted to bf16 alike
        lse, norm_stats = 16 * s * 2 / tp, 2 * 2 * s * 2
        assert plain.saved_bytes_none == plain.regathered().saved_bytes_none
        assert plain.saved_bytes_none == 2 * (4 * s * h + 12 * s * h / tp) + lse + norm_stats
        assert with_sp.regathered().saved_bytes_none == 2 * 16 * s * h / tp + lse + norm_stats / tp
        assert with_sp.saved_bytes_none == with_sp.regathered().saved_bytes_none + 2 * 2 * s * h * (1 - 1 / tp)


def test_sequence_parallel_none_keeps_the_cheaper(gpt_chain, a100) -> None:
    auto = solve_block(gpt_chain, a100, 4, None)
    plain, sp = solve_block(gpt_chain, a100, 4, False), solve_block(gpt_chain, a100, 4, True)
    assert auto.objective_s == min(plain.objective_s, sp.objective_s)
    assert auto.sequence_parallel is (sp.objective_s < plain.objective_s)


def test_tp1_is_replicated_and_matches_layer_pricing(gpt_chain, a100) -> None:
    ls = solve_block(gpt_chain, a100, 1, None)
    assert ls.status is SolveStatus.TRIVIAL and not ls.collectives
    assert {s for _, s in ls.choices} == {"replicate"}
    ref = price_segment(gpt_chain, gpt_chain.segments[1], a100[1], microbatch_size=1)
    for f in ("fwd_compute_s", "bwd_compute_s", "recompute_selective_s", "recompute_full_s"):
        assert getattr(ls.cost, f) == pytest.approx(getattr(ref, f)), f
    for f in ("param_count", "param_bytes", "saved_bytes_none", "saved_bytes_selective", "saved_bytes_full",
              "boundary_bytes", "peak_temp_bytes"):
        assert getattr(ls.cost, f) == getattr(ref, f), f
    assert ls.cost.fwd_comm_s == ls.cost.bwd_comm_s == 0.0 and ls.cost.grad_sync_bytes == 0


def test_head_sharding_not_offered_when_heads_do_not_divide(a100) -> None:
    chain = _chain("gpt", ("layers=1", "hidden=1536", "heads=12", "seq=1024", "vocab=1000"))
    nodes = chain.nodes_of(1)
    sdpa = next(n for n in nodes if n.op_kind is OpKind.ATTENTION)
    labels = propagate_labels(nodes, chain.graph.batch_size)
    in_labels = tuple(labels[i] for i in sdpa.inputs)
    offered = {s.name for s in node_strategies(sdpa, StrategyContext(8, False, in_labels, labels[sdpa.name]))}
    assert offered == {"replicate"}
    assert "heads" in {s.name for s in node_strategies(sdpa, StrategyContext(4, False, in_labels,
                                                                             labels[sdpa.name]))}
    ls = solve_block(chain, a100, 8, False)
    assert ls.choice(sdpa.name) == "replicate" and "heads" not in dict(ls.styles).values()


def test_identical_blocks_share_one_solve(gpt_chain, a100) -> None:
    cache = ShardingCache()
    first = solve_block(gpt_chain, a100, 4, True, segment=1, cache=cache)
    second = solve_block(gpt_chain, a100, 4, True, segment=2, cache=cache)
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    assert second.cost == first.cost and second.styles == first.styles
    assert second.solve_time_s == 0.0
    names = [n.name for n in gpt_chain.nodes_of(2)]
    assert [n for n, _ in second.choices] == names
    assert [s for _, s in second.choices] == [s for _, s in first.choices]
    assert all(t in names or t not in [n.name for n in gpt_chain.nodes_of(1)] for t, _, _ in second.collectives)


def test_settings_with_the_same_tokens_share_one_solve(gpt_chain, a100) -> None:
    """A context-parallel group holding half of 2 samples prices what a group holding 1 whole sample does."""
    cluster, device = a100

    def solve(mbs: int, divisor: int, cache: ShardingCache | None) -> LayerSharding:
        return solve_layer_sharding(gpt_chain.nodes_of(1), cluster, device, tp=4, tp_group=CommGroup(4),
                                    microbatch_size=mbs, traced_batch=gpt_chain.graph.batch_size,
                                    sequence_parallel=True, token_divisor=divisor, cache=cache)

    cache = ShardingCache()
    whole = solve(1, 1, cache)
    halves = solve(2, 2, cache)
    assert (cache.misses, cache.hits) == (1, 1)
    assert halves.cost == whole.cost and halves.choices == whole.choices
    fresh = solve(2, 2, None)
    assert (fresh.cost, fresh.choices, fresh.collectives) == (halves.cost, halves.choices, halves.collectives)
    doubled = solve(2, 1, cache)
    assert cache.misses == 2 and doubled.cost.fwd_compute_s > whole.cost.fwd_compute_s


def test_a_model_reused_for_other_prices_is_the_model_a_fresh_build_makes(gpt_chain, a100) -> None:
    """The CP-SAT model of a problem structure, built for one micro-batch size and given another's prices, is
    the model built for those prices from scratch (same proto), so it finds the same assignment."""
    cluster, device = a100
    pricer = make_pricer(cluster, device, CommGroup(4))

    def problem(mbs: int) -> ShardingProblem:
        return build_sharding_model(gpt_chain.nodes_of(1), tp=4, sequence_parallel=True, microbatch_size=mbs,
                                    traced_batch=gpt_chain.graph.batch_size, pricer=pricer).problem()

    one, four = problem(1), problem(4)
    assert structure_of(one) == structure_of(four) and one != four
    models: dict = {}
    first = solve_problem(one, models=models)
    reused = solve_problem(four, models=models)
    assert len(models) == 1
    (built,) = models.values()
    fresh = _build(four)
    _minimize(fresh, four)
    assert str(built.model.Proto()) == str(fresh.model.Proto())
    assert reused == solve_problem(four) and first == solve_problem(one)


def test_solving_a_gpt_block_is_fast_and_deterministic(gpt_chain, a100) -> None:
    times = {}
    for sp in (False, True):
        start = time.process_time()
        ls = solve_block(gpt_chain, a100, 8, sp)
        times[sp] = time.process_time() - start
        assert solve_block(gpt_chain, a100, 8, sp) == ls
    print(f"GPT block (h=2048, s=2048) tp=8 solve: {times[False]:.3f} s, with SP {times[True]:.3f} s")
    assert max(times.values()) < 1.0


def test_bad_settings_are_refused_with_the_reason(gpt_chain, a100) -> None:
    cluster, device = a100
    nodes = gpt_chain.nodes_of(1)
    common = dict(microbatch_size=1, traced_batch=1)
    with pytest.raises(ValueError, match="tp_group has 2 ranks but tp=4"):
        solve_layer_sharding(nodes, cluster, device, tp=4, tp_group=CommGroup(2), **common)
    with pytest.raises(ValueError, match="sequence parallelism needs tp > 1"):
        solve_layer_sharding(nodes, cluster, device, tp=1, tp_group=CommGroup(1), sequence_parallel=True, **common)
    with pytest.raises(ValueError, match="not nodes of the segment"):
        solve_layer_sharding(nodes, cluster, device, tp=2, tp_group=CommGroup(2), outputs=("nope",), **common)
    with pytest.raises(ValueError, match="microbatch_size must be a positive integer"):
        solve_layer_sharding(nodes, cluster, device, tp=2, tp_group=CommGroup(2), microbatch_size=0,
                             traced_batch=1)


def test_module_styles_are_plan_entries(gpt_chain, a100) -> None:
    ls = solve_block(gpt_chain, a100, 4, False)
    entries = {m.module: m.style.value for m in ls.module_styles()}
    assert ls.module_prefix == "blocks.0"
    assert entries == {"attn_norm": "replicate", "attn.q_proj": "colwise", "attn.k_proj": "colwise",
                       "attn.v_proj": "colwise", "attn": "heads", "attn.o_proj": "rowwise",
                       "mlp_norm": "replicate", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}
    assert "colwise" in ls.explain() and "all_reduce" in ls.explain()
