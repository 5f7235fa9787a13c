"""`plot_plan`: a real, non-trivial picture (PNG signature, dimensions, many colours), a clear error for an unknown
image type, and a one-line install hint when matplotlib is missing."""

from __future__ import annotations

import sys

import pytest
from plan_factory import make_plan

from costmodel.strategy import Recompute, Schedule
from planner.errors import UserError

pytest.importorskip("matplotlib")

from planner.reports.plot import KIND_COLORS, plot_plan  # noqa: E402


def _pixels(path):
    from matplotlib.image import imread

    return imread(path)


def test_png_is_produced_and_not_trivial(tmp_path):
    plan = make_plan(schedule=Schedule.INTERLEAVED, v=2, p2p_s=0.002, recompute=Recompute.SELECTIVE,
                     recompute_frac=0.05, memory_gib=[70, 60, 50, 85])
    path = tmp_path / "plan.png"
    plot_plan(plan, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000
    img = _pixels(path)
    assert img.shape[:2] == (750, 1200)  # figsize 12 x 7.5 inches at 100 dpi
    colours = {tuple(px) for px in (img[::5, ::5, :3] * 255).round().astype(int).reshape(-1, 3)}
    assert len(colours) > 20
    # The event colours are drawn: forward (blue) and backward (green) bars are in the picture.
    for kind in ("forward", "backward"):
        hexcode = next(c for k, c in KIND_COLORS.items() if k.value == kind)
        rgb = tuple(int(hexcode[i:i + 2], 16) for i in (1, 3, 5))
        assert rgb in colours, kind


def test_svg_by_extension(tmp_path):
    path = tmp_path / "plan.svg"
    plot_plan(make_plan(pp=2, m=4), path)
    assert path.read_text().lstrip().startswith("<?xml") and "<svg" in path.read_text()


def test_unknown_image_type_lists_the_valid_ones(tmp_path):
    with pytest.raises(UserError, match=r"unknown image type 'bmpx'; use one of .*png"):
        plot_plan(make_plan(), tmp_path / "plan.bmpx")
    assert not (tmp_path / "plan.bmpx").exists()


def test_missing_matplotlib_gives_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # makes `import matplotlib.figure` fail
    with pytest.raises(UserError, match=r"needs matplotlib: pip install matplotlib"):
        plot_plan(make_plan(), tmp_path / "plan.png")
