"""Framework overheads (`costmodel.framework`): profile round trip, closed forms in the step-time terms and the
sharding pricer, and the search's objective still equal to `costmodel.estimate` when a profile holds them."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import astuple, replace

import pytest
from test_search_bruteforce import (
    GPT_INTERLEAVE,
    GPT_MEMORY,
    GPT_TINY,
    chain_of,
    plain_where_left_out,
    random_partition,
)

from costmodel.estimate import RankSetting, estimate, param_tensor_kinds, rank_step_terms
from costmodel.framework import (
    NO_FRAMEWORK_COSTS,
    DataParallelMode,
    FrameworkCosts,
    PassCost,
    dp_mode,
)
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.layer_cost import LayerCost
from costmodel.layer_pricing import owned_param_tensors, price_segment
from costmodel.memory import PricedSegment, rank_memory, runs
from costmodel.profile_db import OpProfile, OpTiming
from costmodel.step_time import data_parallel_comm, host_time, optimizer_step_time, tp_grad_sync_time
from costmodel.strategy import Recompute, Schedule, Strategy
from planner.search.candidates import enumerate_candidates
from planner.search.layer_costs import LayerCostTable
from planner.search.pricing import layer_cost_map
from planner.search.space import SearchSpace
from planner.search.stage_problem import StageProblemBuilder

COSTS = FrameworkCosts(
    optimizer_per_tensor_s=20e-6, optimizer_per_dtensor_s=150e-6,
    dp_unit={DataParallelMode.REPLICATE: {2: PassCost(1e-3, 2e-3)},
             DataParallelMode.FSDP: {2: PassCost(1.5e-3, 2.5e-3), 4: PassCost(2e-3, 3e-3)},
             DataParallelMode.FSDP_RESHARD: {2: PassCost(2e-3, 4e-3), 4: PassCost(3e-3, 5e-3)}},
    tp_module={2: PassCost(0.4e-3, 0.8e-3), 4: PassCost(0.6e-3, 1.2e-3)},
    grad_sync={2: 2e-3})


def test_profile_round_trip_and_lookup_by_group_size() -> None:
    profile = OpProfile(entries={**COSTS.entries("cpu"), ("cpu", "torch.nn.Linear|in=..."): OpTiming(1e-4, 2e-4)})
    back = FrameworkCosts.from_profile(OpProfile.from_dict(profile.to_dict()), "cpu")
    assert back == COSTS
    assert FrameworkCosts.from_profile(profile, "a100-80gb") is NO_FRAMEWORK_COSTS
    assert FrameworkCosts.from_profile(None, "cpu").is_zero and not COSTS.is_zero
    assert back.dp_unit_cost(3, 4) == PassCost(3e-3, 5e-3)
    assert back.dp_unit_cost(3, 8) == PassCost(3e-3, 5e-3)      # nearest measured size below
    assert back.dp_unit_cost(0, 8) == PassCost(1e-3, 2e-3)
    assert back.dp_unit_cost(1, 1) == PassCost()                  # no data parallelism, no unit
    assert back.tp_module_cost(3) == PassCost(0.4e-3, 0.8e-3)
    assert back.optimizer_host_s(10, 2) == pytest.approx(10 * 20e-6 + 2 * 150e-6)
    assert back.grad_sync_per_tensor(4) == 2e-3 and back.grad_sync_per_tensor(1) == 0.0
    assert [dp_mode(z) for z in range(4)] == [DataParallelMode.REPLICATE, DataParallelMode.FSDP,
                                              DataParallelMode.FSDP, DataParallelMode.FSDP_RESHARD]
    with pytest.raises(ValueError, match=">= 0"):
        PassCost(-1.0, 0.0)


def test_optimizer_pays_host_work_unscaled_by_speed() -> None:
    cpu = Cluster.parse("1x2xcpu").device_of(0)
    base = optimizer_step_time(10_000, cpu)
    assert optimizer_step_time(10_000, cpu, host_s=5e-3) == pytest.approx(base + 5e-3)
    # host work per tensor is measured as the ranks run, not at the device's speed
    assert optimizer_step_time(10_000, cpu, speed=0.5, host_s=5e-3) == pytest.approx(2 * base + 5e-3)


def test_tp_gradient_sync_is_one_flat_all_reduce_plus_per_tensor_work() -> None:
    cluster = Cluster.parse("1x4xcpu")
    group = CommGroup(4)
    one = collective_time(Collective.ALL_REDUCE, 1e5, group, cluster)
    assert 10 * one > collective_time(Collective.ALL_REDUCE, 1e6, group, cluster)  # latency paid once, not 10x
    whole = collective_time(Collective.ALL_REDUCE, 1e6, group, cluster)
    assert tp_grad_sync_time(1e6, 10, group, cluster) == pytest.approx(whole)   # one flat all-reduce
    assert tp_grad_sync_time(1e6, 10, group, cluster, per_tensor_s=2e-3) == pytest.approx(whole + 20e-3)
    assert tp_grad_sync_time(0, 10, group, cluster) == 0 and tp_grad_sync_time(1e6, 10, CommGroup(1), cluster) == 0


def test_data_parallel_units_pay_latency_each() -> None:
    cluster = Cluster.parse("1x4xcpu")
    group = CommGroup(4)
    nbytes = 4e6

    def comm(zero: int):
        return data_parallel_comm(zero_stage=zero, grad_bytes=nbytes, param_bytes=nbytes, num_segments=5,
                                  fwd_window_s=0.0, bwd_window_s=0.0, group=group, cluster=cluster)

    # One gather and one reduce-scatter per unit, each with its latency; ZeRO-0: one all-reduce.
    ag = 5 * collective_time(Collective.ALL_GATHER, nbytes / 5, group, cluster)
    rs = 5 * collective_time(Collective.REDUCE_SCATTER, nbytes / 5, group, cluster)
    assert comm(3).per_microbatch_fwd_s == pytest.approx(ag)          # no window: all exposed
    assert comm(3).per_microbatch_bwd_s == pytest.approx(ag + rs)
    assert comm(1).end_reduce_s == pytest.approx(rs) and comm(1).post_step_s == pytest.approx(ag)
    assert comm(0).end_reduce_s == pytest.approx(collective_time(Collective.ALL_REDUCE, nbytes, group, cluster))


def test_host_time_counts_units_actions_and_checkpointed_layers() -> None:
    chain = chain_of("gpt", GPT_TINY)
    device = Cluster.parse("1x2xcpu").device_of(0)
    costs = [price_segment(chain, s, device, microbatch_size=1) for s in chain.segments]
    framework = replace(COSTS, pp_action={2: PassCost(0.3e-3, 0.5e-3)},
                        recompute={"selective": PassCost(1e-3, 4e-3), "full": PassCost(0.5e-3, 2e-3)})
    segs = [PricedSegment(c, Recompute.NONE) for c in costs]
    assert host_time(segs, framework, zero_stage=3, dp_size=2, pipeline_size=1) == \
        PassCost(len(segs) * 2e-3, len(segs) * 4e-3)
    assert host_time(segs, framework, zero_stage=0, dp_size=2, pipeline_size=2) == PassCost(1e-3 + 0.3e-3,
                                                                                           2e-3 + 0.5e-3)
    # selective checkpoints only the segments with an attention core (the blocks); full every segment
    blocks = sum(1 for c in costs if c.recompute_selective_s > 0)
    assert 0 < blocks < len(costs)
    sel = host_time([PricedSegment(c, Recompute.SELECTIVE) for c in costs], framework, zero_stage=0, dp_size=1,
                    pipeline_size=1)
    full = host_time([PricedSegment(c, Recompute.FULL) for c in costs], framework, zero_stage=0, dp_size=1,
                     pipeline_size=1)
    assert sel == PassCost(blocks * 1e-3, blocks * 4e-3)
    assert full == PassCost(len(costs) * 0.5e-3, len(costs) * 2e-3)
    assert host_time(segs, NO_FRAMEWORK_COSTS, zero_stage=3, dp_size=8, pipeline_size=4) == PassCost()


def test_host_time_of_chunked_and_zero_bubble_schedules() -> None:
    chain = chain_of("gpt", GPT_TINY)
    device = Cluster.parse("1x2xcpu").device_of(0)
    segs = [PricedSegment(price_segment(chain, s, device, microbatch_size=1), Recompute.NONE) for s in chain.segments]
    framework = replace(COSTS, pp_action={2: PassCost(0.1e-3, 0.1e-3)}, pp_chunked_action={2: PassCost(0.4e-3, 0.4e-3)},
                        split_backward=PassCost(0.0, 0.8e-3))
    layers = sum(s.count for s in segs)

    def host(schedule: Schedule, fw: FrameworkCosts = framework, pp: int = 2) -> PassCost:
        return host_time(segs, fw, zero_stage=0, dp_size=1, pipeline_size=pp, schedule=schedule)

    assert host(Schedule.ONE_F_ONE_B) == host(Schedule.GPIPE) == PassCost(0.1e-3, 0.1e-3)
    assert host(Schedule.INTERLEAVED) == PassCost(0.4e-3, 0.4e-3)
    # the zero-bubble schedules run on the action runtime and split every layer's backward
    for schedule in (Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV):
        zb = host(schedule)
        assert zb.forward_s == 0.4e-3 and zb.backward_s == pytest.approx(0.4e-3 + layers * 0.8e-3)
    # without a pipeline nothing of it; a profile without the chunked figure prices the single-stage one
    assert host(Schedule.INTERLEAVED_ZB, pp=1) == PassCost()
    assert host(Schedule.INTERLEAVED, replace(framework, pp_chunked_action={})) == PassCost(0.1e-3, 0.1e-3)


def test_owned_param_tensors_count_a_tied_weight_once() -> None:
    chain = chain_of("gpt", GPT_TINY)
    counts = [owned_param_tensors(chain, s) for s in chain.segments]
    total = len({name for n in chain.graph.nodes for name in n.param_names})
    assert sum(counts) == total
    assert counts[-1] == sum(1 for n in chain.nodes_of(chain.segments[-1]) for name in n.param_names
                             if name.startswith("norm"))  # the tied head owns only the final norm


def test_estimate_adds_the_framework_terms_in_closed_form() -> None:
    chain = chain_of("gpt", GPT_TINY)
    cluster = Cluster.parse("1x2xcpu")
    profile = OpProfile(entries=COSTS.entries("cpu"))
    tensors = len({name for n in chain.graph.nodes for name in n.param_names})
    units = len(chain.segments)
    for zero in range(4):
        strategy = Strategy(dp=2, microbatch_size=1, num_microbatches=2, zero_stage=zero)
        plain = estimate(chain, cluster, strategy, dtype="float32")
        loaded = estimate(chain, cluster, strategy, dtype="float32", profile=profile)
        unit = COSTS.dp_unit_cost(zero, 2)
        per_mb = (1 if zero == 0 else units) * (unit.forward_s + unit.backward_s)
        assert loaded.breakdown.optimizer_s - plain.breakdown.optimizer_s == pytest.approx(tensors * 150e-6)
        assert loaded.breakdown.framework_s == pytest.approx(2 * per_mb) and plain.breakdown.framework_s == 0
        assert loaded.step_time_s - plain.step_time_s == pytest.approx(2 * per_mb + tensors * 150e-6, rel=1e-6)
        assert loaded.breakdown.total_s == pytest.approx(loaded.step_time_s)
    # A single device holds plain tensors.
    one = Strategy(microbatch_size=1, num_microbatches=4)
    seg = price_segment(chain, chain.segments[1], cluster.device_of(0), microbatch_size=1)
    costs = [replace(seg, param_tensors=12, dtensor_param_tensors=8)] * 2
    assert param_tensor_kinds(one, costs) == (24, 0)
    assert param_tensor_kinds(Strategy(tp=2, microbatch_size=1, num_microbatches=4), costs) == (8, 16)
    assert param_tensor_kinds(Strategy(dp=2, tp=2, microbatch_size=1, num_microbatches=4), costs) == (0, 24)
    delta = (estimate(chain, cluster, one, dtype="float32", profile=profile).step_time_s
             - estimate(chain, cluster, one, dtype="float32").step_time_s)
    assert delta == pytest.approx(tensors * 20e-6)


def test_sharded_modules_pay_the_dispatch_overhead() -> None:
    chain = chain_of("gpt", GPT_MEMORY)  # large enough that the GPU shards it in Megatron's layout
    cluster = Cluster.parse("1x2xa100-80gb")
    device = cluster.device_of(0)
    small = FrameworkCosts(tp_module={2: PassCost(0.4e-6, 0.8e-6)})
    plain = LayerCostTable(chain, cluster)
    loaded = LayerCostTable(chain, cluster, profile=OpProfile(entries=small.entries(device.name)))
    block = chain.segments[1].class_id
    a = plain.prices(device, tp=2, tp_stride=1, sequence_parallel=False, microbatch_size=1)
    b = loaded.prices(device, tp=2, tp_stride=1, sequence_parallel=False, microbatch_size=1)
    # The block's four linears (qkv, out, fc1, fc2) are sharded in Megatron's layout: at least those pay.
    extra_fwd = b.costs[block].fwd_compute_s - a.costs[block].fwd_compute_s
    extra_bwd = b.costs[block].bwd_compute_s - a.costs[block].bwd_compute_s
    assert b.sharding[block] == a.sharding[block]
    assert extra_fwd >= 4 * 0.4e-6 - 1e-15
    assert math.isclose(extra_fwd / 0.4e-6, round(extra_fwd / 0.4e-6), abs_tol=1e-6)
    assert extra_bwd == pytest.approx(2 * extra_fwd)


@pytest.mark.slow
def test_search_objective_equals_estimate_with_framework_costs() -> None:
    """The partition problem prices the framework terms exactly as `costmodel.estimate` does."""
    rng = random.Random(5)
    checked = 0
    for sets, spec in ((GPT_TINY, "1x4xcpu"), (GPT_INTERLEAVE, "1x4xcpu")):
        chain, cluster = chain_of("gpt", sets), Cluster.parse(spec)
        full = replace(COSTS, pp_action={2: PassCost(0.3e-3, 0.5e-3), 4: PassCost(0.4e-3, 0.6e-3)},
                       pp_chunked_action={2: PassCost(0.9e-3, 0.9e-3), 4: PassCost(1.1e-3, 1.1e-3)},
                       split_backward=PassCost(0.0, 0.7e-3),
                       recompute={"selective": PassCost(1e-3, 4e-3), "full": PassCost(0.5e-3, 2e-3)})
        profile = OpProfile(entries=full.entries("cpu"))
        builder = StageProblemBuilder(chain, cluster, LayerCostTable(chain, cluster, profile=profile))
        cands, _ = enumerate_candidates(chain, cluster, 8, SearchSpace(max_microbatch_size=2))
        # one builder prices them all: the schedules of one mesh share its caches, which must tell their host
        # work apart (the multi-chunk engine and the split backward cost more than 1F1B's loop)
        cands += [replace(c, schedule=schedule) for c in cands if c.schedule is Schedule.ONE_F_ONE_B and c.mesh.pp > 1
                  for schedule in (Schedule.GPIPE, Schedule.INTERLEAVED_ZB)]
        for cand in rng.sample(cands, min(30, len(cands))):
            built = builder.build(cand, tuple(Recompute))
            value, strategy, stages = random_partition(built, cand, rng)
            est = estimate(chain, cluster, strategy, layer_costs=layer_cost_map(builder, cand, built.placements),
                           global_batch=8, profile=profile)
            if est.fits and not math.isfinite(value) and built.layout is None:  # left out as dominated
                assert plain_where_left_out(built, stages) <= est.step_time_s * (1 + 1e-9), cand.label
            elif est.fits:
                assert value == pytest.approx(est.step_time_s, rel=1e-9), cand.label
                checked += 1
    assert checked > 30


def test_profiled_segment_glue_is_added_to_the_layer_price() -> None:
    import torch

    from costmodel.layer_pricing import segment_glue
    from costmodel.profile_db import segment_signature
    from planner.profiling.options import ProfileOptions
    from planner.profiling.requests import ModelRequest, profile_requests

    run = profile_requests([ModelRequest("gpt", ("layers=2", "hidden=64", "heads=4", "vocab=128", "seq=32"))],
                           device=torch.device("cpu"), device_name="cpu",
                           options=ProfileOptions(microbatch_sizes=(1,), dtype="float32", warmup=1, repeats=3))
    glue = {sig: t for (_, sig), t in run.profile.entries.items() if sig.startswith("segment|")}
    assert len(glue) == 1  # the block class: embedding and head are not one module each
    assert all(t.forward_s >= 0 and t.backward_s >= 0 for t in glue.values())
    chain = chain_of("gpt", ("layers=2", "hidden=64", "heads=4", "vocab=128", "seq=32"))
    block = chain.segments[1]
    device = Cluster.parse("1x2xcpu").device_of(0)
    key = segment_signature(block.structural_hash, 1, "float32")
    assert key in glue  # the meta-device trace and the profiled model agree on the layer's structure
    fake = OpProfile(entries={("cpu", key): OpTiming(1e-3, 2e-3)})
    assert segment_glue(block, device, microbatch_size=1, dtype="float32", profile=fake) == OpTiming(1e-3, 2e-3)
    plain = price_segment(chain, block, device, microbatch_size=1, dtype="float32")
    loaded = price_segment(chain, block, device, microbatch_size=1, dtype="float32", profile=fake)
    assert loaded.fwd_compute_s - plain.fwd_compute_s == pytest.approx(1e-3)
    assert loaded.bwd_compute_s - plain.bwd_compute_s == pytest.approx(2e-3)


def _layer(params: int, saved: int, **kw) -> LayerCost:
    base = dict(fwd_compute_s=1e-3, bwd_compute_s=2e-3, fwd_comm_s=1e-4, bwd_comm_s=2e-4, param_count=params,
                param_bytes=2 * params, saved_bytes_none=saved, saved_bytes_selective=saved // 2,
                saved_bytes_full=saved // 10, recompute_selective_s=5e-5, recompute_full_s=1.1e-3, boundary_bytes=64,
                peak_temp_bytes=saved // 3, param_tensors=4, dtensor_param_tensors=2, grad_sync_bytes=100,
                grad_sync_tensors=2)
    base.update(kw)
    return LayerCost(**base)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_run_of_identical_segments_prices_as_the_segments_it_stands_for(zero: int) -> None:
    """`memory.runs` merges a stage's identical blocks into one `PricedSegment` with a count: every term of
    `rank_step_terms` and `rank_memory` is what the segments one by one give."""
    embed, block, head = _layer(5000, 800), _layer(1200, 3000), _layer(5000, 900, loss_elements=4096)
    segs = [PricedSegment(embed), *[PricedSegment(block)] * 3, *[PricedSegment(block, Recompute.FULL)] * 2,
            PricedSegment(block), PricedSegment(head)]
    merged = runs(segs)
    assert [s.count for s in merged] == [1, 3, 2, 1, 1]
    strategy = Strategy(dp=4, tp=2, pp=1, microbatch_size=1, num_microbatches=4, zero_stage=zero)
    cluster = Cluster.parse("1x8xcpu")
    rank = RankSetting(0, cluster.device_of(0), 1.0, COSTS)
    one_by_one = rank_step_terms([segs], 0, strategy, rank, cluster, "bfloat16")
    as_runs = rank_step_terms([merged], 0, strategy, rank, cluster, "bfloat16")
    assert astuple(as_runs[0][0]) == pytest.approx(astuple(one_by_one[0][0]), rel=1e-12)
    assert astuple(as_runs[1]) == pytest.approx(astuple(one_by_one[1]), rel=1e-12)
    for in_flight, pipelined in itertools.product((0, 1, 3), (False, True)):
        kw = dict(zero_stage=zero, dp=4, device_name="cpu", pipelined=pipelined)
        assert rank_memory([merged], [in_flight], **kw) == rank_memory([segs], [in_flight], **kw)
