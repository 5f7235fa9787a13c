"""Layout algebra, per-node strategies, resharding duals and pricing of costmodel.sharding.layout, checked by hand."""

from __future__ import annotations

import math

import pytest

from costmodel.sharding.cost import (
    boundary_layout,
    build_sharding_model,
    saved_fraction,
    shape_only_reads,
    structural_key,
)
from costmodel.sharding.dims import DimLabel, input_dim_maps, op_name
from costmodel.sharding.layout import (
    PARTIAL,
    REPLICATED,
    Layout,
    Move,
    allowed_inside,
    grad_layout_of,
    redistribution,
    shard,
)
from costmodel.sharding.model import Pricer
from costmodel.sharding.rules import NodeStrategy, StrategyContext, node_strategies
from ir.graph import Node, OpKind, TensorSpec

BF16 = "bfloat16"


def spec(*shape: int, dtype: str = BF16) -> TensorSpec:
    return TensorSpec(tuple(shape), dtype)


def node(name: str, kind: OpKind, inputs: tuple[str, ...], in_specs: tuple[TensorSpec, ...], out: TensorSpec, *,
         target: str = "", params: tuple[TensorSpec, ...] = (), flops: int = 0, saved: int = 0,
         module: str = "", attrs: tuple = ()) -> Node:
    return Node(name=name, op_kind=kind, target=target or kind.value, module_path=module, inputs=inputs,
                input_specs=in_specs, output_specs=(out,), param_names=tuple(f"{name}.p{i}" for i in range(len(params))),
                param_specs=params, forward_flops=flops, backward_flops=2 * flops,
                bytes_read=sum(s.nbytes for s in in_specs), bytes_written=out.nbytes, saved_bytes=saved,
                attrs=tuple(sorted(attrs)))


def linear(name: str, src: str, x: TensorSpec, out_features: int, *, flops: int = 10**9, bias: bool = True,
           module: str = "") -> Node:
    in_features = x.shape[-1]
    params = (spec(out_features, in_features),) + ((spec(out_features),) if bias else ())
    return node(name, OpKind.LINEAR, (src,), (x,), spec(*x.shape[:-1], out_features), target="torch.nn.Linear",
                params=params, flops=flops, saved=x.nbytes, module=module or name,
                attrs=(("in_features", in_features), ("out_features", out_features)))


def ctx(tp: int, in_labels: tuple, out_labels: tuple, sp: bool = False) -> StrategyContext:
    return StrategyContext(tp=tp, sequence_parallel=sp, in_labels=in_labels, out_labels=out_labels)


B, S, SEQ3 = DimLabel.BATCH, DimLabel.SEQ, (DimLabel.BATCH, DimLabel.SEQ, None)

# Seconds per byte of each move in the hand-priced tests (all-reduce = reduce-scatter + all-gather, as a ring).
RATE = {Move.ALL_REDUCE: 2e-9, Move.REDUCE_SCATTER: 1e-9, Move.ALL_GATHER: 1e-9, Move.ALL_TO_ALL: 0.5e-9,
        Move.LOCAL_SLICE: 0.0, Move.LOCAL_SCALE: 0.0}


def flat_pricer() -> Pricer:
    """Compute: 1 ps per FLOP plus 1 us per node; moves: RATE per byte."""
    def node_time(n: Node, fs: float, bs: float, ps: float) -> tuple[float, float]:
        return n.forward_flops * fs * 1e-12 + 1e-6, n.backward_flops * fs * 1e-12 + 1e-6

    return Pricer(node_time=node_time, move_time=lambda m, nbytes: RATE[m] * nbytes)


# ------------------------------------------------------------------------------------------------ layout algebra

def test_layout_text_round_trips_and_rejects_bad_text() -> None:
    for text in ("R", "P", "S(0)", "S(3)"):
        assert str(Layout.parse(text)) == text
    with pytest.raises(ValueError, match="valid: R, P, S"):
        Layout.parse("Q")
    with pytest.raises(ValueError):
        Layout(Layout.parse("R").kind, 2)


