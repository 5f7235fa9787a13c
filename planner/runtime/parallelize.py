"""Apply a `Plan` to a model on this rank: tensor parallelism, recomputation, pipeline stages, data parallelism.

`parallelize(model, plan)` is called on every rank under torchrun with the same (identically initialized)
model. The order follows torchtitan: tensor parallelism first (DTensor parameters), expert parallelism (this
rank's experts, all-to-all routing), context parallelism (attention over the cp ranks' keys), then activation
checkpointing, the sequence split hooks, the pipeline split, and FSDP2 / replication over the dp (x cp) ranks per
model part. The result is a `ParallelModel` that `planner.runtime.train_step.train_step` drives, pipelined or not.

A plan is refused (`PlanLoadError`) when it was made for another world size, another parameter count or, when
the layer chain is known, another traced graph (fingerprint).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from costmodel.estimate import recomputes
from costmodel.pipeline import split_backward_problem, stage_rank
from costmodel.rank_layout import even_stages
from costmodel.strategy import CrossEntropy, Offload, Schedule, StageSpec, Strategy
from ir.layer_chain import LayerChain
from planner.errors import PlanLoadError, UserError
from planner.plan import Plan
from planner.runtime.apply_cp import (
    CpGroup,
    SequenceShard,
    apply_context_parallel,
    install_gather_hook,
    install_split_hook,
)
from planner.runtime.apply_ep import EpGroup, apply_expert_parallel, apply_expert_token_split, experts_modules
from planner.runtime.apply_fp8 import apply_fp8, fp8_runtime_problem
from planner.runtime.apply_fsdp import apply_data_parallel
from planner.runtime.apply_pipeline import (
    build_schedule,
    build_stage_modules,
    module_segments,
    module_stages,
    stage_indices_of_rank,
)
from planner.runtime.apply_recompute import apply_recompute
from planner.runtime.apply_tp import (
    BLOCKS_ATTR,
    apply_tensor_parallel,
    install_sequence_parallel_hooks,
    shared_parameters,
)
from planner.runtime.device_mesh import (
    MeshLayout,
    PlanMeshes,
    build_mesh,
    check_world_size,
    derive_meshes,
    mesh_layout,
)
from planner.tracing import trace_one_sample

LossFn = Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]
"""`loss_fn(output, batch)`: a scalar loss of a (micro-)batch, a mean over its samples (the zoo's `loss`)."""


def model_output_is_loss(output: Any, _batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Default loss: the model's forward already returns the scalar loss."""
    if not isinstance(output, torch.Tensor) or output.numel() != 1:
        raise UserError("the model does not return a scalar loss; pass loss_fn=(output, batch) -> loss")
    return output.reshape(())


class MicrobatchLoss:
    """The pipeline schedule's `loss_fn(output, target)`: `target` is the micro-batch's sample indices into the
    step's local batch, so a loss that needs any of the batch's tensors (labels, the input ids themselves) works."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn
        self.batch: tuple[torch.Tensor, ...] = ()

    def __call__(self, output: Any, sample_ids: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, tuple(t[sample_ids] for t in self.batch))


@dataclass(frozen=True, slots=True)
class TiedAcrossStages:
    """A parameter shared by modules on several pipeline stages (the GPT head tied to the embedding): each
    holder keeps a copy and their gradients are summed over `group` after backward (Megatron-LM's embedding
    group, Shoeybi et al. 2019)."""

    names: Mapping[int, str]
    """Stage index -> the parameter's name in that stage."""
    group: Any
    """Process group of the ranks (same dp and tp coordinates) that hold the stages; None on other ranks."""


@dataclass(eq=False)
class ParallelModel:
    """What this rank trains: one model part per local pipeline stage (the whole model when pp == 1)."""

    plan: Plan
    mesh: Any
    parts: dict[int, nn.Module]
    """Stage index -> module; `{0: model}` when not pipelined."""
    loss_fn: LossFn
    schedule: Any = None
    microbatch_loss: MicrobatchLoss | None = None
    tied: tuple[TiedAcrossStages, ...] = ()
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    meshes: PlanMeshes | None = None
    """The 1-D meshes of the plan (set by `parallelize`)."""
    expert_params: frozenset[str] = frozenset()
    """FQNs of parameters of which this rank holds a dim-0 slice over the ep group (expert parallelism)."""
    split_experts: tuple[nn.Module, ...] = ()
    """Experts modules whose slots the tp ranks split (`apply_ep.apply_expert_token_split`) and whose gradients
    are summed over `PlanMeshes.expert_tp_sum` after the backward."""

    @property
    def strategy(self) -> Strategy:
        return self.plan.strategy

    @property
    def pipelined(self) -> bool:
        return self.schedule is not None

    @property
    def num_stages(self) -> int:
        return self.strategy.pp * self.strategy.virtual_stages if self.pipelined else 1

    @property
    def holds_last_stage(self) -> bool:
        return (self.num_stages - 1) in self.parts

    @property
    def local_batch_size(self) -> int:
        """Samples this rank's data-parallel replica trains on per step (micro-batch size x micro-batches)."""
        return self.strategy.microbatch_size * self.strategy.num_microbatches

    @property
    def dp_rank(self) -> int:
        dp = self.meshes.dp if self.meshes is not None else self.mesh["dp"]
        return dp.get_local_rank()

    def full_tensor(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The whole (unsharded) value of this rank's parameter `name`: DTensors gathered, expert slices
        all-gathered over the ep group. A collective: every rank of the group must call it."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if name in self.expert_params and self.meshes is not None and self.meshes.ep is not None:
                import torch.distributed._functional_collectives as funcol

                group = self.meshes.ep.get_group()
                full = funcol.wait_tensor(funcol.all_gather_single(full.contiguous(), 0, group))
        return full

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (DTensors when sharded) under the model's own names, each once."""
        seen: set[int] = set()
        for index in sorted(self.parts):
            for name, p in self.parts[index].named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield name, p

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def train(self, mode: bool = True) -> ParallelModel:
        for part in self.parts.values():
            part.train(mode)
        return self


def plan_stages(strategy: Strategy, chain: LayerChain) -> tuple[StageSpec, ...]:
    """The plan's stages, or (when it lists none) the split `costmodel.estimate` priced: `costmodel.rank_layout.even_stages`, with
    the strategy's recompute."""
    if strategy.stages:
        return strategy.stages
    count = strategy.pp * strategy.virtual_stages
    if count > len(chain):
        raise UserError(f"cannot cut a layer chain of {len(chain)} segments into {count} pipeline stages")
    return even_stages(chain, count, strategy.recompute)


def count_trainable_params(model: nn.Module) -> int:
    """Unique trainable parameters (tied weights once), as `Graph.param_count` counts them."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_plan_matches(model: nn.Module, plan: Plan, *, chain: LayerChain | None = None,
                       world_size: int | None = None) -> None:
    """Refuse a plan made for another model or another world size (PlanLoadError, one line)."""
    if world_size is not None:
        check_world_size(plan.strategy, world_size)
    params = count_trainable_params(model)
    if params != plan.model.params:
        raise PlanLoadError(f"the plan is for {plan.model.name} with {plan.model.params:,} parameters but this "
                            f"model has {params:,}; make a plan for this model (same --set options)")
    if chain is not None:
        import ir

        found = ir.fingerprint(chain.graph)
        if found != plan.model.fingerprint:
            raise PlanLoadError(f"the plan's model fingerprint {plan.model.fingerprint} does not match this "
                                f"model's {found}; the plan was made for another model or configuration")


def _check_mesh(mesh: Any, layout: MeshLayout) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    sizes = tuple(mesh.shape)
    if names != layout.names or sizes != layout.sizes:
        raise UserError(f"the given mesh has axes {dict(zip(names, sizes, strict=False))} but the plan needs "
                        f"{dict(zip(layout.names, layout.sizes, strict=True))} (outermost first)")


def model_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units recomputation checkpoints and FSDP shards one at a time: `blocks.<i>` for the zoo's
    transformers, else the root's children with `ModuleList`/`ModuleDict` containers (never called
    themselves) replaced by their members."""
    blocks = getattr(model, BLOCKS_ATTR, None)
    if isinstance(blocks, nn.ModuleList):
        return [(f"{BLOCKS_ATTR}.{i}", b) for i, b in enumerate(blocks)]
    layers: list[tuple[str, nn.Module]] = []
    todo = list(model.named_children())
    while todo:
        name, child = todo.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            todo[:0] = [(f"{name}.{n}", c) for n, c in child.named_children()]
        else:
            layers.append((name, child))
    return layers


def _apply_recompute(model: nn.Module, stages: Sequence[StageSpec], chain: LayerChain | None,
                     strategy: Strategy) -> None:
    layers = model_layers(model)
    partial = any(st.recomputed is not None for st in stages)
    if strategy.pp == 1 and not partial:  # one stage, whose recompute applies to every layer
        mode = stages[0].recompute if stages else strategy.recompute
        apply_recompute([m for _, m in layers], mode)
        return
    if chain is None:
        raise UserError("a plan that recomputes part of a stage's layers picks them by the layer chain: pass "
                        "example_inputs= (or chain=)")
    owners = module_stages(chain, stages)
    segments = module_segments(chain)
    for index, stage in enumerate(stages):
        # a layer split by a pipeline cut is inlined into two stages and cannot be checkpointed as one unit
        chosen = [(path, m) for path, m in layers if owners.get(path) == frozenset({index})]
        if stage.recomputed is None:
            apply_recompute([m for _, m in chosen], stage.recompute)
            continue
        # A layer holding a recomputed segment is checkpointed: the plan priced its bytes as given up.
        picked = set(stage.recomputed)
        apply_recompute([m for path, m in chosen if segments.get(path, frozenset()) & picked], stage.recompute)


def _layers_in(part: nn.Module, model: nn.Module) -> list[tuple[str, nn.Module]]:
    inside = {id(m) for m in part.modules()}
    return [(n, m) for n, m in model_layers(model) if id(m) in inside]


def _tied_across_stages(model: nn.Module, stage_modules: Mapping[int, nn.Module], mesh: Any,
                        layout: MeshLayout, schedule: Schedule) -> tuple[TiedAcrossStages, ...]:
    import torch.distributed as dist

    tied = []
    pp = layout.size("pp")
    for group in shared_parameters(model):
        p = getattr(model.get_submodule(group[0][0]), group[0][1])
        names: dict[int, str] = {}
        for index, part in stage_modules.items():
            for name, q in part.named_parameters():
                if q is p:
                    names[index] = name
        pp_ranks = sorted({stage_rank(schedule, pp, i) for i in names})
        if len(names) < 2:
            continue
        if len(pp_ranks) == 1:  # one rank holds every use: one parameter, its gradients add up by themselves
            continue
        if len(pp_ranks) < len(names):
            raise UserError(f"parameter {group[0][0]}.{group[0][1]} is tied across stages {sorted(names)} that "
                            "run on the same pipeline rank; untie the weights or cut elsewhere")
        mine = None
        me = dist.get_rank()
        for ranks in _peer_rank_lists(layout, pp_ranks):  # every rank creates every group, in the same order
            g = dist.new_group(ranks)
            if me in ranks:
                mine = g
        tied.append(TiedAcrossStages(names=names, group=mine))
    return tuple(tied)


def _peer_rank_lists(layout: MeshLayout, pp_ranks: Sequence[int]) -> list[list[int]]:
    """For each (dp, tp) coordinate, the global ranks at `pp_ranks` on the pp axis."""
    by_coords: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for rank in range(layout.num_devices):
        coords = layout.coordinates(rank)
        if coords["pp"] in pp_ranks:
            key = tuple(sorted((k, v) for k, v in coords.items() if k != "pp"))
            by_coords.setdefault(key, []).append(rank)
    return [by_coords[k] for k in sorted(by_coords)]


def parallelize(model: nn.Module, plan: Plan, *, mesh: Any = None,
                example_inputs: Sequence[torch.Tensor] | None = None, chain: LayerChain | None = None,
                loss_fn: LossFn | None = None) -> ParallelModel:
    """Shard `model` (in place) by `plan` for this rank and return what this rank trains.

    `model` must be identically initialized on every rank (same seed) and already on this rank's device.
    `chain` (or `example_inputs`, from which it is traced) is needed for pipeline plans, which cut the layer
    chain, and enables the fingerprint check. `loss_fn(output, batch)` defaults to "the model returns its loss".
    """
    import torch.distributed as dist

    strategy = plan.strategy
    layout = mesh_layout(strategy)
    device = next(model.parameters()).device
    unsupported = runtime_unsupported(strategy) or _fp8_problem(strategy, device)
    if unsupported:
        raise UserError(unsupported)
    if not dist.is_initialized():
        raise UserError("torch.distributed is not initialized; run under torchrun (or `stratagem run --nproc K`)")
    if mesh is None:
        mesh = build_mesh(strategy, device.type)
    else:
        _check_mesh(mesh, layout)
    if chain is None and example_inputs is not None:
        chain = trace_one_sample(model, example_inputs, dtype=plan.training.dtype)
    check_plan_matches(model, plan, chain=chain, world_size=dist.get_world_size())
    loss_fn = loss_fn or model_output_is_loss
    if strategy.pp > 1 and chain is None:
        raise UserError("a pipeline plan cuts the model's layer chain: pass example_inputs= (or chain=)")
    stages = plan_stages(strategy, chain) if chain is not None else strategy.stages

    sharded = _model_parallel(model, plan, derive_meshes(mesh, strategy), stages, chain)
    if strategy.pp == 1:
        _data_parallel(model, model_layers(model), sharded, strategy)
        return ParallelModel(plan=plan, mesh=mesh, parts={0: model}, loss_fn=loss_fn, device=device,
                             meshes=sharded.meshes, expert_params=sharded.expert_params,
                             split_experts=sharded.split_experts)
    return _pipeline(model, plan, mesh, layout, chain, stages, loss_fn, device, sharded)


@dataclass(frozen=True)
class _Sharded:
    """What the model-parallel steps left for data parallelism and the pipeline split."""

    meshes: PlanMeshes
    experts: Sequence[nn.Module]
    expert_params: frozenset[str]
    split_experts: tuple[nn.Module, ...] = ()


def _data_parallel(part: nn.Module, layers: Sequence[tuple[str, nn.Module]], sharded: _Sharded,
                   strategy: Strategy) -> None:
    """FSDP2 / replicate `part` over the dp (x cp) ranks; its experts over their replicas."""
    if strategy.dp * strategy.cp == 1:
        return
    inside = {id(m) for m in part.modules()}
    experts = [m for m in sharded.experts if id(m) in inside]
    apply_data_parallel(part, [m for _, m in layers], sharded.meshes.replicas, zero_stage=strategy.zero_stage,
                        experts=experts, experts_mesh=sharded.meshes.expert_replicas,
                        reshard_after_forward=strategy.runtime.reshard_after_forward,
                        offload=strategy.runtime.offload)


def _model_parallel(model: nn.Module, plan: Plan, meshes: PlanMeshes, stages: Sequence[StageSpec],
                    chain: LayerChain | None) -> _Sharded:
    """Tensor, expert and context parallelism and recomputation, applied in place, in torchtitan's order."""
    strategy = plan.strategy
    if strategy.runtime.fp8 is not None:  # before any wrapping, as torchtitan converts the model it then shards
        apply_fp8(model, strategy.runtime.fp8, fsdp_float8_all_gather=strategy.zero_stage == 3)
    if strategy.tp > 1:
        apply_tensor_parallel(model, plan.sharding, meshes.tp, sequence_parallel=strategy.sequence_parallel)
    expert_params: tuple[str, ...] = ()
    experts: tuple[nn.Module, ...] = ()
    if strategy.ep > 1:
        shards = apply_expert_parallel(model, EpGroup(strategy.ep, meshes.ep.get_local_rank(),
                                                      meshes.ep.get_group()), strategy.ep_dp)
        experts, expert_params = shards.modules, shards.param_names
    split: tuple[nn.Module, ...] = ()
    if strategy.tp > 1:  # outside the all-to-alls: the ep group exchanges this tp rank's slots
        found = experts if strategy.ep > 1 else tuple(m for _, m in experts_modules(model))
        split = apply_expert_token_split(found, EpGroup(strategy.tp, meshes.tp.get_local_rank(),
                                                        meshes.tp.get_group()))
        split = split if meshes.expert_tp_sum is not None else ()
    cp = None
    if strategy.cp > 1:
        cp = CpGroup(SequenceShard(strategy.cp, meshes.cp.get_local_rank()), meshes.cp.get_group())
        apply_context_parallel(model, cp)
    _apply_recompute(model, stages, chain, strategy)
    # Sequence hooks after recomputation (see install_sequence_parallel_hooks); the first block's input is split
    # over cp before tp, its last output gathered over tp before cp.
    if cp is not None:
        install_split_hook(model, cp)
    if strategy.sequence_parallel:
        install_sequence_parallel_hooks(model, meshes.tp)
    if cp is not None:
        install_gather_hook(model, cp)
    return _Sharded(meshes=meshes, experts=experts, expert_params=frozenset(expert_params), split_experts=split)


def _fp8_problem(strategy: Strategy, device: torch.device) -> str:
    if strategy.runtime.fp8 is None:
        return ""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return fp8_runtime_problem(device.type, capability)


def runtime_unsupported(strategy: Strategy) -> str:
    """Why this runtime cannot run the plan's runtime options as priced ('' when it can): they describe how
    another trainer runs the strategy (`stratagem estimate --tp-overlap / --no-dp-overlap`)."""
    r = strategy.runtime
    if r.tp_overlap and strategy.tp > 1:
        return ("the plan prices tensor-parallel communication overlapped with GEMMs (tp_overlap), which this "
                "runtime does not run; plan with tp_overlap=false, or export the plan to a trainer that has it")
    if r.tp_grad_overlap and strategy.tp > 1:
        return ("the plan prices each column-parallel linear's input-gradient all-reduce hidden behind its "
                "weight-gradient GEMM (tp_grad_overlap, Megatron-LM), which this runtime does not run; plan with "
                "tp_grad_overlap=false, or export the plan to Megatron-LM")
    if (r.p2p_scatter_gather or r.p2p_blocking) and strategy.pp > 1:
        return ("the plan prices pipeline sends as another trainer runs them (p2p_scatter_gather / p2p_blocking); "
                "this runtime sends whole activations, paired: plan with both false, or export the plan")
    if r.p2p_transient_buffers and strategy.pp > 1:
        return ("the plan prices pipeline buffers freed after each transfer (p2p_transient_buffers, Megatron-LM); "
                "this runtime keeps one per micro-batch: plan with p2p_transient_buffers=false, or export the plan")
    if r.ep_dedup and strategy.ep > 1:
        return ("the plan prices expert-parallel dispatch deduplicated per node (ep_dedup, DeepEP's internode "
                "kernels); this runtime sends a plain all-to-all: plan with ep_dedup=false, or export the plan")
    if r.grads_in_training_dtype:
        return ("the plan prices gradients kept and reduced in the training dtype (grads_in_training_dtype, "
                "Megatron-LM --grad-reduce-in-bf16); this runtime reduces them in fp32: plan with "
                "grads_in_training_dtype=false, or export the plan to Megatron-LM")
    if r.fp8 is not None and not r.fp8.torchao:
        return (f"the plan prices Transformer Engine's FP8 (fp8={r.fp8.value}, Megatron-Core / NeMo); this runtime "
                "trains FP8 with torchao: plan with --fp8 tensorwise or rowwise, or export the plan to Megatron-LM")
    if r.fused_kernels:
        return ("the plan prices the memory-bound ops as fused kernels (fused_kernels: torch.compile, Megatron-Core "
                "with Transformer Engine); this runtime runs them eagerly: plan with fused_kernels=false, or export "
                "the plan")
    if r.fp32_grad_pass:
        return ("the plan prices a separate fp32 gradient pass per micro-batch (fp32_grad_pass, DeepSpeed's "
                "BF16_Optimizer); this runtime does not run one: plan with fp32_grad_pass=false, or export the plan")
    if r.metric_passes:
        return (f"the plan prices {r.metric_passes} training-metric passes over the logits per micro-batch "
                f"(metric_passes, MosaicML Composer); this runtime computes none: plan with metric_passes=0, or "
                f"export the plan")
    if r.loss_kernel(strategy.tp) is not CrossEntropy.TORCH:
        return (f"the plan prices the loss as another trainer computes it (cross_entropy={r.cross_entropy.value}); "
                f"this runtime calls PyTorch's cross_entropy: plan with cross_entropy=torch, or export the plan")
    if r.ep_overlap:
        return ("the plan prices DualPipe's overlap of the paired chunks' all-to-alls (ep_overlap); this runtime runs "
                "torch's ScheduleDualPipeV, whose pairs run one after the other: plan with ep_overlap=false, or "
                "export the plan")
    if r.offload is Offload.OPTIMIZER:
        return ("the plan offloads the optimizer state alone (offload=optimizer, ZeRO-Offload), which FSDP2 has no "
                "form of; export the plan to DeepSpeed or Megatron-LM, or plan with --fix offload=params or none")
    if r.offload is Offload.PARAMS and strategy.dp * strategy.cp == 1:
        return "offload=params runs through FSDP2, which this runtime applies only with dp*cp > 1"
    if not r.dp_overlap and strategy.dp * strategy.cp > 1:
        return ("the plan prices data-parallel communication without overlap (dp_overlap=false, another trainer's "
                "behaviour); this runtime always overlaps it: plan with dp_overlap=true")
    return split_backward_problem(strategy.schedule, recomputed=recomputes(strategy),
                                  resharded=strategy.zero_stage == 3 and r.reshard_after_forward)


def _pipeline(model: nn.Module, plan: Plan, mesh: Any, layout: MeshLayout, chain: LayerChain,
              stages: Sequence[StageSpec], loss_fn: LossFn, device: torch.device,
              sharded: _Sharded) -> ParallelModel:
    from torch.distributed.pipelining import PipelineStage

    strategy = plan.strategy
    all_parts = build_stage_modules(model, chain, stages)
    tied = _tied_across_stages(model, all_parts, mesh, layout, strategy.schedule)
    pp_rank = sharded.meshes.pp.get_local_rank()
    mine = stage_indices_of_rank(pp_rank, strategy.pp, len(stages), strategy.schedule)
    parts = {i: all_parts[i] for i in mine}
    for part in parts.values():
        _data_parallel(part, _layers_in(part, model), sharded, strategy)
    pp_group = sharded.meshes.pp.get_group()
    pipeline_stages = [PipelineStage(parts[i], i, len(stages), device, group=pp_group) for i in mine]
    microbatch_loss = MicrobatchLoss(loss_fn)
    schedule = build_schedule(pipeline_stages, strategy.schedule, strategy.num_microbatches, microbatch_loss)
    return ParallelModel(plan=plan, mesh=mesh, parts=parts, loss_fn=loss_fn, schedule=schedule,
                         microbatch_loss=microbatch_loss, tied=tied, device=device, meshes=sharded.meshes,
                         expert_params=sharded.expert_params, split_experts=sharded.split_experts)
