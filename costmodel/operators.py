"""Compute time of one IR node on one device: a roofline with a size-dependent efficiency, or a measured profile.

Forward time of a node with F FLOPs moving B bytes on a device:

    t_fwd = max( F / R(kind, F),  B / (BW * mem_eff),  T_KERNEL_FLOOR )        (0 when F == B == 0)

    R(GEMM kinds: linear, matmul, conv) = peak(dtype) * matmul_efficiency * s(F / peak(dtype))
    R(attention, fused SDPA)             = peak(dtype) * flash_fraction(device) * s(F / peak(dtype))
    R(everything else)                   = vector peak (non-tensor float32 FLOP/s); these ops are memory-bound

`s(tau)` is the fraction of a device's best GEMM throughput that a GEMM reaches when it would take `tau` seconds at
peak -- small GEMMs do not fill the machine (wave quantization, too few tiles). It is a Hill curve

    s(tau) = 1 / (1 + (TAU_HALF / tau) ** ALPHA),    ALPHA = 0.763,  TAU_HALF = 6.85 us,

fitted (least squares, rms error 0.028, max 0.071) on the 16 measured cuBLASLt GEMMs of
shared/data/measured_gemm_hbm_attention.csv (Azure/AI-benchmarking-guide: A100 FP16 1024^3 .. 16384^3 and
6144x12288x12288, H100 and H200 FP8 1024^3 .. 32768^3), each normalized by the best GEMM of its series. Expressing
size as time-at-peak lets one curve serve devices of different speed (a 1024^3 GEMM reaches 47% of the best on
A100 but 20% on H100, whose peak is 6x higher). Nothing was fitted to the Korthikanti et al. validation targets.

The large-GEMM level `matmul_efficiency` comes from the device catalog (measured max-achievable matmul / peak);
`flash_fraction` is measured FlashAttention-2 forward TFLOP/s / peak from the same file (A100 179.5/312,
H100 327.9/989, H200 329.3/989); devices without a measurement use A100's ratio of FlashAttention-2 to its best GEMM
times their own `matmul_efficiency`.

Causal fused attention skips the blocks above the diagonal: FlashAttention-2 runs causal attention "around
1.7-1.8x" faster than the same shape without the mask (Dao 2023, "FlashAttention-2", Sec. 3.1.1), so a fused
attention node with `is_causal` takes 1 / CAUSAL_SPEEDUP (1.75, the middle of that range) of its unmasked time. The
FLOPs it reports stay the full count (the convention of model FLOPs and MFU in Megatron-LM and torchtitan).

Backward: FLOPs come from the tracer (2x forward for linear/matmul: dX and dW are each a GEMM of the forward's
size, so the backward runs at the forward GEMM's efficiency). Backward bytes are the forward bytes times a
per-kind factor (`BACKWARD_BYTES_FACTOR`): the backward of an elementwise op reads the output gradient and the
saved input and writes the input gradient (1.5x the unary forward's read+write); norms also re-reduce (2x).
Nodes whose output is not floating point (indices, masks) have no backward.

`T_KERNEL_FLOOR` = 4 us: one CUDA kernel launch costs about 4-6 us of driver/runtime time, which bounds how fast a
stream of tiny kernels can run (measured in "pegainfer (3): From Launch Overhead to CUDA Graph", susun-blog.com;
NVIDIA Technical Blog "Getting Started with CUDA Graphs" shows the same microsecond-scale launch cost).

A sustained training step does not run every kernel at its roofline: clocks drop under the power limit, kernels
leave gaps and tails, real GEMM shapes fall below the best measured one. `DeviceSpec.training_efficiency` divides
every analytical time by the fraction reached, fitted per device class to published runs leave-one-out (the
catalog's source column says on what, and with what error); measured profile times are taken as they are.

A grouped GEMM (the routed experts: one GEMM per expert in one launch) is sized per group: `gemm_groups` = G
equal GEMMs of F / G FLOPs each run at R(F / G) -- the small-GEMM loss of fine-grained experts (DeepSeek-V3's
2048-wide experts get about 160 tokens each per rank without expert parallelism). Tiles of different experts do
share waves in a grouped kernel, so this is the pessimistic end; `costmodel.expert_parallel` sets G.

`flops_scale` / `bytes_scale` multiply the node's traced FLOPs and activation bytes (micro-batch / traced batch,
times 1/tp for a sharded op); `param_scale` multiplies its parameter bytes (1/tp for a sharded weight; the
micro-batch does not change them). Bytes are also converted from the traced dtype to the priced `dtype`.
A profile entry for the node's signature at these scales (`costmodel.profile_db`) replaces the analytical value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from costmodel.float8 import Float8Recipe, Operand, converted_node, fused_cast_traffic
from costmodel.hardware.catalog import FP8_DTYPE, fp8_matmul_efficiency
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.profile_db import OpProfile, op_signature
from ir.fusion import FUSED_MEMBER_ATTR
from ir.graph import Node, OpKind, dtype_bytes

GEMM_SIZE_ALPHA = 0.763
"""Exponent of the GEMM size curve (fit described in the module docstring)."""
GEMM_HALF_TIME_S = 6.85e-6
"""Time-at-peak at which a GEMM reaches half of the device's best GEMM throughput (same fit)."""
T_KERNEL_FLOOR_S = 4e-6
"""Smallest time of one launched kernel (launch overhead, see module docstring)."""
CAUSAL_SPEEDUP = 1.75
"""Causal over unmasked fused attention time (module docstring)."""

