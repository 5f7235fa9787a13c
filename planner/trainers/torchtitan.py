"""torchtitan: a plan as a TOML job config, and a job config read back.

The file is the `JobConfig` TOML of torchtitan 0.2.x (`torchrun ... -m torchtitan.train --job.config_file F`;
validated in tests/test_trainer_parsers.py by torchtitan 0.2.2's own `ConfigManager`). torchtitan 0.3 replaced TOML
files with Python config registries; there the same `[section] key = value` pairs are the `--section.key value`
command-line overrides. What maps to what:

    dp                    data_parallel_shard_degree (FSDP) or data_parallel_replicate_degree (DDP, ZeRO-0 with no
                          other parallelism: torchtitan's DDP takes no second mesh axis)
    ZeRO-3 resharding     fsdp_reshard_after_forward = "always" / "never"
    tp, pp, cp, ep        tensor_/pipeline_/context_/expert_parallel_degree (sequence parallelism is always on with
                          tp in torchtitan 0.2)
    schedule              pipeline_parallel_schedule = "1F1B" / "GPipe" / "Interleaved1F1B" /
                          "InterleavedZeroBubble" / "ZBVZeroBubble" / "DualPipeV" (torch's own schedule classes;
                          torchtitan places the two stages of the V-shaped ones on a rank itself)
    stages                module_fqns_per_model_part (torchtitan's decoder FQNs: tok_embeddings, layers.N, norm,
                          output), always written when pp > 1 so that the cut is exact
    batch                 training.local_batch_size (per data-parallel rank; with pp, micro-batch *
                          micro-batches), pipeline_parallel_microbatch_size, training.global_batch_size
    recompute             activation_checkpoint.mode = "none" / "full" / "selective" with selective_ac_option
                          "op" (per-op); Megatron's attention-core recomputation exports as per-op with a warning
    tp_overlap            enable_async_tensor_parallel (needs compile.enable)
    fused_kernels         compile.enable with the model among compile.components (torch.compile fuses the
                          memory-bound ops; enabled too for async TP and FP8, which need it)
    tp_sharded_weights    always with tp > 1 (torchtitan's TP plan: colwise / rowwise linears, rowwise embedding)
    fp8                   model.converters = ["float8"] with [quantize.linear.float8] recipe_name, filter_fqns =
                          ["output"] and, for tensorwise scaling under FSDP, enable_fsdp_float8_all_gather and
                          precompute_float8_dynamic_scale_for_fsdp (torchtitan's llama3_405b.toml); compile is
                          enabled with it, as torchtitan's float8 docs require for speed; Transformer Engine's
                          delayed scaling exports as tensorwise with a note
    grads_in_training_dtype  training.mixed_precision_reduce = "bfloat16" (FSDP2 reduces in bf16; its sharded
                          gradients stay fp32)
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from typing import Any

from costmodel.float8 import Float8Recipe, parse_recipe
from costmodel.rank_layout import even_shares
from costmodel.strategy import CrossEntropy, Offload, Recompute, RuntimeOptions, Schedule
from planner.errors import UserError
from planner.trainers.common import ModelShape, Notes, Trainer, TrainerConfig

_SCHEDULES = {Schedule.ONE_F_ONE_B: "1F1B", Schedule.GPIPE: "GPipe", Schedule.INTERLEAVED: "Interleaved1F1B",
              Schedule.INTERLEAVED_ZB: "InterleavedZeroBubble", Schedule.ZBV: "ZBVZeroBubble",
              Schedule.DUALPIPEV: "DualPipeV"}
_APPROXIMATED = {"LoopedBFS": "Interleaved1F1B"}
TORCHTITAN_MODELS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B")}
"""Zoo presets that are torchtitan's own model flavors (torchtitan/models/llama3/__init__.py)."""


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return str(value)


def fqns_per_part(blocks: Sequence[int]) -> list[list[str]]:
    """torchtitan module names of each model part (virtual stage) holding `blocks[i]` decoder layers."""
    parts, layer = [], 0
    for i, n in enumerate(blocks):
        part = ["tok_embeddings"] if i == 0 else []
        part += [f"layers.{layer + k}" for k in range(n)]
        layer += n
        parts.append(part + (["norm", "output"] if i == len(blocks) - 1 else []))
    return parts


