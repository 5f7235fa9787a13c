"""Megatron-LM: a plan as the command-line arguments of `pretrain_gpt.py`, and an argument file read back.

The arguments are those of Megatron-LM core_v0.16.1 (`megatron/training/arguments.py`; the table and its provenance
are in planner/trainers/data/megatron_lm_arguments.json). What maps to what:

    tp, pp, cp, ep       --tensor-/--pipeline-/--context-/--expert-model-parallel-size (dp is the rest of the world)
    experts with tp      --expert-tensor-parallel-size 1 (MoE parallel folding: experts whole, their tokens split
                         over the tp ranks, ep groups over tp x dp ranks); read back, another size is a note
    ep_overlap           --overlap-moe-expert-parallel-comm (1F1B / interleaved steady-state F&B pairs)
    interleaved:V        --num-layers-per-virtual-pipeline-stage (equal chunks) or --pipeline-model-parallel-layout
    uneven stages        --decoder-first/last-pipeline-num-layers (equal middle stages) or the layout string
    mbs, global batch    --micro-batch-size, --global-batch-size
    sp                   --sequence-parallel
    recompute            full: --recompute-granularity full --recompute-method uniform --recompute-num-layers 1;
                         full on the first N layers of every stage: --recompute-method block --recompute-num-layers N;
                         selective: --recompute-granularity selective (the attention core)
    ZeRO 1 / 2 / 3       --use-distributed-optimizer / Megatron-FSDP --data-parallel-sharding-strategy
                         optim_grads / optim_grads_params
    pp inside dp         --use-tp-pp-dp-mapping (rank order tp-cp-ep-pp-dp)
    dp_overlap           --overlap-grad-reduce (+ --overlap-param-gather with a sharded optimizer)
    tp_overlap           --tp-comm-overlap (needs sequence parallelism)
    tp_grad_overlap      on unless --no-async-tensor-model-parallel-allreduce (Megatron-LM always reduces a
                         column-parallel linear's input gradient during its weight-gradient GEMM by default; a plan
                         priced without it exports with a note, not with the flag that would slow Megatron down)
    fused_kernels        --transformer-impl transformer_engine (Megatron-LM's default: Transformer Engine's fused
                         norms, bias-activation, bias-dropout-add and rotary kernels); local reads as eager ops
    tp_sharded_weights   always with tp > 1 (Megatron-LM's column / row-parallel linears, vocab-parallel embedding)
    cross_entropy        inplace (Megatron-LM's vocab-parallel cross-entropy works in place in the fp32 logits)
    grads_in_training_dtype  --grad-reduce-in-bf16 (Megatron-LM's default for bf16 is fp32 gradients)
    p2p_overlap          Megatron-LM's default for the interleaved schedule; a plan priced without it exports
                         --no-overlap-p2p-communication
    fp8 delayed          --fp8-format hybrid --fp8-recipe delayed (Transformer Engine); read back from --fp8-format
                         whatever --fp8-recipe says, with a note; torchao's recipes are not exported
    dtype                --bf16 / --fp16

Megatron-LM has no GPipe schedule, no zero-bubble schedule and no per-op recomputation; those export as 1F1B,
(interleaved) 1F1B over the same stages and selective, each with a warning.
"""

from __future__ import annotations

import argparse

from costmodel.float8 import Float8Recipe
from costmodel.rank_layout import even_shares
from costmodel.strategy import DEFAULT_MESH_ORDER, CrossEntropy, Offload, Recompute, RuntimeOptions, Schedule
from planner.errors import UserError
from planner.trainers.argtable import argument_tokens, load_table
from planner.trainers.common import ModelShape, Notes, Trainer, TrainerConfig
from planner.trainers.layout import format_megatron_layout, parse_megatron_layout
from planner.trainers.mapping import PP_INSIDE_DP

