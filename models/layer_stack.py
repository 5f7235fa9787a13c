"""Which layers of a model repeat, proven on its modules, so that tracing can stop after two periods.

The planner's `ir.layer_repeat` builds the graph of L layers from the trace of a model with T < L layers built
from the same config. That is only right if layer i of the full model does what layer i - p does for every i past
a prefix P. This module decides it from the modules themselves, not from a list of architectures:

- the layer stack is the `nn.ModuleList` of exactly L elements (the config's layer count);
- a layer's signature is, for the layer and every submodule, its relative name, class and plain attributes
  (scalars and tuples of them: window sizes, head counts, flags such as `is_sliding` or `use_rope`), plus every
  parameter's name, shape and dtype; attributes that only number the layer (`LAYER_INDEX_ATTRS`) are left out;
- per-layer config entries that a forward may read by layer index join the signature: a list field of length L
  contributes its i-th entry (`layer_types`), a strictly increasing list of layer indices its membership of i
  (`mlp_only_layers`, `moe_layers`).

`periodic_stack` picks the prefix and period that need the fewest traced layers; the stand-in model is built from
the config with the layer count and per-layer lists cut to T, and is used only if its T layers have the
signatures of the full model's first T (`stand_in_for`): a config whose cut changes a layer is traced whole.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

LAYER_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
"""Module attributes that number a layer rather than shape it (transformers: `layer_idx`; Megatron:
`layer_number`). A forward reads them only to look up per-layer config entries, which the signature holds."""

MAX_PERIOD = 64
"""Longest layer pattern searched for (Gemma 3 repeats every 6 layers, Qwen3-Next every 4)."""

_SCALARS = (int, float, str, bool, type(None), enum.Enum, torch.dtype)
_NOT_PLAIN = object()


def _plain(value: Any) -> Hashable:
    """A scalar attribute, or a tuple / list of them (a window pair, per-head sizes), as a hashable value;
    `_NOT_PLAIN` for anything else (tensors, modules, callables, configs)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, tuple | list):
        items = tuple(_plain(v) for v in value)
        return _NOT_PLAIN if any(i is _NOT_PLAIN for i in items) else (type(value).__name__, items)
    return _NOT_PLAIN


@dataclass(frozen=True)
class LayerPattern:
    """A stack of `total` layers at module path `path`: `prefix` distinct layers, then layers repeating with
    `period`."""

    path: str
    total: int
    prefix: int
    period: int

    def __post_init__(self) -> None:
        if not (0 <= self.prefix < self.total and self.period >= 1):
            raise ValueError(f"bad layer pattern {self}")

    @property
    def lead(self) -> int:
        """Layers before the two periods the trace is checked on: the prefix, and at least one, because the
        first layer of a stack reads the embedding where every later layer reads the layer before it."""
        return max(self.prefix, 1)

    @property
    def traced(self) -> int:
        """Layers of the stand-in: the lead, two periods, and the remainder that gives the last layer its type."""
        return self.lead + 2 * self.period + (self.total - self.lead) % self.period

    @property
    def saves_layers(self) -> bool:
        return self.traced < self.total


@dataclass(frozen=True)
class TraceStandIn:
    """A model with the first `stack.traced` layers of a deeper one, to trace in its place."""

    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    pattern: LayerPattern
    added_params: int
    """Parameters of the full model's layers the stand-in lacks: what `ir.repeat_layers` must add."""


def find_layer_stack(module: nn.Module, num_layers: int) -> tuple[str, nn.ModuleList] | None:
    """The one `nn.ModuleList` of `num_layers` elements (path, list), or None when there is none or several."""
    found = [(name, sub) for name, sub in module.named_modules()
             if isinstance(sub, nn.ModuleList) and len(sub) == num_layers]
    return found[0] if len(found) == 1 else None


def layer_signatures(layers: Sequence[nn.Module], config: Any) -> list[Hashable]:
    """One hashable signature per layer (module docstring)."""
    per_layer = config_entries(config, len(layers))
    return [(_module_signature(layer), per_layer[i]) for i, layer in enumerate(layers)]


def config_entries(config: Any, num_layers: int) -> list[tuple[tuple[str, str], ...]]:
    """Per layer, the config entries indexed by layer: i-th entries of length-L lists, membership of index lists."""
    entries: list[list[tuple[str, str]]] = [[] for _ in range(num_layers)]
    for key, value, is_index in _per_layer_fields(config, num_layers):
        members = set(value) if is_index else set()
        for i in range(num_layers):
            entries[i].append((key, ("in" if i in members else "out") if is_index else repr(value[i])))
    return [tuple(e) for e in entries]


