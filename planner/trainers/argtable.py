"""The pinned releases' command-line arguments (planner/trainers/data/*_arguments.json), as an argparse parser.

The tables are extracted from the trainers' own source by scripts/extract_trainer_args.py (the provenance --
repository, tag, commit, file -- is in each table). Parsing an argument file with the rebuilt parser reads it
as the trainer would: the same flags, value counts, types and choices, and every unstated flag at the release's
default.
"""

from __future__ import annotations

import argparse
import difflib
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from planner.errors import UserError

DATA = Path(__file__).resolve().parent / "data"
_TYPES = {"int": int, "float": float, "str": str, None: None}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # the trainer's own usage errors become one-line user errors
        raise UserError(message)


@dataclass(frozen=True)
class ArgTable:
    """One trainer release's arguments."""

    name: str
    provenance: dict[str, Any]
    arguments: tuple[dict[str, Any], ...]

    @property
    def release(self) -> str:
        p = self.provenance
        ref = p.get("tag") or (p.get("commit") or "")[:12]
        return f"{p['trainer']} {ref}".strip()

    @property
    def flags(self) -> frozenset[str]:
        return frozenset(f for a in self.arguments for f in a["flags"])

    def parser(self) -> argparse.ArgumentParser:
        parser = _Parser(prog=self.provenance["trainer"], allow_abbrev=False, add_help=False)
        for a in self.arguments:
            _add(parser, a)
        return parser

    def parse(self, tokens: Sequence[str], *, source: str) -> argparse.Namespace:
        """The arguments as the trainer reads them; an unknown flag is a UserError naming the closest real one."""
        known = self.flags
        for tok in tokens:
            flag = tok.split("=", 1)[0]
            if flag.startswith("--") and flag not in known:
                close = difflib.get_close_matches(flag, sorted(known), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise UserError(f"{source}: {flag} is not an argument of {self.release}{hint}")
        try:
            return self.parser().parse_args(list(tokens))
        except UserError as e:
            raise UserError(f"{source}: {e}") from None


def _add(parser: argparse.ArgumentParser, a: dict[str, Any]) -> None:
    kind, flags, dest = a["kind"], a["flags"], a["dest"]
    if kind == "storetrue":
        parser.add_argument(*flags, dest=dest, action="store_true", default=bool(a["default"]))
    elif kind == "storefalse":
        parser.add_argument(*flags, dest=dest, action="store_false",
                            default=True if a["default"] is None else a["default"])
    elif kind == "storeconst":
        parser.add_argument(*flags, dest=dest, action="store_const", const=True, default=a["default"])
    else:
        nargs = a["nargs"] if a["nargs"] not in (0,) else None
        kwargs: dict[str, Any] = {"dest": dest, "default": _default(a), "type": _TYPES.get(a["type"], str)}
        if nargs is not None:
            kwargs["nargs"] = nargs
        if a["choices"] is not None and a["type"] in ("int", "float", "str"):
            kwargs["choices"] = a["choices"]
        parser.add_argument(*flags, action="append" if kind == "append" else "store", **kwargs)


def _default(a: dict[str, Any]) -> Any:
    """The default, or None where the table kept only its source text (`2 ** 32`): argparse would convert it."""
    default = a["default"]
    if isinstance(default, str) and a["type"] in ("int", "float"):
        try:
            return _TYPES[a["type"]](default)
        except ValueError:
            return None
    return default


@cache
def load_table(name: str) -> ArgTable:
    """`megatron_lm` or `megatron_deepspeed`."""
    data = json.loads((DATA / f"{name}_arguments.json").read_text(encoding="utf-8"))
    return ArgTable(name=name, provenance=data["provenance"], arguments=tuple(data["arguments"]))


def argument_tokens(text: str, *, source: str) -> list[str]:
    """The `--flag value` tokens of an argument file or launch script.

    Accepted: one argument per line or all on one line, `#` comments, backslash continuations, a launcher and
    script before the arguments (`torchrun ... pretrain_gpt.py --tensor-model-parallel-size 8 ...`: everything up
    to the last `*.py` is dropped), bash arrays (`GPT_ARGS=( ... )`). Shell variables are not expanded: a
    `$VAR` value of a flag that needs a number is the trainer's own "invalid int value" error."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as e:
        raise UserError(f"{source}: cannot split into arguments: {e}") from None
    scripts = [i for i, t in enumerate(tokens) if t.endswith(".py")]
    if scripts:
        tokens = tokens[scripts[-1] + 1:]
    out: list[str] = []
    for tok in tokens:
        if tok in ("(", ")") or tok.endswith("=(") or (tok.endswith("=") and not tok.startswith("-")):
            continue
        if tok.startswith("-") or out:
            out.append(tok.rstrip(")") if tok.endswith(")") and not tok.startswith("(") else tok)
    return out
