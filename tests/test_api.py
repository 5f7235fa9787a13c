"""The Python API: what `planner` exports, the API and the CLI planning alike, and the round trip a user makes with
a module of their own -- `planner.api.plan` from example inputs, then `planner.parallelize` under torchrun -- for
dp, tp, pp and tp x pp plans, matching a single-process run (tests/dist/api_round_trip.py); and the README's
"Python API" example, run as written.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import planner
import planner.api
from costmodel.hardware.collective_fit import CollectiveProfile, CollectiveSample
from costmodel.hardware.collectives import Collective
from costmodel.profile_db import OpProfile
from models.registry import build_model
from planner.cli.main import main
from planner.plan import Plan
from planner.tracing import trace_one_sample

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "dist" / "api_round_trip.py"
sys.path.insert(0, str(WORKER.parent))

import api_round_trip as worker  # noqa: E402  (the worker's model and configs)

LOSS_RTOL = 1e-4


# ---- names ------------------------------------------------------------------------------------------------------

def test_no_submodule_name_is_rebound():
    import planner.plan as plan_module

    assert isinstance(plan_module, types.ModuleType) and plan_module.Plan is Plan
    shadowed = []
    packages = [importlib.import_module(name) for name in ("ir", "costmodel", "planner", "models")]
    for info in (i for p in packages for i in pkgutil.walk_packages(p.__path__, f"{p.__name__}.")):
        module = importlib.import_module(info.name)
        parent_name, _, child = info.name.rpartition(".")
        if getattr(sys.modules[parent_name], child) is not module:
            shadowed.append(info.name)
    assert not shadowed, f"package attributes hide these submodules: {shadowed}"
    assert callable(planner.parallelize) and callable(planner.train_step)  # runtime's functions, not modules


# ---- the API and the CLI agree ------------------------------------------------------------------------------------

def _slow_link_profile() -> OpProfile:
    """Measured collectives on a link far slower than the catalog's CPU node: calibration changes the plan's
    prediction."""
    samples = [CollectiveSample(kind, n, float(s), 2e-3 * (n - 1) + s / 5e7)
               for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
               for n in (2, 4) for s in (4096, 1 << 20, 1 << 22)]
    return OpProfile(collectives=CollectiveProfile.from_samples(samples))


def test_api_with_a_profile_plans_what_the_cli_does(tmp_path, capsys):
    path = tmp_path / "profile.json"
    _slow_link_profile().save(path)
    argv = ["plan", "gpt-tiny", "--cluster", "1x4xcpu", "--batch", "8", "--dtype", "float32", "--json"]
    assert main([*argv, "--profile", str(path)]) == 0
    cli = Plan.from_json(capsys.readouterr().out)
    built = build_model("gpt-tiny", batch=8)
    api = planner.api.plan(built.module, built.example_inputs, "1x4xcpu", global_batch=8, dtype="float32",
                           profile=planner.api.load_profile(str(path)), model_name="gpt-tiny")
    assert api.strategy == cli.strategy and api.sharding == cli.sharding
    assert api.predicted == cli.predicted and api.cluster == cli.cluster
    assert api.model.fingerprint == cli.model.fingerprint
    plain = planner.api.plan(built.module, built.example_inputs, "1x4xcpu", global_batch=8, dtype="float32")
    assert plain.predicted.step_time_s != api.predicted.step_time_s  # the calibration is applied


def test_a_module_is_traced_at_one_sample_whatever_the_example_batch():
    torch.manual_seed(0)
    model = worker.TinyLM()
    ids = torch.randint(0, worker.VOCAB, (8, worker.SEQ))
    chains = [trace_one_sample(model, (ids[:b],)) for b in (1, 3, 8)]
    assert len({c.graph.batch_size for c in chains}) == 1 and chains[0].graph.batch_size == 1
    prints = {planner.api.plan(model, (ids[:b],), "1x2xcpu", global_batch=8, dtype="float32").model.fingerprint
              for b in (2, 8)}
    assert len(prints) == 1


# ---- the round trip under torchrun ----------------------------------------------------------------------------------

def _torchrun(nproc: int, args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp)


def _round_trip(nproc: int, configs: tuple[str, ...], tmp: Path) -> dict[str, Any]:
    out = tmp / f"round_trip_{nproc}.json"
    proc = _torchrun(nproc, [str(WORKER), str(out), *configs], tmp)
    assert proc.returncode == 0 and out.exists(), f"torchrun failed:\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_plan_then_parallelize_a_users_module_matches_one_process(tmp_path):
    results = {**_round_trip(2, ("dp2", "tp2", "pp2"), tmp_path), **_round_trip(4, ("tp2_pp2",), tmp_path)}
    degrees = {"dp2": (2, 1, 1), "tp2": (1, 2, 1), "pp2": (1, 1, 2), "tp2_pp2": (1, 2, 2)}
    for name, per_rank in results.items():
        errors = [r["error"] for r in per_rank if "error" in r]
        assert not errors, f"{name}: {errors[0]}"
        first = per_rank[0]
        s = first["strategy"]
        assert (s["dp"], s["tp"], s["pp"]) == degrees[name] and s["stages"] == s["pp"]
        for rank in per_rank:
            assert rank["losses"] == pytest.approx(first["ref_losses"], rel=LOSS_RTOL), name


# ---- the README's example ---------------------------------------------------------------------------------------

TEARDOWN_ABORT = "terminate called without an active exception"


def readme_example() -> str:
    """The first Python block of the README's "Python API" section."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_readme_python_api_example_trains_under_torchrun(tmp_path):
    script = tmp_path / "train_tiny_lm.py"
    script.write_text(readme_example())
    proc = _torchrun(2, [str(script)], tmp_path)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr and "step 2: loss" in proc.stdout:
        # Known, not understood: about 1 run in 13 here, a rank aborts at exit after training and
        # destroy_process_group (C++ std::terminate of a thread still joinable). One more run; twice fails.
        proc = _torchrun(2, [str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 3 and all(0 < loss < 10 for loss in losses), proc.stdout
