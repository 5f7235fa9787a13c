"""Worker launched by torchrun from tests/test_parallelize.py: runs several parallel configs in one launch and
compares each with a single-process run of the same model, seed and data.

Usage: torchrun --standalone --nproc-per-node N tests/dist/parallel_worker.py OUT.json CONFIG [CONFIG ...]

For each config every rank builds the same model (same seed), trains STEPS steps with `planner.runtime.parallelize` +
`planner.runtime.train_step` on the same synthetic global batches, and also trains an unsharded copy on the whole
batch. Rank 0 writes, per config: the parallel and reference losses per step, the largest relative parameter
difference per rank, which parameter names each rank checked, and how far training moved the parameters (so a
test can tell that the comparison could have failed).

SGD is used, not Adam: Adam normalizes the gradient, so a gradient off by a constant factor (a wrong micro-batch
or data-parallel average) would go unnoticed.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from costmodel.breakdown import Estimate, TimeBreakdown
from costmodel.strategy import Recompute, RuntimeOptions, StageSpec, Strategy
from models import gpt, llama, moe
from models.synthetic import normal, token_ids
from planner.runtime.parallelize import count_trainable_params, parallelize
from costmodel.sharding.rules import Style
from planner.plan import ModelInfo, ModuleSharding, Plan, SearchInfo, TrainingConfig
from planner.runtime.train_step import local_batch, train_step
from planner.runtime.worker_exit import exit_without_teardown

STEPS = 3
LR = 0.5
SEED = 1234

C, R, V, S = Style.COLWISE, Style.ROWWISE, Style.VOCAB, Style.SEQUENCE
TP_ATTENTION = (("blocks.*.attn.q_proj", C), ("blocks.*.attn.k_proj", C), ("blocks.*.attn.v_proj", C),
                ("blocks.*.attn.o_proj", R))
TP_MLP = (("blocks.*.mlp.up_proj", C), ("blocks.*.mlp.down_proj", R))
TP_GATE = (("blocks.*.mlp.gate_proj", C),)
TP_EMBED_HEAD = (("tok_embed", V), ("lm_head", C))
SP_NORMS = (("blocks.*.attn_norm", S), ("blocks.*.mlp_norm", S))
TP_FULL = TP_ATTENTION + TP_MLP + TP_EMBED_HEAD
TP_LLAMA = TP_FULL + TP_GATE


@dataclass(frozen=True)
class Config:
    family: str
    strategy: dict[str, Any]
    sharding: tuple[tuple[str, Style], ...] = ()
    settings: dict[str, Any] = field(default_factory=dict)
    first_blocks: tuple[int, ...] = ()
    """Block index each pipeline stage after the first starts at (empty: the even split of the chain)."""
    stage_recompute: tuple[Recompute, ...] = ()
    """Recompute per stage (empty: the strategy's `recompute` everywhere)."""
    recomputed_blocks: tuple[int, ...] | None = None
    """Partial recomputation: the blocks whose segments run their stage's recompute (None: all of them)."""


TINY = {
    "gpt": dict(vocab=64, hidden=32, layers=4, heads=4, seq=8),
    "llama": dict(vocab=64, hidden=32, layers=4, heads=4, kv_heads=2, ffn_hidden=48, seq=8),
    "moe": dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn_hidden=32, seq=8, experts=4, top_k=2,
                group_size=4),
    "user": dict(features=8, width=16, depth=4),
}


@dataclass(frozen=True)
class UserMLPConfig:
    features: int = 8
    width: int = 16
    depth: int = 4


class UserMLP(nn.Module):
    """A user's own model (no zoo layout, no `blocks`): residual tanh MLP regressing a function of its input."""

    def __init__(self, c: UserMLPConfig) -> None:
        super().__init__()
        self.config = c
        self.inp = nn.Linear(c.features, c.width)
        self.hidden = nn.ModuleList(nn.Linear(c.width, c.width) for _ in range(c.depth))
        self.out = nn.Linear(c.width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = h + torch.tanh(layer(h))
        return self.out(h).squeeze(-1)


class user_family:  # noqa: N801  (stands in for a zoo family module: build / example_inputs / loss)
    @staticmethod
    def build(config: UserMLPConfig, device: str) -> nn.Module:
        return UserMLP(config).to(device)

    @staticmethod
    def example_inputs(config: UserMLPConfig, batch: int, _seq: Any, device: str) -> tuple[torch.Tensor, ...]:
        return (normal((batch, config.features), device),)

    @staticmethod
    def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, torch.sin(inputs[0].sum(-1)))


