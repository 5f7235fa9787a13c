"""Bad input through the real CLI: every user mistake exits 2 with one line naming the bad value, no traceback.

`BAD_INPUTS` is the table of mistakes; `docs/bad_inputs.md` is generated from it together with what
each one actually prints, and `test_docs_table_is_current` keeps the two equal. Regenerate the docs with

    python tests/test_bad_input.py --write-docs

How the cases run: each case is its own process running the CLI entry point (`planner.cli.main.main`, exactly
what the `stratagem` console script calls) with its own argv, stdout and stderr. Starting a Python process
that imports torch takes seconds on a loaded machine, so one driver process imports the CLI once and then
`fork()`s a child per case (`_run_cases_forked`); an exception escaping `main` in a child prints a traceback
and exits 1, as the interpreter would. `test_forked_driver_matches_console_script` runs a few cases through the
installed `stratagem` script as well and checks that both ways give the same exit code and output.

Every case runs in one scratch folder holding the input files it needs (a valid plan made by a real `stratagem
plan` run, corrupt variants of it, cluster YAML files with mistakes); `test_bad_inputs_write_nothing` checks
that no case created, changed or deleted any file there -- an input is never overwritten and a failed command
leaves no half-written output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "bad_inputs.md"
USER_ERROR = 2


@dataclass(frozen=True)
class BadInput:
    """One mistake: the command line, what is wrong, and what the one-line message must contain."""

    id: str
    what: str
    """The mistake, in words (first column of the docs table)."""
    argv: tuple[str, ...]
    """Arguments after `stratagem`, run in the scratch folder (`scratch_files` lists its files)."""
    expect: tuple[str, ...]
    """Substrings of the message: the bad value, and the valid choices or the rule it breaks."""


def _case(id: str, what: str, argv: str, *expect: str) -> BadInput:
    return BadInput(id, what, tuple(argv.split()), expect)


# A tiny model keeps tracing and searching cheap; every command line runs against the files of `scratch_files`.
TINY = "gpt-tiny"
BAD_INPUTS: tuple[BadInput, ...] = (
    # ---- model and --set --------------------------------------------------------------------------------------
    _case("unknown-model", "unknown model name", "trace gpt-huge",
          "unknown model 'gpt-huge'", "families: gpt, llama", "presets: ", "gpt3-175b", "package.module:factory"),
    _case("preset-typo", "preset name with a typo", "plan gpt3-175 --cluster 1x8xa100-80gb --batch 8",
          "unknown model 'gpt3-175'", "did you mean gpt3-175b?"),
    _case("factory-import", "package.module:factory that cannot be imported", "trace nosuchpkg.models:build",
          "nosuchpkg.models:build", "cannot import nosuchpkg.models"),
    _case("set-unknown-key", "--set with a key the config does not have", f"trace {TINY} --set layer=2",
          "--set layer", "unknown setting for GPTConfig", "valid keys: attn_impl, bias, dropout", "layers"),
    _case("set-not-int", "--set with a non-integer for an integer field", f"trace {TINY} --set layers=two",
          "--set layers=two", "expected an integer"),
    _case("set-out-of-range", "--set with a value the config rejects", f"trace {TINY} --set layers=0",
          "layers must be a positive integer, got 0"),
    _case("set-layers-typo", "--set depth far past any trained model (a typo), refused before building",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --set layers=100000",
          "100,000 layers is more than the 1,024 the planner traces", "a typo?"),
    _case("seq-past-positions", "--seq far past the model's learned positions",
          "plan bert-tiny --cluster 1x4xcpu --batch 8 --seq 10000000", "seq=10000000 exceeds max_positions=512"),
    _case("set-bad-enum", "--set with a value outside an enum", f"trace {TINY} --set attn_impl=fast",
          "--set attn_impl=fast", "not one of sdpa, math"),
    _case("set-no-equals", "--set without KEY=VALUE", f"trace {TINY} --set layers",
          "--set 'layers'", "expected KEY=VALUE"),
    _case("set-inconsistent", "--set values that contradict each other", f"trace {TINY} --set heads=3",
          "hidden=128", "divisible by heads=3"),
    _case("seq-contradicts-set", "--seq contradicting --set seq", f"trace {TINY} --set seq=32 --seq 16",
          "--seq 16 contradicts --set seq=32"),
    _case("seq-not-applicable", "--seq for a model without a sequence", "trace resnet-tiny --seq 16",
          "resnet-tiny", "--seq does not apply"),
    # ---- cluster --------------------------------------------------------------------------------------------------
    _case("cluster-malformed", "cluster shorthand missing its device", f"plan {TINY} --cluster 1x4 --batch 8",
          "bad cluster spec '1x4'", "expected NODESxGPUSxDEVICE", "devices: v100-32gb", "cpu"),
    _case("cluster-zero-nodes", "cluster shorthand with 0 nodes", f"plan {TINY} --cluster 0x8xa100-80gb --batch 8",
          "'0x8xa100-80gb'", "NODES and GPUS must be at least 1"),
    _case("cluster-unknown-device", "unknown device type in the shorthand",
          f"plan {TINY} --cluster 2x8xh900 --batch 8",
          "unknown device 'h900'", "valid devices: v100-32gb", "h100-sxm"),
    _case("cluster-huge", "absurdly large cluster", f"plan {TINY} --cluster 99999999999x8xa100-80gb --batch 8",
          "799,999,999,992 devices", "at most 1,048,576"),
    _case("yaml-missing", "cluster YAML file that does not exist", f"plan {TINY} --cluster missing.yaml --batch 8",
          "missing.yaml", "not found"),
    _case("yaml-syntax", "cluster YAML that is not valid YAML", f"plan {TINY} --cluster syntax.yaml --batch 8",
          "syntax.yaml", "not valid YAML at line 3"),
    _case("yaml-empty", "empty cluster YAML", f"plan {TINY} --cluster empty.yaml --batch 8",
          "expected a mapping with keys name, groups, tiers"),
    _case("yaml-unknown-group-key", "unknown key in a device group (with its path)",
          f"plan {TINY} --cluster group-key.yaml --batch 8",
          "groups[0]: unknown key 'gpus'", "valid keys: name, device, num_nodes, devices_per_node"),
    _case("yaml-unknown-tier-key", "misspelled key in a network tier (with its path)",
          f"plan {TINY} --cluster tier-key.yaml --batch 8",
          "tiers[1]: unknown key 'bandwith'", "valid keys: name, size, bandwidth"),
    _case("yaml-unknown-device", "unknown device type in the YAML", f"plan {TINY} --cluster device.yaml --batch 8",
          "groups[0].device: unknown device 'h900'", "valid devices: v100-32gb"),
    _case("yaml-bad-quantity", "bandwidth that is not a quantity", f"plan {TINY} --cluster quantity.yaml --batch 8",
          "tiers[1].bandwidth", "'fast'", "such as '400Gbps', '50GB/s'"),
    _case("yaml-negative-price", "negative price", f"plan {TINY} --cluster price.yaml --batch 8",
          "groups[0].price_per_device_hour", "got -1"),
    _case("yaml-expert-imbalance", "expert imbalance below 1 (the busiest rank cannot get less than the mean)",
          f"plan {TINY} --cluster imbalance.yaml --batch 8", "expert_imbalance", "[1, 100]", "got 0.5"),
    # ---- search space ---------------------------------------------------------------------------------------------
    _case("fix-tp-not-dividing", "--fix tp that does not divide the devices",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix tp=3", "tp=3", "4 devices"),
    _case("fix-dp-not-dividing-batch", "--fix dp that does not divide the batch",
          f"plan {TINY} --cluster 1x4xcpu --batch 6 --fix dp=4", "dp=4", "divide", "global batch 6"),
    _case("fix-unknown-key", "--fix with an unknown dimension", f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix tensor=2",
          "unknown key 'tensor'", "valid: dp, tp, pp"),
    _case("fix-bad-zero", "--fix zero outside 0..3", f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix zero=4",
          "--fix zero=4", "valid: 0, 1, 2, 3"),
    _case("fix-bad-schedule", "--fix with an unknown schedule",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix schedule=zigzag",
          "schedule=zigzag", "valid: gpipe, 1f1b, interleaved:V, interleaved-zb[:V], zbv, dualpipev"),
    _case("fix-bad-offload", "--fix offload with an unknown value",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix offload=gpu", "--fix offload=gpu",
          "valid: none, optimizer, params"),
    _case("fix-offload-params-zero1", "--fix offload=params with a ZeRO stage that does not shard the parameters",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix offload=params --fix zero=1", "offload=params",
          "needs zero=3", "offload=optimizer"),
    _case("fix-contradiction", "--fix pins that contradict each other",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --fix tp=2 --fix tp=4", "tp=4", "contradicts"),
    _case("batch-zero", "--batch 0", f"plan {TINY} --cluster 1x4xcpu --batch 0",
          "--batch", "expected a positive integer, got 0"),
    _case("estimate-batch-not-dividing", "batch that dp x micro-batch does not divide",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 1 --dp 3 --mbs 1",
          "--batch 8 is not a multiple of dp*mbs = 3*1 = 3"),
    _case("estimate-offload-params-zero0", "--offload params without --zero 3",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 1 --dp 4 --mbs 2 --offload params",
          "offload=params", "needs zero_stage 3", "offload=optimizer"),
    _case("estimate-too-many-devices", "strategy needing more devices than the cluster has",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 8 --pp 1 --dp 1 --mbs 8",
          "dp*tp*pp*cp = 1*8*1*1 = 8 devices", "the cluster has 4 available"),
    _case("estimate-cp-short-sequence", "context parallelism that leaves too few tokens per rank",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 1 --dp 2 --cp 2 --mbs 4",
          "cp=2:", "tokens per rank, fewer than 1024"),
    _case("estimate-ep-dense-model", "expert parallelism on a model without routed experts",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 1 --dp 4 --ep 2 --mbs 2",
          "ep=2: the model has no mixture-of-experts layers"),
    _case("estimate-tp-heads", "tensor parallelism that does not divide the attention heads",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 3 --pp 1 --dp 1 --mbs 8",
          "tp=3 does not divide heads=8"),
    _case("estimate-bad-schedule", "unknown pipeline schedule",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 2 --dp 1 --mbs 8 --schedule zigzag",
          "unknown schedule 'zigzag'", "valid: gpipe, 1f1b, interleaved:V, interleaved-zb[:V], zbv, dualpipev"),
    _case("estimate-zero-bubble-recompute", "a zero-bubble schedule with recomputation (its backward runs in two "
          "passes)", f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 2 --dp 1 --mbs 2 --schedule zbv "
          "--recompute full", "the zbv schedule runs without activation recomputation"),
    _case("estimate-zbv-few-microbatches", "zbv with fewer than 2 * pp micro-batches",
          f"estimate {TINY} --cluster 1x4xcpu --batch 8 --tp 1 --pp 2 --dp 1 --mbs 4 --schedule zbv",
          "the zbv schedule needs at least 2 * pp = 4 micro-batches, got 2"),
    _case("nothing-fits", "model that fits no strategy, not even offloading its optimizer (says the least memory "
          "that would)",
          "plan gpt --set layers=6 --set hidden=8192 --set heads=64 --set seq=512 --cluster 1x1xl4 --batch 1",
          "nothing fits in 22.49 GiB per device", "the least memory any strategy needs is 30.54 GiB per device",
          "offload=optimizer"),
    _case("cost-without-prices", "--objective cost on a cluster without prices",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --objective cost",
          "--objective cost needs a price for every device", "price_per_device_hour"),
    _case("time-limit-negative", "negative --time-limit", f"plan {TINY} --cluster 1x4xcpu --batch 8 --time-limit -1",
          "--time-limit", "expected a number of seconds >= 0 (0: no limit), got -1"),
    _case("time-limit-inf", "--time-limit inf (0 is the way to say no limit)",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --time-limit inf", "--time-limit", "(0: no limit), got inf"),
    _case("time-limit-nan", "--time-limit nan", f"plan {TINY} --cluster 1x4xcpu --batch 8 --time-limit nan",
          "--time-limit", "got nan"),
    _case("gap-100", "--gap of 100% or more (a plan is proven within a fraction of the optimum)",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --gap 100", "--gap", "expected a percentage >= 0 and below 100, got 100"),
    _case("gap-negative", "negative --gap", f"plan {TINY} --cluster 1x4xcpu --batch 8 --gap -1", "--gap",
          "expected a percentage >= 0, got -1"),
    # ---- plan files -----------------------------------------------------------------------------------------------
    _case("plan-missing", "plan file that does not exist", "explain nosuch.json", "plan file nosuch.json does not exist"),
    _case("plan-corrupt", "plan file that is not JSON", "explain corrupt.json",
          "corrupt.json", "not valid JSON (truncated or corrupt?)"),
    _case("plan-truncated", "plan file cut off after its first lines", "diff plan.json truncated.json",
          "truncated.json", "not valid JSON (truncated or corrupt?)"),
    _case("plan-binary", "plan file that is not text", "explain binary.json", "binary.json", "not text"),
    _case("plan-newer-schema", "plan of a newer schema_version", "explain newer.json",
          "schema_version 3 is newer than this Stratagem reads (2)", "upgrade"),
    _case("plan-unknown-key", "plan with a key this version does not know", "explain unknown-key.json",
          "unknown key(s) in plan: comment", "valid: cluster, model"),
    _case("plan-bad-value", "plan with a value of the wrong kind", "explain bad-value.json",
          "bad-value.json", "dp must be a positive integer, got 'two'"),
    _case("plan-stage-gap", "plan whose stages skip a segment", "explain stage-gap.json",
          "strategy.stages[0] starts at 1", "must start at segment 0"),
    _case("plan-other-model", "plan applied to another model", "run llama-tiny --plan plan.json --nproc 2",
          "the plan is for gpt-tiny with 867,072 parameters but this model has 918,656"),
    _case("plan-other-settings", "plan applied to the same model with other --set values",
          f"run {TINY} --set layers=2 --plan plan.json --nproc 2",
          "the plan is for gpt-tiny", "this model has 470,528", "same --set options"),
    _case("plan-other-world-size", "plan run with another number of processes",
          f"run {TINY} --plan plan.json --nproc 4", "--nproc 4 but the plan needs 2 processes"),
    _case("plan-no-launcher", "multi-process plan run without --nproc", f"run {TINY} --plan plan.json",
          "the plan needs 2 processes", "pass --nproc 2"),
    _case("plan-not-runnable", "run a plan priced as another trainer runs it (fused kernels)",
          f"run {TINY} --plan fused.json --nproc 2", "fused kernels", "plan with fused_kernels=false"),
    # ---- outputs --------------------------------------------------------------------------------------------------
    _case("output-missing-folder", "-o into a folder that does not exist",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 -o nosuch/plan.json", "-o nosuch/plan.json", "does not exist"),
    _case("output-is-folder", "-o naming a folder", f"plan {TINY} --cluster 1x4xcpu --batch 8 -o .",
          "-o . is a directory"),
    _case("output-unwritable", "-o where nothing can be written",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 -o /sys/plan.json", "-o /sys/plan.json: not writable"),
    _case("output-is-input", "-o naming the cluster YAML the command reads",
          f"plan {TINY} --cluster cluster.yaml --batch 8 -o cluster.yaml",
          "-o cluster.yaml is an input file", "refusing to overwrite it"),
    _case("output-is-input-via-link", "-o naming a symbolic link to the cluster YAML",
          f"plan {TINY} --cluster cluster.yaml --batch 8 -o cluster-link.yaml",
          "-o cluster-link.yaml is an input file", "refusing to overwrite it"),
    _case("timeline-is-input", "--timeline naming the plan being explained", "explain plan.json --timeline plan.json",
          "--timeline plan.json is an input file", "refusing to overwrite it"),
    _case("outputs-collide", "-o and --timeline naming the same file",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 -o out.json --timeline out.json", "must name different files"),
    _case("replan-output-is-input", "replan -o naming the plan it starts from",
          "replan plan.json --cluster 1x2xcpu -o plan.json", "-o plan.json is an input file", "refusing to overwrite"),
    _case("whatif-unknown-key", "whatif --vary of something that cannot vary",
          f"whatif {TINY} --cluster 1x4xcpu --batch 8 --vary gpus=4,8", "unknown key 'gpus'", "keys: tier.NAME.bandwidth",
          "nodes"),
    # ---- trainers: export, --from, --baseline, report ------------------------------------------------------------
    _case("export-unknown-trainer", "export to a trainer that is not supported", "export plan.json --to nemo",
          "invalid choice: 'nemo'", "torchtitan", "megatron", "deepspeed"),
    _case("export-output-exists", "export -o onto an existing file without --force",
          "export plan.json --to torchtitan -o existing.toml", "-o existing.toml exists", "pass --force"),
    _case("from-no-trainer", "--from without TRAINER:", f"estimate {TINY} --cluster 1x4xcpu --from ok.args",
          "--from 'ok.args'", "expected TRAINER:FILE", "megatron, deepspeed"),
    _case("from-unknown-trainer", "--from of an unknown trainer",
          f"estimate {TINY} --cluster 1x4xcpu --from nemo:ok.args", "unknown trainer", "valid: torchtitan"),
    _case("from-missing-file", "--from a file that does not exist",
          f"estimate {TINY} --cluster 1x4xcpu --from megatron:nosuch.args", "nosuch.args does not exist"),
    _case("from-typo-flag", "--from a Megatron-LM argument file with a misspelled flag",
          f"estimate {TINY} --cluster 1x4xcpu --from megatron:typo.args",
          "--tensor-parallel-size is not an argument of Megatron-LM core_v0.16.1",
          "did you mean --tensor-model-parallel-size?"),
    _case("from-bad-value", "--from a file whose value the trainer's parser rejects",
          f"estimate {TINY} --cluster 1x4xcpu --from megatron:badvalue.args",
          "--tensor-model-parallel-size: invalid int value: '$TP'"),
    _case("from-bad-toml", "--from a torchtitan config that is not TOML",
          f"estimate {TINY} --cluster 1x4xcpu --from torchtitan:corrupt.json", "not valid TOML"),
    _case("from-other-model", "--from a configuration of a model with other layers",
          f"estimate {TINY} --cluster 1x4xcpu --from megatron:layers.args",
          "12 layers, but the model has 4", "--set layers="),
    _case("from-and-flags", "--from together with strategy flags",
          f"estimate {TINY} --cluster 1x4xcpu --from megatron:ok.args --tp 2", "--from sets the strategy; drop --tp"),
    _case("estimate-no-strategy", "estimate with neither the strategy flags nor --from",
          f"estimate {TINY} --cluster 1x4xcpu --tp 1", "required: --batch, --pp, --dp, --mbs", "--from"),
    _case("baseline-other-batch", "--baseline that trains another global batch",
          f"plan {TINY} --cluster 1x4xcpu --batch 8 --baseline megatron:ok.args",
          "trains a global batch of 16, --batch is 8"),
    _case("report-not-html", "report -o with a name that is not .html", "report plan.json -o report.txt",
          "give the page an .html name"),
    # ---- command line ---------------------------------------------------------------------------------------------
    _case("unknown-command", "unknown sub-command", "optimize gpt", "invalid choice: 'optimize'", "plan", "trace"),
    _case("bad-choice", "value outside a flag's choices", "diff plan.json plan.json --format html",
          "invalid choice: 'html'", "'text', 'md', 'json'"),
    _case("missing-required", "required flag left out", f"plan {TINY} --cluster 1x4xcpu",
          "the following arguments are required: --batch"),
    _case("no-command", "no sub-command at all", "", "the following arguments are required: COMMAND"),
    _case("profile-bad-tp", "malformed list of tensor-parallel degrees", "profile --tp 2,x",
          "--tp", "expected comma-separated positive integers, got '2,x'"),
    # ---- FP8 --------------------------------------------------------------------------------------------------
    _case("fp8-no-tensor-cores", "--fp8 on a device without FP8 tensor cores",
          f"plan {TINY} --cluster 1x8xa100-80gb --batch 8 --fp8",
          "--fp8 tensorwise", "a100-80gb has none", "devices with them: h100-sxm, h200"),
    _case("fp8-bad-recipe", "--fix fp8= with an unknown scaling recipe",
          f"plan {TINY} --cluster 1x8xh100-sxm --batch 8 --fix fp8=mxfp8",
          "--fix fp8=mxfp8", "valid: tensorwise, rowwise, delayed, off"),
    _case("fp8-run-on-cpu", "plan with FP8 linear layers run on a machine without CUDA",
          f"run {TINY} --plan fp8.json --nproc 2", "trains linear layers in FP8", "this rank runs on cpu",
          "plan without --fp8"),
)

# Cases also run through the installed `stratagem` script, to check the forked driver is faithful.
CONSOLE_SCRIPT_CASES = ("yaml-unknown-group-key", "plan-newer-schema")


# ---- scratch files ---------------------------------------------------------------------------------------------

_VALID_CLUSTER = """\
name: two-cpus
groups:
  - device: cpu
    num_nodes: 1
    devices_per_node: 2
