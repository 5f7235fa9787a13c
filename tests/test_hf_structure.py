"""The models people train now, from transformers' own config classes: DeepSeek-V3, Qwen3, Qwen3-MoE,
GPT-OSS, Llama 4 text and Gemma 3 text, built small on meta, traced, recognized and planned.

Recognition is structural (`ir.moe_structure`): routed experts in any layout, their router's k, shared experts
and dense first layers left dense, identical blocks one layer class.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ir
import planner.api
from costmodel.expert_parallel import ep_options, ep_problem, expert_param_numel
from costmodel.strategy import Schedule
from ir.moe_structure import ExpertLayout, routed_experts
from models.registry import build_model
from planner.cli.main import main
from planner.errors import UserError
from planner.search.space import SearchSpace

transformers = pytest.importorskip("transformers")

_SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 4, "vocab_size": 512, "max_position_embeddings": 512}
_MLA = {"kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32}

CONFIGS = {
    # name: (config class, overrides, block classes, (experts, k) or None)
    "deepseek_v3": ("DeepseekV3Config", {**_SMALL, **_MLA, "num_key_value_heads": 4, "moe_intermediate_size": 64,
                                         "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                         "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}, 2, (8, 2)),
    # DeepSeek Sparse Attention: 8 keys per query, fewer than the runtime tests' 16 tokens
    **{name: (cls, {**_SMALL, **_MLA, "num_key_value_heads": 4, "moe_intermediate_size": 64, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                    "topk_group": 1, "index_topk": 8, "index_n_heads": 4, "index_head_dim": 32}, 2, (8, 2))
       for name, cls in (("deepseek_v32", "DeepseekV32Config"), ("glm_moe_dsa", "GlmMoeDsaConfig"))},
    "qwen3": ("Qwen3Config", {**_SMALL, "head_dim": 32}, 1, None),
    "qwen3_moe": ("Qwen3MoeConfig", {**_SMALL, "head_dim": 32, "moe_intermediate_size": 64, "num_experts": 8,
                                     "num_experts_per_tok": 2}, 1, (8, 2)),
    "gpt_oss": ("GptOssConfig", {**_SMALL, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                                 "sliding_window": 64}, 1, (8, 2)),
    # Layer 3 of 4 is a NoPE full-attention layer (no_rope_layers): legitimately its own class.
    "llama4_text": ("Llama4TextConfig", {**_SMALL, "head_dim": 32, "intermediate_size_mlp": 256,
                                         "num_local_experts": 4, "num_experts_per_tok": 1}, 2, (4, 1)),
    "gemma3_text": ("Gemma3TextConfig", {**_SMALL, "head_dim": 32, "sliding_window": 64}, 1, None),
}


def _saved(tmp_path_factory, name: str, **extra) -> str:
    cls, overrides, _, _ = CONFIGS[name]
    folder = tmp_path_factory.mktemp(name)
    getattr(transformers, cls)(**{**overrides, **extra}).save_pretrained(folder)
    return f"hf:{folder}"


def _trace(name: str, *, seq: int = 64, batch: int = 1):
    built = build_model(name, seq=seq, batch=batch)
    graph = ir.trace(built.module, built.example_inputs, model_name=name)
    return built, graph, ir.build_layer_chain(graph)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameters_layer_classes_and_experts(tmp_path_factory, name):
    _, _, block_classes, moe = CONFIGS[name]
    built, graph, chain = _trace(_saved(tmp_path_factory, name))
    assert graph.param_count == built.module.num_parameters()
    blocks = [s for s in chain.segments if s.name.startswith("model.layers.")]
    assert len(blocks) == 4 and len({s.class_id for s in blocks}) == block_classes
    found = routed_experts(graph.nodes)
    if moe is None:
        assert found is None and ep_problem(chain, 2) == "ep=2: the model has no mixture-of-experts layers"
        return
    assert (found.num_experts, found.top_k, found.layout) == (*moe, ExpertLayout.STACKED)
    # Shared experts, routers and attention stay dense: only the stacked (E, ...) weights are routed experts.
    assert all(".experts." in p for p in found.param_names)
    assert moe[0] in ep_options(chain, 8)


def test_deepseek_dense_first_layers_and_group_routing(tmp_path_factory):
    """first_k_dense_replace=2: two dense blocks, then MoE blocks -- two classes; group-limited routing's
    top-k over n_group=2 groups does not pass for the expert count."""
    _, graph, chain = _trace(_saved(tmp_path_factory, "deepseek_v3", first_k_dense_replace=2, num_hidden_layers=5))
    blocks = [s.class_id for s in chain.segments if s.name.startswith("model.layers.")]
    assert blocks[0] == blocks[1] != blocks[2] == blocks[3] == blocks[4]
    dense, moe = chain.segments[1], chain.segments[3]
    assert routed_experts(chain.nodes_of(dense)) is None
    layer = routed_experts(chain.nodes_of(moe))
    h, f, e = 128, 64, 8
    assert (layer.num_experts, layer.top_k) == (8, 2) and layer.param_numel == e * 3 * h * f
    assert (layer.num_groups, layer.top_groups) == (2, 1)  # n_group, topk_group: the router's group top-k
    assert expert_param_numel(graph.nodes, 8) == 3 * layer.param_numel
    # MLA: queries and keys carry nope + rope dims, values their own.
    attention = [n for n in chain.nodes_of(moe) if n.op_kind.value == "attention"]
    assert [(n.attr("head_dim"), n.input_specs[2].shape[-1]) for n in attention] == [(48, 32)]


def test_expert_parallelism_is_searched_and_priced_for_deepseek(tmp_path_factory):
    built, _, chain = _trace(_saved(tmp_path_factory, "deepseek_v3"), seq=64)
    fixed = planner.api.plan(chain, None, "1x8xh100-sxm", global_batch=64, model_name=built.name,
                             space=SearchSpace(ep=8))
    assert fixed.strategy.ep == 8 and fixed.predicted.fits
    assert fixed.model.params == built.module.num_parameters()


def test_listed_experts_are_recognized():
    """One module per expert in a ModuleList (the pre-fused transformers layout) is the same structure."""

    class ListedMoe(nn.Module):
        def __init__(self, h: int = 16, experts: int = 4) -> None:
            super().__init__()
            self.gate = nn.Linear(h, experts, bias=False)
            self.experts = nn.ModuleList(nn.Linear(h, h) for _ in range(experts))

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (N, h)
            weights, index = torch.topk(self.gate(x).softmax(-1), 2, dim=-1)  # (N, 2)
            outs = torch.stack([e(x) for e in self.experts], dim=1)  # (N, E, h)
            picked = torch.gather(outs, 1, index[..., None].expand(-1, -1, x.size(-1)))  # (N, 2, h)
            return (picked * weights[..., None]).sum(1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(ListedMoe() for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = x + layer(x)
            return x

    graph = ir.trace(Model(), (torch.randn(8, 16),))
    found = routed_experts(graph.nodes)
    assert (found.num_experts, found.top_k, found.layout) == (4, 2, ExpertLayout.LISTED)
    assert found.param_numel == 2 * 4 * (16 * 16 + 16)
    assert not any("gate" in p for p in found.param_names)


def test_transformers_model_type_builds_its_default_config():
    """hf:MODEL_TYPE is transformers' own config class with its defaults (the published sizes) plus --set."""
    built = build_model("hf:qwen3_moe", ("num_hidden_layers=1", "hidden_size=64", "num_attention_heads=2",
                                         "num_key_value_heads=1", "moe_intermediate_size=32",
                                         "num_experts=4", "num_experts_per_tok=2", "vocab_size=256"), seq=32)
    assert type(built.module).__name__ == "Qwen3MoeForCausalLM"
    assert built.module.config._experts_implementation == "stratagem_capacity"
    graph = ir.trace(built.module, built.example_inputs)
    assert graph.param_count == built.module.num_parameters()