FAMILIES = {"gpt": (gpt, gpt.GPTConfig), "llama": (llama, llama.LlamaConfig), "moe": (moe, moe.MoEConfig),
            "user": (user_family, UserMLPConfig)}

CONFIGS: dict[str, Config] = {
    # 2 processes
    "dp2": Config("gpt", dict(dp=2, microbatch_size=2, num_microbatches=2)),
    "dp2_zero1": Config("gpt", dict(dp=2, microbatch_size=4, num_microbatches=1, zero_stage=1)),
    "fsdp2": Config("gpt", dict(dp=2, microbatch_size=2, num_microbatches=2, zero_stage=3)),
    # FSDP2's CPUOffloadPolicy: the shards, gradients and optimizer on the host (a no-op copy on cpu devices)
    "fsdp2_offload": Config("gpt", dict(dp=2, microbatch_size=2, num_microbatches=2, zero_stage=3,
                                        runtime=RuntimeOptions(offload="params"))),
    "tp2": Config("gpt", dict(tp=2, microbatch_size=4, num_microbatches=2), TP_FULL),
    "tp2_sp": Config("gpt", dict(tp=2, microbatch_size=4, num_microbatches=2, sequence_parallel=True),
                     TP_FULL + SP_NORMS),
    "tp2_sp_llama": Config("llama", dict(tp=2, microbatch_size=4, num_microbatches=2, sequence_parallel=True),
                           TP_LLAMA + SP_NORMS),
    "tp2_moe": Config("moe", dict(tp=2, microbatch_size=4, num_microbatches=2), TP_ATTENTION + TP_EMBED_HEAD),
    "tp2_sp_moe": Config("moe", dict(tp=2, microbatch_size=4, num_microbatches=2, sequence_parallel=True),
                         TP_ATTENTION + TP_EMBED_HEAD + SP_NORMS),
    "pp2_gpipe": Config("gpt", dict(pp=2, microbatch_size=2, num_microbatches=4, schedule="gpipe")),
    "pp2_1f1b": Config("gpt", dict(pp=2, microbatch_size=2, num_microbatches=4, schedule="1f1b")),
    "pp2_1f1b_one_microbatch": Config("gpt", dict(pp=2, microbatch_size=4, num_microbatches=1, schedule="1f1b")),
    "pp2_interleaved": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=2, num_microbatches=4,
                                          schedule="interleaved")),
    "pp2_interleaved_m3": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=1, num_microbatches=3,
                                             schedule="interleaved")),
    "pp2_interleaved_m1": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=4, num_microbatches=1,
                                             schedule="interleaved")),
    # uneven virtual stages: 5 blocks + the embedding + the head in 4 chunks, the embedding alone in the first
    "pp2_interleaved_uneven": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=2, num_microbatches=4,
                                                 schedule="interleaved"), settings=dict(layers=5),
                                     first_blocks=(0, 2, 4), stage_recompute=(Recompute.NONE, Recompute.FULL) * 2),
    # zero-bubble schedules: the backward split into input and weight gradients (torch's own schedules)
    "pp2_zb": Config("gpt", dict(pp=2, microbatch_size=2, num_microbatches=4, schedule="interleaved-zb")),
    "pp2_interleaved_zb": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=2, num_microbatches=4,
                                             schedule="interleaved-zb"), settings=dict(layers=5),
                                 first_blocks=(0, 2, 4)),
    "pp2_zbv": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=1, num_microbatches=4, schedule="zbv")),
    "pp2_zbv_untied": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=1, num_microbatches=4,
                                         schedule="zbv"), settings=dict(tie_embeddings=False)),
    "pp2_dualpipev": Config("gpt", dict(pp=2, virtual_stages=2, microbatch_size=1, num_microbatches=8,
                                        schedule="dualpipev"), first_blocks=(1, 2, 3)),
    "user_pp2": Config("user", dict(pp=2, microbatch_size=2, num_microbatches=4)),
    "user_dp2_recompute": Config("user", dict(dp=2, microbatch_size=2, num_microbatches=2, recompute="full")),
    "pp2_llama_uneven": Config("llama", dict(pp=2, microbatch_size=2, num_microbatches=4), first_blocks=(1,)),
    "recompute_full_dp2": Config("gpt", dict(dp=2, microbatch_size=4, num_microbatches=1, recompute="full")),
    "recompute_op_fsdp2": Config("gpt", dict(dp=2, zero_stage=3, microbatch_size=2, num_microbatches=2,
                                             recompute="op")),
    "recompute_selective_tp2": Config("gpt", dict(tp=2, microbatch_size=4, num_microbatches=2,
                                                  recompute="selective"), TP_FULL,
                                      settings=dict(attn_impl="sdpa")),
    # selective recomputation of a replicated attention under sp: the checkpointed module's layout hooks gather
    "tp2_sp_selective_island": Config("gpt", dict(tp=2, microbatch_size=2, num_microbatches=2,
                                                  sequence_parallel=True, recompute="selective"),
                                      TP_MLP + TP_EMBED_HEAD + SP_NORMS),
    # a colwise up projection without its rowwise partner under sp (and a reduce-scatter in a selective region)
    "tp2_sp_unpaired_colwise": Config("gpt", dict(tp=2, microbatch_size=4, num_microbatches=1,
                                                  sequence_parallel=True, recompute="selective"),
                                      TP_ATTENTION + (("blocks.*.mlp.up_proj", C),) + TP_EMBED_HEAD),
    # the MLP's linears on the sequence shard (replicated weights), as the sharding ILP picks for small layers
    "tp2_sp_sequence_mlp": Config("gpt", dict(tp=2, microbatch_size=4, num_microbatches=1, sequence_parallel=True),
                                  TP_ATTENTION + (("blocks.*.mlp.up_proj", S), ("blocks.*.mlp.down_proj", S))
                                  + TP_EMBED_HEAD + SP_NORMS),
    "partial_recompute_pp2": Config("gpt", dict(pp=2, microbatch_size=2, num_microbatches=4), first_blocks=(2,),
                                    stage_recompute=(Recompute.FULL, Recompute.FULL), recomputed_blocks=(0, 3)),
    "recompute_pp2": Config("gpt", dict(pp=2, microbatch_size=2, num_microbatches=4), first_blocks=(2,),
                            stage_recompute=(Recompute.FULL, Recompute.SELECTIVE)),
    # 4 processes
    "dp4_fsdp": Config("gpt", dict(dp=4, microbatch_size=2, num_microbatches=1, zero_stage=3)),
    "tp2_dp2": Config("gpt", dict(tp=2, dp=2, microbatch_size=2, num_microbatches=2), TP_FULL),
    "tp2_sp_fsdp2": Config("llama", dict(tp=2, dp=2, microbatch_size=2, num_microbatches=2, zero_stage=3,
                                         sequence_parallel=True), TP_LLAMA + SP_NORMS),
    "pp2_dp2": Config("gpt", dict(pp=2, dp=2, microbatch_size=1, num_microbatches=4)),
    "pp2_fsdp2": Config("gpt", dict(pp=2, dp=2, microbatch_size=1, num_microbatches=4, zero_stage=3)),
    "pp2_fsdp2_offload": Config("gpt", dict(pp=2, dp=2, microbatch_size=1, num_microbatches=4, zero_stage=3,
                                            runtime=RuntimeOptions(offload="params"))),
    "pp2_tp2": Config("gpt", dict(pp=2, tp=2, microbatch_size=2, num_microbatches=4), TP_FULL),
    "pp2_tp2_sp_recompute": Config("gpt", dict(pp=2, tp=2, microbatch_size=2, num_microbatches=4,
                                               sequence_parallel=True, recompute="full"), TP_FULL + SP_NORMS),
    # zero-bubble under sequence parallelism, a chunk per segment: the last block's chunk sends the gathered
    # sequence, a view
    "pp2_tp2_sp_zb": Config("gpt", dict(pp=2, tp=2, virtual_stages=3, microbatch_size=2, num_microbatches=4,
                                        schedule="interleaved-zb", sequence_parallel=True), TP_FULL + SP_NORMS),
    "pp4_1f1b": Config("gpt", dict(pp=4, microbatch_size=1, num_microbatches=4)),
    "user_pp2_fsdp2": Config("user", dict(pp=2, dp=2, microbatch_size=1, num_microbatches=4, zero_stage=3)),
    "pp2_interleaved_dp2": Config("llama", dict(pp=2, dp=2, virtual_stages=2, microbatch_size=1,
                                                num_microbatches=4, schedule="interleaved")),
    "pp2_zbv_fsdp2": Config("llama", dict(pp=2, dp=2, virtual_stages=2, microbatch_size=1, num_microbatches=4,
                                               schedule="zbv", zero_stage=3,
                                               runtime=RuntimeOptions(reshard_after_forward=False))),
    "pp2_zbv_dp2": Config("llama", dict(pp=2, dp=2, virtual_stages=2, microbatch_size=1, num_microbatches=4,
                                        schedule="zbv")),
    "pp2_zb_zero1": Config("gpt", dict(pp=2, dp=2, microbatch_size=1, num_microbatches=4, schedule="interleaved-zb",
                                       zero_stage=1)),
    "pp2_zb_zero2": Config("gpt", dict(pp=2, dp=2, microbatch_size=1, num_microbatches=4, schedule="interleaved-zb",
                                       zero_stage=2)),
    "pp2_dualpipev_tp2": Config("llama", dict(pp=2, tp=2, virtual_stages=2, microbatch_size=2, num_microbatches=4,
                                              schedule="dualpipev"), TP_LLAMA),
    # uneven virtual stages under ZeRO-1: 3 blocks + the embedding + the head in 4 chunks, the head with a block
    "pp2_interleaved_uneven_zero1": Config("llama", dict(pp=2, dp=2, virtual_stages=2, microbatch_size=1,
                                                         num_microbatches=4, schedule="interleaved", zero_stage=1),
                                           settings=dict(layers=3), first_blocks=(0, 1, 2)),
    # context parallelism (seq 8 = 2*cp chunks of 2 tokens) and expert parallelism
    "cp2": Config("gpt", dict(cp=2, microbatch_size=2, num_microbatches=2)),
    "cp2_llama_recompute": Config("llama", dict(cp=2, microbatch_size=4, num_microbatches=1, recompute="full")),
    "ep2": Config("moe", dict(dp=2, ep=2, microbatch_size=2, num_microbatches=2)),
    "ep2_fsdp": Config("moe", dict(dp=2, ep=2, microbatch_size=4, num_microbatches=1, zero_stage=3)),
    # 4 processes
    "cp2_dp2": Config("llama", dict(cp=2, dp=2, microbatch_size=2, num_microbatches=1)),
    "cp2_fsdp2_selective": Config("gpt", dict(cp=2, dp=2, microbatch_size=1, num_microbatches=2, zero_stage=3,
                                              recompute="selective")),
    "cp2_tp2_sp": Config("llama", dict(cp=2, tp=2, microbatch_size=2, num_microbatches=2, sequence_parallel=True),
                         TP_LLAMA + SP_NORMS),
    "cp2_pp2": Config("gpt", dict(cp=2, pp=2, microbatch_size=1, num_microbatches=4)),
    "ep2_dp4": Config("moe", dict(dp=4, ep=2, microbatch_size=1, num_microbatches=2)),
    "ep2_tp2": Config("moe", dict(dp=2, tp=2, ep=2, microbatch_size=2, num_microbatches=2),
                      TP_ATTENTION + TP_EMBED_HEAD),
    # tp ranks split the experts' slots (ep 1, and 5 slots per expert: padded to 6)
    "tp2_sp_moe_odd_slots": Config("moe", dict(tp=2, microbatch_size=1, num_microbatches=2, sequence_parallel=True),
                         TP_ATTENTION + TP_EMBED_HEAD + SP_NORMS, settings=dict(group_size=8)),
    "tp2_moe_fsdp": Config("moe", dict(dp=2, tp=2, microbatch_size=2, num_microbatches=1, zero_stage=3),
                           TP_ATTENTION + TP_EMBED_HEAD),
    # ep groups over tp x dp ranks: whole tp groups of 2 dp coordinates (ep 4), half a tp group (ep 2 of tp 4)
    "ep4_tp2": Config("moe", dict(dp=2, tp=2, ep=4, microbatch_size=2, num_microbatches=1, zero_stage=1),
                      TP_ATTENTION + TP_EMBED_HEAD),
    "ep2_tp4": Config("moe", dict(tp=4, ep=2, microbatch_size=2, num_microbatches=2), TP_ATTENTION + TP_EMBED_HEAD,
                      settings=dict(kv_heads=4)),
    "ep2_pp2": Config("moe", dict(pp=2, dp=2, ep=2, microbatch_size=1, num_microbatches=4)),
    "cp2_ep2_moe": Config("moe", dict(dp=2, cp=2, ep=2, microbatch_size=2, num_microbatches=1, zero_stage=3),
                          settings=dict(capacity_factor=2.0)),
}


