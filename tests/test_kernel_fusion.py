"""Fused memory-bound kernels (`ir.fusion`, `RuntimeOptions.fused_kernels`): what a compiled or hand-fused runtime
moves and keeps, priced, searched and recorded."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ir
from costmodel import Cluster, RuntimeOptions, Strategy
from costmodel.estimate import estimate
from costmodel.layer_pricing import price_segment
from costmodel.operators import T_KERNEL_FLOOR_S, node_time
from ir.fusion import FUSED_MEMBER_ATTR, fusion_groups
from ir.graph import OpKind
from models.registry import build_model
from planner.api import plan
from planner.runtime.parallelize import runtime_unsupported
from planner.search.space import SearchSpace

HIDDEN, FFN, SEQ, BATCH = 256, 704, 128, 2


@pytest.fixture(scope="module")
def llama():
    built = build_model("llama", [f"hidden={HIDDEN}", f"ffn_hidden={FFN}", "heads=8", "kv_heads=2", "layers=4",
                                  "vocab=1024"], batch=BATCH, seq=SEQ, device="meta")
    graph = ir.trace(built.module, built.example_inputs, model_name="llama-small", dtype="bfloat16")
    return ir.build_layer_chain(graph)


def _block(chain):
    return next(s for s in chain.segments if s.name.endswith(".1") or s.name == "blocks.1")


def test_fused_chain_keeps_nodes_segments_and_classes(llama):
    fused = llama.fused_kernels
    assert fused.fused and not llama.fused and fused.fused_kernels is fused
    assert [n.name for n in fused.graph.nodes] == [n.name for n in llama.graph.nodes]
    assert [(s.start, s.stop, s.class_id, s.structural_hash) for s in fused.segments] == \
        [(s.start, s.stop, s.class_id, s.structural_hash) for s in llama.segments]
    assert fused.graph.forward_flops == llama.graph.forward_flops
    assert ir.LayerChain.from_json(fused.to_json()).fused


def test_groups_stop_at_gemms_and_attention(llama):
    nodes = llama.nodes_of(_block(llama))
    for group in fusion_groups(nodes):
        assert all(nodes[i].op_kind not in (OpKind.LINEAR, OpKind.ATTENTION, OpKind.MATMUL) for i in group)
    # SwiGLU's SiLU and gate multiply are one group (between the gate/up projections and the down projection)
    silu = next(i for i, n in enumerate(nodes) if "silu" in n.target)
    group = next(g for g in fusion_groups(nodes) if silu in g)
    assert any(nodes[i].op_kind is OpKind.ELEMENTWISE and "mul" in nodes[i].target for i in group)


def test_fused_group_moves_each_outside_tensor_once_and_keeps_only_its_inputs(llama):
    block = _block(llama)
    eager, fused = llama.nodes_of(block), llama.fused_kernels.nodes_of(block)
    silu = next(i for i, n in enumerate(eager) if "silu" in n.target)
    group = next(g for g in fusion_groups(eager) if silu in g)
    tokens = BATCH * SEQ
    gate_up = 2 * tokens * FFN * 2  # the two projections' bf16 outputs: what the fused kernel reads
    out = tokens * FFN * 2          # its one output, read by the down projection
    assert sum(fused[i].bytes_read + fused[i].bytes_written for i in group) == gate_up + out
    assert sum(eager[i].bytes_read + eager[i].bytes_written for i in group) > gate_up + out
    # eagerly SiLU's output is saved too (the multiply's input); fused, only the gate and up outputs are
    assert sum(eager[i].saved_bytes for i in group) == gate_up + out
    assert sum(fused[i].saved_bytes for i in group) == gate_up
    # one kernel launch per group: every member but the first runs inside it
    assert [bool(fused[i].attr(FUSED_MEMBER_ATTR)) for i in group] == [False] + [True] * (len(group) - 1)


def test_no_group_costs_more_fused_and_pure_views_stay_free(llama):
    fused = llama.fused_kernels
    for seg in llama.segments:
        eager_nodes, fused_nodes = llama.nodes_of(seg), fused.nodes_of(seg)
        for group in fusion_groups(eager_nodes):
            before = sum(eager_nodes[i].bytes_read + eager_nodes[i].bytes_written for i in group)
            after = sum(fused_nodes[i].bytes_read + fused_nodes[i].bytes_written for i in group)
            assert after <= before
            assert sum(fused_nodes[i].saved_bytes for i in group) <= sum(eager_nodes[i].saved_bytes for i in group)
        assert fused.segments[seg.index].saved_bytes <= seg.saved_bytes


def test_members_launch_no_kernel_of_their_own(llama):
    h100 = Cluster.parse("1x8xh100-sxm").groups[0].device
    for n in llama.fused_kernels.graph.nodes:
        if n.attr(FUSED_MEMBER_ATTR) and n.bytes_read + n.bytes_written == 0:
            fwd, _ = node_time(n, h100)
            assert fwd < T_KERNEL_FLOOR_S


def test_fused_kernels_price_a_faster_block_with_less_memory(llama):
    h100 = Cluster.parse("1x8xh100-sxm").groups[0].device
    block = _block(llama)
    eager = price_segment(llama, block, h100, microbatch_size=BATCH)
    fused = price_segment(llama.fused_kernels, block, h100, microbatch_size=BATCH)
    assert fused.fwd_compute_s < eager.fwd_compute_s and fused.bwd_compute_s < eager.bwd_compute_s
    assert fused.saved_bytes_none < eager.saved_bytes_none
    # the GEMMs and attention are the same kernels either way: only the memory-bound time moves
    assert fused.saved_bytes_full == eager.saved_bytes_full


def test_estimate_and_search_price_fused_kernels_the_same_way(llama):
    cluster = Cluster.parse("1x8xh100-sxm")
    runtime = RuntimeOptions(fused_kernels=True)
    strategy = Strategy(dp=8, microbatch_size=2, num_microbatches=1, zero_stage=1, runtime=runtime)
    eager = estimate(llama, cluster, Strategy(dp=8, microbatch_size=2, num_microbatches=1, zero_stage=1))
    fused = estimate(llama, cluster, strategy)
    assert fused.step_time_s < eager.step_time_s
    assert max(s.memory.total for s in fused.stages) < max(s.memory.total for s in eager.stages)
    p = plan(llama, None, cluster, global_batch=16, space=SearchSpace(runtime=runtime))
    assert p.strategy.runtime.fused_kernels
    again = estimate(llama, cluster, p.strategy, global_batch=16)
    assert again.step_time_s == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    with pytest.raises(ValueError, match="priced with fused kernels"):
        RuntimeOptions().priced_chain(llama.fused_kernels)


def test_plan_records_it_and_this_runtime_refuses_it():
    s = Strategy(dp=2, runtime=RuntimeOptions(fused_kernels=True))
    assert s.to_dict()["runtime"]["fused_kernels"] is True
    assert Strategy.from_dict(s.to_dict()) == s
    assert "fused_kernels" not in Strategy(dp=2).to_dict()["runtime"]  # plans written before it read the same
    assert "fused_kernels" in runtime_unsupported(s)
    assert SearchSpace.from_fixes(["fused_kernels=true"]).runtime == RuntimeOptions(fused_kernels=True)


def test_estimate_flag():
    args = [sys.executable, "-m", "planner.cli.main", "estimate", "llama-tiny", "--cluster", "1x8xh100-sxm",
            "--batch", "16", "--tp", "1", "--pp", "1", "--dp", "8", "--mbs", "2", "--json"]
    eager = subprocess.run(args, capture_output=True, text=True, timeout=300)
    fused = subprocess.run([*args, "--fused-kernels"], capture_output=True, text=True, timeout=300)
    assert eager.returncode == 0 and fused.returncode == 0, eager.stderr + fused.stderr
    e, f = json.loads(eager.stdout), json.loads(fused.stdout)
    assert f["strategy"]["runtime"]["fused_kernels"] is True
    assert f["predicted"]["step_time_s"] < e["predicted"]["step_time_s"]


def test_attention_keeps_unexpanded_grouped_query_heads_when_fused(llama):
    block = _block(llama)
    eager = next(n for n in llama.nodes_of(block) if n.op_kind is OpKind.ATTENTION)
    fused = next(n for n in llama.fused_kernels.nodes_of(block) if n.op_kind is OpKind.ATTENTION)
    q = BATCH * SEQ * HIDDEN * 2
    kv = q // 4  # 2 of 8 heads
    # eagerly it saves k and v expanded to every query head; fused, the projections' outputs (plus the small
    # rotary tables the fused kernel also reads)
    assert eager.saved_bytes - fused.saved_bytes == pytest.approx(2 * (q - kv), rel=0.02)


def test_replan_keeps_the_trainers_kernels(llama):
    from planner.scenarios.replan import replan

    runtime = RuntimeOptions(fused_kernels=True)
    old = plan(llama, None, Cluster.parse("1x8xh100-sxm"), global_batch=16, space=SearchSpace(runtime=runtime))
    smaller = Cluster.parse("1x4xh100-sxm")
    new = replan(old, llama, smaller).plan
    assert new.strategy.runtime.fused_kernels
    again = estimate(llama, smaller, new.strategy, global_batch=16)
    assert again.step_time_s == pytest.approx(new.predicted.step_time_s, rel=1e-9)
