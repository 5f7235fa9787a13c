"""Hugging Face transformers models: built from config classes on meta, traced, planned (`hf:` models).

Numbers are checked against closed forms (parameter counts, expert FLOPs), against the zoo's own Llama with the
same sizes, and against transformers' own kernels on CPU (attention without a materialized mask, capacity
dispatch with a capacity that drops nothing).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import ir
import planner.api
from models.registry import ModelError, build_model
from planner.cli.main import main
from planner.search.space import SearchSpace

transformers = pytest.importorskip("transformers")

from models import hf, hf_tracing  # noqa: E402 - needs transformers to be meaningful
from models.expert_dispatch import capacity_route, combine, dispatch  # noqa: E402

ARCHS = ("llama", "mistral", "qwen2", "mixtral", "gpt2", "bert", "t5")


def _trace(name: str, sets: tuple[str, ...] = (), *, batch: int = 1, seq: int | None = None, dtype=None):
    built = build_model(name, sets, batch=batch, seq=seq)
    return built, ir.trace(built.module, built.example_inputs, model_name=name, dtype=dtype)


def _llama_params(v: int, h: int, layers: int, heads: int, kv: int, f: int) -> int:
    """Llama without biases, untied head (Touvron et al. 2023): embeddings + final norm + per layer q/o, k/v,
    SwiGLU and two RMSNorms."""
    d = h // heads
    return 2 * v * h + h + layers * (2 * h * h + 2 * h * kv * d + 3 * h * f + 2 * h)


# --------------------------------------------------------------------------------------------------------------
# Building and tracing
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_traced_parameter_count_equals_num_parameters(arch):
    built, graph = _trace(f"hf:{arch}", batch=2)
    assert built.family == "hf" and built.seq_len == hf.DEFAULT_SEQ
    assert graph.param_count == built.module.num_parameters()
    assert graph.batch_size == 2 and graph.seq_len == hf.DEFAULT_SEQ
    assert all(p.device.type == "meta" for p in built.module.parameters())
    chain = ir.build_layer_chain(graph)
    # The decoder / encoder blocks repeat: the chain has fewer layer classes than segments.
    assert chain.num_classes < len(chain.segments) or arch == "t5"


def test_llama_parameters_match_closed_form_and_settings():
    sets = ("hidden_size=96", "num_attention_heads=6", "num_key_value_heads=3", "num_hidden_layers=3",
            "intermediate_size=200", "vocab_size=500")
    built, graph = _trace("hf:llama", sets, seq=64)
    assert graph.param_count == _llama_params(500, 96, 3, 6, 3, 200)
    assert dict(built.settings) == {"hidden_size": 96, "intermediate_size": 200, "num_attention_heads": 6,
                                    "num_hidden_layers": 3, "num_key_value_heads": 3, "seq": 64, "vocab_size": 500}
    assert built.example_inputs[0].shape == (1, 64)


def test_hf_llama_traces_like_the_zoo_llama_of_the_same_sizes():
    """Same architecture, two implementations: same parameters, same matmul and attention FLOPs."""
    zoo, zoo_graph = _trace("llama", ("vocab=1024", "hidden=128", "layers=2", "heads=4", "kv_heads=2",
                                      "ffn_hidden=352"), seq=hf.DEFAULT_SEQ)
    _, hf_graph = _trace("hf:llama")
    assert hf_graph.param_count == zoo_graph.param_count == _llama_params(1024, 128, 2, 4, 2, 352)
    assert hf_graph.forward_flops == zoo_graph.forward_flops
    assert hf_graph.backward_flops == zoo_graph.backward_flops
    # 2 layers x (q,k,v,o,gate,up,down) + lm_head, 2 FLOPs per multiply-add on 128 tokens.
    linear = 2 * 128 * (2 * (2 * 128 * 128 + 2 * 128 * 64 + 3 * 128 * 352) + 128 * 1024)
    assert sum(n.forward_flops for n in hf_graph.nodes if n.op_kind.value == "linear") == linear


def test_attention_is_causal_sdpa_with_grouped_kv_and_no_materialized_mask():
    seq = 256
    _, graph = _trace("hf:llama", seq=seq)
    attention = [n for n in graph.nodes if n.op_kind.value == "attention"]
    assert len(attention) == 2
    for node in attention:
        assert node.attr("is_causal") is True and node.attr("has_mask") is False
        assert (node.attr("num_heads"), node.attr("num_kv_heads"), node.attr("head_dim")) == (4, 2, 32)
    # No (seq x seq) tensor anywhere: transformers' export-time mask would be (B, 1, seq, seq).
    assert not [n.name for n in graph.nodes for s in n.output_specs if s.shape[-2:] == (seq, seq)]
    _, bert = _trace("hf:bert", seq=seq)
    assert all(n.attr("is_causal") is False and n.attr("has_mask") is False
               for n in bert.nodes if n.op_kind.value == "attention")


@pytest.mark.parametrize("arch", ["t5", "mixtral", "gpt2"])
def test_bfloat16_trace_has_bfloat16_matmuls(arch):
    """torch.export bakes dtype casts; the tracer exports a copy cast to the trace dtype (ir/export_cast.py)."""
    built, graph = _trace(f"hf:{arch}", dtype="bfloat16")
    assert graph.dtype == "bfloat16" and graph.param_count == built.module.num_parameters()
    matmuls = [n for n in graph.nodes if n.op_kind.value in ("linear", "matmul", "attention")]
    assert matmuls and {n.output_specs[0].dtype for n in matmuls} == {"bfloat16"}
    assert graph.param_bytes == 2 * graph.param_count


def test_mixtral_expert_flops_follow_capacity_dispatch():
    """Per MoE layer: E*C slots of SwiGLU experts, C = min(S, ceil(k*cf*S/E)) (GShard / Switch Transformer)."""
    tokens, h, f, experts, k = 2 * 128, 128, 352, 4, 2
    for factor, slots in ((1.25, 160), (2.0, 256)):
        assert hf_tracing.capacity(tokens, k, experts, factor) == slots == min(tokens, math.ceil(k * factor * tokens / experts))
        _, graph = _trace("hf:mixtral", (f"capacity_factor={factor}",), batch=2)
        expert_linear = [n for n in graph.nodes if ".experts" in n.module_path and n.op_kind.value == "linear"]
        assert len(expert_linear) == 2 * 2  # gate_up and down, 2 layers
        assert sum(n.forward_flops for n in expert_linear) == 2 * experts * slots * 6 * h * f
        assert {n.param_names[0].rsplit(".", 1)[-1] for n in expert_linear} == {"gate_up_proj", "down_proj"}
        routing = [n for n in graph.nodes if n.attr("num_experts") is not None]
        assert {(n.attr("k"), n.attr("num_experts")) for n in routing} == {(k, experts)}


def test_config_json_file_and_folder(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96,
              "intermediate_size": 256, "num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 3,
              "vocab_size": 500, "max_position_embeddings": 1024, "transformers_version": "4.40.0"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    folder, _ = _trace(f"hf:{tmp_path}")
    assert type(folder.module).__name__ == "LlamaForCausalLM"
    assert folder.seq_len == 1024  # max_position_embeddings, under the 4096 cap
    built, graph = _trace(f"hf:{tmp_path / 'config.json'}", ("num_hidden_layers=2",), seq=32)
    assert graph.param_count == _llama_params(500, 96, 2, 6, 2, 256)
    assert built.example_inputs[0].shape == (1, 32)


def test_config_json_without_architectures_gets_the_lm_head(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64,
                                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                                      "intermediate_size": 128, "vocab_size": 300}))
    built = build_model(f"hf:{tmp_path}", seq=16)
    assert type(built.module).__name__ == "BertForMaskedLM"


# --------------------------------------------------------------------------------------------------------------
# Settings and errors
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "sets", "message"), [
    ("hf:llama", ("hidden_size=abc",), "hidden_size=abc: expected an integer"),
    ("hf:llama", ("hiden_size=64",), "valid keys: attention_bias"),
    ("hf:llama", ("use_cache=true",), "unknown setting"),
    ("hf:llama", ("capacity_factor=2",), "unknown setting"),
    ("hf:mixtral", ("capacity_factor=-1",), "capacity_factor must be a positive number"),
    ("hf:llama", ("rope_parameters=[1,2]",), "invalid LlamaConfig"),
    ("hf:nope", (), "not a built-in architecture (llama, mistral, qwen2, mixtral, gpt2, bert, t5)"),
    ("hf:", (), "expected hf:ARCH"),
    ("hf:gemma3", (), "Gemma3Config is a multimodal config, whose language model is its text_config: plan "
                      "hf:gemma3_text"),
])
def test_bad_settings_are_one_line_user_errors(name, sets, message):
    with pytest.raises(ModelError) as info:
        build_model(name, sets)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_model_type_whose_default_config_does_not_validate_is_one_line(monkeypatch):
    """transformers' strict config dataclasses raise huggingface_hub errors that are not ValueErrors."""
    class Broken:
        def __init__(self) -> None:
            raise LookupError("hidden_size_per_layer_input must be 0, got 256")

    monkeypatch.setattr(sys.modules["transformers"], "Qwen3Config", Broken)
    with pytest.raises(ModelError) as info:
        build_model("hf:qwen3")
    assert "default Broken does not validate: hidden_size_per_layer_input must be 0" in str(info.value)
    assert "\n" not in str(info.value)