def _estimate() -> Estimate:
    zero = TimeBreakdown(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    return Estimate(step_time_s=0.0, tokens_per_s=None, samples_per_s=0.0, model_tflops_per_device=0.0,
                    hardware_tflops_per_device=0.0, mfu=0.0, hfu=0.0, stages=(), breakdown=zero, fits=True)


def first_segment_of_block(chain: Any, block: int) -> int:
    """Index of the first layer-chain segment holding an op of `blocks.<block>`."""
    prefix = f"blocks.{block}"
    for seg in chain.segments:
        if any(n.module_path == prefix or n.module_path.startswith(prefix + ".") for n in chain.nodes_of(seg)):
            return seg.index
    raise ValueError(f"no segment of the chain holds {prefix}")


def plan_stages(cfg: Config, chain: Any) -> tuple[StageSpec, ...]:
    if not cfg.first_blocks:
        return ()
    bounds = [0] + [first_segment_of_block(chain, b) for b in cfg.first_blocks] + [len(chain)]
    modes = cfg.stage_recompute or (Recompute(cfg.strategy.get("recompute", "none")),) * (len(bounds) - 1)
    picked = (None if cfg.recomputed_blocks is None
              else {first_segment_of_block(chain, b) for b in cfg.recomputed_blocks})
    return tuple(StageSpec(bounds[i], bounds[i + 1], modes[i],
                           recomputed=None if picked is None else tuple(sorted(
                               j for j in picked if bounds[i] <= j < bounds[i + 1])))
                 for i in range(len(bounds) - 1))


def make_plan(model: nn.Module, cfg: Config, chain: Any) -> Plan:
    import ir

    strategy = Strategy(**cfg.strategy, stages=plan_stages(cfg, chain))
    return Plan(
        model=ModelInfo(name=cfg.family, fingerprint=ir.fingerprint(chain.graph),
                        params=count_trainable_params(model)),
        cluster={}, training=TrainingConfig(global_batch=strategy.global_batch, seq_len=TINY[cfg.family].get("seq")),
        strategy=strategy, sharding=tuple(ModuleSharding(p, s) for p, s in cfg.sharding), predicted=_estimate(),
        search=SearchInfo(time_s=0.0, candidates=1, status="fixed", optimality_gap=0.0, lower_bound_s=0.0))


def build(cfg: Config) -> tuple[nn.Module, Any]:
    module, config_type = FAMILIES[cfg.family]
    config = config_type(**{**TINY[cfg.family], **cfg.settings})
    torch.manual_seed(SEED)
    return module.build(config, "cpu"), module


def batches(cfg: Config, global_batch: int) -> list[tuple[torch.Tensor, ...]]:
    t = TINY[cfg.family]
    if cfg.family == "user":
        return [(normal((global_batch, t["features"]), "cpu", seed=SEED + step),) for step in range(STEPS)]
    return [(token_ids(global_batch, t["seq"], t["vocab"], "cpu", seed=SEED + step),) for step in range(STEPS)]


def reference(cfg: Config, data: Sequence[tuple[torch.Tensor, ...]]) -> tuple[list[float], dict[str, torch.Tensor],
                                                                             dict[str, torch.Tensor]]:
    model, family = build(cfg)
    initial = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in data:
        opt.zero_grad()
        loss = family.loss(model(*batch), batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)}, initial


