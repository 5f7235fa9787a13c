"""The propagation cache: a call's result described relative to its inputs, so that an identical later call
(the next transformer block's q_proj) gets its result rebuilt instead of running the op again on fake tensors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ir.node_metrics import storage_key


def leaf_signature(leaves: Sequence[torch.Tensor]) -> Any:
    """Specs of the call's tensor arguments and which of them share a storage (views of one buffer)."""
    keys = [storage_key(t) for t in leaves]
    first = {}
    shared = tuple(first.setdefault(k, i) for i, k in enumerate(keys))
    specs = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad) for t in leaves)
    return specs, shared


@dataclass(frozen=True)
class _Out:
    """How to rebuild one tensor output: the input itself, a view of an input's storage, or a new tensor."""

    kind: str  # "input" | "view" | "new"
    leaf: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    """For views: storage offset relative to the input's."""
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True)
class ResultTemplate:
    """A call's result with tensors described relative to the call's inputs, so an identical later call (the next
    transformer block's q_proj) gets a result with the right shapes, strides, aliasing and requires_grad without
    running the op again on fake tensors. Only calls whose every output is an input, a view of an input's storage
    or a fresh tensor are cached; in-place calls never are."""

    structure: Any
    outs: tuple[_Out, ...]

    @classmethod
    def of(cls, result: Any, leaves: Sequence[torch.Tensor]) -> ResultTemplate | None:
        outs: list[_Out] = []
        keys = {}
        for i, t in enumerate(leaves):
            keys.setdefault(storage_key(t), i)
        ids = {id(t): i for i, t in enumerate(leaves)}

        def describe(t: torch.Tensor) -> str | None:
            base = dict(shape=tuple(t.shape), stride=tuple(t.stride()), dtype=t.dtype, device=t.device,
                        requires_grad=t.requires_grad)
            if id(t) in ids:
                outs.append(_Out("input", ids[id(t)], offset=0, **base))
                return "<T>"
            k = keys.get(storage_key(t))
            if k is None and not t._is_view():
                outs.append(_Out("new", -1, offset=0, **base))
                return "<T>"
            src = leaves[k] if k is not None else None
            if src is not None and t._is_view() and t.dtype == src.dtype and t.requires_grad == src.requires_grad:
                outs.append(_Out("view", k, offset=t.storage_offset() - src.storage_offset(), **base))
                return "<T>"
            return None

        structure = _template(result, describe)
        if structure is _UNCACHEABLE:
            return None
        return cls(structure, tuple(outs))

    def replay(self, leaves: Sequence[torch.Tensor]) -> Any:
        it = iter(self.outs)
        return _fill(self.structure, lambda: _rebuild_tensor(next(it), leaves))


_UNCACHEABLE = object()


def _template(obj: Any, describe: Callable[[torch.Tensor], str | None]) -> Any:
    if isinstance(obj, torch.Tensor):
        marker = describe(obj)
        return _UNCACHEABLE if marker is None else _TensorSlot()
    if obj is None or isinstance(obj, bool | int | float | str | torch.dtype | torch.device | torch.Size):
        return obj
    if isinstance(obj, tuple | list):
        items = [_template(x, describe) for x in obj]
        if any(x is _UNCACHEABLE for x in items):
            return _UNCACHEABLE
        return rebuild_like(obj, items)
    return _UNCACHEABLE


class _TensorSlot:
    """Placeholder for a tensor in a cached result structure."""


def _fill(obj: Any, make: Callable[[], torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSlot):
        return make()
    if isinstance(obj, tuple | list) and not isinstance(obj, torch.Size):
        return rebuild_like(obj, [_fill(x, make) for x in obj])
    return obj


def _rebuild_tensor(out: _Out, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    if out.kind == "input":
        return leaves[out.leaf]
    if out.kind == "view":
        src = leaves[out.leaf]
        return src.as_strided(out.shape, out.stride, src.storage_offset() + out.offset)
    t = torch.empty_strided(out.shape, out.stride, dtype=out.dtype, device=out.device)
    if out.requires_grad:
        # not a leaf, like the op's own output: later in-place ops on it must stay legal
        t = t.requires_grad_(True).clone()
    return t


def rebuild_like(obj: tuple | list, items: list[Any]) -> Any:
    """A list/tuple like `obj` holding `items`: named tuples and torch's structseqs (`torch.max(x, 1)`'s
    `(values, indices)`) keep their type, so `.values` still works downstream."""
    if isinstance(obj, list):
        return items
    if type(obj) is tuple or isinstance(obj, torch.Size):
        return tuple(items)
    if hasattr(obj, "_fields"):  # collections.namedtuple
        return type(obj)(*items)
    return type(obj)(items)  # structseq (torch.return_types.*)
