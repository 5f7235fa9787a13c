"""Per-node costs: forward/backward FLOPs, bytes read and written, and bytes autograd saves for backward.

How each number is measured (all on fake tensors: no real memory, no real arithmetic):

- **FLOPs.** The node's call is re-run on fresh fake inputs of the same shapes, dtypes and strides under
  `torch.utils.flop_counter.FlopCounterMode`; the total is `forward_flops`. Then `torch.autograd.grad` of every
  differentiable output (with all-ones gradients) with respect to every input that requires grad (activations
  that require grad in the traced graph, and the parameters) runs under a second counter: `backward_flops`.
  FlopCounterMode counts matmul-like ops (mm, addmm, bmm, convolution, attention kernels); elementwise ops are 0,
  exactly as in torch. Results are cached per op signature (target, module type and config, argument structure,
  input and parameter specs), so the 96 identical blocks of GPT-3 cost one measurement per distinct op.
- **Fused attention** (`scaled_dot_product_attention`) is priced with FlashAttention semantics whatever kernel the
  trace device would pick: forward and backward FLOPs are torch's own `sdpa_flop_count` /
  `sdpa_backward_flop_count` (the formulas FlopCounterMode applies to the flash/efficient/cuDNN kernels; the
  backward recomputes the scores, 2.5x the forward), and the saved tensors are q, k, v, the output and the fp32
  logsumexp (batch x heads x seq_q), never the seq x seq score matrix (Dao et al. 2022, FlashAttention, Alg. 1-2).
  `stratagem::windowed_attention` (a causal sliding window, `models.windowed_attention`) gets the same formulas
  times the band's share of the causal pairs (`window_fraction`), and so does `stratagem::sparse_attention` (DeepSeek
  Sparse Attention, `models.sparse_attention`) with its top-k as the window: query s sees min(s + 1, k) keys in
  both. Its `stratagem::lightning_indexer` is a GEMM over the causal query-key pairs (`indexer_measurement`).
  The CPU flash kernel, which FlopCounterMode does not know, is given the same formulas (`flop_counter_mode()`).
- **RMSNorm** (`nn.RMSNorm`, `F.rms_norm`) saves what it saves on a GPU: torch dispatches `rms_norm` on CUDA to
  `aten._fused_rms_norm`, whose backward (`_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight,
  output_mask)`) reads the input and the fp32 per-row rstd only. The CPU and meta builds decompose it instead and
  would save fp32 copies of the input (four times the input's bytes in bfloat16), which no GPU run keeps. A
  hand-written RMSNorm module (as in many Hugging Face models) is measured as written: it really saves its copies.
- **Bytes read / written.** Inputs (activations, parameters and buffers) are read, outputs written. A pure view
  (its outputs alias an input's storage and are views) moves nothing: 0 and 0.
- **Saved bytes.** `torch.autograd.graph.saved_tensors_hooks` records every tensor autograd packs during the
  forward re-run. Each is traced back to what it is: one of the node's inputs, one of its outputs, a parameter or
  buffer (not activation memory, skipped), or an internal tensor (e.g. LayerNorm's mean/rstd, a dropout mask).
  Tensors sharing a storage are one allocation, counted once at the storage's size. In the whole graph, an
  activation saved by several nodes (x feeding q_proj, k_proj and v_proj) is still one allocation: a
  `SavedLedger` charges each storage to the *first* node (in topological order) that saves it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _cpu_flash_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    # Same formula FlopCounterMode registers for aten._scaled_dot_product_flash_attention (torch/utils/flop_counter.py).
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def flop_counter_mode() -> FlopCounterMode:
    """A FlopCounterMode that also counts the CPU flash-attention kernel (torch leaves it out), so counts do not
    depend on which device the trace runs on. Use it for whole-model reference counts too."""
    return FlopCounterMode(
        display=False,
        custom_mapping={
            _aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
            _aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
        },
    )


class Role(enum.StrEnum):
    """What a tensor argument of a call is."""

    ACTIVATION = "activation"
    PARAM = "param"
    BUFFER = "buffer"


class SavedSource(enum.StrEnum):
    INPUT = "input"
    OUTPUT = "output"
    INTERNAL = "internal"


@dataclass(frozen=True, slots=True)
class SavedRef:
    """One allocation autograd keeps for backward: an input leaf, an output, or an op-internal tensor."""

    source: SavedSource
    index: int
    """Position in the call's tensor leaves (INPUT) or tensor outputs (OUTPUT); -1 for INTERNAL."""
    nbytes: int
    """Storage size, used for INTERNAL tensors (inputs and outputs are sized from the traced graph)."""


