"""`costmodel.estimate` end to end on hand-built GPT chains: closed forms for single-device, data-parallel and
pipeline steps, memory per stage, utilization, problems and errors, heterogeneous and straggling clusters, speed."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster, Recompute, Schedule, StageSpec, Strategy
from costmodel.estimate import estimate
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.layer_pricing import price_segment
from costmodel.memory import GPU_FRAMEWORK_OVERHEAD_BYTES
from costmodel.pipeline import in_flight_per_chunk, pipeline_step_time
from costmodel.rank_layout import even_stages
from costmodel.step_time import optimizer_step_time, overlapped_exposed
from costmodel.strategy import RuntimeOptions

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "clusters"
SHAPE = GptShape(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, batch=2)


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE)


@pytest.fixture(scope="module")
def node8():
    return Cluster.parse("1x8xa100-80gb")


def _sums(chain, device, mbs, recompute=Recompute.NONE):
    costs = [price_segment(chain, s, device, microbatch_size=mbs) for s in chain.segments]
    extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: sum(c.recompute_selective_s for c in costs),
             Recompute.FULL: sum(c.recompute_full_s for c in costs)}[recompute]
    return costs, sum(c.fwd_compute_s for c in costs), sum(c.bwd_compute_s for c in costs) + extra


def test_single_device_step_is_microbatches_times_fwd_bwd_plus_optimizer(chain, node8):
    device = node8.device_of(0)
    costs, fwd, bwd = _sums(chain, device, 1)
    e = estimate(chain, node8, Strategy(microbatch_size=1, num_microbatches=2))
    opt = optimizer_step_time(chain.graph.param_count, device)
    assert e.step_time_s == pytest.approx(2 * (fwd + bwd) + opt)
    b = e.breakdown
    assert b.compute_s == pytest.approx(2 * (fwd + bwd)) and b.optimizer_s == pytest.approx(opt)
    assert b.bubble_s == pytest.approx(0.0, abs=1e-12) and b.dp_comm_s == 0 and b.pp_comm_s == 0
    assert b.total_s == pytest.approx(e.step_time_s)
    assert e.fits and not e.problems
    # Throughput and utilization from the graph's FLOPs.
    tokens = 2 * SHAPE.seq
    assert e.tokens_per_s == pytest.approx(tokens / e.step_time_s)
    model_flops = (chain.graph.forward_flops + chain.graph.backward_flops) * 2 / SHAPE.batch
    assert e.model_tflops_per_device == pytest.approx(model_flops / e.step_time_s / 1e12)
    assert e.mfu == pytest.approx(model_flops / e.step_time_s / 312e12)
    assert e.hfu == pytest.approx(e.mfu)


def test_recompute_adds_time_and_hardware_flops(chain, node8):
    base = estimate(chain, node8, Strategy(microbatch_size=2, num_microbatches=1))
    full = estimate(chain, node8, Strategy(microbatch_size=2, num_microbatches=1, recompute="full"))
    sel = estimate(chain, node8, Strategy(microbatch_size=2, num_microbatches=1, recompute="selective"))
    _, fwd, _ = _sums(chain, node8.device_of(0), 2)
    assert full.step_time_s - base.step_time_s == pytest.approx(fwd)
    assert full.breakdown.recompute_s == pytest.approx(fwd)
    assert 0 < sel.breakdown.recompute_s < full.breakdown.recompute_s
    g = chain.graph
    ratio = (g.forward_flops + g.backward_flops + g.forward_flops) / (g.forward_flops + g.backward_flops)
    assert full.hfu / full.mfu == pytest.approx(ratio)
    # Activation memory: none > selective > full.
    acts = [e.stages[0].memory.activations for e in (base, sel, full)]
    assert acts[0] > acts[1] > acts[2]


def test_data_parallel_all_reduce_overlaps_the_last_backward(chain, node8):
    device = node8.device_of(0)
    costs, fwd, bwd = _sums(chain, device, 1)
    e = estimate(chain, node8, Strategy(dp=8, microbatch_size=1, num_microbatches=2))
    grad = chain.graph.param_count * 4  # gradients are reduced in fp32
    ar = collective_time(Collective.ALL_REDUCE, grad, CommGroup(8), node8)
    exposed = overlapped_exposed(ar, bwd, math.ceil(grad / (25 * 2 ** 20)))
    opt = optimizer_step_time(chain.graph.param_count, device)
    assert e.breakdown.dp_comm_s == pytest.approx(exposed)
    assert e.step_time_s == pytest.approx(2 * (fwd + bwd) + exposed + opt)
    z1 = estimate(chain, node8, Strategy(dp=8, microbatch_size=1, num_microbatches=2, zero_stage=1))
    assert z1.breakdown.optimizer_s == pytest.approx(optimizer_step_time(-(-chain.graph.param_count // 8), device))
    assert z1.stages[0].memory.optimizer < e.stages[0].memory.optimizer
    # Without overlap (Megatron-LM of 2022) the whole all-reduce is exposed.
    off = estimate(chain, node8, Strategy(dp=8, microbatch_size=1, num_microbatches=2,
                                          runtime=RuntimeOptions(dp_overlap=False)))
    assert off.breakdown.dp_comm_s == pytest.approx(ar)
    assert off.step_time_s == pytest.approx(2 * (fwd + bwd) + ar + opt)


def test_pipeline_uses_the_shared_closed_form(chain, node8):
    st = Strategy(pp=2, microbatch_size=1, num_microbatches=4)
    e = estimate(chain, node8, st)
    device = node8.device_of(0)
    stages = even_stages(chain, 2)
    assert [(s.start, s.stop) for s in stages] == [(0, 3), (3, 6)]
    f, b = [], []
    for s in stages:
        costs = [price_segment(chain, chain.segments[i], device, microbatch_size=1) for i in range(s.start, s.stop)]
        f.append(sum(c.fwd_compute_s for c in costs))
        b.append(sum(c.bwd_compute_s for c in costs))
    boundary = price_segment(chain, chain.segments[2], device, microbatch_size=1).boundary_bytes
    p2p = collective_time(Collective.SEND_RECV, boundary, CommGroup(2, stride=1), node8)
    pipe = pipeline_step_time(f, b, Schedule.ONE_F_ONE_B, 4, 1, [p2p])
    params = [sum(chain.segments[i].param_count for i in range(s.start, s.stop)) for s in stages]
    opt = max(optimizer_step_time(p, device) for p in params)
    assert e.step_time_s == pytest.approx(pipe + opt)
    assert e.breakdown.pp_comm_s > 0 and e.breakdown.bubble_s > 0
    assert [s.in_flight_microbatches for s in e.stages] == [2, 1]
    # Stage memory: 18 bytes per parameter (fp32 gradients), saved activations x in-flight, overhead; and
    # torch.distributed.pipelining's buffers: on stage 0, m gradient-receive buffers and the 2 in-flight outputs;
    # on stage 1, m forward-receive buffers, 1 of them the saved input of the micro-batch in flight.
    m0, m1 = e.stages[0].memory, e.stages[1].memory
    assert m0.params + m0.grads + m0.optimizer == 18 * params[0]
    saved = [sum(price_segment(chain, chain.segments[i], device, microbatch_size=1).saved_bytes_none
                 for i in range(s.start, s.stop)) for s in stages]
    assert m0.activations == 2 * saved[0] + (4 + 2) * boundary and m0.overhead == GPU_FRAMEWORK_OVERHEAD_BYTES
    assert m1.activations == saved[1] + (4 - 1) * boundary
    assert e.peak_memory_bytes == tuple(s.memory.total for s in e.stages)
    # Megatron-LM allocates receives per transfer and frees sent outputs: the saved activations alone.
    megatron = estimate(chain, node8, replace(st, runtime=RuntimeOptions(p2p_transient_buffers=True)))
    assert [s.memory.activations for s in megatron.stages] == [2 * saved[0], saved[1]]


def test_interleaved_first_rank_memory_factor(node8):
    chain = gpt_chain(GptShape(layers=8, hidden=512, heads=8, seq=256, vocab=1000, batch=1))
    p, v, m = 2, 2, 4
    stages = tuple(StageSpec(i * 2 + 1 if i else 0, (i + 1) * 2 + 1 if i < 3 else 10) for i in range(4))
    e = estimate(chain, node8, Strategy(pp=p, microbatch_size=1, num_microbatches=m, schedule="interleaved",
                                        virtual_stages=v, stages=stages))
    per_layer = price_segment(chain, chain.segments[1], node8.device_of(0), microbatch_size=1).saved_bytes_none
    embed = price_segment(chain, chain.segments[0], node8.device_of(0), microbatch_size=1).saved_bytes_none
    boundary = price_segment(chain, chain.segments[1], node8.device_of(0), microbatch_size=1).boundary_bytes
    # Rank 0 holds chunks 0 (embed + 2 layers) and 2 (2 layers); in flight (2p-1, p) = (3, 2). Pipeline buffers:
    # chunk 0 sends (m gradient receives + 3 outputs), chunk 2 receives and sends (m + m, the in-flight inputs
    # being saved activations already and the in-flight outputs not).
    saved = 3 * (embed + 2 * per_layer) + 2 * (2 * per_layer)
    assert e.stages[0].memory.activations == saved + (m + 3) * boundary + 2 * m * boundary


def test_uneven_virtual_stages_closed_form(node8):
    """6 blocks + the embedding + the head as 8 chunks of one unit on p=2, v=4 (Llama 3 405B's layout in small:
    the embedding and the head each alone in a chunk): the interleaved step T = m D + (S - D)/v with D the busiest
    rank, and each chunk's activations times its own in-flight count."""
    chain = gpt_chain(GptShape(layers=6, hidden=512, heads=8, seq=256, vocab=1000, batch=1))
    p, v, m = 2, 4, 4
    stages = tuple(StageSpec(j, j + 1) for j in range(8))
    # Pipeline buffers freed per transfer (Llama 3's trainer is not torch.distributed.pipelining).
    e = estimate(chain, node8, Strategy(pp=p, microbatch_size=1, num_microbatches=m, schedule="interleaved",
                                        virtual_stages=v, stages=stages,
                                        runtime=RuntimeOptions(p2p_transient_buffers=True)))
    assert e.fits
    device = node8.device_of(0)
    costs = [price_segment(chain, s, device, microbatch_size=1) for s in chain.segments]
    work = [sum(c.fwd_compute_s + c.bwd_compute_s for c in costs[r::p]) for r in range(p)]
    # Rank 0: the embedding and 3 blocks, rank 1: 3 blocks and the head.
    assert [s.fwd_s + s.bwd_s for s in e.stages] == pytest.approx(work)
    busy = max(work)
    b = e.breakdown
    assert b.compute_s == pytest.approx(m * busy)
    assert b.bubble_s == pytest.approx((sum(work) - busy) / v)
    fwd = [c.fwd_compute_s for c in costs]
    bwd = [c.bwd_compute_s for c in costs]
    assert b.compute_s + b.bubble_s == pytest.approx(pipeline_step_time(fwd, bwd, "interleaved", m, v))
    saved = [c.saved_bytes_none for c in costs]
    for r in range(p):
        counts = in_flight_per_chunk("interleaved", p, r, m, v)
        assert e.stages[r].memory.activations == sum(n * saved[c * p + r] for c, n in enumerate(counts))


