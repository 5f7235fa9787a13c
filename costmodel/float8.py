"""FP8 training of linear layers as torchao runs it (`torchao.float8`, the converter torchtitan applies) or as
Transformer Engine does (Megatron-Core, NeMo): which GEMMs run in FP8, what the conversion adds, and what stays in
BF16.

A converted linear y = x W^T keeps its BF16 weight, gradient and optimizer state; each GEMM casts its operands to
FP8 (e4m3) with dynamic scales and multiplies them on the FP8 tensor cores (`torch._scaled_mm`):

    GEMM rate   R8 = peak_fp8 * fp8_matmul_efficiency * s(F / peak_fp8)
                (forward y = x W^T and both backward GEMMs dX = dY W, dW = dY^T x; `s` is the size curve of
                `costmodel.operators`, fitted on BF16 and FP8 series alike; the level is the measured FP8
                max-achievable matmul over the FP8 peak, `catalog.fp8_matmul_efficiency`)
    casts       memory-bound kernels per GEMM operand (x the input, w the weight, dy the output gradient), priced
                like every elementwise kernel (HBM roofline, at least the kernel floor), with the traffic of
                torchao's own roofline model of float8 training (`get_tensor_memory_traffic_ovhd_s`,
                torchao/testing/training/roofline_utils.py at pytorch/ao 36027d8, not fused with the previous
                op); per element, h the training dtype's bytes, 1 byte per FP8 element written:

                recipe      operand  forward                         backward
                tensorwise  x, dy    amax (read h), cast writing both layouts (h + 2): 2h + 2, in the pass
                                     that produces the operand (dy: backward)
                tensorwise  w        amax (h) + cast (h + 1)         cast to the other layout (h + 1)
                rowwise     x, dy    cast and a transposed copy (2h + 1), then its cast (h + 1): forward and
                                     backward for x, both in backward for dy
                rowwise     w        cast (h + 1)                    transposed copy (2h) + its cast (h + 1)

Transformer Engine with delayed scaling (`DELAYED`: TE's `DelayedScaling` recipe, Megatron-Core `--fp8-format
hybrid`, NeMo `fp8: True`) takes each tensor's scale from its amax history, so a cast is one pass that records the
new amax on the way (no amax pass before it), and it casts where the operand is made:

                x           the norm or activation kernel before the linear writes its output in FP8 (TE's
                            `LayerNormLinear` / `LayerNormMLP`), and its transposed FP8 copy for the weight-gradient
                            GEMM comes from the same cast-transpose: 2 FP8 writes per element; an input no fused
                            kernel writes (the attention output before its projection) pays the read as well
                w           cast and transposed once per step, on the first micro-batch, and reused by the others
                            (`is_first_microbatch`): read h, write 2 FP8 bytes per converted weight per step,
                            priced with the optimizer step (`weight_copy_bytes`), nothing per micro-batch
                dy          one cast-transpose in backward: read h (none where a fused kernel writes the gradient,
                            TE's dgelu/dbias cast-transpose), write 2 FP8 bytes

TE's attention stays in BF16 here as in the torchao case (its FP8 attention is off by default). Routed experts
(`Float8Recipe.converts_experts`): under TE their grouped GEMMs run in FP8, priced per expert GEMM at the FP8 rate
with the input and output-gradient casts as above (`costmodel.expert_parallel`); their weights' once-per-step FP8
copies are not priced (a pass over the rank's E / ep expert weights, milliseconds per step). Under torchao they
stay in the training dtype, as the runtime runs them. The runtime does
not run Transformer Engine: plans with `DELAYED` are for pricing a Megatron-Core / NeMo configuration and for
export to Megatron-LM.

Under tensor parallelism each rank casts its own share of each operand (`costmodel.sharding.cost.fp8_cast_shares`):
its weight shard, the output gradient in the module's output layout, the input as it arrives -- with sequence
parallelism torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` cast the sequence shard before the
all-gather, so 1/tp of the activation and of the output gradient.

Memory: what `Float8Linear`'s autograd function saves is the BF16 input and weight
(`matmul_with_hp_or_float8_args.forward`: `ctx.save_for_backward(input_hp, weight_hp_t)`,
torchao/float8/float8_linear.py), so activation memory, weights, gradients and optimizer state are priced as
without FP8 (torch.compile's partitioner may keep FP8 copies instead: not priced).

ZeRO-3 (FSDP2) with tensorwise scaling: torchao's `enable_fsdp_float8_all_gather` casts each rank's weight shard
to FP8 before the all-gather (`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`, torchao/float8/
fsdp_utils.py), and the linear finds the gathered weight already in FP8 (`tensor_already_casted_to_fp8` in
float8_linear.py). So a converted weight is gathered in 1 byte instead of 2 (`LayerCost.fp8_weight_share`), and its
casts run on the 1/dp shard (`LayerCost.fp8_weight_cast_fwd_s` / `_bwd_s` shrink to that share in
`costmodel.estimate`). torchtitan's configurations of the published FP8 runs set it (train_configs/llama3_405b.toml
at torchtitan 9dec370, and the launch command of its docs/float8.md). Rowwise scaling gathers in BF16 ("for
float8 with rowwise scaling, all distributed communication is done in high precision", torchtitan
components/quantization/float8.md).

What stays BF16 (`converts`): the attention core, norms, softmax, embeddings and every op that is not an
`nn.Linear`; the model's output layer and MoE routers (torchtitan's converter filters `output` and `router.gate`
by name; here the zoo's and transformers' names for them, `FILTERED_MODULE_NAMES`); routed experts' grouped GEMMs
(torchtitan converts them with a separate converter, not priced here); and linears with a dimension not divisible
by 16 (FP8 tensor cores need it; torchtitan's `module_filter_fn` skips them).

Compiled runs (chains priced with fused kernels, `ir.fusion`): where a fused kernel writes a linear's input, or its
output gradient, the first read of that operand's cast is done by that kernel (`fused_cast_traffic`, torchao's
roofline with fusion modeling); everything else is priced as above.

Not priced: the amax all-reduce of the precomputed weight scales (one small all-reduce per step); torchtitan's
FP8 tensor-parallel all-gathers of activations (tp collectives are priced in BF16).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from costmodel.hardware.catalog import FP8_DTYPE, list_devices
from costmodel.hardware.device import DeviceSpec
from ir.fusion import FUSED_GRAD_ATTR, FUSED_INPUT_ATTR
from ir.graph import Node, OpKind

FP8_BYTES = 1
"""Bytes per FP8 (e4m3) element: a cast's output, and a converted weight as ZeRO-3 gathers it (tensorwise)."""
FP8_DIM_MULTIPLE = 16
"""FP8 tensor-core GEMMs need both dimensions of the weight divisible by 16 (torchtitan `module_filter_fn`)."""
FILTERED_MODULE_NAMES = frozenset({"output", "lm_head", "head", "classifier", "router", "gate"})
"""Last names of modules kept in BF16: the output layer (torchtitan `output`, the zoo's and transformers'
`lm_head`, `head`, `classifier`) and MoE routers (torchtitan `router.gate`, the zoo's `router`, transformers'
`gate` of Mixtral and DeepSeek). By name, as torchtitan filters: the runtime converts exactly what is priced."""


