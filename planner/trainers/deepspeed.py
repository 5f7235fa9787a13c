"""DeepSpeed: a plan as a DeepSpeed JSON config and as Megatron-DeepSpeed arguments, and both read back.

The JSON (`deepspeed.initialize(config=...)`; validated in tests by deepspeed 0.19.8's own `DeepSpeedConfig`) holds
the batch (`train_batch_size`, `train_micro_batch_size_per_gpu`, `gradient_accumulation_steps` = micro-batches per
step), `zero_optimization.stage` with `overlap_comm`, the dtype, `activation_checkpointing` and the pipeline's
`stages` with its `activation_checkpoint_interval`. DeepSpeed's JSON has no tensor-parallel degree: that, the
pipeline degree and sequence parallelism are Megatron-DeepSpeed arguments (microsoft/Megatron-DeepSpeed
megatron/arguments.py, table in planner/trainers/data/megatron_deepspeed_arguments.json), which name the JSON with
`--deepspeed_config`.

DeepSpeed's pipeline engine runs one 1F1B-like schedule over an even split, reduces gradients after the pipeline
flush (no data-parallel overlap) and takes ZeRO-0/1 only; what a plan has beyond that exports with a warning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from costmodel.strategy import CrossEntropy, Offload, Recompute, RuntimeOptions, Schedule
from planner.errors import UserError
from planner.trainers.argtable import argument_tokens, load_table
from planner.trainers.common import ModelShape, Notes, Trainer, TrainerConfig
from planner.trainers.megatron import model_arguments

TABLE = "megatron_deepspeed"
DEFAULT_JSON_NAME = "ds_config.json"


def pipeline_notes(cfg: TrainerConfig, notes: Notes) -> None:
    """What DeepSpeed's pipeline engine cannot run as planned (shared by the JSON and the arguments)."""
    if cfg.pp == 1:
        return
    if cfg.schedule is not Schedule.ONE_F_ONE_B:
        notes.add(f"DeepSpeed's pipeline engine runs 1F1B only; the plan's {cfg.schedule.value} schedule exported as "
                  f"1F1B over {cfg.pp} stages")
    if cfg.stage_blocks is not None:
        notes.add(f"DeepSpeed's pipeline engine splits the layers evenly; the plan's split {list(cfg.stage_blocks)} "
                  f"is not carried over")
    if cfg.zero_stage >= 2:
        notes.add(f"DeepSpeed's pipeline engine takes ZeRO-0/1 only; ZeRO-{cfg.zero_stage} exported as ZeRO-1")
    if cfg.runtime.dp_overlap:
        notes.add("DeepSpeed's pipeline engine reduces gradients after the pipeline flush; the plan priced them "
                  "overlapped with the backward")
    if not cfg.runtime.p2p_blocking:
        notes.add("DeepSpeed's pipeline engine blocks both ends of every send; the plan priced paired sends that "
                  "only the receiver waits for")
    if cfg.dtype == "bfloat16" and not cfg.runtime.fp32_grad_pass:
        notes.add("DeepSpeed's pipeline engine in bf16 adds each micro-batch's gradients into fp32 buffers in a "
                  "pass of their own (BF16_Optimizer); the plan priced no such pass")