def test_redistribution_table() -> None:
    s0, s2 = shard(0), shard(2)
    assert redistribution(PARTIAL, REPLICATED) == (Move.ALL_REDUCE,)
    assert redistribution(PARTIAL, s2) == (Move.REDUCE_SCATTER,)
    assert redistribution(s2, REPLICATED) == (Move.ALL_GATHER,)
    assert redistribution(s0, s2) == (Move.ALL_TO_ALL,)
    assert redistribution(REPLICATED, s2) == (Move.LOCAL_SLICE,)
    assert redistribution(REPLICATED, PARTIAL) == (Move.LOCAL_SCALE,)
    assert redistribution(s2, PARTIAL) == (Move.ALL_GATHER, Move.LOCAL_SCALE)
    for lay in (REPLICATED, PARTIAL, s0):
        assert redistribution(lay, lay) == ()


def test_only_module_boundary_collectives_are_allowed_inside_a_segment() -> None:
    assert allowed_inside(PARTIAL, REPLICATED) and allowed_inside(PARTIAL, shard(1))
    assert allowed_inside(shard(2), REPLICATED) and allowed_inside(REPLICATED, REPLICATED)
    assert not allowed_inside(REPLICATED, shard(2))   # a local slice: no parallel style makes one
    assert not allowed_inside(REPLICATED, PARTIAL)
    assert not allowed_inside(shard(1), shard(2))     # all-to-all


def test_gradient_duals() -> None:
    assert grad_layout_of(PARTIAL) == REPLICATED
    assert grad_layout_of(REPLICATED) == REPLICATED
    assert grad_layout_of(shard(1)) == shard(1)


def test_boundary_layout_shards_only_batch_seq_hidden_under_sp() -> None:
    x = spec(2, 8, 16)
    assert boundary_layout(x, SEQ3, 4, True) == shard(1)
    assert boundary_layout(x, SEQ3, 4, False) == REPLICATED
    assert boundary_layout(spec(2, 6, 16), SEQ3, 4, True) == REPLICATED  # 6 % 4
    assert boundary_layout(spec(2, 8, dtype="int64"), (B, S), 4, True) == REPLICATED


# ------------------------------------------------------------------------------------------------ dim maps

def _view(src: TensorSpec, out: TensorSpec, target: str, attrs: tuple = ()) -> Node:
    return node("v", OpKind.VIEW, ("x",), (src,), out, target=target, attrs=attrs)


@pytest.mark.parametrize(("target", "src", "out", "expected"), [
    ("Tensor.view", (2, 8, 64), (2, 8, 4, 16), {0: 0, 1: 1, 2: 2}),      # split hidden into heads x head_dim
    ("Tensor.reshape", (2, 8, 4, 16), (2, 8, 64), {0: 0, 1: 1, 2: 2}),   # merge heads back
    ("Tensor.view", (2, 8, 64), (16, 64), {0: 0, 2: 1}),                 # flatten tokens
    ("Tensor.unsqueeze", (2, 8), (2, 1, 8), {0: 0, 1: 2}),
    ("Tensor.transpose", (2, 8, 4, 16), (2, 4, 8, 16), {0: 0, 1: 2, 2: 1, 3: 3}),
    ("Tensor.transpose", (2, 4, 4, 16), (2, 4, 4, 16), {0: 0, 1: 2, 2: 1, 3: 3}),  # the one swap that fits
    ("Tensor.transpose", (2, 4, 4, 4), (2, 4, 4, 4), {0: 0}),         # three equal sizes: ambiguous, unmapped
    ("Tensor.repeat_interleave", (2, 2, 8, 16), (2, 4, 8, 16), {0: 0, 1: 1, 2: 2, 3: 3}),
    ("Tensor.expand", (1, 8, 16), (2, 8, 16), {1: 1, 2: 2}),
    ("operator.getitem", (2, 8, 48), (2, 8, 16), {0: 0, 1: 1}),
])
def test_view_dim_maps(target: str, src: tuple, out: tuple, expected: dict) -> None:
    assert dict(input_dim_maps(_view(spec(*src), spec(*out), target))[0]) == expected


def test_permute_uses_recorded_dims_when_shapes_are_ambiguous() -> None:
    n = _view(spec(2, 4, 4, 4), spec(2, 4, 4, 4), "Tensor.transpose", attrs=(("dim0", 1), ("dim1", 2)))
    assert dict(input_dim_maps(n)[0]) == {0: 0, 1: 2, 2: 1, 3: 3}


