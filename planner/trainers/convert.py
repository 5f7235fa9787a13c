"""The two entry points: `export_plan` (a plan as a trainer's file) and `read_trainer_config` (a trainer's file as
the strategy it runs on a given model and cluster).

Exports never drop a setting silently: what the trainer cannot express exactly is a warning in
`ExportResult.warnings` (an error with `strict=True`), what it cannot express at all (a cut inside the embedding,
stages on two device types) a `UserError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from costmodel.strategy import Strategy
from planner.errors import UserError
from planner.plan import Plan
from planner.strategy_label import strategy_label
from planner.trainers import deepspeed, megatron, torchtitan
from planner.trainers.argtable import load_table
from planner.trainers.common import ExportError, ExportResult, ModelShape, Notes, Trainer, TrainerConfig
from planner.trainers.layout import BlockLayout
from planner.trainers.mapping import config_of_plan, strategy_of_config

_FILENAMES = {Trainer.TORCHTITAN: "torchtitan.toml", Trainer.MEGATRON: "megatron.args",
              Trainer.DEEPSPEED: deepspeed.DEFAULT_JSON_NAME, Trainer.MEGATRON_DEEPSPEED: "megatron_deepspeed.args"}


def _header(plan: Plan, trainer: Trainer) -> list[str]:
    p = plan.predicted
    release = {Trainer.TORCHTITAN: "torchtitan 0.2.x JobConfig TOML",
               Trainer.MEGATRON: f"{load_table(megatron.TABLE).release} arguments",
               Trainer.MEGATRON_DEEPSPEED: f"{load_table(deepspeed.TABLE).release} arguments"}[trainer]
    return [f"{release}, written by `stratagem export --to {trainer.value}`",
            f"plan: {plan.model.name} on {plan.cluster.get('name', '?')}, {strategy_label(plan.strategy)}",
            f"predicted step {p.step_time_s:.4g} s, MFU {100 * p.mfu:.1f}%, model fingerprint "
            f"{plan.model.fingerprint[:16]}"]


def _launch_hint(plan: Plan, trainer: Trainer, filename: str) -> str:
    n = plan.strategy.num_devices
    if trainer is Trainer.TORCHTITAN:
        return f"torchrun --nproc-per-node ... -m torchtitan.train --job.config_file {filename}  ({n} GPUs)"
    if trainer is Trainer.MEGATRON:
        return (f"CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun ... pretrain_gpt.py $(grep -v '^#' {filename}) <data, "
                f"tokenizer, optimizer arguments>  ({n} GPUs)")
    if trainer is Trainer.MEGATRON_DEEPSPEED:
        return f"deepspeed pretrain_gpt.py $(grep -v '^#' {filename}) <data arguments>  ({n} GPUs)"
    return f"deepspeed.initialize(..., config=\"{filename}\")  ({n} GPUs)"


def export_plan(plan: Plan, trainer: Trainer, layout: BlockLayout, shape: ModelShape, *, strict: bool = False,
                filename: str | None = None, deepspeed_json: str = deepspeed.DEFAULT_JSON_NAME) -> ExportResult:
    """`plan` as `trainer`'s configuration file (module docstring)."""
    notes = Notes()
    cfg = config_of_plan(plan, layout, trainer, notes)
    _expert_dispatch_notes(plan.strategy, trainer, notes)
    header = _header(plan, trainer) if trainer is not Trainer.DEEPSPEED else []
    if trainer is Trainer.TORCHTITAN:
        text = torchtitan.render(cfg, shape, header, notes)
    elif trainer is Trainer.MEGATRON:
        text = megatron.render(cfg, shape, header, notes)
    elif trainer is Trainer.DEEPSPEED:
        text = deepspeed.render_json(cfg, notes)
    else:
        text = deepspeed.render_arguments(cfg, shape, header, notes, json_name=deepspeed_json)
    if strict and notes.items:
        raise ExportError(f"--strict: {notes.items[0]}")
    name = filename or _FILENAMES[trainer]
    return ExportResult(trainer=trainer, text=text, filename=name, warnings=tuple(notes.items),
                        launch_hint=_launch_hint(plan, trainer, name))


def _expert_dispatch_notes(strategy: Strategy, trainer: Trainer, notes: Notes) -> None:
    """DeepSeek's expert-parallel runtime choices, which no exported file carries (`RuntimeOptions.ep_dedup`,
    `ep_overlap`, which Megatron-LM has as a flag): the trainer runs a plain all-to-all, exposed,
    unless set up by hand."""
    if strategy.runtime.ep_dedup and strategy.ep > 1:
        notes.add("the plan priced the expert dispatch deduplicated per node (ep_dedup, DeepEP's internode "
                  "kernels), which is not exported: set up the trainer's DeepEP dispatcher yourself or expect a "
                  "plain all-to-all's step time")
    # Megatron-LM pairs its 1F1B steady state itself (every schedule exports as 1F1B or interleaved there).
    if strategy.runtime.ep_overlap and trainer is not Trainer.MEGATRON:
        notes.add("the plan priced DualPipe's overlap of the paired chunks' all-to-alls (ep_overlap), which no "
                  "exported schedule runs: expect the all-to-alls exposed")


@dataclass(frozen=True, slots=True)
class ImportedConfig:
    """A trainer's configuration as the strategy it runs on the cluster at hand."""

    source: str
    """`trainer:path` as given."""
    config: TrainerConfig
    strategy: Strategy
    global_batch: int


def parse_source(spec: str, *, flag: str) -> tuple[Trainer, Path]:
    """`megatron:args.txt` -> (trainer, path), with one-line errors listing the valid trainers."""
    trainer_text, sep, path = spec.partition(":")
    if not sep or not path:
        raise UserError(f"{flag} {spec!r}: expected TRAINER:FILE, e.g. megatron:train.args; trainers: "
                        f"{', '.join(t.value for t in Trainer)}")
    return Trainer.parse(trainer_text, flag=flag), Path(path)


def read_trainer_config(spec: str, *, flag: str = "--from") -> TrainerConfig:
    """Read `TRAINER:FILE` into a `TrainerConfig` (without a model or cluster yet)."""
    trainer, path = parse_source(spec, flag=flag)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{flag} {spec}: file {path} does not exist") from None
    except (UnicodeDecodeError, IsADirectoryError):
        raise UserError(f"{flag} {spec}: {path} is not a text file") from None
    except OSError as e:
        raise UserError(f"{flag} {spec}: cannot read {path}: {e.strerror or e}") from None
    source = f"{flag} {spec}"
    if trainer is Trainer.TORCHTITAN:
        return torchtitan.read(text, source=source)
    if trainer is Trainer.MEGATRON:
        return megatron.read(text, source=source)
    if trainer is Trainer.DEEPSPEED:
        return deepspeed.read_json(text, source=source)
    return deepspeed.read_arguments(text, source=source, folder=path.parent)


def imported_strategy(spec: str, cfg: TrainerConfig, layout: BlockLayout, num_devices: int) -> ImportedConfig:
    strategy, global_batch = strategy_of_config(cfg, layout, num_devices)
    return ImportedConfig(source=spec, config=cfg, strategy=strategy, global_batch=global_batch)


DEFAULT_JSON_NAME = deepspeed.DEFAULT_JSON_NAME

__all__ = ["DEFAULT_JSON_NAME", "ExportError", "ExportResult", "ImportedConfig", "ModelShape", "Trainer", "export_plan",
           "imported_strategy", "parse_source", "read_trainer_config"]
