"""Progress: frozen `PlanProgress` records for the Python API's callback, drawn with rich on stderr by the CLI only
when stderr is a terminal and the output is not JSON; the default time limit and its one-line note."""

from __future__ import annotations

import dataclasses
import io
import sys
from functools import cache

import pytest
import torch
from ir_models import TinyGPT
from rich.console import Console

import planner.api
import planner.search.reporting as reporting
from ir.layer_chain import LayerChain
from planner.cli.common import DEFAULT_TIME_LIMIT_S, time_limit_note, time_limit_s
from planner.cli.main import build_parser, main
from planner.cli.progress import describe, live, search_callback
from planner.progress import Phase, PlanProgress
from planner.tracing import trace_model

PLAN = ["plan", "gpt-tiny", "--cluster", "1x4xcpu", "--batch", "8", "--dtype", "float32"]


@cache
def tiny_chain() -> LayerChain:
    return trace_model("gpt-tiny", dtype="float32").chain


class Terminal(io.StringIO):
    """A stderr that says it is a terminal (what rich checks)."""

    def isatty(self) -> bool:
        return True


def test_api_callback_gets_frozen_records_ending_with_the_proven_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reporting, "INTERVAL_S", 0.0)  # every step, so the test sees each phase
    records: list[PlanProgress] = []
    plan = planner.api.plan(tiny_chain(), None, "1x4xcpu", global_batch=8, dtype="float32", progress=records.append)
    assert records and all(isinstance(r, PlanProgress) for r in records)
    with pytest.raises(dataclasses.FrozenInstanceError):
        records[0].phase = Phase.DONE  # type: ignore[misc]
    assert {Phase.PRICE, Phase.SEARCH} <= {r.phase for r in records}
    last = records[-1]
    assert last.phase is Phase.DONE and [r.phase for r in records].count(Phase.DONE) == 1
    # Proven within the API's default gap of 1%.
    assert last.candidates_priced == plan.search.candidates and 0.0 <= last.gap <= 0.01 / 1.01
    assert last.best == pytest.approx(plan.predicted.step_time_s, rel=0.3)  # the tie rule may pick a simpler one
    for a, b in zip(records, records[1:], strict=False):  # counters and the bound only grow
        assert b.candidates_priced >= a.candidates_priced and b.elapsed_s >= a.elapsed_s
        assert b.lower_bound >= a.lower_bound
    for r in records:
        if r.best is not None and r.lower_bound is not None:
            assert 0.0 <= r.gap <= 1.0 and r.lower_bound <= r.best


def test_records_are_throttled() -> None:
    records: list[PlanProgress] = []
    plan = planner.api.plan(tiny_chain(), None, "1x4xcpu", global_batch=8, dtype="float32", progress=records.append)
    assert 1 <= len(records) <= plan.search.time_s / reporting.INTERVAL_S + 2


def test_tracing_a_module_reports_the_trace_phase() -> None:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, seq=8, hidden=32, layers=2, heads=4)
    records: list[PlanProgress] = []
    planner.api.plan(model, (torch.randint(0, 64, (2, 8)),), "1x2xcpu", global_batch=4, dtype="float32",
                     progress=records.append)
    assert records[0].phase is Phase.TRACE and records[-1].phase is Phase.DONE


def test_gap_and_description() -> None:
    assert PlanProgress(phase=Phase.PRICE, lower_bound=1.0).gap is None  # no plan yet
    assert PlanProgress(phase=Phase.DONE, best=2.0, lower_bound=float("inf")).gap == 0.0  # all explored
    record = PlanProgress(phase=Phase.SEARCH, candidates_priced=12, candidates_seen=340, layer_solves=7, best=2.0,
                          lower_bound=1.8)
    assert record.gap == pytest.approx(0.1)
    assert describe(record) == "12/340 candidates priced, 7 layer pricings, best 2 s, bound 1.8 s, gap 10.0%"
    assert "per step" in describe(dataclasses.replace(record, objective="cost"))
    assert "tracing" in describe(PlanProgress(phase=Phase.TRACE))


def test_display_only_on_a_terminal() -> None:
    with live(console=Console(file=io.StringIO())) as display:  # a file, not a terminal
        assert display is None and search_callback(display) is None
    with live(enabled=False, console=Console(file=Terminal(), force_terminal=True)) as display:  # --json
        assert display is None
    term = Terminal()
    with live(console=Console(file=term, force_terminal=True, width=160)) as display:
        assert display is not None
        show = search_callback(display)
        show(PlanProgress(phase=Phase.SEARCH, candidates_priced=5, candidates_seen=9, best=1.0, lower_bound=0.5))
        display.refresh()
    assert "search meshes" in term.getvalue() and "5/9 candidates priced" in term.getvalue()


def test_cli_draws_on_a_terminal_and_nowhere_else(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(PLAN) == 0  # stderr captured by pytest: not a terminal
    out, err = capsys.readouterr()
    assert err == "" and "search: optimal" in out
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert main([*PLAN, "--json"]) == 0
    assert term.getvalue() == ""  # nothing extra with --json, even on a terminal
    capsys.readouterr()
    monkeypatch.setattr(reporting, "INTERVAL_S", 0.0)
    assert main([*PLAN, "--no-trace-cache"]) == 0
    drawn = term.getvalue()
    assert "trace" in drawn and "candidates priced" in drawn and "done" in drawn
    out, _ = capsys.readouterr()
    assert "layer pricings" not in out and "\x1b" not in out  # the display never reaches stdout


@pytest.mark.parametrize("command", [["plan", "gpt", "--cluster", "1x1xcpu", "--batch", "1"],
                                     ["replan", "p.json", "--cluster", "1x1xcpu"],
                                     ["whatif", "gpt", "--batch", "1", "--vary", "nodes=1,2"]])
def test_search_commands_default_to_a_minute(command: list[str]) -> None:
    args = build_parser().parse_args(command)
    assert args.time_limit == DEFAULT_TIME_LIMIT_S == 60.0 and time_limit_s(args) == 60.0
    assert time_limit_s(build_parser().parse_args([*command, "--time-limit", "0"])) is None
    assert time_limit_s(build_parser().parse_args([*command, "--time-limit", "2.5"])) == 2.5


def test_time_limit_note_is_one_line() -> None:
    assert time_limit_note(False, 0.0, 60.0) is None and time_limit_note(True, 0.1, None) is None
    note = time_limit_note(True, 0.034, 60.0)
    assert note == ("stratagem: note: time limit of 60 s reached; the plan is the best found, proven within 3.4% "
                    "of the optimum (--time-limit 0 searches to the end)")
