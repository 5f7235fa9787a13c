"""Expert parallelism and context parallelism: closed-form prices, and the search choosing them.

The prices are checked against the formulas of `costmodel.expert_parallel` / `costmodel.context_parallel` computed
here from the model's configuration; the search is checked to pick ep > 1 exactly when the all-to-alls cost less
than replicated experts, to pick cp > 1 for a 128K-token sequence, and to equal the best of its pinned subspaces
(its bounds never prune the best cp / ep candidate).
"""

from __future__ import annotations

import math

import pytest

import ir
from costmodel.context_parallel import MIN_TOKENS_PER_RANK, cp_options, cp_problem, ring_exchange_s
from costmodel.expert_parallel import dp_synced_params, ep_options, ep_problem, optimizer_params
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.layer_cost import LayerCost
from costmodel.memory import PricedSegment, model_state_bytes, rank_memory
from models.registry import build_model
from planner.search.branch_and_bound import search
from planner.search.layer_costs import AxisSplit, LayerCostTable
from planner.search.space import SearchSpace

H100 = "1x8xh100"


def _chain(name: str, sets: tuple[str, ...], *, seq: int | None = None, batch: int = 1) -> ir.LayerChain:
    built = build_model(name, sets, seq=seq, batch=batch)
    return ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=name))


def _block(chain: ir.LayerChain) -> int:
    """Index of the first segment holding attention (the first transformer block)."""
    return next(s.index for s in chain.segments if any(n.op_kind.value == "attention" for n in chain.nodes_of(s)))


# --------------------------------------------------------------------------------------------------------------
# Expert parallelism: prices
# --------------------------------------------------------------------------------------------------------------

MOE = ("layers=1", "hidden=256", "ffn_hidden=512", "heads=4", "kv_heads=4", "vocab=1024", "experts=4", "top_k=2")


def test_expert_parallel_layer_cost_closed_form():
    chain = _chain("moe", MOE, seq=256)
    cluster = Cluster.parse(H100)
    device = cluster.device_of(0)
    table = LayerCostTable(chain, cluster)
    i = _block(chain)
    plain = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=2,
                                split=AxisSplit(ep=1, num_devices=8))[i]
    split = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=2,
                                split=AxisSplit(ep=4, ep_stride=2, num_devices=8))[i]
    # Dispatch buffer: E x C x h per routing group of S = gcd(256, 1024) tokens, C = ceil(k * 1.25 * S / E),
    # 2 samples, bf16; the busiest of 4 ranks gets the default imbalance 1.25 = the capacity: all of it.
    experts, k, h, f, seq = 4, 2, 256, 512, 256
    slots = min(seq, math.ceil(k * 1.25 * seq / experts))
    payload = 2 * experts * slots * h * 2
    a2a = collective_time(Collective.ALL_TO_ALL, payload, CommGroup(4, 2), cluster, concurrent=2)
    assert split.fwd_comm_s == pytest.approx(plain.fwd_comm_s + 2 * a2a, rel=1e-12)
    assert split.bwd_comm_s == pytest.approx(plain.bwd_comm_s + 2 * a2a, rel=1e-12)
    expert_params = experts * 3 * h * f
    assert plain.param_count - split.param_count == expert_params - expert_params // 4
    assert split.expert_param_count == expert_params // 4
    # Compute and activations follow the experts' load and GEMM sizes (tests/test_expert_pricing.py).
    assert split.saved_bytes_full == plain.saved_bytes_full


def test_expert_gradients_and_state_follow_the_expert_groups():
    cost = LayerCost(0, 0, 0, 0, param_count=1000 + 250, param_bytes=0, saved_bytes_none=0, saved_bytes_selective=0,
                     saved_bytes_full=0, recompute_selective_s=0, recompute_full_s=0, boundary_bytes=0,
                     expert_param_count=250)
    # n = 8 data-parallel ranks: a ring over n/ep ranks moves (n-ep)/(n-1) of what the n-rank ring would.
    assert dp_synced_params([cost], dp_size=8, ep_dp=4) == pytest.approx(1000 + 250 * 4 / 7)
    assert dp_synced_params([cost], dp_size=8, ep_dp=8) == 1000   # one owner per expert: nothing to reduce
    assert optimizer_params(1250, 250, zero_stage=1, dp_size=8, ep_dp=4) == 125 + 125
    assert optimizer_params(1250, 250, zero_stage=0, dp_size=8, ep_dp=4) == 1250
    mem = rank_memory([[PricedSegment(cost)]], [1], zero_stage=1, dp=8, ep_dp=4)
    dense, experts = model_state_bytes(1000, zero_stage=1, dp=8), model_state_bytes(250, zero_stage=1, dp=2)
    assert mem.optimizer == dense.optimizer + experts.optimizer