TABLE = "megatron_lm"
_SHARDING = {1: None, 2: "optim_grads", 3: "optim_grads_params"}
_ZERO_OF_SHARDING = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def model_arguments(shape: ModelShape, seq_len: int | None, *, deepspeed_fork: bool = False) -> list[str]:
    """The model's architecture as Megatron-LM arguments (what `pretrain_gpt.py` needs to build it);
    `deepspeed_fork` spells them as Megatron-DeepSpeed does (its fork predates GQA and RMSNorm flags of today)."""
    args = [f"--num-layers {shape.num_layers}"]
    for flag, value in (("--hidden-size", shape.hidden), ("--num-attention-heads", shape.heads),
                        ("--ffn-hidden-size", shape.ffn_hidden), ("--seq-length", seq_len),
                        ("--max-position-embeddings", seq_len), ("--vocab-size", shape.vocab)):
        if value is not None:
            args.append(f"{flag} {value}")
    if shape.kv_heads is not None and shape.heads is not None and shape.kv_heads != shape.heads:
        args += ([f"--num-key-value-heads {shape.kv_heads}"] if deepspeed_fork
                 else ["--group-query-attention", f"--num-query-groups {shape.kv_heads}"])
    if shape.family in ("llama", "moe"):
        args += (["--swiglu", "--normalization rmsnorm", "--use-rotary-position-embeddings"] if deepspeed_fork
                 else ["--swiglu", "--normalization RMSNorm", "--position-embedding-type rope"])
        args.append("--disable-bias-linear")
    if shape.experts:
        args += ([f"--num-experts {shape.experts}", f"--topk {shape.top_k or 2}"] if deepspeed_fork
                 else [f"--num-experts {shape.experts}", f"--moe-router-topk {shape.top_k or 2}"])
    if shape.tie_embeddings is False:
        args.append("--untie-embeddings-and-output-weights")
    return args


def parallel_arguments(cfg: TrainerConfig, num_layers: int, notes: Notes) -> list[str]:
    """Degrees, pipeline split, batch, recomputation, optimizer sharding, overlap and dtype as arguments."""
    args = [f"--tensor-model-parallel-size {cfg.tp}", f"--pipeline-model-parallel-size {cfg.pp}"]
    args += ["--use-tp-pp-dp-mapping"] if cfg.mesh_order == PP_INSIDE_DP and cfg.pp > 1 and cfg.dp != 1 else []
    args += [f"--context-parallel-size {cfg.cp}"] if cfg.cp > 1 else []
    args += [f"--expert-model-parallel-size {cfg.ep}"] if cfg.ep > 1 else []
    # Megatron-Core shards experts over tp by default (expert tensor parallel size = tp); the plan keeps them whole
    # and splits their tokens over the tp ranks (costmodel.expert_parallel), expert tensor parallel size 1.
    args += ["--expert-tensor-parallel-size 1"] if cfg.ep > 1 and cfg.tp > 1 else []
    args += ["--overlap-moe-expert-parallel-comm"] if cfg.runtime.ep_overlap and cfg.ep > 1 else []
    args += ["--sequence-parallel"] if cfg.sequence_parallel else []
    args += _pipeline_arguments(cfg, num_layers, notes)
    args += [f"--micro-batch-size {cfg.microbatch_size}", f"--global-batch-size {cfg.global_batch}"]
    args += _recompute_arguments(cfg.recompute, notes, cfg.recompute_layers)
    args += _sharding_arguments(cfg, notes)
    args += _offload_arguments(cfg, notes)
    args += _overlap_arguments(cfg, notes)
    args += {"bfloat16": ["--bf16"], "float16": ["--fp16"]}.get(cfg.dtype or "float32", [])
    return args


