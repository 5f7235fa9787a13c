"""FP8 as Transformer Engine runs it (Megatron-Core, NeMo): delayed scaling, casts fused into the kernels that
make the operands, weights cast once per step (`costmodel.float8` module docstring). Closed forms for the casts
and the per-step weight copies, and what the runtime and the trainer exports do with a plan that prices it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain
from test_operators import linear
from test_trainers import golden, round_trip  # noqa: F401  (the fixture is used by name)

from costmodel import Cluster, RuntimeOptions, Strategy
from costmodel.float8 import Float8Recipe
from costmodel.hardware.catalog import get_device
from costmodel.layer_pricing import price_segment
from costmodel.operators import T_KERNEL_FLOOR_S, fp8_cast_times, fp8_weight_copy_time, node_time
from ir.fusion import FUSED_GRAD_ATTR, FUSED_INPUT_ATTR
from planner.api import estimate
from planner.runtime.parallelize import runtime_unsupported
from planner.trainers.common import Trainer

H100 = get_device("h100-sxm")
DELAYED, TENSORWISE = Float8Recipe.DELAYED, Float8Recipe.TENSORWISE
SHAPE = GptShape(layers=4, hidden=2048, heads=16, seq=2048, vocab=32000, batch=1)


def _hbm_s(nbytes: float) -> float:
    return max(nbytes / (H100.memory_bandwidth * H100.memory_efficiency) / H100.training_efficiency,
               T_KERNEL_FLOOR_S)


@pytest.mark.parametrize("fused", [False, True])
def test_delayed_scaling_casts_in_closed_form(fused: bool):
    """x: one cast-transpose writing both FP8 layouts (read 2 + write 2 bytes; the read done by the fused norm or
    activation kernel that makes x); w: nothing per micro-batch; dy: one cast-transpose in backward."""
    m, k, n = 8192, 4096, 4096
    x, dy = m * k, m * n
    node = linear(m, k, n)
    if fused:
        node = dataclasses.replace(node, attrs=((FUSED_GRAD_ATTR, True), (FUSED_INPUT_ATTR, True)))
    read = 0 if fused else 2
    fwd, bwd = fp8_cast_times(node, H100, DELAYED, bytes_scale=1, param_scale=1, dtype="bfloat16")
    assert fwd == pytest.approx(_hbm_s((read + 2) * x))
    assert bwd == pytest.approx(_hbm_s((read + 2) * dy))
    torchao = sum(fp8_cast_times(node, H100, TENSORWISE, bytes_scale=1, param_scale=1, dtype="bfloat16"))
    assert fwd + bwd < 0.55 * torchao  # per micro-batch: no amax passes, no weight casts
    assert sum(node_time(node, H100, fp8=DELAYED)) < sum(node_time(node, H100, fp8=TENSORWISE))


def test_weights_are_cast_once_per_step_with_the_optimizer():
    chain = gpt_chain(SHAPE)
    block = chain.segments[1]
    cost = price_segment(chain, block, H100, microbatch_size=1, fp8=DELAYED)
    assert cost.fp8_weight_cast_fwd_s == cost.fp8_weight_cast_bwd_s == 0.0
    h = SHAPE.hidden
    converted = 4 * h * h + 2 * 4 * h * h  # q, k, v, o, up, down
    assert cost.fp8_weight_share * (cost.param_count - cost.expert_param_count) == pytest.approx(converted)
    assert fp8_weight_copy_time([cost], DELAYED, H100, dtype="bfloat16") == pytest.approx(_hbm_s(4 * converted))
    assert fp8_weight_copy_time([cost], TENSORWISE, H100, dtype="bfloat16") == 0.0
    assert fp8_weight_copy_time([cost], None, H100, dtype="bfloat16") == 0.0

    def optimizer_s(fp8, micro):
        s = Strategy(dp=8, zero_stage=1, microbatch_size=1, num_microbatches=micro,
                     runtime=RuntimeOptions(fp8=fp8))
        return estimate(chain, Cluster.parse("1x8xh100-sxm"), s, global_batch=8 * micro).breakdown.optimizer_s

    copies = fp8_weight_copy_time([price_segment(chain, s, H100, microbatch_size=1, fp8=DELAYED)
                                   for s in chain.segments], DELAYED, H100, dtype="bfloat16")
    assert optimizer_s(DELAYED, 1) - optimizer_s(None, 1) == pytest.approx(copies, rel=1e-6)
    assert optimizer_s(DELAYED, 8) == pytest.approx(optimizer_s(DELAYED, 1))  # per step, not per micro-batch


def test_the_routed_experts_weights_are_copied_once_per_step_too():
    """Transformer Engine's grouped GEMMs keep FP8 copies of the rank's expert weights like its linears do."""
    cost = dataclasses.replace(price_segment(gpt_chain(SHAPE), gpt_chain(SHAPE).segments[1], H100,
                                             microbatch_size=1, fp8=DELAYED), expert_param_count=0)
    experts = 3 * 8 * SHAPE.hidden * SHAPE.hidden
    with_experts = dataclasses.replace(cost, param_count=cost.param_count + experts, expert_param_count=experts)
    dense = fp8_weight_copy_time([cost], DELAYED, H100, dtype="bfloat16")
    assert fp8_weight_copy_time([with_experts], DELAYED, H100, dtype="bfloat16") == pytest.approx(
        dense + _hbm_s(4 * experts))
    assert fp8_weight_copy_time([with_experts], TENSORWISE, H100, dtype="bfloat16") == 0.0


def test_the_runtime_refuses_it_and_megatron_exports_it(golden, tmp_path: Path):  # noqa: F811
    plan, layout, shape = golden["gpt3-1.3b-2x8xa100"]
    runtime = dataclasses.replace(plan.strategy.runtime, fp8=DELAYED)
    variant = dataclasses.replace(plan, strategy=dataclasses.replace(plan.strategy, runtime=runtime))
    assert "Transformer Engine's FP8 (fp8=delayed" in runtime_unsupported(variant.strategy)
    result, back = round_trip(variant, layout, shape, Trainer.MEGATRON, tmp_path)
    assert "--fp8-format hybrid" in result.text and "--fp8-recipe delayed" in result.text
    assert back.strategy.runtime.fp8 is DELAYED
    (tmp_path / "tt").mkdir()
    result, back = round_trip(variant, layout, shape, Trainer.TORCHTITAN, tmp_path / "tt")
    assert back.strategy.runtime.fp8 is TENSORWISE
    assert any("exported as tensorwise, slower than planned" in w for w in result.warnings)
