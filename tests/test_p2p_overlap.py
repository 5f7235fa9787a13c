"""Megatron-Core's overlapped interleaved sends (`RuntimeOptions.p2p_overlap`, `overlap_p2p_comm`): priced in the
estimate as the fill and drain see them (the closed form and its event simulation are in tests/test_pipeline.py,
the search against brute force in tests/test_search_bruteforce.py), and what the runtime and Megatron-LM's export
do with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain
from test_trainers import golden, round_trip  # noqa: F401  (the fixture is used by name)

from costmodel import Cluster, RuntimeOptions, Strategy
from costmodel.estimate import estimate, p2p_time
from planner.runtime.parallelize import runtime_unsupported
from planner.trainers.common import Trainer

SHAPE = GptShape(layers=8, hidden=1024, heads=16, seq=1024, vocab=32000, batch=1)
OVERLAP = RuntimeOptions(p2p_overlap=True)


def test_overlapped_sends_cost_each_boundary_twice_per_step_not_per_micro_batch():
    chain, cluster = gpt_chain(SHAPE), Cluster.parse("2x8xa100-80gb")
    kw = dict(dp=4, pp=4, microbatch_size=1, num_microbatches=8, schedule="interleaved", virtual_stages=2)
    blocking = estimate(chain, cluster, Strategy(**kw))
    overlapped = estimate(chain, cluster, Strategy(**kw, runtime=OVERLAP))
    s = Strategy(**kw)
    boundaries = s.pp * s.virtual_stages - 1
    nbytes = 1 * SHAPE.seq * SHAPE.hidden * 2  # one micro-batch's bf16 boundary activation
    sends = sum(p2p_time(s, j, nbytes, cluster) for j in range(boundaries))
    assert overlapped.breakdown.pp_comm_s == pytest.approx(2 * sends, rel=1e-6)
    assert 0 < overlapped.breakdown.pp_comm_s < blocking.breakdown.pp_comm_s
    assert blocking.step_time_s - overlapped.step_time_s == pytest.approx(
        blocking.breakdown.pp_comm_s - overlapped.breakdown.pp_comm_s, rel=1e-6)
    one_f = estimate(chain, cluster, Strategy(**{**kw, "schedule": "1f1b", "virtual_stages": 1}, runtime=OVERLAP))
    assert one_f.step_time_s == estimate(chain, cluster, Strategy(**{**kw, "schedule": "1f1b",
                                                                      "virtual_stages": 1})).step_time_s


def test_the_runtime_runs_it_and_megatron_exports_it(golden, tmp_path: Path):  # noqa: F811
    # torch's interleaved runtime posts its sends and receives ahead as well: this runtime runs such a plan
    interleaved = Strategy(dp=1, pp=2, num_microbatches=4, schedule="interleaved", virtual_stages=2, runtime=OVERLAP)
    assert runtime_unsupported(interleaved) == ""
    plan, layout, shape = golden["gpt-tiny-interleaved-1x8xa100"]
    result, back = round_trip(plan, layout, shape, Trainer.MEGATRON, tmp_path)
    assert "--no-overlap-p2p-communication" in result.text and not back.strategy.runtime.p2p_overlap
    runtime = dataclasses.replace(plan.strategy.runtime, p2p_overlap=True)
    variant = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, runtime=runtime))
    (tmp_path / "on").mkdir()
    result, back = round_trip(variant, layout, shape, Trainer.MEGATRON, tmp_path / "on")
    assert "overlap-p2p" not in result.text and back.strategy.runtime.p2p_overlap
