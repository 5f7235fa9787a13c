"""Framework behaviours as priced, recorded choices (`RuntimeOptions`), the error band, and ties."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster, Estimate, RuntimeOptions, Strategy
from costmodel.estimate import estimate
from costmodel.hardware.catalog import get_device
from costmodel.validation import error_band, unvalidated_band, within_band
from planner.runtime.parallelize import runtime_unsupported
from planner.search.ranking import prefer_simplest, simplicity_key
from planner.search.space import SearchSpace

SHAPE = GptShape(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, batch=1)


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE)


@pytest.fixture(scope="module")
def two_nodes():
    return Cluster.parse("2x8xa100-80gb")


def test_strategy_records_runtime_options_and_rejects_unknown_ones():
    s = Strategy(dp=2, runtime=RuntimeOptions(dp_overlap=False, tp_overlap=True))
    assert Strategy.from_dict(s.to_dict()) == s
    assert s.to_dict()["runtime"] == {"dp_overlap": False, "reshard_after_forward": True, "tp_overlap": True}
    piped = Strategy(dp=2, runtime=RuntimeOptions(p2p_blocking=True))  # later options are written only when set
    assert piped.to_dict()["runtime"]["p2p_blocking"] and "p2p_scatter_gather" not in piped.to_dict()["runtime"]
    assert Strategy.from_dict(piped.to_dict()) == piped
    old = {k: v for k, v in s.to_dict().items() if k != "runtime"}
    assert Strategy.from_dict(old).runtime == RuntimeOptions()  # plans written before the field
    with pytest.raises(ValueError, match="unknown runtime options.*valid: dp_overlap"):
        RuntimeOptions.from_dict({"dp_overlap": True, "overlap_everything": True})


def test_fix_keys_set_runtime_options():
    space = SearchSpace.from_fixes(["dp_overlap=false", "reshard_after_forward=no", "tp=2"])
    assert space.runtime == RuntimeOptions(dp_overlap=False, reshard_after_forward=False)
    assert "runtime" not in space.pinned()
    with pytest.raises(ValueError, match="tp_overlap=maybe: expected true or false"):
        SearchSpace.from_fixes(["tp_overlap=maybe"])


def test_data_parallel_overlap_is_priced(chain, two_nodes):
    base = Strategy(dp=16, microbatch_size=1, num_microbatches=4)
    on = estimate(chain, two_nodes, base)
    off = estimate(chain, two_nodes, Strategy(dp=16, microbatch_size=1, num_microbatches=4,
                                              runtime=RuntimeOptions(dp_overlap=False)))
    assert off.breakdown.dp_comm_s > on.breakdown.dp_comm_s > 0
    assert off.step_time_s - on.step_time_s == pytest.approx(off.breakdown.dp_comm_s - on.breakdown.dp_comm_s)


def test_the_fp32_gradient_pass_is_a_memory_bound_pass_per_micro_batch(chain, two_nodes):
    """DeepSpeed's BF16_Optimizer upcasts and adds each micro-batch's gradients into fp32 buffers: 2 + 16 bytes
    per local parameter per micro-batch at the optimizer's memory bandwidth, as weight-gradient work."""
    from costmodel.step_time import FP32_GRAD_PASS_EXTRA_BYTES

    kw = dict(dp=4, pp=2, microbatch_size=1, num_microbatches=4)
    plain = estimate(chain, two_nodes, Strategy(**kw))
    passed = estimate(chain, two_nodes, Strategy(**kw, runtime=RuntimeOptions(fp32_grad_pass=True)))
    device = two_nodes.groups[0].device
    bandwidth = device.memory_bandwidth * device.memory_efficiency * device.training_efficiency
    for a, b in zip(plain.stages, passed.stages, strict=True):
        local_params = a.memory.params / 2  # bf16 weights, replicated (ZeRO-0), untied: the stage's own
        expected = local_params * (2 + FP32_GRAD_PASS_EXTRA_BYTES) / bandwidth
        assert b.bwd_s - a.bwd_s == pytest.approx(expected, rel=1e-9)
    assert passed.breakdown.compute_s > plain.breakdown.compute_s
    assert passed.breakdown.dp_comm_s <= plain.breakdown.dp_comm_s  # a longer backward hides more of it
    assert "fp32_grad_pass" in runtime_unsupported(Strategy(**kw, runtime=RuntimeOptions(fp32_grad_pass=True)))