"""

_GROUP = "groups:\n  - device: cpu\n    num_nodes: 1\n    devices_per_node: 2\n"
_TIERS = "tiers:\n  - name: node\n  - name: cluster\n"


def scratch_files(plan_json: str) -> dict[str, bytes]:
    """File name -> contents of every input the cases read (besides the valid `plan.json`)."""
    plan = json.loads(plan_json)
    newer = {**plan, "schema_version": plan["schema_version"] + 1}
    unknown = {**plan, "comment": "hand-edited"}
    bad_value = json.loads(plan_json)
    bad_value["strategy"]["dp"] = "two"
    stage_gap = json.loads(plan_json)
    stage_gap["strategy"]["stages"][0]["start"] = 1
    fp8 = json.loads(plan_json)
    fp8["strategy"]["runtime"]["fp8"] = "tensorwise"
    fused = json.loads(plan_json)
    fused["strategy"]["runtime"]["fused_kernels"] = True
    texts = {
        "plan.json": plan_json,
        "corrupt.json": "this is not a plan\n",
        # cut off inside its first key, so the JSON error (line, column) does not move when plans grow
        "truncated.json": "\n".join(plan_json.splitlines()[:3]),
        "newer.json": json.dumps(newer, indent=2),
        "unknown-key.json": json.dumps(unknown, indent=2),
        "bad-value.json": json.dumps(bad_value, indent=2),
        "stage-gap.json": json.dumps(stage_gap, indent=2),
        "fp8.json": json.dumps(fp8, indent=2),
        "fused.json": json.dumps(fused, indent=2),
        "cluster.yaml": _VALID_CLUSTER,
        "syntax.yaml": "name: broken\ngroups: [ {device: cpu,\n",
        "empty.yaml": "",
        "group-key.yaml": "name: x\n" + _GROUP + "    gpus: 2\n",
        "tier-key.yaml": "name: x\n" + _GROUP + _TIERS + "    bandwith: 100Gbps\n",
        "device.yaml": "name: x\ngroups:\n  - device: h900\n    num_nodes: 1\n    devices_per_node: 2\n",
        "quantity.yaml": "name: x\n" + _GROUP + _TIERS + "    bandwidth: fast\n",
        "price.yaml": "name: x\n" + _GROUP + "    price_per_device_hour: -1\n",
        "ok.args": "--micro-batch-size 2 --global-batch-size 16\n",
        "typo.args": "--tensor-parallel-size 2\n--micro-batch-size 1\n",
        "badvalue.args": "--tensor-model-parallel-size $TP\n--micro-batch-size 1\n",
        "layers.args": "--num-layers 12\n--micro-batch-size 1\n",
        "existing.toml": "# a hand-written job config\n",
        "imbalance.yaml": "name: x\nexpert_imbalance: 0.5\n" + _GROUP,
    }
    files = {name: text.encode() for name, text in texts.items()}
    files["binary.json"] = b"\xff\xfe\x00\x01 not utf-8"
    return files


def make_valid_plan(folder: Path) -> str:
    """A real two-process plan of the tiny model, written by the real CLI (a positive control: exit 0)."""
    out = folder / "plan.json"
    proc = subprocess.run(
        [sys.executable, "-m", "planner.cli.main", "plan", TINY, "--cluster", "1x4xcpu", "--batch", "8",
         "--fix", "dp=2", "--fix", "tp=1", "--fix", "pp=1", "-o", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    out.unlink()
    return text


LINKS = {"cluster-link.yaml": "cluster.yaml"}
"""Symbolic links in the scratch folder: name -> target."""


def populate(folder: Path, files: Mapping[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).write_bytes(data)
    for name, target in LINKS.items():
        (folder / name).symlink_to(target)


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry of the folder: file contents, or "-> target" for a symbolic link."""
    return {str(p.relative_to(folder)): f"-> {os.readlink(p)}" if p.is_symlink() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


# ---- running the CLI ---------------------------------------------------------------------------------------------

def _driver_main() -> None:
    """`python tests/test_bad_input.py --driver FOLDER`: read [[argv...], ...] as JSON on stdin, run each case
    in a forked child, print [{"rc", "stdout", "stderr"}, ...] as JSON."""
    folder = Path(sys.argv[2])
    cases = json.loads(sys.stdin.read())
    json.dump(_run_cases_forked(cases, folder), sys.stdout)


def _run_cases_forked(cases: Sequence[Sequence[str]], folder: Path) -> list[dict[str, Any]]:
    # Import what the commands use before forking, so that each child pays only for its own work.
    import ortools.sat.python.cp_model  # noqa: F401
    import torch  # noqa: F401

    import models.registry  # noqa: F401
    import planner.api  # noqa: F401
    import planner.cli.main  # noqa: F401

    os.chdir(folder)
    results = []
    for i, argv in enumerate(cases):
        out_path, err_path = folder.parent / f"case{i}.out", folder.parent / f"case{i}.err"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child: the CLI with this argv, its stdout/stderr in files
            _child(list(argv), out_path, err_path)
        _, status = os.waitpid(pid, 0)
        results.append({"rc": os.waitstatus_to_exitcode(status), "stdout": out_path.read_text(errors="replace"),
                        "stderr": err_path.read_text(errors="replace")})
        out_path.unlink()
        err_path.unlink()
    return results


def _child(argv: list[str], out_path: Path, err_path: Path) -> None:
    code = 1
    try:
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
        sys.argv = ["stratagem", *argv]
        from planner.cli.main import main

        code = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # what the interpreter does with an uncaught exception: traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_forked(cases: Sequence[BadInput], folder: Path) -> dict[str, dict[str, Any]]:
    proc = subprocess.run([sys.executable, __file__, "--driver", str(folder)], input=json.dumps(
        [list(c.argv) for c in cases]), cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    return dict(zip((c.id for c in cases), json.loads(proc.stdout), strict=True))


def run_console_script(case: BadInput, folder: Path) -> dict[str, Any]:
    exe = shutil.which("stratagem")
    assert exe is not None, "the stratagem console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, *case.argv], cwd=folder, capture_output=True, text=True, timeout=300, check=False)
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


# ---- tests -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("bad_input")
    folder = root / "work"
    folder.mkdir()
    files = scratch_files(make_valid_plan(root))
    populate(folder, files)
    return folder, files


@pytest.fixture(scope="module")
def outcomes(scratch: tuple[Path, dict[str, bytes]]) -> dict[str, dict[str, Any]]:
    folder, _ = scratch
    return run_forked(BAD_INPUTS, folder)


def test_table_has_25_distinct_mistakes() -> None:
    ids = [c.id for c in BAD_INPUTS]
    assert len(set(ids)) == len(ids) >= 25
    assert len({c.argv for c in BAD_INPUTS}) == len(BAD_INPUTS)
    assert all(c.expect for c in BAD_INPUTS)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.id)
def test_bad_input_is_one_line_exit_2(case: BadInput, outcomes: dict[str, dict[str, Any]]) -> None:
    got = outcomes[case.id]
    stderr = got["stderr"]
    assert "Traceback" not in stderr + got["stdout"], stderr
    assert got["rc"] == USER_ERROR, f"exit {got['rc']}: {stderr}"
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}: {stderr}"
    assert lines[0].startswith("stratagem: error: ")
    assert got["stdout"] == ""
    for part in case.expect:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"


