"""`LayerCost`: the price of one chain segment on one device for one micro-batch, under a fixed intra-op sharding.

It is the interface between intra-operator decisions (which op is sharded how, solved per layer class by the
planner's ILP or trivially replicated when tp == 1) and the inter-operator model (stages, pipeline schedule,
data parallelism, memory). Times are seconds; bytes are per device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class LayerCost:
    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float
    """Tensor/context-parallel communication on the forward critical path (not overlapped)."""
    bwd_comm_s: float
    param_count: int
    """Parameters held by this device for this segment (after tensor-parallel sharding, before ZeRO)."""
    param_bytes: int
    saved_bytes_none: int
    """Activations saved for backward with no recomputation."""
    saved_bytes_selective: int
    """Activations saved with selective recomputation (attention core dropped)."""
    saved_bytes_full: int
    """Activations saved with full recomputation (the segment input only)."""
    recompute_selective_s: float
    """Extra forward time in backward to recompute what selective recomputation dropped."""
    recompute_full_s: float
    """Extra time for full recomputation: the segment's forward compute plus its forward communication."""
    boundary_bytes: int
    """Activation bytes sent to the next stage if a pipeline cut follows this segment (per device)."""
    grad_sync_bytes: int = 0
    """Gradient bytes of parameters replicated inside the tensor-parallel group that must be all-reduced there."""
    peak_temp_bytes: int = 0
    """Largest transient buffer while running the segment (e.g. attention scores, logits)."""
    expert_param_count: int = 0
    """Of `param_count`, mixture-of-experts weights split over the expert-parallel axis (already divided by ep):
    data parallelism reduces and ZeRO shards them over dp*cp/ep ranks (`costmodel.expert_parallel`)."""
    tp_split_expert_params: int = 0
    """Of `param_count`, expert weights whose slots the tp ranks split (`costmodel.expert_parallel`): each rank's
    gradient is partial, summed over the tp group after the backward."""
    param_tensors: int = 0
    """Parameter tensors this segment owns (a weight first used by an earlier segment is not counted): the
    optimizer's per-tensor framework cost (`costmodel.framework`) counts tensors, not bytes."""
    dtensor_param_tensors: int = 0
    """Of `param_tensors`, those of nodes that run a sharded strategy (tp > 1): the runtime holds them as
    DTensors even without data parallelism (`estimate.dtensor_param_tensors`)."""
    grad_sync_tensors: int = 0
    """Tensors whose gradients make up `grad_sync_bytes` (each is synchronized on its own)."""
    saved_bytes_op: int = 0
    """Activations saved with per-op selective checkpointing (`Recompute.OP`: the segment input, every other
    matmul output and the attention outputs)."""
    recompute_op_s: float = 0.0
    """Extra forward time in backward under `Recompute.OP`: every op whose output is not kept, and the forward
    communication."""
    weight_grad_share: float = 0.0
    """Fraction of `bwd_compute_s` that computes weight gradients (`layer_pricing.weight_grad_share`): the work
    the zero-bubble schedules split off the backward and defer. A share, so that pricing that scales the backward
    (context and expert parallelism) keeps it."""
    fp8_weight_share: float = 0.0
    """Fraction of `param_count` that FP8 training converts (`costmodel.float8.fp8_weight_share`; 0 without FP8):
    ZeRO-3 with tensorwise scaling gathers those weights in FP8."""
    fp8_weight_cast_fwd_s: float = 0.0
    """Of `fwd_compute_s`, the casts of converted weights to FP8 (`operators.fp8_weight_cast_times`; 0 without
    FP8): with FSDP's FP8 all-gather each rank casts only its 1/dp shard (`costmodel.estimate`)."""
    fp8_weight_cast_bwd_s: float = 0.0
    """Of `bwd_compute_s`, the same for the backward's weight casts."""
    bwd_comm_async_s: float = 0.0
    """Of `bwd_comm_s`, what a trainer that reduces each column-parallel linear's input gradient during its
    weight-gradient GEMM hides (`RuntimeOptions.tp_grad_overlap`): per reduced gradient, min(its collective, the
    weight-gradient GEMMs of the linears that produce it)."""
    ep_comm_s: float = 0.0
    """Of `fwd_comm_s`, and likewise of `bwd_comm_s`, the expert-parallel all-to-alls (dispatch and combine,
    `costmodel.expert_parallel`): what DualPipe's paired chunks can hide (`RuntimeOptions.ep_overlap`)."""
    regathered_bytes_none: int = 0
    """Of `saved_bytes_none`, the inputs saved whole after an all-gather from a sequence shard (column-parallel
    inputs under sequence parallelism, beyond their 1/tp shard): DTensor's matmul keeps the gathered tensor,
    Megatron-LM's linear keeps the shard and gathers it again in backward (`regathered`)."""
    regathered_bytes_selective: int = 0
    """The same bytes of `saved_bytes_selective` (those of inputs outside the recomputed region)."""
    loss_elements: int = 0
    """Elements of the model output this device computes the training loss on (its local logits; 0 for every
    segment but the last): the loss's transient buffers depend on how the trainer computes it
    (`training_loss.loss_transient_bytes`), so they are added where the runtime is known (`memory.rank_memory`)."""

    def regathered(self) -> LayerCost:
        """This cost as Megatron-LM's linear runs it (`RuntimeOptions.tp_grad_overlap`): each column-parallel input
        gathered from a sequence shard is kept as the shard and gathered again in backward, overlapped with the
        gradient GEMMs (Korthikanti et al. 2022, Sec. 4.2.2; the 34/t of their activation formula)."""
        none = self.saved_bytes_none - self.regathered_bytes_none
        return replace(self, saved_bytes_none=none,
                       saved_bytes_selective=self.saved_bytes_selective - self.regathered_bytes_selective,
                       saved_bytes_full=min(self.saved_bytes_full, none), saved_bytes_op=min(self.saved_bytes_op, none),
                       regathered_bytes_none=0, regathered_bytes_selective=0)