class Float8Recipe(enum.StrEnum):
    """How torchao scales FP8 operands (`Float8LinearConfig.from_recipe_name`)."""

    TENSORWISE = "tensorwise"
    """One dynamic scale per tensor; weights all-gathered in FP8 under FSDP2."""
    ROWWISE = "rowwise"
    """One dynamic scale per row (per column for the weight-gradient GEMM's operands); communication in BF16."""
    DELAYED = "delayed"
    """Transformer Engine's delayed scaling (Megatron-Core, NeMo): scales from the amax history, casts fused into
    the kernels that make the operands, weights cast once per step (module docstring)."""

    @property
    def fp8_all_gather(self) -> bool:
        """Whether ZeRO-3 gathers the converted weights in FP8."""
        return self is Float8Recipe.TENSORWISE

    @property
    def torchao(self) -> bool:
        """Whether torchao runs the recipe (`planner.runtime` can train with it); Transformer Engine's cannot."""
        return self is not Float8Recipe.DELAYED

    @property
    def converts_experts(self) -> bool:
        """Whether the routed experts' grouped GEMMs run in FP8 too: Transformer Engine's `GroupedLinear` (Megatron-
        Core's grouped MLP) has had its FP8 grouped GEMM since it was added (TE commit a4e95e866, 2024-06-25,
        `fp8_grouped_gemm`); torchao's `convert_to_float8_training` swaps `nn.Linear` modules only, so stacked
        expert weights stay in the training dtype (module docstring)."""
        return self is Float8Recipe.DELAYED

    @property
    def weight_copy_bytes(self) -> tuple[int, int]:
        """(training-dtype elements read, FP8 bytes written) per converted weight element once per step: the
        weight's FP8 copy and its transpose made on the first micro-batch (delayed scaling); (0, 0) where the
        casts are per micro-batch (`CAST_TRAFFIC`)."""
        return (1, 2 * FP8_BYTES) if self is Float8Recipe.DELAYED else (0, 0)


FP8_RECIPES = ", ".join(r.value for r in Float8Recipe)


def parse_recipe(text: str) -> Float8Recipe:
    """"tensorwise" -> TENSORWISE; unknown text raises ValueError naming the valid recipes."""
    try:
        return Float8Recipe(text.strip().lower())
    except ValueError:
        raise ValueError(f"unknown FP8 recipe {text!r}; valid: {FP8_RECIPES}") from None


def converts(module_path: str, in_features: int, out_features: int) -> bool:
    """Whether FP8 training converts the `nn.Linear` at `module_path` of this shape (module docstring)."""
    name = module_path.rsplit(".", 1)[-1]
    return (name not in FILTERED_MODULE_NAMES and in_features % FP8_DIM_MULTIPLE == 0
            and out_features % FP8_DIM_MULTIPLE == 0)