def config_dict(cfg: TrainerConfig, notes: Notes) -> dict[str, Any]:
    """The DeepSpeed JSON config as a dict."""
    dp = cfg.dp or 1
    zero = min(cfg.zero_stage, 1) if cfg.pp > 1 else cfg.zero_stage
    pipeline_notes(cfg, notes)
    if cfg.ep > 1:
        notes.add(f"DeepSpeed's JSON config has no expert-parallel degree (its MoE layers take ep_size in the model "
                  f"code): set ep_size={cfg.ep} there")
    zero_opt: dict[str, Any] = {"stage": zero, "overlap_comm": cfg.runtime.dp_overlap and cfg.pp == 1,
                                "contiguous_gradients": True, "reduce_scatter": True}
    if zero == 3 and not cfg.runtime.reshard_after_forward:
        zero_opt["stage3_max_live_parameters"] = int(1e12)
        zero_opt["stage3_max_reuse_distance"] = int(1e12)
    zero_opt.update(_offload_sections(cfg.runtime.offload, zero, notes))
    if cfg.runtime.offload is not Offload.NONE and zero == 0:
        notes.add("DeepSpeed offloads the optimizer under ZeRO >= 1; exported as ZeRO-1")
        zero_opt["stage"] = 1
    out: dict[str, Any] = {"train_batch_size": cfg.global_batch, "train_micro_batch_size_per_gpu": cfg.microbatch_size,
                           "gradient_accumulation_steps": cfg.global_batch // (cfg.microbatch_size * dp),
                           "zero_optimization": zero_opt}
    if cfg.dtype in ("bfloat16", "float16"):
        out["bf16" if cfg.dtype == "bfloat16" else "fp16"] = {"enabled": True}
    if cfg.recompute is not Recompute.NONE:
        out["activation_checkpointing"] = {"partition_activations": cfg.tp > 1, "contiguous_memory_optimization": False,
                                           "cpu_checkpointing": False}
    if cfg.pp > 1:
        out["pipeline"] = {"stages": cfg.pp, "activation_checkpoint_interval":
                           1 if cfg.recompute is Recompute.FULL else 0,
                           "pipe_partitioned": cfg.runtime.p2p_scatter_gather,
                           "grad_partitioned": cfg.runtime.p2p_scatter_gather}
    if cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1:
        notes.add("the DeepSpeed JSON carries no tensor/pipeline/sequence degree: launch it with the arguments of "
                  "`stratagem export --to megatron-deepspeed`")
    if cfg.runtime.fp8 is not None:
        notes.add("DeepSpeed has no FP8 linear layers of its own; the plan priced them (FP8 "
                  f"{cfg.runtime.fp8.value} scaling): exported in {cfg.dtype or 'float32'}, slower than planned")
    return out


def _offload_sections(offload: Offload, zero: int, notes: Notes) -> dict[str, Any]:
    """ZeRO-Offload (`offload_optimizer`) and ZeRO-3's parameter offload (`offload_param`, with the optimizer:
    what FSDP2's CPUOffloadPolicy offloads), to pinned host memory."""
    cpu = {"device": "cpu", "pin_memory": True}
    if offload is Offload.NONE:
        return {}
    if offload is Offload.PARAMS and zero != 3:
        notes.add(f"DeepSpeed offloads parameters under ZeRO-3 only; ZeRO-{zero} exported with the optimizer "
                  f"offloaded alone (more device memory than planned)")
        return {"offload_optimizer": cpu}
    if offload is Offload.PARAMS:
        return {"offload_param": cpu, "offload_optimizer": dict(cpu)}
    return {"offload_optimizer": cpu}


def _read_offload(zero: Mapping[str, Any], source: str) -> Offload:
    def on(key: str) -> bool:
        section = zero.get(key)
        device = str(section.get("device", "none")) if isinstance(section, Mapping) else "none"
        if device == "nvme":
            raise UserError(f"{source}: zero_optimization.{key}.device nvme is not priced; valid: cpu, none")
        return device == "cpu"

    if on("offload_param"):
        return Offload.PARAMS
    return Offload.OPTIMIZER if on("offload_optimizer") else Offload.NONE


def render_json(cfg: TrainerConfig, notes: Notes) -> str:
    return json.dumps(config_dict(cfg, notes), indent=2) + "\n"


