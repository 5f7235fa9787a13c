"""Offloading model state to host memory: the host data, the memory it saves, its closed-form prices, the search's
choice (only where memory binds), the runtime mapping onto FSDP2 and the plan JSON."""

from __future__ import annotations

import csv
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from costmodel_graphs import GptShape, gpt_chain

from costmodel import Cluster, Strategy
from costmodel.estimate import estimate
from costmodel.hardware.catalog import device_names
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.hardware.host import host_of
from costmodel.memory import GIB, model_state_bytes
from costmodel.offload import HostCopy, host_problem, offload_tail
from costmodel.step_time import data_parallel_comm, overlapped_exposed
from costmodel.strategy import Offload, RuntimeOptions
from planner.search.space import SearchSpace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
SHAPE = GptShape(layers=4, hidden=1024, heads=16, seq=1024, vocab=32000, batch=2)
P = 1_000_000


@pytest.fixture(scope="module")
def chain():
    return gpt_chain(SHAPE)


def _runtime(offload: str) -> RuntimeOptions:
    return RuntimeOptions(offload=offload)


# ---- host data ------------------------------------------------------------------------------------------------

def test_every_host_value_has_its_source_and_the_measured_rates() -> None:
    rows = list(csv.DictReader((REPO / "costmodel/hardware/data/host.csv").open()))
    assert {r["name"] for r in rows} == set(device_names())
    for r in rows:
        for value, source in (("host_to_device_gbps", "source_host_link"), ("host_memory_gb", "source_host_memory"),
                              ("cpu_adam_gparams", "source_cpu_adam")):
            assert not r[value] or r[source], (r["name"], value)
    # nvbandwidth on Azure ND A100 v4 / ND H100 v5 / ND H200 v5 (PCIe 4.0 and 5.0 x16)
    assert host_of("a100-80gb").host_to_device_bandwidth == 26.28e9
    assert (host_of("h100-sxm").host_to_device_bandwidth, host_of("h100-sxm").device_to_host_bandwidth) == (51e9, 52e9)
    assert host_of("h200").host_to_device_bandwidth == 55e9
    # ZeRO-Offload Table 3: 10B parameters in 2.57 s on one DGX-2 host, shared by 8 devices
    assert host_of("h100-sxm").adam_params_per_s == pytest.approx(10e9 / 2.57 / 8, rel=0.01)
    assert host_of("tpu-v4") is None and host_of("no-such-device") is None