@dataclass(frozen=True, slots=True)
class OpMeasurement:
    forward_flops: int
    backward_flops: int
    saved: tuple[SavedRef, ...]


@dataclass(frozen=True, slots=True)
class Leaf:
    """A tensor argument of a call, as propagated: its value and role."""

    value: torch.Tensor
    role: Role


def storage_key(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------------------------------
# Signatures (cache keys)
# ---------------------------------------------------------------------------------------------------------------


def value_signature(obj: Any) -> Hashable:
    """A hashable description of a call argument with tensors reduced to their spec (shape, stride, dtype, grad)."""
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), tuple(obj.stride()), str(obj.dtype), obj.requires_grad)
    if isinstance(obj, tuple | list):
        return (type(obj).__name__, tuple(value_signature(x) for x in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((k, value_signature(v)) for k, v in obj.items()))
    if isinstance(obj, slice):
        return ("slice", value_signature(obj.start), value_signature(obj.stop), value_signature(obj.step))
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return repr(obj)


def module_signature(module: torch.nn.Module) -> Hashable:
    tensors = [(n, tuple(t.shape), str(t.dtype), t.requires_grad)
               for n, t in (*module.named_parameters(), *module.named_buffers())]
    return (type(module).__module__, type(module).__qualname__, module.extra_repr(), module.training,
            tuple(tensors))


# ---------------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class OpMeter:
    """Measures calls on fresh fake tensors under FlopCounterMode and saved-tensor hooks, one per signature.

    One meter lives for one trace (it holds the fake mode); nothing is global.
    """

    fake_mode: Any
    _cache: dict[Hashable, OpMeasurement] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def measure(self, key: Hashable, leaves: Sequence[Leaf],
                call: Callable[[Sequence[torch.Tensor]], Any]) -> OpMeasurement:
        """`call(tensors)` runs the op with `tensors` in place of `leaves` (same order) and returns its result."""
        full_key = (key, tuple((value_signature(lf.value), lf.role.value) for lf in leaves))
        hit = self._cache.get(full_key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        result = self._run(leaves, call)
        self._cache[full_key] = result
        return result

    def _run(self, leaves: Sequence[Leaf], call: Callable[[Sequence[torch.Tensor]], Any]) -> OpMeasurement:
        with self.fake_mode:
            grad_leaves: list[torch.Tensor] = []
            args: list[torch.Tensor] = []
            for lf in leaves:
                v = lf.value
                fresh = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=v.device)
                if v.requires_grad and (v.is_floating_point() or v.is_complex()):
                    fresh.requires_grad_(True)
                    grad_leaves.append(fresh)
                    # Activations go through a clone so in-place ops (x += y, ReLU(inplace=True)) are legal;
                    # clone costs no counted FLOPs and saves nothing.
                    fresh = fresh.clone() if lf.role is Role.ACTIVATION else fresh
                args.append(fresh)
            packed: list[torch.Tensor] = []

            def pack(t: torch.Tensor) -> torch.Tensor:
                packed.append(t)
                return t

            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with flop_counter_mode() as fwd_counter:
                    out = call(args)
            outs = tensor_outputs(out)
            saved = _classify_saved(packed, args, leaves, outs)
            diff = [o for o in outs if o.requires_grad and o.grad_fn is not None]
            backward = 0
            if diff and grad_leaves:
                with flop_counter_mode() as bwd_counter:
                    torch.autograd.grad(diff, grad_leaves, [torch.ones_like(o) for o in diff], allow_unused=True)
                backward = bwd_counter.get_total_flops()
            return OpMeasurement(int(fwd_counter.get_total_flops()), int(backward), saved)


def _classify_saved(packed: Sequence[torch.Tensor], args: Sequence[torch.Tensor], leaves: Sequence[Leaf],
                    outs: Sequence[torch.Tensor]) -> tuple[SavedRef, ...]:
    arg_keys = {storage_key(a): i for i, a in enumerate(args)}
    out_keys = {storage_key(o): j for j, o in enumerate(outs)}
    seen: dict[StorageWeakRef, SavedRef] = {}
    for t in packed:
        key = storage_key(t)
        if key in seen:
            continue
        if key in arg_keys:
            i = arg_keys[key]
            if leaves[i].role is not Role.ACTIVATION:
                seen[key] = SavedRef(SavedSource.INTERNAL, -1, 0)  # parameter or buffer: not activation memory
                continue
            seen[key] = SavedRef(SavedSource.INPUT, i, t.untyped_storage().nbytes())
        elif key in out_keys:
            seen[key] = SavedRef(SavedSource.OUTPUT, out_keys[key], t.untyped_storage().nbytes())
        else:
            seen[key] = SavedRef(SavedSource.INTERNAL, -1, t.untyped_storage().nbytes())
    return tuple(r for r in seen.values() if r.source is not SavedSource.INTERNAL or r.nbytes > 0)


def tensor_outputs(obj: Any) -> list[torch.Tensor]:
    """Tensors in a call result, in order (tuples, lists, dicts, named tuples)."""
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, tuple | list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(obj)
    return out


def window_fraction(q_length: int, kv_length: int, window: int | None) -> float:
    """Query-key pairs a causal attention over the last `window` keys computes, over those of plain causal
    attention (queries are the last q_length positions): sum_i min(i + 1, w) / sum_i (i + 1)."""
    if window is None or window >= kv_length:
        return 1.0
    first = kv_length - q_length  # position of the first query

    def pairs(w: int) -> int:  # sum over query positions p of min(p + 1, w)
        ramp_end = min(max(w - 1, first), kv_length)  # positions p < w - 1 see p + 1 keys
        ramp = sum(range(first + 1, ramp_end + 1)) if ramp_end > first else 0
        return ramp + (kv_length - ramp_end) * w

    return pairs(window) / pairs(kv_length)


def attention_measurement(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          needs_grad: bool, window: int | None = None, saves_indices: bool = False) -> OpMeasurement:
    """FlashAttention-semantics costs of scaled_dot_product_attention (see the module docstring); with a causal
    `window` (`stratagem::windowed_attention`), the FLOPs of the band: `window_fraction` of causal attention's,
    the count that keeps the FLOP convention of causal attention (a full S x S count) for windows >= S.

    Leaves 0, 1, 2 are q, k, v; output 0 is the attention output; the logsumexp is internal; with
    `saves_indices` (`stratagem::sparse_attention`), leaf 3, the selected keys' indices, is saved too.
    """
    q4, k4, v4, o4 = (_as_4d(t) for t in (q, k, v, out))
    band = window_fraction(q4[2], k4[2], window)
    forward = sdpa_flop_count(q4, k4, v4) * band
    backward = sdpa_backward_flop_count(o4, q4, k4, v4) * band if needs_grad else 0
    b, h, s_q, _ = q4
    logsumexp_bytes = b * h * s_q * 4  # fp32, one value per query row and head
    saved = (
        SavedRef(SavedSource.INPUT, 0, 0), SavedRef(SavedSource.INPUT, 1, 0), SavedRef(SavedSource.INPUT, 2, 0),
        SavedRef(SavedSource.OUTPUT, 0, 0), SavedRef(SavedSource.INTERNAL, -1, logsumexp_bytes),
        *((SavedRef(SavedSource.INPUT, 3, 0),) if saves_indices else ()),
    )
    return OpMeasurement(int(forward), int(backward), saved if needs_grad else ())


def causal_pairs(q_length: int, kv_length: int) -> int:
    """Query-key pairs (s, t) with t <= s when the queries are the last q_length of kv_length positions."""
    first = kv_length - q_length
    return q_length * (first + 1) + q_length * (q_length - 1) // 2


def indexer_measurement(q: torch.Tensor, k: torch.Tensor) -> tuple[OpMeasurement, int]:
    """(costs, logit bytes) of `stratagem::lightning_indexer(q (B, S, H, D), k (B, T, D), weights (B, S, H))`:
    per causal query-key pair, H dot products of length D and the weighted sum over the H heads (2HD + 2H FLOPs),
    as the fused kernels compute them (no (B, S, H, T) scores); the fp32 logits (one per pair) are written for the
    top-k to read, which the caller adds to the bytes moved. No backward: the indices carry no gradient."""
    batch, seq, heads, dim = q.shape
    pairs = batch * causal_pairs(seq, k.size(1))
    return OpMeasurement(pairs * (2 * heads * dim + 2 * heads), 0, ()), 4 * pairs


def gpu_attention_layout(out: Any) -> Any:
    """A fused attention's output laid out as the GPU kernels write it: (batch, seq, heads, head_dim) in memory,
    seen as (batch, heads, seq, head_dim). FlashAttention, memory-efficient and cuDNN attention all write it so,
    which makes the usual ``transpose(1, 2).reshape(b, s, h)`` before the output projection a view; the CPU
    kernels and the meta device write it heads-major and would add a copy (its traffic, and a saved activation
    of the output's size for the projection's backward) that no GPU run makes."""
    if isinstance(out, torch.Tensor) and out.dim() == 4 and out.is_contiguous():
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    return out


def rms_norm_measurement(measured: OpMeasurement, x: torch.Tensor, normalized_ndim: int) -> OpMeasurement:
    """`measured` (the decomposed call's FLOPs) with the fused kernel's saved set (see the module docstring): leaf 0,
    the input, and the fp32 rstd, one value per normalized row."""
    if not measured.saved:
        return measured  # nothing needs a gradient
    rows = 1
    for d in x.shape[:x.dim() - normalized_ndim]:
        rows *= int(d)
    saved = (SavedRef(SavedSource.INPUT, 0, 0), SavedRef(SavedSource.INTERNAL, -1, rows * 4))
    return OpMeasurement(measured.forward_flops, measured.backward_flops, saved)


def _as_4d(t: torch.Tensor) -> tuple[int, int, int, int]:
    shape = tuple(int(d) for d in t.shape)
    if len(shape) == 4:
        return shape  # type: ignore[return-value]
    if len(shape) == 3:
        return (shape[0], 1, shape[1], shape[2])
    batch = 1
    for d in shape[:-3]:
        batch *= d
    return (batch, shape[-3], shape[-2], shape[-1])


# ---------------------------------------------------------------------------------------------------------------
# Graph-wide attribution of saved activations
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class SavedLedger:
    """Charges each saved activation storage once, to the first node that saves it.

    `excluded` holds storages that are never activation memory (parameters, buffers, constants' storages are
    added by the tracer).
    """

    excluded: set[StorageWeakRef] = field(default_factory=set)
    _charged: set[StorageWeakRef] = field(default_factory=set)

    def charge(self, saved: Sequence[SavedRef], inputs: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor]) -> int:
        """Bytes newly saved by one node. `inputs`/`outputs` are the node's propagated tensor leaves/outputs,
        indexed like the `SavedRef`s."""
        total = 0
        for ref in saved:
            if ref.source is SavedSource.INTERNAL:
                total += ref.nbytes
                continue
            t = inputs[ref.index] if ref.source is SavedSource.INPUT else outputs[ref.index]
            key = storage_key(t)
            if key in self.excluded or key in self._charged:
                continue
            self._charged.add(key)
            total += t.untyped_storage().nbytes()
        return total


