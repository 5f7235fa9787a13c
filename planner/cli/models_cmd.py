"""`stratagem models [--json]`: the model zoo's families and presets with their parameter counts.

Counts come from each family's closed form (no model is built), so the listing is instant even for the
trillion-parameter presets; tests check every closed form against the built model on the meta device.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from models.registry import ModelEntry


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("models", help="list the model zoo: families and presets with parameter counts",
                              description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--json", action="store_true", help="print the zoo as JSON, with every default config")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from models.registry import list_models  # the zoo imports torch: only this command pays for it

    entries = list_models()
    if args.json:
        print(json.dumps({"models": [entry_json(e) for e in entries]}, indent=2))
    else:
        print(format_table(entries))
    return 0


def entry_json(entry: ModelEntry) -> dict[str, Any]:
    return {
        "name": entry.name,
        "kind": entry.kind.value,
        "family": entry.family,
        "params": entry.params,
        "published_params": entry.published_params,
        "description": entry.description,
        "reference": entry.reference,
        "config": {f.name: _jsonable(getattr(entry.config, f.name)) for f in dataclasses.fields(entry.config)},
    }


def format_table(entries: list[ModelEntry]) -> str:
    header = ("NAME", "KIND", "FAMILY", "PARAMS", "PUBLISHED", "DESCRIPTION")
    rows = [
        (e.name, e.kind.value, e.family, human_count(e.params),
         human_count(e.published_params) if e.published_params is not None else "-", e.description)
        for e in entries
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def human_count(n: int) -> str:
    """124439808 -> "124.4M", 174615846912 -> "174.6B", 1008038758400 -> "1.01T"."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.3g}{unit}" if value < 10 else f"{value:.1f}{unit}"
    return str(n)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    return value
