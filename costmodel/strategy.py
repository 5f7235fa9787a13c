"""A parallelization strategy: the typed answer to "how is this model split", priced by `costmodel.estimate`.

The planner searches over `Strategy` values; `stratagem estimate` builds one from flags. All fields are validated
here so that an invalid combination is reported once, where it enters, with the valid choices.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from costmodel.float8 import Float8Recipe

if TYPE_CHECKING:
    from ir.layer_chain import LayerChain


class Schedule(enum.StrEnum):
    """Pipeline schedule: GPipe, 1F1B and interleaved 1F1B (Narayanan et al., SC'21); the zero-bubble schedules,
    which split each backward into its input-gradient (B) and weight-gradient (W) parts and run W in the bubbles
    (Qi et al., ICLR 2024: ZB1P interleaved over v chunks, ZB-V), and DeepSeek's DualPipeV (DeepSeek-AI 2024,
    "DeepSeek-V3 Technical Report", Sec. 3.2.1, in its V-shaped one-direction form), as torch.distributed.pipelining
    runs them (`costmodel.pipeline` prices each)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"

    @property
    def chunked(self) -> bool:
        """Whether a rank may hold several model chunks (virtual stages)."""
        return self in _CHUNKED

    @property
    def v_shape(self) -> bool:
        """Whether rank r holds virtual stages r and 2p - 1 - r (exactly two: the V), instead of r, r + p, ..."""
        return self in (Schedule.ZBV, Schedule.DUALPIPEV)

    @property
    def zero_bubble(self) -> bool:
        """Whether the backward is split into input-gradient and weight-gradient work, the latter filling bubbles."""
        return self in (Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV)

    def label(self, virtual_stages: int) -> str:
        """How the CLI and the reports write it: "interleaved:4", "interleaved-zb:2", "zbv", "1f1b"."""
        return f"{self.value}:{virtual_stages}" if virtual_stages > 1 and not self.v_shape else self.value


_CHUNKED = frozenset({Schedule.INTERLEAVED, Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV})

SCHEDULE_CHOICES = "gpipe, 1f1b, interleaved:V, interleaved-zb[:V], zbv, dualpipev"
"""How a schedule is written on the command line (V: model chunks per rank)."""


def parse_schedule(text: str) -> tuple[Schedule, int | None]:
    """"interleaved:4" -> (INTERLEAVED, 4); "zbv" -> (ZBV, 2); "interleaved-zb" -> (INTERLEAVED_ZB, None): the
    chunks per rank when the text fixes them (the V-shaped schedules always have two), else None. Raises
    ValueError naming the valid forms."""
    name, colon, v = text.strip().lower().partition(":")
    try:
        schedule = Schedule(name)
    except ValueError:
        raise ValueError(f"unknown schedule {text!r}; valid: {SCHEDULE_CHOICES}") from None
    if not colon:
        return schedule, 2 if schedule.v_shape else None
    if schedule not in (Schedule.INTERLEAVED, Schedule.INTERLEAVED_ZB):
        raise ValueError(f"only interleaved and interleaved-zb take :V, got {text!r}; valid: {SCHEDULE_CHOICES}")
    least = 2 if schedule is Schedule.INTERLEAVED else 1
    if not v.isdigit() or int(v) < least:
        raise ValueError(f"{schedule.value} needs :V with V >= {least} chunks per rank, e.g. {schedule.value}:2; "
                         f"got {text!r}")
    return schedule, int(v)


class Recompute(enum.StrEnum):
    """Activation recomputation of a layer (Korthikanti et al. 2022)."""

    NONE = "none"
    SELECTIVE = "selective"  # recompute the attention core (softmax, dropout, QK^T, AV) only
    FULL = "full"            # keep only the layer input, recompute the whole forward in backward
    OP = "op"
    """Per-op selective checkpointing as torchtitan runs it (`activation_checkpoint.selective_ac_option = "op"`):
    keep the layer input, every other matmul output (the 1st, 3rd, ...) and the attention outputs; recompute
    everything else (norms, activations, the other matmuls) in backward (`costmodel.layer_pricing`)."""


