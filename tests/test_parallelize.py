"""Tests of applying plans: the device mesh, tensor-parallel layouts, pipeline cuts, recomputation,
`planner.runtime.parallelize` + `train_step` against single-process training, and `stratagem run`.

Multi-process tests launch `torchrun --standalone` (gloo, CPU) once per world size with many configs in one
launch (tests/dist/parallel_worker.py) and compare every config with a single-process run of the same model,
seed and data. Tolerances (float32; sharded and unsharded runs differ only by reduction order, ~1e-7):
- loss of each of the 3 steps: relative difference <= LOSS_RTOL = 1e-4;
- final parameters: max |p - p_ref| <= PARAM_RTOL * max |p_ref| + PARAM_ATOL, PARAM_RTOL = 1e-4 (PARAM_ATOL =
  1e-7 covers parameters whose exact gradient is zero, like attention key biases, where float noise is all
  there is);
- parameter *updates* p - p0: max difference <= UPDATE_RTOL = 1e-2 of the reference update (floor 1e-6). The
  updates are ~1e-3 of the weights, so this is what catches a gradient scaled wrongly (a mis-averaged
  micro-batch or data-parallel reduction) that the parameter tolerance alone could miss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from costmodel.estimate import resolve_stages
from costmodel.sharding.rules import Style
from costmodel.strategy import MeshAxis, Recompute, Schedule, StageSpec, Strategy
from planner.errors import PlanLoadError, UserError
from planner.plan import ModuleSharding
from planner.runtime.apply_pipeline import build_stage_modules, segment_stage_index, stage_indices_of_rank
from planner.runtime.apply_recompute import apply_recompute, attention_modules, is_collective_op
from planner.runtime.apply_tp import (
    parallel_styles,
    replicated_islands,
    resolve_styles,
    sequence_parallel_styles,
    shared_parameters,
)
from planner.runtime.device_mesh import check_world_size, mesh_layout
from planner.runtime.parallelize import plan_stages

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist" / "parallel_worker.py"
sys.path.insert(0, str(WORKER.parent))

import parallel_worker as worker  # noqa: E402  (the worker's configs and tiny models, shared with the launch)

LOSS_RTOL = 1e-4
PARAM_RTOL = 1e-4
PARAM_ATOL = 1e-7
UPDATE_RTOL = 1e-2
UPDATE_FLOOR = 1e-6

CONFIGS_2 = ("dp2", "dp2_zero1", "fsdp2", "fsdp2_offload", "tp2", "tp2_sp", "tp2_sp_llama", "tp2_moe", "tp2_sp_moe",
             "pp2_gpipe", "pp2_1f1b", "pp2_1f1b_one_microbatch", "pp2_interleaved", "pp2_interleaved_m3",
             "pp2_interleaved_m1", "pp2_interleaved_uneven", "pp2_zb", "pp2_interleaved_zb", "pp2_zbv",
             "pp2_zbv_untied", "pp2_dualpipev", "pp2_llama_uneven", "user_pp2", "user_dp2_recompute", "recompute_full_dp2",
             "recompute_selective_tp2", "recompute_op_fsdp2", "tp2_sp_selective_island", "tp2_sp_unpaired_colwise", "tp2_sp_sequence_mlp", "recompute_pp2",
             "partial_recompute_pp2",
             "cp2", "cp2_llama_recompute", "ep2", "ep2_fsdp", "tp2_sp_moe_odd_slots")
CONFIGS_4 = ("dp4_fsdp", "tp2_dp2", "tp2_sp_fsdp2", "pp2_dp2", "pp2_fsdp2", "pp2_fsdp2_offload", "pp2_tp2", "pp2_tp2_sp_recompute", "pp2_tp2_sp_zb",
             "pp4_1f1b", "pp2_interleaved_dp2", "pp2_interleaved_uneven_zero1", "pp2_zbv_fsdp2",
             "pp2_zbv_dp2", "pp2_zb_zero1", "pp2_zb_zero2", "pp2_dualpipev_tp2", "user_pp2_fsdp2", "cp2_dp2", "cp2_fsdp2_selective", "cp2_tp2_sp",
             "cp2_pp2", "ep2_dp4", "ep2_tp2", "tp2_moe_fsdp", "ep4_tp2", "ep2_tp4", "ep2_pp2",
             "cp2_ep2_moe")


def tiny_gpt(**overrides: Any) -> nn.Module:
    from models import gpt

    torch.manual_seed(0)
    return gpt.build(gpt.GPTConfig(**{**worker.TINY["gpt"], **overrides}), "cpu")


# --- device mesh -----------------------------------------------------------------------------------------

def test_mesh_is_outermost_first_with_tp_fastest():
    layout = mesh_layout(Strategy(dp=2, tp=2, pp=2))
    assert layout.names == ("pp", "dp", "cp", "tp")  # every axis, size 1 included
    assert layout.sizes == (2, 2, 1, 2)
    # rank = pp*4 + dp*2 + tp: tp has stride 1, dp stride tp, pp stride tp*dp (Megatron-LM order)
    assert [tuple(layout.coordinates(r)[a] for a in ("pp", "dp", "tp")) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]


def test_mesh_follows_a_custom_axis_order():
    order = (MeshAxis.DP, MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.PP)
    layout = mesh_layout(Strategy(dp=4, tp=2, mesh_order=order))
    assert layout.names == ("pp", "cp", "tp", "dp")
    assert layout.coordinates(1)["dp"] == 1 and layout.coordinates(4)["tp"] == 1


def test_mesh_has_a_cp_axis_between_dp_and_tp():
    layout = mesh_layout(Strategy(dp=2, tp=2, cp=2, ep=2))
    assert layout.names == ("pp", "dp", "cp", "tp") and layout.sizes == (1, 2, 2, 2)
    # rank = dp*4 + cp*2 + tp (Megatron-LM's order tp, cp, dp, pp); ep has no axis: it splits dp
    assert [tuple(layout.coordinates(r)[a] for a in ("dp", "cp", "tp")) for r in (1, 2, 5, 6)] == [
        (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 0)]


def test_expert_parallelism_must_fit_the_tp_x_dp_ranks():
    # An ep group is consecutive tp x dp ranks (cp ranks hold the same experts): the strategy refuses the rest
    with pytest.raises(ValueError, match=r"ep=4 must divide tp=1 or be tp times a divisor of dp=2.*valid ep: 1, 2"):
        Strategy(dp=2, cp=2, ep=4)
    with pytest.raises(ValueError, match=r"valid ep: 1, 2, 4, 8$"):
        Strategy(dp=4, tp=2, ep=6)
    assert Strategy(dp=2, tp=4, ep=2).ep_dp == 1 and Strategy(dp=4, tp=2, ep=4).ep_dp == 2


def test_world_size_mismatch_is_refused_with_both_numbers():
    with pytest.raises(PlanLoadError, match=r"needs 8 processes .*world size is 4"):
        check_world_size(Strategy(dp=2, tp=2, pp=2), 4)
    with pytest.raises(PlanLoadError, match=r"needs 4 processes \(dp=1 tp=2 pp=1 cp=2\)"):
        check_world_size(Strategy(tp=2, cp=2), 2)


# --- context parallelism ---------------------------------------------------------------------------------

def test_load_balanced_chunks():
    # 2*cp chunks of T/(2cp): rank r holds chunks r and 2cp-1-r (Llama 3 sec. 3.3.2)
    from planner.runtime.apply_cp import SequenceShard

    assert SequenceShard(2, 0).positions(8).tolist() == [0, 1, 6, 7]
    assert SequenceShard(2, 1).positions(8).tolist() == [2, 3, 4, 5]
    assert SequenceShard(3, 1).positions(12).tolist() == [2, 3, 8, 9]
    assert SequenceShard(2, 1).gathered_positions(8).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    # every rank does the same causal work: the sum over its queries of (position + 1) keys
    work = [sum(p + 1 for p in SequenceShard(4, r).positions(64).tolist()) for r in range(4)]
    assert len(set(work)) == 1
    with pytest.raises(UserError, match="sequence length 10 does not split into 2.cp=4 equal chunks"):
        SequenceShard(2, 0).positions(10)


def test_split_and_restore_order_round_trip():
    from planner.runtime.apply_cp import SequenceShard

    x = torch.arange(2 * 12 * 3).reshape(2, 12, 3)
    shards = [SequenceShard(3, r) for r in range(3)]
    gathered = torch.cat([s.split(x, 1) for s in shards], dim=1)  # what an all-gather over the ranks returns
    assert torch.equal(shards[0].split(x, 1)[:, :, 0] // 3 % 12, torch.tensor([[0, 1, 10, 11]] * 2))
    assert torch.equal(shards[1].restore_order(gathered, 1), x)


def test_local_queries_against_gathered_keys_equal_full_causal_attention():
    import torch.nn.functional as F

    from planner.runtime.apply_cp import SequenceShard, causal_mask

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    cp = 4
    shards = [SequenceShard(cp, r) for r in range(cp)]
    keys = torch.cat([s.split(k, 2) for s in shards], dim=2)
    values = torch.cat([s.split(v, 2) for s in shards], dim=2)
    for s in shards:
        local = F.scaled_dot_product_attention(s.split(q, 2), keys, values, attn_mask=causal_mask(s, 16, "cpu"))
        torch.testing.assert_close(local, s.split(full, 2), rtol=1e-12, atol=1e-12)
    # the first query of rank 1 (position 2) sees gathered keys 0, 1 (rank 0's positions 0, 1) and 4 (itself)
    assert causal_mask(shards[1], 16, "cpu")[0].nonzero().flatten().tolist() == [0, 1, 4]


def test_grouped_query_attention_exchanges_kv_heads_only():
    # A llama block (4 query heads, 2 KV heads) under cp: the K/V all-gather carries the 2 KV heads, not their
    # repeats, and the attention equals the one computed from the whole repeated K/V.
    import torch.nn.functional as F

    from models import llama
    from planner.runtime.apply_cp import CpGroup, SequenceShard, apply_context_parallel, causal_mask

    class Recording(CpGroup):
        def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
            sent.append(tuple(x.shape))
            return torch.cat([x] * self.shard.cp, dim=dim)  # every rank holds the same tokens here

    sent: list[tuple[int, ...]] = []
    model = llama.build(llama.LlamaConfig(**worker.TINY["llama"]), "cpu")
    attn = model.blocks[0].attn
    assert (attn.num_heads, attn.num_kv_heads) == (4, 2)
    x = torch.randn(1, 4, 32)
    apply_context_parallel(model, Recording(SequenceShard(2, 0), None))
    out = attn(x)
    assert sent == [(1, 2, 4, 8), (1, 2, 4, 8)]  # (batch, KV heads, local tokens, head_dim) for K and V
    # the reference: the module's own projections and (global-position) rotary, K/V repeated before the gather
    q = attn.rotary(attn.q_proj(x).view(1, 4, 4, 8).transpose(1, 2))
    k = attn.rotary(attn.k_proj(x).view(1, 4, 2, 8).transpose(1, 2)).repeat_interleave(2, dim=1)
    v = attn.v_proj(x).view(1, 4, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    keys, values = torch.cat([k, k], dim=2), torch.cat([v, v], dim=2)
    ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_mask(SequenceShard(2, 0), 8, "cpu"))
    torch.testing.assert_close(out, attn.o_proj(ref.transpose(1, 2).reshape(1, 4, 32)))


def test_context_parallel_refuses_explicit_attention_and_models_without_blocks():
    from planner.runtime.apply_cp import CpGroup, SequenceShard, apply_context_parallel

    group = CpGroup(SequenceShard(2, 0), None)  # never used: both fail before communicating
    model = tiny_gpt(attn_impl="math")
    changed = apply_context_parallel(model, group)
    assert changed == [f"blocks.{i}.attn" for i in range(4)]
    with pytest.raises(UserError, match="blocks.0.attn computed attention without F.scaled_dot_product_attention"):
        model.blocks[0].attn(torch.zeros(1, 4, 32))
    with pytest.raises(UserError, match="transformer blocks"):
        apply_context_parallel(worker.UserMLP(worker.UserMLPConfig()), group)


def test_rotary_tables_read_global_positions():
    from models import llama
    from planner.runtime.apply_cp import CpGroup, SequenceShard, apply_context_parallel

    model = llama.build(llama.LlamaConfig(**worker.TINY["llama"]), "cpu")
    rotary = model.blocks[0].attn.rotary
    x = torch.randn(1, 4, 8, rotary.head_dim)
    full = rotary(x)
    shard = SequenceShard(2, 1)
    changed = apply_context_parallel(model, CpGroup(shard, None))
    assert "blocks.0.attn.rotary" in changed
    torch.testing.assert_close(rotary(shard.split(x, 2)), shard.split(full, 2), rtol=0, atol=0)
    assert rotary.cos.shape[0] == worker.TINY["llama"]["seq"]  # the tables are put back after the call


# --- expert parallelism ----------------------------------------------------------------------------------

def test_expert_parallelism_keeps_this_ranks_experts():
    from models import moe
    from planner.runtime.apply_ep import EpGroup, apply_expert_parallel, scale_gradient

    model = moe.build(moe.MoEConfig(**worker.TINY["moe"]), "cpu")
    full = model.blocks[1].mlp.experts.up_proj.detach().clone()  # (4 experts, 32, 32)
    shards = apply_expert_parallel(model, EpGroup(2, 1, None))
    assert len(shards.modules) == 2 and "blocks.1.mlp.experts.up_proj" in shards.param_names
    assert torch.equal(model.blocks[1].mlp.experts.up_proj, full[2:4])
    with pytest.raises(UserError, match="ep=3 does not divide the 4 experts of blocks.0.mlp.experts; valid ep: 1, 2, 4"):
        apply_expert_parallel(moe.build(moe.MoEConfig(**worker.TINY["moe"]), "cpu"), EpGroup(3, 0, None))
    with pytest.raises(UserError, match="GPT has no experts module"):
        apply_expert_parallel(tiny_gpt(), EpGroup(2, 0, None))

    class TokenChoiceExperts(nn.Module):  # Hugging Face Mixtral's layout: tokens plus their routing
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.down_proj = nn.Parameter(torch.zeros(4, 8, 8))

        def forward(self, tokens, top_k_index, top_k_weights):
            return tokens

    with pytest.raises(UserError, match="TokenChoiceExperts. is not called with per-expert token buffers"):
        apply_expert_parallel(nn.Sequential(TokenChoiceExperts()), EpGroup(2, 0, None))
    x = torch.ones(3, requires_grad=True)
    (scale_gradient(x, 0.5) * 4).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


# --- pipeline cuts ---------------------------------------------------------------------------------------

def test_a_plan_without_stages_runs_the_split_the_estimator_priced():
    # The runtime cuts a plan without explicit stages where costmodel.estimate priced it: the blocks spread
    # evenly, embedding and head on the end stages (a split by segment count would put them differently).
    model = tiny_gpt(layers=6)
    chain = _chain(model)
    for pp, v in ((2, 1), (3, 1), (2, 2)):
        strategy = Strategy(pp=pp, virtual_stages=v, num_microbatches=2 * pp,
                            schedule="interleaved" if v > 1 else "1f1b", recompute=Recompute.FULL)
        stages = plan_stages(strategy, chain)
        assert stages == resolve_stages(chain, strategy)
        assert all(s.recompute is Recompute.FULL for s in stages)
    # embedding | 6 blocks | head: two blocks per stage (a split by segment count would give 3, 3, 2 segments)
    assert [s.num_segments for s in plan_stages(Strategy(pp=3, num_microbatches=3), chain)] == [3, 2, 3]
    with pytest.raises(UserError, match=f"{len(chain)} segments into {len(chain) + 1}"):
        plan_stages(Strategy(pp=len(chain) + 1), chain)


def test_stage_ranges_must_tile_the_chain():
    assert segment_stage_index((StageSpec(0, 2), StageSpec(2, 3)), 3) == (0, 0, 1)
    with pytest.raises(UserError, match="starts at segment 3, expected 2"):
        segment_stage_index((StageSpec(0, 2), StageSpec(3, 4)), 4)
    with pytest.raises(UserError, match="cover 3 segments but .* has 5"):
        segment_stage_index((StageSpec(0, 2), StageSpec(2, 3)), 5)


def test_looped_stage_placement():
    assert stage_indices_of_rank(1, 2, 4) == (1, 3)
    assert stage_indices_of_rank(0, 4, 4) == (0,)
    # V-shaped zero-bubble schedules: rank r holds r and 2p - 1 - r (the first and the last stage on rank 0)
    assert stage_indices_of_rank(0, 2, 4, Schedule.ZBV) == (0, 3)
    assert stage_indices_of_rank(1, 4, 8, Schedule.DUALPIPEV) == (1, 6)


def _chain(model: nn.Module) -> Any:
    import ir

    return ir.build_layer_chain(ir.trace(model, (torch.zeros(1, worker.TINY["gpt"]["seq"], dtype=torch.long),)))


@pytest.mark.parametrize("first_blocks", [(2,), (1, 3), (1, 2, 3)])
def test_stage_modules_compose_to_the_model(first_blocks):
    model = tiny_gpt().eval()
    chain = _chain(model)
    cfg = worker.Config("gpt", {}, first_blocks=first_blocks)
    stages = worker.plan_stages(cfg, chain)
    parts = build_stage_modules(model, chain, stages)
    ids = torch.randint(0, 64, (3, 8))
    x: Any = (ids,)
    for i in range(len(stages)):
        out = parts[i](*x)
        x = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(x[0], model(ids), rtol=0, atol=0)
    # each block lives on the stage the plan puts it on, under its own name
    for stage, part in parts.items():
        names = {n for n, _ in part.named_parameters()}
        lo = 0 if stage == 0 else first_blocks[stage - 1]
        hi = first_blocks[stage] if stage < len(first_blocks) else 4
        assert {int(n.split(".")[1]) for n in names if n.startswith("blocks.")} == set(range(lo, hi))
    # the tied head/embedding weight is held by the first stage (embedding) and the last (head)
    assert "tok_embed.weight" in {n for n, _ in parts[0].named_parameters()}
    assert "lm_head.weight" in {n for n, _ in parts[len(stages) - 1].named_parameters()}


def test_stage_output_must_be_a_tensor():
    from planner.runtime.apply_pipeline import check_stage_outputs

    with pytest.raises(UserError, match="'size' .*int.* crosses a pipeline cut"):
        check_stage_outputs(("x", "size"), torch.zeros(1), 3)


# --- tensor-parallel layouts -----------------------------------------------------------------------------

def test_first_matching_pattern_wins_and_unknown_patterns_are_refused():
    model = tiny_gpt()
    styles = resolve_styles(model, (ModuleSharding("blocks.0.attn.q_proj", Style.REPLICATE),
                                    ModuleSharding("blocks.*.attn.q_proj", Style.COLWISE)))
    assert styles["blocks.0.attn.q_proj"] is Style.REPLICATE
    assert styles["blocks.3.attn.q_proj"] is Style.COLWISE
    with pytest.raises(UserError, match=r"'blocks\.\*\.mlp\.gate_proj'.*modules: tok_embed"):
        resolve_styles(model, (ModuleSharding("blocks.*.mlp.gate_proj", Style.COLWISE),))


def test_layouts_follow_colwise_rowwise_pairs():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    model = tiny_gpt()
    styles = resolve_styles(model, tuple(ModuleSharding(p, s) for p, s in worker.TP_FULL))
    plain = parallel_styles(model, styles, sequence_parallel=False)
    assert plain["blocks.0.attn.q_proj"].output_layouts == (Shard(-1),)   # feeds o_proj: stays sharded
    assert plain["lm_head"].output_layouts == (Replicate(),)              # no rowwise partner: gathered
    assert plain["blocks.0.attn.o_proj"].output_layouts == (Replicate(),)
    assert "blocks.0.attn_norm" not in plain
    sp_styles = sequence_parallel_styles(model, styles)
    assert sp_styles["blocks.2.mlp_norm"] is Style.SEQUENCE and "norm" not in sp_styles
    sp = parallel_styles(model, sp_styles, sequence_parallel=True)
    assert sp["blocks.0.attn.o_proj"].output_layouts == (Shard(1),)        # reduce-scatter over the sequence
    assert isinstance(sp["blocks.0.attn_norm"], SequenceParallel)
    assert isinstance(sp["blocks.0.attn"], PrepareModuleInput)             # one all-gather per sub-layer
    assert isinstance(sp["blocks.0.mlp"], PrepareModuleInput)


def test_sub_layers_without_a_colwise_rowwise_pair_run_replicated_under_sequence_parallelism():
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    model = tiny_gpt()
    # the up projection alone is colwise: it gathers its output, so the MLP must read and return full sequences
    sharding = worker.TP_ATTENTION + (("blocks.*.mlp.up_proj", Style.COLWISE),)
    styles = sequence_parallel_styles(model, resolve_styles(model, tuple(ModuleSharding(p, s) for p, s in sharding)))
    assert replicated_islands(model, styles) == [f"blocks.{i}.mlp" for i in range(len(model.blocks))]
    sp = parallel_styles(model, styles, sequence_parallel=True)
    assert isinstance(sp["blocks.0.mlp"], PrepareModuleInputOutput)
    assert isinstance(sp["blocks.0.attn"], PrepareModuleInput)             # paired: gathered once, reduce-scattered


def test_selective_recompute_saves_collective_outputs():
    from torch.utils.checkpoint import CheckpointPolicy

    from planner.runtime.apply_recompute import _attention_module_policy, _inline_attention_policy

    functional = torch.ops._c10d_functional
    for op in (functional.all_gather_into_tensor.default, functional.reduce_scatter_tensor.default,
               functional.all_reduce.default, functional.wait_tensor.default):
        assert is_collective_op(op)
        assert _attention_module_policy(None, op) is CheckpointPolicy.MUST_SAVE
        assert _inline_attention_policy(None, op) is CheckpointPolicy.MUST_SAVE
    assert not is_collective_op(torch.ops.aten.bmm.default)
    assert _attention_module_policy(None, torch.ops.aten.bmm.default) is CheckpointPolicy.PREFER_RECOMPUTE


def test_style_on_the_wrong_module_type_is_refused():
    from planner.runtime.apply_tp import apply_tensor_parallel

    with pytest.raises(UserError, match="blocks.0.attn_norm .LayerNorm. cannot be colwise-sharded"):
        apply_tensor_parallel(tiny_gpt(), (ModuleSharding("blocks.0.attn_norm", Style.COLWISE),), None,
                              sequence_parallel=False)


def test_tied_weights_are_found():
    from models import llama

    assert shared_parameters(tiny_gpt()) == [[("tok_embed", "weight"), ("lm_head", "weight")]]
    assert shared_parameters(tiny_gpt(tie_embeddings=False)) == []
    assert shared_parameters(llama.build(llama.LlamaConfig(**worker.TINY["llama"]), "cpu")) == []


# --- recomputation ---------------------------------------------------------------------------------------

class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: Recompute, attn_impl: str) -> Counter[str]:
    from models import gpt

    model = tiny_gpt(attn_impl=attn_impl, layers=2)
    apply_recompute(list(model.blocks), mode)
    ids = torch.randint(0, 64, (2, 8))
    loss = gpt.loss(model(ids), (ids,))
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def _recomputed(mode: Recompute, attn_impl: str) -> Counter[str]:
    counts, base = _backward_ops(mode, attn_impl), _backward_ops(Recompute.NONE, attn_impl)
    return Counter({k: counts[k] - base[k] for k in counts if counts[k] != base[k]})


def test_full_recompute_reruns_every_layer_forward():
    extra = _recomputed(Recompute.FULL, "sdpa")
    # per block (2 blocks): the forward is rerun up to the last op whose saved tensors backward needs (torch
    # stops recomputing early): q/k/v/o and up projections (the final down_proj is not rerun), 2 layer norms,
    # 1 GELU, 1 fused attention
    assert extra["addmm"] == 10 and extra["native_layer_norm"] == 4 and extra["gelu"] == 2
    assert extra["_scaled_dot_product_flash_attention_for_cpu"] == 2


def test_op_recompute_keeps_every_other_matmul_and_the_attention():
    """Per-op checkpointing (torchtitan's "op"): per block q(1st), v(3rd) and up(5th) projections and the fused
    attention are kept; k (2nd) and o (4th) are rerun with the norms and the GELU; down (6th) is not needed by
    the backward, so torch does not rerun it. `costmodel.layer_pricing.op_policy_kept` prices the same set."""
    extra = _recomputed(Recompute.OP, "sdpa")
    assert extra["addmm"] == 2 * 2 and extra["native_layer_norm"] == 2 * 2 and extra["gelu"] == 2
    assert extra["_scaled_dot_product_flash_attention_for_cpu"] == 0
    import ir
    from costmodel.layer_pricing import op_policy_kept

    chain = ir.build_layer_chain(ir.trace(tiny_gpt(layers=2), (torch.randint(0, 64, (2, 8)),)))
    block = next(s for s in chain.segments if any(n.attr("attention_core", False) for n in chain.nodes_of(s)))
    kept = sorted(n.module_path.rsplit(".", 1)[-1] or n.name for n in chain.nodes_of(block)
                  if n.name in op_policy_kept(chain.nodes_of(block)))
    assert len(kept) == 4 and "q_proj" in kept and "v_proj" in kept


@pytest.mark.parametrize("attn_impl", ["sdpa", "math"])
def test_selective_recompute_reruns_only_the_attention_core(attn_impl):
    extra = _recomputed(Recompute.SELECTIVE, attn_impl)
    assert extra["addmm"] == 0 and extra["native_layer_norm"] == 0 and extra["gelu"] == 0
    if attn_impl == "sdpa":
        assert extra["_scaled_dot_product_flash_attention_for_cpu"] == 2
    else:  # QK^T and AV batched matmuls, the scale, the causal mask and the softmax of both blocks
        assert extra["bmm"] == 4 and extra["_softmax"] == 2 and extra["masked_fill"] == 2 and extra["mul"] == 2


def test_layers_are_blocks_or_the_roots_children_with_lists_expanded():
    from planner.runtime.parallelize import model_layers

    assert [n for n, _ in model_layers(tiny_gpt())] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    user = worker.UserMLP(worker.UserMLPConfig(depth=2))
    assert [n for n, _ in model_layers(user)] == ["inp", "hidden.0", "hidden.1", "out"]


def test_attention_modules_are_found_by_layout():
    model = tiny_gpt()
    assert attention_modules(model.blocks[0]) == [model.blocks[0].attn]
    assert attention_modules(model.blocks[0].mlp) == []


# --- plan checks and the single-process path -------------------------------------------------------------

@pytest.fixture
def single_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _plan_for(model: nn.Module, strategy: dict[str, Any], *, fingerprint: str | None = None) -> Any:
    cfg = worker.Config("gpt", strategy)
    plan = worker.make_plan(model, cfg, _chain(model))
    if fingerprint is not None:
        from dataclasses import replace

        plan = replace(plan, model=replace(plan.model, fingerprint=fingerprint))
    return plan


def test_parallelize_needs_torch_distributed():
    from planner.runtime.parallelize import parallelize

    model = tiny_gpt()
    with pytest.raises(UserError, match="not initialized; run under torchrun"):
        parallelize(model, _plan_for(model, dict(microbatch_size=2)))


def test_plans_for_another_model_or_world_are_refused(single_rank_group):
    from planner.runtime.parallelize import parallelize

    model = tiny_gpt()
    with pytest.raises(PlanLoadError, match="needs 2 processes"):
        parallelize(model, _plan_for(model, dict(dp=2)))
    bigger = tiny_gpt(layers=5)
    with pytest.raises(PlanLoadError, match="parameters but this model has"):
        parallelize(bigger, _plan_for(model, dict(microbatch_size=2)))
    with pytest.raises(PlanLoadError, match="fingerprint 0123 does not match"):
        parallelize(model, _plan_for(model, dict(microbatch_size=2), fingerprint="0123"),
                    example_inputs=(torch.zeros(4, 8, dtype=torch.long),))


def test_single_rank_accumulation_matches_one_big_batch(single_rank_group):
    from models import gpt
    from planner.runtime.parallelize import parallelize
    from planner.runtime.train_step import local_batch, train_step

    model, ref = tiny_gpt(), tiny_gpt()
    pm = parallelize(model, _plan_for(model, dict(microbatch_size=2, num_microbatches=3)), loss_fn=gpt.loss)
    batch = (torch.randint(0, 64, (6, 8)),)
    loss = train_step(pm, local_batch(pm, batch), torch.optim.SGD(model.parameters(), lr=0.5))
    ref_loss = gpt.loss(ref(*batch), batch)
    ref_loss.backward()
    assert loss == pytest.approx(ref_loss.item(), rel=LOSS_RTOL)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    with pytest.raises(UserError, match="global batch of 4 samples; the plan trains on 6"):
        local_batch(pm, (batch[0][:4],))


def test_partial_gradients_are_synced_in_one_buffer_with_their_parameters_layout(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from planner.runtime.train_step import sync_partial_gradients

    mesh = init_device_mesh("cpu", (1,))
    norms = [nn.Parameter(distribute_tensor(torch.ones(n), mesh, [Replicate()])) for n in (3, 5)]
    sharded = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    plain = nn.Parameter(torch.ones(2))
    for i, p in enumerate(norms):
        p.grad = DTensor.from_local(torch.full((p.numel(),), float(i + 1)), mesh, [Partial()])
    sharded.grad = DTensor.from_local(torch.ones(4, 2), mesh, [Partial()])
    plain.grad = torch.ones(2)
    assert sync_partial_gradients([norms[0], sharded, plain, norms[1]]) == 2
    for i, p in enumerate(norms):
        assert p.grad.placements == (Replicate(),)
        torch.testing.assert_close(p.grad.to_local(), torch.full((p.numel(),), float(i + 1)))
    assert sharded.grad.placements == (Partial(),)  # a sharded weight's gradient is its owner's business
    assert sync_partial_gradients(norms) == 0        # nothing partial is left


# --- multi-process: every config against a single-process run --------------------------------------------

def _launch(nproc: int, configs: tuple[str, ...], tmp: Path) -> dict[str, Any]:
    out = tmp / f"results_{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(WORKER), str(out), *configs]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0 and out.exists(), f"torchrun failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results_2(tmp_path_factory) -> dict[str, Any]:
    return _launch(2, CONFIGS_2, tmp_path_factory.mktemp("dist2"))


@pytest.fixture(scope="module")
def results_4(tmp_path_factory) -> dict[str, Any]:
    return _launch(4, CONFIGS_4, tmp_path_factory.mktemp("dist4"))


def _check_config(name: str, ranks: list[dict[str, Any]]) -> None:
    errors = [r["traceback"] for r in ranks if "error" in r]
    assert not errors, f"{name} failed:\n{errors[0]}"
    cfg = worker.CONFIGS[name]
    strategy = Strategy(**cfg.strategy)
    for rank, r in enumerate(ranks):
        for step, (got, want) in enumerate(zip(r["losses"], r["ref_losses"], strict=True)):
            assert abs(got - want) <= LOSS_RTOL * abs(want), f"{name} rank {rank} step {step}: {got} vs {want}"
        for pname, (diff, ref_max, update_diff, update_max) in r["params"].items():
            assert diff <= PARAM_RTOL * ref_max + PARAM_ATOL, f"{name} rank {rank} {pname}: {diff} vs {ref_max}"
            assert update_diff <= UPDATE_RTOL * max(update_max, UPDATE_FLOOR), (
                f"{name} rank {rank} {pname}: update differs by {update_diff}, reference update {update_max}")
    # every parameter (under one of its names when tied) is trained somewhere...
    trained = set().union(*(r["params"] for r in ranks))
    assert all(trained & set(group) for group in ranks[0]["param_groups"]), f"{name}: a parameter is missing"
    # ...attention sees this rank's share of the sequence (context parallelism splits it over cp)...
    seq = worker.TINY[cfg.family].get("seq")
    if seq is not None:
        seen = [r["attention_tokens"] for r in ranks]  # [] on a pipeline rank without blocks
        assert all(t in ([], [seq // strategy.cp]) for t in seen) and any(seen), (
            f"{name}: attention saw {seen} tokens, expected {seq // strategy.cp}")
    # ...the tp ranks split the experts' slots (each MoE layer's experts module)...
    if cfg.family == "moe" and strategy.tp > 1:
        layers = cfg.settings.get("layers", worker.TINY["moe"]["layers"])
        assert [r["split_experts"] for r in ranks] == [layers] * len(ranks), f"{name}: experts not split over tp"
    # ...and sharding really splits the model over the ranks
    full = ranks[0]["model_numel"]
    # cp ranks hold the same weights (ZeRO shards them over dp x cp); ep ranks hold different experts
    split = strategy.tp * strategy.pp * strategy.ep * (strategy.dp * strategy.cp if strategy.zero_stage else 1)
    for r in ranks:
        assert r["local_numel"] == full if split == 1 else r["local_numel"] < full
    # ...and FSDP2 offloads to the host exactly when the plan says so
    if strategy.zero_stage:
        policy = "CPUOffloadPolicy" if strategy.runtime.offload.value == "params" else "OffloadPolicy"
        assert all(r["offload_policies"] == [policy] for r in ranks), f"{name}: {ranks[0]['offload_policies']}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CONFIGS_2)
def test_two_processes_match_single_process(results_2, name):
    _check_config(name, results_2[name])


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CONFIGS_4)
def test_four_processes_match_single_process(results_4, name):
    _check_config(name, results_4[name])


# --- stratagem run ---------------------------------------------------------------------------------------

def _stratagem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "planner.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


@pytest.mark.multiprocess
def test_stratagem_plan_then_run_pp2_tp2_with_check(tmp_path):
    plan_file = tmp_path / "plan.json"
    made = _stratagem("plan", "gpt-tiny", "--cluster", "1x4xcpu", "--batch", "8", "--fix", "pp=2", "--fix", "tp=2",
                      "-o", str(plan_file))
    assert made.returncode == 0, made.stderr
    plan = json.loads(plan_file.read_text())
    assert (plan["strategy"]["pp"], plan["strategy"]["tp"]) == (2, 2)
    ran = _stratagem("run", "gpt-tiny", "--plan", str(plan_file), "--steps", "3", "--nproc", "4", "--check",
                     "--json")
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = json.loads(ran.stdout)
    assert report["check"]["passed"] and report["check"]["max_rel_loss_diff"] <= 1e-4
    assert len(report["steps"]) == 3 and report["steps"][2]["loss"] < report["steps"][0]["loss"]
    assert len(report["measured"]["peak_memory_bytes"]) == 2


@pytest.mark.multiprocess
def test_stratagem_plan_then_run_context_parallel_with_check(tmp_path):
    # cp needs >= 1024 tokens per rank (costmodel.context_parallel.MIN_TOKENS_PER_RANK): a 2048-token gpt-tiny
    plan_file = tmp_path / "plan.json"
    model = ["gpt-tiny", "--set", "seq=2048"]
    made = _stratagem("plan", *model, "--cluster", "1x4xcpu", "--batch", "2", "--fix", "cp=2", "-o", str(plan_file))
    assert made.returncode == 0, made.stderr
    assert json.loads(plan_file.read_text())["strategy"]["cp"] == 2
    ran = _stratagem("run", *model, "--plan", str(plan_file), "--steps", "2", "--nproc", "4", "--check", "--json")
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = json.loads(ran.stdout)
    assert report["strategy"]["cp"] == 2 and report["world_size"] == 4
    assert report["check"]["passed"] and report["check"]["max_rel_loss_diff"] <= 1e-4
    assert report["steps"][1]["loss"] < report["steps"][0]["loss"]


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`stratagem ARGS` in this process (torch is already imported, so it is quick)."""
    from planner.cli.main import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_refuses_a_wrong_process_count(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(_plan_for(tiny_gpt(), dict(dp=2, tp=2)).to_json())
    code, _, err = _main(capsys, "run", "gpt", "--plan", str(plan), "--nproc", "2")
    assert code == 2 and err.count("\n") == 1 and "--nproc 2 but the plan needs 4 processes (dp=2 tp=2" in err
    code, _, err = _main(capsys, "run", "gpt", "--plan", str(plan))
    assert code == 2 and "pass --nproc 4 or launch under torchrun" in err
    code, _, err = _main(capsys, "run", "gpt", "--plan", str(tmp_path / "missing.json"))
    assert code == 2 and "does not exist" in err


def test_run_single_process_plan_with_check(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(_plan_for(tiny_gpt(), dict(microbatch_size=2, num_microbatches=2)).to_json())
    sets = [f"--set={k}={v}" for k, v in worker.TINY["gpt"].items()]
    code, out, err = _main(capsys, "run", "gpt", *sets, "--plan", str(plan), "--steps", "2", "--check", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["check"]["passed"] and [s["step"] for s in report["steps"]] == [1, 2]
    assert report["steps"][1]["loss"] < report["steps"][0]["loss"]  # AdamW on a fixed batch learns it
    more_layers = [s for s in sets if not s.startswith("--set=layers=")] + ["--set=layers=5"]
    code, _, err = _main(capsys, "run", "gpt", *more_layers, "--plan", str(plan), "--steps", "1")
    assert code == 2 and "parameters but this model has" in err and err.count("\n") == 1


def test_partial_recompute_checkpoints_only_the_planned_layers():
    """A stage that recomputes part of its segments checkpoints the blocks owning them and no others: the backward
    reruns two blocks' forwards (2 GELUs), not four; without the layer chain the runtime says what it needs."""
    from models import gpt
    from planner.runtime.parallelize import _apply_recompute

    def gelus(stages: tuple[StageSpec, ...] | None) -> int:
        torch.manual_seed(0)
        model = tiny_gpt(attn_impl="sdpa")
        chain = _chain(model)
        if stages is None:
            stages = (StageSpec(0, len(chain), Recompute.FULL, recomputed=tuple(
                worker.first_segment_of_block(chain, b) for b in (1, 3))),)
        _apply_recompute(model, stages, chain, Strategy(dp=1))
        ids = torch.randint(0, 64, (2, 8))
        loss = gpt.loss(model(ids), (ids,))
        with _OpCounter() as counter:
            loss.backward()
        return counter.counts["gelu"]

    base = gelus((StageSpec(0, 1, Recompute.NONE),))
    assert gelus(None) - base == 2
    model = tiny_gpt()
    with pytest.raises(UserError, match="pass example_inputs="):
        _apply_recompute(model, (StageSpec(0, 3, Recompute.FULL, recomputed=(1,)),), None, Strategy(dp=1))