def test_ep_options_need_experts_dividing_ep():
    moe = _chain("moe", MOE, seq=256)
    assert ep_options(moe, 8) == (1, 2, 4)
    assert ep_problem(moe, 8) == "ep=8 does not divide the 4 experts"
    dense = _chain("llama", ("layers=1", "hidden=128", "heads=4", "kv_heads=2", "ffn_hidden=256", "vocab=512"),
                   seq=128)
    assert ep_options(dense, 8) == (1,)
    assert "no mixture-of-experts" in ep_problem(dense, 2)


# --------------------------------------------------------------------------------------------------------------
# Expert parallelism: the search
# --------------------------------------------------------------------------------------------------------------

BIG_EXPERTS = ("layers=2", "hidden=1024", "ffn_hidden=4096", "heads=8", "kv_heads=8", "vocab=1024", "experts=8",
               "top_k=2")
TINY_EXPERTS = ("layers=2", "hidden=256", "ffn_hidden=64", "heads=4", "kv_heads=4", "vocab=1024", "experts=8",
                "top_k=2")
DATA_PARALLEL = SearchSpace(tp=1, pp=1, cp=1, zero_stage=0)


def _best(chain, space=None, *, batch: int, cluster: str = H100):
    return search(chain, Cluster.parse(cluster), global_batch=batch, space=space).best


@pytest.mark.parametrize(("sets", "seq", "batch", "wins"), [
    (BIG_EXPERTS, 256, 8, True),      # 100M expert weights per layer, 256 tokens per rank: all-to-all is cheap
    (TINY_EXPERTS, 4096, 64, False),  # 0.4M expert weights per layer, 32K tokens per rank: all-to-all dominates
])
def test_search_picks_expert_parallelism_when_all_to_all_is_cheaper(sets, seq, batch, wins):
    chain = _chain("moe", sets, seq=seq)
    best = _best(chain, DATA_PARALLEL, batch=batch)
    ep1 = _best(chain, DATA_PARALLEL.with_changes(ep=1), batch=batch)
    ep8 = _best(chain, DATA_PARALLEL.with_changes(ep=8), batch=batch)
    assert (best.strategy.ep > 1) is wins
    assert best.objective == min(ep1.objective, ep8.objective, best.objective)
    # What ep trades: its all-to-alls (in the tp/ep communication) against the replicated experts' reduction.
    a2a = ep8.estimate.breakdown.tp_comm_s - ep1.estimate.breakdown.tp_comm_s
    saved = ep1.estimate.breakdown.dp_comm_s + ep1.estimate.breakdown.optimizer_s - (
        ep8.estimate.breakdown.dp_comm_s + ep8.estimate.breakdown.optimizer_s)
    assert a2a > 0 and (a2a < saved) is wins
    for b in (best, ep1, ep8):
        assert b.predicted_step_time_s == pytest.approx(b.estimate.step_time_s, rel=1e-9)


def test_hf_mixtral_gets_expert_parallelism():
    pytest.importorskip("transformers")
    chain = _chain("hf:mixtral", ("hidden_size=1024", "intermediate_size=4096", "num_attention_heads=8",
                                  "num_key_value_heads=8", "num_local_experts=8"), seq=256)
    assert ep_options(chain, 8) == (1, 2, 4, 8)
    best = _best(chain, DATA_PARALLEL, batch=8)
    assert best.strategy.ep > 1


# --------------------------------------------------------------------------------------------------------------
# Context parallelism
# --------------------------------------------------------------------------------------------------------------

SMALL_LLAMA = ("layers=1", "hidden=256", "heads=4", "kv_heads=2", "ffn_hidden=512", "vocab=1024")