def test_keeping_gathered_weights_trades_memory_for_the_backward_gather(chain, two_nodes):
    kw = dict(dp=16, microbatch_size=1, num_microbatches=4, zero_stage=3)
    reshard = estimate(chain, two_nodes, Strategy(**kw))
    kept = estimate(chain, two_nodes, Strategy(**kw, runtime=RuntimeOptions(reshard_after_forward=False)))
    assert kept.breakdown.dp_comm_s <= reshard.breakdown.dp_comm_s
    assert kept.stages[0].memory.temporary > reshard.stages[0].memory.temporary


def test_runtime_refuses_what_it_does_not_run():
    assert "tp_overlap" in runtime_unsupported(Strategy(tp=2, runtime=RuntimeOptions(tp_overlap=True)))
    assert "dp_overlap" in runtime_unsupported(Strategy(dp=2, runtime=RuntimeOptions(dp_overlap=False)))
    assert runtime_unsupported(Strategy(dp=2, zero_stage=3, runtime=RuntimeOptions(reshard_after_forward=False))) == ""
    # the zero-bubble schedules' split backward: no recomputation, and ZeRO-3 keeps the gathered weights
    zbv = dict(pp=2, virtual_stages=2, num_microbatches=4, schedule="zbv")
    assert "without activation recomputation" in runtime_unsupported(Strategy(**zbv, recompute="full"))
    assert "reshard_after_forward=false" in runtime_unsupported(Strategy(**zbv, dp=2, zero_stage=3))
    assert runtime_unsupported(Strategy(**zbv, dp=2, zero_stage=3,
                                        runtime=RuntimeOptions(reshard_after_forward=False))) == ""


def test_error_band_is_the_least_validated_device_type():
    h100, a100, b200 = (get_device(n) for n in ("h100-sxm", "a100-80gb", "b200"))
    assert h100.prediction_error is not None and a100.prediction_error is not None
    assert error_band([h100]) == h100.prediction_error
    assert error_band([h100, a100]) == max(h100.prediction_error, a100.prediction_error)
    assert b200.prediction_error is None and error_band([b200]) == unvalidated_band() > 0
    assert within_band(1.05, 1.0, 0.06) and not within_band(1.07, 1.0, 0.06)


class _Ranked:
    def __init__(self, strategy: Strategy, seconds: float, band: float) -> None:
        self.strategy, self.objective = strategy, seconds
        self.estimate = Estimate(step_time_s=seconds, tokens_per_s=None, samples_per_s=1.0,
                                 model_tflops_per_device=1.0, hardware_tflops_per_device=1.0, mfu=0.5, hfu=0.5,
                                 stages=(), breakdown=None, fits=True, error_band=band)  # type: ignore[arg-type]


def test_the_simplest_of_tied_strategies_leads():
    fastest = Strategy(dp=4, tp=2, microbatch_size=1, num_microbatches=2, zero_stage=3)
    simple = Strategy(dp=8, microbatch_size=2, num_microbatches=1)
    slow_simple = Strategy(dp=8, microbatch_size=1, num_microbatches=2)
    ranked = [_Ranked(fastest, 1.00, 0.10), _Ranked(simple, 1.08, 0.10), _Ranked(slow_simple, 1.30, 0.10)]
    order = prefer_simplest(ranked)
    assert [r.strategy for r in order] == [simple, fastest, slow_simple]
    assert simplicity_key(simple) < simplicity_key(fastest)
    # With no band (an unvalidated profile-free case never has 0, but a band of 0 means "rank strictly").
    strict = [_Ranked(fastest, 1.00, 0.0), _Ranked(simple, 1.08, 0.0)]
    assert prefer_simplest(strict)[0].strategy == fastest


