"""Helpers shared by the CLI commands: model, cluster, --set/--fix and output options, and safe output writing.

Everything here turns bad input into `UserError` (one line naming the bad value and the valid choices), so the
commands stay short and every command reports the same mistake the same way.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from costmodel.float8 import Float8Recipe, fp8_devices
from costmodel.hardware.cluster import Cluster
from planner.errors import UserError
from planner.trace_cache import TraceCache

DEFAULT_TIME_LIMIT_S = 60.0
"""The CLI's search time limit: a plan, or its proven gap, within a minute on any input (`--time-limit 0`: none)."""


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


def gap_percent(text: str) -> float:
    """argparse type for `--gap`: a percentage >= 0 and below 100."""
    value = percent(text)
    if value >= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage >= 0 and below 100, got {text}")
    return value


def time_limit(text: str) -> float:
    """argparse type for `--time-limit`: a finite number of seconds >= 0 (0: no limit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0 (0: no limit), got {text}")
    return value


def add_time_limit_argument(parser: argparse.ArgumentParser, *, per: str = "") -> None:
    parser.add_argument("--time-limit", type=time_limit, default=DEFAULT_TIME_LIMIT_S, metavar="SEC",
                        help=f"{per}stop searching after SEC seconds with the best plan found and its proven gap "
                             "(default %(default)g; 0: no limit)")


def time_limit_s(args: argparse.Namespace) -> float | None:
    """The search's time limit from `--time-limit` (None for 0: no limit)."""
    return args.time_limit or None


def time_limit_note(cut_short: bool, gap: float, limit_s: float | None) -> str | None:
    """The one line saying the time limit was reached (None when the search finished)."""
    if not cut_short or limit_s is None:
        return None
    return (f"stratagem: note: time limit of {limit_s:g} s reached; the plan is the best found, proven within "
            f"{100 * gap:.1f}% of the optimum (--time-limit 0 searches to the end)")


def add_trace_cache_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--trace-cache", default=None, metavar="DIR",
                       help="keep traced models in DIR (default: $STRATAGEM_CACHE_DIR/traces, else the user's "
                            "cache folder, e.g. ~/.cache/stratagem/traces)")
    group.add_argument("--no-trace-cache", action="store_true",
                       help="trace the model again and keep nothing")


def trace_cache(args: argparse.Namespace) -> TraceCache | None:
    """The trace cache the flags ask for (None with --no-trace-cache)."""
    if args.no_trace_cache:
        return None
    return TraceCache(Path(args.trace_cache).expanduser()) if args.trace_cache else TraceCache.default()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="zoo family or preset (see `stratagem models`) or package.module:factory")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override a model config field (repeatable)")
    parser.add_argument("--seq", type=positive_int, default=None, help="sequence length (default: the model's)")


def add_dtype_argument(parser: argparse.ArgumentParser, default: str | None = "bfloat16") -> None:
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=default,
                        help="training compute dtype: prices FLOPs at its peak and activations at its size "
                             "(default bfloat16; use float32 for CPU runs)")


def add_fp8_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fp8", nargs="?", const=Float8Recipe.TENSORWISE.value, default=None,
                        choices=[r.value for r in Float8Recipe], metavar="RECIPE",
                        help="train linear layers in FP8 (the output layer and MoE routers stay in the training "
                             "dtype): tensorwise or rowwise dynamic scaling as torchao runs it (torchtitan; default "
                             "tensorwise), or delayed: Transformer Engine's delayed scaling as Megatron-Core and "
                             "NeMo run it (priced and exported, not run here); needs FP8 tensor cores "
                             f"({', '.join(fp8_devices())})")


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
    from planner.tracing import trace_built

    try:
        return ir.build_layer_chain(trace_built(built, dtype=dtype))
    except UserError:
        raise
    except ValueError as e:
        raise UserError(f"cannot trace {built.name}: {_one_line(e)}") from None


def setting_text(value: Any) -> str:
    """A parsed `--set` value written back as the command line gives it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def plan_settings(plan: Any) -> tuple[list[str], int | None]:
    """The plan's model settings as `--set` texts, and its sequence length apart: a "seq" setting is `--seq`
    (a Hugging Face config has no `seq` key; `stratagem plan` keys its trace cache on `--seq`)."""
    sets = [f"{k}={setting_text(v)}" for k, v in plan.model.settings if k != "seq"]
    return sets, dict(plan.model.settings).get("seq")


def plan_model(plan: Any) -> tuple[Any, Any]:
    """The plan's model rebuilt from its name and settings and traced as `stratagem plan` traced it:
    (`BuiltModel`, `LayerChain`); a chain whose fingerprint is not the plan's is a user error."""
    import ir

    sets, seq = plan_settings(plan)
    built = build_model(plan.model.name, sets, seq=seq)
    chain = trace_chain(built, dtype=plan.training.dtype)
    if ir.fingerprint(chain.graph) != plan.model.fingerprint:
        raise UserError(f"the plan's model {plan.model.name} traces differently here (fingerprint "
                        f"{plan.model.fingerprint[:12]} expected); was it planned with another Stratagem version?")
    return built, chain


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


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, KeyError) and text.startswith("'") and text.endswith("'"):
        text = text[1:-1]
    return " ".join(text.split())
