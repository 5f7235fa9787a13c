"""Published GPU training runs as planner inputs, and the published figure as the quantity the model predicts.

Rows come from `shared/data/published_runs.csv` and `shared/data/korthikanti2022_selective_recompute.csv` (beside the
checkout). Each row becomes a zoo model (`gpt` or `llama` with `--set` of the published shape), a cluster, and the
published configuration pinned in a `SearchSpace`; what the source leaves unstated is left to the planner and listed
in `PublishedRun.unstated` (or, where the framework of the time had one choice only, filled in and listed in
`PublishedRun.inferred` with the reason). Published speed is converted to seconds per iteration the way the source
counts it:

- an iteration time: as is;
- model TFLOP/s per GPU (Megatron-LM's formula, no recomputation): step = F / (TFLOP/s * GPUs), with the dense
  transformer FLOPs  F = 3 * B * [L * (2*s*(2*h*(h + h_kv) + 2*h*f_ffn*g) + 4*s^2*h) + 2*s*h*V]  (g = 1.5 for a
  gated MLP, h_kv = kv heads * head dim) -- the same closed form the tracer's FLOPs reproduce;
- hardware TFLOP/s with full recomputation (Narayanan et al. 2021): the blocks' term counted 4 times instead of 3;
- tokens per second per GPU: step = global batch * seq / (tokens/s * GPUs).

How a row's trainer runs the step (`RuntimeOptions`) is read from its name and framework notes: a compiled model or
Megatron-Core / NeMo runs fused kernels; Megatron-LM itself (not a Megatron-DeepSpeed fork) reduces input
gradients during the weight-gradient GEMMs; Megatron-LM before Megatron-Core also reduced data-parallel gradients
after the backward (unless the notes say it overlapped them) and scattered pipeline sends over the tp ranks; the
Megatron-DeepSpeed forks ran DeepSpeed's pipeline engine.

This module is reference code for `bench/published_runs.py` and the tests; nothing in the cost model reads it, and
the published figures are compared with, never fed into, the predictions.
"""

from __future__ import annotations

import csv
import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from costmodel.float8 import Float8Recipe, fp8_problem
from costmodel.hardware.catalog import get_device
from costmodel.strategy import CrossEntropy, Offload, Recompute, RuntimeOptions, Schedule

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
PUBLISHED_CSV = DATA_DIR / "published_runs.csv"
FP8_CSV = Path(__file__).resolve().parents[1] / "bench" / "data" / "published_fp8_runs.csv"
"""Published runs with FP8 linear layers, in the columns of `PUBLISHED_CSV` (each row cites its source)."""
KORTHIKANTI_CSV = DATA_DIR / "korthikanti2022_selective_recompute.csv"
FSDP_CSV = Path(__file__).resolve().parents[1] / "bench" / "data" / "published_fsdp_runs.csv"
"""Published eager FSDP runs (MosaicML llm-foundry's benchmark tables), in the columns of `PUBLISHED_CSV`; each
row cites its source."""
SCALING_CSV = Path(__file__).resolve().parents[1] / "bench" / "data" / "published_scaling_runs.csv"
"""Published scaling tables added as checks after the efficiencies were fitted: Megatron-LM's 2021 weak scaling on
32 to 3,072 A100 (Narayanan et al., SC'21, Table 1) and Llama 3 405B on 8,192 and 16,384 H100 (Llama 3 paper,
Table 4), in the columns of `PUBLISHED_CSV`; each row cites its source."""
GIB = 1024 ** 3

H100_NVL_DENSE_BF16_FLOPS = 1671e12 / 2
"""H100 NVL (350-400 W): 1,671 BF16 Tensor-Core TFLOP/s with sparsity, half of it dense (NVIDIA H100 Tensor Core GPU
datasheet, 2023). The lower bound of the power-capped H100s below."""
CAPPED_H100_NOTE = "peak FLOP/s between H100 SXM and NVL"
"""Device notes of torchtitan's H100s (500 W power limit, HBM2e): the benchmark says their peak lies between the
SXM's and the NVL's and that the exact value is unknown; they are priced at the middle of the two, and the
uncertainty (+-8% of the step's compute) is part of the row's error."""

# Network facts of the clusters named in the rows' device notes (the shorthand's defaults are the typical NIC).
OMNI_PATH_PER_GPU_GBPS = 4 * 100 / 8
"""BLOOM's Jean Zay nodes: 4 Omni-Path 100 Gb/s links per node of 8 A100 (device_notes of the row)."""


@dataclass(frozen=True)
class PublishedRun:
    """One published run: the model, the cluster and the configuration as pinned, plus the measured figures."""

    name: str
    family: str
    sets: tuple[str, ...]
    seq: int
    device: str
    num_gpus: int
    gpus_per_node: int
    tp: int
    pp: int
    cp: int
    dp: int
    global_batch: int
    microbatch_size: int | None
    virtual_stages: int | None
    zero_stage: int | None
    recompute: Recompute | None
    sequence_parallel: bool | None
    measured_step_s: float
    measured_memory_gib: float | None
    counts: str
    framework: str
    inter_node_gbps: float | None = None
    memory_gb: float | None = None
    """Device memory when the row's device differs from the catalog's (GB, 1e9 bytes)."""
    memory_bandwidth_tbps: float | None = None
    power_capped_h100: bool = False
    """The device notes put the peak between the H100 SXM's and NVL's (`CAPPED_H100_NOTE`)."""
    stage_layers: tuple[int, ...] = ()
    runtime: RuntimeOptions = RuntimeOptions()
    unstated: tuple[str, ...] = ()
    inferred: tuple[str, ...] = field(default=())
    ep: int = 1
    expert_imbalance: float | None = None
    """The busiest expert-parallel rank's routed tokens over the mean where the source states it (1.0: routing
    force-balanced); None: the catalog default (`costmodel.expert_parallel.EXPERT_IMBALANCE`)."""
    precision: str = "bf16"
    """What the run computed in ("bf16", "fp8"); FP8 rows are reported, not fitted. Rows whose `runtime.fp8` is
    set are priced in FP8 too; the others in bf16."""
    schedules: frozenset[Schedule] | None = None
    """The pipeline schedules the row's trainer runs, which an unstated schedule ranges over; None: every schedule
    the planner has (torchtitan runs all of torch.distributed.pipelining's)."""
    out_of_sample: bool = False
    """A row added after the training efficiencies were fitted: it checks the shipped constants and is kept out of
    the calibration mean and of `--fit` (the eager-FSDP rows of `FSDP_CSV`)."""

    @property
    def cluster_spec(self) -> str:
        return f"{self.num_gpus // self.gpus_per_node}x{self.gpus_per_node}x{self.device}"


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text else None