def render_arguments(cfg: TrainerConfig, shape: ModelShape, header: list[str], notes: Notes,
                     json_name: str = DEFAULT_JSON_NAME) -> str:
    """Megatron-DeepSpeed arguments, naming the DeepSpeed JSON `json_name` (written by `--to deepspeed`)."""
    pipeline_notes(cfg, notes)
    args = [f"--tensor-model-parallel-size {cfg.tp}"]
    args += [f"--pipeline-model-parallel-size {cfg.pp}"] if cfg.pp > 1 else ["--no-pipeline-parallel"]
    if cfg.cp > 1:
        notes.add("Megatron-DeepSpeed's sequence parallelism across ranks is DeepSpeed-Ulysses (all-to-all), not "
                  "the ring attention priced for cp; exported as --ds-sequence-parallel-size")
        args.append(f"--ds-sequence-parallel-size {cfg.cp}")
    if cfg.ep > 1:
        notes.add("expert parallelism is not exported to Megatron-DeepSpeed (its MoE takes --num-experts and "
                  "expert groups of its own)")
    args += ["--sequence-parallel"] if cfg.sequence_parallel else []
    if cfg.runtime.tp_overlap:
        notes.add("Megatron-DeepSpeed has no tensor-parallel communication overlap; the plan priced it")
    args += [f"--micro-batch-size {cfg.microbatch_size}", f"--global-batch-size {cfg.global_batch}"]
    args += _recompute_arguments(cfg.recompute, notes)
    zero = min(cfg.zero_stage, 1) if cfg.pp > 1 else cfg.zero_stage
    args += [f"--zero-stage {zero}", "--deepspeed", f"--deepspeed_config {json_name}"]
    args += {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(cfg.dtype or "float32", [])
    lines = [f"# {h}" for h in header] + ["# model", *model_arguments(shape, cfg.seq_len, deepspeed_fork=True),
                                          "# parallelism, batch",
                                          *args]
    return "\n".join(lines) + "\n"


def _recompute_arguments(recompute: Recompute, notes: Notes) -> list[str]:
    if recompute is Recompute.FULL:
        return ["--recompute-granularity full", "--recompute-method uniform", "--deepspeed-activation-checkpointing"]
    if recompute is Recompute.OP:
        notes.add("Megatron-DeepSpeed has no per-op recomputation; exported as selective recomputation of the "
                  "attention core")
    return ["--recompute-granularity selective"] if recompute is not Recompute.NONE else []


# ---- reading --------------------------------------------------------------------------------------------------

def read_json(text: str, *, source: str) -> TrainerConfig:
    """A DeepSpeed JSON config alone: ZeRO data parallelism (and DeepSpeed pipeline stages when it gives them)."""
    ds = _json(text, source)
    mbs = ds.get("train_micro_batch_size_per_gpu")
    if not isinstance(mbs, int):
        raise UserError(f"{source}: train_micro_batch_size_per_gpu must be given as an integer")
    gas = ds.get("gradient_accumulation_steps", 1)
    gbs = ds.get("train_batch_size")
    pipe = ds.get("pipeline", {}) if isinstance(ds.get("pipeline"), Mapping) else {}
    stages = pipe.get("stages", 1)
    pp = stages if isinstance(stages, int) else 1
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0
    return TrainerConfig(
        trainer=Trainer.DEEPSPEED, pp=pp, microbatch_size=mbs, global_batch=gbs if isinstance(gbs, int) else None,
        samples_per_rank=mbs * int(gas), zero_stage=stage, recompute=_json_recompute(ds),
        runtime=RuntimeOptions(dp_overlap=bool(zero.get("overlap_comm", stage == 3)) and pp == 1,
                               reshard_after_forward=int(zero.get("stage3_max_reuse_distance", 1e9)) < 1e12,
                               **pipeline_runtime(pipe, pp, _json_dtype(ds)),
                               offload=_read_offload(zero, source) if isinstance(zero, Mapping) else Offload.NONE),
        dtype=_json_dtype(ds))


def pipeline_runtime(pipe: Mapping[str, Any], pp: int, dtype: str) -> dict[str, bool]:
    """How DeepSpeed's pipeline engine runs: every send and receive its own blocking instruction, activations
    partitioned over the tensor-parallel ranks unless `pipe_partitioned` is off (deepspeed/runtime/pipe/engine.py;
    the defaults are in deepspeed/runtime/config.py); in bf16, each micro-batch's gradients added into fp32
    buffers by its BF16_Optimizer (`RuntimeOptions.fp32_grad_pass`); buffers for the micro-batches in flight only
    (`num_pipe_buffers`, `RuntimeOptions.p2p_transient_buffers`)."""
    if pp == 1:
        return {}
    return {"p2p_blocking": True, "p2p_scatter_gather": bool(pipe.get("pipe_partitioned", True)),
            "fp32_grad_pass": dtype == "bfloat16", "p2p_transient_buffers": True}


def _json(text: str, source: str) -> Mapping[str, Any]:
    try:
        ds = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{source}: not valid JSON: {e}") from None
    if not isinstance(ds, Mapping):
        raise UserError(f"{source}: a DeepSpeed config must be a JSON object")
    return ds


def _json_recompute(ds: Mapping[str, Any]) -> Recompute:
    pipe = ds.get("pipeline", {})
    interval = pipe.get("activation_checkpoint_interval", 0) if isinstance(pipe, Mapping) else 0
    return Recompute.FULL if interval else Recompute.NONE


def _json_dtype(ds: Mapping[str, Any]) -> str:
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        section = ds.get(key)
        if isinstance(section, Mapping) and section.get("enabled") in (True, "auto"):
            return dtype
    return "float32"


def read_arguments(text: str, *, source: str, folder: Path) -> TrainerConfig:
    """Megatron-DeepSpeed arguments, with the DeepSpeed JSON they name (relative to `folder`) when it exists."""
    ns = load_table(TABLE).parse(argument_tokens(text, source=source), source=source)
    if ns.micro_batch_size is None:
        raise UserError(f"{source}: --micro-batch-size is missing")
    zero = int(ns.zero_stage)
    pp = 1 if ns.no_pipeline_parallel else ns.pipeline_model_parallel_size
    ds_path = folder / ns.deepspeed_config if ns.deepspeed_config else None
    grad_overlap = bool(ns.async_tensor_model_parallel_allreduce) and ns.tensor_model_parallel_size > 1
    dtype = "bfloat16" if ns.bf16 else "float16" if ns.fp16 else "float32"
    pipe = RuntimeOptions(dp_overlap=pp == 1, tp_grad_overlap=grad_overlap,
                          tp_sharded_weights=ns.tensor_model_parallel_size > 1,
                          cross_entropy=CrossEntropy.INPLACE,
                          **pipeline_runtime({}, pp, dtype))
    if ds_path is not None and ds_path.is_file():
        ds = read_json(ds_path.read_text(encoding="utf-8"), source=str(ds_path))
        zero = ds.zero_stage
        pipe = replace(pipe, offload=ds.runtime.offload)
        if ds.pp > 1:  # the JSON's pipeline section says whether sends are partitioned
            pipe = replace(pipe, p2p_scatter_gather=ds.runtime.p2p_scatter_gather)
    granularity = ns.recompute_granularity or ("full" if ns.checkpoint_activations else None)
    recompute = {"full": Recompute.FULL, "selective": Recompute.SELECTIVE}.get(granularity, Recompute.NONE)
    return TrainerConfig(
        trainer=Trainer.MEGATRON_DEEPSPEED, tp=ns.tensor_model_parallel_size, pp=pp,
        cp=ns.ds_sequence_parallel_size, microbatch_size=ns.micro_batch_size, global_batch=ns.global_batch_size,
        zero_stage=zero, sequence_parallel=bool(ns.sequence_parallel), recompute=recompute,
        runtime=pipe, seq_len=ns.seq_length,
        dtype=dtype, num_layers=ns.num_layers)
