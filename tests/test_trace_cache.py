"""The trace cache: a faithful round trip (same fingerprint, same plans), hits that never build or trace the model,
keys that change with everything that changes the graph, corrupt and stale entries ignored with a note and
rewritten, atomic writes, the cache folder's platform convention, and the CLI flags."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import ir
import models.registry
import planner.api
import planner.trace_cache as tc
from planner.cli.main import main
from planner.trace_cache import ENV_VAR, TraceCache, TracedModel, default_cache_root, trace_key
from planner.tracing import trace_model

REPO = Path(__file__).resolve().parents[1]
TINY = "gpt-tiny"


class Notes(list):
    def __call__(self, text: str) -> None:
        self.append(text)


def cache_in(folder: Path) -> tuple[TraceCache, Notes]:
    notes = Notes()
    return TraceCache(folder, note=notes), notes


def no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make building any model fail: a trace served from the cache must not need it."""
    def fail(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was built although the trace cache holds it")
    monkeypatch.setattr(models.registry, "build_model", fail)


def plan_dict(chain: ir.LayerChain, cluster: str = "1x4xcpu") -> dict:
    plan = planner.api.plan(chain, None, cluster, global_batch=8, dtype="float32", model_name=TINY)
    d = plan.to_dict()
    d["search"].pop("time_s")
    return d


def test_round_trip_gives_the_same_graph_and_the_same_plans(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cache, notes = cache_in(tmp_path)
    fresh = trace_model(TINY, ["layers=3"], dtype="float32", cache=cache)
    assert cache.path(trace_key(TINY, ["layers=3"], seq=None, dtype="float32")).is_file()
    no_build(monkeypatch)
    cached = trace_model(TINY, ["layers=3"], dtype="float32", cache=cache)
    assert notes == []
    assert cached == fresh  # the chain, its graph, the name and the settings
    assert ir.fingerprint(cached.chain.graph) == ir.fingerprint(fresh.chain.graph)
    assert plan_dict(cached.chain) == plan_dict(fresh.chain)
    assert plan_dict(cached.chain, "1x2xcpu") == plan_dict(fresh.chain, "1x2xcpu")


def test_settings_are_recorded_as_a_plan_records_them(tmp_path: Path) -> None:
    cache, _ = cache_in(tmp_path)
    fresh = trace_model(TINY, ["attn_impl=math", "layers=2"], seq=32, cache=cache)
    assert dict(fresh.settings) == {"attn_impl": "math", "layers": 2, "seq": 32}
    assert trace_model(TINY, ["layers=2", "attn_impl=math"], seq=32, cache=cache).settings == fresh.settings


def test_key_changes_with_everything_that_changes_the_graph(tmp_path: Path) -> None:
    base = trace_key(TINY, ["layers=2"], seq=None, dtype="bfloat16")
    others = [trace_key("gpt-small", ["layers=2"], seq=None, dtype="bfloat16"),
              trace_key(TINY, ["layers=3"], seq=None, dtype="bfloat16"),
              trace_key(TINY, ["layers=2"], seq=64, dtype="bfloat16"),
              trace_key(TINY, ["layers=2"], seq=None, dtype="float32")]
    assert len({base.file_name(), *(k.file_name() for k in others)}) == 5
    assert trace_key(TINY, ["layers=2", "heads=4"], seq=None, dtype="bfloat16") == trace_key(
        TINY, ["heads=4", "layers=2"], seq=None, dtype="bfloat16")  # order of --set does not matter
    versions = dict(base.versions)
    assert set(versions) == {"torch", "stratagem", "entry"} and versions["torch"].startswith("2.")
    assert trace_key("mypkg.models:build", [], seq=None, dtype="bfloat16") is None  # user code: never cached
    # an hf: config file is part of the key by its contents
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    first = trace_key(f"hf:{config}", [], seq=None, dtype="bfloat16")
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    second = trace_key(f"hf:{config}", [], seq=None, dtype="bfloat16")
    assert first.sources != second.sources and "transformers" in dict(first.versions)


def _entry(tmp_path: Path) -> tuple[TraceCache, Notes, Path, TracedModel]:
    cache, notes = cache_in(tmp_path)
    traced = trace_model(TINY, ["layers=2"], cache=cache)
    return cache, notes, cache.path(trace_key(TINY, ["layers=2"], seq=None, dtype="bfloat16")), traced


def _flip_body_byte(data: bytes) -> bytes:
    i = data.index(b'"forward_flops": ') + len(b'"forward_flops": ')
    return data[:i] + (b"7" if data[i:i + 1] != b"7" else b"8") + data[i + 1:]


def _other_fingerprint(data: bytes) -> bytes:
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    header["fingerprint"] = "0" * 64
    return json.dumps(header).encode() + b"\n" + body


def _other_torch(data: bytes) -> bytes:
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    header["key"]["versions"] = [["torch", "1.0"] if v[0] == "torch" else v for v in header["key"]["versions"]]
    return json.dumps(header).encode() + b"\n" + body


@pytest.mark.parametrize(("damage", "says"), [
    (lambda d: d[: len(d) // 2], "corrupt"),                         # truncated
    (lambda d: b"", "corrupt"),                                      # empty
    (lambda d: b"\x00\xff garbage", "corrupt"),                      # not JSON at all
    (lambda d: b"{}\n" + d.partition(b"\n")[2], "stale"),            # header without format
    (_flip_body_byte, "corrupt (checksum mismatch)"),                # a flipped digit in the graph
    (_other_fingerprint, "corrupt (graph fingerprint mismatch)"),    # checksum right, graph not the one stored
    (_other_torch, "stale (made with other versions)"),              # made by another torch
], ids=["truncated", "empty", "garbage", "no-format", "checksum", "fingerprint", "stale-torch"])
def test_bad_entry_is_ignored_with_a_note_and_rewritten(tmp_path: Path, damage, says: str) -> None:
    cache, notes, path, traced = _entry(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    again = trace_model(TINY, ["layers=2"], cache=cache)
    assert again == traced
    assert len(notes) == 1 and says in notes[0] and str(path) in notes[0] and "tracing again" in notes[0]
    assert "\n" not in notes[0]
    notes.clear()
    assert trace_model(TINY, ["layers=2"], cache=cache) == traced and notes == []  # rewritten, valid again


def test_unreadable_or_unwritable_cache_is_a_note_not_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache, notes = cache_in(blocker / "traces")  # mkdir fails: a file is in the way
    traced = trace_model(TINY, ["layers=2"], cache=cache)
    assert traced.chain.graph.param_count > 0
    assert len(notes) == 1 and "cannot write the trace cache" in notes[0]
    # an entry that is a folder cannot be read
    cache, notes = cache_in(tmp_path / "ok")
    cache.path(trace_key(TINY, ["layers=2"], seq=None, dtype="bfloat16")).mkdir(parents=True)
    assert trace_model(TINY, ["layers=2"], cache=cache) == traced
    assert any("cannot read trace cache entry" in n for n in notes)


def test_concurrent_writers_and_readers_never_see_half_a_file(tmp_path: Path) -> None:
    cache, notes, path, traced = _entry(tmp_path)
    key = trace_key(TINY, ["layers=2"], seq=None, dtype="bfloat16")
    stop = threading.Event()
    loaded: list[TracedModel | None] = []

    def write() -> None:
        while not stop.is_set():
            cache.store(key, traced)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        loaded += [cache.load(key) for _ in range(40)]
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert notes == [] and all(x == traced for x in loaded)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left behind


def test_default_folder_follows_the_platform(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "mine"))
    assert default_cache_root() == tmp_path / "mine"
    assert TraceCache.default().directory == tmp_path / "mine" / "traces"
    monkeypatch.delenv(ENV_VAR)
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: tmp_path / "home"))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "stratagem"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_root() == tmp_path / "home" / ".cache" / "stratagem"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert default_cache_root() == tmp_path / "home" / "Library" / "Caches" / "stratagem"
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setenv("LOCALAPPDATA", str(tmp_path / "local"))
    assert default_cache_root() == tmp_path / "local" / "stratagem" / "Cache"


def test_the_suite_never_touches_the_users_cache() -> None:
    root = default_cache_root()
    assert os.environ[ENV_VAR] == str(root)
    assert Path.home() / ".cache" not in root.parents and "stratagem-cache" in root.name


def test_cli_flags_and_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", TINY, "--cluster", "1x2xcpu", "--batch", "4", "--dtype", "float32", "--json"]
    assert main([*argv, "--trace-cache", str(tmp_path / "mine")]) == 0
    assert len(list((tmp_path / "mine").glob("*.json"))) == 1
    assert main([*argv, "--no-trace-cache"]) == 0
    assert not TraceCache.default().directory.exists()
    assert main(argv) == 0
    assert len(list(TraceCache.default().directory.glob("*.json"))) == 1
    capsys.readouterr()
    assert main([*argv, "--no-trace-cache", "--trace-cache", "x"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_cached_plan_and_replan_never_import_torch(tmp_path: Path) -> None:
    """The point of the cache: a second plan and a re-plan skip torch (seconds to import) and the model."""
    cluster = tmp_path / "straggler.yaml"
    cluster.write_text("name: slow\ngroups:\n  - device: cpu\n    num_nodes: 1\n    devices_per_node: 4\n"
                       "    slowdown:\n      1: 0.5\n")
    first = ["plan", TINY, "--cluster", "1x4xcpu", "--batch", "8", "-o", str(tmp_path / "plan.json")]
    probe = ("import sys; from planner.cli.main import main; code = main(sys.argv[1:]); "
             "print('torch' in sys.modules, file=sys.stderr); sys.exit(code)")
    for argv, imports_torch in ((first, True),
                                (["plan", TINY, "--cluster", "1x2xcpu", "--batch", "16"], False),
                                (["replan", str(tmp_path / "plan.json"), "--cluster", str(cluster)], False)):
        proc = subprocess.run([sys.executable, "-c", probe, *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.strip().splitlines()[-1] == str(imports_torch), (argv, proc.stderr)


def test_entry_is_json_never_pickle(tmp_path: Path) -> None:
    _, _, path, traced = _entry(tmp_path)
    head, _, body = path.read_bytes().partition(b"\n")
    header = json.loads(head)
    assert header["format"] == tc.ENTRY_FORMAT and header["fingerprint"] == ir.fingerprint(traced.chain.graph)
    assert ir.LayerChain.from_json(body.decode()) == traced.chain
    assert dataclasses.is_dataclass(traced) and traced.__dataclass_params__.frozen
