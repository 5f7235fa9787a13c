"""A plan's strategy as a `TrainerConfig`, and a `TrainerConfig` back as the `Strategy` it runs.

Both directions are the same rules read two ways, so that exporting a plan and importing the file gives back the
plan's strategy (tests/test_trainers.py checks it over the golden plans):

- degrees: tp, pp, cp, ep as they are; dp is what the trainer leaves to data parallelism, world / (tp*pp*cp);
- batch: micro-batch size and global batch; micro-batches per step = global / (micro-batch * dp);
- stages: decoder layers per virtual stage (`planner.trainers.layout`), omitted when they are the even split;
- recomputation: one mode for the whole model (every trainer here applies one), the strongest a plan's stages use;
- runtime options (data-parallel overlap, ZeRO-3 resharding, TP overlap) map to the trainers' own switches.
"""

from __future__ import annotations

from dataclasses import replace

from costmodel.rank_layout import even_shares
from costmodel.strategy import DEFAULT_MESH_ORDER, MeshAxis, Recompute, Strategy
from planner.errors import UserError
from planner.plan import Plan
from planner.trainers.common import Notes, Trainer, TrainerConfig
from planner.trainers.layout import BlockLayout

PP_INSIDE_DP = (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.PP, MeshAxis.DP)
"""The rank order of Megatron-LM's `--use-tp-pp-dp-mapping` (pipeline neighbours closer than data-parallel ones)."""

_STRENGTH = {Recompute.NONE: 0, Recompute.OP: 1, Recompute.SELECTIVE: 2, Recompute.FULL: 3}
"""Recomputed work per mode, least first (per-op keeps more than Megatron's attention-core selective)."""


def config_of_plan(plan: Plan, layout: BlockLayout, trainer: Trainer, notes: Notes) -> TrainerConfig:
    """The plan's strategy in the trainer-neutral form; what no trainer can express is a note or a UserError."""
    s = plan.strategy
    _check_one_device_type(plan, trainer)
    if s.mesh_order != DEFAULT_MESH_ORDER and not (trainer is Trainer.MEGATRON and s.mesh_order == PP_INSIDE_DP):
        notes.add(f"the plan orders the device mesh {'/'.join(a.value for a in s.mesh_order)} (innermost first); "
                  f"{trainer.value} lays ranks out tp/cp/dp/pp, so its ranks sit on other links than priced")
    stages = s.stages
    blocks = layout.blocks_per_stage(stages, trainer.value) if stages else None
    layers = layout.first_blocks_recomputed(stages) if trainer is Trainer.MEGATRON else None
    if blocks is not None and blocks == even_shares(layout.num_blocks, len(blocks)):
        blocks = None  # the trainer's default split is the plan's
    return TrainerConfig(
        trainer=trainer, tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, dp=s.dp, microbatch_size=s.microbatch_size,
        global_batch=plan.training.global_batch, schedule=s.schedule, virtual_stages=s.virtual_stages,
        stage_blocks=blocks, zero_stage=s.zero_stage, sequence_parallel=s.sequence_parallel,
        recompute=_one_recompute(s, trainer, notes, layers), recompute_layers=layers, runtime=s.runtime,
        mesh_order=s.mesh_order,
        seq_len=plan.training.seq_len,
        dtype=plan.training.dtype, num_layers=layout.num_blocks)


def _check_one_device_type(plan: Plan, trainer: Trainer) -> None:
    groups = sorted({st.device_group for st in plan.strategy.stages if st.device_group is not None})
    devices = sorted({st.device for st in plan.predicted.stages})
    if len(groups) > 1 or len(devices) > 1:
        raise UserError(f"the plan runs stages on {len(max(groups, devices, key=len))} device types "
                        f"({', '.join(max(groups, devices, key=len))}); {trainer.value} runs one device type per "
                        f"job and has no per-stage placement")


def _one_recompute(s: Strategy, trainer: Trainer, notes: Notes, layers: int | None) -> Recompute:
    modes = {st.recompute for st in s.stages} or {s.recompute}
    strongest = max(modes, key=_STRENGTH.__getitem__)
    partial = sorted({st.recompute_label for st in s.stages if st.recomputed is not None})
    if partial and layers is None:
        notes.add(f"the plan recomputes part of some stages' layers ({', '.join(partial)}); exported as "
                  f"{strongest.value} recomputation of every layer (more recomputation, no more memory than planned)")
    if len(modes) > 1:
        notes.add(f"the plan recomputes per stage ({', '.join(sorted(m.value for m in modes))}); {trainer.value} "
                  f"applies one mode to every layer, exported as {strongest.value} (more recomputation, no "
                  f"more memory than planned)")
    return strongest


def strategy_of_config(cfg: TrainerConfig, layout: BlockLayout, num_devices: int) -> tuple[Strategy, int]:
    """The strategy `cfg` runs on `num_devices` devices and its global batch; UserError when it cannot run."""
    model_parallel = cfg.tp * cfg.pp * cfg.cp
    where = f"{cfg.trainer.value} configuration"
    if cfg.num_layers is not None and cfg.num_layers != layout.num_blocks:
        raise UserError(f"{where}: {cfg.num_layers} layers, but the model has {layout.num_blocks}; pass the "
                        f"model the configuration trains (--set layers=...)")
    dp = cfg.dp if cfg.dp is not None else num_devices // model_parallel
    if cfg.dp is None and num_devices % model_parallel:
        raise UserError(f"{where}: tp*pp*cp = {cfg.tp}*{cfg.pp}*{cfg.cp} = {model_parallel} does not divide the "
                        f"cluster's {num_devices} devices")
    if dp < 1:
        raise UserError(f"{where}: tp*pp*cp = {model_parallel} is more than the cluster's {num_devices} devices")
    global_batch = cfg.global_batch or (cfg.samples_per_rank or cfg.microbatch_size) * dp
    per_step = cfg.microbatch_size * dp
    if global_batch % per_step:
        raise UserError(f"{where}: global batch {global_batch} is not a multiple of micro-batch * dp = "
                        f"{cfg.microbatch_size}*{dp} = {per_step}")
    num_stages = cfg.pp * cfg.virtual_stages
    blocks = cfg.stage_blocks or even_shares(layout.num_blocks, num_stages)
    if len(blocks) != num_stages:
        raise UserError(f"{where}: {len(blocks)} pipeline stages given, pp*virtual = {num_stages}")
    if min(even_shares(layout.num_blocks, num_stages)) < 1 and cfg.stage_blocks is None:
        raise UserError(f"{where}: {num_stages} pipeline stages for {layout.num_blocks} layers")
    try:
        strategy = Strategy(
            dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep, microbatch_size=cfg.microbatch_size,
            num_microbatches=global_batch // per_step, schedule=cfg.schedule, virtual_stages=cfg.virtual_stages,
            zero_stage=cfg.zero_stage, sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
            stages=layout.stages_of(blocks, cfg.recompute, cfg.recompute_layers), runtime=cfg.runtime,
            mesh_order=cfg.mesh_order)
    except ValueError as e:
        raise UserError(f"{where}: {e}") from None
    return strategy, global_batch


def comparable(strategy: Strategy) -> Strategy:
    """The strategy without what a trainer file does not carry (the cluster's device-group names of stages)."""
    return replace(strategy, stages=tuple(replace(st, device_group=None) for st in strategy.stages))
