"""Extract the command-line argument tables of Megatron-LM and Megatron-DeepSpeed into planner/trainers/data/.

Neither trainer's argument parser ships in a package on PyPI (megatron-core has no `megatron.training`;
Megatron-DeepSpeed is not published), so `stratagem export` and `--from` read a table of the pinned release's
arguments (names, nargs, types, choices, defaults), extracted here from the release's own source:

    python scripts/extract_trainer_args.py megatron-lm --src MEGATRON_LM_CHECKOUT --tag core_v0.16.1
    python scripts/extract_trainer_args.py megatron-deepspeed --src MEGATRON_DEEPSPEED_CHECKOUT

Megatron-LM's parser is built by running the release's `megatron.training.arguments.add_megatron_arguments` (it
generates part of its flags from megatron-core dataclasses, so reading the source would miss them): the checkout's
`megatron/` is put on the path with megatron-core of the same version installed (`pip install --no-deps
megatron-core==0.16.1 six triton`). Megatron-DeepSpeed's flags are plain `add_argument` calls in
megatron/arguments.py and are read from its syntax tree; DeepSpeed's own `--deepspeed`/`--deepspeed_config` come
from `deepspeed.add_config_arguments` when deepspeed is installed.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "planner" / "trainers" / "data"


def _kind(action: argparse.Action) -> str:
    return type(action).__name__.strip("_").removesuffix("Action").lower() or "store"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def action_row(action: argparse.Action) -> dict[str, Any]:
    typ = getattr(action.type, "__name__", None) if action.type is not None else None
    return {"flags": list(action.option_strings), "dest": action.dest, "kind": _kind(action),
            "nargs": action.nargs if action.nargs is None or isinstance(action.nargs, str) else int(action.nargs),
            "type": typ if typ in ("int", "float", "str") else ("str" if typ else None),
            "choices": [_jsonable(c) for c in action.choices] if action.choices is not None else None,
            "default": _jsonable(action.default)}


def megatron_lm(src: Path, tag: str, git_dir: Path) -> dict[str, Any]:
    sys.path.insert(0, str(src))
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", f"{tag}^{{commit}}"], capture_output=True,
                            text=True, check=False).stdout.strip() or None
    import megatron.core

    rows = [action_row(a) for a in parser._actions if a.option_strings and a.dest != "help"]
    return {"provenance": {"trainer": "Megatron-LM", "repository": "NVIDIA/Megatron-LM", "tag": tag,
                           "commit": commit, "file": "megatron/training/arguments.py",
                           "function": "add_megatron_arguments",
                           "megatron_core": getattr(megatron.core, "__version__", None),
                           "extracted_by": "scripts/extract_trainer_args.py megatron-lm"},
            "arguments": rows}


def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        return ast.unparse(node)


def _ast_row(call: ast.Call) -> dict[str, Any] | None:
    flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
             and a.value.startswith("-")]
    if not flags:
        return None
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    action = _literal(kw.get("action")) or "store"
    typ = kw.get("type")
    type_name = typ.id if isinstance(typ, ast.Name) else (None if typ is None else "str")
    dest = _literal(kw.get("dest")) or flags[-1].lstrip("-").replace("-", "_")
    kind = {"store_true": "storetrue", "store_false": "storefalse", "store_const": "storeconst",
            "append": "append"}.get(action, "store")
    nargs = _literal(kw.get("nargs"))
    choices = _literal(kw.get("choices"))
    return {"flags": flags, "dest": dest, "kind": kind, "nargs": nargs,
            "type": type_name if type_name in ("int", "float", "str", None) else "str",
            "choices": choices if isinstance(choices, list) else None, "default": _literal(kw.get("default"))}


def megatron_deepspeed(src: Path, git_dir: Path) -> dict[str, Any]:
    path = src / "megatron" / "arguments.py"
    tree = ast.parse(path.read_text())
    rows = [r for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument" and (r := _ast_row(node)) is not None]
    try:
        import deepspeed

        parser = argparse.ArgumentParser()
        deepspeed.add_config_arguments(parser)
        rows += [action_row(a) for a in parser._actions if a.option_strings and a.dest != "help"]
        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = None
    commit = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or None
    rows.sort(key=lambda r: r["flags"][0])
    return {"provenance": {"trainer": "Megatron-DeepSpeed", "repository": "microsoft/Megatron-DeepSpeed",
                           "commit": commit, "file": "megatron/arguments.py",
                           "deepspeed_add_config_arguments": ds_version,
                           "extracted_by": "scripts/extract_trainer_args.py megatron-deepspeed"},
            "arguments": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trainer", choices=("megatron-lm", "megatron-deepspeed"))
    ap.add_argument("--src", type=Path, required=True, help="a checkout of the trainer's repository")
    ap.add_argument("--tag", default="core_v0.16.1", help="Megatron-LM release tag of the checkout")
    ap.add_argument("--git-dir", type=Path, default=None, help="the repository's git directory (default SRC/.git)")
    args = ap.parse_args(argv)
    git_dir = args.git_dir or args.src / ".git"
    table = (megatron_lm(args.src, args.tag, git_dir) if args.trainer == "megatron-lm"
             else megatron_deepspeed(args.src, git_dir))
    out = OUT / f"{args.trainer.replace('-', '_')}_arguments.json"
    out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: {len(table['arguments'])} arguments")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