def test_frozen_router_statistics_are_not_trainable_parameters():
    """ERNIE 4.5 MoE keeps its router's load-balancing bias as a frozen nn.Parameter (updated by a rule, not by
    gradients): the traced count, which gradients and optimizer state follow, is the trainable one, and the
    experts are still found."""
    built = build_model("hf:ernie4_5_moe", ("num_hidden_layers=2", "hidden_size=64", "num_attention_heads=2",
                                            "num_key_value_heads=1", "moe_intermediate_size=32", "intermediate_size=64",
                                            "moe_num_experts=4", "moe_k=2", "moe_layer_start_index=0",
                                            "vocab_size=256"), seq=32)
    graph = ir.trace(built.module, built.example_inputs)
    frozen = sum(p.numel() for p in built.module.parameters() if not p.requires_grad)
    assert frozen > 0
    trainable = built.module.num_parameters(only_trainable=True)
    assert graph.param_count == trainable == built.module.num_parameters() - frozen
    found = routed_experts(graph.nodes)
    assert found is not None and (found.num_experts, found.top_k) == (4, 2)


def test_inconsistent_mla_dims_fail_in_one_line(tmp_path_factory, capsys):
    name = _saved(tmp_path_factory, "deepseek_v3")
    assert main(["trace", name, "--set", "qk_rope_head_dim=10", "--seq", "32"]) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.err + captured.out).splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot trace" in lines[0]