def _per_layer_fields(config: Any, num_layers: int) -> list[tuple[str, Sequence[Any], bool]]:
    """The config's list fields that a layer index reads, by name: (name, value, whether it lists layer indices --
    `mlp_only_layers` -- rather than holding one entry per layer -- `layer_types`)."""
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    out = []
    for key in sorted(fields):
        value = fields[key]
        if not isinstance(value, list | tuple):
            continue
        if _is_index_list(value, num_layers):
            out.append((key, value, True))
        elif len(value) == num_layers:
            out.append((key, value, False))
    return out


def _is_index_list(value: Sequence[Any], num_layers: int) -> bool:
    ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return (len(ints) == len(value) and all(0 <= v < num_layers for v in ints)
            and all(a < b for a, b in zip(ints, ints[1:], strict=False)))


def _module_signature(layer: nn.Module) -> Hashable:
    parts: list[Hashable] = []
    for name, sub in layer.named_modules():
        attrs = tuple(sorted((k, plain) for k, v in vars(sub).items()
                             if not k.startswith("_") and k not in LAYER_INDEX_ATTRS
                             and (plain := _plain(v)) is not _NOT_PLAIN))
        parts.append((name, type(sub).__qualname__, attrs))
    parts.extend((name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in layer.named_parameters())
    return tuple(parts)


def periodic_stack(path: str, signatures: Sequence[Hashable]) -> LayerPattern | None:
    """The prefix and period (at most `MAX_PERIOD`) under which `signatures` repeat with the fewest traced
    layers, or None when no choice traces fewer layers than there are."""
    ids = _class_ids(signatures)
    total = len(ids)
    best: LayerPattern | None = None
    for period in range(1, min(MAX_PERIOD, total // 2) + 1):
        breaks = [i for i in range(period, total) if ids[i] != ids[i - period]]
        prefix = breaks[-1] - period + 1 if breaks else 0
        stack = LayerPattern(path=path, total=total, prefix=prefix, period=period)
        if stack.saves_layers and (best is None or stack.traced < best.traced):
            best = stack
    return best


def _class_ids(signatures: Iterable[Hashable]) -> list[int]:
    seen: dict[Hashable, int] = {}
    return [seen.setdefault(s, len(seen)) for s in signatures]


def cut_config_lists(config: Any, num_layers: int, keep: int) -> dict[str, Any]:
    """Overrides that cut the per-layer list fields of `config` (L entries; indices below L) to `keep` layers."""
    return {key: type(value)(v for v in value if v < keep) if is_index else value[:keep]
            for key, value, is_index in _per_layer_fields(config, num_layers)}


def parameter_count(layers: Iterable[nn.Module]) -> int:
    return sum(p.numel() for layer in layers for p in layer.parameters())


def stand_in_for(module: nn.Module, config: Any, num_layers: int, layers_key: str,
                 rebuild: Callable[[dict[str, Any]], tuple[nn.Module, Any, tuple[torch.Tensor, ...]]],
                 ) -> TraceStandIn | None:
    """A stand-in for `module` (built from `config`, `num_layers` layers) when its layers repeat, or None.

    `rebuild(overrides)` builds the model again from the same config with `overrides` (the layer count under
    `layers_key` and the cut per-layer lists) and returns (module, config, example inputs); a ValueError from it
    means the config refuses the cut, and the model is traced whole.
    """
    found = find_layer_stack(module, num_layers)
    if found is None:
        return None
    path, layers = found
    signatures = layer_signatures(layers, config)
    pattern = periodic_stack(path, signatures)
    if pattern is None:
        return None
    try:
        short_module, short_config, inputs = rebuild(
            {**cut_config_lists(config, num_layers, pattern.traced), layers_key: pattern.traced})
    except ValueError:
        return None
    short = find_layer_stack(short_module, pattern.traced)
    if short is None or short[0] != path or layer_signatures(short[1], short_config) != signatures[:pattern.traced]:
        return None
    return TraceStandIn(module=short_module, example_inputs=inputs, pattern=pattern,
                        added_params=parameter_count(layers[pattern.traced:]))
