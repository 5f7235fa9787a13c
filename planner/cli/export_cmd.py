"""`stratagem export PLAN.json --to torchtitan|megatron|deepspeed|megatron-deepspeed [-o FILE]`: the plan as that
trainer's configuration.

torchtitan: a JobConfig TOML; megatron: Megatron-LM arguments, one per line (`pretrain_gpt.py $(grep -v '^#'
FILE)`); deepspeed: the DeepSpeed JSON config; megatron-deepspeed: Megatron-DeepSpeed arguments naming that JSON.
What the trainer cannot express exactly is a warning on stderr (`--strict` makes it an error, exit 2); what it
cannot express at all is an error. Without -o the file goes to stdout. -o never overwrites an existing file unless
--force is given: a trainer configuration is often hand-edited.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from planner.cli.common import check_output_path, plan_model, write_text
from planner.errors import UserError
from planner.plan import Plan


def register(subparsers: argparse._SubParsersAction) -> None:
    from planner.trainers.common import Trainer

    p = subparsers.add_parser("export", help="write a plan as a torchtitan, Megatron-LM or DeepSpeed configuration",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("plan", metavar="PLAN.json", help="a plan written by `stratagem plan -o` or `estimate -o`")
    p.add_argument("--to", required=True, choices=[t.value for t in Trainer], help="the trainer")
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write the configuration to FILE")
    p.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    p.add_argument("--strict", action="store_true",
                   help="fail (exit 2) instead of warning when the trainer cannot express the plan exactly")
    p.add_argument("--deepspeed-config", default=None, metavar="NAME",
                   help="megatron-deepspeed: the DeepSpeed JSON file the arguments name (default ds_config.json)")
    p.add_argument("--json", action="store_true", help="print the export (text, warnings, hint) as JSON")
    p.set_defaults(func=run)


def output_path(path: str, inputs: tuple[Path, ...], force: bool) -> Path:
    """`-o` for a file the user may have edited: refuses an existing file without --force."""
    out = check_output_path(path, inputs)
    if out.exists() and not force:
        raise UserError(f"-o {path} exists; pass --force to overwrite it")
    return out


def run(args: argparse.Namespace) -> int:
    from planner.trainers.common import ModelShape, Trainer
    from planner.trainers.convert import DEFAULT_JSON_NAME, export_plan
    from planner.trainers.layout import BlockLayout

    trainer = Trainer(args.to)
    if args.deepspeed_config and trainer is not Trainer.MEGATRON_DEEPSPEED:
        raise UserError("--deepspeed-config applies to --to megatron-deepspeed only")
    out = output_path(args.output, (Path(args.plan),), args.force) if args.output else None
    plan = Plan.load(args.plan)
    built, chain = plan_model(plan)
    layout = BlockLayout.of(chain)
    shape = ModelShape.of(built.name, built.family, built.config, layout.num_blocks, built.seq_len)
    result = export_plan(plan, trainer, layout, shape, strict=args.strict,
                         filename=out.name if out else None,
                         deepspeed_json=args.deepspeed_config or DEFAULT_JSON_NAME)
    for warning in result.warnings:
        print(f"stratagem: warning: {warning}", file=sys.stderr)
    if out is not None:
        write_text(out, result.text)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    elif out is not None:
        print(f"wrote {out} ({trainer.value}); run: {result.launch_hint}")
    else:
        print(result.text, end="")
    return 0