def test_deepseek_capacity_dispatch_without_drops_matches_transformers_on_cpu(tmp_path_factory):
    name = _saved(tmp_path_factory, "deepseek_v3", num_hidden_layers=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = build_model(name, ("capacity_factor=4",), batch=2, seq=16, device="cpu")
    ids = built.example_inputs[0]
    ours = built.module(ids).logits
    for m in built.module.modules():
        if hasattr(m, "has_gate"):
            m.config._experts_implementation = "eager"
    torch.testing.assert_close(ours, built.module(ids).logits, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_beyond_the_kv_heads_replicates_them():
    """hf:llama has 4 query and 2 KV heads: tp=4 plans (KV heads replicated in pairs); tp=3 is refused with why."""
    built = build_model("hf:llama", seq=64)
    plan = planner.api.plan(built.module, built.example_inputs, "1x4xa100-80gb", global_batch=4,
                            space=SearchSpace(tp=4, dp=1, pp=1))
    assert plan.strategy.tp == 4 and plan.predicted.fits
    with pytest.raises(UserError, match="tp=3 does not divide heads=4"):
        planner.api.plan(built.module, built.example_inputs, "1x3xa100-80gb", global_batch=3,
                         space=SearchSpace(tp=3, dp=1, pp=1))


MLP_TP = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
          "shared_experts.gate_proj": "colwise", "shared_experts.up_proj": "colwise",
          "shared_experts.down_proj": "rowwise"}
ATTENTION_TP = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise"}
RUNTIME_CASES = [
    # (config, layers, pinned degrees, module styles forced Megatron's way: on CPU the cost model keeps these
    # tiny layers replicated, so tp would otherwise split nothing)
    pytest.param("qwen3_moe", 2, dict(ep=2, dp=4, tp=1, pp=1), {}, id="qwen3_moe-ep2xdp4"),
    pytest.param("qwen3_moe", 2, dict(ep=2, dp=2, tp=2, pp=1), ATTENTION_TP, id="qwen3_moe-ep2xtp2"),
    pytest.param("qwen3_moe", 2, dict(ep=2, dp=2, tp=1, pp=2, microbatch_size=2), {}, id="qwen3_moe-ep2xpp2"),
    pytest.param("deepseek_v3", 3, dict(ep=2, dp=4, tp=1, pp=1), {}, id="deepseek_v3-ep2xdp4"),
    # MLA stays replicated under tp (planner/runtime/apply_tp.py says why); its dense and shared-expert MLPs split
    pytest.param("deepseek_v3", 3, dict(ep=2, dp=2, tp=2, pp=1), MLP_TP, id="deepseek_v3-ep2xtp2"),
    pytest.param("deepseek_v3", 3, dict(ep=2, dp=2, tp=1, pp=2, microbatch_size=2), {},
                 id="deepseek_v3-ep2xpp2"),
    pytest.param("deepseek_v32", 3, dict(ep=2, dp=2, tp=1, pp=2, microbatch_size=2), {},
                 id="deepseek_v32-ep2xpp2"),
    # DualPipeV on the dense first block and two MoE blocks: the chunks of a chain of two block classes
    # (`costmodel.rank_layout.balanced_chunks`), the V placing chunks 0 and 3 on rank 0
    pytest.param("deepseek_v3", 3, dict(ep=2, dp=2, tp=1, pp=2, microbatch_size=1, schedule=Schedule.DUALPIPEV,
                                        virtual_stages=2), {}, id="deepseek_v3-ep2xpp2-dualpipev"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("config", "layers", "degrees", "styles"), RUNTIME_CASES)
def test_tiny_moe_trains_like_one_process(tmp_path_factory, config, layers, degrees, styles):
    """`stratagem run --check`: 4 gloo processes, experts split over ep=2 (all-to-all around transformers'
    experts, through `expert_buffers_forward`) with data, tensor or pipeline parallelism (DeepSeek-V3: MLA, a
    shared expert and a dense first layer; pipeline stages cut from transformers' own blocks), against the
    unsharded loss. capacity_factor = E / k drops no token, so each rank's routing groups give what the single
    process's do."""
    import json
    import os
    import subprocess
    import sys

    name = _saved(tmp_path_factory, config, num_hidden_layers=layers)
    sets = ("capacity_factor=4",)
    built = build_model(name, sets, seq=16)
    plan = planner.api.plan(built.module, built.example_inputs, "1x4xcpu", global_batch=8, model_name=name,
                            settings=(("capacity_factor", 4.0), ("seq", 16)), space=SearchSpace(**degrees))
    assert all(getattr(plan.strategy, k) == v for k, v in degrees.items())
    data = plan.to_dict()
    for m in data["strategy"]["sharding"]:
        m["style"] = next((s for k, s in styles.items() if m["module"].endswith(k)), m["style"])
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(data))
    cmd = [sys.executable, "-m", "planner.cli.main", "run", name, "--set", sets[0], "--seq", "16", "--plan",
           str(path), "--steps", "3", "--nproc", "4", "--check", "--json"]
    ran = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = json.loads(ran.stdout)
    assert all(report["strategy"][k] == v for k, v in degrees.items() if k in report["strategy"])
    assert report["check"]["passed"] and report["check"]["max_rel_loss_diff"] <= 1e-4


@pytest.mark.multiprocess
def test_a_check_that_fails_on_dropped_tokens_says_why_without_a_traceback(tmp_path_factory, tmp_path):
    """capacity_factor 0.5 drops half the token choices, and a rank groups its micro-batch's tokens otherwise than
    one process: the losses differ by about 2e-5 (float32 sharding alone: about 1e-7), the check at 1e-6 fails
    (exit 1) with a note on the drops and the dropless setting, and torchrun's tracebacks about a failed worker do
    not follow it."""
    import os
    import subprocess
    import sys

    from planner.runtime.measure import token_drop_note

    name = _saved(tmp_path_factory, "qwen3_moe", num_hidden_layers=2)
    assert "capacity factor 1.25 < experts / top-k = 4" in token_drop_note(_trace(name, seq=16)[2])
    assert token_drop_note(ir.build_layer_chain(ir.trace(
        (b := build_model(name, ("capacity_factor=4",), seq=16)).module, b.example_inputs))) is None
    sets = ("--set", "capacity_factor=0.5", "--seq", "16")
    plan = tmp_path / "plan.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    made = subprocess.run([sys.executable, "-m", "planner.cli.main", "plan", name, *sets, "--cluster", "1x2xcpu",
                           "--batch", "8", "--fix", "ep=2", "-o", str(plan)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert made.returncode == 0, made.stderr
    ran = subprocess.run([sys.executable, "-m", "planner.cli.main", "run", name, *sets, "--plan", str(plan),
                          "--steps", "2", "--nproc", "2", "--check", "--tolerance", "1e-6"], capture_output=True,
                         text=True, timeout=600,
                         env=env)
    assert ran.returncode == 1, ran.stderr[-4000:]
    assert "FAILED" in ran.stdout and "--set capacity_factor=4 to compare without drops" in ran.stdout
    assert "Traceback" not in ran.stderr and "ChildFailedError" not in ran.stderr


def test_mla_split_over_tp_is_refused_with_its_reason(tmp_path_factory):
    from costmodel.sharding.rules import Style
    from planner.runtime.apply_tp import _check_pairs

    built = build_model(_saved(tmp_path_factory, "deepseek_v3", num_hidden_layers=2), seq=16)
    styles = {"model.layers.0.self_attn.q_b_proj": Style.COLWISE, "model.layers.0.self_attn.kv_b_proj": Style.COLWISE,
              "model.layers.0.self_attn.o_proj": Style.ROWWISE}
    with pytest.raises(UserError, match="splits multi-head latent attention over tp.*kv_a_proj_with_mqa"):
        _check_pairs(built.module, styles)
    _check_pairs(built.module, {"model.layers.0.mlp.gate_proj": Style.COLWISE, "model.layers.0.mlp.up_proj":
                                Style.COLWISE, "model.layers.0.mlp.down_proj": Style.ROWWISE})

@pytest.mark.parametrize(("name", "classes"), [("gemma3_text", 2), ("gpt_oss", 2)])
def test_sliding_window_layers_are_priced_over_their_window(tmp_path_factory, name, classes):
    """A window of 16 keys on a 64-token sequence: sliding layers trace as `stratagem::windowed_attention` with
    ("window", 16), global layers over the whole sequence; each attention node's FLOPs are the band's share of
    causal attention's, and the two kinds of layer are two classes (Gemma 3: layers 0-2 sliding, 3 global with
    a pattern of 4; GPT-OSS alternates and its attention sinks ride in the same op)."""
    seq, window, heads, head_dim = 64, 16, 4, 32
    extra = {"sliding_window": window, **({"sliding_window_pattern": 4} if name == "gemma3_text" else {})}
    built = build_model(_saved(tmp_path_factory, name, **extra), seq=seq)
    graph = ir.trace(built.module, built.example_inputs, model_name=name)
    chain = ir.build_layer_chain(graph)
    assert graph.param_count == built.module.num_parameters()
    attention = [n for n in graph.nodes if n.op_kind.value == "attention"]
    full = 4 * heads * seq * seq * head_dim  # sdpa_flop_count of (1, 4, 64, 32): the causal convention
    band = (sum(range(1, window)) + (seq - window + 1) * window) / (seq * (seq + 1) / 2)
    for n in attention:
        w = n.attr("window")
        if w == window:
            assert n.forward_flops == int(full * band) and n.attr("is_causal") and not n.attr("has_mask")
        else:  # global layers: plain causal SDPA, or the windowed op over the whole sequence when it has sinks
            assert w in (None, seq) and n.forward_flops == full
    assert sum(n.attr("window") == window for n in attention) >= 2
    blocks = {s.class_id for s in chain.segments if s.name.startswith("model.layers.")}
    assert len(blocks) == classes


@pytest.mark.parametrize(("config", "extra"), [("gpt_oss", {"sliding_window": 8}),
                                               ("deepseek_v32", {"index_topk": 8}),
                                               ("glm_moe_dsa", {"index_topk": 8})])
def test_custom_attention_matches_transformers_eager_on_cpu(tmp_path_factory, config, extra):
    """Windowed attention with sinks (GPT-OSS: 8 keys) and DeepSeek Sparse Attention (8 keys kept of 32: the
    indexer really drops keys) compute what transformers' own eager code computes (a boolean mask on full attention;
    for DSA also a dense (B, S, H, T) indexer)."""
    name = _saved(tmp_path_factory, config, num_hidden_layers=2, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = build_model(name, ("capacity_factor=4",), batch=2, seq=32, device="cpu")
    ids = built.example_inputs[0]
    ours = built.module(ids).logits
    for m in built.module.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = "eager"
            m.config._experts_implementation = "eager"
    torch.testing.assert_close(ours, built.module(ids).logits, rtol=1e-5, atol=1e-5)


def test_windowed_attention_op_gradients_equal_autograd_of_its_reference():
    from models.windowed_attention import reference, windowed_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out = windowed_attention(q, k, v, 5, 0.3, sinks)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v, sinks), grad)
    expected = torch.autograd.grad(reference(q, k, v, 5, 0.3, sinks), (q, k, v, sinks), grad)
    for a, b in zip(ours, expected, strict=True):
        torch.testing.assert_close(a, b)
    # The band: query i sees keys i-4 .. i; the first query only itself.
    no_sink = windowed_attention(q, k, v, 5, 0.3, None)
    torch.testing.assert_close(no_sink[:, :, 0], v.repeat_interleave(2, dim=1)[:, :, 0])