def io_bytes(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], pure_view: bool) -> tuple[int, int]:
    """(bytes read, bytes written): every distinct input tensor once, every output; 0, 0 for a pure view."""
    if pure_view:
        return 0, 0
    seen: set[int] = set()
    read = 0
    for t in inputs:
        if id(t) not in seen:
            seen.add(id(t))
            read += tensor_nbytes(t)
    return read, sum(tensor_nbytes(o) for o in outputs)


def is_pure_view(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], inplace: bool,
                 getitem_of_container: bool) -> bool:
    """True when the call moves no data: every output is a view of (or the very object of) an input."""
    if getitem_of_container:
        return True
    if inplace or not outputs:
        return False
    in_ids = {id(t) for t in inputs}
    in_keys = {storage_key(t) for t in inputs}
    for o in outputs:
        if id(o) in in_ids:
            continue  # x.contiguous() / x.to(same dtype) return x itself
        if not (o._is_view() and storage_key(o) in in_keys):
            return False
    return True


def alias_index(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> int | None:
    """Index of the input whose storage the first output shares (views, in-place ops), else None."""
    if not outputs:
        return None
    key = storage_key(outputs[0])
    for i, t in enumerate(inputs):
        if storage_key(t) == key:
            return i
    return None


MeasurementMap = Mapping[Hashable, OpMeasurement]
