"""`planner.profiling.framework` and `stratagem profile --framework`: the runtime's framework overheads measured in a
gloo process group, net of the collectives the other models price, stored as profile entries that
`costmodel.framework.FrameworkCosts.from_profile` reads back."""

from __future__ import annotations

import json
import math

import pytest
from torch import nn

from costmodel.framework import RECOMPUTE_MODES, DataParallelMode, FrameworkCosts
from costmodel.profile_db import OpProfile
from planner.cli.main import main
from planner.profiling.framework import FrameworkOptions, measure_framework, per_tensor_intercept
from planner.profiling.framework_passes import ReferenceBlock, fsdp_padded_numel
from planner.profiling.pipeline_actions import action_pair_overhead, priced_wire_s
from planner.profiling.spawn import divisor_group_sizes


def test_group_sizes_default_to_every_divisor_of_at_least_two():
    assert divisor_group_sizes(2) == (2,)
    assert divisor_group_sizes(6) == (2, 3, 6)
    assert FrameworkOptions(processes=4).group_sizes == (2, 4)
    assert FrameworkOptions(processes=4, group_sizes=(4, 2, 4)).group_sizes == (2, 4)


@pytest.mark.parametrize("kwargs, message", [
    ({"processes": 1}, "at least 2 processes"),
    ({"processes": 4, "group_sizes": (3,)}, "valid: 2, 4"),
    ({"repeats": 0}, "repeats must be a positive integer"),
    ({"optimizer_sides": (16, 16)}, "two different"),
    ({"hidden": 32, "heads": 5}, "heads must divide hidden"),
])
def test_options_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FrameworkOptions(**kwargs)


def test_per_tensor_intercept_recovers_the_constant_of_a_line():
    # K tensors of n elements: t(n) = K * a + K * c * n; the intercept over K is a whatever c is.
    k, a, c = 48, 1.1e-4, 3e-9
    step = {n: k * a + k * c * n for n in (32 * 32, 128 * 128)}
    assert math.isclose(per_tensor_intercept((1024, step[1024]), (16384, step[16384]), k), a, rel_tol=1e-12)


def test_action_pair_overhead_is_the_1f1b_slope_less_compute_and_wire():
    # 1F1B over p stages: t(m) = c + (m + p - 1) * (compute + wire + host) for m micro-batches.
    p, c, compute, wire, host = 4, 2e-3, 3e-4, 1e-4, 7e-4
    step = {m: c + (m + p - 1) * (compute + wire + host) for m in (p, 3 * p)}
    assert math.isclose(action_pair_overhead((step[p], step[3 * p]), (p, 3 * p), compute, wire), host,
                        rel_tol=1e-9)


def test_action_pair_overhead_of_a_chunked_schedule_is_per_chunk():
    # v chunks per rank: the slope per micro-batch is v pairs (compute, host) plus the rank's wire
    p, v, c, compute, wire, host = 2, 2, 1e-3, 3e-4, 5e-4, 9e-4
    step = {m: c + m * (v * (compute + host) + wire) for m in (p, 3 * p)}
    assert math.isclose(action_pair_overhead((step[p], step[3 * p]), (p, 3 * p), v * compute, wire, v), host,
                        rel_tol=1e-9)


def test_priced_wire_matches_the_pipeline_model_on_its_busiest_stage():
    from costmodel.pipeline import pipeline_step_time
    from costmodel.strategy import Schedule

    # the wire's share of the 1F1B slope per micro-batch in costmodel.pipeline, equal stages, one hop = 1 ms
    for p in (2, 3, 4, 8):
        def step(m, p2p, p=p):
            return pipeline_step_time([1.0] * p, [2.0] * p, Schedule.ONE_F_ONE_B, m, 1, p2p)
        slope = (step(3 * p, 1e-3) - step(p, 1e-3)) / (2 * p) - (step(3 * p, 0.0) - step(p, 0.0)) / (2 * p)
        assert math.isclose(priced_wire_s(p, 1e-3, 1e-3), slope, rel_tol=1e-9)


def test_priced_wire_of_chunks_matches_the_interleaved_pipeline_model():
    from costmodel.pipeline import pipeline_step_time
    from costmodel.strategy import Schedule

    # rank r holds chunks r, r + p, ...: the wire's share of the interleaved slope per micro-batch, one hop = 1 ms
    for p, v in ((2, 2), (2, 3), (4, 2)):
        def step(m, p2p, p=p, v=v):
            return pipeline_step_time([1.0] * (p * v), [2.0] * (p * v), Schedule.INTERLEAVED, m, v, p2p)
        slope = (step(3 * p, 1e-3) - step(p, 1e-3)) / (2 * p) - (step(3 * p, 0.0) - step(p, 0.0)) / (2 * p)
        assert math.isclose(priced_wire_s(p, 1e-3, 1e-3, v), slope, rel_tol=1e-9), (p, v)


