"""Gradients kept and reduced in the training dtype (`RuntimeOptions.grads_in_training_dtype`: Megatron-LM
`--grad-reduce-in-bf16`, NeMo `grad_sync_dtype: bf16`): 2 bytes per gradient in memory and on the wire instead of
fp32's 4, the search's memory bounds and the estimate agreeing, and what the runtime and the exports do with it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain
from test_trainers import golden, round_trip  # noqa: F401  (the fixture is used by name)

from costmodel import Cluster, RuntimeOptions, Strategy
from costmodel.estimate import estimate
from costmodel.memory import GRAD_BYTES, model_state_bytes
from planner.api import plan
from planner.runtime.parallelize import runtime_unsupported
from planner.search.space import SearchSpace
from planner.trainers.common import Trainer

SHAPE = GptShape(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, batch=1)
BF16_GRADS = RuntimeOptions(grads_in_training_dtype=True)


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE)


def test_model_state_in_closed_form():
    n, d = 1_000_000, 8
    # ZeRO-1 (Megatron's distributed optimizer): 2 + 2 + 12/d bytes per parameter instead of 2 + 4 + 12/d
    fp32 = model_state_bytes(n, zero_stage=1, dp=d)
    bf16 = model_state_bytes(n, zero_stage=1, dp=d, grad_bytes=BF16_GRADS.grad_bytes(2))
    assert (fp32.params, fp32.grads, fp32.optimizer) == (2 * n, 4 * n, 12 * n // d)
    assert (bf16.params, bf16.grads, bf16.optimizer) == (2 * n, 2 * n, 12 * n // d)
    assert BF16_GRADS.grad_bytes(4) == GRAD_BYTES == RuntimeOptions().grad_bytes(2)  # fp32 training keeps fp32


def test_data_parallel_volume_halves_and_memory_drops(chain):
    cluster = Cluster.parse("2x8xa100-80gb")
    kw = dict(dp=16, microbatch_size=1, num_microbatches=4)
    exposed = RuntimeOptions(dp_overlap=False)
    fp32 = estimate(chain, cluster, Strategy(**kw, runtime=exposed))
    bf16 = estimate(chain, cluster, Strategy(**kw, runtime=dataclasses.replace(exposed,
                                                                                grads_in_training_dtype=True)))
    # ZeRO-0: one all-reduce of the gradients, exposed; latency terms keep the ratio a little above one half
    assert bf16.breakdown.dp_comm_s == pytest.approx(fp32.breakdown.dp_comm_s / 2, rel=0.05)
    params = fp32.stages[0].memory.params // 2  # bf16 weights, replicated
    assert fp32.stages[0].memory.grads - bf16.stages[0].memory.grads == 2 * params


def test_the_search_prices_it_as_the_estimate_and_fits_what_fp32_gradients_do_not(chain):
    """On a device just too small for fp32 gradients the search finds only plans that keep them in bf16 (its
    memory bounds use the same bytes as the estimate), and the plan's price is the estimate's."""
    cluster = Cluster.parse("1x8xa100-80gb")
    fixes = ["tp=1", "pp=1", "cp=1", "zero=0", "recompute=full", "mbs=1", "offload=none"]
    need = estimate(chain, cluster, Strategy(dp=8, microbatch_size=1, num_microbatches=2, recompute="full",
                                             runtime=BF16_GRADS)).stages[0].memory.total
    params = estimate(chain, cluster, Strategy(dp=8, microbatch_size=1, num_microbatches=2, recompute="full")
                      ).stages[0].memory.params // 2
    small = dataclasses.replace(cluster, groups=tuple(
        dataclasses.replace(g, device=dataclasses.replace(g.device, memory_bytes=need + params))
        for g in cluster.groups))  # fits bf16 gradients (+1 byte per parameter of slack), not fp32's (+2)
    with pytest.raises(Exception, match="fits|memory"):
        plan(chain, None, small, global_batch=16, space=SearchSpace.from_fixes(fixes), time_limit_s=60)
    found = plan(chain, None, small, global_batch=16,
                 space=SearchSpace.from_fixes([*fixes, "grads_in_training_dtype=true"]), time_limit_s=60)
    assert found.strategy.runtime.grads_in_training_dtype
    est = estimate(chain, small, found.strategy)
    assert found.predicted.step_time_s == pytest.approx(est.step_time_s, rel=1e-9)
    assert max(found.predicted.peak_memory_bytes) <= need + params


def test_plans_record_it_the_runtime_refuses_it_and_the_exports_carry_it(golden, tmp_path: Path):  # noqa: F811
    s = Strategy(dp=2, runtime=BF16_GRADS)
    assert Strategy.from_dict(s.to_dict()) == s and s.to_dict()["runtime"]["grads_in_training_dtype"]
    assert "grads_in_training_dtype" not in Strategy(dp=2).to_dict()["runtime"]  # older plans read back unchanged
    assert "grads_in_training_dtype" in runtime_unsupported(s)
    plan_, layout, shape = golden["gpt3-1.3b-2x8xa100"]
    runtime = dataclasses.replace(plan_.strategy.runtime, grads_in_training_dtype=True)
    variant = dataclasses.replace(plan_, strategy=dataclasses.replace(plan_.strategy, runtime=runtime))
    result, back = round_trip(variant, layout, shape, Trainer.MEGATRON, tmp_path)
    assert "--grad-reduce-in-bf16" in result.text and back.strategy.runtime.grads_in_training_dtype
    (tmp_path / "tt").mkdir()
    result, back = round_trip(variant, layout, shape, Trainer.TORCHTITAN, tmp_path / "tt")
    assert 'mixed_precision_reduce = "bfloat16"' in result.text and back.strategy.runtime.grads_in_training_dtype