def _float(text: str) -> float | None:
    text = text.strip().rstrip("%")
    return float(text) if text else None


def dense_training_flops(*, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
                         batch: int, gated: bool, recomputed: bool = False) -> float:
    """Model FLOPs of one training step of a dense decoder (module docstring; no recomputation), or with
    `recomputed` the hardware FLOPs of full recomputation, the blocks' forward once more (4 passes, the output
    layer 3): Narayanan et al. 2021's 96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)) for a GPT."""
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    mlp = 2 * hidden * ffn * (1.5 if gated else 1.0)
    per_layer = 2 * seq * (2 * hidden * (hidden + kv) + mlp) + 4 * seq * seq * hidden
    return batch * ((4.0 if recomputed else 3.0) * layers * per_layer + 3.0 * 2 * seq * hidden * vocab)


def _zero_of(text: str) -> int | None:
    """The ZeRO stage a dp_sharding cell names ("ZeRO-1", "FSDP2 (ZeRO-3)", "distributed optimizer", ...)."""
    low = text.lower()
    m = re.search(r"zero[- ]?(?:stage[- ]?)?(\d)", low)
    if m:
        return int(m.group(1))
    for words, stage in ((("shard_grad_op", "zero2"), 2), (("fsdp", "full_shard", "fully sharded", "hsdp"), 3),
                         (("distributed optimizer", "distributed-optimizer"), 1),
                         (("ddp", "no sharding", "replicated", "none"), 0)):
        if any(w in low for w in words):
            return stage
    return None


def _recompute_of(text: str) -> Recompute | None:
    """The recomputation a recompute cell names ("full", "selective (...)", "none (...)", "activation
    checkpointing", "no", ...)."""
    low = text.strip().lower()
    if not low:
        return None
    if "per-op" in low:
        return Recompute.OP
    for r in (Recompute.FULL, Recompute.SELECTIVE, Recompute.NONE):
        if low.startswith(r.value):
            return r
    if low.startswith(("no", "off", "disabled", "without", "false")):
        return Recompute.NONE
    if "selective" in low:
        return Recompute.SELECTIVE
    if low.startswith(("yes", "on", "true")) or "checkpoint" in low or "recomput" in low:
        return Recompute.FULL
    return None


def _flag_of(text: str) -> bool | None:
    low = text.strip().lower()
    if low.startswith(("yes", "true", "on")):
        return True
    if low.startswith(("no", "false", "off")):
        return False
    return None