def test_bad_inputs_write_nothing(scratch: tuple[Path, dict[str, bytes]],
                                  outcomes: dict[str, dict[str, Any]]) -> None:
    """No case created, changed or removed a file: inputs are never overwritten, failures leave no output."""
    folder, files = scratch
    assert outcomes  # every case has run
    expected = {**files, **{name: f"-> {target}" for name, target in LINKS.items()}}
    assert snapshot(folder) == dict(sorted(expected.items()))


def test_forked_driver_matches_console_script(scratch: tuple[Path, dict[str, bytes]],
                                              outcomes: dict[str, dict[str, Any]]) -> None:
    folder, _ = scratch
    by_id = {c.id: c for c in BAD_INPUTS}
    for case_id in CONSOLE_SCRIPT_CASES:
        assert run_console_script(by_id[case_id], folder) == outcomes[case_id], case_id


def test_docs_table_is_current(outcomes: dict[str, dict[str, Any]]) -> None:
    expected = render_docs(outcomes)
    assert DOCS.is_file(), "docs/bad_inputs.md is missing: python tests/test_bad_input.py --write-docs"
    assert DOCS.read_text() == expected, (
        "docs/bad_inputs.md is out of date: python tests/test_bad_input.py --write-docs")


# ---- the docs table ---------------------------------------------------------------------------------------------

