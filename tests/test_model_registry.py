"""The CLI model registry: names, --set parsing to typed config fields, --seq, user factories, and its errors."""

from __future__ import annotations

import textwrap
import time

import pytest
import torch

from models.attention import AttnImpl
from models.registry import BuiltModel, EntryKind, ModelError, build_model, list_models, resolve_config
from models.zoo import FAMILIES, PRESETS


def test_preset_builds_on_meta_with_example_inputs() -> None:
    built = build_model("gpt3-175b", batch=2)
    assert isinstance(built, BuiltModel)
    assert (built.name, built.family, built.settings, built.seq_len) == ("gpt3-175b", "gpt", (), 2048)
    assert built.config == PRESETS["gpt3-175b"].config
    assert [tuple(t.shape) for t in built.example_inputs] == [(2, 2048)]
    assert all(t.is_meta for t in built.example_inputs)
    assert sum(p.numel() for p in built.module.parameters()) == 174_615_846_912


def test_family_name_builds_the_default_config() -> None:
    built = build_model("llama")
    assert built.config == FAMILIES["llama"].config_type()
    assert sum(p.numel() for p in built.module.parameters()) == 8_030_261_248


def test_sets_are_parsed_to_field_types_and_recorded_sorted() -> None:
    built = build_model("gpt", ["layers=2", "attn_impl=math", "bias=false", "dropout=0.1", "ffn_hidden=none"],
                        seq=128, batch=3)
    c = built.config
    assert (c.layers, c.attn_impl, c.bias, c.dropout, c.ffn_hidden, c.seq) == (2, AttnImpl.MATH, False, 0.1, None, 128)
    assert type(c.layers) is int and type(c.dropout) is float and c.attn_impl is AttnImpl.MATH
    assert [k for k, _ in built.settings] == ["attn_impl", "bias", "dropout", "ffn_hidden", "layers", "seq"]
    assert built.seq_len == 128 and tuple(built.example_inputs[0].shape) == (3, 128)
    # 2 blocks of width 768 with ffn 4h, no biases; position table of 128 rows
    assert sum(p.numel() for p in built.module.parameters()) == 50257 * 768 + 128 * 768 + 2 * (12 * 768**2 + 2 * 768) + 768


def test_tuple_fields_take_comma_separated_values() -> None:
    _, config, overrides = resolve_config("resnet", ["depths=3,4,23,3"])
    assert config.depths == (3, 4, 23, 3) and overrides == {"depths": (3, 4, 23, 3)}
    _, config, _ = resolve_config("dlrm-small", ["tables=10, 20,30"])
    assert config.tables == (10, 20, 30)


def test_settings_rebuild_the_same_model() -> None:
    built = build_model("llama-tiny", ["kv_heads=2", "layers=3"], seq=32)
    again = build_model(built.name, [f"{k}={v}" for k, v in built.settings])
    assert again.config == built.config


def test_cpu_build_runs_forward_and_loss() -> None:
    torch.manual_seed(0)
    built = build_model("moe-tiny", batch=2, device="cpu")
    out = built.module(*built.example_inputs)
    assert tuple(out.shape) == (2, 64, 512)
    assert torch.isfinite(built.loss(out, built.example_inputs))


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("gpt", ["nope=1"]), {}, r"--set nope: unknown setting for GPTConfig; valid keys: attn_impl, bias, dropout"),
        (("gpt", ["layers=x"]), {}, r"--set layers=x: expected an integer"),
        (("gpt", ["dropout=lots"]), {}, r"--set dropout=lots: expected a number"),
        (("gpt", ["bias=maybe"]), {}, r"--set bias=maybe: expected a boolean"),
        (("gpt", ["attn_impl=flash"]), {}, r"--set attn_impl=flash: not one of sdpa, math"),
        (("gpt", ["layers"]), {}, r"expected KEY=VALUE"),
        (("gpt", ["layers=2", "layers=3"]), {}, r"--set layers given twice"),
        (("gpt", ["heads=5"]), {}, r"model gpt: GPTConfig.hidden=768 must be divisible by heads=5"),
        (("gtp3-175b",), {}, r"unknown model 'gtp3-175b' \(did you mean gpt3-175b\?\); families: gpt, llama"),
        (("vit",), {"seq": 64}, r"model vit has no free sequence length"),
        (("resnet-50",), {"seq": 64}, r"model resnet-50 \(resnet\) has no free sequence length"),
        (("gpt", ["seq=4"]), {"seq": 8}, r"--seq 8 contradicts --set seq=4"),
        (("gpt",), {"batch": 0}, r"batch must be a positive integer, got 0"),
        (("gpt",), {"seq": 0}, r"--seq must be a positive integer, got 0"),
        (("gpt",), {"device": "tpu9"}, r"unknown device 'tpu9'"),
        (("moe", ["group_size=3"]), {}, r"group_size=3 must divide seq=4096"),
        (("dlrm", ["tables=1,x"]), {}, r"--set tables=x: expected an integer"),
        (("no_such_pkg.mod:make",), {}, r"cannot import no_such_pkg.mod"),
        (("json:no_such_factory",), {}, r"json has no callable 'no_such_factory'"),
        ((":make",), {}, r"expected package.module:factory"),
    ],
)
def test_user_errors_are_one_line_and_name_the_problem(args, kwargs, message: str) -> None:
    with pytest.raises(ModelError, match=message) as excinfo:
        build_model(*args, **kwargs)
    assert "\n" not in str(excinfo.value)