def converted_node(node: Node) -> bool:
    """Whether `node` is the GEMM of a converted linear layer (its weight is a 2-D (out, in) parameter)."""
    if node.op_kind is not OpKind.LINEAR or not node.param_specs or len(node.param_specs[0].shape) != 2:
        return False
    out_features, in_features = node.param_specs[0].shape
    return converts(node.module_path, in_features, out_features)


class Operand(enum.StrEnum):
    """A GEMM operand of a linear layer that FP8 training casts."""

    INPUT = "x"
    WEIGHT = "w"
    GRAD_OUTPUT = "dy"


@dataclass(frozen=True, slots=True)
class CastTraffic:
    """HBM traffic per element of one operand's casts in one pass: reads and writes in the training dtype, FP8
    elements written."""

    reads: int = 0
    writes: int = 0
    fp8_writes: int = 0

    def bytes_per_element(self, dtype_bytes: int) -> int:
        return (self.reads + self.writes) * dtype_bytes + self.fp8_writes * FP8_BYTES


_NONE = CastTraffic()
CAST_TRAFFIC: Mapping[tuple[Float8Recipe, Operand], tuple[CastTraffic, CastTraffic]] = {
    (Float8Recipe.TENSORWISE, Operand.INPUT): (CastTraffic(reads=2, fp8_writes=2), _NONE),
    (Float8Recipe.TENSORWISE, Operand.WEIGHT): (CastTraffic(reads=2, fp8_writes=1), CastTraffic(reads=1, fp8_writes=1)),
    (Float8Recipe.TENSORWISE, Operand.GRAD_OUTPUT): (_NONE, CastTraffic(reads=2, fp8_writes=2)),
    (Float8Recipe.ROWWISE, Operand.INPUT): (CastTraffic(reads=1, writes=1, fp8_writes=1),
                                            CastTraffic(reads=1, fp8_writes=1)),
    (Float8Recipe.ROWWISE, Operand.WEIGHT): (CastTraffic(reads=1, fp8_writes=1),
                                             CastTraffic(reads=2, writes=1, fp8_writes=1)),
    (Float8Recipe.ROWWISE, Operand.GRAD_OUTPUT): (_NONE, CastTraffic(reads=2, writes=1, fp8_writes=2)),
    (Float8Recipe.DELAYED, Operand.INPUT): (CastTraffic(reads=1, fp8_writes=2), _NONE),
    (Float8Recipe.DELAYED, Operand.WEIGHT): (_NONE, _NONE),
    (Float8Recipe.DELAYED, Operand.GRAD_OUTPUT): (_NONE, CastTraffic(reads=1, fp8_writes=2)),
}
"""(forward, backward) cast traffic per recipe and operand: the table of the module docstring."""


def fused_cast_traffic(node: Node, recipe: Float8Recipe, operand: Operand) -> tuple[CastTraffic, CastTraffic]:
    """`CAST_TRAFFIC` of one operand of a converted linear, less the first read of the input (forward) or of the
    output gradient (backward) where a fused kernel writes it (`ir.fusion.FUSED_INPUT_ATTR` / `FUSED_GRAD_ATTR`,
    set on chains priced with fused kernels): the compiled producer computes the amax (tensorwise) or the cast's
    first pass (rowwise) on the values it writes, as torchao's roofline models compiled training
    (`get_tensor_memory_traffic_ovhd_s(fuse_with_prev=True)` for input and grad_output, torchao/testing/training/
    roofline_utils.py)."""
    fwd, bwd = CAST_TRAFFIC[recipe, operand]
    if operand is Operand.INPUT and node.attr(FUSED_INPUT_ATTR, False):
        fwd = dataclasses.replace(fwd, reads=fwd.reads - 1)
    elif operand is Operand.GRAD_OUTPUT and node.attr(FUSED_GRAD_ATTR, False):
        bwd = dataclasses.replace(bwd, reads=bwd.reads - 1)
    return fwd, bwd


def fp8_weight_share(nodes: Sequence[Node]) -> float:
    """Fraction of the parameters of `nodes` that are converted linear weights (gathered in FP8 under FSDP2)."""
    total = sum(n.param_count for n in nodes)
    if total <= 0:
        return 0.0
    converted = sum(n.param_specs[0].numel for n in nodes if converted_node(n))
    return converted / total


def fp8_devices() -> tuple[str, ...]:
    """Catalog devices with FP8 tensor cores (an FP8 peak), in catalog order."""
    return tuple(d.name for d in list_devices() if FP8_DTYPE in d.peak_flops)


def fp8_problem(devices: Iterable[DeviceSpec]) -> str | None:
    """Why FP8 training cannot run on `devices` (those without FP8 tensor cores, and the catalog's that have
    them), or None when every device has them."""
    lacking = sorted({d.name for d in devices if FP8_DTYPE not in d.peak_flops})
    if not lacking:
        return None
    return (f"FP8 training needs FP8 tensor cores and {', '.join(lacking)} "
            f"{'has' if len(lacking) == 1 else 'have'} none; devices with them: {', '.join(fp8_devices())}")
