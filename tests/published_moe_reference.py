"""Published mixture-of-experts runs with their configuration, for `bench/published_runs.py --moe-rows`.

NeMo 25.09 on DGX-H100 (Megatron-Bridge docs/performance-summary.md, read from the fork pufanyi/Megatron-Bridge at
21a2ced): Qwen3-30B-A3B, Qwen3-235B-A22B and DeepSeek-V3 pre-training, FP8 (128x128 weight / 1x128 activation
blocks in the parenthesised variant; the main figures FP8 current scaling as the section's 25.11 twin states, priced
as Transformer Engine's delayed scaling like the dense NeMo rows), token-dropless with the routing force-balanced
("we force-balance the token distribution among experts": imbalance 1.0). Their recipes
(scripts/performance/configs/{qwen3,deepseek}/workload_base_configs.py, same fork) set expert tensor parallel
size 1 (the planner's layout: experts whole, ep over tp x dp ranks), `moe_a2a_overlap=True` (the steady state's
forward and backward passes paired to hide the all-to-alls: `RuntimeOptions.ep_overlap`), and for DeepSeek-V3 the
DeepEP dispatcher (`ep_dedup`) and recomputation of the MLA up-projections and MLPs (not a policy the planner has:
left to the planner). The Megatron-Core runtime options are the dense NeMo rows' (`published_nemo_runs.csv`).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from published_reference import PublishedRun, load_published_runs

NEMO_CSV = Path(__file__).resolve().parents[1] / "bench" / "data" / "published_nemo_runs.csv"

QWEN3_235B_A22B = {"hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                   "head_dim": 128, "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128,
                   "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
                   "tie_word_embeddings": False}
"""Qwen/Qwen3-235B-A22B's config.json on the Hugging Face hub (the fields that shape the model)."""
QWEN3_30B_A3B = {**QWEN3_235B_A22B, "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "intermediate_size": 6144, "moe_intermediate_size": 768}
"""Qwen/Qwen3-30B-A3B's config.json (the same as THUDM/slime's scripts/models/qwen3-30B-A3B.sh)."""


def _qwen3_folder(config: dict) -> str:
    """`hf:FOLDER` of a Qwen3MoeConfig saved with `config` (head_dim is a config.json field the class does not
    declare, so it is planned from a folder, not with --set)."""
    import transformers

    folder = tempfile.mkdtemp(prefix="qwen3-moe-")
    transformers.Qwen3MoeConfig(**config).save_pretrained(folder)
    return f"hf:{folder}"


def nemo_moe_runs() -> list[PublishedRun]:
    """The three NeMo 25.09 DGX-H100 MoE rows (module docstring); sequence 4,096, tokens/s/GPU as published."""
    template = next(r for r in load_published_runs(NEMO_CSV, out_of_sample=True)
                    if "25.09" in r.name and "70B" in r.name)

    def row(name: str, family: str, gpus: int, batch: int, mbs: int, tp: int, pp: int, vp: int, ep: int,
            tokens_per_gpu: float, *, dedup: bool = False, inferred: tuple[str, ...] = ()) -> PublishedRun:
        return dataclasses.replace(
            template, name=f"NeMo 25.09 {name} on {gpus} H100 FP8-CS", family=family, sets=(), seq=4096,
            num_gpus=gpus, tp=tp, pp=pp, cp=1, dp=gpus // (tp * pp), ep=ep, global_batch=batch,
            microbatch_size=mbs, virtual_stages=vp, expert_imbalance=1.0, stage_layers=(),
            measured_step_s=batch * 4096 / (tokens_per_gpu * gpus), measured_memory_gib=None,
            counts="tokens/s per GPU", framework="NeMo 25.09 (Megatron-Core), expert tensor parallel 1, moe_a2a_overlap",
            runtime=dataclasses.replace(template.runtime, ep_overlap=True, ep_dedup=dedup),
            unstated=("ZeRO stage", "recompute"), inferred=inferred)

    return [row("Qwen3-30B-A3B", _qwen3_folder(QWEN3_30B_A3B), 16, 512, 2, 1, 2, 24, 8, 10494),
            row("Qwen3-235B-A22B", _qwen3_folder(QWEN3_235B_A22B), 256, 2048, 1, 2, 8, 4, 32, 1204),
            row("DeepSeek-V3", "hf:deepseek_v3", 1024, 8192, 1, 2, 8, 4, 64, 1297, dedup=True,
                inferred=("chunks of the 4 virtual stages: the planner's FLOP-balanced split of 3 dense + 58 MoE "
                          "blocks; the recipe's own pipeline layout string is not read",
                          "no multi-token-prediction module (transformers' DeepseekV3 has none)"))]
