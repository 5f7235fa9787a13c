"""Render an HTML plan report to a PNG with headless Chromium (Debian: `apt-get install -y chromium`).

    python scripts/render_report_png.py plan.html docs/report.png [--width 1200] [--height 2600]

Used for the picture in the docs (docs/report.png, from the gpt3-1.3b golden plan compared with a pipelined
estimate). The page is local and has no script, so the screenshot is what a reader sees offline.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def render(html: Path, png: Path, width: int, height: int) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        sys.exit("no chromium on PATH (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:
        cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}",
               f"--window-size={width},{height}", f"--screenshot={png.resolve()}", html.resolve().as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 or not png.is_file():
        sys.exit(f"chromium failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    try:  # a 256-colour palette keeps the docs picture small; the page has few colours anyway
        from PIL import Image

        Image.open(png).convert("RGB").quantize(colors=256).save(png, optimize=True)
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("html", type=Path)
    ap.add_argument("png", type=Path)
    ap.add_argument("--width", type=int, default=1200)
    ap.add_argument("--height", type=int, default=2600)
    args = ap.parse_args(argv)
    render(args.html, args.png, args.width, args.height)
    print(f"wrote {args.png} ({args.png.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
