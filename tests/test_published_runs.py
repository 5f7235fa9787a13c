"""The cost model against published GPU training runs: a subset of bench/published_runs.py's rows, and the ceiling
of the best published MFU per device type over the zoo presets on their reference clusters.

The published figures are read from shared/data (beside the checkout) by `published_reference`; nothing here
copies them. The thresholds are the targets: every row within 20%, the subset's mean within 10%, memory within
10%, and no plan predicted above the best MFU a published run reached on its device type.
"""

from __future__ import annotations

import pytest
from published_reference import PUBLISHED_CSV, all_runs, predict

import ir
from costmodel import Cluster
from models.registry import build_model
from planner.api import plan

pytestmark = pytest.mark.skipif(not PUBLISHED_CSV.exists(), reason="shared/data is not beside the checkout")

SUBSET = (
    "Megatron-Core r0.8.0 weak scaling 1.7B",       # H100, data parallel over 48 ranks
    "Megatron-Core r0.8.0 weak scaling 16B",        # H100, tp 4 with TP overlap
    "torchtitan Llama 3.1 8B FSDP 8 GPUs torch.compile",   # H100, FSDP2 + per-op checkpointing, with memory
    "Korthikanti 22B Table3+Table5 selective+SP",   # A100, tp 8, 2022 Megatron-LM
)


@pytest.fixture(scope="module")
def predictions():
    runs = {r.name: r for r in all_runs()}
    return {name: (runs[name], predict(runs[name])) for name in SUBSET}


@pytest.mark.slow
def test_step_time_within_the_targets(predictions):
    errors = {name: pred.step_s / run.measured_step_s - 1 for name, (run, pred) in predictions.items()}
    assert all(abs(e) <= 0.20 for e in errors.values()), errors
    assert sum(abs(e) for e in errors.values()) / len(errors) <= 0.10, errors


@pytest.mark.slow
def test_peak_memory_within_ten_percent(predictions):
    for run, pred in predictions.values():
        if run.measured_memory_gib is not None:
            assert pred.memory_gib == pytest.approx(run.measured_memory_gib, rel=0.10), run.name


A100_GAP = pytest.mark.xfail(strict=True, reason=(
    "known gap: A100 data-parallel plans at tp=1 with ZeRO are predicted at up to 68% MFU (gpt3-13b on 64 GPUs), "
    "above the 64.2% the best published A100 run reached (llm-foundry MPT-7B, FSDP on 8 GPUs); the out-of-sample llm-foundry rows show the same gap "
    "(eager FSDP at tp=1 predicted 8-16% too fast on A100 and H100, bench/published_runs.py). A cited "
    "compute/communication contention term (18.9%) was tried and worsened the leave-one-out error, so the term "
    "that slows these steps is still unknown"))

REFERENCE = (
    # preset, cluster, global batch, sequence
    pytest.param("gpt3-1.3b", "2x8xa100-80gb", 512, None),  # 64.0%: just under
    pytest.param("gpt3-13b", "8x8xa100-80gb", 512, 2048, marks=A100_GAP),
    pytest.param("llama3-8b", "1x8xh100-sxm", 16, 8192),
    # A mixture of experts, credited with its token choices (not the trace's padded expert slots): 41.6%.
    pytest.param("mixtral-8x7b", "64x8xh100-sxm", 1024, None),
)


@pytest.mark.slow
@pytest.mark.parametrize("name,spec,batch,seq", REFERENCE)
def test_no_plan_beats_the_best_published_mfu(name, spec, batch, seq):
    cluster = Cluster.parse(spec)
    ceiling = cluster.groups[0].device.best_published_mfu
    assert ceiling is not None
    built = build_model(name, (), batch=1, seq=seq, device="meta")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=name))
    best = plan(chain, None, cluster, global_batch=batch)
    assert best.predicted.mfu <= ceiling, (best.predicted.mfu, ceiling)


