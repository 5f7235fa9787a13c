"""The trainer-neutral record both directions go through, and what an export returns.

`TrainerConfig` is what a trainer's configuration says about the parallel strategy, in the trainer's own terms
(blocks per stage rather than chain segments, "the rest of the world" for the data-parallel degree): each trainer
module reads its file into one and writes one out as its file. `planner.trainers.mapping` converts it to and from
a `Strategy`, so the rules of that conversion (and the warnings for what a trainer cannot express) live in one place.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from costmodel.strategy import DEFAULT_MESH_ORDER, MeshAxis, Recompute, RuntimeOptions, Schedule
from planner.errors import UserError


class Trainer(enum.StrEnum):
    """The trainers a plan can be exported to and a configuration imported from."""

    TORCHTITAN = "torchtitan"
    MEGATRON = "megatron"
    DEEPSPEED = "deepspeed"
    MEGATRON_DEEPSPEED = "megatron-deepspeed"

    @classmethod
    def parse(cls, text: str, *, flag: str) -> Trainer:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise UserError(f"{flag} {text!r}: unknown trainer; valid: {', '.join(t.value for t in cls)}") from None


class ExportError(UserError):
    """The plan has something the trainer cannot express and `--strict` (or the nature of it) forbids a warning."""


@dataclass(frozen=True, slots=True)
class TrainerConfig:
    """A trainer's parallel configuration. Degrees are the trainer's; `dp` None means "every remaining rank"."""

    trainer: Trainer
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    microbatch_size: int = 1
    global_batch: int | None = None
    """Samples per optimizer step; None: `samples_per_rank` per data-parallel rank."""
    samples_per_rank: int | None = None
    """Samples per data-parallel rank per step when `global_batch` is None (None: one micro-batch)."""
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    stage_blocks: tuple[int, ...] | None = None
    """Decoder layers per virtual stage, in pipeline order; None: the trainer's even split."""
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    recompute_layers: int | None = None
    """Full recomputation of only the first N decoder layers of each (virtual) stage (Megatron-LM's
    `--recompute-method block --recompute-num-layers N`); None: `recompute` on every layer."""
    runtime: RuntimeOptions = RuntimeOptions()
    mesh_order: tuple[MeshAxis, ...] = DEFAULT_MESH_ORDER
    """Rank order, innermost first (Megatron-LM's `--use-tp-pp-dp-mapping` puts pp inside dp)."""
    seq_len: int | None = None
    dtype: str | None = None
    """Training dtype ("bfloat16", "float16", "float32"), None when the file does not say."""
    num_layers: int | None = None
    """The model's layer count as the file states it (checked against the model being priced)."""
    notes: tuple[str, ...] = ()
    """What was approximated while reading the file, one sentence each."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The model's architecture as trainers' model arguments need it (None where the model does not say)."""

    name: str
    family: str
    num_layers: int
    hidden: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    vocab: int | None = None
    seq_len: int | None = None
    experts: int | None = None
    top_k: int | None = None
    tie_embeddings: bool | None = None

    @classmethod
    def of(cls, name: str, family: str, config: Any, num_layers: int, seq_len: int | None) -> ModelShape:
        """From a zoo config (field names of models/gpt.py, llama.py, moe.py); other configs give what they have."""
        def get(*names: str) -> Any:
            for n in names:
                value = getattr(config, n, None)
                if value is not None:
                    return value
            return None

        hidden = get("hidden")
        ffn = get("ffn_hidden") or (4 * hidden if family == "gpt" and hidden else None)
        return cls(name=name, family=family, num_layers=num_layers, hidden=hidden, heads=get("heads"),
                   kv_heads=get("kv_heads"), ffn_hidden=ffn, vocab=get("vocab"), seq_len=seq_len,
                   experts=get("experts", "num_experts"), top_k=get("top_k"), tie_embeddings=get("tie_embeddings"))


@dataclass(frozen=True, slots=True)
class ExportResult:
    """One trainer configuration file: its text, a conventional file name, and what did not carry over exactly."""

    trainer: Trainer
    text: str
    filename: str
    warnings: tuple[str, ...] = ()
    launch_hint: str = ""
    """How to hand the file to the trainer, one line."""

    def to_dict(self) -> dict[str, Any]:
        return {"trainer": self.trainer.value, "text": self.text, "filename": self.filename,
                "warnings": list(self.warnings), "launch_hint": self.launch_hint}


@dataclass
class Notes:
    """Collects the approximations of one export or import (mutable while one conversion runs)."""

    items: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        if text not in self.items:
            self.items.append(text)
