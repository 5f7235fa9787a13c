"""The model registry: MODEL names and `--set key=value` strings -> a built model with example inputs.

MODEL is a zoo family ("gpt", "llama", ...: the family's default config), a preset ("gpt3-175b", ...),
"hf:ARCH" or "hf:path/to/config.json" for a Hugging Face transformers model (`models.hf`), or
"package.module:factory" for a user's own model. This module is the only entry to `models` for code outside it
(the planner, the CLI); tests, bench and scripts may import the zoo directly.

`--set` values are parsed to the config field's declared type (int, float, bool, str, enum, `X | None`,
`tuple[int, ...]` as comma-separated values) and validated by the config itself; every mistake is a
one-line `ModelError` naming the bad key or value and listing the valid ones.

A user factory is called with the `--set` values as keyword arguments (parsed by its annotations), plus
`batch` and `seq` when its signature names them; it returns an `nn.Module` or `(module, example_inputs)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import importlib
import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.family import Family
from models.layer_stack import TraceStandIn, stand_in_for
from models.validation import require_traceable_depth
from models.zoo import FAMILIES, PRESETS

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")
_NONE = ("none", "null")



class ModelError(Exception):
    """A bad model name, `--set` key or value, in one line naming it and the valid choices (the CLI exits 2)."""


Loss = Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]


class EntryKind(enum.StrEnum):
    FAMILY = "family"  # a family name: builds the family's default config
    PRESET = "preset"  # a named configuration of a family


@dataclass(frozen=True)
class BuiltModel:
    """A model ready to trace or train."""

    name: str
    """The MODEL string it was built from."""
    family: str
    """Zoo family, or "user" for package.module:factory models."""
    settings: tuple[tuple[str, Any], ...]
    """The overrides applied (from --set and --seq), parsed, sorted by key: with `name` they rebuild it."""
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    """Positional forward inputs for the requested batch (shape-only on the meta device)."""
    seq_len: int | None
    """Tokens per sample (None for models without a sequence)."""
    loss: Loss
    """`loss(output, inputs)`: the synthetic training loss (scalar)."""
    config: Any
    """The family's config dataclass (None for user models)."""
    trace_stand_in: Callable[[], TraceStandIn | None] | None = None
    """Builds a shorter model with the same repeating layers to trace in place of `module`
    (`models.layer_stack`), when the family can; None otherwise."""


@dataclass(frozen=True)
class ModelEntry:
    """One row of `stratagem models`."""

    name: str
    kind: EntryKind
    family: str
    params: int
    published_params: int | None
    description: str
    reference: str
    config: Any


def list_models() -> list[ModelEntry]:
    """Families (their default configs) then presets, in table order; parameter counts from closed forms."""
    entries = [
        ModelEntry(f.name, EntryKind.FAMILY, f.name, f.num_params(f.config_type()), None, f.description, "",
                   f.config_type())
        for f in FAMILIES.values()
    ]
    entries += [
        ModelEntry(p.name, EntryKind.PRESET, p.family, FAMILIES[p.family].num_params(p.config),
                   p.published_params, p.description, p.reference, p.config)
        for p in PRESETS.values()
    ]
    return entries


def resolve_config(name: str, sets: Sequence[str] = (), *, seq: int | None = None) -> tuple[Family, Any, dict]:
    """(family, config with overrides applied, the parsed overrides) for a zoo name, without building it."""
    family, base = _lookup(name)
    overrides = parse_settings(family.config_type, sets)
    if seq is not None:
        if family.seq_field is None:
            of = "" if name == family.name else f" ({family.name})"
            raise ModelError(f"model {name}{of} has no free sequence length; --seq does not apply")
        if overrides.get(family.seq_field, seq) != seq:
            raise ModelError(f"--seq {seq} contradicts --set {family.seq_field}={overrides[family.seq_field]}")
        overrides[family.seq_field] = _check_positive("--seq", seq)
    try:
        config = dataclasses.replace(base, **overrides)
        require_traceable_depth(_num_layers(config))
    except ValueError as e:
        raise ModelError(f"model {name}: {e}") from None
    return family, config, overrides


def _num_layers(config: Any) -> int:
    """The layers a zoo config builds: its fields `layers`, `*_layers` and `depths` (per-stage counts)."""
    total = 0
    for f in dataclasses.fields(config):
        if f.name in ("layers", "depths") or f.name.endswith("_layers"):
            value = getattr(config, f.name)
            total += sum(value) if isinstance(value, tuple) else (value or 0)
    return total


