"""`stratagem profile` and `planner.profiling.ops`: measured op timings keyed exactly as the cost model looks them up,
used by node_time / price_segment / the sharding pricer when present, the analytical model otherwise; the CLI; and
the fidelity benchmark's metrics."""

from __future__ import annotations

import json
import math
import time

import fidelity_metrics as fidelity
import pytest
import torch

import ir
from costmodel.hardware.catalog import get_device
from costmodel.layer_pricing import price_segment
from costmodel.operators import node_time
from costmodel.profile_db import OpProfile, OpTiming, op_signature, segment_signature
from costmodel.sharding.cost import build_sharding_model
from costmodel.training_loss import loss_inputs
from ir.graph import OpKind
from planner.cli.main import main
from planner.cli.profile_cmd import microbatch_sizes
from planner.profiling.ops import profile_module, runnable_graph
from planner.profiling.options import ProfileOptions, Statistic
from planner.profiling.requests import StandardOps
from planner.profiling.timing import compute_clock
from planner.profiling.variants import RecordingPricer

CPU = get_device("cpu")
FAST = dict(warmup=1, repeats=3)


class TinyBlockModel(torch.nn.Module):
    """Two identical pre-LN MLP blocks and a head: small enough to profile in well under a second."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(StandardOps(hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, h)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = TinyBlockModel()
    x = torch.randn(1, 8, 32)
    graph = ir.trace(model, (x,), model_name="tiny")
    run = profile_module(model, (x,), name="tiny", device_name="cpu",
                         options=ProfileOptions(microbatch_sizes=(1, 2), **FAST))
    return model, x, graph, run


def _work_nodes(graph):
    return [n for n in graph.nodes if n.op_kind not in (OpKind.PLACEHOLDER, OpKind.OUTPUT)]


def test_fx_graph_has_the_ir_node_names(tiny):
    model, x, graph, _ = tiny
    gm = runnable_graph(model, 1)
    assert {n.name for n in _work_nodes(graph)} <= {n.name for n in gm.graph.nodes}
    assert torch.equal(gm(x), model(x))


def test_every_priced_key_is_measured(tiny):
    _, _, graph, run = tiny
    expected = {op_signature(n, flops_scale=m, bytes_scale=m) for n in _work_nodes(graph) for m in (1, 2)}
    measured = {sig for (_, sig) in run.profile.entries if not sig.startswith("segment|")}
    assert measured == expected  # identical blocks share keys: one entry per distinct signature
    assert run.measured_ops == len(expected) and not run.skipped
    for (_, sig), t in run.profile.entries.items():
        if sig.startswith("segment|"):  # a layer's glue beyond its ops: small, possibly 0
            assert 0 <= t.forward_s < 0.1 and 0 <= t.backward_s < 0.1
        else:
            assert 0 < t.forward_s < 0.1 and 0 <= t.backward_s < 0.1 and t.samples == 3
    glue = [sig for (_, sig) in run.profile.entries if sig.startswith("segment|")]
    # one per layer class that is one module (blocks, head), at micro-batches 1 and 2
    assert glue and len(glue) % 2 == 0 and {s.rsplit("|", 2)[1] for s in glue} == {"mbs=1", "mbs=2"}


def test_node_time_uses_the_entry_and_falls_back(tiny):
    _, _, graph, run = tiny
    prof = run.profile
    up = next(n for n in graph.nodes if n.name == "blocks_0_up")
    entry = prof.lookup("cpu", op_signature(up, flops_scale=2, bytes_scale=2))
    assert node_time(up, CPU, flops_scale=2, bytes_scale=2, profile=prof) == (entry.forward_s, entry.backward_s)
    # A scale that was not measured (micro-batch 4) and another device: the analytical model answers.
    assert node_time(up, CPU, flops_scale=4, bytes_scale=4, profile=prof) == node_time(up, CPU, flops_scale=4,
                                                                                         bytes_scale=4)
    a100 = get_device("a100-80gb")
    assert node_time(up, a100, profile=prof) == node_time(up, a100)


def test_price_segment_sums_the_measured_entries(tiny, tmp_path):
    _, _, graph, run = tiny
    path = tmp_path / "p.json"
    run.profile.save(path)
    prof = OpProfile.load(path)  # round trip: what the CLI writes is what the cost model reads
    assert prof == run.profile
    chain = ir.build_layer_chain(graph)
    for seg in chain.segments:
        cost = price_segment(chain, seg, CPU, microbatch_size=2, dtype="float32", profile=prof)
        nodes = chain.nodes_of(seg)
        entries = [prof.lookup("cpu", op_signature(n, flops_scale=2, bytes_scale=2)) for n in nodes
                   if n.op_kind not in (OpKind.PLACEHOLDER, OpKind.OUTPUT)]
        glue = prof.lookup("cpu", segment_signature(seg.structural_hash, 2, "float32")) or OpTiming(0.0, 0.0)
        measured_fwd = sum(e.forward_s for e in entries) + glue.forward_s
        measured_bwd = sum(e.backward_s for e in entries) + glue.backward_s
        if loss_inputs(nodes):  # the segment returning the logits also pays the (unprofiled) training loss
            assert cost.fwd_compute_s > measured_fwd and cost.bwd_compute_s > measured_bwd
            continue
        assert cost.fwd_compute_s == pytest.approx(measured_fwd, rel=1e-12)
        assert cost.bwd_compute_s == pytest.approx(measured_bwd, rel=1e-12)


def test_tensor_parallel_shards_are_measured():
    torch.manual_seed(0)
    model = TinyBlockModel()
    x = torch.randn(1, 8, 32)
    graph = ir.trace(model, (x,), model_name="tiny")
    run = profile_module(model, (x,), name="tiny", device_name="cpu",
                         options=ProfileOptions(microbatch_sizes=(2,), tp_degrees=(1, 2), **FAST))
    chain = ir.build_layer_chain(graph)
    skipped = {s.signature for s in run.skipped}
    lookups = 0
    for cid in sorted({s.class_id for s in chain.segments}):
        nodes = chain.nodes_of(chain.representative(cid))
        for sp in (False, True):
            rec = RecordingPricer()
            build_sharding_model(nodes, tp=2, sequence_parallel=sp, traced_batch=1, microbatch_size=2,
                                 pricer=rec.pricer(), dtype="float32")
            by_name = {n.name: n for n in nodes}
            for name, fs, bs, ps in rec.calls:
                if by_name[name].op_kind in (OpKind.PLACEHOLDER, OpKind.OUTPUT):
                    continue  # no work: node_time prices them 0 without a lookup
                sig = op_signature(by_name[name], flops_scale=fs, bytes_scale=bs, param_scale=ps)
                assert sig in skipped or run.profile.lookup("cpu", sig) is not None, sig
                lookups += 1
    assert lookups > len(_work_nodes(graph))  # sharded strategies were priced, not only replicated ones
    # A column-parallel up projection (weight split on its output features) is its own key: half the FLOPs.
    up = next(n for n in graph.nodes if n.name == "blocks_0_up")
    assert run.profile.lookup("cpu", op_signature(up, flops_scale=1, bytes_scale=1.2, param_scale=0.5)) is not None


def test_memory_budget_skips_and_reports():
    torch.manual_seed(0)
    model = TinyBlockModel()
    x = torch.randn(1, 8, 32)
    run = profile_module(model, (x,), name="tiny", device_name="cpu",
                         options=ProfileOptions(memory_budget_bytes=2048, **FAST))
    assert run.skipped and all("memory budget" in s.reason for s in run.skipped)
    assert len(run.profile) + len(run.skipped) == len({s.signature for s in run.skipped} |
                                                      {sig for _, sig in run.profile.entries})


def test_mean_statistic_times_a_window():
    torch.manual_seed(0)
    model = StandardOps(32)
    x = torch.randn(1, 8, 32)
    run = profile_module(model, (x,), name="std", device_name="cpu",
                         options=ProfileOptions(statistic=Statistic.MEAN, min_window_s=0.005, **FAST))
    assert run.profile.meta["statistic"] == "mean"
    for t in run.profile.entries.values():
        assert t.samples >= 3
        if t.forward_s + t.backward_s < 0.005 / 10:
            # an op far shorter than the window is run until the window is full: well beyond the 3 repeats
            assert t.samples >= 10


def test_options_validate_their_values():
    with pytest.raises(ValueError, match="microbatch_sizes"):
        ProfileOptions(microbatch_sizes=(0,))
    with pytest.raises(ValueError, match="repeats"):
        ProfileOptions(repeats=0)
    with pytest.raises(ValueError, match="median"):
        ProfileOptions(statistic="average")
    assert ProfileOptions(tp_degrees=(4, 2, 2, 1)).tp_degrees == (1, 2, 4)


def test_microbatch_sizes_are_powers_of_two_and_the_batch():
    assert microbatch_sizes(1) == (1,)
    assert microbatch_sizes(8) == (1, 2, 4, 8)
    assert microbatch_sizes(6) == (1, 2, 4, 6)


def test_cli_profiles_gpt_tiny(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "--model", "gpt-tiny", "--repeats", "3", "--warmup", "1", "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    prof = OpProfile.load(out)
    # The keys are exactly what `stratagem plan gpt-tiny` (training dtype bfloat16, traced batch 1) looks up.
    from planner.cli.common import build_model, trace_chain

    chain = trace_chain(build_model("gpt-tiny", [], seq=None), dtype="bfloat16")
    expected = {op_signature(n, flops_scale=1, bytes_scale=1) for n in _work_nodes(chain.graph)}
    # plus the glue of every layer class that is one module (the blocks), keyed as `price_segment` looks it up
    expected |= {segment_signature(s.structural_hash, 1, "bfloat16") for s in chain.segments
                 if s.name.startswith("blocks.")}
    assert {sig for _, sig in prof.entries} == expected
    assert summary["entries"] == len(expected) and summary["skipped"] == []
    assert prof.meta["dtype"] == "bfloat16" and prof.meta["models"] == "gpt-tiny"
    assert all(dev == "cpu" for dev, _ in prof.entries)


@pytest.mark.parametrize("argv, message", [
    (["profile", "--device", "cuda"], "no CUDA"),
    (["profile", "--set", "layers=2"], "--set needs --model"),
    (["profile", "--catalog-device", "tpu-v9"], "tpu-v9"),
    (["profile", "--model", "no-such-model"], "no-such-model"),
    (["profile", "--tp", "0"], "positive"),
])
def test_cli_user_errors_are_one_line(argv, message, capsys, tmp_path):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main([*argv, "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


@pytest.mark.multiprocess
def test_collectives_are_measured_and_fitted():
    from planner.profiling.collectives import CollectiveOptions, collective_profile

    prof = collective_profile(CollectiveOptions(max_ranks=2, sizes=(4096, 1 << 20), warmup=1, repeats=3))
    assert {s.kind.value for s in prof.samples} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                   "broadcast", "send_recv"}
    link = prof.fit("cpu")
    assert link is not None and link.alpha_s >= 0 and link.bandwidth_bytes_per_s > 0 and link.samples == 8


# ---- the fidelity benchmark's metrics (tests/fidelity_metrics.py, used by bench/fidelity.py) ---------------------

def test_spearman_and_mape_closed_forms():
    assert fidelity.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)       # 1 - 6*2/(4*15)
    assert fidelity.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(22.5))  # tie-averaged ranks
    assert fidelity.spearman([3, 2, 1], [1, 2, 3]) == pytest.approx(-1.0)
    assert fidelity.ranks_of([10, 30, 20, 30]) == [1, 3.5, 2, 3.5]
    assert fidelity.mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(0.1)


def test_regret_uses_the_side_by_side_confirmation():
    key_a = (1, 1, 2, 2, 2, "1f1b", 1, 0, False, "none")
    key_b = (1, 1, 2, 1, 4, "1f1b", 1, 0, False, "none")
    cases = [fidelity.Case(id="a", cluster="1x2xcpu", key=key_a, plan={}, labels=("choice:profiled",),
                    predicted={"profiled": {"step_time_s": 0.010, "memory_bytes": [100]}}),
             fidelity.Case(id="b", cluster="1x2xcpu", key=key_b, plan={},
                    predicted={"profiled": {"step_time_s": 0.011, "memory_bytes": [100]}})]
    measured = {"a": {"step_time_s": 0.031, "memory_bytes": [110]}, "b": {"step_time_s": 0.026, "memory_bytes": [90]}}
    first = fidelity.summarize(cases, measured, "profiled")
    assert first["regret"] == pytest.approx(0.031 / 0.026) == first["regret_first_pass"]
    confirmed = {fidelity.describe(key_a): 0.027, fidelity.describe(key_b): 0.028}
    again = fidelity.summarize(cases, measured, "profiled", confirmed)
    assert again["regret"] == pytest.approx(1.0) and again["regret_first_pass"] == first["regret"]
    assert again["memory_error"] == pytest.approx((0.1 / 1.1 + 0.1 / 0.9) / 2)


def test_peak_during_reconstructs_the_allocator_peak():
    from torch.profiler import ProfilerActivity, profile

    mib = 1 << 20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(mib, dtype=torch.uint8)
        c = torch.empty(2 * mib, dtype=torch.uint8)
        del a
        d = torch.empty(mib // 2, dtype=torch.uint8)
        del c, d
    assert fidelity.peak_during(prof, 5 * mib) == 5 * mib + 3 * mib


def test_primary_error_is_the_cause_not_the_echo():
    errors = ["RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234",
              "RuntimeError: The size of tensor a (32) must match the size of tensor b (64)",
              "RuntimeError: Could not resolve the process group registered under the name 7"]
    assert fidelity.primary_error(errors) == errors[1]
    assert fidelity.primary_error(errors[:1]) == errors[0]  # only echoes: keep what there is


def test_profile_loads_and_calibrates_the_cluster(tmp_path):
    from costmodel.hardware.cluster import Cluster
    from costmodel.hardware.collective_fit import CollectiveProfile, CollectiveSample
    from costmodel.hardware.collectives import Collective
    from planner.api import as_cluster, load_profile
    from planner.errors import UserError

    cluster = Cluster.parse("1x2xcpu")
    assert as_cluster(cluster, None) is cluster
    samples = [CollectiveSample(Collective.ALL_REDUCE, 2, float(s), 1e-4 + s / 1e9) for s in (4096, 1 << 20)]
    prof = OpProfile(collectives=CollectiveProfile.from_samples(samples))
    path = tmp_path / "p.json"
    prof.save(path)
    loaded = load_profile(str(path))
    assert loaded == prof
    calibrated = as_cluster("1x2xcpu", loaded)
    assert calibrated.tiers[0].bandwidth == pytest.approx(1e9) and calibrated.tiers[0].latency == pytest.approx(5e-5)
    assert as_cluster(calibrated, loaded) == calibrated  # calibrating twice changes nothing
    with pytest.raises(UserError, match="does not exist"):
        load_profile(str(tmp_path / "missing.json"))
    path.write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        load_profile(str(path))


def test_cpu_compute_is_timed_on_the_thread_clock() -> None:
    """Single-threaded CPU ops on the thread's CPU clock: time slices other processes take from the core (4 ranks
    on 2 cores) are not the op's. Several threads, or a mean meant to sample the sharing, keep the wall clock."""
    cpu = torch.device("cpu")
    assert compute_clock(cpu, ProfileOptions(threads=1)) is time.thread_time
    assert compute_clock(cpu, ProfileOptions(threads=None)) is time.perf_counter
    assert compute_clock(cpu, ProfileOptions(threads=1, statistic="mean", min_window_s=0.05)) is time.perf_counter
    assert compute_clock(torch.device("meta"), ProfileOptions(threads=1)) is time.perf_counter
    # The thread clock does not run while the thread sleeps (as it does not while another process has the core).
    t0, w0 = time.thread_time(), time.perf_counter()
    time.sleep(0.05)
    assert time.thread_time() - t0 < 0.5 * (time.perf_counter() - w0)