def run_config(name: str) -> dict[str, Any]:
    import ir

    cfg = CONFIGS[name]
    model, family = build(cfg)
    probe = family.example_inputs(model.config, 1, None, "cpu")
    chain = ir.build_layer_chain(ir.trace(model, probe))
    plan = make_plan(model, cfg, chain)
    data = batches(cfg, plan.strategy.global_batch)
    ref_losses, ref_params, initial = reference(cfg, data)

    seen = _record_attention_tokens(model)
    start = time.perf_counter()
    pm = parallelize(model, plan, chain=chain, loss_fn=family.loss)
    opt = torch.optim.SGD(list(pm.parameters()), lr=LR)
    losses = [train_step(pm, local_batch(pm, batch), opt) for batch in data]
    elapsed = time.perf_counter() - start

    params: dict[str, list[float]] = {}
    local_numel = 0
    for pname, p in pm.named_parameters():
        local_numel += p.to_local().numel() if isinstance(p, DTensor) else p.numel()
        full = pm.full_tensor(pname, p)
        ref, init = ref_params[pname], initial[pname]
        # [max |param - ref|, max |ref|, max |update - ref update|, max |ref update|]
        params[pname] = [_max_abs(full - ref), _max_abs(ref), _max_abs((full - init) - (ref - init)),
                         _max_abs(ref - init)]
    return {"losses": losses, "ref_losses": ref_losses, "params": params, "param_groups": _param_groups(cfg),
            "local_numel": local_numel, "model_numel": count_trainable_params(build(cfg)[0]), "seconds": elapsed,
            "attention_tokens": sorted(set(seen)), "offload_policies": _offload_policies(pm),
            "split_experts": _split_experts(pm)}


