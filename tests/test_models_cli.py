"""`stratagem models [--json]`: the zoo table and its JSON, with parameter counts from the closed forms."""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import pytest

from models.zoo import FAMILIES, PRESETS
from planner.cli import models_cmd
from planner.cli.models_cmd import human_count


def run_models(argv: list[str], capsys) -> tuple[int, str]:
    """Run the command through its own `register` (the same parser wiring `stratagem` uses)."""
    parser = argparse.ArgumentParser(prog="stratagem")
    models_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.func(args)
    return code, capsys.readouterr().out


def test_table_lists_every_family_and_preset_with_counts(capsys) -> None:
    start = time.process_time()
    code, out = run_models(["models"], capsys)
    assert time.process_time() - start < 2.0
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "FAMILY", "PARAMS", "PUBLISHED", "DESCRIPTION"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert list(rows) == [*FAMILIES, *PRESETS]
    assert rows["gpt3-175b"][:5] == ["gpt3-175b", "preset", "gpt", "174.6B", "174.6B"]
    assert rows["llama3-8b"][3:5] == ["8.03B", "8.03B"]
    assert rows["gpt"][:5] == ["gpt", "family", "gpt", "124.4M", "-"]
    assert rows["gpt-tiny"][4] == "-"


def test_json_has_counts_and_default_configs(capsys) -> None:
    code, out = run_models(["models", "--json"], capsys)
    assert code == 0
    models = json.loads(out)["models"]
    by_name = {m["name"]: m for m in models}
    assert len(by_name) == len(models) == len(FAMILIES) + len(PRESETS)
    m = by_name["gpt3-175b"]
    assert (m["kind"], m["family"], m["params"], m["published_params"]) == (
        "preset", "gpt", 174_615_846_912, 174_600_000_000)
    assert m["config"] == {
        "vocab": 51200, "hidden": 12288, "layers": 96, "heads": 96, "kv_heads": None, "seq": 2048, "ffn_hidden": None,
        "dropout": 0.0, "attn_impl": "sdpa", "fused_dropout_add": False, "bias": True, "tie_embeddings": True,
        "norm_eps": 1e-05,
    }
    assert by_name["dlrm-mlperf"]["config"]["tables"][0] == 39884406
    assert by_name["mixtral-8x7b"]["params"] == 46_702_792_704
    assert by_name["resnet"]["kind"] == "family" and by_name["resnet"]["params"] == 25_557_032


@pytest.mark.parametrize(
    ("count", "text"),
    [(999, "999"), (9_362, "9.36K"), (124_439_808, "124.4M"), (8_030_261_248, "8.03B"),
     (174_615_846_912, "174.6B"), (1_008_038_758_400, "1.01T")],
)
def test_human_count(count: int, text: str) -> None:
    assert human_count(count) == text


@pytest.mark.skipif(importlib.util.find_spec("planner.cli.trace_cmd") is None,
                    reason="the stratagem entry point also needs planner.cli.trace_cmd")
def test_stratagem_models_entry_point(capsys) -> None:
    from planner.cli.main import main

    assert main(["models", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["models"][0]["name"] == "gpt"
    assert main(["models", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
