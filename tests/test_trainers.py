"""Export to torchtitan, Megatron-LM, Megatron-DeepSpeed and DeepSpeed, and reading their files back.

The round trip over the golden plans: exporting a plan and reading the file back on the plan's cluster gives the
plan's strategy exactly, unless the export warned that the trainer cannot express something -- then the warning
names it. The CLI commands (`export`, `estimate --from`, `plan --baseline`) run in-process on small models.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.strategy import CrossEntropy, Recompute, RuntimeOptions, Schedule, StageSpec
from planner.cli.common import plan_model
from planner.cli.main import main
from planner.errors import UserError
from planner.plan import Plan
from planner.trainers.argtable import argument_tokens, load_table
from planner.trainers.common import ExportError, ModelShape, Trainer
from planner.trainers.convert import export_plan, imported_strategy, read_trainer_config
from planner.trainers.layout import BlockLayout, format_megatron_layout, parse_megatron_layout
from planner.trainers.mapping import comparable

REPO = Path(__file__).resolve().parents[1]
GOLDEN = sorted((REPO / "plans").glob("*.json"))
EXAMPLES = REPO / "examples" / "trainers"


@pytest.fixture(scope="module")
def golden() -> dict[str, tuple[Plan, BlockLayout, ModelShape]]:
    out = {}
    for path in GOLDEN:
        plan = Plan.load(path)
        built, chain = plan_model(plan)
        layout = BlockLayout.of(chain)
        out[path.stem] = (plan, layout, ModelShape.of(built.name, built.family, built.config, layout.num_blocks,
                                                      built.seq_len))
    return out


def planned_for(plan: Plan, trainer: Trainer) -> Plan:
    """The plan as a user of `trainer` makes it: for Megatron-LM, priced with the fused kernels it runs
    (`--fix fused_kernels=true`), which its files carry as the default --transformer-impl; for Megatron-LM and
    its DeepSpeed fork, with their in-place cross-entropy (`--fix cross_entropy=inplace`); for the trainers
    with tensor-parallel layers of their own, with every weight split over tp (`--fix tp_sharded_weights=true`);
    for the trainers with a pipeline engine of their own, with its buffers freed per transfer
    (`--fix p2p_transient_buffers=true`); for torchtitan, with the schedule's outputs returned
    (`--fix pp_returns_outputs=true`)."""
    runtime = plan.strategy.runtime
    if trainer is Trainer.MEGATRON:
        runtime = replace(runtime, fused_kernels=True)
    if trainer in (Trainer.MEGATRON, Trainer.MEGATRON_DEEPSPEED):
        runtime = replace(runtime, cross_entropy=CrossEntropy.INPLACE)
    if trainer in (Trainer.MEGATRON, Trainer.TORCHTITAN, Trainer.MEGATRON_DEEPSPEED) and plan.strategy.tp > 1:
        runtime = replace(runtime, tp_sharded_weights=True)
    if trainer is not Trainer.TORCHTITAN and plan.strategy.pp > 1:
        runtime = replace(runtime, p2p_transient_buffers=True)
    if trainer is Trainer.TORCHTITAN and plan.strategy.pp > 1:
        runtime = replace(runtime, pp_returns_outputs=True)
    return replace(plan, strategy=replace(plan.strategy, runtime=runtime))


def round_trip(plan: Plan, layout: BlockLayout, shape: ModelShape, trainer: Trainer, folder: Path):
    """Export the plan as a user of `trainer` makes it (`planned_for`) and read the file back."""
    plan = planned_for(plan, trainer)
    result = export_plan(plan, trainer, layout, shape)
    path = folder / result.filename
    path.write_text(result.text)
    if trainer is Trainer.MEGATRON_DEEPSPEED:
        (folder / "ds_config.json").write_text(export_plan(plan, Trainer.DEEPSPEED, layout, shape).text)
    cfg = read_trainer_config(f"{trainer.value}:{path}")
    return result, imported_strategy("x", cfg, layout, plan.strategy.num_devices)


@pytest.mark.parametrize("trainer", list(Trainer), ids=str)
def test_export_then_import_gives_the_plans_strategy(golden, trainer: Trainer, tmp_path: Path) -> None:
    exact = 0
    for name, (eager_plan, layout, shape) in golden.items():
        plan = planned_for(eager_plan, trainer)
        folder = tmp_path / name
        folder.mkdir()
        result, back = round_trip(plan, layout, shape, trainer, folder)
        same = comparable(back.strategy) == comparable(plan.strategy)
        assert back.global_batch == plan.training.global_batch, name
        if result.warnings:
            assert not same or trainer is Trainer.DEEPSPEED, (name, result.warnings)
        else:
            assert same, (name, back.strategy, plan.strategy)
            exact += 1
    assert exact >= {Trainer.MEGATRON: 6, Trainer.TORCHTITAN: 2}.get(trainer, 3)


def test_megatron_exports_every_golden_plan_it_has_the_schedule_of_exactly(golden, tmp_path: Path) -> None:
    runnable = {k: v for k, v in golden.items() if not Schedule(v[0].strategy.schedule).zero_bubble}
    assert len(runnable) >= len(golden) - 1
    for name, (plan, layout, shape) in runnable.items():
        result, _ = round_trip(plan, layout, shape, Trainer.MEGATRON, tmp_path)
        assert result.warnings == (), name
        tokens = argument_tokens(result.text, source=name)
        ns = load_table("megatron_lm").parse(tokens, source=name)  # every flag is Megatron-LM's, values typed
        assert ns.tensor_model_parallel_size == plan.strategy.tp
        assert ns.global_batch_size == plan.training.global_batch


def test_uneven_and_interleaved_cuts_round_trip(golden, tmp_path: Path) -> None:
    plan, layout, shape = golden["gpt3-1.3b-2x8xa100"]
    s = plan.strategy
    cases = {  # blocks per virtual stage -> the Megatron-LM flags that must carry them
        (5, 7, 7, 5): "--decoder-first-pipeline-num-layers 5",
        (3, 9, 6, 6): "--pipeline-model-parallel-layout Ettt|ttttttttt|tttttt|ttttttL",
        (3, 3, 3, 3, 3, 3, 3, 3): "--num-layers-per-virtual-pipeline-stage 3",
    }
    for blocks, flag in cases.items():
        v = 2 if len(blocks) == 8 else 1
        strategy = replace(s, dp=4, pp=4, virtual_stages=v, schedule="interleaved" if v > 1 else "1f1b",
                           num_microbatches=4, microbatch_size=4, stages=layout.stages_of(blocks))
        variant = replace(plan, strategy=strategy)
        for trainer in (Trainer.MEGATRON, Trainer.TORCHTITAN):
            result, back = round_trip(variant, layout, shape, trainer, tmp_path)
            if trainer is Trainer.MEGATRON:
                assert flag in result.text
            assert back.strategy.stages == strategy.stages, (trainer, blocks)


def test_partial_recompute_round_trips_through_megatrons_block_method(golden, tmp_path: Path) -> None:
    """Stages that fully recompute their first N decoder layers are Megatron-LM's `--recompute-method block
    --recompute-num-layers N` both ways; another pick of layers, and torchtitan, export full recomputation with a
    warning (more recomputation, no more memory)."""
    plan, layout, shape = golden["gpt3-1.3b-2x8xa100"]
    stages = layout.stages_of((6, 6, 6, 6), Recompute.FULL, recompute_layers=2)
    assert [len(st.recomputed) for st in stages] == [2, 2, 2, 2]
    assert stages[0].recomputed == (layout.lead, layout.lead + 1)
    strategy = replace(plan.strategy, dp=4, pp=4, num_microbatches=4, microbatch_size=4, recompute=Recompute.FULL,
                       stages=stages)
    variant = replace(plan, strategy=strategy)
    result, back = round_trip(variant, layout, shape, Trainer.MEGATRON, tmp_path)
    assert "--recompute-method block\n--recompute-num-layers 2\n" in result.text and result.warnings == ()
    assert back.strategy.stages == strategy.stages
    other = replace(strategy, stages=(replace(stages[0], recomputed=stages[0].recomputed[1:]), *stages[1:]))
    result, back = round_trip(replace(plan, strategy=other), layout, shape, Trainer.MEGATRON, tmp_path)
    assert "--recompute-method uniform" in result.text
    assert any("part of some stages' layers" in w for w in result.warnings)
    assert all(st.recomputed is None for st in back.strategy.stages)
    result, _ = round_trip(variant, layout, shape, Trainer.TORCHTITAN, tmp_path)
    assert any("part of some stages' layers" in w for w in result.warnings)


def test_zero_bubble_schedules_round_trip_through_torchtitan_and_warn_in_megatron(golden, tmp_path: Path) -> None:
    plan, layout, shape = golden["gpt3-1.3b-2x8xa100"]
    names = {"interleaved-zb": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
    for schedule, name in names.items():
        strategy = replace(plan.strategy, dp=4, pp=4, virtual_stages=2, schedule=schedule, num_microbatches=8,
                           microbatch_size=2, zero_stage=3, stages=layout.stages_of((3,) * 8),
                           runtime=replace(plan.strategy.runtime, reshard_after_forward=False,
                                           pp_returns_outputs=True))
        variant = replace(plan, strategy=strategy)
        result, back = round_trip(variant, layout, shape, Trainer.TORCHTITAN, tmp_path)
        assert f'pipeline_parallel_schedule = "{name}"' in result.text and not result.warnings
        assert comparable(back.strategy) == comparable(strategy), schedule
        result, back = round_trip(variant, layout, shape, Trainer.MEGATRON, tmp_path)
        assert any(f"no {schedule} schedule" in w for w in result.warnings), result.warnings
        assert back.strategy.schedule == "interleaved" and back.strategy.stages == strategy.stages


def test_offload_round_trips_where_the_trainer_has_it_and_warns_where_not(golden, tmp_path: Path) -> None:
    """DeepSpeed `offload_optimizer` / `offload_param`, Megatron-LM `--optimizer-cpu-offload` (optimizer only),
    torchtitan `enable_cpu_offload` (FSDP2's CPUOffloadPolicy: parameters)."""
    plan, layout, shape = golden["gpt3-1.3b-2x8xa100"]
    s = plan.strategy
    cases = {  # (zero, offload) -> trainers that carry it exactly, and the text that shows it
        (1, "optimizer"): {Trainer.MEGATRON: "--optimizer-cpu-offload", Trainer.DEEPSPEED: '"offload_optimizer"'},
        (3, "params"): {Trainer.TORCHTITAN: "enable_cpu_offload = true", Trainer.DEEPSPEED: '"offload_param"'},
    }
    for (zero, offload), exact in cases.items():
        strategy = replace(s, dp=16, tp=1, pp=1, virtual_stages=1, schedule="1f1b", zero_stage=zero, stages=(),
                           sequence_parallel=False, microbatch_size=2, num_microbatches=s.global_batch // 32,
                           runtime=replace(s.runtime, offload=offload))
        variant = replace(plan, strategy=strategy)
        for trainer in (Trainer.MEGATRON, Trainer.TORCHTITAN, Trainer.DEEPSPEED):
            result, back = round_trip(variant, layout, shape, trainer, tmp_path)
            if trainer in exact:
                assert exact[trainer] in result.text, (trainer, result.text)
                assert back.strategy.runtime.offload == strategy.runtime.offload, (trainer, offload)
            else:
                assert any("offload" in w for w in result.warnings), (trainer, result.warnings)


def test_megatron_layout_strings() -> None:
    assert format_megatron_layout((1, 2, 2, 1)) == "Et|tt|tt|tL"
    assert parse_megatron_layout("Et|tt|tt|tL") == (1, 2, 2, 1)
    assert parse_megatron_layout("E|(t|)*3,tL") == (0, 1, 1, 1, 1)
    assert parse_megatron_layout("Et*3|t*4|tttL") == (3, 4, 3)
    with pytest.raises(UserError, match="not priced"):
        parse_megatron_layout("Et|mm|tL")


def test_a_cut_inside_the_embedding_cannot_be_exported(golden) -> None:
    plan, layout, shape = golden["gpt-tiny-1x4xcpu"]
    layout = replace(layout, lead=2, num_blocks=3)  # pretend the embedding spans two segments
    s = plan.strategy
    bad = replace(plan, strategy=replace(s, pp=2, dp=s.dp // 2, microbatch_size=2 * s.microbatch_size,
                                         stages=(StageSpec(0, 1), StageSpec(1, 6))))
    with pytest.raises(UserError, match="inside the embedding or head"):
        export_plan(bad, Trainer.MEGATRON, layout, shape)


def test_what_a_trainer_cannot_express_is_a_warning_or_with_strict_an_error(golden) -> None:
    plan, layout, shape = golden["moe-tiny-1x8xh100"]
    plan = replace(plan, strategy=replace(plan.strategy, zero_stage=1))  # torchtitan has FSDP or DDP only
    result = export_plan(plan, Trainer.TORCHTITAN, layout, shape)
    assert any("ZeRO-1 exported as FSDP" in w for w in result.warnings)
    with pytest.raises(ExportError, match="--strict: torchtitan shards"):
        export_plan(plan, Trainer.TORCHTITAN, layout, shape, strict=True)
    stages = (StageSpec(0, 3, Recompute.FULL), StageSpec(3, 6, Recompute.NONE))
    mixed = replace(plan, strategy=replace(plan.strategy, pp=2, dp=4, num_microbatches=2, stages=stages))
    result = export_plan(mixed, Trainer.MEGATRON, layout, shape)
    assert "--recompute-granularity full" in result.text
    assert any("recomputes per stage" in w for w in result.warnings)


def test_deepseeks_expert_runtime_choices_are_warnings_in_every_trainer(golden) -> None:
    plan, layout, shape = golden["moe-tiny-1x8xh100"]
    s = plan.strategy
    deduplicated = replace(plan, strategy=replace(s, ep=2, runtime=replace(s.runtime, ep_dedup=True,
                                                                               ep_overlap=True)))
    for trainer in Trainer:
        exported = export_plan(deduplicated, trainer, layout, shape)
        assert any("ep_dedup" in w for w in exported.warnings), trainer
        # Megatron-LM pairs its 1F1B steady state itself: the overlap is a flag there, a warning elsewhere
        if trainer is Trainer.MEGATRON:
            assert "--overlap-moe-expert-parallel-comm" in exported.text
            assert not any("ep_overlap" in w for w in exported.warnings)
        else:
            assert any("ep_overlap" in w for w in exported.warnings), trainer


def test_launch_scripts_and_bash_arrays_are_read() -> None:
    cfg = read_trainer_config(f"megatron:{EXAMPLES / 'megatron_gpt3_1.3b.sh'}")
    assert (cfg.tp, cfg.pp, cfg.microbatch_size, cfg.global_batch) == (2, 2, 2, 64)
    assert cfg.sequence_parallel and cfg.zero_stage == 1 and cfg.recompute is Recompute.FULL
    assert cfg.runtime.dp_overlap is False  # no --overlap-grad-reduce: Megatron-LM does not overlap then
    assert cfg.runtime.tp_sharded_weights  # Megatron-LM's tp layers split every weight
    assert cfg.num_layers == 24 and cfg.seq_len == 2048 and cfg.dtype == "bfloat16"


def test_import_errors_say_what_is_wrong(tmp_path: Path, golden) -> None:
    _, layout, _ = golden["gpt3-1.3b-2x8xa100"]
    typo = tmp_path / "typo.args"
    typo.write_text("--tensor-parallel-size 2\n--micro-batch-size 1\n")
    with pytest.raises(UserError, match="did you mean --tensor-model-parallel-size"):
        read_trainer_config(f"megatron:{typo}")
    wrong = tmp_path / "wrong.args"
    wrong.write_text("--num-layers 12 --micro-batch-size 1 --tensor-model-parallel-size 3")
    cfg = read_trainer_config(f"megatron:{wrong}")
    with pytest.raises(UserError, match="12 layers, but the model has 24"):
        imported_strategy("x", cfg, layout, 16)
    with pytest.raises(UserError, match="does not divide the cluster's 16 devices"):
        imported_strategy("x", replace(cfg, num_layers=None), layout, 16)
    with pytest.raises(UserError, match="expected TRAINER:FILE"):
        read_trainer_config("megatron")
    with pytest.raises(UserError, match="unknown trainer"):
        read_trainer_config("nemo:x.yaml")


def test_cli_export_writes_once_and_refuses_to_overwrite(tmp_path: Path, capsys) -> None:
    plan = REPO / "plans" / "llama-tiny-pp4-1x8xh100.json"
    out = tmp_path / "job.toml"
    assert main(["export", str(plan), "--to", "torchtitan", "-o", str(out)]) == 0
    text = out.read_text()
    assert "module_fqns_per_model_part" in text and "pipeline_parallel_degree = 4" in text
    assert main(["export", str(plan), "--to", "torchtitan", "-o", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["export", str(plan), "--to", "megatron", "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["trainer"] == "megatron" and "--pipeline-model-parallel-size 4" in exported["text"]


def test_cli_estimate_from_equals_estimate_flags(tmp_path: Path, capsys) -> None:
    args_file = tmp_path / "tiny.args"
    args_file.write_text("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 2 "
                         "--global-batch-size 16 --sequence-parallel --overlap-grad-reduce --bf16\n")
    base = ["estimate", "gpt-tiny", "--cluster", "1x8xa100-80gb", "--json"]
    assert main([*base, "--from", f"megatron:{args_file}"]) == 0
    imported = json.loads(capsys.readouterr().out)
    # Megatron-LM reduces input gradients during the weight-gradient GEMMs unless told not to, runs Transformer
    # Engine's fused kernels by default, its tensor-parallel layers split every weight, its loss works in place and
    # its pipeline receives are allocated per transfer
    assert main([*base, "--tp", "2", "--pp", "2", "--dp", "2", "--mbs", "2", "--batch", "16", "--sp",
                 "--tp-grad-overlap", "--fused-kernels", "--tp-sharded-weights", "--cross-entropy", "inplace",
                 "--p2p-transient-buffers"]) == 0
    flags = json.loads(capsys.readouterr().out)
    assert imported["strategy"] == flags["strategy"]
    assert imported["predicted"]["step_time_s"] == flags["predicted"]["step_time_s"]
    assert main([*base, "--from", f"megatron:{args_file}", "--tp", "2"]) == 2
    assert "--from sets the strategy; drop --tp" in capsys.readouterr().err


def test_cli_plan_baseline_prints_the_gain(tmp_path: Path, capsys) -> None:
    args_file = tmp_path / "today.args"
    args_file.write_text("--pipeline-model-parallel-size 4 --micro-batch-size 1 --global-batch-size 16 "
                         "--recompute-granularity full --bf16\n")
    argv = ["plan", "gpt-tiny", "--cluster", "1x8xa100-80gb", "--batch", "16", "--baseline",
            f"megatron:{args_file}"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["baseline"]["strategy"]["pp"] == 4 and out["baseline"]["search"]["status"] == "fixed"
    gain = out["gain"]
    assert gain["speedup"] == pytest.approx(out["baseline"]["predicted"]["step_time_s"]
                                            / out["plan"]["predicted"]["step_time_s"])
    assert gain["speedup"] > 1  # four pipeline stages with full recomputation lose to the free plan
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"baseline megatron:{args_file}" in text and "predicted gain:" in text and "what changes" in text


def test_deepspeed_pipeline_sends_are_read_and_written(tmp_path: Path) -> None:
    """DeepSpeed's pipeline engine blocks both ends of each send and partitions activations over the tp ranks
    unless `pipe_partitioned` is off: imports price that, exports write it and warn about paired sends."""
    base = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "pipeline": {"stages": 4}}
    for partitioned in (None, False):
        cfg = json.loads(json.dumps(base))
        if partitioned is not None:
            cfg["pipeline"]["pipe_partitioned"] = partitioned
        path = tmp_path / f"ds_{partitioned}.json"
        path.write_text(json.dumps(cfg))
        runtime = read_trainer_config(f"deepspeed:{path}").runtime
        assert runtime.p2p_blocking and runtime.p2p_scatter_gather == (partitioned is None)
        assert not runtime.fp32_grad_pass  # fp32 training: no 16-bit gradients to upcast
    bf16 = dict(base, bf16={"enabled": True})
    (tmp_path / "bf16.json").write_text(json.dumps(bf16))
    assert read_trainer_config(f"deepspeed:{tmp_path / 'bf16.json'}").runtime.fp32_grad_pass  # BF16_Optimizer
    flat = dict(base, pipeline={"stages": 1})
    (tmp_path / "flat.json").write_text(json.dumps(flat))
    assert read_trainer_config(f"deepspeed:{tmp_path / 'flat.json'}").runtime == RuntimeOptions(dp_overlap=False)


TP2 = "[training]\nseq_len = 2048\n[parallelism]\ntensor_parallel_degree = 2\n"


@pytest.mark.parametrize(("text", "kernel"), [
    (TP2, CrossEntropy.LOSS_PARALLEL),
    ("[training]\nseq_len = 2048\n", CrossEntropy.TORCH),
    (TP2 + "disable_loss_parallel = true\n", CrossEntropy.TORCH),
    (TP2 + '[compile]\nenable = true\ncomponents = ["model", "loss"]\n', CrossEntropy.TORCH),
    (TP2 + '[compile]\nenable = true\ncomponents = ["model"]\n', CrossEntropy.LOSS_PARALLEL),
])
def test_torchtitans_loss_is_read_as_it_runs_it(text: str, kernel: CrossEntropy) -> None:
    """torchtitan computes the loss under loss_parallel() when tp > 1 unless disabled; a compiled loss is the
    compiler's, priced as PyTorch's. At tp 1 both price alike (`RuntimeOptions.loss_kernel`)."""
    from planner.trainers import torchtitan

    runtime = torchtitan.read(text, source="job.toml").runtime
    assert runtime.cross_entropy is kernel
    assert runtime.loss_kernel(1) is CrossEntropy.TORCH
