"""`stratagem` command line: one sub-command per module in this package, each with `register(subparsers)`.

Exit codes: 0 success, 2 a user error (`UserError`, or `ModelError` from the model registry: one line on
stderr, no traceback), 1 an internal error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from models.registry import ModelError
from planner.errors import UserError

# Each module defines `register(subparsers) -> None`, which adds its parser with `set_defaults(func=...)`;
# `func(args) -> int` runs the command.
COMMAND_MODULES: tuple[str, ...] = (
    "planner.cli.models_cmd",
    "planner.cli.trace_cmd",
    "planner.cli.plan_cmd",
    "planner.cli.estimate_cmd",
    "planner.cli.explain_cmd",
    "planner.cli.diff_cmd",
    "planner.cli.run_cmd",
    "planner.cli.profile_cmd",
    "planner.cli.replan_cmd",
    "planner.cli.whatif_cmd",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own usage errors: keep them one line, exit 2
        raise UserError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="stratagem", description="Parallelization-strategy planner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except (UserError, ModelError) as e:
        print(f"stratagem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stratagem: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