def test_list_models_covers_families_and_presets_with_closed_form_counts() -> None:
    start = time.perf_counter()
    entries = list_models()
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0  # closed forms, nothing built (the whole command must stay under 2 s)
    assert [e.name for e in entries] == [*FAMILIES, *PRESETS]
    by_name = {e.name: e for e in entries}
    assert by_name["gpt"].kind is EntryKind.FAMILY and by_name["gpt"].params == 124_439_808
    assert by_name["gpt3-175b"].kind is EntryKind.PRESET and by_name["gpt3-175b"].params == 174_615_846_912
    assert by_name["llama3-8b"].published_params == 8_030_261_248
    for e in entries:
        if e.kind is EntryKind.PRESET:
            assert e.params == FAMILIES[e.family].num_params(PRESETS[e.name].config)


# --- user models (package.module:factory) -----------------------------------------------------------------------

USER_MODULE = textwrap.dedent(
    '''
    from typing import Literal

    import torch
    from torch import nn


    def mlp(hidden: int = 8, act: Literal["relu", "tanh"] = "relu", scale: float = 1.0) -> nn.Module:
        layers = [nn.Linear(4, hidden), nn.ReLU() if act == "relu" else nn.Tanh(), nn.Linear(hidden, 2)]
        return nn.Sequential(*layers)


    def with_inputs(batch: int, seq: int = 16, width: int = 4):
        model = nn.Linear(width, 3)
        return model, (torch.zeros(batch, seq, width),)


    def not_a_module():
        return 42
    '''
)


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_user_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_user_models"


def test_user_factory_gets_parsed_sets(user_module: str) -> None:
    built = build_model(f"{user_module}:mlp", ["hidden=16", "act=tanh", "scale=0.5"], device="cpu")
    assert built.family == "user" and built.config is None and built.example_inputs == ()
    assert built.settings == (("act", "tanh"), ("hidden", 16), ("scale", 0.5))
    assert isinstance(built.module[1], torch.nn.Tanh) and built.module[0].out_features == 16
    out = built.module(torch.ones(3, 4))
    assert built.loss(out, ()).item() == pytest.approx(out.pow(2).mean().item())


def test_user_factory_returning_inputs_gets_batch_and_seq(user_module: str) -> None:
    built = build_model(f"{user_module}:with_inputs", ["width=6"], batch=5, seq=7, device="meta")
    assert [tuple(t.shape) for t in built.example_inputs] == [(5, 7, 6)]
    assert built.module.weight.is_meta  # built under the requested device
    assert built.seq_len == 7 and built.settings == (("seq", 7), ("width", 6))


@pytest.mark.parametrize(
    ("spec", "sets", "kwargs", "message"),
    [
        ("mlp", ["act=gelu"], {}, r"--set act=gelu: not one of relu, tanh"),
        ("mlp", ["depth=3"], {}, r"--set depth: unknown setting .*valid keys: act, hidden, scale"),
        ("mlp", [], {"seq": 4}, r"takes no `seq` argument"),
        ("not_a_module", [], {}, r"returned int, expected an nn.Module"),
    ],
)
def test_user_factory_errors(user_module: str, spec: str, sets, kwargs, message: str) -> None:
    with pytest.raises(ModelError, match=message):
        build_model(f"{user_module}:{spec}", sets, **kwargs)