# ---- memory ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("zero", "offload", "device", "host"), [
    # mixed precision: 2-byte weights, 4-byte gradient buffers, 12 bytes of fp32 master + Adam (module docstring)
    (0, Offload.NONE, (2 * P, 4 * P, 12 * P), 0),
    (0, Offload.OPTIMIZER, (2 * P, 4 * P, 0), 16 * P),         # master + m + v + the fp32 gradient copy
    (1, Offload.OPTIMIZER, (2 * P, 4 * P, 0), 16 * P // 4),    # the rank's shard of it
    (3, Offload.NONE, (4 * P // 4, 4 * P // 4, 8 * P // 4), 0),
    (3, Offload.OPTIMIZER, (2 * P // 4, 4 * P // 4, 0), 16 * P // 4),
    (3, Offload.PARAMS, (0, 0, 0), 16 * P // 4),               # FSDP2 CPUOffloadPolicy: everything on the host
])
def test_offload_moves_state_to_the_host(zero: int, offload: Offload, device: tuple[int, ...], host: int) -> None:
    state = model_state_bytes(P, zero_stage=zero, dp=4, offload=offload)
    assert (state.params, state.grads, state.optimizer, state.host) == (*device, host)
    assert state.total + state.host >= model_state_bytes(P, zero_stage=zero, dp=4).total - 2 * P


def test_parameter_offload_needs_zero3() -> None:
    with pytest.raises(ValueError, match="needs zero_stage 3"):
        model_state_bytes(P, zero_stage=1, dp=4, offload=Offload.PARAMS)
    with pytest.raises(ValueError, match="offload=params .* needs zero_stage 3, got 2; use offload=optimizer"):
        Strategy(dp=2, zero_stage=2, runtime=_runtime("params"))
    with pytest.raises(ValueError, match="offload must be one of none, optimizer, params"):
        RuntimeOptions(offload="gpu")


def test_estimate_reports_device_and_host_bytes(chain) -> None:
    cluster = Cluster.parse("1x8xa100-80gb")
    plain = estimate(chain, cluster, Strategy(dp=8, num_microbatches=1))
    off = estimate(chain, cluster, Strategy(dp=8, num_microbatches=1, runtime=_runtime("optimizer")))
    params = chain.graph.param_count
    a, b = plain.stages[0].memory, off.stages[0].memory
    assert a.optimizer == 12 * params and b.optimizer == 0 and b.host == 16 * params
    assert a.total - b.total == 12 * params and off.fits
    assert b.to_dict()["host"] == b.host and "host" not in a.to_dict()  # plan JSON: only when offloaded


# ---- time -----------------------------------------------------------------------------------------------------

def test_optimizer_offload_tail_is_the_copies_and_the_cpu_step(chain) -> None:
    cluster = Cluster.parse("1x8xa100-80gb")
    host = host_of("a100-80gb")
    for zero in (0, 1):
        est = estimate(chain, cluster, Strategy(dp=8, num_microbatches=1, zero_stage=zero,
                                                runtime=_runtime("optimizer")))
        local = chain.graph.param_count if zero == 0 else -(-chain.graph.param_count // 8)
        d2h, h2d = 4 * local / host.device_to_host_bandwidth, 2 * local / host.host_to_device_bandwidth
        assert est.breakdown.offload_s == pytest.approx(d2h + h2d, rel=1e-9)
        assert est.breakdown.optimizer_s == pytest.approx(local / host.adam_params_per_s, rel=1e-9)
        assert est.breakdown.total_s == pytest.approx(est.step_time_s, rel=1e-12)
    tail = offload_tail(Offload.PARAMS, local, host, weight_bytes=2)
    assert (tail.d2h_s, tail.h2d_s, tail.cpu_step_s) == (0.0, 0.0, local / host.adam_params_per_s)


def test_parameter_offload_copies_join_the_prefetched_gathers() -> None:
    cluster = Cluster.parse("1x8xa100-80gb")
    group = CommGroup(size=8, stride=1)
    grad, param, n, fwd, bwd = 4e8, 2e8, 4, 0.05, 0.1
    copies = HostCopy(h2d_s=0.004, d2h_s=0.004, blocking=False)
    base = data_parallel_comm(zero_stage=3, grad_bytes=grad, param_bytes=param, num_segments=n, fwd_window_s=fwd,
                              bwd_window_s=bwd, group=group, cluster=cluster)
    off = data_parallel_comm(zero_stage=3, grad_bytes=grad, param_bytes=param, num_segments=n, fwd_window_s=fwd,
                             bwd_window_s=bwd, group=group, cluster=cluster, host_copy=copies)

    def t(kind: Collective, nbytes: float) -> float:
        return n * collective_time(kind, nbytes / n, group, cluster)

    gather, reduce = t(Collective.ALL_GATHER, param), t(Collective.REDUCE_SCATTER, grad)
    assert off.per_microbatch_fwd_s == base.per_microbatch_fwd_s  # the copies are kept apart for the breakdown
    assert base.per_microbatch_fwd_s + off.offload_fwd_s == pytest.approx(
        overlapped_exposed(gather + 0.004, fwd, n), rel=1e-12)
    assert base.per_microbatch_bwd_s + off.offload_bwd_s == pytest.approx(
        overlapped_exposed(gather + 0.004 + reduce + 0.004, bwd, n), rel=1e-12)
    # accumulating gradients over micro-batches, FSDP2 copies each one blocking: exposed
    blocking = data_parallel_comm(zero_stage=3, grad_bytes=grad, param_bytes=param, num_segments=n,
                                  fwd_window_s=fwd, bwd_window_s=bwd, group=group, cluster=cluster,
                                  host_copy=replace(copies, blocking=True))
    assert base.per_microbatch_bwd_s + blocking.offload_bwd_s == pytest.approx(
        overlapped_exposed(gather + 0.004 + reduce, bwd, n) + 0.004, rel=1e-12)


def test_offload_is_never_faster_when_the_plan_fits(chain) -> None:
    cluster = Cluster.parse("1x8xa100-80gb")
    for zero, offloads in ((0, ("optimizer",)), (3, ("optimizer", "params"))):
        for m in (1, 4):
            base = estimate(chain, cluster, Strategy(dp=8, num_microbatches=m, zero_stage=zero))
            for offload in offloads:
                est = estimate(chain, cluster, Strategy(dp=8, num_microbatches=m, zero_stage=zero,
                                                        runtime=_runtime(offload)))
                assert est.step_time_s > base.step_time_s and est.breakdown.offload_s + est.breakdown.optimizer_s > 0


def test_host_memory_and_host_data_are_checked() -> None:
    host = host_of("a100-40gb")
    assert host_problem(Offload.OPTIMIZER, "a100-40gb", host, host.host_memory_bytes, 0) == ""
    why = host_problem(Offload.OPTIMIZER, "a100-40gb", host, host.host_memory_bytes + 1, 3)
    assert why.startswith("stage 3 offloads") and f"{host.host_memory_bytes / GIB:.1f} GiB host memory" in why
    assert "no host link data for tpu-v4" in host_problem(Offload.PARAMS, "tpu-v4", None, 1, 0)
    assert host_problem(Offload.NONE, "tpu-v4", None, 1, 0) == ""


# ---- search ---------------------------------------------------------------------------------------------------

def test_fix_offload_is_parsed_and_checked() -> None:
    assert SearchSpace.from_fixes(["offload=optimizer"]).offload is Offload.OPTIMIZER
    assert SearchSpace(runtime=_runtime("params")).offload is Offload.PARAMS  # a runtime offload pins it
    with pytest.raises(ValueError, match="--fix offload=gpu: valid: none, optimizer, params"):
        SearchSpace.from_fixes(["offload=gpu"])
    with pytest.raises(ValueError, match="needs zero=3, not zero=1"):
        SearchSpace.from_fixes(["offload=params", "zero=1"])


def test_the_search_offloads_only_when_memory_binds(tmp_path: Path) -> None:
    import test_search_bruteforce as brute

    from planner.errors import InfeasibleError
    from planner.search.branch_and_bound import search

    chain = brute.chain_of("gpt", brute.GPT_MEMORY)
    space = SearchSpace(max_microbatch_size=2, max_virtual_stages=2, pp=1, tp=1)
    chosen = {}
    for memory, zero in (("1.06GB", 3), ("1.15GB", 3), ("1.2GB", 3), ("1.2GB", 0)):
        result = search(chain, brute.small_memory(tmp_path, memory), global_batch=8,
                        space=space.with_changes(zero_stage=zero))
        chosen[memory, zero] = result.best.strategy.runtime.offload
    assert chosen == {("1.06GB", 3): Offload.PARAMS, ("1.15GB", 3): Offload.OPTIMIZER, ("1.2GB", 3): Offload.NONE,
                      ("1.2GB", 0): Offload.OPTIMIZER}
    with pytest.raises(InfeasibleError, match="nothing fits"):
        search(chain, brute.small_memory(tmp_path, "1.2GB"), global_batch=8,
               space=space.with_changes(zero_stage=0, offload=Offload.NONE))


# ---- runtime --------------------------------------------------------------------------------------------------

def test_fully_shard_gets_the_cpu_offload_policy_only_when_planned() -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    from planner.runtime.apply_fsdp import fsdp_kwargs

    assert fsdp_kwargs(3, reshard_after_forward=True, offload=Offload.NONE, device_type="cuda") == {
        "reshard_after_forward": True}
    kwargs = fsdp_kwargs(3, reshard_after_forward=False, offload=Offload.PARAMS, device_type="cuda")
    assert kwargs["reshard_after_forward"] is False and kwargs["offload_policy"] == CPUOffloadPolicy(pin_memory=True)
    assert fsdp_kwargs(3, reshard_after_forward=True, offload=Offload.PARAMS, device_type="cpu")[
        "offload_policy"] == CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    with pytest.raises(ValueError, match="no FSDP2 form"):
        fsdp_kwargs(1, reshard_after_forward=True, offload=Offload.OPTIMIZER, device_type="cuda")


def test_the_runtime_refuses_what_it_cannot_run() -> None:
    from planner.runtime.parallelize import runtime_unsupported

    assert "export the plan to DeepSpeed or Megatron-LM" in runtime_unsupported(
        Strategy(dp=2, zero_stage=1, runtime=_runtime("optimizer")))
    assert runtime_unsupported(Strategy(dp=2, zero_stage=3, runtime=_runtime("params"))) == ""


# ---- plan JSON ------------------------------------------------------------------------------------------------

def test_runtime_json_carries_offload_only_when_set() -> None:
    assert "offload" not in RuntimeOptions().to_dict()
    assert RuntimeOptions.from_dict({"offload": "params"}).offload is Offload.PARAMS
    s = Strategy(dp=2, zero_stage=3, runtime=_runtime("params"))
    assert Strategy.from_dict(s.to_dict()) == s and s.to_dict()["runtime"]["offload"] == "params"


def test_state_the_host_cannot_hold_does_not_fit_and_keeps_the_memory_slope() -> None:
    from costmodel.breakdown import MemoryBreakdown
    from costmodel.offload import HOST_OVERFLOW_BYTES, bytes_to_fit

    host = host_of("h100-sxm").host_memory_bytes

    def mem(activations: int, offloaded: int) -> MemoryBreakdown:
        return MemoryBreakdown(params=10**9, grads=0, optimizer=0, activations=activations, temporary=0,
                               overhead=0, host=offloaded)

    assert bytes_to_fit(mem(5, host), Offload.OPTIMIZER, "h100-sxm") == 10**9 + 5
    over = [bytes_to_fit(mem(a, host + 1), Offload.OPTIMIZER, "h100-sxm") for a in (0, 123_456_789)]
    assert over[0] == 10**9 + HOST_OVERFLOW_BYTES and abs(over[1] - over[0] - 123_456_789) <= 256


def test_cli_estimate_offload_prints_and_writes_what_is_offloaded() -> None:
    import json
    import subprocess

    argv = [sys.executable, "-m", "planner.cli.main", "estimate", "gpt-tiny", "--cluster", "1x8xa100-80gb",
            "--batch", "16", "--tp", "1", "--pp", "1", "--dp", "8", "--mbs", "2", "--zero", "3", "--offload", "params"]
    out = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["strategy"]["runtime"]["offload"] == "params"
    assert plan["predicted"]["breakdown"]["offload_s"] > 0 and plan["predicted"]["stages"][0]["memory"]["host"] > 0
    assert plan["predicted"]["stages"][0]["memory"]["optimizer"] == 0
    text = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO).stdout
    assert "runtime: data-parallel overlap on, reshard after forward, offload params" in text
    assert "offload: parameters, gradients and optimizer state (FSDP2 CPUOffloadPolicy) in host memory" in text
