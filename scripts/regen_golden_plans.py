"""Regenerate the golden plans in plans/ from plans/golden.yaml (run from anywhere):

    python scripts/regen_golden_plans.py            # rewrite every plans/<name>.json
    python scripts/regen_golden_plans.py NAME ...   # only these
    python scripts/regen_golden_plans.py --check    # compare, write nothing; exit 1 and print the diff if stale

Each plan is made by `stratagem plan` itself (the CLI in-process), so a golden plan is exactly what a user gets
(tests/golden.py, shared with tests/test_golden_plans.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from golden import load_manifest, make_plan_json, stale_report  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="plans to regenerate (default: all in plans/golden.yaml)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a plan is stale")
    args = parser.parse_args(argv)
    entries = load_manifest()
    unknown = sorted(set(args.names) - {e.name for e in entries})
    if unknown:
        parser.error(f"unknown plan(s) {unknown}; known: {[e.name for e in entries]}")
    chosen = [e for e in entries if not args.names or e.name in args.names]
    stale = 0
    with tempfile.TemporaryDirectory() as tmp:
        for entry in chosen:
            fresh = make_plan_json(entry, Path(tmp))
            report = stale_report(entry, fresh)
            if args.check:
                if report:
                    stale += 1
                    print(report)
                continue
            if report or not entry.path.is_file():
                entry.path.write_text(fresh)
            print(f"{entry.path.relative_to(ROOT)}: {'updated' if report else 'unchanged'}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