def _pipeline_arguments(cfg: TrainerConfig, num_layers: int, notes: Notes) -> list[str]:
    if cfg.pp == 1:
        return []
    if cfg.schedule is Schedule.GPIPE:
        notes.add("Megatron-LM has no GPipe schedule; exported as 1F1B (the same bubble, fewer micro-batches in "
                  "flight, so less activation memory than planned)")
    if cfg.schedule.zero_bubble:
        placed = "a looped placement instead of the V, " if cfg.schedule.v_shape else ""
        notes.add(f"Megatron-LM has no {cfg.schedule.value} schedule; exported as "
                  f"{'interleaved 1F1B' if cfg.virtual_stages > 1 else '1F1B'} with {placed}the same stages "
                  f"(the weight gradients do not fill the bubbles: slower than planned)")
    blocks = cfg.stage_blocks or even_shares(num_layers, cfg.pp * cfg.virtual_stages)
    equal = len(set(blocks)) == 1
    if cfg.virtual_stages > 1:
        if equal:
            return [f"--num-layers-per-virtual-pipeline-stage {blocks[0]}"]
        return [f"--pipeline-model-parallel-layout {format_megatron_layout(blocks)}"]
    if equal:
        return []
    middle = set(blocks[1:-1])
    if len(middle) <= 1 and blocks[0] > 0 and blocks[-1] > 0:
        return [f"--decoder-first-pipeline-num-layers {blocks[0]}", f"--decoder-last-pipeline-num-layers {blocks[-1]}"]
    return [f"--pipeline-model-parallel-layout {format_megatron_layout(blocks)}"]


def _recompute_arguments(recompute: Recompute, notes: Notes, layers: int | None = None) -> list[str]:
    if recompute is Recompute.FULL and layers is not None:
        return ["--recompute-granularity full", "--recompute-method block", f"--recompute-num-layers {layers}"]
    if recompute is Recompute.FULL:
        return ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    if recompute is Recompute.OP:
        notes.add("Megatron-LM has no per-op recomputation (torchtitan's); exported as selective recomputation of "
                  "the attention core, which keeps more activations than planned")
    if recompute in (Recompute.SELECTIVE, Recompute.OP):
        return ["--recompute-granularity selective"]
    return []


def _sharding_arguments(cfg: TrainerConfig, notes: Notes) -> list[str]:
    if cfg.zero_stage == 0:
        return []
    if cfg.zero_stage == 1:
        return ["--use-distributed-optimizer"]
    if cfg.zero_stage == 3 and not cfg.runtime.reshard_after_forward:
        notes.add("Megatron-FSDP reshards weights after the forward; the plan keeps them gathered to the backward "
                  "(more weight gathers than planned)")
    return ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {_SHARDING[cfg.zero_stage]}",
            "--ckpt-format fsdp_dtensor"]


def _offload_arguments(cfg: TrainerConfig, notes: Notes) -> list[str]:
    """Megatron-Core's HybridDeviceOptimizer: the distributed optimizer's state and step on the CPU; the fraction
    defaults to 0 (nothing offloaded), so it is given."""
    if cfg.runtime.offload is Offload.NONE:
        return []
    if cfg.runtime.offload is Offload.PARAMS:
        notes.add("Megatron-LM offloads the optimizer, not the parameters (FSDP2's CPUOffloadPolicy); exported as "
                  "--optimizer-cpu-offload: the sharded weights and gradients stay on the device, more memory than "
                  "planned")
    args = ["--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0"]
    if cfg.zero_stage == 0:
        notes.add("Megatron-LM offloads the distributed optimizer only; exported with --use-distributed-optimizer "
                  "(ZeRO-1)")
        args.insert(0, "--use-distributed-optimizer")
    return args


