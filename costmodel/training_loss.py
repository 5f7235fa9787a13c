"""The training loss on the model's output: softmax cross-entropy in fp32, priced on the segment that returns it.

The traced graph ends at the model's output (logits for a language model); the trainer then computes the loss,
which for a large vocabulary is neither small nor free. Trainers compute it in fp32 on the device's local share of
the logits (E elements; 1/tp of them when the head is vocabulary-sharded), w the training dtype's bytes:

- saved for backward: 4E bytes of fp32 (PyTorch's `log_softmax` saves its output; Megatron keeps the fp32
  softmax), priced as saved activations of the last segment;
- transient, on top of the saved 4E and depending on the trainer (`loss_transient_bytes`, added by
  `memory.rank_memory` where the runtime is known):
  * PyTorch's `cross_entropy(logits.float(), labels)` (this project's runtime, torchtitan, Hugging Face models):
    forward holds the w-byte logits and their fp32 copy while `log_softmax` writes its output, (w + 4)E; backward
    allocates the gradient of the log-probabilities (`nll_loss`'s dense one-hot gradient, fp32) and
    `log_softmax`'s input gradient beside the saved output, 8E. The peak is 8E for w <= 4.
  * in place (`RuntimeOptions.inplace_cross_entropy`, Megatron-LM's vocab-parallel cross-entropy): the fp32 copy
    is itself normalized into the softmax that backward keeps and turns into the gradient, so only the w-byte
    logits (forward) or their gradient's cast (backward) sit beside it: wE, and nothing when training in fp32 (the
    copy is the logits).
  Both are measured on the CPU by `tests/test_training_loss.py` (live bytes of every tensor the loss creates).
- time, memory-bound (HBM roofline, like the other elementwise kernels of `costmodel.operators`):
  forward reads the w-byte logits and writes the fp32 copy, `log_softmax` reads it twice (max and sum, then the
  normalization) and writes the result, the loss gathers one value per row: (w + 4 + 8 + 4) E bytes in 3 kernels;
  backward writes the one-hot gradient, `log_softmax`'s backward reads it and the saved output and writes the
  input gradient, the cast writes it back in w bytes: (4 + 8 + 4 + 4 + w) E bytes in 3 kernels.
Outputs that are not floating point, or scalars (a model that returns its own loss), add nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.operators import T_KERNEL_FLOOR_S
from ir.graph import Node, OpKind, dtype_bytes

FP32_BYTES = 4
LOSS_KERNELS_PER_PASS = 3


def loss_inputs(nodes: Sequence[Node]) -> frozenset[str]:
    """Nodes of the segment whose output the loss reads: what the graph's output node returns, when it is a
    floating, non-scalar tensor (empty for every segment but the last)."""
    producers = {i for n in nodes if n.op_kind is OpKind.OUTPUT for i in n.inputs}
    return frozenset(n.name for n in nodes
                     if n.name in producers and n.output_specs and n.output_specs[0].numel > 1
                     and n.output_specs[0].dtype.startswith(("float", "bfloat")))


def loss_transient_bytes(elements: float, dtype: str, *, inplace: bool) -> float:
    """Bytes the loss over `elements` local logits holds beside its saved fp32 output at its peak (module
    docstring): 8E for PyTorch's cross-entropy, wE in place (0 in fp32)."""
    w = dtype_bytes(dtype)
    if inplace:
        return (w if w < FP32_BYTES else 0) * elements
    return max(2 * FP32_BYTES, w + FP32_BYTES) * elements


def with_training_loss(cost: LayerCost, input_bytes: float, device: DeviceSpec, dtype: str) -> LayerCost:
    """`cost` plus the fp32 cross-entropy over a local output of `input_bytes` in the training dtype."""
    if input_bytes <= 0:
        return cost
    w = dtype_bytes(dtype)
    elements = input_bytes / w
    bandwidth = device.memory_bandwidth * device.memory_efficiency * device.training_efficiency
    floor = LOSS_KERNELS_PER_PASS * T_KERNEL_FLOOR_S
    fwd = max((w + 4 + 8 + 4) * elements / bandwidth, floor)
    bwd = max((4 + 8 + 4 + 4 + w) * elements / bandwidth, floor)
    saved = round(FP32_BYTES * elements)
    return dataclasses.replace(
        cost,
        fwd_compute_s=cost.fwd_compute_s + fwd,
        bwd_compute_s=cost.bwd_compute_s + bwd,
        saved_bytes_none=cost.saved_bytes_none + saved,
        saved_bytes_selective=cost.saved_bytes_selective + saved,
        saved_bytes_full=cost.saved_bytes_full + saved,
        saved_bytes_op=cost.saved_bytes_op + saved,
        loss_elements=cost.loss_elements + round(elements),
    )