def test_fsdp_padding_rounds_dim_zero_up_to_the_group():
    linear = nn.Linear(5, 3)  # weight (3, 5), bias (3,)
    assert fsdp_padded_numel(linear, 2, recurse=True) == 4 * 5 + 4
    assert fsdp_padded_numel(linear, 3, recurse=True) == 3 * 5 + 3
    block = ReferenceBlock(8)  # norm 8 + 8, up (32, 8) + 32, down (8, 32) + 8: all divisible by 2
    assert fsdp_padded_numel(block, 2, recurse=True) == sum(p.numel() for p in block.parameters())
    assert fsdp_padded_numel(block, 2, recurse=False) == 0


def _check_measured(costs: FrameworkCosts, group_sizes: set[int]) -> None:
    assert 0 < costs.optimizer_per_tensor_s < costs.optimizer_per_dtensor_s < 0.01
    assert set(costs.dp_unit) == set(DataParallelMode)
    for table in costs.dp_unit.values():
        assert set(table) == group_sizes
        assert all(c.forward_s >= 0 and c.backward_s >= 0 and c.forward_s + c.backward_s < 0.5
                   for c in table.values())
    assert any(c for table in costs.dp_unit.values() for c in table.values())  # the wrappers cost something
    reshard = costs.dp_unit[DataParallelMode.FSDP_RESHARD][2]
    assert reshard.forward_s + reshard.backward_s >= 0
    assert set(costs.tp_module) == group_sizes
    # partial gradients share one flat all-reduce: per tensor only its flattening and wrapping remain (it was
    # ~2 ms per tensor on gloo while the optimizer step redistributed each gradient on its own)
    assert set(costs.grad_sync) == group_sizes and all(0 <= v < 1e-3 for v in costs.grad_sync.values())
    # one pipeline size per group size; forward and backward share the action pair half and half
    assert set(costs.pp_action) == set(costs.pp_chunked_action) == group_sizes
    assert all(c.forward_s == c.backward_s and c.forward_s < 0.05
               for table in (costs.pp_action, costs.pp_chunked_action) for c in table.values())
    # the split backward walks the autograd graph and runs a second backward: it costs something, and less
    # than a second whole block's backward would
    assert 0 < costs.split_backward.backward_s < 0.05 and costs.split_backward.forward_s == 0
    assert set(costs.recompute) == set(RECOMPUTE_MODES)
    assert all(c.forward_s >= 0 and c.backward_s >= 0 and c.forward_s + c.backward_s < 0.05
               for c in costs.recompute.values())
    # selective checkpointing calls a Python policy per op of the attention body: it costs something
    assert costs.recompute["selective"]


@pytest.mark.multiprocess
def test_two_processes_measure_every_term_and_round_trip():
    options = FrameworkOptions(processes=2, warmup=1, repeats=3, hidden=32, seq=16, units=2, optimizer_tensors=32)
    costs = measure_framework(options)
    _check_measured(costs, {2})
    entries = costs.entries("cpu")
    # optimizer plain and DTensor, one per mode, tp module, grad sync, pp action (single and chunked), split
    # backward, selective and full recompute
    assert len(entries) == 2 + 3 + 1 + 1 + 2 + 1 + 2
    back = FrameworkCosts.from_profile(OpProfile.from_dict(OpProfile(entries=entries).to_dict()), "cpu")
    assert back == costs
    assert back.dp_unit_cost(3, 2) == costs.dp_unit[DataParallelMode.FSDP_RESHARD][2]
    assert back.pp_action_cost(4) == costs.pp_action[2] and back.recompute_cost("full") == costs.recompute["full"]
    assert back.pp_action_cost(4, chunked=True) == costs.pp_chunked_action[2]


@pytest.mark.multiprocess
def test_cli_framework_merges_the_entries_into_the_profile(tmp_path, capsys):
    out = tmp_path / "profile.json"
    # A small model's operators rather than the standard shape set: the framework entries are what is checked.
    assert main(["profile", "--model", "gpt-tiny", "--batch", "1", "--framework", "--framework-processes", "2",
                 "--repeats", "3", "--warmup", "1", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    prof = OpProfile.load(out)
    costs = FrameworkCosts.from_profile(prof, "cpu")
    _check_measured(costs, {2})
    assert summary["framework"]["optimizer_per_dtensor_s"] == costs.optimizer_per_dtensor_s
    assert summary["framework"]["pp_action"] == {"2": [costs.pp_action[2].forward_s, costs.pp_action[2].backward_s]}
    assert set(summary["framework"]["recompute"]) == set(RECOMPUTE_MODES)
    assert prof.meta["framework_processes"] == "2" and prof.meta["framework_group_sizes"] == "2"
    ops = [sig for _, sig in prof.entries if not sig.startswith("framework|")]
    # 7 as above, plus the pipeline actions of the one group size, the split backward and the two recompute modes
    assert ops and summary["entries"] == len(prof.entries) == len(ops) + 7 + 2 + 1 + 2


@pytest.mark.parametrize("argv, message", [
    (["profile", "--framework-processes", "2"], "--framework-processes needs --framework"),
    (["profile", "--framework", "--framework-processes", "1"], "at least 2 processes"),
    (["profile", "--framework", "--device", "cuda"], "CPU ranks over gloo"),
    (["profile", "--framework", "--framework-processes", "0"], "positive"),
])
def test_cli_framework_user_errors_are_one_line(argv, message, capsys, tmp_path):
    assert main([*argv, "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "p.json").exists()