def test_estimate_flags_and_report(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "estimate", "gpt-tiny", "--cluster", "1x8xa100-80gb",
         "--batch", "16", "--tp", "2", "--pp", "1", "--dp", "4", "--mbs", "2", "--zero", "3", "--keep-gathered",
         "--tp-overlap", "--no-dp-overlap", "--recompute", "op", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["strategy"]["runtime"] == {"dp_overlap": False, "reshard_after_forward": False, "tp_overlap": True}
    assert plan["strategy"]["recompute"] == "op" and plan["predicted"]["error_band"] > 0
    text = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "estimate", "gpt-tiny", "--cluster", "1x8xa100-80gb",
         "--batch", "16", "--tp", "2", "--pp", "1", "--dp", "4", "--mbs", "2", "--tp-overlap"],
        capture_output=True, text=True, timeout=300).stdout
    assert "runtime: data-parallel overlap on, tensor-parallel overlap on" in text
    assert "step time:" in text and "± " in text
    piped = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "estimate", "gpt-tiny", "--cluster", "1x8xa100-80gb",
         "--batch", "16", "--tp", "2", "--pp", "2", "--dp", "2", "--mbs", "2", "--p2p-scatter-gather",
         "--p2p-blocking", "--json"], capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    runtime = json.loads(piped.stdout)["strategy"]["runtime"]
    assert runtime["p2p_scatter_gather"] and runtime["p2p_blocking"]


def test_a_plan_for_a_tuned_configuration_takes_the_fastest_not_the_simplest_tie(chain):
    """`plan(simplest_tie=False)` (what a published run left unstated) returns the fastest plan the search proves;
    the default returns the simplest plan within the error band of it, which is slower here."""
    from planner.api import plan

    cluster = Cluster.parse("1x8xa100-80gb")
    simplest = plan(chain, None, cluster, global_batch=128)
    fastest = plan(chain, None, cluster, global_batch=128, simplest_tie=False)
    assert fastest.predicted.step_time_s < simplest.predicted.step_time_s
    assert within_band(simplest.predicted.step_time_s, fastest.predicted.step_time_s, simplest.predicted.error_band)
    assert simplicity_key(simplest.strategy) < simplicity_key(fastest.strategy)
    assert fastest.search.status == "optimal"


def test_a_trainers_schedule_families_bound_the_search():
    """`schedules` (`--fix schedules=1f1b,interleaved`, what Megatron-LM runs) searches exactly those families: its
    plan is the better of the two searched one at a time, and never a zero-bubble or V schedule."""
    from costmodel.strategy import Schedule
    from planner.api import plan
    from planner.search.space import SearchSpace

    deep = gpt_chain(GptShape(layers=8, hidden=1024, heads=16, seq=1024, vocab=32000, batch=1))
    cluster = Cluster.parse("2x8xa100-80gb")
    megatron = frozenset({Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})
    free = plan(deep, None, cluster, global_batch=64, space=SearchSpace(pp=4), simplest_tie=False)
    assert free.strategy.schedule.zero_bubble  # what the restriction takes away here
    bounded = plan(deep, None, cluster, global_batch=64, space=SearchSpace(pp=4, schedules=megatron),
                   simplest_tie=False)
    each = [plan(deep, None, cluster, global_batch=64, space=SearchSpace(pp=4, schedule=s), simplest_tie=False)
            for s in sorted(megatron)]
    assert bounded.strategy.schedule in megatron
    assert bounded.predicted.step_time_s == min(p.predicted.step_time_s for p in each)
    # pp = 1 runs under any trainer; a pinned schedule must be one of the families
    assert plan(deep, None, cluster, global_batch=64,
                space=SearchSpace(pp=1, schedules=frozenset({Schedule.INTERLEAVED}))).strategy.pp == 1
    assert SearchSpace.from_fixes(["schedules=1f1b, interleaved"]).schedules == megatron
    for bad, message in ((["schedules=1f1b,zigzag"], "comma-separated list"),
                         (["schedules=1f1b", "schedule=zbv"], "not one of schedules=1f1b")):
        with pytest.raises(ValueError, match=message):
            SearchSpace.from_fixes(bad)