def test_problems_are_exact(chain, node8):
    device = node8.device_of(0)
    costs = {(s.class_id, device.name): price_segment(chain, s, device, microbatch_size=1) for s in chain.segments}
    e = estimate(chain, node8, Strategy(tp=3, microbatch_size=1), layer_costs=costs, global_batch=64)
    assert "tp=3 does not divide heads=16" in e.problems
    assert "global batch 64 is not dp*mbs*m = 1*1*1 = 1" in e.problems
    assert not e.fits
    bad = estimate(chain, node8, Strategy(pp=2, num_microbatches=3, schedule="interleaved", virtual_stages=2))
    assert any("multiple of pp" in p for p in bad.problems)


def test_does_not_fit_names_the_stage_and_sizes():
    big = gpt_chain(GptShape(layers=4, hidden=8192, heads=64, seq=4096, vocab=51200, batch=8))
    cluster = Cluster.parse("1x2xa100-80gb")
    e = estimate(big, cluster, Strategy(pp=2, microbatch_size=8, num_microbatches=4))
    assert not e.fits
    need = e.stages[0].memory.total / 2 ** 30
    assert f"stage 0 needs {need:.1f} GiB > 80.0 GiB (a100-80gb)" in e.problems  # nvidia-smi: 81,920 MiB