def _row(run: str, notes: str, *, pp: int = 4) -> dict[str, str]:
    """A published_runs.csv row with the given name and framework notes (shape and figures are placeholders)."""
    row = dict.fromkeys(("device_notes", "kv_heads", "virtual_stages", "micro_batch", "dp_sharding", "recompute",
                         "sequence_parallel", "precision", "iteration_time_s", "tokens_per_s_per_gpu",
                         "tflops_counts", "mfu", "peak_memory_gib", "source", "cp"), "")
    row.update(run=run, device="a100-80gb", num_gpus="64", gpus_per_node="8", model_family="gpt", params="",
               layers="8", hidden="1024", heads="16", kv_heads="16", ffn_hidden="4096", vocab="32000",
               seq_len="2048", tp="2", pp=str(pp), dp=str(32 // pp), global_batch="64", framework_notes=notes,
               iteration_time_s="1.0", precision="bf16")
    return row


def test_rows_are_priced_as_their_trainer_runs():
    """How a row's trainer runs the step is read from its name and notes, not from a list of known rows."""
    from published_reference import _published_row

    core = _published_row(_row("Megatron-Core GPT", "overlap of DP/TP/PP communication enabled")).runtime
    assert core.fused_kernels and core.tp_grad_overlap and core.dp_overlap and not core.p2p_scatter_gather
    legacy = _published_row(_row("GPT 18B", "Megatron-LM 2021, full recompute")).runtime
    assert not legacy.fused_kernels and legacy.tp_grad_overlap
    assert not legacy.dp_overlap and legacy.p2p_scatter_gather  # Korthikanti Sec. 6.3; scatter/gather sends
    compiled = _published_row(_row("Llama", "torchtitan, torch.compile", pp=1)).runtime
    assert compiled.fused_kernels and not compiled.tp_grad_overlap
    eager = _published_row(_row("Llama", "torchtitan, eager", pp=1)).runtime
    assert not eager.fused_kernels
    fork = _published_row(_row("BLOOM", "Megatron-DeepSpeed")).runtime
    assert not (fork.fused_kernels or fork.tp_grad_overlap or fork.dp_overlap) and fork.p2p_blocking


def test_an_unstated_schedule_ranges_over_what_the_trainer_runs():
    """Megatron-LM has 1F1B and interleaved 1F1B only, DeepSpeed's pipeline engine 1F1B; torchtitan runs every
    torch.distributed.pipelining schedule. A stated schedule is pinned whatever the trainer."""
    from published_reference import _published_row, search_space

    from costmodel.strategy import Schedule

    def space(name: str, notes: str, **extra: str):
        return search_space(_published_row(_row(name, notes) | extra), 1)

    core = space("Megatron-Core GPT", "overlap of DP/TP/PP communication enabled")
    assert core.schedule is None and core.schedules == {Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED}
    assert space("BLOOM", "Megatron-DeepSpeed").schedules == {Schedule.ONE_F_ONE_B}
    assert space("Llama", "torchtitan, torch.compile").schedules is None
    named = space("Llama", "Meta's stack; interleaved 1F1B pipeline schedule")
    assert named.schedules == {Schedule.INTERLEAVED}
    assert space("GPT", "Megatron-LM, non-interleaved schedule").schedules == core.schedules
    assert space("GPT", "Megatron-LM without interleaving").schedules == core.schedules
    assert space("GPT", "Megatron-LM, pipeline with interleaving").schedules == {Schedule.INTERLEAVED}
    stated = space("Megatron-Core GPT", "overlap", virtual_stages="3")
    assert (stated.schedule, stated.virtual_stages, stated.schedules) == (Schedule.INTERLEAVED, 3, None)


def test_a_row_with_empty_cells_is_completed_and_a_broken_row_is_skipped(tmp_path, capsys):
    """What a source leaves out is filled in as stated (degrees 1, dp from the GPUs, kv heads = heads, the family's
    MLP width and vocabulary, MFU as model TFLOP/s at the catalog's peak); sharding and recompute cells are read in
    the words sources use; a row that cannot be read is skipped with its line and reason, the others load."""
    import csv

    from published_reference import CSV_COLUMNS, _published_row, llama_ffn, load_published_runs

    from costmodel.hardware.catalog import get_device
    from costmodel.strategy import Recompute

    row = _row("Llama 2 7B somewhere", "a trainer") | {
        "model_family": "llama", "layers": "32", "hidden": "4096", "heads": "32", "kv_heads": "", "ffn_hidden": "",
        "vocab": "", "tp": "", "pp": "", "dp": "", "num_gpus": "16", "gpus_per_node": "", "iteration_time_s": "",
        "mfu": "40%", "dp_sharding": "FSDP FULL_SHARD", "recompute": "activation checkpointing",
        "sequence_parallel": "false", "device": "A100 SXM 80GB"}
    run = _published_row(row)
    assert (run.tp, run.pp, run.cp, run.dp, run.gpus_per_node) == (1, 1, 1, 16, 8)
    assert run.device == "a100-80gb" and any("the row names 'A100 SXM 80GB'" in n for n in run.inferred)
    assert "ffn_hidden=11008" in run.sets and "vocab=32000" in run.sets and "kv_heads=32" in run.sets
    assert llama_ffn(4096) == 11008 and llama_ffn(8192) == 22016  # Llama 2 7B and 70B
    assert run.zero_stage == 3 and run.recompute is Recompute.FULL and run.sequence_parallel is False
    assert any("MLP width" in n for n in run.inferred)
    flops = 0.40 * get_device("a100-80gb").flops("bfloat16")
    from published_reference import dense_training_flops
    step = dense_training_flops(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq=2048,
                                batch=64, gated=True) / (flops * 16)
    assert run.measured_step_s == pytest.approx(step)
    for cell, stage in (("ZeRO stage 1", 1), ("distributed optimizer", 1), ("SHARD_GRAD_OP", 2), ("DDP", 0)):
        assert _published_row(row | {"dp_sharding": cell}).zero_stage == stage
    for cell, mode in (("no", Recompute.NONE), ("selective", Recompute.SELECTIVE), ("full (uniform)", Recompute.FULL)):
        assert _published_row(row | {"recompute": cell}).recompute is mode

    path = tmp_path / "rows.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerow(row)
        w.writerow(row | {"run": "broken", "layers": "many"})
        w.writerow(row | {"run": "no speed", "mfu": ""})
    runs = load_published_runs(path)
    assert [r.name for r in runs] == ["Llama 2 7B somewhere"]
    err = capsys.readouterr().err
    assert "rows.csv:3: row 'broken' skipped" in err and "rows.csv:4: row 'no speed' skipped: " in err


def test_a_rows_family_is_read_from_its_name_or_its_parameter_count():
    """Known gated families build the zoo's llama; any other name is resolved by the stated parameter count (a gated
    MLP holds 3hf weights, a GELU one 2hf), and grouped-query heads are kept for a GPT too: a Mistral-style row is
    not priced with two thirds of its MLP, nor a GQA GPT (Nemotron-4 340B's shape) with full K/V projections."""
    from published_reference import _param_count, _published_row

    from models.gpt import GPTConfig
    from models.gpt import num_params as gpt_params

    assert [_param_count(t) for t in ("70.6B", "356M", "1T", "1.7 B", "", "n/a")] == [
        70.6e9, 356e6, 1e12, 1.7e9, None, None]
    mistral = _row("Mistral 7B", "a trainer") | {
        "model_family": "mistral", "params": "7.2B", "layers": "32", "hidden": "4096", "heads": "32", "kv_heads": "8",
        "ffn_hidden": "14336", "vocab": "32000", "seq_len": "4096", "global_batch": "64", "device": "h100-sxm"}
    run = _published_row(mistral)
    assert run.family == "llama" and "kv_heads=8" in run.sets
    assert "ffn_hidden=11008" in _published_row(mistral | {"ffn_hidden": ""}).sets  # a gated family's default
    unnamed = _published_row(mistral | {"model_family": "some decoder"})
    assert unnamed.family == "llama" and any("a gated MLP (llama)" in n for n in unnamed.inferred)
    nemotron = mistral | {"model_family": "nemotron-4", "params": "341B", "layers": "96", "hidden": "18432",
                          "heads": "96", "kv_heads": "8", "ffn_hidden": "73728", "vocab": "256000",
                          "num_gpus": "64"}
    run = _published_row(nemotron)
    assert run.family == "gpt" and "kv_heads=8" in run.sets and "tie_embeddings=false" in run.sets
    assert any("a GELU MLP (gpt)" in n for n in run.inferred)
    shape = GPTConfig(layers=96, hidden=18432, heads=96, kv_heads=8, ffn_hidden=73728, vocab=256000, seq=4096,
                      tie_embeddings=False)
    assert gpt_params(shape) == pytest.approx(341e9, rel=0.01)
    assert _published_row(mistral | {"precision": "FP8 (Transformer Engine)"}).runtime.fp8 is not None
    assert _published_row(mistral).runtime.fp8 is None
    from published_reference import _device_of
    assert [_device_of(c, "")[0] for c in ("NVIDIA H100 80GB HBM3", "AMD Instinct MI250X", "Tesla V100")] == [
        "h100-sxm", "mi250x", "v100-32gb"]
    on_a100 = _published_row(mistral | {"precision": "fp8", "device": "a100-80gb"})
    assert on_a100.runtime.fp8 is None and any("priced in bf16" in n for n in on_a100.inferred)


def test_a_named_schedule_that_does_not_fit_is_priced_as_run():
    """A row whose notes name the interleaved schedule keeps it when the model says it does not fit (the run did):
    the fastest virtual-stage count is priced without the memory limit and the memory error shows."""
    from published_reference import _published_row, predict

    row = _row("Llama-ish", "Meta's stack; interleaved 1F1B pipeline schedule") | {
        "device_notes": "A100 with 1 GB HBM2e (2.0 TB/s)", "micro_batch": "1", "recompute": "none"}
    run = _published_row(row)
    assert run.memory_gb == 1
    p = predict(run)
    assert p.chosen.startswith("nothing fits: priced as is") and "the fastest virtual stages" in p.chosen
    assert " interleaved:2 " in p.strategy and " none" in p.strategy and p.memory_gib > 1


def test_hardware_flops_with_full_recomputation_are_narayanan_et_als_formula():
    """A row that counts hardware FLOP/s with full recomputation converts with 96*B*s*l*h^2*(1 + s/(6h) +
    V/(16*l*h)) (Narayanan et al. 2021, Sec. 5.1), i.e. the blocks' forward counted once more."""
    from published_reference import _published_row, dense_training_flops

    B, s, layers, h, V = 512, 2048, 24, 2304, 51200
    expected = 96 * B * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
    got = dense_training_flops(layers=layers, hidden=h, heads=24, kv_heads=24, ffn=4 * h, vocab=V, seq=s, batch=B,
                               gated=False, recomputed=True)
    assert got == pytest.approx(expected, rel=1e-12)
    row = _row("GPT 1.7B", "Megatron-LM 2021, full recompute", pp=1)
    row.update(layers=str(layers), hidden=str(h), heads="24", kv_heads="24", ffn_hidden=str(4 * h), vocab=str(V),
               global_batch=str(B), num_gpus="32", tp="1", dp="32", iteration_time_s="", tflops_per_gpu="137",
               tflops_counts="hardware FLOPs with full recomputation")
    run = _published_row(row)
    assert run.measured_step_s == pytest.approx(expected / (137e12 * 32))
    assert "fused_dropout_add=true" in run.sets and "attn_impl=fused_softmax" in run.sets  # Megatron-LM of 2021