def build_model(
    name: str,
    sets: Sequence[str] = (),
    *,
    batch: int = 1,
    seq: int | None = None,
    device: str = "meta",
) -> BuiltModel:
    """Build MODEL with `--set` overrides on `device`, with example inputs of `batch` samples."""
    _check_positive("batch", batch)
    torch_device = _device(device)
    if name.startswith(HF_PREFIX):  # Hugging Face transformers models (models/hf.py)
        return build_hf_model(name, sets, batch=batch, seq=seq, device=torch_device)
    if ":" in name:
        return _build_user_model(name, sets, batch=batch, seq=seq, device=torch_device)
    family, config, overrides = resolve_config(name, sets, seq=seq)
    try:
        module = family.build(config, torch_device)
        inputs = family.example_inputs(config, batch, None, torch_device)
    except ValueError as e:
        raise ModelError(f"model {name}: {e}") from None
    return BuiltModel(
        name=name,
        family=family.name,
        settings=tuple(sorted(overrides.items())),
        module=module,
        example_inputs=inputs,
        seq_len=family.sequence_length(config),
        loss=family.loss,
        config=config,
        trace_stand_in=functools.partial(_zoo_stand_in, family, config, module, batch=batch),
    )


def _zoo_stand_in(family: Family, config: Any, module: nn.Module, *, batch: int) -> TraceStandIn | None:
    """A shorter model of a zoo config whose `layers` repeat (`models.layer_stack`), on the meta device (a trace
    needs no weights), to trace in its place."""
    if not isinstance(getattr(config, "layers", None), int):
        return None

    def rebuild(cut: dict[str, Any]) -> tuple[nn.Module, Any, tuple[torch.Tensor, ...]]:
        short = dataclasses.replace(config, **cut)
        return family.build(short, "meta"), short, family.example_inputs(short, batch, None, "meta")

    return stand_in_for(module, config, config.layers, "layers", rebuild)


def parse_settings(config_type: type, sets: Sequence[str]) -> dict[str, Any]:
    """`["key=value", ...]` -> {field: parsed value} for a config dataclass (validation happens on replace)."""
    hints = typing.get_type_hints(config_type)
    fields = [f.name for f in dataclasses.fields(config_type)]
    return _parse_pairs(sets, hints, fields, owner=config_type.__name__)


def _lookup(name: str) -> tuple[Family, Any]:
    if name in FAMILIES:
        family = FAMILIES[name]
        return family, family.config_type()
    if name in PRESETS:
        preset = PRESETS[name]
        return FAMILIES[preset.family], preset.config
    known = [*FAMILIES, *PRESETS]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ModelError(
        f"unknown model {name!r}{hint}; families: {', '.join(FAMILIES)}; presets: {', '.join(PRESETS)}; "
        "or package.module:factory"
    )


def _parse_pairs(
    sets: Sequence[str], hints: Mapping[str, Any], valid: Sequence[str], *, owner: str
) -> dict[str, Any]:
    parsed: dict[str, Any] = {}
    for item in sets:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ModelError(f"--set {item!r}: expected KEY=VALUE")
        if key not in valid:
            raise ModelError(f"--set {key}: unknown setting for {owner}; valid keys: {', '.join(sorted(valid))}")
        if key in parsed:
            raise ModelError(f"--set {key} given twice")
        parsed[key] = _parse_value(key, raw.strip(), hints.get(key, str))
    return parsed


