"""Exports validated by the trainers' own parsers from their released packages (the `export` extra, installed by
.ci/run; each test skips when its package is missing):

- torchtitan 0.2.2: `torchtitan.config.ConfigManager` reads the TOML (`--job.config_file`) into its JobConfig;
- DeepSpeed 0.19.8: `deepspeed.runtime.config.DeepSpeedConfig` checks the JSON (batch arithmetic, ZeRO section);
- Megatron-LM: megatron-core 0.16.1's `TransformerConfig` (its `__post_init__` checks the pipeline split, the
  recomputation and the parallel sizes) and its micro-batch calculator, fed the way Megatron-LM core_v0.16.1's
  `core_transformer_config_from_args` feeds them from the exported arguments (read with the release's argument
  table, planner/trainers/data/megatron_lm_arguments.json). Megatron-LM's `megatron/training` is not on PyPI; its
  full `validate_args` was run on these exports from a checkout of the tag (scripts/extract_trainer_args.py).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from costmodel.strategy import Recompute
from planner.cli.common import plan_model
from planner.plan import Plan
from planner.trainers.argtable import argument_tokens, load_table
from planner.trainers.common import ModelShape, Trainer
from planner.trainers.convert import export_plan
from planner.trainers.layout import BlockLayout

REPO = Path(__file__).resolve().parents[1]
GOLDEN = sorted((REPO / "plans").glob("*.json"))


@pytest.fixture(scope="module")
def exports() -> dict[str, tuple[Plan, dict[Trainer, str]]]:
    out = {}
    for path in GOLDEN:
        plan = Plan.load(path)
        built, chain = plan_model(plan)
        layout = BlockLayout.of(chain)
        shape = ModelShape.of(built.name, built.family, built.config, layout.num_blocks, built.seq_len)
        variants = {path.stem: plan}
        if plan.strategy.pp > 1:  # the same plan with full recomputation and ZeRO-1 exercises more flags
            stages = tuple(replace(s, recompute=Recompute.FULL) for s in plan.strategy.stages)
            variants[path.stem + "+full+zero1"] = replace(plan, strategy=replace(
                plan.strategy, zero_stage=1, recompute=Recompute.FULL, stages=stages))
        elif plan.strategy.dp > 1:  # offloading: the optimizer under ZeRO-1, the parameters under ZeRO-3
            for zero, offload in ((1, "optimizer"), (3, "params")):
                variants[f"{path.stem}+zero{zero}+offload-{offload}"] = replace(plan, strategy=replace(
                    plan.strategy, zero_stage=zero, runtime=replace(plan.strategy.runtime, offload=offload)))
        if plan.strategy.ep > 1:  # expert parallelism over tp x dp ranks (whole tp groups)
            variants[path.stem + "+tp2+ep4"] = replace(plan, strategy=replace(
                plan.strategy, tp=2, dp=plan.strategy.dp // 2, ep=4, sequence_parallel=True,
                num_microbatches=plan.strategy.num_microbatches * 2))
        for name, p in variants.items():
            out[name] = (p, {t: export_plan(p, t, layout, shape).text for t in Trainer})
    return out


def test_torchtitan_config_manager_reads_the_export(exports, tmp_path: Path) -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.config import ConfigManager

    for name, (plan, texts) in exports.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(texts[Trainer.TORCHTITAN])
        cfg = ConfigManager().parse_args(["--job.config_file", str(path)])
        s, par = plan.strategy, cfg.parallelism
        assert par.tensor_parallel_degree == s.tp and par.pipeline_parallel_degree == s.pp, name
        assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == s.dp, name
        assert cfg.training.global_batch_size == plan.training.global_batch, name
        assert cfg.training.seq_len == plan.training.seq_len, name
        if s.pp > 1:
            parts = par.module_fqns_per_model_part
            assert len(parts) == s.pp * s.virtual_stages and parts[0][0] == "tok_embeddings", name
            assert cfg.training.local_batch_size % par.pipeline_parallel_microbatch_size == 0, name
        assert cfg.activation_checkpoint.mode in ("none", "full", "selective"), name
        assert cfg.training.enable_cpu_offload == (s.runtime.offload.value != "none"), name


class _DataParallelOnly:
    """The `mpu` DeepSpeed asks for the data-parallel world size (the export's dp; no process group here)."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def test_deepspeed_config_accepts_the_export(exports, monkeypatch) -> None:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    pytest.importorskip("deepspeed")
    import json

    import deepspeed.runtime.config as ds_config

    # DeepSpeedConfig asks the process group for the rank before it asks `mpu` for the data-parallel size.
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    for name, (plan, texts) in exports.items():
        cfg = ds_config.DeepSpeedConfig(json.loads(texts[Trainer.DEEPSPEED]), mpu=_DataParallelOnly(plan.strategy.dp))
        s = plan.strategy
        assert cfg.train_batch_size == plan.training.global_batch, name
        assert cfg.train_micro_batch_size_per_gpu == s.microbatch_size, name
        assert cfg.gradient_accumulation_steps == s.num_microbatches, name
        assert cfg.zero_optimization_stage == (min(s.zero_stage, 1) if s.pp > 1 else s.zero_stage), name
        offloaded = {k for k in ("offload_optimizer", "offload_param")
                     if getattr(cfg.zero_config, k) is not None and getattr(cfg.zero_config, k).device == "cpu"}
        want = {"none": set(), "optimizer": {"offload_optimizer"}, "params": {"offload_optimizer", "offload_param"}}
        assert offloaded == want[s.runtime.offload.value], (name, offloaded)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        ds_config.DeepSpeedConfig({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 3,
                                   "gradient_accumulation_steps": 4}, mpu=_DataParallelOnly(2))


def _megatron_core_config(ns: SimpleNamespace):
    """`core_transformer_config_from_args` of Megatron-LM core_v0.16.1, for the arguments an export sets."""
    import torch
    from megatron.core.transformer import TransformerConfig

    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    return TransformerConfig(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        ffn_hidden_size=ns.ffn_hidden_size, num_query_groups=ns.num_query_groups if ns.group_query_attention else None,
        tensor_model_parallel_size=ns.tensor_model_parallel_size,
        pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=_virtual(ns), context_parallel_size=ns.context_parallel_size,
        expert_model_parallel_size=ns.expert_model_parallel_size, sequence_parallel=ns.sequence_parallel,
        expert_tensor_parallel_size=ns.expert_tensor_parallel_size,
        pipeline_dtype=torch.bfloat16 if ns.bf16 else torch.float16 if ns.fp16 else torch.float32,
        bf16=ns.bf16, fp16=ns.fp16, recompute_granularity=ns.recompute_granularity,
        recompute_method=ns.recompute_method, recompute_num_layers=ns.recompute_num_layers,
        num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
        pipeline_model_parallel_layout=ns.pipeline_model_parallel_layout,
        num_moe_experts=ns.num_experts, moe_router_topk=ns.moe_router_topk)


def _virtual(ns: SimpleNamespace) -> int | None:
    if ns.num_layers_per_virtual_pipeline_stage:
        return ns.num_layers // (ns.pipeline_model_parallel_size * ns.num_layers_per_virtual_pipeline_stage)
    return None


def test_megatron_core_accepts_the_export(exports) -> None:
    pytest.importorskip("megatron.core")
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )

    table = load_table("megatron_lm")
    for name, (plan, texts) in exports.items():
        ns = table.parse(argument_tokens(texts[Trainer.MEGATRON], source=name), source=name)
        config = _megatron_core_config(ns)
        s = plan.strategy
        assert config.pipeline_model_parallel_size == s.pp and config.tensor_model_parallel_size == s.tp, name
        if s.ep > 1:  # experts whole on each tp rank, as priced
            assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (s.ep, 1), name
        dp = s.num_devices // (s.tp * s.pp * s.cp)
        init_num_microbatches_calculator(0, None, ns.global_batch_size, ns.micro_batch_size, dp)
        try:
            assert get_num_microbatches() == s.num_microbatches, name
        finally:
            destroy_num_microbatches_calculator()


def test_megatron_deepspeed_arguments_are_its_own(exports) -> None:
    table = load_table("megatron_deepspeed")
    for name, (plan, texts) in exports.items():
        ns = table.parse(argument_tokens(texts[Trainer.MEGATRON_DEEPSPEED], source=name), source=name)
        assert ns.tensor_model_parallel_size == plan.strategy.tp and ns.deepspeed, name
        assert ns.deepspeed_config == "ds_config.json", name