def test_cp_options_and_problems():
    chain = _chain("llama", SMALL_LLAMA, seq=8192)
    assert cp_options(chain, 8) == (1, 2, 4, 8)
    assert "tokens per rank" in cp_problem(_chain("llama", SMALL_LLAMA, seq=1024), 2)
    assert cp_options(_chain("llama", SMALL_LLAMA, seq=1536), 8) == (1,)  # 768 tokens per rank at cp=2
    assert MIN_TOKENS_PER_RANK == 1024
    pytest.importorskip("transformers")
    t5 = _chain("hf:t5", (), seq=4096)
    assert "mask" in cp_problem(t5, 2)  # relative position bias is an S x S mask


def test_ring_exchange_hides_behind_attention():
    cluster = Cluster.parse(H100)
    group = CommGroup(4)
    comm = collective_time(Collective.ALL_GATHER, 1e9, group, cluster)
    assert ring_exchange_s(1e9, 4, group, cluster, window_s=0.0) == pytest.approx(comm)
    assert ring_exchange_s(1e9, 4, group, cluster, window_s=10.0) == 0.0
    # Each of the cp-1 transfers shows where it outlasts one block of attention (W / cp).
    w = comm  # per block W/4 < C/3
    assert ring_exchange_s(1e9, 4, group, cluster, window_s=w) == pytest.approx(3 * (comm / 3 - w / 4))


def test_context_parallel_rank_costs_what_a_cp_th_of_the_micro_batch_costs():
    seq, mbs, cp = 8192, 2, 2
    chain = _chain("llama", SMALL_LLAMA, seq=seq)
    cluster = Cluster.parse(H100)
    device = cluster.device_of(0)
    table = LayerCostTable(chain, cluster)
    i = _block(chain)
    whole = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=mbs)[i]
    share = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=mbs // cp)[i]
    split = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=mbs,
                                split=AxisSplit(cp=cp, cp_stride=1, num_devices=8))[i]
    assert split.saved_bytes_none == share.saved_bytes_none
    assert split.saved_bytes_none * cp == pytest.approx(whole.saved_bytes_none, rel=1e-6)  # the memory saving
    # Ring: K and V of the whole sequence, (mbs, kv heads, seq, head_dim) each in bf16, once around forward.
    kv = 2 * mbs * 2 * seq * 64 * 2
    attention = [n for n in chain.nodes_of(chain.segments[i]) if n.op_kind.value == "attention"]
    from costmodel.context_parallel import kv_bytes
    from costmodel.operators import node_time

    # the model repeats its 2 KV heads to the 4 query heads before SDPA; the ring passes the 2 (1 per tp rank)
    assert attention[0].attr("num_kv_heads") == 2 and attention[0].input_specs[1].shape[1] == 4
    assert kv_bytes(attention[0], scale=mbs, tp=1, dtype="bfloat16") == kv
    assert kv_bytes(attention[0], scale=mbs, tp=2, dtype="bfloat16") == kv / 2
    assert kv_bytes(attention[0], scale=mbs, tp=4, dtype="bfloat16") == kv / 2  # kv heads replicated past 2
    w_fwd, w_bwd = node_time(attention[0], device, flops_scale=mbs, bytes_scale=mbs)
    # Causal attention on a rank: 2cp - 1 = 3 unmasked chunk blocks and 2 causal diagonal ones (of c = S/4 tokens)
    # against 4cp = 8 unmasked blocks for its queries; one causal kernel takes 1/1.75 of the unmasked time.
    assert attention[0].attr("is_causal")
    # The ring runs them as cp kernels of (S/cp) x (S/cp), each on the GEMM size curve at its own size.
    own_fwd, own_bwd = node_time(attention[0], device, flops_scale=mbs / cp, bytes_scale=mbs / cp)
    step_fwd, step_bwd = node_time(attention[0], device, flops_scale=mbs / cp / cp, bytes_scale=mbs / cp / cp)
    blocks_fwd, blocks_bwd = node_time(attention[0], device, flops_scale=mbs / cp, bytes_scale=mbs / cp,
                                       gemm_groups=cp)
    assert blocks_fwd > own_fwd and blocks_fwd == pytest.approx(cp * step_fwd, rel=0.05)  # floors, bytes aside
    ring_fwd, ring_bwd = blocks_fwd * 1.75 * (3 + 2 / 1.75) / 8, blocks_bwd * 1.75 * (3 + 2 / 1.75) / 8
    assert split.fwd_compute_s == pytest.approx(share.fwd_compute_s - own_fwd + ring_fwd, rel=1e-12)
    assert split.bwd_compute_s == pytest.approx(share.bwd_compute_s - own_bwd + ring_bwd, rel=1e-12)
    assert split.recompute_full_s - split.fwd_comm_s == pytest.approx(split.fwd_compute_s, rel=1e-12)
    # the weight-gradient work (none of it attention's) is what it was
    assert split.weight_grad_share * split.bwd_compute_s == pytest.approx(
        share.weight_grad_share * share.bwd_compute_s, rel=1e-12)
    group = CommGroup(cp, 1)  # each transfer overlaps one step's attention: 1/cp of the rank's
    fwd_ring = ring_exchange_s(kv, cp, group, cluster, window_s=ring_fwd, concurrent=4)
    bwd_ring = ring_exchange_s(kv, cp, group, cluster, window_s=ring_bwd, concurrent=4, factor=2.0)
    assert split.fwd_comm_s == pytest.approx(share.fwd_comm_s + fwd_ring, rel=1e-12)
    assert split.bwd_comm_s == pytest.approx(share.bwd_comm_s + bwd_ring, rel=1e-12)
    assert split.param_count == whole.param_count