def test_op_name_normalizes_targets() -> None:
    for target in ("operator.add", "<built-in function add>", "aten.add.Tensor", "Tensor.add_", "torch.add"):
        assert op_name(target) == "add"


# ------------------------------------------------------------------------------------------------ strategies

def _names(strats: tuple[NodeStrategy, ...]) -> list[str]:
    return [s.name for s in strats]


def test_linear_strategies_and_gradient_layouts() -> None:
    n = linear("fc", "x", spec(2, 8, 16), 64)
    strats = {s.name: s for s in node_strategies(n, ctx(4, (SEQ3,), SEQ3))}
    assert list(strats) == ["replicate", "colwise", "rowwise"]
    col, row = strats["colwise"], strats["rowwise"]
    assert (col.inputs, col.output, col.input_grads, col.param_dims) == ((REPLICATED,), shard(2), (PARTIAL,), (0, 0))
    assert (row.inputs, row.output, row.input_grads, row.param_dims) == ((shard(2),), PARTIAL, (shard(2),), (1, None))
    assert col.work_fraction == row.work_fraction == 0.25
    with_sp = _names(node_strategies(n, ctx(4, (SEQ3,), SEQ3, sp=True)))
    assert with_sp == ["replicate", "colwise", "rowwise", "sequence"]
    assert _names(node_strategies(n, ctx(1, (SEQ3,), SEQ3, sp=False))) == ["replicate"]


def test_linear_not_split_where_features_do_not_divide() -> None:
    n = linear("fc", "x", spec(2, 8, 6), 10)
    assert _names(node_strategies(n, ctx(4, (SEQ3,), SEQ3))) == ["replicate"]


def _sdpa(q_heads: int, kv_heads: int, tp: int) -> tuple[NodeStrategy, ...]:
    q, kv = spec(2, q_heads, 8, 16), spec(2, kv_heads, 8, 16)
    n = node("attn", OpKind.ATTENTION, ("q", "k", "v"), (q, kv, kv), q,
             target="torch.nn.functional.scaled_dot_product_attention",
             attrs=(("num_heads", q_heads), ("attention_core", True)))
    labels = (B, None, None, None)
    return node_strategies(n, ctx(tp, (labels,) * 3, labels))


def test_attention_head_sharding_needs_divisible_heads() -> None:
    heads = {s.name: s for s in _sdpa(8, 8, 4)}["heads"]
    assert heads.inputs == (shard(1),) * 3 and heads.output == shard(1) and heads.style == "heads"
    assert _names(_sdpa(6, 6, 4)) == ["replicate"]  # 6 heads over 4 ranks
    assert _names(_sdpa(8, 2, 4)) == ["replicate"]  # grouped-query: 2 kv heads over 4 ranks
    assert _names(_sdpa(6, 6, 2)) == ["replicate", "heads"]


def test_norm_and_softmax_never_shard_their_reduced_dim() -> None:
    x = spec(2, 8, 16)
    ln = node("ln", OpKind.NORM, ("x",), (x,), x, target="torch.nn.LayerNorm", params=(spec(16), spec(16)),
              attrs=(("dim", -1), ("norm_type", "layer"), ("normalized_ndim", 1)))
    assert _names(node_strategies(ln, ctx(4, (SEQ3,), SEQ3))) == ["replicate"]
    sp = {s.name: s for s in node_strategies(ln, ctx(4, (SEQ3,), SEQ3, sp=True))}
    assert list(sp) == ["replicate", "S(1)"] and sp["S(1)"].style == "sequence"
    scores = spec(2, 4, 8, 8)
    sm = node("sm", OpKind.SOFTMAX, ("s",), (scores,), scores, attrs=(("dim", -1),))
    labels = (B, None, None, None)
    assert _names(node_strategies(sm, ctx(4, (labels,), labels))) == ["replicate", "S(1)", "S(2)"]