def _overlap_arguments(cfg: TrainerConfig, notes: Notes) -> list[str]:
    args = []
    fp8 = cfg.runtime.fp8
    if fp8 is not None and fp8.torchao:
        notes.add("the plan priced torchao's FP8 linear layers; Megatron-LM runs FP8 through Transformer Engine "
                  "(--fp8-format, its own scaling and kernels), not exported: set it yourself or expect the BF16 "
                  "step time")
    elif fp8 is not None:
        args += ["--fp8-format hybrid", "--fp8-recipe delayed"]
    if cfg.runtime.grads_in_training_dtype:
        args.append("--grad-reduce-in-bf16")
    if cfg.pp > 1 and cfg.virtual_stages > 1 and not cfg.runtime.p2p_overlap:
        args.append("--no-overlap-p2p-communication")  # Megatron-LM overlaps them by default; the plan did not
    if cfg.runtime.dp_overlap:
        args.append("--overlap-grad-reduce")
        if cfg.zero_stage >= 1:
            args.append("--overlap-param-gather")
    if cfg.tp > 1 and not cfg.runtime.tp_grad_overlap and not cfg.runtime.tp_overlap:
        notes.add("Megatron-LM runs each column-parallel linear's input-gradient all-reduce during its "
                  "weight-gradient GEMM; the plan priced it exposed, so Megatron-LM should step a little faster "
                  "(plan with --fix tp_grad_overlap=true to price it as Megatron-LM runs it)")
    if cfg.pp > 1 and not cfg.runtime.p2p_transient_buffers:
        notes.add("Megatron-LM frees each pipeline receive after its transfer; the plan priced "
                  "torch.distributed.pipelining's buffers, one per micro-batch, so Megatron-LM needs a little less "
                  "memory (plan with --fix p2p_transient_buffers=true to price it as Megatron-LM runs it)")
    if not cfg.runtime.fused_kernels:
        notes.add("Megatron-LM runs Transformer Engine's fused kernels; the plan priced one eager kernel per "
                  "memory-bound op, so Megatron-LM should step a little faster (plan with --fix fused_kernels=true "
                  "to price it as Megatron-LM runs it)")
    if cfg.runtime.tp_overlap:
        if cfg.sequence_parallel:
            args.append("--tp-comm-overlap")
        else:
            notes.add("Megatron-LM overlaps tensor-parallel communication only with sequence parallelism; exported "
                      "without --tp-comm-overlap (more exposed communication than planned)")
    return args


def render(cfg: TrainerConfig, shape: ModelShape, header: list[str], notes: Notes) -> str:
    """The argument file: `#` comment lines, then one argument (with its value) per line."""
    lines = [f"# {h}" for h in header]
    lines += ["# model", *model_arguments(shape, cfg.seq_len), "# parallelism, batch, memory",
              *parallel_arguments(cfg, shape.num_layers, notes)]
    return "\n".join(lines) + "\n"


# ---- reading an argument file --------------------------------------------------------------------------------

def read(text: str, *, source: str) -> TrainerConfig:
    """A Megatron-LM argument file or launch script as a `TrainerConfig` (module docstring, read backwards)."""
    ns = load_table(TABLE).parse(argument_tokens(text, source=source), source=source)
    notes = Notes()
    if ns.micro_batch_size is None:
        raise UserError(f"{source}: --micro-batch-size is missing (Megatron-LM requires it)")
    pp = ns.pipeline_model_parallel_size
    virtual, blocks = _read_pipeline(ns, pp, source)
    etp = ns.expert_tensor_parallel_size or ns.tensor_model_parallel_size  # Megatron-Core's default: tp
    if ns.expert_model_parallel_size > 1 and etp != 1:
        notes.add(f"expert tensor parallel size {etp} shards every expert over tp ranks; the plan prices experts whole "
                  f"with their tokens split over the tp ranks (expert tensor parallel size 1)")
    return TrainerConfig(
        trainer=Trainer.MEGATRON, tp=ns.tensor_model_parallel_size, pp=pp, cp=ns.context_parallel_size,
        ep=ns.expert_model_parallel_size, microbatch_size=ns.micro_batch_size, global_batch=ns.global_batch_size,
        schedule=Schedule.INTERLEAVED if virtual > 1 else Schedule.ONE_F_ONE_B, virtual_stages=virtual,
        stage_blocks=blocks, zero_stage=_read_zero(ns), sequence_parallel=ns.sequence_parallel,
        recompute=_read_recompute(ns), recompute_layers=_read_recompute_layers(ns),
        runtime=RuntimeOptions(dp_overlap=ns.overlap_grad_reduce, tp_overlap=ns.tp_comm_overlap,
                               tp_grad_overlap=ns.async_tensor_model_parallel_allreduce
                               and ns.tensor_model_parallel_size > 1,
                               fused_kernels=ns.transformer_impl == "transformer_engine",
                               tp_sharded_weights=ns.tensor_model_parallel_size > 1,
                               cross_entropy=CrossEntropy.INPLACE, offload=_read_offload(ns, notes),
                               fp8=_read_fp8(ns, notes), grads_in_training_dtype=ns.grad_reduce_in_bf16,
                               p2p_overlap=ns.overlap_p2p_comm and pp > 1 and virtual > 1,
                               p2p_transient_buffers=pp > 1,
                               ep_overlap=ns.overlap_moe_expert_parallel_comm
                               and (ns.expert_model_parallel_size or 1) > 1),
        mesh_order=PP_INSIDE_DP if ns.use_tp_pp_dp_mapping else DEFAULT_MESH_ORDER,
        seq_len=ns.seq_length, dtype="bfloat16" if ns.bf16 else "float16" if ns.fp16 else "float32",
        num_layers=ns.num_layers, notes=tuple(notes.items))


