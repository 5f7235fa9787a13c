"""The training loss on the model's output: softmax cross-entropy in fp32, priced on the segment that returns it.

The traced graph ends at the model's output (logits for a language model); the trainer then computes the loss,
which for a large vocabulary is neither small nor free. Trainers compute it on the device's local share of the
logits (E elements; 1/tp of them when the head is vocabulary-sharded), w the training dtype's bytes, with one of
three kernels (`strategy.CrossEntropy`, `RuntimeOptions.cross_entropy`), whose memory differs by up to 3x:

    kernel    kept for backward        transient beside it, at the peak
    torch     4E  fp32 log-probs       8E: backward's fp32 one-hot gradient from `nll_loss` and `log_softmax`'s
                                       input gradient (forward holds (w + 4)E: the logits and their fp32 copy)
    inplace   4E  fp32 softmax         wE: the 16-bit logits beside their fp32 copy (forward) or the gradient's
                                       cast (backward); 0 in fp32, where the copy is the logits
    fused     wE  the logits           wE: their gradient (flash-attn's kernel writes it in one pass)
    loss-     4E  fp32 log-probs       12E: backward's zero-filled gradient, exp of the log-probs, their sum and
    parallel                           its product with the output gradient (forward holds (w + 8)E: the logits,
                                       their fp32 copy, the shifted copy and its exp)

`torch` is PyTorch's `cross_entropy(logits.float(), labels)` (this project's runtime, torchtitan without tensor
parallelism, Hugging Face models); `loss-parallel` the same call under `loss_parallel()` on vocabulary-sharded
DTensor logits (torchtitan with tp > 1), where DTensor replaces the fused ATen kernels by its own decomposition
(`_log_softmax`: amax, subtract, exp, sum, subtract; `_nll_loss_and_log_softmax_backward`: zeros, scatter, (grad +
exp(x)) * dy, each an fp32 tensor of the local logits' size); `inplace` Megatron-LM's vocab-parallel cross-entropy,
which normalizes the fp32 copy in place into the softmax it keeps and turns into the gradient; `fused` flash-attn's
cross-entropy (llm-foundry's default `fused_crossentropy`), which reads the 16-bit logits once per pass and keeps
only a log-sum-exp per row beside them. `torch` and `inplace` are measured on the CPU by
`tests/test_training_loss.py` (live bytes of every tensor the loss creates), `loss-parallel` there too (peak
resident memory of a process running it on a one-rank mesh: 16E in bf16 and fp32); `fused` follows from flash-attn's
`save_for_backward(logits, lse, labels)` and its `empty_like(logits)` gradient. What is kept is priced as
activations of the last segment's micro-batches in flight, the transient as the largest temporary
(`memory.rank_memory`), both where the runtime is known: `LayerCost.loss_elements` carries E.

Time, memory-bound (HBM roofline, like the other elementwise kernels of `costmodel.operators`), priced here for
`torch`: forward reads the w-byte logits and writes the fp32 copy, `log_softmax` reads it twice (max and sum, then
the normalization) and writes the result, the loss gathers one value per row: (w + 4 + 8 + 4) E bytes in 3 kernels;
backward writes the one-hot gradient, `log_softmax`'s backward reads it and the saved output and writes the input
gradient, the cast writes it back in w bytes: (4 + 8 + 4 + 4 + w) E bytes in 3 kernels. `inplace` makes about the
same passes (its forward's in-place subtract, exp and divide add 8E, its backward saves the one-hot and the
log-softmax gradient, -8E) and is priced the same; `fused` reads wE forward and reads and writes wE backward, one
kernel each (`loss_time_change`); `loss-parallel` runs its decomposition as 6 kernels each way, forward the cast
(w + 4), amax (4), subtract (8), exp (8), sum (4) and subtract (8), backward zeros (4), exp (8), add (12), multiply
(8) and the cast back (4 + w): (w + 36) E bytes each way. A trainer that also computes training metrics from the
logits adds that many `torch` forwards without gradient per micro-batch (`metric_pass_time`,
`RuntimeOptions.metric_passes`), after the backward: their buffers come when the activations are gone and are
not priced as memory.
Outputs that are not floating point, or scalars (a model that returns its own loss), add nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.operators import T_KERNEL_FLOOR_S, memory_pass_time
from costmodel.strategy import CrossEntropy
from ir.graph import Node, OpKind, dtype_bytes

FP32_BYTES = 4
LOSS_KERNELS_PER_PASS = 3
LOSS_PARALLEL_KERNELS_PER_PASS = 6
LOSS_PARALLEL_TRANSIENT = 3 * FP32_BYTES
"""Bytes per local logit that DTensor's loss-parallel backward holds beside the kept log-probs: the zero-filled
gradient, exp of the log-probs, their sum, and its product with the output gradient live together (module
docstring); its forward's (w + 8) is less for 16- and 32-bit logits."""