class CrossEntropy(enum.StrEnum):
    """How the trainer computes the softmax cross-entropy loss on the logits (`costmodel.training_loss` prices its
    memory and time)."""

    TORCH = "torch"
    """PyTorch's `cross_entropy(logits.float(), labels)`: `planner.parallelize`, torchtitan, Hugging Face models."""
    INPLACE = "inplace"
    """In place in the fp32 copy of the logits: Megatron-LM's vocab-parallel cross-entropy (Megatron-Core, NeMo,
    the Megatron-DeepSpeed forks)."""
    FUSED = "fused"
    """One kernel each way on the 16-bit logits, which it keeps, with an fp32 log-sum-exp per row: flash-attn's
    cross-entropy (`flash_attn.losses.cross_entropy`), MosaicML llm-foundry's default `fused_crossentropy`."""
    LOSS_PARALLEL = "loss-parallel"
    """PyTorch's `cross_entropy(logits.float(), labels)` under `loss_parallel()` on vocabulary-sharded DTensor
    logits: DTensor's own log-softmax and nll-loss decompositions (`torch.distributed.tensor.parallel.loss`), which
    hold more fp32 copies than the fused ATen kernels. torchtitan's loss (unless `disable_loss_parallel`): under
    `loss_parallel()` when tp > 1, `TORCH` otherwise (`RuntimeOptions.loss_kernel`)."""


CROSS_ENTROPY_CHOICES = ", ".join(c.value for c in CrossEntropy)
MAX_METRIC_PASSES = 8
"""Most loss-metric passes a runtime may state (`RuntimeOptions.metric_passes`): trainers compute one or two."""


