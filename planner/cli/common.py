"""Helpers shared by the CLI commands: model, cluster, --set/--fix and output options, and safe output writing.

Everything here turns bad input into `UserError` (one line naming the bad value and the valid choices), so the
commands stay short and every command reports the same mistake the same way.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from costmodel.hardware.cluster import Cluster
from planner.errors import UserError


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def percent(text: str) -> float:
    """argparse type for a percentage (`--fail-on-regression`, `--stickiness`): finite and >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0, got {text}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="zoo family or preset (see `stratagem models`) or package.module:factory")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model config field (repeatable)")
    parser.add_argument("--seq", type=positive_int, default=None, help="sequence length (default: the model's)")


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="training compute dtype: prices FLOPs at its peak and activations at its size "
                             "(default bfloat16; use float32 for CPU runs)")


def add_cluster_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, metavar="SPEC",
                        help="NODESxGPUSxDEVICE (e.g. 128x8xa100-80gb, 1x4xcpu) or a cluster YAML file")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", default=None, metavar="FILE", help="write the plan JSON to FILE")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="profile from `stratagem profile`: its measured op times replace the analytical ones "
                             "and its collective fits calibrate the links inside a node")


def parse_cluster(spec: str) -> Cluster:
    """`Cluster.parse` with its ValueError / missing-file errors turned into one-line user errors."""
    try:
        return Cluster.parse(spec)
    except UserError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"--cluster {spec}: {_one_line(e)}") from None
    except OSError as e:
        raise UserError(f"--cluster {spec}: cannot read it: {e.strerror or e}") from None


def build_model(name: str, sets: Sequence[str], *, seq: int | None, batch: int = 1) -> Any:
    """The registry's `BuiltModel` on the meta device, with a traced batch of `batch`."""
    from models.registry import build_model as registry_build

    try:
        return registry_build(name, sets, batch=batch, seq=seq, device="meta")
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"model {name}: {_one_line(e)}") from None


def trace_chain(built: Any, *, dtype: str = "bfloat16") -> Any:
    """Trace a `BuiltModel` into a `LayerChain` in the training dtype (trace errors become user errors).

    The dtype matters: activation, boundary and saved bytes are priced from the traced tensors.
    """
    import ir

    try:
        graph = ir.trace(built.module, built.example_inputs, model_name=built.name, dtype=dtype)
        return ir.build_layer_chain(graph)
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"cannot trace {built.name}: {_one_line(e)}") from None


def input_paths(*candidates: str | None) -> tuple[Path, ...]:
    """Paths of the command's input files that exist (a cluster YAML, a plan JSON), for `check_output_path`."""
    return tuple(Path(c) for c in candidates if c and Path(c).is_file())


def check_output_path(path: str, inputs: Sequence[Path] = (), *, flag: str = "-o") -> Path:
    """Validate an output path before doing any work: never an input file, never a directory, writable folder.

    Writability is tried, not inferred from permission bits: root passes every `os.access` check, yet cannot
    write into /proc or a read-only mount."""
    out = Path(path)
    for src in inputs:
        if out.exists() and src.exists() and os.path.samefile(out, src):
            raise UserError(f"{flag} {path} is an input file of this command; refusing to overwrite it")
    if out.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"{flag} {path}: folder {parent} does not exist")
    if out.exists() and not os.access(out, os.W_OK):
        raise UserError(f"{flag} {path}: not writable")
    try:
        with tempfile.NamedTemporaryFile(prefix=f".{out.name}.", dir=parent):
            pass
    except OSError as e:
        raise UserError(f"{flag} {path}: not writable ({e.strerror or e})") from None
    return out


def write_text(path: Path, text: str) -> None:
    """Write atomically (temporary file in the same folder, then rename) so a failed write leaves no half file."""
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {e.strerror or e}") from None


def progress_printer(stream: Any = None) -> Callable[[int, int, float | None], None] | None:
    """A one-line progress indicator on stderr, only when stderr is a terminal (never in pipes or CI logs)."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, total: int, best_s: float | None) -> None:
        best = f", best {best_s:.4g} s" if best_s is not None else ""
        stream.write(f"\rsearching: {done}/{total} candidates{best}   ")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError) and text.startswith("'") and text.endswith("'"):
        text = text[1:-1]
    return " ".join(text.split())
