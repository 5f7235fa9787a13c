"""FP8 linear layers (`costmodel.float8`): the FP8 GEMM rate, the cast traffic in closed form, the FP8 all-gather
of ZeRO-3, what stays in BF16, the device check, the plan and report, and the runtime's module mapping (checked
without CUDA: the conversion itself needs an FP8 GPU and torchao)."""

from __future__ import annotations

import json

import pytest
from costmodel_graphs import GptShape, gpt_chain
from test_operators import linear

from costmodel import Cluster, RuntimeOptions, Strategy
from costmodel.float8 import (
    CAST_TRAFFIC,
    Float8Recipe,
    Operand,
    converted_node,
    converts,
    fp8_devices,
    fp8_problem,
    fp8_weight_share,
    parse_recipe,
)
from costmodel.hardware.catalog import fp8_matmul_efficiency, get_device
from costmodel.layer_pricing import price_segment
from costmodel.operators import T_KERNEL_FLOOR_S, fp8_cast_times, fp8_gemm_rate, gemm_size_factor, node_time
from models.registry import build_model
from planner.api import estimate, estimate_plan
from planner.errors import UserError
from planner.plan import Plan
from planner.reports.render import render_plan
from planner.runtime.apply_fp8 import fp8_modules, fp8_runtime_problem
from planner.search.space import SearchSpace

H100 = get_device("h100-sxm")
SHAPE = GptShape(layers=4, hidden=2048, heads=16, seq=2048, vocab=32000, batch=1)
TENSORWISE, ROWWISE = Float8Recipe.TENSORWISE, Float8Recipe.ROWWISE


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE)


def _hbm_s(nbytes: float, device=H100) -> float:
    """One memory-bound kernel of `nbytes`, as `roofline_time` prices it."""
    return max(nbytes / (device.memory_bandwidth * device.memory_efficiency) / device.training_efficiency,
               T_KERNEL_FLOOR_S)


def test_fp8_gemm_efficiency_is_the_measured_mamf_over_the_fp8_peak():
    assert fp8_matmul_efficiency(H100) == pytest.approx(1402.6 / 1979)
    assert fp8_matmul_efficiency(get_device("h200")) == pytest.approx(1453.4 / 1979)
    assert fp8_matmul_efficiency(get_device("b200")) == pytest.approx(3432.5 / 4500)
    assert fp8_matmul_efficiency(get_device("h800")) == fp8_matmul_efficiency(H100)  # same die, cited
    mi300x = get_device("mi300x")  # FP8 peak, no FP8 measurement: its BF16 level
    assert fp8_matmul_efficiency(mi300x) == mi300x.matmul_efficiency
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        fp8_matmul_efficiency(get_device("a100-80gb"))


def test_converted_linear_runs_its_gemms_at_the_fp8_rate_plus_the_casts():
    m, k, n = 16384, 4096, 14336
    node = linear(m, k, n)
    flops = 2 * m * k * n
    rate = 1979e12 * (1402.6 / 1979) * gemm_size_factor(flops / 1979e12)
    assert fp8_gemm_rate(H100, flops) == pytest.approx(rate)
    fwd, bwd = node_time(node, H100, fp8=TENSORWISE)
    cast_fwd, cast_bwd = fp8_cast_times(node, H100, TENSORWISE, bytes_scale=1, param_scale=1, dtype="bfloat16")
    assert fwd - cast_fwd == pytest.approx(flops / rate / H100.training_efficiency)
    assert bwd - cast_bwd == pytest.approx(2 * flops / rate / H100.training_efficiency)
    bf16_fwd, bf16_bwd = node_time(node, H100)
    assert fwd < bf16_fwd and bwd < bf16_bwd  # large GEMMs: FP8 wins despite the casts