def _read_pipeline(ns: argparse.Namespace, pp: int, source: str) -> tuple[int, tuple[int, ...] | None]:
    layers = ns.num_layers
    if ns.pipeline_model_parallel_layout:
        blocks = parse_megatron_layout(ns.pipeline_model_parallel_layout)
        if len(blocks) % pp:
            raise UserError(f"{source}: the pipeline layout has {len(blocks)} stages, not a multiple of pp={pp}")
        return len(blocks) // pp, blocks
    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    virtual = ns.num_virtual_stages_per_pipeline_rank or 1
    if ns.num_layers_per_virtual_pipeline_stage:
        if layers is None or layers % (pp * ns.num_layers_per_virtual_pipeline_stage):
            raise UserError(f"{source}: --num-layers {layers} is not a multiple of pp * "
                            f"--num-layers-per-virtual-pipeline-stage")
        virtual = layers // (pp * ns.num_layers_per_virtual_pipeline_stage)
    if pp == 1 or (first is None and last is None):
        return virtual, None
    if layers is None or virtual > 1:
        raise UserError(f"{source}: --decoder-first/last-pipeline-num-layers need --num-layers and no virtual stages")
    first = layers // pp if first is None else first
    last = layers // pp if last is None else last
    rest, middle = layers - first - last, pp - 2
    if (middle == 0 and rest) or (middle > 0 and rest % middle) or rest < 0:
        raise UserError(f"{source}: {layers} layers with {first} on the first and {last} on the last stage do not "
                        f"split evenly over the {middle} middle stages")
    return 1, (first,) + (rest // middle if middle else 0,) * middle + (last,)


def _read_offload(ns: argparse.Namespace, notes: Notes) -> Offload:
    fraction = ns.optimizer_offload_fraction or 0.0
    if not ns.optimizer_cpu_offload or fraction <= 0:
        return Offload.NONE
    if fraction < 1:
        notes.add(f"--optimizer-offload-fraction {fraction} offloads part of the optimizer; priced as all of it")
    return Offload.OPTIMIZER


def _read_fp8(ns: argparse.Namespace, notes: Notes) -> Float8Recipe | None:
    """Transformer Engine's FP8 (`--fp8-format`), priced as delayed scaling whatever `--fp8-recipe` says."""
    if not ns.fp8:
        return None
    if ns.fp8_recipe != "delayed":
        notes.add(f"--fp8-recipe {ns.fp8_recipe} priced as delayed scaling (Transformer Engine's fused casts, "
                  "weights cast once per step); its own scaling passes are not priced")
    return Float8Recipe.DELAYED


def _read_zero(ns: argparse.Namespace) -> int:
    if ns.use_megatron_fsdp:
        return _ZERO_OF_SHARDING[ns.data_parallel_sharding_strategy]
    if ns.use_torch_fsdp2:
        return 3
    return 1 if ns.use_distributed_optimizer else 0


def _read_recompute(ns: argparse.Namespace) -> Recompute:
    granularity = ns.recompute_granularity or ("selective" if ns.recompute_activations else None)
    if granularity == "selective":
        return Recompute.SELECTIVE
    return Recompute.FULL if granularity == "full" else Recompute.NONE


def _read_recompute_layers(ns: argparse.Namespace) -> int | None:
    """`--recompute-method block --recompute-num-layers N`: only the first N layers of each stage recompute."""
    if _read_recompute(ns) is Recompute.FULL and ns.recompute_method == "block":
        return ns.recompute_num_layers if ns.recompute_num_layers is not None else 0
    return None