def test_unpriceable_strategies_raise(chain, node8):
    with pytest.raises(ValueError, match="planner.estimate"):
        estimate(chain, node8, Strategy(tp=2))
    with pytest.raises(ValueError, match="needs dp\\*tp\\*pp\\*cp = 16 devices, the cluster has 8"):
        estimate(chain, node8, Strategy(dp=16))
    with pytest.raises(ValueError, match="segments of the layer chain"):
        estimate(chain, node8, Strategy(pp=8, num_microbatches=8))
    with pytest.raises(ValueError, match="expected 0"):
        estimate(chain, node8, Strategy(pp=2, stages=(StageSpec(1, 3), StageSpec(3, 6))))


def test_straggler_slows_its_stage(chain, node8):
    st = Strategy(dp=4, pp=2, microbatch_size=1, num_microbatches=4)
    fast = estimate(chain, node8, st)
    slow = estimate(chain, node8.with_speed(5, 0.5), st)  # rank 5 is in pipeline rank 1
    assert slow.stages[1].fwd_s == pytest.approx(2 * fast.stages[1].fwd_s)
    assert slow.stages[0].fwd_s == pytest.approx(fast.stages[0].fwd_s)
    assert slow.step_time_s > fast.step_time_s


def _sharing(cores: int) -> Cluster:
    """4 CPU ranks on one host of `cores` cores."""
    g = Cluster.parse("1x4xcpu")
    return replace(g, groups=(replace(g.groups[0], host_cores=cores),))