def test_learned_positions_bound_the_sequence():
    with pytest.raises(ModelError, match="exceeds n_positions=1024 .* set n_positions=2048"):
        build_model("hf:gpt2", seq=2048)
    assert build_model("hf:gpt2", ("n_positions=2048",), seq=2048).seq_len == 2048


def test_structured_fields_take_json():
    built = build_model("hf:llama", ('rope_parameters={"rope_type": "default", "rope_theta": 10000.0}',))
    assert built.config.rope_parameters["rope_theta"] == 10000.0


def test_transformers_4_is_too_old(monkeypatch):
    # sys.modules, not the module imported above: transformers re-registers its lazy module on some imports.
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
    with pytest.raises(ModelError, match=r"need transformers>=5.0, found 4.57.1: pip install 'stratagem\[hf\]'"):
        build_model("hf:llama")


def test_without_transformers_the_error_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ModelError, match=r"pip install 'stratagem\[hf\]'"):
        build_model("hf:llama")
    assert main(["trace", "hf:llama"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pip install 'stratagem[hf]'" in err


# --------------------------------------------------------------------------------------------------------------
# Numerics on CPU: our registered kernels compute what transformers' own ones do
# --------------------------------------------------------------------------------------------------------------


def test_sdpa_without_mask_matches_transformers_sdpa_on_cpu():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = build_model("hf:llama", batch=2, seq=16, device="cpu")
    ids = built.example_inputs[0]
    assert built.module.config._attn_implementation == hf_tracing.ATTENTION
    ours = built.module(ids).logits
    built.module.config._attn_implementation = "eager"  # explicit causal mask and softmax
    reference = built.module(ids).logits
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert built.loss(built.module(ids), built.example_inputs).item() == pytest.approx(math.log(1024), rel=0.05)


def test_capacity_dispatch_without_drops_matches_transformers_experts_on_cpu():
    # capacity_factor = E / k gives C = S: nothing is dropped.
    built = build_model("hf:mixtral", ("capacity_factor=2",), batch=2, seq=16, device="cpu")
    ids = built.example_inputs[0]
    assert built.module.config._experts_implementation == hf_tracing.EXPERTS
    ours = built.module(ids).logits
    built.module.config._experts_implementation = "eager"
    torch.testing.assert_close(ours, built.module(ids).logits, rtol=1e-5, atol=1e-5)


def test_capacity_dispatch_drops_choices_past_capacity():
    """All 4 tokens pick experts (0, 1): with C = 2, tokens 2 and 3 are dropped from both experts."""
    index = torch.tensor([[[0, 1]] * 4])  # (G=1, S=4, k=2)
    route = capacity_route(index, num_experts=3, capacity=2)
    assert route.kept.shape == (1, 2, 4)
    assert route.kept.sum(dim=1)[0].tolist() == [2, 2, 0, 0]  # choices kept per token
    # (E=3, G=1, C=2) rows: expert 0 slots take tokens 0, 1; expert 1 slots take tokens 0, 1
    assert route.sources[:4].tolist() == [0, 1, 0, 1]
    assert route.slots[0, :, :2].tolist() == [[0, 1], [2, 3]]
    x = torch.arange(4.0).view(1, 4, 1)
    out = combine(dispatch(x, route, 3) * 10, route, torch.full((1, 4, 2), 0.5))
    assert out.flatten().tolist() == [0.0, 10.0, 0.0, 0.0]


def test_losses_are_per_task():
    for arch, inputs in (("bert", 1), ("t5", 3)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            built = build_model(f"hf:{arch}", batch=2, seq=8, device="cpu")
        assert len(built.example_inputs) == inputs
        loss = built.loss(built.module(*built.example_inputs), built.example_inputs)
        assert loss.ndim == 0 and loss.item() == pytest.approx(math.log(1024), rel=0.1)


def test_builds_on_cpu_follow_the_callers_seed():
    def weights(seed: int) -> dict[str, torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_model("hf:qwen2", device="cpu").module.state_dict()

    a, b, c = weights(0), weights(0), weights(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


# --------------------------------------------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------------------------------------------


def test_hf_llama_gets_the_zoo_llamas_plan():
    zoo = build_model("llama", ("vocab=1024", "hidden=128", "layers=2", "heads=4", "kv_heads=2", "ffn_hidden=352"),
                      seq=hf.DEFAULT_SEQ)
    ours = build_model("hf:llama")
    plans = [planner.api.plan(b.module, b.example_inputs, "1x4xa100-80gb", global_batch=8) for b in (zoo, ours)]
    shape = [(p.strategy.dp, p.strategy.tp, p.strategy.pp, p.strategy.microbatch_size) for p in plans]
    assert shape[0] == shape[1]
    assert plans[0].model.params == plans[1].model.params == ours.module.num_parameters()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_plan_each_architecture(arch):
    built = build_model(f"hf:{arch}")
    chain = ir.build_layer_chain(ir.trace(built.module, built.example_inputs, model_name=built.name))
    result = planner.api.plan(chain, None, "1x2xa100-80gb", global_batch=4, model_name=built.name)
    s = result.strategy
    assert s.dp * s.tp * s.pp * s.cp == 2 and s.dp * s.microbatch_size * s.num_microbatches == 4
    assert result.model.params == built.module.num_parameters()
    assert result.predicted.fits and result.search.status == "optimal"
    # The plan's prediction is what the cost model says of its strategy.
    again = planner.estimate(chain, "1x2xa100-80gb", result.strategy, global_batch=4)
    assert again.step_time_s == pytest.approx(result.predicted.step_time_s, rel=1e-9)


# --------------------------------------------------------------------------------------------------------------
# Running a plan: tensor parallelism on transformers' own module names
# --------------------------------------------------------------------------------------------------------------

HF_TP_STYLES = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                "mlp.down_proj": "rowwise", "model.embed_tokens": "vocab", "lm_head": "colwise"}


@pytest.mark.multiprocess
def test_tiny_hf_llama_trains_under_tp2_dp2_like_one_process(tmp_path):
    """`stratagem run --check`: 4 gloo processes, tp=2 x dp=2, Megatron's column/row split of every block on
    transformers' module names (the plan's sharding patterns come from the trace), against the unsharded loss."""
    import os
    import subprocess

    sets = ("num_hidden_layers=2",)
    built = build_model("hf:llama", sets, seq=16)
    plan = planner.api.plan(built.module, built.example_inputs, "1x4xcpu", global_batch=8, model_name="hf:llama",
                        settings=(*(tuple(s.split("=")) for s in sets), ("seq", 16)),
                        space=SearchSpace(tp=2, dp=2, pp=1))
    patterns = {m.module for m in plan.sharding}
    assert {"model.layers.*.self_attn.q_proj", "model.layers.*.mlp.down_proj", "lm_head"} <= patterns
    # On CPU the cost model keeps these tiny layers replicated; shard them the Megatron way to run real TP.
    data = plan.to_dict()
    for m in data["strategy"]["sharding"]:
        m["style"] = next((s for k, s in HF_TP_STYLES.items() if m["module"].endswith(k)), m["style"])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    cmd = [sys.executable, "-m", "planner.cli.main", "run", "hf:llama", *(a for s in sets for a in ("--set", s)),
           "--seq", "16", "--plan", str(path), "--steps", "3", "--nproc", "4", "--check", "--json"]
    ran = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert ran.returncode == 0, ran.stderr[-4000:]
    report = json.loads(ran.stdout)
    assert report["strategy"]["tp"] == 2 and report["strategy"]["dp"] == 2
    assert report["check"]["passed"] and report["check"]["max_rel_loss_diff"] <= 1e-4
    assert report["steps"][-1]["loss"] < report["steps"][0]["loss"]
