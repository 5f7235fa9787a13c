"""Routed experts priced as they run (`costmodel.expert_parallel`), checked against closed forms computed here from
the model's configuration: grouped GEMMs sized per expert, the busiest rank's load, the all-to-all payload and its
buffers, the router and the token gathers, and the expert-imbalance setting of the cluster spec."""

from __future__ import annotations

import math

import pytest

import ir
from costmodel.expert_parallel import (
    EXPERT_IMBALANCE,
    ExpertSetting,
    expert_cost,
    expert_layer,
    expert_load_factor,
)
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.operators import gemm_size_factor, node_time
from ir.graph import OpKind
from ir.moe_structure import expert_region, routed_experts
from models.registry import build_model
from planner.search.layer_costs import AxisSplit, LayerCostTable

E, K, H, F, SEQ, MBS = 4, 2, 256, 1024, 256, 2
MOE = ("layers=1", f"hidden={H}", f"ffn_hidden={F}", "heads=4", "kv_heads=4", "vocab=1024", f"experts={E}",
       f"top_k={K}")


def _chain(*extra: str) -> ir.LayerChain:
    built = build_model("moe", (*MOE, *extra), seq=SEQ)
    return ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="moe"))


def _block(chain: ir.LayerChain) -> int:
    return next(s.index for s in chain.segments if routed_experts(chain.nodes_of(s)) is not None)


def _costs(chain: ir.LayerChain, cluster: Cluster, ep: int):
    table = LayerCostTable(chain, cluster)
    device = cluster.device_of(0)
    return table.segment_costs(device, tp=1, tp_stride=1, sequence_parallel=False, microbatch_size=MBS,
                               split=AxisSplit(ep=ep, ep_stride=1, num_devices=cluster.num_devices))[_block(chain)]


def _gemm_s(flops: float, groups: int, cluster: Cluster) -> float:
    """Closed form of a compute-bound grouped GEMM: F / (peak * matmul efficiency * s(F / G / peak)) / training
    efficiency."""
    d = cluster.device_of(0)
    peak = d.flops("bfloat16")
    return flops / (peak * d.matmul_efficiency * gemm_size_factor(flops / groups / peak)) / d.training_efficiency


def test_the_trace_gives_the_capacity_factor_and_the_load_factor_follows():
    capacity = math.ceil(K * 1.25 * SEQ / E)  # slots per expert per routing group of S = 256 tokens
    found = routed_experts(_chain().graph.nodes)
    assert found.choices == SEQ * K
    assert found.capacity_factor == pytest.approx(E * capacity / (K * SEQ))
    # lambda(ep) = min(c, f_ep) / c with f_1 = 1: one rank sums every expert's load, the mean.
    assert expert_load_factor(1.25, 1, 1.25) == pytest.approx(0.8)
    assert expert_load_factor(1.25, 4, 1.25) == 1.0
    assert expert_load_factor(2.0, 4, 1.1) == pytest.approx(0.55)
    assert expert_load_factor(1.0, 4, 1.25) == 1.0  # capacity caps the busiest rank: tokens past it are dropped


def test_expert_gemms_are_sized_per_expert_at_the_busiest_ranks_load():
    """ep=1 vs ep=4 with perfectly balanced routing (f = 1): the same load (the mean), so what changes is the
    grouped GEMM: 4 GEMMs of 1/4 the FLOPs each at ep=1, one GEMM 4x taller at ep=4 (E/ep = 1 expert per rank)."""
    chain = _chain()
    cluster = Cluster.from_dict({**Cluster.parse("1x8xh100").to_dict(), "expert_imbalance": 1.0})
    one, four = _costs(chain, cluster, 1), _costs(chain, cluster, 4)
    nodes = chain.nodes_of(chain.segments[_block(chain)])
    found = routed_experts(nodes)
    load = 1 / found.capacity_factor  # the mean: k choices per token, no padding
    linears = [n for n in nodes if n.name in found.linears]
    flops = [n.forward_flops * MBS * load for n in linears]  # gate, up, down: each E * tokens * 2hf
    assert sum(flops) == pytest.approx(MBS * SEQ * K * 6 * H * F)
    expected = sum(_gemm_s(f, E, cluster) - _gemm_s(f, 1, cluster) for f in flops)
    assert one.fwd_compute_s - four.fwd_compute_s == pytest.approx(expected, rel=1e-9)
    assert one.bwd_compute_s - four.bwd_compute_s == pytest.approx(2 * expected, rel=1e-9)  # dX and dW GEMMs