class Offload(enum.StrEnum):
    """What of the model state lives in host memory instead of on the device (`costmodel.offload` prices it)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    """ZeRO-Offload (Ren et al., ATC'21): the fp32 master weights and Adam moments on the host and the Adam step on
    the CPU; gradients go device-to-host, updated 16-bit weights host-to-device (DeepSpeed `offload_optimizer`,
    Megatron-LM `--optimizer-cpu-offload`). `planner.parallelize` does not run it: plans with it are for export."""
    PARAMS = "params"
    """FSDP2's `CPUOffloadPolicy` (ZeRO-3 only): sharded parameters, gradients and optimizer state on the host;
    each unit's shard is copied host-to-device before its all-gather, its reduce-scattered gradient
    device-to-host, and the optimizer steps on the CPU (DeepSpeed `offload_param` + `offload_optimizer`,
    torchtitan `enable_cpu_offload`)."""


OFFLOAD_CHOICES = ", ".join(o.value for o in Offload)


class MeshAxis(enum.StrEnum):
    """Axes of the device mesh. "axis" names a mesh axis, "dim" a tensor dimension."""

    TP = "tp"
    CP = "cp"
    EP = "ep"
    DP = "dp"
    PP = "pp"


DEFAULT_MESH_ORDER: tuple[MeshAxis, ...] = (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.DP, MeshAxis.PP)
"""Innermost (fastest-varying rank, fastest network tier) first, as Megatron-LM orders ranks."""


@dataclass(frozen=True, slots=True)
class RuntimeOptions:
    """How the training framework runs the strategy, where frameworks differ and the difference is priced.

    The defaults are what `planner.parallelize` runs (FSDP2 / replicate, eager TP). `stratagem estimate` takes
    each as a flag so that a configuration run by another trainer (Megatron-LM, torchtitan, DeepSpeed) is priced
    as that trainer runs it."""

    dp_overlap: bool = True
    """Data-parallel communication overlaps computation: gradient reduction during the backward (DDP buckets,
    FSDP2, Megatron-LM `--overlap-grad-reduce`) and ZeRO weight gathers during the forward (FSDP2 prefetch,
    Megatron-LM `--overlap-param-gather`). False: they run between the passes and the optimizer, exposed (Megatron-LM
    of 2022: "no DP grad all-reduce overlap", Korthikanti et al. 2022 Sec. 6.3)."""
    reshard_after_forward: bool = True
    """ZeRO-3: free each unit's gathered weights after its forward and gather them again for its backward (FSDP2's
    default). False keeps the rank's gathered 16-bit weights from forward to backward: one gather per micro-batch
    instead of two, for the memory of the whole gathered stage."""
    tp_overlap: bool = False
    """Tensor-parallel collectives pipelined with the GEMMs beside them in tp chunks (Transformer Engine userbuffers,
    Megatron-Core `--tp-comm-overlap`). `planner.parallelize` does not run it: plans with it are for export."""
    tp_grad_overlap: bool = False
    """The input-gradient reduction of each column-parallel linear (all-reduce; reduce-scatter under sequence
    parallelism) runs while the same linear computes its weight gradient, so at most the part longer than that
    GEMM shows (`LayerCost.bwd_comm_async_s`). Megatron-LM's asynchronous tensor-model-parallel all-reduce
    (`LinearWithGradAccumulationAndAsyncCommunication`; on unless `--no-async-tensor-model-parallel-allreduce`,
    whose help reads "asynchronous execution of tensor-model-parallel all-reduce with weight gradient computation
    of a column-linear layer"). The same autograd function keeps a sequence-parallel input as its shard and
    gathers it again in backward (`LayerCost.regathered`), where DTensor keeps the gathered tensor.
    `planner.parallelize` (eager DTensor) does not run it: plans with it are for export."""
    offload: Offload = Offload.NONE
    """Model state kept in host memory (`Offload`); the search chooses it when the device memory binds."""
    fp8: Float8Recipe | None = None
    """Linear layers trained in FP8 with this scaling recipe (torchao float8 training, as torchtitan converts
    them; `costmodel.float8` says what is priced); None trains every op in the training dtype. Needs FP8 tensor
    cores (a device with an FP8 peak in the catalog)."""

    fused_kernels: bool = False
    """The memory-bound ops between GEMMs and attention run as fused kernels (`ir.fusion`: one HBM pass per
    connected run of norms, activations, residual adds and rotary embeddings, whose intermediates backward
    recomputes instead of keeping): torch.compile (torchtitan `compile.enable`), Megatron-Core with Transformer
    Engine. False: one eager kernel per op, as `planner.parallelize` runs the model. `planner.parallelize` does not
    compile the model: plans with it are for export or for a runtime that compiles."""

    p2p_scatter_gather: bool = False
    """Pipeline sends without sequence parallelism: each tensor-parallel rank sends its 1/tp slice of the
    replicated boundary activation and the receiving stage all-gathers it over its tp group (Narayanan et al.,
    SC'21, Sec. 4.1 "scatter/gather communication optimization"; Megatron-LM's default until Megatron-Core, and
    DeepSpeed's pipeline engine `pipe_partitioned` / `grad_partitioned`, default true). False: every tp rank sends
    the whole activation (torch.distributed.pipelining, Megatron-Core)."""
    p2p_blocking: bool = False
    """Every pipeline send and receive is its own blocking operation, so the sender waits as long as the receiver
    and a step's two transfers do not overlap (DeepSpeed's pipeline engine: `SendActivation`, `RecvGrad`, ... as
    separate instructions of its `TrainSchedule`). False: a step's send is paired with its receive and waited
    later (Megatron-LM's `send_forward_recv_backward`, torch.distributed.pipelining's batched p2p), so only the
    receiver waits."""
    p2p_overlap: bool = False
    """The interleaved schedule posts each chunk's pipeline sends and receives without waiting and waits only
    before their data is used, so in the steady state a transfer runs while another chunk computes and only the
    fill and drain wait for it (`costmodel.pipeline`, "Pipeline send/recv"): Megatron-Core's `overlap_p2p_comm`,
    on by default in Megatron-LM (`--no-overlap-p2p-communication` turns it off) and in NeMo's configs. Only the
    interleaved schedule has it (1F1B and the zero-bubble schedules are priced with blocking sends either way).
    False: every send blocks (Megatron-LM of 2021-22). `planner.parallelize` runs interleaved plans with torch's
    `ScheduleInterleaved1F1B`, whose runtime (`_PipelineScheduleRuntime` in torch 2.13) also posts each send
    without waiting (all are waited at the end of the step) and each receive where the peer sends it
    (`_add_send_recv`), waiting only before the chunk that reads it: it runs such a plan as priced; the planner
    still prices its own plans with blocking sends unless this is set (an upper bound, until a measurement says
    which is closer)."""
    p2p_transient_buffers: bool = False
    """Pipeline receive buffers live only for their transfer and a sent activation is freed once sent: Megatron-LM
    allocates each receive with `torch.empty` when it is posted (megatron/core/pipeline_parallel/
    p2p_communication.py) and pseudo-frees each stage output after its send (`deallocate_output_tensor`);
    DeepSpeed's pipeline engine holds an input and an output buffer per micro-batch in flight (`num_pipe_buffers`):
    the inputs are saved activations, the outputs (a boundary activation per micro-batch in flight) are not
    priced. False: torch.distributed.pipelining (`planner.parallelize`, torchtitan), whose
    stages allocate a forward-receive and a gradient-receive buffer for every micro-batch of the step and keep them
    from step to step (`PipelineStage._setup_forward_recv_info`, `_setup_backward_recv_info`), and keep each
    in-flight micro-batch's stage output in `fwd_cache` until its backward (`costmodel.memory`, pipeline buffers).
    Only memory changes. `planner.parallelize` does not run it: plans with it are for export."""
    pp_returns_outputs: bool = False
    """The pipeline schedule returns the last stage's outputs: torch.distributed.pipelining's `schedule.step` keeps
    every micro-batch's output (a language model's logits) in `output_chunks` until the step ends and then
    concatenates them when called with `return_outputs=True`, its default, as torchtitan's trainer calls it
    (torchtitan/train.py `forward_backward_step`). False: `return_outputs=False` (`planner.parallelize`). Only
    memory changes, and only under torch.distributed.pipelining (`p2p_transient_buffers` false)."""
    ep_dedup: bool = False
    """Expert-parallel dispatch and combine send a token once per destination node across nodes and forward it to
    its experts' GPUs over NVLink (DeepSeek-V3's node-limited dispatch, arXiv 2412.19437 Sec. 3.2.2; DeepEP's
    internode kernels); `costmodel.expert_parallel` prices the volumes, bounded by the model's group-limited
    routing where it has one. False: a plain all-to-all of every token choice (torch `all_to_all_single`,
    Megatron-Core's alltoall dispatcher). `planner.parallelize` does not run it: plans with it are for export."""
    ep_overlap: bool = False
    """DualPipe's overlapped forward and backward chunks (DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.1 and Figure 4):
    in each F&B pair of the DualPipeV schedule, the forward's expert-parallel all-to-alls run while the backward
    computes and the backward's while the forward computes (`costmodel.pipeline`, "Paired all-to-all overlap").
    False: the pair's chunks run one after the other (torch's `ScheduleDualPipeV` without a custom OVERLAP_F_B
    function). Megatron-Core pairs the steady state of 1F1B and interleaved 1F1B the same way
    (`--overlap-moe-expert-parallel-comm`, NeMo's `moe_a2a_overlap`). Needs one of those schedules
    (`pipeline.PAIRED_SCHEDULES`); `planner.parallelize` does not run it: plans with it are for export."""

    tp_sharded_weights: bool = False
    """Every linear layer's and the token embedding's weight is split over the tensor-parallel ranks (column, row
    or vocabulary parallel), as the tensor-parallel plans of Megatron-LM and torchtitan run them (a learned
    position embedding is left to the search: Megatron-LM replicates it). False lets the intra-operator search
    also keep such a weight whole on every tp rank and split the op by sequence (`costmodel.sharding.rules`),
    which `planner.parallelize` runs but those trainers do not."""
    fp32_grad_pass: bool = False
    """After every micro-batch's backward a separate memory-bound pass adds the 16-bit gradients into fp32
    gradient buffers (`step_time.fp32_grad_pass_time`): DeepSpeed's pipeline engine in bf16, which runs its
    BF16_Optimizer (ZeRO-2/3 are refused there), clears the bf16 gradients before each backward and calls
    `update_hp_grads` after it (deepspeed/runtime/pipe/engine.py `_exec_backward_pass`), each gradient upcast and
    added, `hp_grad.add_(lp.grad.to(fp32))`. False: no separate pass is priced (Megatron-LM accumulates into its fp32
    main grads inside the weight-gradient GEMM, `--gradient-accumulation-fusion`). `planner.parallelize` does not
    run it: plans with it are for export."""
    grads_in_training_dtype: bool = False
    """Gradient buffers are kept and reduced over the data-parallel ranks in the 16-bit training dtype, 2 bytes
    per parameter instead of fp32's 4 (`grad_bytes`): Megatron-LM `--grad-reduce-in-bf16`, NeMo's
    `grad_sync_dtype: bf16` (the Nemotron-4 340B launcher config, NeMo-Framework-Launcher conf/training/nemotron/
    nemotron_340b.yaml). False: fp32, Megatron-LM's default for bf16 (`--accumulate-allreduce-grads-in-fp32` is
    forced on) and FSDP2's `reduce_dtype=float32` (`costmodel.memory`). `planner.parallelize` does not run it: plans
    with it are for export."""

    cross_entropy: CrossEntropy = CrossEntropy.TORCH
    """The loss kernel (`CrossEntropy`): what it keeps for backward, its transient buffers and its passes over the
    logits (`costmodel.training_loss`). `planner.parallelize` runs `torch`: plans with another are for export."""
    metric_passes: int = 0
    """Forward passes of PyTorch's cross-entropy over the logits, without gradient, that the trainer adds to every
    micro-batch for its training metrics (`training_loss.metric_pass_time`): MosaicML Composer updates its model's
    train metrics on each micro-batch's outputs after the backward (`Trainer._eval_train_metrics`), and
    llm-foundry's MPT has two, LanguageCrossEntropy and LanguagePerplexity, each a `CrossEntropyLoss` of the
    logits: 2. `planner.parallelize` computes none: plans with them are for export."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "offload", Offload(self.offload))
        except ValueError:
            raise ValueError(f"offload must be one of {OFFLOAD_CHOICES}, got {self.offload!r}") from None
        if self.fp8 is not None:
            object.__setattr__(self, "fp8", Float8Recipe(self.fp8))
        if not isinstance(self.metric_passes, int) or isinstance(self.metric_passes, bool) \
                or not 0 <= self.metric_passes <= MAX_METRIC_PASSES:
            raise ValueError(f"metric_passes must be an integer from 0 to {MAX_METRIC_PASSES}, "
                             f"got {self.metric_passes!r}")
        try:
            object.__setattr__(self, "cross_entropy", CrossEntropy(self.cross_entropy))
        except ValueError:
            raise ValueError(f"cross_entropy must be one of {CROSS_ENTROPY_CHOICES}, got {self.cross_entropy!r}"
                             ) from None

    def grad_bytes(self, training_bytes: int) -> int:
        """Bytes per parameter of the gradient buffers and their data-parallel reduction when the training dtype
        takes `training_bytes` (`grads_in_training_dtype`; fp32, `memory.GRAD_BYTES`, otherwise)."""
        return training_bytes if self.grads_in_training_dtype else FP32_BYTES

    def loss_kernel(self, tp: int) -> CrossEntropy:
        """The loss kernel at tensor-parallel degree `tp`: `LOSS_PARALLEL` is torchtitan's loss, which is under
        `loss_parallel()` only when tp > 1 and PyTorch's own kernels otherwise."""
        if self.cross_entropy is CrossEntropy.LOSS_PARALLEL and tp == 1:
            return CrossEntropy.TORCH
        return self.cross_entropy

    def keeps_p2p_buffers(self, pp: int) -> bool:
        """Whether pipeline buffers are kept for every micro-batch of the step (`p2p_transient_buffers`)."""
        return pp > 1 and not self.p2p_transient_buffers

    def priced_chain(self, chain: LayerChain) -> LayerChain:
        """`chain` with its kernels as this runtime runs them: fused (`LayerChain.fused_kernels`) or as traced."""
        if chain.fused and not self.fused_kernels:
            raise ValueError("this chain is priced with fused kernels; pass the traced chain to price eager ops")
        return chain.fused_kernels if self.fused_kernels else chain

    def to_dict(self) -> dict[str, Any]:
        # Options added later are written only when set: plans written before them read back unchanged.
        out: dict[str, Any] = {name: getattr(self, name) for name in RUNTIME_FLAGS
                               if name not in _LATER_FLAGS or getattr(self, name)}
        if self.offload is not Offload.NONE:
            out["offload"] = self.offload.value
        if self.fp8 is not None:
            out["fp8"] = self.fp8.value
        if self.cross_entropy is not CrossEntropy.TORCH:
            out["cross_entropy"] = self.cross_entropy.value
        if self.metric_passes:
            out["metric_passes"] = self.metric_passes
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RuntimeOptions:
        unknown = set(d) - set(RUNTIME_OPTION_NAMES)
        if unknown:
            raise ValueError(f"unknown runtime options {sorted(unknown)}; valid: {', '.join(RUNTIME_OPTION_NAMES)}")
        flags = {k: bool(v) for k, v in d.items() if k in RUNTIME_FLAGS}
        fp8 = d.get("fp8")
        return cls(**flags, offload=Offload(d.get("offload", "none")),
                   fp8=Float8Recipe(fp8) if fp8 is not None else None,
                   cross_entropy=d.get("cross_entropy", CrossEntropy.TORCH.value),
                   metric_passes=d.get("metric_passes", 0))


FP32_BYTES = 4
"""Bytes of an fp32 gradient (`memory.GRAD_BYTES` is this)."""
RUNTIME_FLAGS = ("dp_overlap", "reshard_after_forward", "tp_overlap", "p2p_scatter_gather", "p2p_blocking",
                 "tp_grad_overlap", "ep_dedup", "ep_overlap", "fused_kernels", "fp32_grad_pass", "tp_sharded_weights",
                 "grads_in_training_dtype", "p2p_overlap", "p2p_transient_buffers", "pp_returns_outputs")
"""The true/false fields of `RuntimeOptions`, in the order plans write them."""
_LATER_FLAGS = frozenset({"p2p_scatter_gather", "p2p_blocking", "tp_grad_overlap", "ep_dedup", "ep_overlap",
                          "fused_kernels", "fp32_grad_pass", "tp_sharded_weights", "grads_in_training_dtype",
                          "p2p_overlap", "p2p_transient_buffers", "pp_returns_outputs"})
RUNTIME_OPTION_NAMES = (*RUNTIME_FLAGS, "offload", "fp8", "cross_entropy", "metric_passes")
"""Every field of `RuntimeOptions` (the keys of its JSON)."""



@dataclass(frozen=True, slots=True)
class StageSpec:
    """One pipeline stage (or virtual stage): segments `[start, stop)` of the layer chain."""

    start: int
    stop: int
    recompute: Recompute = Recompute.NONE
    device_group: str | None = None
    """Name of the cluster device group that runs this stage (None: the cluster's only group)."""
    recomputed: tuple[int, ...] | None = None
    """Partial recomputation: the segments (chain indices in `[start, stop)`) that run `recompute`; the others
    keep all their activations (Megatron-LM's `--recompute-num-layers`, torchtitan's every-Nth-layer
    checkpointing). None: every segment of the stage runs `recompute`."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"stage segment range [{self.start}, {self.stop}) is empty or negative")
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.recomputed is not None:
            chosen = tuple(sorted({int(i) for i in self.recomputed}))
            if any(not self.start <= i < self.stop for i in chosen):
                raise ValueError(f"recomputed segments {list(chosen)} must lie in the stage's range "
                                 f"[{self.start}, {self.stop})")
            object.__setattr__(self, "recomputed", chosen)

    @property
    def num_segments(self) -> int:
        return self.stop - self.start

    def segment_recompute(self, index: int) -> Recompute:
        """The recomputation of chain segment `index` (in this stage)."""
        if self.recomputed is None or index in self.recomputed:
            return self.recompute
        return Recompute.NONE

    @property
    def recomputed_share(self) -> float:
        """The fraction of the stage's segments that run `recompute`."""
        return 1.0 if self.recomputed is None else len(self.recomputed) / self.num_segments

    @property
    def recompute_label(self) -> str:
        """The stage's recomputation as reports print it: the mode, or "mode k/n" on k of its n segments."""
        if self.recomputed is None:
            return self.recompute.value
        if not self.recomputed:
            return Recompute.NONE.value
        return f"{self.recompute.value} {len(self.recomputed)}/{self.num_segments}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"start": self.start, "stop": self.stop, "recompute": self.recompute.value,
                               "device_group": self.device_group}
        if self.recomputed is not None:
            out["recomputed"] = list(self.recomputed)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StageSpec:
        chosen = d.get("recomputed")
        return cls(start=int(d["start"]), stop=int(d["stop"]), recompute=Recompute(d["recompute"]),
                   device_group=d.get("device_group"), recomputed=None if chosen is None else tuple(chosen))