def sections(cfg: TrainerConfig, shape: ModelShape, notes: Notes) -> dict[str, dict[str, Any]]:
    """The job config as {section: {key: value}}."""
    out: dict[str, dict[str, Any]] = {}
    if shape.name in TORCHTITAN_MODELS:
        name, flavor = TORCHTITAN_MODELS[shape.name]
        out["model"] = {"name": name, "flavor": flavor}
    local = cfg.microbatch_size * (cfg.global_batch // (cfg.microbatch_size * cfg.dp) if cfg.pp > 1 else 1)
    out["training"] = {"local_batch_size": local, "global_batch_size": cfg.global_batch, "seq_len": cfg.seq_len,
                       "mixed_precision_param": "float32" if cfg.dtype == "float32" else "bfloat16"}
    if cfg.runtime.offload is not Offload.NONE:
        out["training"]["enable_cpu_offload"] = True
        if cfg.runtime.offload is Offload.OPTIMIZER:
            notes.add("torchtitan offloads parameters, gradients and optimizer together (FSDP2's CPUOffloadPolicy); "
                      "the plan's optimizer-only offload exported as enable_cpu_offload: more host-device copies "
                      "than planned")
    if cfg.runtime.grads_in_training_dtype and cfg.dtype != "float32":
        out["training"]["mixed_precision_reduce"] = "bfloat16"
        if cfg.zero_stage >= 2:
            notes.add("torchtitan reduces gradients in bfloat16 but FSDP2 keeps the sharded gradients in fp32: "
                      "slightly more memory than planned")
    if cfg.dtype == "float16":
        notes.add("torchtitan trains in bfloat16 or float32, not float16; exported as bfloat16")
    out["parallelism"] = _parallelism(cfg, shape, notes)
    out["activation_checkpoint"] = _activation_checkpoint(cfg.recompute, notes)
    if cfg.runtime.fused_kernels or (cfg.runtime.tp_overlap and cfg.tp > 1) or cfg.runtime.fp8 is not None:
        # A compiled loss is not DTensor's loss-parallel decomposition the plan may have priced.
        loss = [] if cfg.runtime.cross_entropy is CrossEntropy.LOSS_PARALLEL else ["loss"]
        out["compile"] = {"enable": True, "components": ["model", *loss]}
        if not cfg.runtime.fused_kernels:
            notes.add("torchtitan compiles the model for async tensor parallelism and FP8, which fuses its "
                      "memory-bound ops; the plan priced them eager, so torchtitan should step a little faster "
                      "(plan with --fix fused_kernels=true)")
    compiled_loss = "loss" in out.get("compile", {}).get("components", [])
    if cfg.tp > 1 and cfg.runtime.cross_entropy is CrossEntropy.TORCH and not compiled_loss:
        notes.add("torchtitan computes the loss under loss_parallel() on the vocabulary-sharded logits (DTensor's "
                  "decomposition: 4 more bytes per local logit at its peak than the plan priced); plan with --fix "
                  "cross_entropy=loss-parallel")
    if cfg.runtime.fp8 is not None:
        out.setdefault("model", {})["converters"] = ["float8"]
        out["quantize.linear.float8"] = _float8(cfg, notes)
    return out


def _float8(cfg: TrainerConfig, notes: Notes) -> dict[str, Any]:
    fp8 = cfg.runtime.fp8
    if not fp8.torchao:
        notes.add(f"the plan priced Transformer Engine's FP8 ({fp8.value} scaling, casts fused, weights cast once "
                  "per step); torchtitan converts with torchao: exported as tensorwise, slower than planned")
        fp8 = Float8Recipe.TENSORWISE
    out: dict[str, Any] = {"recipe_name": fp8.value, "filter_fqns": ["output"]}
    if fp8.fp8_all_gather and cfg.zero_stage == 3 and (cfg.dp or 1) > 1:
        out["enable_fsdp_float8_all_gather"] = True
        out["precompute_float8_dynamic_scale_for_fsdp"] = True
    return out


def _parallelism(cfg: TrainerConfig, shape: ModelShape, notes: Notes) -> dict[str, Any]:
    # torchtitan offloads through FSDP only: an offloading plan is exported as FSDP whatever its ZeRO stage.
    ddp = cfg.zero_stage == 0 and cfg.tp == cfg.pp == cfg.cp == 1 and cfg.runtime.offload is Offload.NONE
    if not ddp and cfg.zero_stage != 3:
        notes.add(f"torchtitan shards data-parallel state with FSDP (ZeRO-3) or not at all (DDP, only without "
                  f"other parallelism); ZeRO-{cfg.zero_stage} exported as FSDP: less memory, more weight gathers "
                  f"than planned")
    if not cfg.runtime.dp_overlap:
        notes.add("torchtitan always overlaps data-parallel communication with compute; the plan priced it exposed")
    if cfg.pp > 1 and not cfg.runtime.pp_returns_outputs and not cfg.runtime.p2p_transient_buffers:
        notes.add("torchtitan's trainer asks the pipeline schedule for its outputs, so the last stage keeps every "
                  "micro-batch's logits until the step ends; the plan priced them freed: more memory than planned "
                  "(plan with --fix pp_returns_outputs=true to price it as torchtitan runs it)")
    if cfg.pp > 1 and cfg.runtime.p2p_transient_buffers:
        notes.add("torchtitan's pipeline stages keep a receive and a gradient-receive buffer for every micro-batch "
                  "(torch.distributed.pipelining); the plan priced them freed per transfer: more memory than planned")
    if cfg.tp > 1 and not cfg.sequence_parallel:
        notes.add("torchtitan 0.2 runs sequence parallelism with every tensor-parallel layer; the plan priced tp "
                  "without it")
    p: dict[str, Any] = {"data_parallel_replicate_degree": cfg.dp if ddp else 1,
                         "data_parallel_shard_degree": 1 if ddp else cfg.dp}
    if not ddp:
        reshard = cfg.runtime.reshard_after_forward or cfg.zero_stage != 3
        p["fsdp_reshard_after_forward"] = "always" if reshard else "never"
    p["tensor_parallel_degree"] = cfg.tp
    if cfg.runtime.tp_overlap and cfg.tp > 1:
        p["enable_async_tensor_parallel"] = True
    p["context_parallel_degree"] = cfg.cp
    p["expert_parallel_degree"] = cfg.ep
    if cfg.ep > 1 and cfg.tp > 1:
        # torchtitan's expert tensor parallelism 1: ep borrows the tp ranks (and must take all of them, and cp's)
        p["expert_tensor_parallel_degree"] = 1
        if cfg.ep % (cfg.tp * cfg.cp):
            notes.add(f"torchtitan's ep={cfg.ep} with expert tensor parallel degree 1 must span tp x cp = "
                      f"{cfg.tp * cfg.cp} ranks; the plan's ep groups lie inside a tp group: torchtitan will refuse "
                      f"this configuration")
    p["pipeline_parallel_degree"] = cfg.pp
    if cfg.pp > 1:
        p["pipeline_parallel_schedule"] = _SCHEDULES[cfg.schedule]
        p["pipeline_parallel_microbatch_size"] = cfg.microbatch_size
        blocks = cfg.stage_blocks or even_shares(shape.num_layers, cfg.pp * cfg.virtual_stages)
        p["module_fqns_per_model_part"] = fqns_per_part(blocks)
    return p


def _activation_checkpoint(recompute: Recompute, notes: Notes) -> dict[str, Any]:
    if recompute is Recompute.NONE:
        return {"mode": "none"}
    if recompute is Recompute.FULL:
        return {"mode": "full"}
    if recompute is Recompute.SELECTIVE:
        notes.add("torchtitan has no attention-core recomputation (Megatron's selective); exported as per-op "
                  "selective checkpointing, which recomputes more than planned")
    return {"mode": "selective", "selective_ac_option": "op"}


def render(cfg: TrainerConfig, shape: ModelShape, header: list[str], notes: Notes) -> str:
    lines = [f"# {h}" for h in header]
    if shape.name not in TORCHTITAN_MODELS:
        lines.append(f"# [model] name and flavor: set them to torchtitan's model for {shape.name}")
    for section, values in sections(cfg, shape, notes).items():
        lines += ["", f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines) + "\n"


# ---- reading a job config ---------------------------------------------------------------------------------------

def read(text: str, *, source: str) -> TrainerConfig:
    """A torchtitan TOML job config as a `TrainerConfig` (module docstring, read backwards)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{source}: not valid TOML: {e}") from None
    notes = Notes()
    par, train = _section(doc, "parallelism", source), _section(doc, "training", source)
    pp = int(par.get("pipeline_parallel_degree", 1))
    replicate, shard = int(par.get("data_parallel_replicate_degree", 1)), int(par.get("data_parallel_shard_degree", -1))
    schedule, virtual, blocks = _read_pipeline(par, pp, source, notes)
    mbs = int(par.get("pipeline_parallel_microbatch_size", 1)) if pp > 1 else int(train.get("local_batch_size", 8))
    local = int(train.get("local_batch_size", 8))
    gbs = int(train.get("global_batch_size", -1))
    tp = int(par.get("tensor_parallel_degree", 1))
    etp = int(par.get("expert_tensor_parallel_degree", 1))
    if int(par.get("expert_parallel_degree", 1)) > 1 and etp != 1:
        notes.add(f"expert tensor parallel degree {etp} shards every expert over tp ranks; the plan prices experts "
                  f"whole with their tokens split over the tp ranks (expert tensor parallel degree 1)")
    zero = 0 if shard == 1 else 3
    reshard = {"always": True, "never": False}.get(par.get("fsdp_reshard_after_forward", "default"), pp == 1)
    return TrainerConfig(
        trainer=Trainer.TORCHTITAN, tp=tp, pp=pp, cp=int(par.get("context_parallel_degree", 1)),
        ep=int(par.get("expert_parallel_degree", 1)), dp=None if shard == -1 else replicate * shard,
        microbatch_size=mbs, global_batch=gbs if gbs > 0 else None, samples_per_rank=local,
        schedule=schedule, virtual_stages=virtual, stage_blocks=blocks, zero_stage=zero, sequence_parallel=tp > 1,
        recompute=_read_recompute(_section(doc, "activation_checkpoint", source), notes),
        runtime=RuntimeOptions(reshard_after_forward=reshard,
                               tp_overlap=bool(par.get("enable_async_tensor_parallel", False)),
                               fused_kernels=_compiles(doc, source, "model"), tp_sharded_weights=tp > 1,
                               offload=Offload.PARAMS if train.get("enable_cpu_offload") and zero == 3
                               else Offload.NONE,
                               fp8=_read_float8(doc, source, notes),
                               grads_in_training_dtype=train.get("mixed_precision_reduce", "float32") == "bfloat16",
                               cross_entropy=_read_loss(doc, par, tp, source),
                               pp_returns_outputs=pp > 1),
        seq_len=int(train["seq_len"]) if "seq_len" in train else None,
        dtype=str(train.get("mixed_precision_param", "bfloat16")), notes=tuple(notes.items))


def _read_loss(doc: Mapping[str, Any], par: Mapping[str, Any], tp: int, source: str) -> CrossEntropy:
    """The loss as torchtitan computes it: under `loss_parallel()` on the vocabulary-sharded logits when tp > 1
    (unless `disable_loss_parallel`), DTensor's decomposition; PyTorch's kernels otherwise, and where the loss is
    compiled (its memory is then the compiler's, priced as PyTorch's)."""
    if tp > 1 and not par.get("disable_loss_parallel", False) and not _compiles(doc, source, "loss"):
        return CrossEntropy.LOSS_PARALLEL
    return CrossEntropy.TORCH


def _compiles(doc: Mapping[str, Any], source: str, component: str) -> bool:
    """Whether the config compiles `component`, "model" or "loss" (`compile.enable`; torchtitan 0.2's components
    default to both)."""
    compile_ = _section(doc, "compile", source)
    return bool(compile_.get("enable", False)) and component in compile_.get("components", ["model", "loss"])


def _read_float8(doc: Mapping[str, Any], source: str, notes: Notes) -> Float8Recipe | None:
    """The FP8 recipe of a config whose model converters include "float8" (torchao's default is tensorwise)."""
    if "float8" not in _section(doc, "model", source).get("converters", []):
        return None
    float8 = _section(_section(_section(doc, "quantize", source), "linear", source), "float8", source)
    name = float8.get("recipe_name") or Float8Recipe.TENSORWISE.value
    if name == "rowwise_with_gw_hp":
        notes.add("float8 recipe rowwise_with_gw_hp (weight gradients in bf16) priced as rowwise")
        name = Float8Recipe.ROWWISE.value
    try:
        return parse_recipe(str(name))
    except ValueError as e:
        raise UserError(f"{source}: [quantize.linear.float8] {e}") from None


def _section(doc: Mapping[str, Any], name: str, source: str) -> Mapping[str, Any]:
    value = doc.get(name, {})
    if not isinstance(value, Mapping):
        raise UserError(f"{source}: [{name}] must be a table")
    return value


def _read_pipeline(par: Mapping[str, Any], pp: int, source: str,
                   notes: Notes) -> tuple[Schedule, int, tuple[int, ...] | None]:
    if pp == 1:
        return Schedule.ONE_F_ONE_B, 1, None
    name = str(par.get("pipeline_parallel_schedule", "1F1B"))
    if name in _APPROXIMATED:
        notes.add(f"pipeline schedule {name} priced as {_APPROXIMATED[name]} (stratagem prices "
                  f"{', '.join(_SCHEDULES.values())})")
        name = _APPROXIMATED[name]
    by_name = {v: k for k, v in _SCHEDULES.items()}
    if name not in by_name:
        raise UserError(f"{source}: pipeline_parallel_schedule {name!r} is not priced; valid: "
                        f"{', '.join(list(by_name) + list(_APPROXIMATED))}")
    schedule = by_name[name]
    parts = par.get("module_fqns_per_model_part")
    if parts:
        blocks = tuple(sum(1 for m in part if str(m).startswith("layers.")) for part in parts)
        if len(blocks) % pp:
            raise UserError(f"{source}: {len(blocks)} model parts for pipeline_parallel_degree {pp}")
        virtual = len(blocks) // pp
    else:
        blocks, virtual = None, 2 if schedule.chunked and schedule is not Schedule.INTERLEAVED_ZB else 1
        notes.add("no module_fqns_per_model_part: priced with an even split of the layers (torchtitan weighs the "
                  "embedding and the output as one layer each)")
    if not schedule.chunked and virtual != 1:
        raise UserError(f"{source}: {name} runs one stage per rank, the config has {virtual}")
    if schedule.v_shape and virtual != 2:
        raise UserError(f"{source}: {name} runs two stages per rank (a V), the config has {virtual}")
    if schedule is Schedule.INTERLEAVED and virtual < 2:
        raise UserError(f"{source}: {name} needs at least two stages per rank, the config has {virtual}")
    return schedule, virtual, blocks


def _read_recompute(ac: Mapping[str, Any], notes: Notes) -> Recompute:
    mode = str(ac.get("mode", "selective"))
    if mode == "none":
        return Recompute.NONE
    if mode == "full":
        return Recompute.FULL
    option = str(ac.get("selective_ac_option", "2"))
    if mode == "selective" and option == "op":
        return Recompute.OP
    if mode == "selective" and option == "1":
        return Recompute.FULL
    notes.add(f"activation_checkpoint mode {mode!r} (option {option!r}) priced as "
              f"{'full recomputation of every layer' if mode == 'selective' else 'per-op recomputation'}")
    return Recompute.FULL if mode == "selective" else Recompute.OP