def llama_ffn(hidden: int) -> int:
    """Llama's MLP width when a row omits it: 2/3 of 4h rounded up to a multiple of 256 (Llama 2's rule; meta-llama
    llama/model.py `FeedForward`: 11,008 for h = 4,096)."""
    return -(-(8 * hidden // 3) // 256) * 256


def _completed(r: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The row with the cells a source may leave empty filled in as stated in the returned notes: missing columns
    empty, tp / pp / cp 1, dp the GPUs over tp x pp x cp, 8 GPUs per node, kv heads = heads, the family's MLP
    width and vocabulary, and a speed given only as MFU turned into model TFLOP/s at the device's bf16 peak."""
    row = {k: (v or "").strip() for k, v in r.items() if k is not None}
    for key in CSV_COLUMNS:
        row.setdefault(key, "")
    notes = []
    for key in ("tp", "pp", "cp"):
        row[key] = row[key] or "1"
    row["gpus_per_node"] = row["gpus_per_node"] or "8"
    row["device"], named = _device_of(row["device"], row["device_notes"])
    if named:
        notes.append(named)
    if not row["dp"]:
        model_parallel = int(row["tp"]) * int(row["pp"]) * int(row["cp"])
        if int(row["num_gpus"]) % model_parallel:
            raise ValueError(f"{row['run']}: {row['num_gpus']} GPUs are not a multiple of tp x pp x cp = "
                             f"{model_parallel}")
        row["dp"] = str(int(row["num_gpus"]) // model_parallel)
    llama = _gated_by_name(row["model_family"])  # the defaults of a gated family; other names get GPT's
    if not row["kv_heads"]:
        row["kv_heads"] = row["heads"]
    if not row["ffn_hidden"]:
        hidden = int(row["hidden"])
        row["ffn_hidden"] = str(llama_ffn(hidden) if llama else 4 * hidden)
        notes.append(f"MLP width {row['ffn_hidden']} (not given: {'Llama 2' if llama else 'GPT'}'s rule)")
    if not row["vocab"]:
        row["vocab"] = "32000" if llama else "51200"
        notes.append(f"vocabulary {row['vocab']} (not given: {'Llama 2' if llama else 'Megatron-LM GPT'}'s)")
    if not (row["iteration_time_s"] or row["tflops_per_gpu"] or row["tokens_per_s_per_gpu"]):
        mfu = _float(row["mfu"])
        if mfu is None:
            raise ValueError(f"{row['run']}: no iteration time, TFLOP/s, tokens/s or MFU")
        row["tflops_per_gpu"] = str((mfu / 100 if mfu > 1 else mfu) * get_device(row["device"]).flops("bfloat16") / 1e12)
        row["tflops_counts"] = row["tflops_counts"] or "model FLOPs (MFU x the catalog's bf16 peak)"
    return row, notes


def _device_of(cell: str, notes: str) -> tuple[str, str]:
    """The catalog device a row names, and a note when it had to be read from a looser name ("A100 SXM 80GB",
    "a100" with 40GB in the notes, "H100 80GB"); a name that matches nothing is left for the catalog to refuse."""
    try:
        return get_device(cell).name, ""
    except ValueError:
        pass
    name_only = cell.lower().replace(" ", "")
    for vendor in ("nvidia", "amd", "instinct", "tesla"):
        name_only = name_only.removeprefix(vendor)
    with_notes = name_only + notes.lower().replace(" ", "")
    guesses = (("a100", "a100-40gb" if "40gb" in with_notes else "a100-80gb"), ("h100", "h100-sxm"),
               ("h800", "h800"), ("h200", "h200"), ("v100", "v100-32gb"), ("b200", "b200"),
               ("mi300", "mi300x"), ("mi250", "mi250x"))
    for prefix, name in guesses:
        if name_only.startswith(prefix):
            return name, f"device {name} (the row names {cell!r})"
    return cell, ""


CSV_COLUMNS = ("run", "device", "device_notes", "num_gpus", "gpus_per_node", "model_family", "params", "layers",
               "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len", "tp", "pp", "cp", "dp",
               "virtual_stages", "micro_batch", "global_batch", "dp_sharding", "recompute", "sequence_parallel",
               "precision", "framework_notes", "iteration_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu",
               "tflops_counts", "mfu", "peak_memory_gib", "source")
"""The columns of `published_runs.csv`."""


def _published_row(raw: dict[str, str]) -> PublishedRun:
    r, completed = _completed(raw)
    layers, hidden, heads = int(r["layers"]), int(r["hidden"]), int(r["heads"])
    kv_heads, ffn, vocab, seq = int(r["kv_heads"]), int(r["ffn_hidden"]), int(r["vocab"]), int(r["seq_len"])
    gbs, gpus = int(r["global_batch"]), int(r["num_gpus"])
    family, family_note = _family_of(r)
    if family_note:
        completed.append(family_note)
    sets = [f"layers={layers}", f"hidden={hidden}", f"heads={heads}", f"ffn_hidden={ffn}", f"vocab={vocab}"]
    if family == "llama" or kv_heads != heads:
        sets.append(f"kv_heads={kv_heads}")
    if family == "gpt" and not _tied(r):
        # Megatron-LM GPTs untie the output layer (the published sizes count it: 1.7B = 24 layers + 2 x V x h);
        # a row whose framework notes say "tied embeddings" (MPT) keeps the zoo GPT's tied head.
        sets.append("tie_embeddings=false")
    framework = r["framework_notes"]
    text = f"{r['run']}; {framework}"
    megatron = _megatron_lm(text)
    legacy = megatron and not any(w in text.lower() for w in ("core", "nemo"))
    unstated, inferred = [], completed
    # DeepSpeed's pipeline engine in bf16 runs BF16_Optimizer's gradient pass (`RuntimeOptions.fp32_grad_pass`).
    deepspeed_bf16 = "Megatron-DeepSpeed" in framework and r["precision"].lower() == "bf16"
    mbs, zero = _int(r["micro_batch"]), _zero_of(r["dp_sharding"])
    recompute = _recompute_of(r["recompute"])
    sp = _flag_of(r["sequence_parallel"])
    if mbs is None:
        unstated.append("micro-batch")
    if zero is None:
        unstated.append("ZeRO stage (0 or 1: Megatron-LM has no ZeRO-2/3)" if megatron
                        else "ZeRO stage (searched over 0 and 1)")
    if "Megatron-DeepSpeed" in framework or legacy:
        # Megatron-LM before Megatron-Core and its Megatron-DeepSpeed forks of 2021-22 (BLOOM, MT-NLG) predate what
        # Korthikanti et al. (May 2022) and FlashAttention (Dao et al., May 2022) introduced; their attention was
        # the fused-softmax math kernel.
        sets.append("attn_impl=fused_softmax")
        inferred.append("explicit attention with Megatron's fused softmax (no FlashAttention in Megatron-LM of the time)")
        # Megatron's --attention-dropout / --hidden-dropout default to 0.1; the BLOOM run kept them ("The default
        # Megatron-LM dropout settings are inherited", bigscience train/tr11-176B-ml/README.md), MT-NLG states none.
        sets.append("dropout=0.1")
        inferred.append("dropout 0.1 in attention and on the residual branches (Megatron-LM's default)")
        sets.append("fused_dropout_add=true")
        inferred.append("the residual branches' dropout and add as one fused kernel (Megatron-LM's "
                        "bias_dropout_add_fused_train, --bias-dropout-fusion on by default)")
        if recompute is None:
            recompute = Recompute.FULL
            inferred.append("full recompute (selective recompute came with Korthikanti et al. 2022)")
        if sp is None:
            sp = False
            inferred.append("no sequence parallelism (came with Korthikanti et al. 2022)")
        inferred.append("no data-parallel overlap (DeepSpeed's pipeline engine reduces gradients after the "
                        "pipeline flush)")
        inferred.append("pipeline sends as DeepSpeed's pipeline engine runs them: partitioned over the tp ranks "
                        "(pipe_partitioned), each send and receive blocking both ends")
        if deepspeed_bf16:
            inferred.append("DeepSpeed's BF16_Optimizer (bf16 with ZeRO-1 under its pipeline engine): each "
                            "micro-batch's gradients upcast and added into fp32 buffers in a pass of their own")
    if recompute is None:
        unstated.append("recompute")
    if sp is None and int(r["tp"]) > 1:
        unstated.append("sequence parallelism")
    if not r["virtual_stages"] and int(r["pp"]) > 1:
        unstated.append("schedule / virtual stages")
    step = _float(r["iteration_time_s"])
    counts = r["tflops_counts"] or "iteration time"
    if step is None and r["tflops_per_gpu"]:
        flops = dense_training_flops(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                                     vocab=vocab, seq=seq, batch=gbs, gated=family == "llama",
                                     recomputed="with full recomputation" in counts)
        step = flops / (float(r["tflops_per_gpu"]) * 1e12 * gpus)
    elif step is None:
        step = gbs * seq / (float(r["tokens_per_s_per_gpu"]) * gpus)
        counts = "tokens/s per GPU"
    stage_layers: tuple[int, ...] = ()
    m = re.search(r"first and last pipeline stage hold (\d+) blocks.*the others (\d+)", framework)
    if m:
        edge, inner = int(m.group(1)), int(m.group(2))
        pp = int(r["pp"])
        stage_layers = (edge,) + (inner,) * (pp - 2) + (edge,)
    inter = OMNI_PATH_PER_GPU_GBPS if "Omni-Path" in r["device_notes"] else None
    hbm = re.search(r"(\d+) GB HBM\w* \(([\d.]+) TB/s\)", r["device_notes"])
    deepspeed_pipeline = "Megatron-DeepSpeed" in framework and int(r["pp"]) > 1
    # Megatron-LM since Megatron-Core runs its layers (FP8 included) as Transformer Engine modules.
    transformer_engine = (megatron and not legacy) or "transformer engine" in text.lower()
    fp8 = _fp8_of(r["precision"], zero, inferred, transformer_engine=transformer_engine)
    if fp8 is not None and (why := fp8_problem([get_device(r["device"])])):
        inferred.append(f"priced in bf16: the row says FP8, but {why}")
        fp8 = None
    # torchtitan's default FSDP policy keeps a pipeline stage's weights gathered from forward to backward
    # (`reshard_after_forward = not pp_enabled`, models/llama3/infra/parallelize.py, the "default" of
    # fsdp_reshard_after_forward), so that each micro-batch does not gather them twice.
    torchtitan_pipeline = "torchtitan" in framework and int(r["pp"]) > 1
    # Megatron-Core reduces a column-parallel linear's input gradient during its weight-gradient GEMM
    # (megatron/core/tensor_parallel/layers.py, always); the Megatron-DeepSpeed forks of 2021 behind BLOOM and
    # MT-NLG predate it.
    # Fused memory-bound kernels (`ir.fusion`): torch.compile rows, and Megatron-Core, which runs Transformer
    # Engine's fused norms, bias-activation, bias-dropout-add and rotary kernels. The 2021-22 Megatron-DeepSpeed
    # forks fused bias-GeLU and bias-dropout-add but ran attention dropout and the layer norms as their own kernels:
    # priced eager, with the fused scale-mask-softmax their attention had (attn_impl=fused_softmax).
    # Megatron-LM before Megatron-Core (Korthikanti et al. 2022 Sec. 6.3, Narayanan et al. 2021) reduced data-parallel
    # gradients after the backward and scattered/gathered pipeline sends over the tp ranks by default
    # (--scatter-gather-tensors-in-pipeline), as the Korthikanti rows are priced; a row that says it overlapped
    # the reduction keeps the overlap.
    # Megatron-Core's interleaved schedule posts its sends without waiting (`overlap_p2p_comm`, on unless
    # --no-overlap-p2p-communication; NeMo's configs set it): rows of Megatron-LM itself since Megatron-Core, not
    # the 2021-22 Megatron-LM of the legacy rows nor the DeepSpeed forks.
    # Megatron-LM (NeMo, Megatron-Core) and DeepSpeed's pipeline engine free their pipeline buffers per transfer;
    # torchtitan's torch.distributed.pipelining keeps one per micro-batch. Meta's Llama 3 stack is its own and not
    # public: priced as those engines run, since only torch.distributed.pipelining is known to keep them.
    # torchtitan asks the schedule for the last stage's outputs (`pp_returns_outputs`).
    # The loss kernel of the row's trainer (`_cross_entropy_of`).
    # Every trainer of these rows splits each linear's and the token embedding's weight over tp (Megatron's column
    # / row / vocab-parallel layers, torchtitan's TP plan), never a whole weight the ILP may also keep.
    fused = _runs_fused_kernels(text)
    runtime = RuntimeOptions(dp_overlap="Megatron-DeepSpeed" not in framework
                             and not (legacy and "overlap" not in framework.lower()),
                             fused_kernels=fused, reshard_after_forward=not torchtitan_pipeline,
                             tp_grad_overlap=megatron, tp_sharded_weights=int(r["tp"]) > 1,
                             tp_overlap="TP/PP communication enabled" in framework or "AsyncTP" in framework,
                             p2p_scatter_gather=deepspeed_pipeline or (legacy and int(r["pp"]) > 1),
                             p2p_blocking=deepspeed_pipeline, fp8=fp8,
                             fp32_grad_pass=deepspeed_bf16,
                             grads_in_training_dtype=_grads_in_training_dtype(framework),
                             p2p_overlap=megatron and not legacy and "no-overlap-p2p" not in framework,
                             p2p_transient_buffers=int(r["pp"]) > 1 and "torchtitan" not in framework,
                             pp_returns_outputs=torchtitan_pipeline,
                             cross_entropy=_cross_entropy_of(text), metric_passes=_metric_passes_of(text))
    return PublishedRun(
        name=r["run"], family=family, sets=tuple(sets), seq=seq, schedules=trainer_schedules(text),
        device=r["device"], num_gpus=gpus, gpus_per_node=int(r["gpus_per_node"]), tp=int(r["tp"]), pp=int(r["pp"]), cp=int(r["cp"]),
        dp=int(r["dp"]), global_batch=gbs, microbatch_size=mbs, virtual_stages=_int(r["virtual_stages"]),
        zero_stage=zero, recompute=recompute, sequence_parallel=sp, measured_step_s=step,
        measured_memory_gib=_float(r["peak_memory_gib"]), counts=counts, framework=framework,
        inter_node_gbps=inter, memory_gb=float(hbm.group(1)) if hbm else None,
        memory_bandwidth_tbps=float(hbm.group(2)) if hbm else None,
        power_capped_h100=CAPPED_H100_NOTE in r["device_notes"], stage_layers=stage_layers, runtime=runtime,
        unstated=tuple(unstated), inferred=tuple(inferred), precision="fp8" if fp8 is not None else "bf16")


GATED_FAMILIES = ("llama", "mistral", "mixtral", "qwen", "yi", "internlm", "baichuan", "deepseek", "gemma", "olmo")
"""Model families whose MLP is gated (SwiGLU / GeGLU: three h x f matrices) with rotary positions and no biases: the
zoo's `llama`. Any other name is read as a GPT (two h x f matrices, GELU, learned positions, biases)."""

PARAM_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def _gated_by_name(family: str) -> bool:
    """Whether a row's family names a gated family (`GATED_FAMILIES`)."""
    return family.lower().startswith(GATED_FAMILIES)


def _param_count(text: str) -> float | None:
    """The parameter count a params cell states ("70.6B", "356M", "1T", "1.7 B"), None when it states none."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmbt])?\w*\s*", text.lower())
    if not m:
        return None
    return float(m.group(1)) * PARAM_SUFFIXES.get(m.group(2) or "", 1.0)


def _tied(r: dict[str, str]) -> bool:
    return "tied embeddings" in r["framework_notes"]


def _family_of(r: dict[str, str]) -> tuple[str, str]:
    """The zoo family a row's shape is built with, and a note when its name alone did not decide it.

    The name decides when it is a known gated family (`GATED_FAMILIES`) or says GPT. Otherwise the stated
    parameter count does: the family whose closed form (`models.llama.num_params`, `models.gpt.num_params`)
    with the row's shape comes closer to it -- a gated MLP holds 3 h f weights where a GELU one holds 2 h f, so
    the two differ by a third of the MLP, far more than embeddings or biases. Without a count, a GPT."""
    name = r["model_family"].lower()
    if _gated_by_name(name):
        return "llama", ""
    stated = _param_count(r["params"])
    if name.startswith("gpt") or stated is None:
        return "gpt", ""
    from models.gpt import GPTConfig
    from models.gpt import num_params as gpt_params
    from models.llama import LlamaConfig
    from models.llama import num_params as llama_params

    shape = dict(layers=int(r["layers"]), hidden=int(r["hidden"]), heads=int(r["heads"]),
                 kv_heads=int(r["kv_heads"]), ffn_hidden=int(r["ffn_hidden"]), vocab=int(r["vocab"]),
                 seq=int(r["seq_len"]))
    counts = {"llama": llama_params(LlamaConfig(**shape, tie_embeddings=_tied(r))),
              "gpt": gpt_params(GPTConfig(**shape, tie_embeddings=_tied(r)))}
    family = min(counts, key=lambda f: (abs(counts[f] - stated), f))
    other = "gpt" if family == "llama" else "llama"
    mlp = "a gated MLP (llama)" if family == "llama" else "a GELU MLP (gpt)"
    return family, (f"{mlp} for family {r['model_family']!r}: {counts[family] / 1e9:.2f}B parameters with this "
                    f"shape against {stated / 1e9:.2f}B stated ({counts[other] / 1e9:.2f}B as {other})")


FUSING_RUNTIMES = ("torch.compile", "Megatron-Core", "NeMo", "Transformer Engine")
"""Trainers whose rows run fused memory-bound kernels (`RuntimeOptions.fused_kernels`): a compiled model, or
Megatron-Core / NeMo, whose layers are Transformer Engine's fused modules."""


MEGATRON_SCHEDULES = frozenset({Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})
"""What Megatron-LM and Megatron-Core run: "two different pipeline parallelism schedules (one without interleaving
and one with interleaving ...)" (NVIDIA/Megatron-LM docs/api-guide/core/pipeline_parallel.md); no zero-bubble or
DualPipe schedule. DeepSpeed's pipeline engine runs 1F1B only (its `TrainSchedule`)."""


NAMED_INTERLEAVED = re.compile(r"\binterleav(?:ed|ing)\b")
"""Notes that name the interleaved schedule as the one the run used ("interleaved 1F1B pipeline schedule",
"pipeline with interleaving"), unless a negation precedes it (`_names_interleaved`)."""
_NEGATIONS = ("non-", "non ", "no ", "not ", "without ")


def _names_interleaved(low: str) -> bool:
    return any(not low[max(0, m.start() - 9):m.start()].endswith(_NEGATIONS) for m in NAMED_INTERLEAVED.finditer(low))


def trainer_schedules(text: str) -> frozenset[Schedule] | None:
    """The schedule families a row may have run, from its name and framework notes: the interleaved schedule alone
    where the notes name it (Meta's Llama 3 stack), else those its trainer runs; None for any."""
    low = text.lower()
    if _names_interleaved(low):
        return frozenset({Schedule.INTERLEAVED})
    if "deepspeed" in low:
        return frozenset({Schedule.ONE_F_ONE_B})
    if "megatron" in low or "nemo" in low:
        return MEGATRON_SCHEDULES
    return None


def _megatron_lm(text: str) -> bool:
    """Whether a row ran Megatron-LM itself (Megatron-Core, NeMo, Megatron-LM), not a Megatron-DeepSpeed fork."""
    low = text.lower()
    return ("megatron" in low or "nemo" in low) and "deepspeed" not in low


def _cross_entropy_of(text: str) -> CrossEntropy:
    """The loss kernel a row's trainer runs: Megatron-LM and its forks their in-place vocab-parallel cross-entropy,
    llm-foundry (Composer) flash-attn's fused one (`loss_fn` defaults to `fused_crossentropy` in
    llmfoundry/models/mpt/modeling_mpt.py), torchtitan PyTorch's under `loss_parallel()` when tp > 1 (on unless
    `disable_loss_parallel`; its loss was not compiled at the time of these rows), the others PyTorch's."""
    low = text.lower()
    if "megatron" in low or "nemo" in low:
        return CrossEntropy.INPLACE
    if "torchtitan" in low:
        return CrossEntropy.LOSS_PARALLEL
    return CrossEntropy.FUSED if _runs_composer(text) else CrossEntropy.TORCH


def _metric_passes_of(text: str) -> int:
    """Training-metric passes over the logits per micro-batch: MosaicML Composer updates llm-foundry MPT's two train
    metrics (LanguageCrossEntropy, LanguagePerplexity; llmfoundry/models/mpt/modeling_mpt.py) on every
    micro-batch (composer/trainer/trainer.py `_eval_train_metrics`, 2023)."""
    return 2 if _runs_composer(text) else 0


def _runs_composer(text: str) -> bool:
    """Whether a row ran MosaicML llm-foundry on Composer."""
    low = text.lower()
    return "llm-foundry" in low or "composer" in low


def _runs_fused_kernels(text: str) -> bool:
    """Whether a row's name and framework notes name a fusing runtime and not eager execution."""
    low = text.lower()
    return any(name.lower() in low for name in FUSING_RUNTIMES) and "eager" not in low


def _grads_in_training_dtype(framework: str) -> bool:
    """Whether a row's notes say its gradients were kept and reduced in bf16 (NeMo `grad_sync_dtype: bf16`,
    Megatron-LM `--grad-reduce-in-bf16`); unstated means fp32, every trainer's default."""
    low = framework.lower()
    return bool(re.search(r"grad_sync_dtype:? ?bf16|grad-reduce-in-bf16|gradients (?:kept and )?reduced in bf16",
                          low))


def _fp8_of(precision: str, zero: int | None, inferred: list[str], *, transformer_engine: bool = False
            ) -> Float8Recipe | None:
    """The FP8 recipe a row's precision column names ("float8 linear layers (torchao dynamic tensorwise ...)";
    on a Transformer Engine trainer, TE's delayed scaling unless the cell names a torchao recipe), noting in
    `inferred` what the row leaves unstated about it."""
    low = precision.lower()
    if "float8" not in low and "fp8" not in low:
        return None
    if transformer_engine and "torchao" not in low:
        if "current scaling" in low or "fp8-cs" in low:
            # TE's Float8CurrentScaling takes each activation's amax in the step before casting it: one more read
            # per cast than delayed scaling, whose other terms (weights cast once per step, fused casts) it shares.
            inferred.append("FP8 current scaling priced as Transformer Engine's delayed scaling: the amax pass "
                            "before each activation and gradient cast is not priced (the row's time is a bound "
                            "from below on that account)")
        elif "delayed" not in low:
            inferred.append("FP8 priced as Transformer Engine's delayed scaling (the trainer's default recipe)")
        return Float8Recipe.DELAYED
    recipe = Float8Recipe.ROWWISE if "rowwise" in low else Float8Recipe.TENSORWISE
    if recipe.fp8_all_gather and zero == 3:
        inferred.append("FSDP float8 all-gather (torchtitan's FP8 launch command in docs/float8.md and its 405B "
                        "config at the benchmark's commit set enable_fsdp_float8_all_gather)")
    return recipe


def load_published_runs(path: Path = PUBLISHED_CSV, *, out_of_sample: bool = False) -> list[PublishedRun]:
    """The rows of a CSV in `published_runs.csv`'s columns; a row that cannot be read (a shape or a speed that is
    not a number, a count of GPUs that does not divide) is skipped with a line on stderr naming it and why."""
    runs = []
    with open(path, newline="") as f:
        for line, r in enumerate(csv.DictReader(f), start=2):
            try:
                runs.append(dataclasses.replace(_published_row(r), out_of_sample=out_of_sample))
            except (ValueError, KeyError, TypeError) as e:
                print(f"{path.name}:{line}: row {(r.get('run') or '?')!r} skipped: {e}", file=sys.stderr)
    return runs


def _korthikanti_rows(r: dict[str, str]) -> list[PublishedRun]:
    layers, hidden, heads = int(r["num_layers"]), int(r["hidden_size"]), int(r["attention_heads"])
    tp, pp, dp = int(r["tensor_parallel"]), int(r["pipeline_parallel"]), int(r["data_parallel"])
    v = _int(r["interleave_stages"]) or 1
    sets = (f"layers={layers}", f"hidden={hidden}", f"heads={heads}", f"vocab={int(r['vocab'])}",
            "attn_impl=fused_softmax", "dropout=0.1", "fused_dropout_add=true")
    common = dict(family="gpt", sets=sets, seq=int(r["seq_len"]), device="a100-80gb",
                  num_gpus=int(r["num_gpus"]), gpus_per_node=min(8, int(r["num_gpus"])), tp=tp, pp=pp, cp=1, dp=dp,
                  global_batch=int(r["global_batch_size"]), microbatch_size=int(r["micro_batch_size"]),
                  virtual_stages=v, zero_stage=0, measured_memory_gib=None, counts="iteration time",
                  framework="Megatron-LM 2022, explicit attention (fused scale-mask-softmax) with dropout",
                  # Sec. 6.3: "no DP grad all-reduce overlap" in these runs; Megatron-LM of 2022 scattered and
                  # gathered pipeline sends without sequence parallelism (--scatter-gather-tensors-in-pipeline,
                  # on by default; Narayanan et al. 2021 Sec. 4.1).
                  # Megatron-LM of 2022 also reduced a column-parallel linear's input gradient during its
                  # weight-gradient GEMM (LinearWithGradAccumulationAndAsyncCommunication, on by default).
                  runtime=RuntimeOptions(dp_overlap=False, p2p_scatter_gather=True, tp_grad_overlap=True,
                                         tp_sharded_weights=tp > 1, p2p_transient_buffers=pp > 1))
    out = []
    for col, recompute, sp in (("full_recompute", Recompute.FULL, False),
                               ("present_work_seqpar_plus_selective", Recompute.SELECTIVE, True)):
        t = _float(r[col])
        if t is not None:
            label = "full" if recompute is Recompute.FULL else "selective+SP"
            out.append(PublishedRun(name=f"Korthikanti {r['model']} {r['table']} {label}", recompute=recompute,
                                    sequence_parallel=sp, measured_step_s=t, **common))
    return out


def load_korthikanti_runs(path: Path = KORTHIKANTI_CSV) -> list[PublishedRun]:
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["metric"] == "iteration_time_s"]
    return [run for r in rows for run in _korthikanti_rows(r)]


H800_GPU_HOURS_PER_TRILLION_TOKENS = 180e3
"""DeepSeek-V3 technical report (arXiv 2412.19437), Sec. 1 and 3.1: 180K H800 GPU hours per trillion training
tokens (2.664M GPU hours for 14.8T tokens of pre-training)."""


def deepseek_v3_run() -> PublishedRun:
    """DeepSeek-V3 pre-training as its report states it (arXiv 2412.19437): 2,048 H800 in nodes of 8 (Sec. 3.1),
    16-way pipeline (DualPipe), 64-way expert parallelism over 8 nodes and ZeRO-1 data parallelism, no tensor
    parallelism (Sec. 3.2), sequence 4,096 and a batch of 15,360 sequences after the ramp-up (Sec. 4.2), no token
    dropping (Sec. 2.1.2), FP8 mixed precision (Sec. 3.3); speed from the GPU hours per trillion tokens. Priced
    with what the cost model has of how it runs: the dispatch deduplicated per node (Sec. 3.2.2, `ep_dedup`;
    the node limit itself, 4 of 8 groups, comes from the traced router), DualPipe's forward and backward chunks
    paired to hide the all-to-alls (Sec. 3.2.1, `ep_overlap`, on 1F1B's steady-state pairs), and every GEMM in
    FP8, the routed experts' included (Sec. 3.3: Fprop, Dgrad and Wgrad of the linear layers; the recipe that
    converts grouped GEMMs here is Transformer Engine's, `Float8Recipe.DELAYED`)."""
    tokens_per_s_per_gpu = 1e12 / (H800_GPU_HOURS_PER_TRILLION_TOKENS * 3600)
    gpus, batch, seq = 2048, 15360, 4096
    return PublishedRun(
        name="DeepSeek-V3 671B on 2048 H800 (FP8 run, FP8 linears and experts priced)", family="hf:deepseek_v3",
        sets=(),
        seq=seq, device="h800", num_gpus=gpus, gpus_per_node=8, tp=1, pp=16, cp=1, dp=gpus // 16, ep=64,
        global_batch=batch, microbatch_size=None, virtual_stages=1, zero_stage=1, recompute=None,
        sequence_parallel=None, measured_step_s=batch * seq / (tokens_per_s_per_gpu * gpus),
        measured_memory_gib=None, counts="tokens/s per GPU (180K H800 GPU hours per trillion tokens)",
        framework="DeepSeek HAI-LLM: DualPipe, node-limited routing with deduplicated IB all-to-all, FP8",
        # HAI-LLM's pipeline engine is its own: its buffers priced as Megatron-LM's, freed per transfer.
        runtime=RuntimeOptions(ep_dedup=True, ep_overlap=True, fp8=Float8Recipe.DELAYED, p2p_transient_buffers=True),
        precision="fp8", unstated=("micro-batch", "recompute (the run recomputes RMSNorm and the MLA "
                                                  "up-projections, not a choice the planner has)"),
        inferred=("1F1B for DualPipe: DualPipeV is priced, but as torch runs it (a split backward that no "
                  "recomputation may rerun), and without recomputation this configuration needs 224 GiB per GPU; "
                  "1F1B has a larger bubble, and pairs its forward and backward passes only in the steady state",
                  "Transformer Engine's delayed-scaling FP8 for the report's per-tile FP8 recipe: every linear "
                  "layer and the routed experts' grouped GEMMs in FP8; its FP8 dispatch (dispatch bytes halved, "
                  "combine in bf16) stays bf16",
                  "no multi-token-prediction module (transformers' DeepseekV3 has none; the run adds one block)",
                  "routing at the default capacity 1.25 x mean for the busiest rank (the run drops no token)"))


def extra_runs() -> list[PublishedRun]:
    """Runs not in the shared CSVs, with their sources in the code."""
    return [deepseek_v3_run()]


def all_runs() -> list[PublishedRun]:
    return (load_published_runs() + load_korthikanti_runs() + extra_runs() + load_published_runs(FSDP_CSV, out_of_sample=True)
            + load_published_runs(FP8_CSV) + load_published_runs(SCALING_CSV, out_of_sample=True))


def schedule_of(run: PublishedRun) -> tuple[Schedule | None, int | None]:
    """The pinned schedule: interleaved when the source gives virtual stages > 1, else 1F1B when it gives them."""
    if run.pp == 1:
        return Schedule.ONE_F_ONE_B, 1
    if run.virtual_stages is None:
        return None, None
    if run.virtual_stages > 1:
        return Schedule.INTERLEAVED, run.virtual_stages
    return Schedule.ONE_F_ONE_B, 1


def stage_bounds(stage_layers: Sequence[int], num_segments: int, num_blocks: int) -> list[tuple[int, int]]:
    """Segment ranges of stages holding `stage_layers` blocks each; the leading/trailing segments (embedding,
    head) join the first/last stage."""
    lead = (num_segments - num_blocks) // 2
    bounds, pos = [], lead
    for n in stage_layers:
        bounds.append((pos, pos + n))
        pos += n
    bounds[0] = (0, bounds[0][1])
    bounds[-1] = (bounds[-1][0], num_segments)
    return bounds


@dataclass(frozen=True)
class Prediction:
    """The model's step time and peak memory for a run's configuration, and what the planner filled in."""

    step_s: float
    memory_gib: float
    mfu: float
    strategy: str
    chosen: str
    device_bound_s: float
    """Of `step_s`, the time that scales with the device's speed: compute, recompute, bubbles, optimizer."""
    breakdown: dict[str, float] = field(default_factory=dict)
    error_band: float = 0.0


def build_chain(run: PublishedRun, microbatch_size: int, dtype: str = "bfloat16"):
    """The run's model traced on `meta` at `microbatch_size` (zoo family with the published shape)."""
    import ir
    from models.registry import build_model

    built = build_model(run.family, run.sets, batch=microbatch_size, seq=run.seq, device="meta")
    graph = ir.trace(built.module, built.example_inputs, model_name=run.name, dtype=dtype)
    return ir.build_layer_chain(graph)


def cluster_of(run: PublishedRun, training_efficiency: float | None = None):
    """The run's cluster; `training_efficiency` replaces the catalog's (1.0 to fit it)."""
    from costmodel import Cluster

    cluster = Cluster.parse(run.cluster_spec)
    device = cluster.groups[0].device
    if training_efficiency is not None:
        device = dataclasses.replace(device, training_efficiency=training_efficiency)
    if run.memory_gb is not None:
        # The row's device has other memory than the catalog's (torchtitan's H100s: 96 GB HBM2e at 2.4 TB/s).
        # Read as the catalog reads its H100 (`costmodel.hardware.catalog`): the nominal GB are GiB of HBM stacks,
        # of which the driver reports the same share as of the 80 GB H100's (81,559 of 81,920 MiB).
        reported_share = get_device("h100-sxm").memory_bytes / (80 * 2 ** 30)
        device = dataclasses.replace(device, memory_bytes=int(run.memory_gb * 2 ** 30 * reported_share),
                                     memory_bandwidth=run.memory_bandwidth_tbps * 1e12)
    if run.power_capped_h100:
        # Tensor-core clocks fall with the power limit; memory-bound work keeps the HBM bandwidth above.
        scale = (1 + H100_NVL_DENSE_BF16_FLOPS / device.peak_flops["bfloat16"]) / 2
        device = dataclasses.replace(device, peak_flops={k: v * scale for k, v in device.peak_flops.items()})
    if device is not cluster.groups[0].device:
        cluster = dataclasses.replace(cluster, groups=(dataclasses.replace(cluster.groups[0], device=device),))
    if run.expert_imbalance is not None:
        cluster = dataclasses.replace(cluster, expert_imbalance=run.expert_imbalance)
    if run.inter_node_gbps is None or len(cluster.tiers) < 2:
        return cluster
    return cluster.with_tier(cluster.tiers[1].name, bandwidth=run.inter_node_gbps * 1e9)


def search_space(run: PublishedRun, zero_stage: int | None):
    """The row's pins; an unstated schedule ranges over the families its trainer runs (`trainer_schedules`). Nothing
    is offloaded to host memory unless the row's runtime says so: no source of these rows offloads, and a search
    free to offload would make a configuration that the model says does not fit look like a slower one that does
    (before this pin, llm-foundry MPT-760M was priced with the optimizer state on the CPU)."""
    from planner.search.space import SearchSpace

    schedule, v = schedule_of(run)
    return SearchSpace(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep, microbatch_size=run.microbatch_size,
                       schedule=schedule, schedules=run.schedules if schedule is None else None, virtual_stages=v, zero_stage=zero_stage,
                       recompute=run.recompute, sequence_parallel=run.sequence_parallel, runtime=run.runtime,
                       offload=run.runtime.offload)


def describe(strategy) -> str:
    """A strategy in the tables' short form."""
    s = strategy
    sched = s.schedule.value + (f":{s.virtual_stages}" if s.virtual_stages > 1 else "")
    return (f"dp{s.dp} tp{s.tp} pp{s.pp} cp{s.cp}{f' ep{s.ep}' if s.ep > 1 else ''} "
            f"mbs{s.microbatch_size}x{s.num_microbatches} {sched} "
            f"zero{s.zero_stage} {s.recompute.value}{'(part)' if any(st.recomputed for st in s.stages) else ''}"
            f"{' sp' if s.sequence_parallel else ''}"
            f"{f' offload-{s.runtime.offload.value}' if s.runtime.offload is not Offload.NONE else ''}")


PINNED_TIME_LIMIT_S = 300.0
"""Search limit for what a row leaves unstated: the slowest current row takes 84 s with its 60 s free plan
(bench/results/published_runs.json, "seconds"), so none is cut; a row whose search would run longer (a new one,
a held-out one) gets the best plan found within it instead of a wait."""


def predict(run: PublishedRun, chains: dict | None = None, training_efficiency: float | None = None
            ) -> Prediction:
    """Plan over what the source leaves unstated with the stated configuration pinned, and price it.

    The ZeRO stage, when unstated, is searched over 0 and 1 (Megatron-LM's replicated or distributed optimizer), and an
    unstated schedule over the families the trainer runs (`search_space`). What the source leaves unstated
    takes the fastest value the model finds, not the simplest within its error band: the run's authors tuned it.
    A run that pairs its passes to hide the expert all-to-alls (`RuntimeOptions.ep_overlap`, which the search does
    not price) is searched without it and its plan estimated with it.
    """
    from planner.api import plan
    from planner.errors import InfeasibleError

    chains = {} if chains is None else chains
    mbs = run.microbatch_size or 1
    key = (run.name, mbs)
    if key not in chains:
        chains[key] = build_chain(run, mbs)
    chain = chains[key]
    cluster = cluster_of(run, training_efficiency)
    best = None
    paired = run.runtime.ep_overlap
    for zero in ((run.zero_stage,) if run.zero_stage is not None else (0, 1)):
        space = search_space(run, zero)
        if paired:
            space = unpaired(space)
        try:
            p = plan(chain, None, cluster, global_batch=run.global_batch, space=space,
                     time_limit_s=PINNED_TIME_LIMIT_S, simplest_tie=False)
        except InfeasibleError:
            continue
        if paired:
            p = with_paired_overlap(p, chain, cluster, run.global_batch)
        if best is None or p.predicted.step_time_s < best.predicted.step_time_s:
            best = p
    chosen = ", ".join(run.unstated) or "-"
    if best is None:
        best, assumed = _priced_out_of_memory(run, chain, cluster)
        chosen = f"nothing fits: priced as is{f' with {assumed}' if assumed else ''}"
    est = best.predicted
    b = est.breakdown
    return Prediction(step_s=est.step_time_s, memory_gib=max(est.peak_memory_bytes) / GIB, mfu=est.mfu,
                      strategy=describe(best.strategy), chosen=chosen,
                      device_bound_s=b.compute_s + b.recompute_s + b.bubble_s + b.optimizer_s,
                      breakdown=b.to_dict(), error_band=est.error_band)


def unpaired(space):
    """`space` without the paired all-to-all overlap, which the search does not price (`with_paired_overlap`)."""
    return dataclasses.replace(space, runtime=dataclasses.replace(space.runtime, ep_overlap=False))


def with_paired_overlap(p, chain, cluster, global_batch: int):
    """The plan `p`, found without `RuntimeOptions.ep_overlap`, with its strategy estimated with it: the search
    refuses the overlap (its partition problems do not price it), an estimate prices it."""
    from planner.api import estimate

    strategy = dataclasses.replace(p.strategy, runtime=dataclasses.replace(p.strategy.runtime, ep_overlap=True))
    return dataclasses.replace(p, strategy=strategy, predicted=estimate(chain, cluster, strategy,
                                                                       global_batch=global_batch))


def _priced_out_of_memory(run: PublishedRun, chain, cluster):
    """The published configuration priced as is when the model says nothing fits (the run did: a memory error of
    the model, shown as such), with what the source leaves unstated set to its least-memory value (micro-batch 1,
    ZeRO-1, full recomputation, sequence parallelism, 1F1B where the row's schedule families allow it) and the
    fastest virtual-stage count where they do not; returns the plan and what was so assumed."""
    from planner.api import plan

    schedule, _ = schedule_of(run)
    one_f_one_b = schedule is None and (run.schedules is None or Schedule.ONE_F_ONE_B in run.schedules)
    defaults = {"micro-batch 1": run.microbatch_size is None, "ZeRO-1": run.zero_stage is None,
                "full recomputation": run.recompute is None,
                "sequence parallelism": run.sequence_parallel is None and run.tp > 1, "1F1B": one_f_one_b,
                "the fastest virtual stages": schedule is None and not one_f_one_b}
    space = search_space(run, 1 if run.zero_stage is None else run.zero_stage)
    space = dataclasses.replace(
        space, microbatch_size=run.microbatch_size or 1, recompute=run.recompute or Recompute.FULL,
        sequence_parallel=run.tp > 1 if run.sequence_parallel is None else run.sequence_parallel,
        **({"schedule": Schedule.ONE_F_ONE_B, "virtual_stages": 1, "schedules": None} if one_f_one_b else {}))
    unbounded = dataclasses.replace(cluster, groups=tuple(
        dataclasses.replace(g, device=dataclasses.replace(g.device, memory_bytes=UNBOUNDED_MEMORY_BYTES))
        for g in cluster.groups))
    priced = plan(chain, None, unbounded, global_batch=run.global_batch, space=space,
                  time_limit_s=PINNED_TIME_LIMIT_S, simplest_tie=False)
    return priced, ", ".join(k for k, on in defaults.items() if on)


UNBOUNDED_MEMORY_BYTES = 2 ** 60
"""Device memory for pricing a configuration the model says does not fit: no candidate is cut for memory, and
the predicted peak (which does not depend on the capacity) is reported against the measured one."""


FIT_GRID = tuple(round(0.5 + 0.005 * i, 3) for i in range(101))
"""Training efficiencies tried by the fit: 0.500 .. 1.000."""


def linearized_step(step_s: float, device_bound_s: float, efficiency: float) -> float:
    """Step time at `efficiency` from a prediction at 1: the device-bound part scales, the rest stays."""
    return step_s - device_bound_s + device_bound_s / efficiency


def fit_efficiency(rows: Sequence[tuple[float, float, float]]) -> float:
    """The efficiency minimizing the mean absolute relative error of (step at 1, device-bound, measured) rows."""
    def loss(f: float) -> float:
        return sum(abs(linearized_step(s, d, f) / m - 1) for s, d, m in rows) / len(rows)
    return min(FIT_GRID, key=lambda f: (loss(f), -f))


def leave_one_out(rows: Sequence[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Per row: (efficiency fitted without it, its relative error at that efficiency)."""
    out = []
    for i, (s, d, m) in enumerate(rows):
        f = fit_efficiency([r for j, r in enumerate(rows) if j != i])
        out.append((f, linearized_step(s, d, f) / m - 1))
    return out