GEMM_KINDS = frozenset({OpKind.LINEAR, OpKind.MATMUL, OpKind.CONV})
NO_WORK_KINDS = frozenset({OpKind.PLACEHOLDER, OpKind.OUTPUT})
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})

BACKWARD_BYTES_FACTOR: Mapping[OpKind, float] = {
    OpKind.LINEAR: 2.0,       # reads dY, X, W; writes dX, dW
    OpKind.MATMUL: 2.0,       # reads dY, A, B; writes dA, dB
    OpKind.CONV: 2.0,
    OpKind.ATTENTION: 2.0,    # FlashAttention backward re-reads q, k, v, o, dO and writes dq, dk, dv
    OpKind.SOFTMAX: 1.5,      # reads dY and Y, writes dX
    OpKind.NORM: 2.0,         # reads dY and X (recomputes statistics), writes dX, reduces dgamma/dbeta
    OpKind.ELEMENTWISE: 1.5,  # reads dY and the saved input, writes dX
    OpKind.EMBEDDING: 1.0,    # scatter-adds dY into the table gradient
    OpKind.REDUCTION: 1.0,    # broadcasts dY back to the input's shape
    OpKind.VIEW: 1.0,         # a copying view (contiguous/cat) copies its gradient back
    OpKind.POOL: 1.5,
    OpKind.ROUTING: 1.0,      # gather/scatter of the gradient
    OpKind.LOSS: 1.0,
    OpKind.OTHER: 1.5,
    OpKind.PLACEHOLDER: 0.0,
    OpKind.OUTPUT: 0.0,
}

# Measured FlashAttention-2 forward TFLOP/s / dense BF16 peak (measured_gemm_hbm_attention.csv, Azure
# AI-benchmarking-guide ND A100 v4 / ND H100 v5 / ND H200 v5: 179.5/312, 327.9/989, 329.3/989); H800 is the H100
# die with slower NVLink, so H100's ratio applies.
FLASH_ATTENTION_FRACTION: Mapping[str, float] = {
    "a100-40gb": 179.5 / 312, "a100-80gb": 179.5 / 312,
    "h100-sxm": 327.9 / 989, "h100": 327.9 / 989, "h200": 329.3 / 989, "h800": 327.9 / 989,
}
# A100 FlashAttention-2 relative to A100's best GEMM (MAMF 271.2 TFLOP/s, stas00/ml-engineering table in the same
# file): used for devices without an attention measurement, times their own matmul_efficiency.
FLASH_TO_GEMM_RATIO = 179.5 / 271.2


