"""Pipeline buffers as trainers keep them (`RuntimeOptions.p2p_transient_buffers`, `memory.p2p_buffer_bytes`).

torch.distributed.pipelining keeps a receive and a gradient-receive buffer for every micro-batch of the step and
each in-flight output; Megatron-LM and DeepSpeed free them per transfer. The closed form, who sets the option,
and what the runtime and the exports say of a plan priced the other way. The measurement on this project's
runtime is `bench/pipeline_buffers.py`; the search's per-stage memory is checked against the estimate in
tests/test_search_bruteforce.py (`stage_peaks`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from costmodel.memory import ChunkBoundary, PricedSegment, p2p_buffer_bytes, rank_memory
from costmodel.strategy import RuntimeOptions, Strategy
from planner.cli.main import main
from planner.runtime.parallelize import runtime_unsupported
from planner.trainers.convert import read_trainer_config
from planner.trainers.deepspeed import pipeline_runtime

REPO = Path(__file__).resolve().parents[1]
MIB = 2 ** 20


def test_closed_form() -> None:
    """m receive buffers (the n in flight are saved inputs already) and m gradient receives plus n outputs."""
    inner = ChunkBoundary(received=3 * MIB, sent=2 * MIB)
    assert p2p_buffer_bytes(inner, 8) == (8 * 5 * MIB, -MIB)
    assert p2p_buffer_bytes(ChunkBoundary(sent=2 * MIB), 8) == (16 * MIB, 2 * MIB)  # the first stage
    assert p2p_buffer_bytes(ChunkBoundary(received=3 * MIB), 8) == (24 * MIB, -3 * MIB)  # the last stage
    assert p2p_buffer_bytes(ChunkBoundary(), 8) == (0, 0)
    # The last stage of a schedule asked for its outputs keeps every micro-batch's logits to the end of the step.
    assert p2p_buffer_bytes(ChunkBoundary(received=3 * MIB, returned=5 * MIB), 8) == (8 * 8 * MIB, -3 * MIB)


def test_rank_memory_adds_them_to_the_activations(tiny_cost) -> None:
    chunks = [[PricedSegment(tiny_cost, count=2)], [PricedSegment(tiny_cost)]]
    plain = rank_memory(chunks, [3, 2], num_microbatches=8)
    kept = rank_memory(chunks, [3, 2], num_microbatches=8,
                       boundaries=[ChunkBoundary(sent=MIB), ChunkBoundary(received=MIB, sent=MIB)])
    # chunk 0: 8 gradient receives + 3 outputs; chunk 1: 8 + 8, its 2 in-flight inputs saved already, 2 outputs
    assert kept.activations - plain.activations == (8 + 3) * MIB + 16 * MIB
    assert kept.total - plain.total == kept.activations - plain.activations
    with pytest.raises(ValueError, match="2 chunks but 1 chunk boundaries"):
        rank_memory(chunks, [3, 2], boundaries=[ChunkBoundary()])


@pytest.fixture
def tiny_cost():
    from costmodel.layer_cost import LayerCost

    return LayerCost(fwd_compute_s=1e-3, bwd_compute_s=2e-3, fwd_comm_s=0.0, bwd_comm_s=0.0, param_count=1000,
                     param_bytes=2000, saved_bytes_none=4 * MIB, saved_bytes_selective=2 * MIB, saved_bytes_full=MIB,
                     recompute_selective_s=0.0, recompute_full_s=1e-3, boundary_bytes=MIB)


def test_only_pipelines_keep_them() -> None:
    assert RuntimeOptions().keeps_p2p_buffers(2) and not RuntimeOptions().keeps_p2p_buffers(1)
    assert not RuntimeOptions(p2p_transient_buffers=True).keeps_p2p_buffers(4)


def test_megatron_and_deepspeed_configs_free_them(tmp_path: Path) -> None:
    args = tmp_path / "train.args"
    args.write_text("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --micro-batch-size 1 "
                    "--global-batch-size 16 --bf16\n")
    assert read_trainer_config(f"megatron:{args}").runtime.p2p_transient_buffers
    args.write_text("--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16 --bf16\n")
    assert not read_trainer_config(f"megatron:{args}").runtime.p2p_transient_buffers  # no pipeline
    assert pipeline_runtime({}, 4, "bfloat16")["p2p_transient_buffers"]
    assert "p2p_transient_buffers" not in pipeline_runtime({}, 1, "bfloat16")


def test_this_runtime_refuses_a_plan_priced_without_them() -> None:
    priced = Strategy(pp=2, microbatch_size=1, num_microbatches=4, runtime=RuntimeOptions(p2p_transient_buffers=True))
    assert "p2p_transient_buffers" in runtime_unsupported(priced)
    assert not runtime_unsupported(Strategy(pp=2, microbatch_size=1, num_microbatches=4))
    # Without a pipeline there are no buffers: the option changes nothing, and the plan runs.
    assert not runtime_unsupported(Strategy(dp=2, runtime=RuntimeOptions(p2p_transient_buffers=True)))


def test_exports_say_where_the_plan_priced_them_otherwise(capsys) -> None:
    plan = REPO / "plans" / "llama-tiny-pp4-1x8xh100.json"
    assert main(["export", str(plan), "--to", "megatron", "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any("Megatron-LM frees each pipeline receive" in w for w in warnings)
    assert main(["export", str(plan), "--to", "torchtitan", "--json"]) == 0
    assert not any("pipeline stages keep" in w for w in json.loads(capsys.readouterr().out)["warnings"])


def _estimate_with_and_without(capsys, flag: str) -> tuple[dict, dict, list[int]]:
    """`stratagem estimate` of gpt-tiny, pp2 1F1B with 16 micro-batches of 1, without and with `flag`: both plans
    and, per stage, the peak bytes the flag adds."""
    base = ["estimate", "gpt-tiny", "--cluster", "1x8xa100-80gb", "--batch", "16", "--tp", "1", "--pp", "2",
            "--dp", "1", "--mbs", "1", "--json"]
    assert main(base) == 0
    without = json.loads(capsys.readouterr().out)
    assert main([*base, flag]) == 0
    with_flag = json.loads(capsys.readouterr().out)
    more = [a - b for a, b in zip(with_flag["predicted"]["peak_memory_bytes"],
                                  without["predicted"]["peak_memory_bytes"], strict=True)]
    return without, with_flag, more


def test_cli_estimate_prices_them_or_not(capsys) -> None:
    kept, freed, fewer = _estimate_with_and_without(capsys, "--p2p-transient-buffers")
    assert freed["strategy"]["runtime"]["p2p_transient_buffers"]
    # 16 micro-batches: stage 0 keeps 16 gradient receives and its 2 in-flight outputs, stage 1 16 receives (1 of
    # them its saved input); the step time does not change.
    more = [-x for x in fewer]
    assert more[0] > 0 and more[1] > 0 and more[0] / more[1] == pytest.approx((16 + 2) / (16 - 1), rel=0.05)
    assert kept["predicted"]["step_time_s"] == freed["predicted"]["step_time_s"]


def test_returned_outputs_are_the_last_stages_logits(capsys) -> None:
    """torchtitan's `schedule.step` returns the outputs: m logits of mbs x seq x vocab in the training dtype."""
    plain, returned, more = _estimate_with_and_without(capsys, "--pp-returns-outputs")
    vocab, seq = 512, 64  # gpt-tiny
    assert more == [0, 16 * seq * vocab * 2]
    assert returned["predicted"]["step_time_s"] == plain["predicted"]["step_time_s"]


def test_torchtitan_config_returns_them_and_exports_say_so(tmp_path: Path, capsys) -> None:
    job = tmp_path / "job.toml"
    job.write_text("[parallelism]\npipeline_parallel_degree = 2\n[training]\nlocal_batch_size = 8\nseq_len = 64\n")
    assert read_trainer_config(f"torchtitan:{job}").runtime.pp_returns_outputs
    job.write_text("[parallelism]\ntensor_parallel_degree = 2\n[training]\nlocal_batch_size = 8\nseq_len = 64\n")
    assert not read_trainer_config(f"torchtitan:{job}").runtime.pp_returns_outputs
    plan = REPO / "plans" / "llama-tiny-pp4-1x8xh100.json"
    assert main(["export", str(plan), "--to", "torchtitan", "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any("asks the pipeline schedule for its outputs" in w for w in warnings)
