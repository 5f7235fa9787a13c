"""The model registry's `hf:` branch: `hf:ARCH` or `hf:path/to/config.json` -> a `BuiltModel` (see `models.hf`).

`--set key=value` sets any field of the transformers config class, parsed with the field's declared type
(structured fields -- dicts, lists, unions -- take JSON); unknown keys, bad values and a missing transformers
install are one-line `UserError`s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from models.registry import BuiltModel, _check_positive, _parse_pairs, _parse_value
from planner.errors import UserError

PREFIX = "hf:"


def is_hf_name(name: str) -> bool:
    return name.startswith(PREFIX)


def build_hf_model(name: str, sets: Sequence[str], *, batch: int, seq: int | None, device: torch.device) -> BuiltModel:
    """Build `hf:SPEC` with `--set` overrides and `batch` example samples of `seq` tokens on `device`."""
    spec = name[len(PREFIX):]
    if not spec:
        raise UserError(f"model {name!r}: expected hf:ARCH or hf:path/to/config.json")
    try:
        from models import hf
    except ImportError as e:  # models.hf itself imports nothing optional; keep the message if that changes
        raise UserError(f"model {name}: {e}") from None
    if seq is not None:
        _check_positive("--seq", seq)
    try:
        hints = hf.setting_types(spec)
        overrides = _parse_hf_pairs(sets, hints, owner=name)
        built = hf.build(spec, overrides, batch=batch, seq=seq, device=device)
    except ImportError as e:
        raise UserError(f"model {name}: {e}") from None
    except ValueError as e:
        raise UserError(f"model {name}: {' '.join(str(e).split())}") from None
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