def test_fp8_weight_casts_stay_whole_on_every_context_parallel_rank():
    """A micro-batch cp does not divide is priced for the rank's 1/cp of the tokens: linear in the tokens, except
    the FP8 weight casts: each rank casts every weight, whatever share of the tokens it holds."""
    from costmodel.float8 import Float8Recipe

    chain = _chain("llama", SMALL_LLAMA, seq=8192)
    cluster = Cluster.parse(H100)
    device = cluster.device_of(0)
    table = LayerCostTable(chain, cluster, fp8=Float8Recipe.TENSORWISE)
    i, cp = _block(chain), 4
    whole = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=1)[i]
    split = table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=1,
                                split=AxisSplit(cp=cp, cp_stride=1, num_devices=8))[i]
    cast_f, cast_b = whole.fp8_weight_cast_fwd_s, whole.fp8_weight_cast_bwd_s
    assert cast_f > 0 and cast_b > 0
    assert (split.fp8_weight_cast_fwd_s, split.fp8_weight_cast_bwd_s) == (cast_f, cast_b)
    from costmodel.layer_pricing import price_segment

    share = price_segment(chain, chain.segments[i], device, microbatch_size=1, fp8=Float8Recipe.TENSORWISE,
                          token_divisor=cp)
    # the same, but for causal attention run as the ring's blocks (1.75 / speedup(4) of one causal kernel)
    from costmodel.operators import node_time

    attention = [n for n in chain.nodes_of(chain.segments[i]) if n.op_kind.value == "attention"]
    scale = 1 / chain.graph.batch_size / cp
    a_f, a_b = node_time(attention[0], device, flops_scale=scale, bytes_scale=scale)
    r_f, r_b = node_time(attention[0], device, flops_scale=scale, bytes_scale=scale, gemm_groups=cp)
    keep = 1.75 * (2 * cp - 1 + 2 / 1.75) / (4 * cp)
    assert split.fwd_compute_s == pytest.approx(share.fwd_compute_s - a_f + keep * r_f, rel=1e-9)
    assert split.bwd_compute_s == pytest.approx(share.bwd_compute_s - a_b + keep * r_b, rel=1e-9)
    # a quarter of the tokens is never cheaper than a quarter of the time: smaller GEMMs run less efficiently
    assert share.fwd_compute_s >= (whole.fwd_compute_s - cast_f) / cp + cast_f
    assert share.bwd_compute_s >= (whole.bwd_compute_s - cast_b) / cp + cast_b