@pytest.mark.parametrize("fused", [False, True])
def test_cast_traffic_is_torchaos_roofline_in_closed_form(fused: bool):
    """`fused`: a fused kernel writes the input and the output gradient (compiled runs), and does the first read
    of their casts (torchao's roofline with fuse_with_prev): 2 bytes per element less for x and for dy."""
    import dataclasses

    from ir.fusion import FUSED_GRAD_ATTR, FUSED_INPUT_ATTR

    m, k, n = 8192, 4096, 4096
    x, w, dy = m * k, n * k, m * n
    node = linear(m, k, n)
    if fused:
        node = dataclasses.replace(node, attrs=((FUSED_GRAD_ATTR, True), (FUSED_INPUT_ATTR, True)))
    read = 2 if fused else 0
    # tensorwise: x amax + cast writing both FP8 layouts (2*2 + 2), w amax + cast (2*2 + 1), then w again in
    # backward (2 + 1), dy like x in backward
    fwd, bwd = fp8_cast_times(node, H100, TENSORWISE, bytes_scale=1, param_scale=1, dtype="bfloat16")
    assert fwd == pytest.approx(_hbm_s((6 - read) * x) + _hbm_s(5 * w))
    assert bwd == pytest.approx(_hbm_s(3 * w) + _hbm_s((6 - read) * dy))
    # rowwise: x cast + transposed bf16 copy (2 + 1 + 2), its cast in backward (2 + 1); w cast (2 + 1), then its
    # transpose (2 + 2) and cast (2 + 1); dy both steps in backward
    fwd, bwd = fp8_cast_times(node, H100, ROWWISE, bytes_scale=1, param_scale=1, dtype="bfloat16")
    assert fwd == pytest.approx(_hbm_s((5 - read) * x) + _hbm_s(3 * w))
    assert bwd == pytest.approx(_hbm_s(3 * x) + _hbm_s(7 * w) + _hbm_s((8 - read) * dy))
    assert CAST_TRAFFIC[TENSORWISE, Operand.WEIGHT][1].bytes_per_element(2) == 3


def test_fused_chains_say_which_linears_a_fused_kernel_feeds():
    built = build_model("llama", ("layers=1", "hidden=256", "heads=4", "kv_heads=2", "ffn_hidden=512",
                                  "vocab=1024"), batch=1, seq=256, device="meta")
    from ir import build_layer_chain, trace
    from ir.fusion import FUSED_GRAD_ATTR, FUSED_INPUT_ATTR

    chain = build_layer_chain(trace(built.module, built.example_inputs, model_name="llama"))
    flags = {n.name.removeprefix("blocks_0_"): (bool(n.attr(FUSED_INPUT_ATTR)), bool(n.attr(FUSED_GRAD_ATTR)))
             for n in chain.fused_kernels.graph.nodes if n.op_kind.value == "linear" and "blocks_0" in n.name}
    # inputs: RMSNorm outputs and the SwiGLU product (fused); o_proj reads attention's output (not a fused kernel).
    # gradients: rotary (q, k), residual adds and SwiGLU (fused); v's gradient comes from attention's backward.
    assert flags == {"attn_q_proj": (True, True), "attn_k_proj": (True, True), "attn_v_proj": (True, False),
                     "attn_o_proj": (False, True), "mlp_gate_proj": (True, True), "mlp_up_proj": (True, True),
                     "mlp_down_proj": (True, True)}
    assert not any(n.attr(FUSED_INPUT_ATTR) or n.attr(FUSED_GRAD_ATTR) for n in chain.graph.nodes)  # eager


def test_what_stays_in_bf16(chain):
    assert converts("layers.0.attention.wq", 4096, 4096)
    assert not converts("output", 4096, 128256) and not converts("lm_head", 4096, 128256)
    assert not converts("blocks.0.mlp.router", 64, 8) and not converts("layers.3.moe.gate", 4096, 64)
    assert not converts("layers.0.mlp.up_proj", 4096, 1000)  # 1000 is not a multiple of 16
    converted = {n.module_path for n in chain.graph.nodes if converted_node(n)}
    kinds = {n.op_kind.value for n in chain.graph.nodes if converted_node(n)}
    assert kinds == {"linear"}
    assert "head" not in converted and len(converted) == SHAPE.layers * 6  # q, k, v, o, up, down per block
    for n in chain.graph.nodes:  # every other node is priced exactly as without FP8
        if not converted_node(n):
            assert node_time(n, H100, fp8=TENSORWISE) == node_time(n, H100)