def test_runtime_refuses_splitting_attention_past_its_kv_heads():
    """hf:llama has 2 KV heads: at tp=4 the planner keeps attention replicated (the heads rule needs every
    operand's head count to divide); a plan splitting k_proj anyway is refused in one line, not a crash."""
    from costmodel.sharding.rules import Style
    from planner.runtime.apply_tp import _check_kv_heads

    built = build_model("hf:llama", seq=16)
    styles = {"model.layers.0.self_attn.k_proj": Style.COLWISE, "model.layers.0.mlp.up_proj": Style.COLWISE}
    with pytest.raises(UserError, match="split over tp=4 ranks but its attention has 2 KV heads"):
        _check_kv_heads(built.module, styles, 4)
    _check_kv_heads(built.module, styles, 2)  # whole heads: fine
    _check_kv_heads(built.module, {"model.layers.0.mlp.up_proj": Style.COLWISE}, 4)  # the MLP may split


@pytest.mark.parametrize("name", ["deepseek_v3", "llama4_text"])
def test_export_counts_every_decoder_layer_of_a_model_with_two_block_classes(tmp_path_factory, tmp_path, capsys,
                                                                               name):
    """DeepSeek-V3's dense first layer and Llama 4's NoPE layer are decoder layers to a trainer: a plan made with
    --seq exports all 4 layers (the layout once counted only the most frequent class and re-traced with a `seq`
    setting that Hugging Face configs do not have)."""
    import json

    from planner.trainers.layout import BlockLayout, parse_megatron_layout

    model = _saved(tmp_path_factory, name)
    layout = BlockLayout.of(_trace(model)[2])
    assert (layout.lead, layout.num_blocks) == (1, 4)
    plan = tmp_path / "plan.json"
    assert main(["plan", model, "--cluster", "1x4xh100-sxm", "--batch", "8", "--seq", "64", "--fix", "pp=2",
                 "--fix", "schedule=interleaved", "--fix", "virtual_stages=2", "-o", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "megatron", "--json"]) == 0
    args = json.loads(capsys.readouterr().out)["text"].split()
    assert args[args.index("--num-layers") + 1] == "4"
    assert sum(parse_megatron_layout(args[args.index("--pipeline-model-parallel-layout") + 1])) == 4
    assert main(["export", str(plan), "--to", "torchtitan", "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert all(f'"layers.{i}"' in text for i in range(4))