_DOCS_HEAD = """\
# Bad inputs and what they get

Every mistake below exits with status 2 and prints one line on stderr (never a Python traceback), naming the bad
value and the valid choices or the rule it breaks; nothing is written. The table is generated from
`tests/test_bad_input.py` (`BAD_INPUTS`) with the message each command actually prints, and
`test_docs_table_is_current` fails when the two drift apart: regenerate with
`python tests/test_bad_input.py --write-docs`.

Commands run in a folder holding the files they name: `plan.json` is a valid two-process plan of `gpt-tiny`
(`stratagem plan gpt-tiny --cluster 1x4xcpu --batch 8 --fix dp=2 --fix tp=1 --fix pp=1 -o plan.json`);
`truncated.json`, `newer.json`, `unknown-key.json`, `bad-value.json`, `stage-gap.json`, `corrupt.json` and
`binary.json` are damaged copies; `cluster.yaml` is a valid two-CPU cluster and the other `.yaml` files each hold
one mistake; `ok.args`, `typo.args`, `badvalue.args` and `layers.args` are Megatron-LM argument files (a valid one
and three with a mistake) and `existing.toml` a file that is already there (see `scratch_files` in the test).

| # | mistake | command (`stratagem ...`) | exit | message |
|---|---|---|---|---|
"""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_docs(outcomes: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for i, case in enumerate(BAD_INPUTS, 1):
        got = outcomes[case.id]
        message = got["stderr"].strip().removeprefix("stratagem: error: ")
        command = f"`{_cell(' '.join(case.argv))}`" if case.argv else "(no arguments)"
        rows.append(f"| {i} | {_cell(case.what)} | {command} | {got['rc']} | {_cell(message)} |")
    return _DOCS_HEAD + "\n".join(rows) + "\n"


def _write_docs() -> None:
    import tempfile

    from planner.trace_cache import ENV_VAR

    with tempfile.TemporaryDirectory() as tmp:
        os.environ[ENV_VAR] = str(Path(tmp) / "cache")  # as under pytest (conftest.py): never the user's cache
        folder = Path(tmp) / "work"
        folder.mkdir()
        populate(folder, scratch_files(make_valid_plan(Path(tmp))))
        DOCS.write_text(render_docs(run_forked(BAD_INPUTS, folder)))
    print(f"wrote {DOCS}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        _driver_main()
    elif sys.argv[1:] == ["--write-docs"]:
        _write_docs()
    else:
        sys.exit("usage: python tests/test_bad_input.py --write-docs")