def gemm_size_factor(time_at_peak_s: float) -> float:
    """Fraction of the device's best GEMM throughput reached by a GEMM taking `time_at_peak_s` at peak."""
    if time_at_peak_s <= 0:
        return 0.0
    return 1.0 / (1.0 + (GEMM_HALF_TIME_S / time_at_peak_s) ** GEMM_SIZE_ALPHA)


def flash_fraction(device: DeviceSpec) -> float:
    """Fraction of dense peak that fused (FlashAttention-style) attention reaches on large inputs."""
    return FLASH_ATTENTION_FRACTION.get(device.name, FLASH_TO_GEMM_RATIO * device.matmul_efficiency)


def _vector_flops(device: DeviceSpec, dtype: str) -> float:
    # Elementwise/normalization math runs on the vector units: the non-tensor float32 rate where the catalog has
    # it, otherwise the dtype's peak (what a device like `cpu` reports for everything).
    return device.peak_flops.get("float32") or device.flops(dtype)


def compute_rate(kind: OpKind, device: DeviceSpec, dtype: str, size_flops: float) -> float:
    """Achieved FLOP/s for an op of `kind` whose (per-GEMM) size is `size_flops` FLOPs."""
    if kind in GEMM_KINDS or kind is OpKind.ATTENTION:
        peak = device.flops(dtype)
        level = device.matmul_efficiency if kind in GEMM_KINDS else flash_fraction(device)
        return peak * level * gemm_size_factor(size_flops / peak)
    return _vector_flops(device, dtype)


def fp8_gemm_rate(device: DeviceSpec, size_flops: float) -> float:
    """Achieved FLOP/s of an FP8 GEMM of `size_flops` FLOPs (`costmodel.float8`): the FP8 peak at the measured
    FP8 level, on the same size curve."""
    peak = device.flops(FP8_DTYPE)
    return peak * fp8_matmul_efficiency(device) * gemm_size_factor(size_flops / peak)


def roofline_time(flops: float, nbytes: float, rate: float, device: DeviceSpec, *,
                  floor_s: float = T_KERNEL_FLOOR_S) -> float:
    """max(compute, memory) / training efficiency, at least `floor_s` (one kernel launch), in seconds; zero work
    costs nothing (no kernel is launched)."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    compute = flops / rate if flops > 0 and rate > 0 else 0.0
    memory = nbytes / (device.memory_bandwidth * device.memory_efficiency)
    return max(max(compute, memory) / device.training_efficiency, floor_s)


def memory_pass_time(nbytes: float, device: DeviceSpec, *, floor_s: float = T_KERNEL_FLOOR_S) -> float:
    """A memory-bound pass over `nbytes` of HBM at the device's sustained training bandwidth (bandwidth x memory
    efficiency x training efficiency), at least `floor_s`: what optimizer steps, gradient passes and the training
    loss cost outside the traced graph."""
    return max(nbytes / (device.memory_bandwidth * device.memory_efficiency * device.training_efficiency), floor_s)


def retype_ratio(traced_dtype: str, dtype: str) -> float:
    """Bytes of `dtype` per byte of a floating tensor traced in `traced_dtype` (1 for non-float tensors)."""
    if traced_dtype not in _FLOAT_DTYPES or dtype not in _FLOAT_DTYPES:
        return 1.0
    return dtype_bytes(dtype) / dtype_bytes(traced_dtype)


def _node_dtype(node: Node) -> str | None:
    specs = node.output_specs or node.input_specs
    return specs[0].dtype if specs else None


def has_backward(node: Node) -> bool:
    """Whether autograd runs a backward for this node (its output is floating point and it does work)."""
    if node.op_kind in NO_WORK_KINDS:
        return False
    return node.backward_flops > 0 or _node_dtype(node) in _FLOAT_DTYPES


def node_bytes(node: Node, *, bytes_scale: float = 1.0, param_scale: float = 1.0, dtype: str = "bfloat16"
               ) -> float:
    """Forward bytes moved by `node` at the given scales, converted to `dtype`."""
    traced = _node_dtype(node)
    ratio = retype_ratio(traced, dtype) if traced else 1.0
    params = node.param_bytes
    activations = max(node.bytes_read + node.bytes_written - params, 0)
    return (activations * bytes_scale + params * param_scale) * ratio


def fp8_cast_times(node: Node, device: DeviceSpec, recipe: Float8Recipe, *, bytes_scale: float, param_scale: float,
                   dtype: str, operands: tuple[Operand, ...] = tuple(Operand),
                   input_scale: float | None = None, output_scale: float | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of casting a converted linear's `operands` to FP8 (`costmodel.float8`): each
    operand's casts in a pass are one memory-bound term of `CAST_TRAFFIC` bytes per element. `input_scale` /
    `output_scale`: the share of the input / output gradient this device casts, where it differs from the op's
    `bytes_scale` (tensor parallelism: `costmodel.sharding.cost`)."""
    x = bytes_scale if input_scale is None else input_scale
    dy = bytes_scale if output_scale is None else output_scale
    elements = {Operand.INPUT: node.input_specs[0].numel * x if node.input_specs else 0.0,
                Operand.WEIGHT: node.param_specs[0].numel * param_scale,
                Operand.GRAD_OUTPUT: node.output_specs[0].numel * dy if node.output_specs else 0.0}
    width = dtype_bytes(dtype)
    fwd = bwd = 0.0
    for operand in operands:
        traffic_fwd, traffic_bwd = fused_cast_traffic(node, recipe, operand)
        fwd += roofline_time(0.0, elements[operand] * traffic_fwd.bytes_per_element(width), 0.0, device)
        bwd += roofline_time(0.0, elements[operand] * traffic_bwd.bytes_per_element(width), 0.0, device)
    return fwd, bwd