def test_partial_passes_only_through_linear_elementwise_ops() -> None:
    x = spec(2, 8, 16)
    labels = (SEQ3, SEQ3)
    add = node("add", OpKind.ELEMENTWISE, ("a", "b"), (x, x), x, target="operator.add")
    gelu = node("g", OpKind.ELEMENTWISE, ("a",), (x,), x, target="torch.nn.functional.gelu")
    scale = node("m", OpKind.ELEMENTWISE, ("a",), (x,), x, target="operator.mul")
    add_one = node("a1", OpKind.ELEMENTWISE, ("a",), (x,), x, target="operator.add")  # x + 1.0: not linear
    assert "P" in _names(node_strategies(add, ctx(4, labels, SEQ3)))
    assert {s.name: s for s in node_strategies(add, ctx(4, labels, SEQ3))}["P"].input_grads == (REPLICATED,) * 2
    assert "P" not in _names(node_strategies(gelu, ctx(4, labels[:1], SEQ3)))
    assert "P" in _names(node_strategies(scale, ctx(4, labels[:1], SEQ3)))
    assert "P" not in _names(node_strategies(add_one, ctx(4, labels[:1], SEQ3)))


def test_broadcast_input_of_a_sharded_op_gets_a_partial_gradient() -> None:
    x, bias = spec(2, 8, 16), spec(16)
    add = node("add", OpKind.ELEMENTWISE, ("a", "b"), (x, bias), x, target="operator.add")
    by_name = {s.name: s for s in node_strategies(add, ctx(4, (SEQ3, (None,)), SEQ3, sp=True))}
    assert by_name["S(1)"].inputs == (shard(1), REPLICATED)
    assert by_name["S(1)"].input_grads == (shard(1), PARTIAL)
    assert by_name["S(2)"].inputs == (shard(2), shard(0))


def test_embedding_strategies() -> None:
    ids, out = spec(2, 8, dtype="int64"), spec(2, 8, 16)
    emb = node("wte", OpKind.EMBEDDING, ("ids",), (ids,), out, target="torch.nn.Embedding", params=(spec(100, 16),))
    by_name = {s.name: s for s in node_strategies(emb, ctx(4, ((B, S),), SEQ3))}
    assert list(by_name) == ["replicate", "vocab"]  # rows only: a tied LM head splits the same rows
    assert by_name["vocab"].output == PARTIAL and by_name["vocab"].param_dims == (0,)
    assert by_name["vocab"].input_grads == (None,)  # ids are integers


def test_saved_fraction_follows_what_the_node_saves() -> None:
    x = spec(2, 8, 16)
    fc = linear("fc", "x", x, 64)  # saves its input
    col, row = node_strategies(fc, ctx(4, (SEQ3,), SEQ3))[1:3]
    assert saved_fraction(fc, col, 4) == 1.0   # the replicated input is kept whole (Korthikanti's "10" term)
    assert saved_fraction(fc, row, 4) == 0.25


# ------------------------------------------------------------------------------------------------ pricing by hand

def mlp_nodes(h: int = 16, ffn: int = 64, seq: int = 8) -> tuple[Node, ...]:
    x = spec(2, seq, h)
    up = linear("up", "x", x, ffn)
    act = node("act", OpKind.ELEMENTWISE, ("up",), (up.output_specs[0],), up.output_specs[0],
               target="torch.nn.functional.gelu", flops=10, saved=up.output_specs[0].nbytes)
    down = linear("down", "act", act.output_specs[0], h)
    return up, act, down


def _solve_by_enumeration(model):  # small graphs only
    import itertools

    problem = model.problem()
    best = min(itertools.product(*(range(len(c)) for c in problem.node_costs)), key=problem.objective)
    return best


def test_megatron_mlp_costs_one_all_reduce_each_way() -> None:
    nodes = mlp_nodes()
    model = build_sharding_model(nodes, tp=4, sequence_parallel=False, traced_batch=2, microbatch_size=2,
                                 pricer=flat_pricer())
    best = _solve_by_enumeration(model)
    assert [c for _, c in model.choices(best)] == ["colwise", "S(2)", "rowwise"]
    act_bytes = 2 * 8 * 16 * 2
    cost = model.layer_cost(best)
    assert cost.fwd_comm_s == pytest.approx(RATE[Move.ALL_REDUCE] * act_bytes)   # g: all-reduce of down's output
    assert cost.bwd_comm_s == pytest.approx(RATE[Move.ALL_REDUCE] * act_bytes)   # f: all-reduce of dL/dx
    assert [(t, d, m) for t, d, m in model.comm_moves(best)] == [("x", "backward", Move.ALL_REDUCE),
                                                                ("down", "forward", Move.ALL_REDUCE)]
    w = 64 * 16 + 64 + 16 * 64
    assert cost.param_count == w // 4 + 16 and cost.grad_sync_bytes == 0
    assert cost.fwd_compute_s == pytest.approx(3e-6 + 2 * 10**9 * 1e-12 / 4 + 10 * 1e-12 / 4)