def test_a_context_parallel_rank_is_tensor_sharded_for_the_tokens_it_holds():
    """A micro-batch cp does not divide: the sharding ILP sees the rank's 1/cp of the tokens. For the whole
    65K-token sequence, moving activations costs more than syncing replicated MLP weights, so the MLP runs
    sequence-split with whole weights; a cp=16 rank holds 4K tokens, where Megatron's column/row split wins, and the
    search and the runtime get that one (`pricing.sharding_of` reads the same prices)."""
    from planner.search.layer_costs import module_sharding

    chain = _chain("llama", ("layers=1", "hidden=1024", "heads=8", "kv_heads=8", "ffn_hidden=4096", "vocab=1024"),
                   seq=65536)
    cluster = Cluster.parse("2x8xh100")
    table = LayerCostTable(chain, cluster)
    styles = {}
    for cp in (1, 16):
        prices = table.rank_prices(cluster.device_of(0), tp=2, tp_stride=1, sequence_parallel=True,
                                   microbatch_size=1, cp=cp)
        styles[cp] = {m.module: m.style.value for m in module_sharding(chain, prices)}
    mlp = ("blocks.0.mlp.gate_proj", "blocks.0.mlp.up_proj", "blocks.0.mlp.down_proj")
    assert [styles[1][m] for m in mlp] == ["sequence"] * 3
    assert [styles[16][m] for m in mlp] == ["colwise", "colwise", "rowwise"]
    # cp dividing the micro-batch shares the cp = 1 prices of the rank's samples
    assert table.rank_prices(cluster.device_of(0), tp=2, tp_stride=1, sequence_parallel=True, microbatch_size=4,
                             cp=2) is table.prices(cluster.device_of(0), tp=2, tp_stride=1, sequence_parallel=True,
                                                   microbatch_size=2)


def test_a_128k_token_sequence_gets_context_parallelism():
    chain = _chain("llama3-8b", ("layers=4",), seq=131072)
    result = search(chain, Cluster.parse(H100), global_batch=8)
    best = result.best
    assert best.strategy.cp > 1 and best.estimate.fits
    assert best.predicted_step_time_s == pytest.approx(best.estimate.step_time_s, rel=1e-9)
    # Plans without cp exist (tensor parallelism also splits the activations), but every one of them is slower.
    no_cp = search(chain, Cluster.parse(H100), global_batch=8, space=SearchSpace(cp=1))
    assert best.objective < no_cp.best.objective


def test_search_equals_the_best_of_its_pinned_cp_ep_subspaces():
    """The cp / ep candidates are bounded correctly: the free search finds the best of all pinned searches."""
    chain = _chain("moe", TINY_EXPERTS, seq=4096)
    space = SearchSpace(tp=1, pp=1, zero_stage=0)
    free = _best(chain, space, batch=64)
    pinned = [_best(chain, space.with_changes(cp=c, ep=e), batch=64)
              for c in cp_options(chain, 8) for e in ep_options(chain, 8 // c)]
    assert free.objective == pytest.approx(min(p.objective for p in pinned), rel=1e-12)


def test_ring_attention_saves_the_causal_mask_and_pays_its_block_size():
    """A cp rank's causal attention is 2cp - 1 unmasked chunk blocks and 2 causal ones: 4cp / (2cp - 1 + 2/1.75)
    times less than unmasked, against 1.75 for one causal kernel. Large blocks keep that saving; a short sequence
    split thin runs small kernels low on the size curve and costs more than its one-kernel price."""
    from costmodel.context_parallel import ring_causal_speedup

    assert ring_causal_speedup(1) == 1.75
    assert ring_causal_speedup(2) == pytest.approx(8 / (3 + 2 / 1.75))
    assert ring_causal_speedup(16) == pytest.approx(64 / (31 + 2 / 1.75))
    assert 1.93 < ring_causal_speedup(2) < ring_causal_speedup(16) < 2.0

    def attention_s(seq: int, cp: int) -> float:
        chain = _chain("llama", ("layers=1", "hidden=4096", "heads=32", "kv_heads=8", "ffn_hidden=14336",
                                 "vocab=1024"), seq=seq)
        cluster = Cluster.parse(H100)
        table = LayerCostTable(chain, cluster)
        i = _block(chain)
        split = AxisSplit(cp=cp, cp_stride=1, num_devices=8) if cp > 1 else None
        cost = table.segment_costs(cluster.device_of(0), tp=1, tp_stride=1, sequence_parallel=False,
                                   microbatch_size=cp, split=split)[i]
        return cost.fwd_compute_s + cost.bwd_compute_s

    # 131K tokens over 8 ranks: 16K-token blocks, as fast per FLOP as one kernel; the rank saves 12% of its attention
    long_one, long_ring = attention_s(131072, 1), attention_s(131072, 8)
    assert long_ring < long_one
    # 2K tokens over 8 ranks: 256-token blocks run far below the rate of one 2K-token kernel
    assert attention_s(2048, 8) > attention_s(2048, 1)