def fp8_weight_cast_times(nodes: Sequence[Node], device: DeviceSpec, recipe: Float8Recipe, *, param_scale: float,
                          dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the weight casts of the converted linears among `nodes` (part of their
    `node_time`): what FSDP's FP8 all-gather moves onto the 1/dp shard (`LayerCost.fp8_weight_cast_fwd_s`)."""
    times = [fp8_cast_times(n, device, recipe, bytes_scale=0.0, param_scale=param_scale, dtype=dtype,
                            operands=(Operand.WEIGHT,)) for n in nodes if converted_node(n)]
    return sum(t[0] for t in times), sum(t[1] for t in times)


def fp8_weight_copy_time(costs: Sequence[LayerCost], recipe: Float8Recipe | None, device: DeviceSpec, *,
                         dtype: str, counts: Sequence[int] | None = None) -> float:
    """Seconds per step of the FP8 weight copies a recipe makes once per step (`Float8Recipe.weight_copy_bytes`:
    Transformer Engine's first-micro-batch cast and transpose) for the converted weights of `costs` -- the rank's
    routed experts too where the recipe converts their grouped GEMMs (`Float8Recipe.converts_experts`) -- one
    memory-bound pass; 0 for recipes that cast weights every micro-batch (their casts are in the layers' times).
    `counts[i]`: segments of `costs[i]` (one each by default)."""
    if recipe is None:
        return 0.0
    reads, fp8_bytes = recipe.weight_copy_bytes
    experts = recipe.converts_experts
    converted = sum(n * (c.fp8_weight_share * (c.param_count - c.expert_param_count)
                         + (c.expert_param_count if experts else 0))
                    for c, n in zip(costs, counts or [1] * len(costs), strict=True))
    if converted <= 0 or fp8_bytes <= 0:
        return 0.0
    return memory_pass_time(converted * (reads * dtype_bytes(dtype) + fp8_bytes), device)


def node_time(node: Node, device: DeviceSpec, *, flops_scale: float = 1.0, bytes_scale: float = 1.0,
              dtype: str = "bfloat16", profile: OpProfile | None = None, param_scale: float = 1.0,
              gemm_groups: int = 1, fp8: Float8Recipe | None = None, fp8_casts: bool = True) -> tuple[float, float]:
    """(forward seconds, backward seconds) of `node` on `device` (formulas in the module docstring).
    `gemm_groups`: the node's FLOPs are that many equal GEMMs (a grouped GEMM), each sized for `s(tau)` alone.
    `fp8`: linear layers run as FP8 training converts them (`costmodel.float8`): their GEMMs at the FP8 rate plus
    the casts of their operands (without them when `fp8_casts` is off: the caller prices them per operand)."""
    if fp8 is not None and converted_node(node):
        return _fp8_linear_time(node, device, fp8, flops_scale=flops_scale, bytes_scale=bytes_scale,
                                param_scale=param_scale, dtype=dtype, casts=fp8_casts)
    if profile is not None:
        sig = op_signature(node, flops_scale=flops_scale, bytes_scale=bytes_scale, param_scale=param_scale)
        hit = profile.lookup(device.name, sig)
        if hit is not None:
            return hit.forward_s, hit.backward_s
    if node.op_kind in NO_WORK_KINDS:
        return 0.0, 0.0
    fwd_flops = node.forward_flops * flops_scale
    bwd_flops = node.backward_flops * flops_scale
    fwd_bytes = node_bytes(node, bytes_scale=bytes_scale, param_scale=param_scale, dtype=dtype)
    rate = compute_rate(node.op_kind, device, dtype, (fwd_flops if fwd_flops > 0 else bwd_flops / 2) / gemm_groups)
    if node.op_kind is OpKind.ATTENTION and node.attr("is_causal", False):
        rate *= CAUSAL_SPEEDUP
    # A node inside a fused kernel (`ir.fusion`) launches nothing of its own.
    floor = 0.0 if node.attr(FUSED_MEMBER_ATTR, False) else T_KERNEL_FLOOR_S
    fwd = roofline_time(fwd_flops, fwd_bytes, rate, device, floor_s=floor)
    if not has_backward(node):
        return fwd, 0.0
    bwd_bytes = fwd_bytes * BACKWARD_BYTES_FACTOR.get(node.op_kind, 1.5)
    return fwd, roofline_time(bwd_flops, bwd_bytes, rate, device, floor_s=floor)


def fp8_grouped_gemm_time(node: Node, device: DeviceSpec, recipe: Float8Recipe, *, flops_scale: float,
                          bytes_scale: float, param_scale: float, gemm_groups: int, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of a routed experts' projection run as `gemm_groups` FP8 GEMMs
    (`Float8Recipe.converts_experts`): each sized on its own at the FP8 rate, plus the operand casts."""
    return _fp8_linear_time(node, device, recipe, flops_scale=flops_scale, bytes_scale=bytes_scale,
                            param_scale=param_scale, dtype=dtype, gemm_groups=gemm_groups)


def _fp8_linear_time(node: Node, device: DeviceSpec, recipe: Float8Recipe, *, flops_scale: float,
                     bytes_scale: float, param_scale: float, dtype: str, casts: bool = True,
                     gemm_groups: int = 1) -> tuple[float, float]:
    """A converted linear: its GEMMs at the FP8 rate (bytes as in BF16: the GEMMs are compute-bound at these
    sizes) plus the operand casts (unless `casts` is off). A measured profile of the BF16 op does not apply."""
    fwd_flops = node.forward_flops * flops_scale
    fwd_bytes = node_bytes(node, bytes_scale=bytes_scale, param_scale=param_scale, dtype=dtype)
    rate = fp8_gemm_rate(device, fwd_flops / gemm_groups)
    cast_fwd, cast_bwd = fp8_cast_times(node, device, recipe, bytes_scale=bytes_scale, param_scale=param_scale,
                                        dtype=dtype) if casts else (0.0, 0.0)
    fwd = roofline_time(fwd_flops, fwd_bytes, rate, device)
    bwd = roofline_time(node.backward_flops * flops_scale, fwd_bytes * BACKWARD_BYTES_FACTOR[OpKind.LINEAR], rate,
                        device)
    return fwd + cast_fwd, bwd + cast_bwd
