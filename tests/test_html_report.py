"""`stratagem report`: the self-contained HTML page, parsed back and checked against the plan JSON."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from planner.cli.main import main
from planner.plan import Plan
from planner.reports.html import render_html
from planner.reports.timeline import build_timeline

REPO = Path(__file__).resolve().parents[1]
PIPELINED = REPO / "plans" / "llama-tiny-pp4-1x8xh100.json"
OTHER = REPO / "plans" / "gpt-tiny-1x4xcpu.json"
SECTIONS = ("summary", "mesh", "stages", "memory", "breakdown", "timeline", "alternatives")


class Page(HTMLParser):
    """Tags with their attributes, in document order, and the text of the page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def find(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items())]


@pytest.fixture(scope="module")
def page() -> tuple[Plan, Page, str]:
    plan = Plan.load(PIPELINED)
    html = render_html(plan)
    return plan, Page(html), html


def test_page_is_self_contained(page) -> None:
    _, parsed, html = page
    assert not parsed.find("script") and not parsed.find("link") and not parsed.find("img")
    urls = [v for _, a in parsed.tags for k, v in a.items() if k in ("src", "href")]
    assert urls == []
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html


def test_sections_and_charts(page) -> None:
    _, parsed, _ = page
    assert [a["id"] for a in parsed.find("section")] == list(SECTIONS)
    labels = [a["aria-label"] for a in parsed.find("svg")]
    assert any("device mesh" in x for x in labels) and any("timeline" in x for x in labels)
    assert any("memory per stage" in x for x in labels) and any("breakdown" in x for x in labels)


def test_numbers_come_from_the_plan(page) -> None:
    plan, parsed, _ = page
    cards = {a["data-key"]: a["data-value"] for a in parsed.find("div", **{"class": "card"})}
    p = plan.predicted
    assert float(cards["step_time_s"]) == p.step_time_s
    assert float(cards["mfu"]) == p.mfu
    assert int(cards["peak_memory_bytes"]) == max(p.peak_memory_bytes)
    assert int(cards["devices"]) == plan.strategy.num_devices == 8
    assert int(cards["global_batch"]) == plan.training.global_batch
    rows = parsed.find("tr")
    assert [a["data-stage"] for a in rows if "data-stage" in a] == ["0", "1", "2", "3"]
    cells = [a for a in parsed.find("td", **{"class": "n"}) if "data-value" in a]
    assert float(cells[0]["data-value"]) == p.stages[0].fwd_s
    bars = {a["data-key"]: float(a["data-value"]) for a in parsed.find("rect") if "data-key" in a
            and a["data-key"].endswith("_s")}
    scale = 1e3  # the breakdown of a millisecond step is drawn in ms
    for key, seconds in p.breakdown.to_dict().items():
        if seconds > 0:
            assert bars[key] == pytest.approx(seconds * scale)


def test_mesh_and_timeline_pictures(page) -> None:
    plan, parsed, _ = page
    cells = [a for a in parsed.find("rect") if "data-rank" in a]
    assert len(cells) == plan.strategy.num_devices
    # pp is the outermost axis: ranks 0-1 are stage 0, ranks 6-7 stage 3
    assert [c["data-stage"] for c in cells] == ["0", "0", "1", "1", "2", "2", "3", "3"]
    drawn = [a for a in parsed.find("rect") if a.get("data-kind") in ("forward", "backward")]
    events = [e for e in build_timeline(plan).events if e.kind.value in ("forward", "backward")]
    assert len(drawn) == len(events) == 2 * plan.strategy.pp * plan.strategy.num_microbatches


def test_compare_shows_the_diff() -> None:
    html = render_html(Plan.load(PIPELINED), compare=Plan.load(OTHER), compare_label="old.json",
                       plan_label="new.json")
    parsed = Page(html)
    assert parsed.find("section", id="compare")
    verdict = parsed.find("p", **{"data-key": "step_time_change"})[0]
    old, new = Plan.load(OTHER).predicted.step_time_s, Plan.load(PIPELINED).predicted.step_time_s
    assert float(verdict["data-value"]) == pytest.approx(new / old - 1)
    assert any(a.get("data-section") == "strategy" for a in parsed.find("tr"))


def test_cli_report_writes_once(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.html"
    assert main(["report", str(PIPELINED), "--compare", str(OTHER), "-o", str(out)]) == 0
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert main(["report", str(PIPELINED), "-o", str(out)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert main(["report", str(PIPELINED), "-o", str(out), "--force"]) == 0
    assert 'id="compare"' not in out.read_text()
    assert json.loads(PIPELINED.read_text())["schema_version"] == 2