def _parse_value(key: str, raw: str, hint: Any) -> Any:
    """Parse `raw` as the annotated type `hint`; a ModelError names the key, the value and what is valid."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and raw.lower() in _NONE:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _parse_value(key, raw, options[0])
        raise ModelError(f"--set {key}: cannot parse a value of type {hint}")
    if origin is typing.Literal:
        choices = [str(a) for a in args]
        if raw not in choices:
            raise ModelError(f"--set {key}={raw}: not one of {', '.join(choices)}")
        return args[choices.index(raw)]
    if origin is tuple:
        item = args[0] if args else str
        parts = [p.strip() for p in raw.split(",") if p.strip()]
        if not parts:
            raise ModelError(f"--set {key}: expected comma-separated values, got {raw!r}")
        return tuple(_parse_value(key, p, item) for p in parts)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw)
        except ValueError:
            raise ModelError(
                f"--set {key}={raw}: not one of {', '.join(str(m.value) for m in hint)}"
            ) from None
    if hint is bool:
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ModelError(f"--set {key}={raw}: expected a boolean (true/false)")
    if hint in (int, float):
        try:
            return hint(raw)
        except ValueError:
            raise ModelError(f"--set {key}={raw}: expected {'an integer' if hint is int else 'a number'}") from None
    return raw


def _check_positive(what: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelError(f"{what} must be a positive integer, got {value!r}")
    return value


def _device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelError(f"unknown device {device!r}; e.g. meta, cpu, cuda, cuda:0") from None


def _load_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelError(f"model {spec!r}: expected package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelError(f"model {spec}: cannot import {module_name}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model {spec}: {module_name} has no callable {attr!r}")
    return factory


def _build_user_model(
    spec: str, sets: Sequence[str], *, batch: int, seq: int | None, device: torch.device
) -> BuiltModel:
    factory = _load_factory(spec)
    params = inspect.signature(factory).parameters
    try:
        hints = typing.get_type_hints(factory)
    except (NameError, TypeError):
        hints = {}
    settable = [p for p in params if p not in ("batch", "seq")]
    kwargs = _parse_pairs(sets, hints, settable, owner=spec)
    settings = tuple(sorted(kwargs.items()))
    if "batch" in params:
        kwargs["batch"] = batch
    if seq is not None:
        if "seq" not in params:
            raise ModelError(f"model {spec}: the factory takes no `seq` argument, so --seq does not apply")
        kwargs["seq"] = seq
        settings = tuple(sorted([*settings, ("seq", seq)]))
    try:
        with device:
            result = factory(**kwargs)
    except (TypeError, ValueError) as e:
        raise ModelError(f"model {spec}: the factory failed: {e}") from None
    module, inputs = result if isinstance(result, tuple) else (result, ())
    if not isinstance(module, nn.Module):
        raise ModelError(f"model {spec}: the factory returned {type(module).__name__}, expected an nn.Module "
                        "or (module, example_inputs)")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return BuiltModel(spec, "user", settings, module, inputs, seq, _mean_square_loss, None)


def _mean_square_loss(output: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Synthetic loss for a user model: mean square of its (first) output, which reaches every parameter
    that the output depends on."""
    if isinstance(output, (tuple, list)):
        output = output[0]
    elif isinstance(output, dict):
        output = next(iter(output.values()))
    return output.float().pow(2).mean()


# ---- hf:ARCH and hf:path/to/config.json ----------------------------------------------------------------------
#
# `--set key=value` sets any field of the transformers config class, parsed with the field's declared type
# (structured fields -- dicts, lists, unions -- take JSON); unknown keys, bad values and a missing transformers
# install are one-line `ModelError`s.

HF_PREFIX = "hf:"


def is_hf_name(name: str) -> bool:
    return name.startswith(HF_PREFIX)


def build_hf_model(name: str, sets: Sequence[str], *, batch: int, seq: int | None, device: torch.device) -> BuiltModel:
    """Build `hf:SPEC` with `--set` overrides and `batch` example samples of `seq` tokens on `device`."""
    spec = name[len(HF_PREFIX):]
    if not spec:
        raise ModelError(f"model {name!r}: expected hf:ARCH or hf:path/to/config.json")
    try:
        from models import hf
    except ImportError as e:  # models.hf itself imports nothing optional; keep the message if that changes
        raise ModelError(f"model {name}: {e}") from None
    if seq is not None:
        _check_positive("--seq", seq)
    try:
        hints = hf.setting_types(spec)
        overrides = _parse_hf_pairs(sets, hints, owner=name)
        built = hf.build(spec, overrides, batch=batch, seq=seq, device=device)
    except ImportError as e:
        raise ModelError(f"model {name}: {e}") from None
    except ValueError as e:
        raise ModelError(f"model {name}: {' '.join(str(e).split())}") from None
    settings = dict(overrides)
    if seq is not None:
        settings["seq"] = seq
    return BuiltModel(
        name=name,
        family="hf",
        settings=tuple(sorted(settings.items())),
        module=built.module,
        example_inputs=built.example_inputs,
        seq_len=built.seq_len,
        loss=built.loss,
        config=built.config,
        trace_stand_in=functools.partial(hf.trace_stand_in, spec, overrides, built, batch=batch),
    )


def _parse_hf_pairs(sets: Sequence[str], hints: dict[str, Any], *, owner: str) -> dict[str, Any]:
    from models.hf import Json

    plain = {k: (str if v is Json else v) for k, v in hints.items()}
    parsed = _parse_pairs(sets, plain, sorted(hints), owner=owner)
    return {k: (_parse_json(k, v) if hints[k] is Json else v) for k, v in parsed.items()}


def _parse_json(key: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        if raw.lower() in ("none", "null"):
            return None
        # A bare word is a string (e.g. --set hidden_act=gelu on a field typed `str | Callable`).
        return _parse_value(key, raw, str)
