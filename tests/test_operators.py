"""Operator pricing: the roofline, the GEMM size curve against the measured GEMMs it was fitted on, backward rules,
the measured-profile override and its JSON format, and a cross-check against a measurement that was not fitted."""

from __future__ import annotations

import json
import math

import pytest
from costmodel_graphs import A100, GptShape, gpt_chain

from costmodel.hardware.device import DeviceSpec
from costmodel.operators import (
    GEMM_HALF_TIME_S,
    T_KERNEL_FLOOR_S,
    compute_rate,
    flash_fraction,
    gemm_size_factor,
    node_time,
)
from costmodel.profile_db import OpProfile, OpTiming, op_signature
from ir.graph import Node, OpKind, TensorSpec


def linear(m: int, k: int, n: int, dtype: str = "bfloat16") -> Node:
    x, w, y = TensorSpec((m, k), dtype), TensorSpec((n, k), dtype), TensorSpec((m, n), dtype)
    return Node(name="lin", op_kind=OpKind.LINEAR, target="torch.nn.Linear", module_path="fc", inputs=("x",),
                input_specs=(x,), output_specs=(y,), param_names=("fc.weight",), param_specs=(w,),
                forward_flops=2 * m * k * n, backward_flops=4 * m * k * n, bytes_read=x.nbytes + w.nbytes,
                bytes_written=y.nbytes, saved_bytes=x.nbytes)


def elementwise(numel: int, dtype: str = "bfloat16") -> Node:
    t = TensorSpec((numel,), dtype)
    return Node(name="gelu", op_kind=OpKind.ELEMENTWISE, target="torch.nn.functional.gelu", module_path="",
                inputs=("x",), input_specs=(t,), output_specs=(t,), bytes_read=t.nbytes, bytes_written=t.nbytes)


# (m, n, k, peak TFLOP/s, measured TFLOP/s, best of its series): the GEMMs the size curve was fitted on
# (measured_gemm_hbm_attention.csv, Azure/AI-benchmarking-guide cuBLASLt rows).
MEASURED_GEMMS = [
    (1024, 1024, 1024, 312, 119.4, 256.5), (4096, 4096, 4096, 312, 228.0, 256.5),
    (8192, 8192, 8192, 312, 253.7, 256.5), (6144, 12288, 12288, 312, 250.8, 256.5),
    (1024, 1024, 1024, 1979, 274.1, 1382.2), (4096, 4096, 4096, 1979, 1216.9, 1382.2),
    (8192, 8192, 8192, 1979, 1290.1, 1382.2), (16384, 16384, 16384, 1979, 1377.3, 1382.2),
    (1024, 1024, 1024, 1979, 290.8, 1366.3), (4096, 4096, 4096, 1979, 1249.1, 1366.3),
    (8192, 8192, 8192, 1979, 1300.6, 1366.3), (6144, 12288, 12288, 1979, 1318.0, 1366.3),
]


@pytest.mark.parametrize("m,n,k,peak,measured,best", MEASURED_GEMMS)
def test_gemm_size_curve_matches_measured_gemms(m, n, k, peak, measured, best):
    tau = 2 * m * n * k / (peak * 1e12)
    assert gemm_size_factor(tau) == pytest.approx(measured / best, abs=0.075)


def test_gemm_size_curve_shape():
    assert gemm_size_factor(GEMM_HALF_TIME_S) == pytest.approx(0.5)
    values = [gemm_size_factor(10.0 ** e) for e in range(-8, 0)]
    assert values == sorted(values) and values[-1] > 0.99 and values[0] < 0.1
    assert gemm_size_factor(0.0) == 0.0


def test_large_linear_is_compute_bound_at_the_fitted_rate():
    node = linear(8192, 8192, 8192)
    fwd, bwd = node_time(node, A100)
    flops = 2 * 8192 ** 3
    rate = 312e12 * 0.8692 * gemm_size_factor(flops / 312e12)
    assert fwd == pytest.approx(flops / rate)
    # dX and dW are each a GEMM of the forward's size: twice the FLOPs at the same rate.
    assert bwd == pytest.approx(2 * fwd)
    # A100 cuBLASLt 8192^3 FP16 measured 253.7 TFLOP/s; the model (MAMF level x size curve) is within 8%.
    assert flops / fwd / 1e12 == pytest.approx(253.7, rel=0.08)


def test_small_gemm_is_slower_per_flop_and_tiny_ops_hit_the_launch_floor():
    big, small = linear(4096, 4096, 4096), linear(256, 256, 256)
    per_flop = [node_time(n, A100)[0] / n.forward_flops for n in (big, small)]
    assert per_flop[1] > 2 * per_flop[0]
    tiny = linear(4, 4, 4)
    assert node_time(tiny, A100) == (T_KERNEL_FLOOR_S, T_KERNEL_FLOOR_S)


def test_elementwise_is_memory_bound_with_backward_factor():
    node = elementwise(64 * 2 ** 20)
    fwd, bwd = node_time(node, A100)
    nbytes = 2 * 64 * 2 ** 20 * 2
    assert fwd == pytest.approx(nbytes / 1.70e12)
    assert bwd == pytest.approx(1.5 * fwd)


def test_scales_micro_batch_and_shards_but_not_parameters_by_batch():
    node = elementwise(64 * 2 ** 20)
    full, _ = node_time(node, A100)
    half, _ = node_time(node, A100, bytes_scale=0.5)
    assert half == pytest.approx(full / 2)
    lin = linear(2048, 12288, 12288)
    one, _ = node_time(lin, A100)
    # Quarter of the tokens: a quarter of the FLOPs, but the smaller GEMM runs at a lower rate.
    quarter, _ = node_time(lin, A100, flops_scale=0.25, bytes_scale=0.25)
    assert one / 4 < quarter < one / 2