def _split_experts(pm: Any) -> int:
    """Experts modules whose slots the tp ranks split (`apply_ep.TokenSplitForward`)."""
    from planner.runtime.apply_ep import TokenSplitForward

    return sum(any(isinstance(m.__dict__.get(entry), TokenSplitForward) for entry in ("forward", "expert_buffers_forward"))
               for part in pm.parts.values() for m in part.modules())


def _offload_policies(pm: Any) -> list[str]:
    """The offload policies of this rank's FSDP2 parameter groups (a plan-to-runtime mapping check)."""
    from torch.distributed.fsdp import FSDPModule

    names = set()
    for part in pm.parts.values():
        for module in part.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            if group is not None:
                names.add(type(group.offload_policy).__name__)
    return sorted(names)


def _record_attention_tokens(model: nn.Module) -> list[int]:
    """Sequence lengths the blocks' attention modules are called with on this rank (a test can tell that context
    parallelism really split the sequence; a sequence-parallel DTensor input counts its tp shards together)."""
    seen: list[int] = []

    def record(_module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append(args[0].shape[1])

    for block in getattr(model, "blocks", ()):
        block.attn.register_forward_pre_hook(record)
    return seen


def _param_groups(cfg: Config) -> list[list[str]]:
    """The names of each distinct parameter of the model (tied weights have several)."""
    model, _ = build(cfg)
    groups: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(pname)
    return sorted(groups.values())


def _max_abs(t: torch.Tensor) -> float:
    return t.abs().max().item()


def main(argv: Sequence[str]) -> int:
    out, names = argv[0], argv[1:]
    # FSDP2 warns when a wrapped module returns a view (any nn.Linear on 3-D input); nothing here writes in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for name in names:
        try:
            mine = run_config(name)
        except Exception as e:  # keep going: one broken config should not hide the others' results
            mine = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"rank {rank} config {name}: {mine['traceback']}", file=sys.stderr, flush=True)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
        dist.barrier()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))  # the results are written