def test_dropless_capacity_is_priced_at_the_imbalance_not_the_padding():
    """capacity_factor = E / k = 2 gives C = S: the trace computes every token in every expert's buffer, E / k
    times the mean. The busiest of 4 ranks computes f = 1.25 times the mean, the trace's 1.25 / 2."""
    padded = _chain(f"capacity_factor={E / K}")
    found = routed_experts(padded.graph.nodes)
    assert found.capacity_factor == pytest.approx(E / K)
    cluster = Cluster.parse("1x8xh100")
    nodes = padded.nodes_of(padded.segments[_block(padded)])
    region = expert_region(nodes, found)
    base = LayerCostTable(padded, cluster).prices(cluster.device_of(0), tp=1, tp_stride=1, sequence_parallel=False,
                                                  microbatch_size=MBS).costs[padded.segments[_block(padded)].class_id]
    four = _costs(padded, cluster, 4)
    saved_region = sum(n.saved_bytes for n in nodes if n.name in region) * MBS / 2  # fp32 trace, bf16 priced
    assert base.saved_bytes_none - four.saved_bytes_none == pytest.approx(saved_region * (1 - 1.25 / 2), abs=2)


def test_all_to_all_payload_buffers_and_imbalance_setting():
    chain = _chain()
    cluster = Cluster.from_dict({**Cluster.parse("1x8xh100").to_dict(), "expert_imbalance": 1.1})
    one, four = _costs(chain, cluster, 1), _costs(chain, cluster, 4)
    capacity = math.ceil(K * 1.25 * SEQ / E)
    load = 1.1 / 1.25
    payload = MBS * E * capacity * H * 2 * load  # (E, C, h) per sample in bf16, at the busiest rank's load
    a2a = collective_time(Collective.ALL_TO_ALL, payload, CommGroup(4), cluster, concurrent=2)
    assert four.fwd_comm_s - one.fwd_comm_s == pytest.approx(2 * a2a, rel=1e-12)
    assert four.bwd_comm_s - one.bwd_comm_s == pytest.approx(2 * a2a, rel=1e-12)
    assert four.peak_temp_bytes >= round(2 * payload)  # send and receive buffers of one all-to-all
    with pytest.raises(ValueError, match="expert_imbalance: expected a number in"):
        Cluster.from_dict({**Cluster.parse("1x8xh100").to_dict(), "expert_imbalance": 0.5})
    assert Cluster.from_dict(cluster.to_dict()) == cluster and Cluster.parse("1x8xh100").expert_imbalance is None
    assert EXPERT_IMBALANCE == 1.25


def test_router_and_dispatch_cost_what_they_move():
    """The router is one h x E GEMM per token and its top-k; dispatch and combine are gathers: no FLOPs, so the MoE
    feed-forward's forward FLOPs are the router's plus the experts' (E * C * 6hf per routing group)."""
    chain = _chain()
    nodes = chain.nodes_of(chain.segments[_block(chain)])
    found = routed_experts(nodes)
    router = [n for n in nodes if n.op_kind is OpKind.LINEAR and n.param_specs
              and n.param_specs[0].shape == (E, H)]
    assert [n.forward_flops for n in router] == [2 * SEQ * H * E]
    gathers = [n for n in nodes if "index_select" in n.target]
    assert len(gathers) == 2 and all(n.forward_flops == 0 and n.bytes_written > 0 for n in gathers)
    moe = [n for n in nodes if ".mlp" in n.module_path or n.module_path.endswith("mlp")]
    capacity = math.ceil(K * 1.25 * SEQ / E)
    assert sum(n.forward_flops for n in moe) == 2 * SEQ * H * E + E * capacity * 6 * H * F
    assert sum(n.forward_flops for n in nodes if n.name in found.linears) == E * capacity * 6 * H * F


@pytest.mark.parametrize("imbalance", [1.0, 1.25, 2.0])
def test_the_search_bound_is_below_every_expert_parallel_price(imbalance):
    chain = _chain("capacity_factor=2")
    cluster = Cluster.from_dict({**Cluster.parse("1x8xh100").to_dict(), "expert_imbalance": imbalance})
    table = LayerCostTable(chain, cluster)
    device = cluster.device_of(0)
    for tp in (1, 2):
        bound = table.segment_costs(device, tp=tp, tp_stride=1, sequence_parallel=tp > 1, microbatch_size=MBS)
        for ep in (1, 2, 4):
            priced = table.segment_costs(device, tp=tp, tp_stride=1, sequence_parallel=tp > 1,
                                         microbatch_size=MBS, split=AxisSplit(ep=ep, ep_stride=2, num_devices=8))
            assert sum(c.fwd_compute_s + c.bwd_compute_s for c in bound) <= sum(
                c.fwd_compute_s + c.bwd_compute_s for c in priced)