@pytest.mark.parametrize(("st", "speed"), [
    (Strategy(dp=4, microbatch_size=1, num_microbatches=1), 0.5),          # all four compute at once
    (Strategy(pp=4, microbatch_size=1, num_microbatches=1), 1.0),          # one stage at a time: a core each
    (Strategy(pp=4, microbatch_size=1, num_microbatches=4), 2 / (4 * 4 / 7)),  # busy 4/7 of the step
    (Strategy(dp=2, pp=2, microbatch_size=1, num_microbatches=1), 1.0),    # busy 1/2: two at once
])
def test_ranks_sharing_host_cores_compute_at_their_share(chain, st, speed):
    own = estimate(chain, _sharing(4), st)
    shared = estimate(chain, _sharing(2), st)
    assert shared.breakdown.compute_s == pytest.approx(own.breakdown.compute_s / speed)
    assert shared.stages[0].fwd_s == pytest.approx(own.stages[0].fwd_s / speed)
    # Without host_cores the devices are independent: the same as a core each.
    assert estimate(chain, Cluster.parse("1x4xcpu"), st).step_time_s == pytest.approx(own.step_time_s)


def test_mixed_cluster_prices_each_stage_on_its_device(chain):
    cluster = Cluster.parse(str(EXAMPLES / "mixed-a100-v100.yaml"))
    e = estimate(chain, cluster, Strategy(dp=32, pp=2, microbatch_size=1, num_microbatches=2))
    assert [s.device for s in e.stages] == ["a100-80gb", "v100-32gb"]
    assert e.stages[1].capacity_bytes < e.stages[0].capacity_bytes


def test_deterministic_and_fast_for_gpt3_175b():
    chain = gpt_chain(GptShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1))
    cluster = Cluster.parse("128x8xa100-80gb")
    st = Strategy(dp=16, pp=8, tp=1, microbatch_size=1, num_microbatches=12, schedule="interleaved",
                  virtual_stages=3, recompute="selective", zero_stage=1)
    estimate(chain, cluster.with_speed(0, 1.0), Strategy(dp=1))  # warm the per-process caches
    t0 = time.process_time()
    a = estimate(chain, cluster, st)
    elapsed = time.process_time() - t0
    b = estimate(chain, cluster, st)
    assert a == b and a.to_dict() == b.to_dict()
    assert elapsed < 1.0, f"one gpt3-175b estimate took {elapsed:.2f} s"


def test_tied_embedding_copy_on_the_last_stage(node8):
    tied = gpt_chain(SHAPE, tied=True)
    st = Strategy(pp=2, microbatch_size=1, num_microbatches=4)
    e = estimate(tied, node8, st)
    copy = SHAPE.vocab * SHAPE.hidden
    stages = even_stages(tied, 2)
    own = [sum(tied.segments[i].param_count for i in range(s.start, s.stop)) for s in stages]
    m0, m1 = (s.memory for s in e.stages)
    assert m0.params == 2 * own[0] and m1.params == 2 * (own[1] + copy)
    assert m1.optimizer == 12 * (own[1] + copy)
    untied_tail = estimate(tied, node8, Strategy(microbatch_size=1, num_microbatches=4))
    assert untied_tail.stages[0].memory.params == 2 * tied.graph.param_count  # one rank: no copy
    sync = collective_time(Collective.ALL_REDUCE, 2 * copy, CommGroup(2, stride=1), node8)
    assert e.breakdown.dp_comm_s >= sync


def test_accepts_a_traced_graph():
    import torch

    import ir

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    graph = ir.trace(model, (torch.empty(8, 64, device="meta"),), model_name="mlp")
    cluster = Cluster.parse("1x1xa100-80gb")
    a = estimate(graph, cluster, Strategy(microbatch_size=8))
    b = estimate(ir.build_layer_chain(graph), cluster, Strategy(microbatch_size=8))
    assert a == b and a.tokens_per_s is None and a.samples_per_s == pytest.approx(8 / a.step_time_s)
