"""`stratagem trace`: text and JSON output, overrides, errors, determinism, and the GPT-3 175B acceptance run."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import pytest

from planner.cli.main import main

# gpt-tiny (models/zoo.py): vocab 512, hidden 128, 4 layers, 8 heads, seq 64, tied embeddings
VOCAB, HIDDEN, LAYERS, SEQ = 512, 128, 4, 64


def _gpt_closed_form(batch: int, seq: int, hidden: int, layers: int, vocab: int) -> int:
    """Forward FLOPs: per layer 24*b*s*h^2 + 4*b*s^2*h, plus the logits 2*b*s*h*V (Narayanan et al. 2021)."""
    return layers * (24 * batch * seq * hidden**2 + 4 * batch * seq**2 * hidden) + 2 * batch * seq * hidden * vocab


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_keys_and_numbers(capsys) -> None:
    code, out, _ = run(["trace", "gpt-tiny", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    for key in ("params", "forward_flops", "layers", "num_layer_classes", "backward_flops", "fingerprint"):
        assert key in d
    assert d["params"] == 867072  # `stratagem models`: gpt-tiny's closed-form count
    assert d["forward_flops"] == _gpt_closed_form(1, SEQ, HIDDEN, LAYERS, VOCAB)
    assert (d["batch"], d["seq"], d["dtype"], d["tracer"]) == (1, SEQ, "bfloat16", "fx")
    assert [layer["class_id"] for layer in d["layers"]] == [0, 1, 1, 1, 1, 2]
    assert d["num_layer_classes"] == 3 and d["num_layers"] == LAYERS + 2
    assert sum(layer["params"] for layer in d["layers"]) == d["params"]
    assert sum(layer["forward_flops"] for layer in d["layers"]) == d["forward_flops"]
    blocks = d["classes"][1]
    assert (blocks["count"], blocks["first"]) == (LAYERS, "blocks.0")
    assert blocks["params_per_layer"] == 12 * HIDDEN**2 + 13 * HIDDEN  # GPT block with biases


def test_text_table(capsys) -> None:
    code, out, _ = run(["trace", "gpt-tiny"], capsys)
    assert code == 0
    assert "params     867.1K (867,072)" in out  # same units as `stratagem models`
    assert "chain      6 layers, 3 classes" in out
    row = next(line for line in out.splitlines() if line.startswith("blocks.0 .. blocks.3"))
    assert row.split()[3:5] == ["1", "4"]  # class 1, 4 layers


def test_batch_seq_and_set_overrides(capsys) -> None:
    _, out, _ = run(["trace", "gpt-tiny", "--json", "--batch", "3", "--seq", "32", "--set", "layers=2"], capsys)
    d = json.loads(out)
    assert (d["batch"], d["seq"], d["num_layers"]) == (3, 32, 4)
    assert d["forward_flops"] == _gpt_closed_form(3, 32, HIDDEN, 2, VOCAB)
    assert ["layers", 2] in d["settings"] and ["seq", 32] in d["settings"]


def test_json_is_deterministic(capsys) -> None:
    _, first, _ = run(["trace", "llama-tiny", "--json"], capsys)
    _, second, _ = run(["trace", "llama-tiny", "--json"], capsys)
    assert first == second


@pytest.mark.parametrize(("argv", "message"), [
    (["trace", "gpt-5"], "unknown model 'gpt-5'"),
    (["trace", "gpt-tiny", "--set", "depth=3"], "unknown setting"),
    (["trace", "gpt-tiny", "--batch", "0"], "positive integer"),
    (["trace", "gpt-tiny", "--dtype", "int8"], "invalid choice"),
])
def test_user_errors_are_one_line_exit_2(argv: list[str], message: str, capsys) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_untraceable_user_model_is_a_user_error(capsys) -> None:
    code, _, err = run(["trace", "ir_models:value_branch"], capsys)
    assert code == 2
    assert err.startswith("stratagem: error: cannot trace ir_models:value_branch in module 'gate'")
    assert err.count("\n") == 1


def test_gpt3_175b_json_time_and_memory() -> None:
    """`stratagem trace gpt3-175b --json` in < 20 s with < 3 GiB peak RSS (aim: < 5 s)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "planner.cli.main", "trace", "gpt3-175b", "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
    assert elapsed < 20.0
    assert peak_rss < 3 * 2**30
    d = json.loads(proc.stdout)
    assert abs(d["params"] - 174.6e9) / 174.6e9 < 0.005
    assert d["num_layer_classes"] == 3 and d["classes"][1]["count"] == 96
    closed = _gpt_closed_form(1, 2048, 12288, 96, 51200)
    assert abs(d["forward_flops"] - closed) / closed < 1e-3