def loss_inputs(nodes: Sequence[Node]) -> frozenset[str]:
    """Nodes of the segment whose output the loss reads: what the graph's output node returns, when it is a
    floating, non-scalar tensor (empty for every segment but the last)."""
    producers = {i for n in nodes if n.op_kind is OpKind.OUTPUT for i in n.inputs}
    return frozenset(n.name for n in nodes
                     if n.name in producers and n.output_specs and n.output_specs[0].numel > 1
                     and n.output_specs[0].dtype.startswith(("float", "bfloat")))


def loss_saved_bytes(elements: float, dtype: str, kernel: CrossEntropy) -> float:
    """Bytes the loss over `elements` local logits keeps for backward (module docstring)."""
    return (dtype_bytes(dtype) if kernel is CrossEntropy.FUSED else FP32_BYTES) * elements


def loss_transient_bytes(elements: float, dtype: str, kernel: CrossEntropy) -> float:
    """Bytes the loss over `elements` local logits holds beside what it keeps, at its peak (module docstring)."""
    w = dtype_bytes(dtype)
    if kernel is CrossEntropy.TORCH:
        return max(2 * FP32_BYTES, w + FP32_BYTES) * elements
    if kernel is CrossEntropy.LOSS_PARALLEL:
        return LOSS_PARALLEL_TRANSIENT * elements
    if kernel is CrossEntropy.INPLACE:
        return (w if w < FP32_BYTES else 0) * elements
    return w * elements


def _torch_pass_times(elements: float, w: int, device: DeviceSpec) -> tuple[float, float]:
    floor = LOSS_KERNELS_PER_PASS * T_KERNEL_FLOOR_S
    return (memory_pass_time((w + 4 + 8 + 4) * elements, device, floor_s=floor),
            memory_pass_time((4 + 8 + 4 + 4 + w) * elements, device, floor_s=floor))


def loss_time_change(elements: float, w: int, kernel: CrossEntropy, device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) seconds that `kernel` takes over the `torch` price of the same loss over `elements`
    logits of `w` bytes (0 or less)."""
    if kernel not in (CrossEntropy.FUSED, CrossEntropy.LOSS_PARALLEL) or elements <= 0:
        return 0.0, 0.0
    fwd, bwd = _torch_pass_times(elements, w, device)
    if kernel is CrossEntropy.LOSS_PARALLEL:  # (w + 36)E bytes each way (module docstring)
        each_way = memory_pass_time((w + 36) * elements, device,
                                    floor_s=LOSS_PARALLEL_KERNELS_PER_PASS * T_KERNEL_FLOOR_S)
        return each_way - fwd, each_way - bwd
    return memory_pass_time(w * elements, device) - fwd, memory_pass_time(2 * w * elements, device) - bwd


def metric_pass_time(elements: float, w: int, device: DeviceSpec) -> float:
    """Seconds of one forward of PyTorch's cross-entropy over `elements` logits of `w` bytes, without gradient: a
    training metric's pass (`RuntimeOptions.metric_passes`), the `torch` forward of the module docstring."""
    if elements <= 0:
        return 0.0
    return _torch_pass_times(elements, w, device)[0]


def with_training_loss(cost: LayerCost, input_bytes: float, device: DeviceSpec, dtype: str) -> LayerCost:
    """`cost` plus the `torch` cross-entropy's time over a local output of `input_bytes` in the training dtype, and
    its element count (its memory depends on the kernel: `memory.rank_memory`)."""
    if input_bytes <= 0:
        return cost
    w = dtype_bytes(dtype)
    elements = input_bytes / w
    fwd, bwd = _torch_pass_times(elements, w, device)
    return dataclasses.replace(
        cost,
        fwd_compute_s=cost.fwd_compute_s + fwd,
        bwd_compute_s=cost.bwd_compute_s + bwd,
        loss_elements=cost.loss_elements + round(elements),
    )