def test_tensor_parallel_ranks_split_the_expert_slots():
    """tp = 2 (experts whole on both ranks): each runs half of every expert's slots -- the grouped GEMMs at half
    the rows, the ops between them on half the bytes -- the ep group exchanges half the payload, the outputs
    and the input gradients are all-gathered over tp, and the expert gradients are partial over tp."""
    chain = _chain()
    cluster = Cluster.from_dict({**Cluster.parse("1x8xh100").to_dict(), "expert_imbalance": 1.0})
    device = cluster.device_of(0)
    block = chain.segments[_block(chain)]
    nodes = chain.nodes_of(block)
    layer = expert_layer(nodes)
    base = LayerCostTable(chain, cluster).prices(device, tp=1, tp_stride=1, sequence_parallel=False,
                                                 microbatch_size=MBS).costs[block.class_id]
    ep, tp_group = 2, CommGroup(2)
    costs = {tp: expert_cost(base, layer, device, cluster, segment_params=block.param_count, setting=ExpertSetting(
        ep=ep, microbatch_size=MBS, traced_batch=1, traced_dtype="float32", group=CommGroup(ep, stride=2),
        concurrent=4, imbalance=1.0, tp=tp, tp_group=tp_group, tp_concurrent=4)) for tp in (1, 2)}
    load = 1 / layer.found.capacity_factor
    region_fwd = {tp: sum(node_time(n, device, flops_scale=MBS * load / tp, bytes_scale=MBS * load / tp,
                                    gemm_groups=E // ep if n.name in layer.found.linears else 1,
                                    param_scale=1 / ep if n.name in layer.found.linears else 1.0)[0]
                          for n in layer.region) for tp in (1, 2)}
    payload = MBS * E * math.ceil(K * 1.25 * SEQ / E) * H * 2 * load
    a2a = {tp: collective_time(Collective.ALL_TO_ALL, payload / tp, CommGroup(ep, stride=2), cluster, concurrent=4)
           for tp in (1, 2)}
    gather = collective_time(Collective.ALL_GATHER, payload, tp_group, cluster, concurrent=4)
    one, two = costs[1], costs[2]
    assert one.fwd_compute_s - two.fwd_compute_s == pytest.approx(region_fwd[1] - region_fwd[2], rel=1e-9)
    assert two.fwd_comm_s - one.fwd_comm_s == pytest.approx(gather + 2 * (a2a[2] - a2a[1]), rel=1e-9)
    assert two.bwd_comm_s - one.bwd_comm_s == pytest.approx(gather + 2 * (a2a[2] - a2a[1]), rel=1e-9)
    assert two.saved_bytes_none < one.saved_bytes_none
    assert two.expert_param_count == layer.found.param_numel // ep

    def partial(tp: int, ep: int) -> int:
        setting = ExpertSetting(ep=ep, microbatch_size=MBS, traced_batch=1, traced_dtype="float32", tp=tp,
                                tp_group=CommGroup(tp))
        return expert_cost(base, layer, device, cluster, segment_params=block.param_count,
                           setting=setting).tp_split_expert_params
    # Gradients partial over tp where several ranks of a tp group hold the same experts: all of them at ep = 1, the
    # rank's E / ep when ep < tp, none when each ep group takes whole tp groups (ep 2 over tp 2, ep 4 over tp 2).
    assert (partial(1, 1), partial(2, 1), partial(4, 2)) == (0, layer.found.param_numel, layer.found.param_numel // 2)
    assert partial(2, 2) == partial(2, 4) == 0


def test_under_tp_the_moe_path_grows_with_the_micro_batch_and_the_experts_stay_whole():
    """The routing groups (G, S, h) and expert buffers (E, slots, h) fold the batch dim away; the sharding problem
    still prices them at the micro-batch (`costmodel.sharding.cost.folded_batch_nodes`), and gives the stacked
    experts only their replicated strategy (the tp ranks split their slots instead, priced on top)."""
    from costmodel.sharding.cost import (
        build_sharding_model,
        folded_batch_nodes,
        make_pricer,
        stacked_expert_region,
    )
    from costmodel.sharding.dims import propagate_labels

    built = build_model("moe", ("layers=1", "hidden=1024", "ffn_hidden=4096", "heads=8", "kv_heads=8", "vocab=1024",
                                f"experts={E}", f"top_k={K}"), seq=1024)
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name="moe"))
    block = chain.segments[_block(chain)]
    nodes = chain.nodes_of(block)
    region = stacked_expert_region(nodes)
    assert set(routed_experts(nodes).linears) <= region
    assert region <= folded_batch_nodes(nodes, propagate_labels(nodes, 1), 1)
    cluster = Cluster.parse("1x8xh100")
    pricer = make_pricer(cluster, cluster.device_of(0), CommGroup(2))
    models = {mbs: build_sharding_model(nodes, tp=2, sequence_parallel=True, traced_batch=1, microbatch_size=mbs,
                                        pricer=pricer) for mbs in (1, 8)}
    linears = set(routed_experts(nodes).linears)
    for i, n in enumerate(nodes):
        if n.name in region:
            one, eight = models[1].options[i], models[8].options[i]
            assert len(one) == len(eight) == 1 and one[0].strategy.is_replicated
        if n.name in linears:  # compute-bound GEMMs: 8x the tokens, at least 6x the time (GEMMs grow efficient)
            assert eight[0].fwd_s > 6 * one[0].fwd_s