def expert_span(tp: int, dp: int, ep: int) -> tuple[int, int] | None:
    """(tp ranks, dp coordinates) an expert-parallel group spans, None when `ep` fits neither way.

    The ep ranks of a pipeline stage are its tp x dp ranks, tp fastest, and a group is `ep` consecutive ones
    (Megatron-Core's MoE parallel folding with expert tensor parallel size 1, Liu et al. 2025, arXiv 2504.14960):
    inside one tp group when ep divides tp, else whole tp groups of ep / tp consecutive dp coordinates. Context-
    parallel ranks hold the same experts (tp = 1: ep consecutive dp coordinates, as in GShard)."""
    if tp % ep == 0:
        return ep, 1
    if ep % tp == 0 and dp % (ep // tp) == 0:
        return tp, ep // tp
    return None


def expert_tp_replicas(tp: int, ep: int) -> int:
    """Ranks of one tp group that hold the same experts (`expert_span`): tp / ep when an ep group lies inside the
    tp group, 1 when ep groups take whole tp groups."""
    return tp // math.gcd(tp, ep)


def expert_span_problem(tp: int, dp: int, ep: int) -> str:
    """The one-line error for an ep that `expert_span` rejects."""
    valid = sorted({e for e in range(1, tp + 1) if tp % e == 0} | {tp * d for d in range(1, dp + 1) if dp % d == 0})
    return (f"ep={ep} must divide tp={tp} or be tp times a divisor of dp={dp} (an expert-parallel group is "
            f"consecutive tp x dp ranks); valid ep: {', '.join(map(str, valid))}")


@dataclass(frozen=True, slots=True)
class Strategy:
    """Degrees and settings of one training step. `dp * tp * pp * cp * ep`... see `num_devices`.

    Expert parallelism reuses tensor- and data-parallel ranks (`expert_span`, as in Megatron-Core) and does not
    multiply the device count. `stages` lists `pp * virtual_stages` stages in pipeline order; when empty, the
    estimator splits the chain evenly and applies `recompute` everywhere.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatch_size: int = 1
    num_microbatches: int = 1
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: Recompute = Recompute.NONE
    stages: tuple[StageSpec, ...] = ()
    cp: int = 1
    ep: int = 1
    mesh_order: tuple[MeshAxis, ...] = DEFAULT_MESH_ORDER
    runtime: RuntimeOptions = RuntimeOptions()

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "microbatch_size", "num_microbatches", "virtual_stages", "cp", "ep"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        object.__setattr__(self, "mesh_order", tuple(MeshAxis(a) for a in self.mesh_order))
        if not isinstance(self.runtime, RuntimeOptions):
            raise ValueError(f"runtime must be a RuntimeOptions, got {type(self.runtime).__name__}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.runtime.offload is Offload.PARAMS and self.zero_stage != 3:
            raise ValueError(f"offload=params (FSDP2 CPUOffloadPolicy) keeps sharded parameters on the host and "
                             f"needs zero_stage 3, got {self.zero_stage}; use offload=optimizer with ZeRO-"
                             f"{self.zero_stage}")
        if sorted(self.mesh_order) != sorted(DEFAULT_MESH_ORDER):
            raise ValueError(f"mesh_order must order each of {[a.value for a in DEFAULT_MESH_ORDER]} once")
        if self.virtual_stages > 1 and not self.schedule.chunked:
            raise ValueError(f"virtual_stages > 1 needs a schedule with model chunks (interleaved, interleaved-zb, "
                             f"zbv, dualpipev), not {self.schedule.value!r}")
        if self.schedule.v_shape and self.virtual_stages != 2:
            raise ValueError(f"{self.schedule.value} runs exactly two chunks per rank (the V), got virtual_stages="
                             f"{self.virtual_stages}")
        if self.schedule.chunked and self.pp == 1:
            raise ValueError(f"the {self.schedule.value} schedule needs pp > 1")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1")
        if expert_span(self.tp, self.dp, self.ep) is None:
            raise ValueError(expert_span_problem(self.tp, self.dp, self.ep))
        if self.stages and len(self.stages) != self.pp * self.virtual_stages:
            raise ValueError(f"{len(self.stages)} stages given, pp*virtual_stages={self.pp * self.virtual_stages}")

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def ep_dp(self) -> int:
        """Data-parallel coordinates an expert-parallel group spans (`expert_span`)."""
        span = expert_span(self.tp, self.dp, self.ep)
        assert span is not None  # validated in __post_init__
        return span[1]

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatch_size * self.num_microbatches

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep,
            "microbatch_size": self.microbatch_size, "num_microbatches": self.num_microbatches,
            "schedule": self.schedule.value, "virtual_stages": self.virtual_stages,
            "zero_stage": self.zero_stage, "sequence_parallel": self.sequence_parallel,
            "recompute": self.recompute.value,
            "stages": [s.to_dict() for s in self.stages],
            "mesh_order": [a.value for a in self.mesh_order],
            "runtime": self.runtime.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Strategy:
        return cls(
            dp=d["dp"], tp=d["tp"], pp=d["pp"], cp=d.get("cp", 1), ep=d.get("ep", 1),
            microbatch_size=d["microbatch_size"], num_microbatches=d["num_microbatches"],
            schedule=Schedule(d["schedule"]), virtual_stages=d["virtual_stages"],
            zero_stage=d["zero_stage"], sequence_parallel=d["sequence_parallel"],
            recompute=Recompute(d.get("recompute", "none")),
            stages=tuple(StageSpec.from_dict(s) for s in d["stages"]),
            mesh_order=tuple(MeshAxis(a) for a in d.get("mesh_order", [a.value for a in DEFAULT_MESH_ORDER])),
            runtime=RuntimeOptions.from_dict(d.get("runtime", {})),
        )