def test_sequence_parallel_mlp_turns_all_reduces_into_gather_and_scatter() -> None:
    model = build_sharding_model(mlp_nodes(), tp=4, sequence_parallel=True, traced_batch=2, microbatch_size=2,
                                 pricer=flat_pricer())
    best = _solve_by_enumeration(model)
    assert [c for _, c in model.choices(best)] == ["colwise", "S(2)", "rowwise"]
    assert sorted((t, d, str(m)) for t, d, m in model.comm_moves(best)) == [
        ("down", "backward", "all_gather"), ("down", "forward", "reduce_scatter"),
        ("x", "backward", "reduce_scatter"), ("x", "forward", "all_gather")]
    cost = model.layer_cost(best)
    assert cost.boundary_bytes == 2 * 8 * 16 * 2 // 4 and cost.saved_bytes_full == 2 * 8 * 16 * 2 // 4


def test_fan_out_gradients_are_summed_before_one_all_reduce() -> None:
    x = spec(2, 8, 16)
    ln = node("ln", OpKind.NORM, ("x",), (x,), x, target="torch.nn.LayerNorm", params=(spec(16),),
              attrs=(("dim", -1), ("norm_type", "layer")), flops=100, saved=x.nbytes)
    q, k = linear("q", "ln", x, 64), linear("k", "ln", x, 64)
    mul = node("qk", OpKind.ELEMENTWISE, ("q", "k"), (q.output_specs[0],) * 2, q.output_specs[0],
               target="operator.mul", saved=2 * q.output_specs[0].nbytes)
    o = linear("o", "qk", q.output_specs[0], 16)
    model = build_sharding_model((ln, q, k, mul, o), tp=2, sequence_parallel=False, traced_batch=2,
                                 microbatch_size=2, pricer=flat_pricer())
    best = _solve_by_enumeration(model)
    assert [c for _, c in model.choices(best)] == ["replicate", "colwise", "colwise", "S(2)", "rowwise"]
    moves = model.comm_moves(best)
    assert moves.count(("ln", "backward", Move.ALL_REDUCE)) == 1
    assert model.layer_cost(best).bwd_comm_s == pytest.approx(RATE[Move.ALL_REDUCE] * x.nbytes)


def test_sequence_sharded_norm_needs_a_gradient_sync_of_its_weight() -> None:
    x = spec(2, 8, 16)
    ln = node("ln", OpKind.NORM, ("x",), (x,), x, target="torch.nn.LayerNorm", params=(spec(16), spec(16)),
              attrs=(("dim", -1), ("norm_type", "layer")), flops=10**9, saved=x.nbytes)
    model = build_sharding_model((ln,), tp=4, sequence_parallel=True, traced_batch=2, microbatch_size=2,
                                 pricer=flat_pricer(), num_microbatches=4)
    seq = next(i for i, o in enumerate(model.options[0]) if o.strategy.name == "S(1)")
    opt = model.options[0][seq]
    assert opt.grad_sync_bytes == 2 * 16 * 2
    assert opt.grad_sync_s == pytest.approx(RATE[Move.ALL_REDUCE] * 64 / 4)
    assert model.layer_cost((seq,)).saved_bytes_none == x.nbytes // 4


def test_microbatch_scales_bytes_and_compute() -> None:
    nodes = mlp_nodes()
    one = build_sharding_model(nodes, tp=2, sequence_parallel=False, traced_batch=2, microbatch_size=2,
                               pricer=flat_pricer())
    two = build_sharding_model(nodes, tp=2, sequence_parallel=False, traced_batch=2, microbatch_size=4,
                               pricer=flat_pricer())
    a = (1, 1, 2)
    c1, c2 = one.layer_cost(a), two.layer_cost(a)
    assert c2.fwd_comm_s == pytest.approx(2 * c1.fwd_comm_s)
    assert c2.saved_bytes_none == 2 * c1.saved_bytes_none
    assert c2.param_count == c1.param_count
    assert math.isclose(c2.fwd_compute_s - 3e-6, 2 * (c1.fwd_compute_s - 3e-6))