def test_layer_cost_keeps_memory_and_records_the_converted_weight_share(chain):
    block = chain.segments[1]
    nodes = chain.nodes_of(block)
    plain = price_segment(chain, block, H100, microbatch_size=4)
    fp8 = price_segment(chain, block, H100, microbatch_size=4, fp8=TENSORWISE)
    h, f = SHAPE.hidden, 4 * SHAPE.hidden
    weights = 4 * h * h + 2 * h * f
    assert fp8_weight_share(nodes) == pytest.approx(weights / block.param_count)
    assert fp8.fp8_weight_share == pytest.approx(weights / block.param_count) and plain.fp8_weight_share == 0
    for field in ("saved_bytes_none", "saved_bytes_selective", "saved_bytes_full", "saved_bytes_op",
                  "param_bytes", "peak_temp_bytes", "boundary_bytes"):
        assert getattr(fp8, field) == getattr(plain, field), field  # torchao saves the BF16 operands
    assert fp8.fwd_compute_s < plain.fwd_compute_s


def test_zero3_gathers_converted_weights_in_fp8_with_tensorwise_scaling_only(chain):
    cluster = Cluster.parse("2x8xh100-sxm")

    def dp_comm(fp8):
        s = Strategy(dp=16, zero_stage=3, microbatch_size=1, num_microbatches=1, runtime=RuntimeOptions(fp8=fp8))
        return estimate(chain, cluster, s, global_batch=16).breakdown.dp_comm_s

    bf16, tensorwise, rowwise = dp_comm(None), dp_comm(TENSORWISE), dp_comm(ROWWISE)
    assert rowwise == pytest.approx(bf16)  # rowwise communicates in high precision
    assert tensorwise < bf16


def test_fp8_all_gather_moves_the_weight_casts_onto_the_shard(chain):
    cluster = Cluster.parse("2x8xh100-sxm")
    block = chain.segments[1]
    cost = price_segment(chain, block, H100, microbatch_size=1, fp8=TENSORWISE)
    h, f = SHAPE.hidden, 4 * SHAPE.hidden
    shapes = [(h, h)] * 4 + [(h, f), (f, h)]  # q, k, v, o, up, down weights: (in, out)
    # tensorwise weight traffic per element: amax + cast (2*2 + 1) forward, the other layout (2 + 1) backward
    assert cost.fp8_weight_cast_fwd_s == pytest.approx(sum(_hbm_s(5 * i * o) for i, o in shapes))
    assert cost.fp8_weight_cast_bwd_s == pytest.approx(sum(_hbm_s(3 * i * o) for i, o in shapes))

    def compute(zero, dp=16):
        s = Strategy(dp=dp, zero_stage=zero, microbatch_size=1, num_microbatches=1,
                     runtime=RuntimeOptions(fp8=TENSORWISE))
        return estimate(chain, cluster, s, global_batch=dp).breakdown.compute_s

    blocks = SHAPE.layers
    saved = (cost.fp8_weight_cast_fwd_s + cost.fp8_weight_cast_bwd_s) * (1 - 1 / 16) * blocks
    assert compute(1) - compute(3) == pytest.approx(saved, rel=1e-6)


def test_fp8_needs_fp8_tensor_cores(chain):
    assert fp8_devices()[:4] == ("h100-sxm", "h200", "h800", "b200")
    assert fp8_problem([H100]) is None
    assert "a100-80gb has none" in fp8_problem([get_device("a100-80gb"), H100])
    with pytest.raises(UserError, match="--fp8 rowwise: FP8 training needs FP8 tensor cores and v100-32gb"):
        estimate(chain, "1x8xv100-32gb", Strategy(dp=8, runtime=RuntimeOptions(fp8=ROWWISE)), global_batch=8)


def test_recipe_choices_and_fix_key():
    assert parse_recipe(" Rowwise ") is ROWWISE
    assert parse_recipe("delayed") is Float8Recipe.DELAYED
    with pytest.raises(ValueError, match="valid: tensorwise, rowwise, delayed"):
        parse_recipe("mxfp8")
    assert SearchSpace.from_fixes(["fp8=tensorwise"]).runtime.fp8 is TENSORWISE
    assert SearchSpace.from_fixes(["fp8=off"]).runtime.fp8 is None
    with pytest.raises(ValueError, match="--fix fp8=mx: valid: tensorwise, rowwise, delayed, off"):
        SearchSpace.from_fixes(["fp8=mx"])