def test_no_backward_for_integer_outputs_and_placeholders():
    t = TensorSpec((1024,), "int64")
    idx = Node(name="argmax", op_kind=OpKind.REDUCTION, target="torch.argmax", module_path="", inputs=("x",),
               input_specs=(TensorSpec((1024, 8), "bfloat16"),), output_specs=(t,), bytes_read=16384,
               bytes_written=8192)
    fwd, bwd = node_time(idx, A100)
    assert fwd > 0 and bwd == 0
    ph = Node(name="x", op_kind=OpKind.PLACEHOLDER, target="x", module_path="", inputs=(), input_specs=(),
              output_specs=(t,))
    assert node_time(ph, A100) == (0.0, 0.0)


def test_dtype_conversion_of_bytes():
    node = elementwise(64 * 2 ** 20, dtype="float32")
    as_fp32, _ = node_time(node, A100, dtype="float32")
    as_bf16, _ = node_time(node, A100, dtype="bfloat16")
    assert as_bf16 == pytest.approx(as_fp32 / 2)


def test_flash_attention_fraction_is_the_measured_one():
    assert flash_fraction(A100) == pytest.approx(179.5 / 312)
    other = DeviceSpec(name="x1", display_name="x", peak_flops={"bfloat16": 1e15}, matmul_efficiency=0.8,
                       memory_bytes=1, memory_bandwidth=1e12, memory_efficiency=0.9, intra_node_bandwidth=1,
                       inter_node_bandwidth=1)
    assert flash_fraction(other) == pytest.approx(0.8 * 179.5 / 271.2)
    big = 4e15
    assert compute_rate(OpKind.ATTENTION, A100, "bfloat16", big) == pytest.approx(179.5e12, rel=0.01)


def test_math_attention_against_measured_pytorch_attention():
    """Not fitted: Azure ND A100 v4 measured 'PyTorch standard' attention at 46.0 TFLOP/s (head_dim 64, batch 2,
    seq 8192; measured_gemm_hbm_attention.csv). Price QK^T, softmax, AV (dropout 0) as separate nodes: the
    roofline must land within 25% (it is memory-bound on the s x s scores)."""
    b, heads, s, d = 2, 16, 8192, 64
    hs, sc = TensorSpec((b, heads, s, d), "bfloat16"), TensorSpec((b, heads, s, s), "bfloat16")

    def node(name, kind, ins, out, flops):
        return Node(name=name, op_kind=kind, target=name, module_path="", inputs=tuple(f"i{i}" for i in
                    range(len(ins))), input_specs=ins, output_specs=(out,), forward_flops=flops,
                    backward_flops=2 * flops, bytes_read=sum(t.nbytes for t in ins), bytes_written=out.nbytes)

    flops = 2 * b * heads * s * s * d
    nodes = [node("qk", OpKind.MATMUL, (hs, hs), sc, flops), node("softmax", OpKind.SOFTMAX, (sc,), sc, 0),
             node("av", OpKind.MATMUL, (sc, hs), hs, flops)]
    fwd = sum(node_time(n, A100)[0] for n in nodes)
    tflops = 2 * flops / fwd / 1e12
    assert tflops == pytest.approx(46.0, rel=0.25)


def test_profile_overrides_and_falls_back(tmp_path):
    lin = linear(512, 512, 512)
    sig = op_signature(lin, flops_scale=0.5, bytes_scale=0.5)
    prof = OpProfile.from_timings([("a100-80gb", sig, OpTiming(1e-3, 3e-3, samples=5))], meta={"torch": "2.13"})
    assert node_time(lin, A100, flops_scale=0.5, bytes_scale=0.5, profile=prof) == (1e-3, 3e-3)
    # Another scale, another device: not in the profile, so the analytical model answers.
    assert node_time(lin, A100, profile=prof) == node_time(lin, A100)
    path = tmp_path / "p.json"
    prof.save(path)
    again = OpProfile.load(path)
    assert again == prof and len(again) == 1
    data = json.loads(path.read_text())
    data["entries"][0]["oops"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="oops"):
        OpProfile.load(path)
    with pytest.raises(ValueError, match="schema_version"):
        OpProfile.from_dict({"schema_version": 99, "entries": []})
    with pytest.raises(ValueError, match="does not exist"):
        OpProfile.load(tmp_path / "missing.json")


def test_signature_ignores_names_but_not_shapes():
    a, b = linear(64, 64, 64), linear(64, 64, 128)
    renamed = Node(**{**{f: getattr(a, f) for f in a.__dataclass_fields__}, "name": "other", "module_path": "x.y"})
    assert op_signature(a) == op_signature(renamed)
    assert op_signature(a) != op_signature(b)


def test_gpt_block_forward_rate_is_sane():
    chain = gpt_chain(GptShape(layers=1, hidden=4096, heads=32, seq=2048, vocab=1024, batch=4))
    seg = chain.segments[1]
    fwd = sum(node_time(n, A100)[0] for n in chain.nodes_of(seg))
    rate = seg.forward_flops / fwd
    # Between 50% and the large-GEMM level of peak: GEMMs near the MAMF level, attention and norms slower.
    assert 0.5 * 312e12 < rate < 0.8692 * 312e12
    assert math.isfinite(rate)