def test_structural_key_ignores_names_but_not_shapes() -> None:
    a = mlp_nodes()
    renamed = tuple(Node.from_dict({**n.to_dict(), "name": "b_" + n.name, "module_path": ".".join(p for p in ("blocks.1", n.module_path) if p),
                                    "inputs": ["b_" + i if i != "x" else "y" for i in n.inputs]}) for n in a)
    assert structural_key(a) == structural_key(renamed)
    assert structural_key(a) != structural_key(mlp_nodes(ffn=32))


def test_row_parallel_input_must_come_sharded_from_inside() -> None:
    """A row-parallel linear straight on the segment input would need a local slice of a replicated tensor,
    which no parallel style makes: it stays replicated even though splitting its work would be cheaper."""
    x = spec(2, 8, 64)
    fc = linear("fc", "x", x, 6)  # 6 output features: no column split at tp=4
    model = build_sharding_model((fc,), tp=4, sequence_parallel=False, traced_batch=2, microbatch_size=2,
                                 pricer=flat_pricer())
    names = [o.strategy.name for o in model.options[0]]
    assert names == ["replicate", "rowwise"]
    problem = model.problem()
    row = names.index("rowwise")
    assert problem.objective((row,)) < problem.objective((0,)) and not problem.feasible((row,))
    assert problem.feasible((0,))


def test_reads_for_shape_only_carry_no_data() -> None:
    """`torch.ones(T, S).triu(1)` traced as ones_like(scores[0, 0]): the select and ones_like read only a shape."""
    scores, mask = spec(2, 4, 8, 8), spec(8, 8)
    nodes = (node("s", OpKind.ELEMENTWISE, ("x",), (scores,), scores, target="operator.mul"),
             node("g", OpKind.VIEW, ("s",), (scores,), mask, target="operator.getitem"),
             node("o", OpKind.ELEMENTWISE, ("g",), (mask,), mask, target="torch.ones_like"),
             node("t", OpKind.ELEMENTWISE, ("o",), (mask,), mask, target="Tensor.triu"),
             node("m", OpKind.ELEMENTWISE, ("s", "t"), (scores, mask), scores, target="Tensor.masked_fill"))
    assert shape_only_reads(nodes, {"m"}) == {(1, 0), (2, 0)}
    assert shape_only_reads(nodes, {"m", "g"}) == {(2, 0)}  # g's value leaves the segment: it is data


def test_vocab_parallel_cross_entropy() -> None:
    """Megatron's vocab-parallel loss: logits split on the class dim, three fp32 all-reduces per token."""
    logits, targets, loss = spec(16, 100), spec(16, dtype="int64"), spec(dtype="float32")
    ce = node("ce", OpKind.LOSS, ("logits", "t"), (logits, targets), loss,
              target="torch.nn.functional.cross_entropy")
    by_name = {s.name: s for s in node_strategies(ce, ctx(4, ((None, None), (None,)), ()))}
    assert list(by_name) == ["replicate", "vocab"]
    vocab = by_name["vocab"]
    assert vocab.inputs == (shard(1), REPLICATED) and vocab.output == REPLICATED
    assert vocab.input_grads == (shard(1), None)
    assert vocab.extra_forward == ((Move.ALL_REDUCE, 3 * 16 * 4.0),)


def test_fp8_casts_each_operand_where_it_is_local():
    """torchao's float8 tensor-parallel classes cast the input as it arrives and the output gradient in the
    module's output layout; under sequence parallelism both are sequence shards, cast before their all-gather."""
    from costmodel.sharding.cost import fp8_cast_shares

    lin = linear("fc", "x", spec(2, 64, 32), 64, bias=False)
    for sp in (False, True):
        styles = {s.name: s for s in node_strategies(lin, ctx(4, (SEQ3,), SEQ3, sp=sp))}
        assert fp8_cast_shares(styles["replicate"], 4, sp) == (1.0, 1.0)
        if sp:  # full weights on a sequence shard
            assert fp8_cast_shares(styles["sequence"], 4, sp) == (0.25, 0.25)
        colwise, rowwise = fp8_cast_shares(styles["colwise"], 4, sp), fp8_cast_shares(styles["rowwise"], 4, sp)
        assert colwise == ((0.25 if sp else 1.0), 0.25)
        assert rowwise == (0.25, (0.25 if sp else 1.0))