def test_plan_json_and_report_say_fp8(chain):
    s = Strategy(dp=8, zero_stage=3, runtime=RuntimeOptions(fp8=TENSORWISE))
    cluster = Cluster.parse("1x8xh100-sxm")
    plan = estimate_plan(chain, cluster, s, global_batch=8)
    d = plan.to_dict()
    assert d["strategy"]["runtime"]["fp8"] == "tensorwise"
    assert Plan.from_dict(json.loads(plan.to_json())).strategy.runtime.fp8 is TENSORWISE
    text = render_plan(plan, cluster)
    assert "FP8 linear layers (tensorwise scaling, output layer and routers not converted, gathered in FP8" in text
    # without FP8 the runtime options serialize as before (golden plans unchanged)
    assert "fp8" not in RuntimeOptions().to_dict()
    assert RuntimeOptions.from_dict({"dp_overlap": True}) == RuntimeOptions()


def test_runtime_converts_exactly_the_priced_modules_and_refuses_cpu():
    built = build_model("moe-tiny", [], batch=1, seq=None, device="meta")
    names = fp8_modules(built.module)
    assert names and all(n.rsplit(".", 1)[-1] in {"q_proj", "k_proj", "v_proj", "o_proj"} for n in names)
    llama = build_model("llama-tiny", [], batch=1, seq=None, device="meta")
    assert not any("lm_head" in n for n in fp8_modules(llama.module))
    assert "down_proj" in {n.rsplit(".", 1)[-1] for n in fp8_modules(llama.module)}
    assert "this rank runs on cpu" in fp8_runtime_problem("cpu")
    assert "compute capability 8.9 or later; this GPU has 8.0" in fp8_runtime_problem("cuda", (8, 0))


TORCHTITAN_FP8 = """
[model]
converters = ["float8"]
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
filter_fqns = ["output"]
[parallelism]
data_parallel_shard_degree = 8
[training]
local_batch_size = 2
global_batch_size = 16
"""


def test_torchtitan_float8_config_reads_and_writes_back():
    from planner.trainers.common import ModelShape, Notes
    from planner.trainers.torchtitan import read, sections

    cfg = read(TORCHTITAN_FP8, source="job.toml")
    assert cfg.runtime.fp8 is TENSORWISE  # torchao's default recipe when none is named
    assert read(TORCHTITAN_FP8.replace("[quantize.linear.float8]", '[quantize.linear.float8]\nrecipe_name = "rowwise"'),
                source="job.toml").runtime.fp8 is ROWWISE
    assert read(TORCHTITAN_FP8.replace('["float8"]', "[]"), source="job.toml").runtime.fp8 is None
    with pytest.raises(UserError, match=r"job.toml: \[quantize.linear.float8\] unknown FP8 recipe 'mx'"):
        read(TORCHTITAN_FP8.replace("[quantize.linear.float8]", '[quantize.linear.float8]\nrecipe_name = "mx"'),
             source="job.toml")
    out = sections(cfg, ModelShape(name="llama-tiny", family="llama", num_layers=2), Notes())
    assert out["model"]["converters"] == ["float8"] and out["compile"]["enable"]
    assert out["quantize.linear.float8"] == {"recipe_name": "tensorwise", "filter_fqns": ["output"],
                                             "enable_fsdp_float8_all_gather": True,
                                             "precompute_float8_dynamic_scale_for_fsdp": True}


def test_replan_keeps_fp8_and_refuses_a_cluster_without_it(chain):
    from planner.scenarios.replan import replan

    old = estimate_plan(chain, Cluster.parse("2x8xh100-sxm"), Strategy(dp=16, zero_stage=3,
                        runtime=RuntimeOptions(fp8=TENSORWISE)), global_batch=16)
    new = replan(old, chain, Cluster.parse("1x8xh100-sxm"), scope="full")
    assert new.plan.strategy.runtime.fp8 is TENSORWISE
    with pytest.raises(UserError, match="the plan trains linear layers in FP8, tensorwise: .* a100-80gb has none"):
        replan(old, chain, Cluster.parse("2x8xa100-80gb"))
