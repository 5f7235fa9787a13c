"""Progress on stderr while planning, drawn with rich: only when stderr is a terminal and the output is not JSON.

One live line per command: the phase (trace, price layer classes, search meshes), candidates priced, the best
step time (or cost) so far, the proven lower bound and the gap, and the elapsed time; `stratagem whatif` adds a
line counting its scenarios. The line is removed when the command ends, so a terminal shows exactly what a pipe would
get, and nothing at all is drawn into pipes, files or CI logs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from planner.progress import Phase, PlanProgress, ProgressCallback

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID


def describe(record: PlanProgress) -> str:
    """The record in one line (without its phase)."""
    if record.phase is Phase.TRACE:
        return "building and tracing the model on the meta device"
    unit = "s" if record.objective == "time" else "per step"
    parts = [f"{record.candidates_priced:,}/{record.candidates_seen:,} candidates priced",
             f"{record.layer_solves:,} layer pricings"]
    if record.best is not None:
        parts.append(f"best {record.best:.4g} {unit}")
    if record.lower_bound is not None and record.lower_bound < float("inf"):
        parts.append(f"bound {min(record.lower_bound, record.best or record.lower_bound):.4g} {unit}")
    if record.gap is not None:
        parts.append(f"gap {100 * record.gap:.1f}%")
    return ", ".join(parts)


@contextmanager
def live(enabled: bool = True, console: Console | None = None) -> Iterator[Progress | None]:
    """A transient rich `Progress` on stderr, or None when disabled or stderr is not a terminal (`console`
    replaces stderr's console, e.g. `Console(force_terminal=True)` in tests)."""
    if not enabled or (console is None and not sys.stderr.isatty()):
        yield None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield None
        return
    # The phase keeps its width and the details give way: a narrow terminal cuts them short, never the phase.
    phase = Column(min_width=max(len(p.value) for p in Phase), no_wrap=True)
    detail = Column(no_wrap=True, overflow="ellipsis")
    columns = (SpinnerColumn(), TextColumn("[bold]{task.description}", table_column=phase),
               TextColumn("{task.fields[detail]}", table_column=detail), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield progress


def search_callback(progress: Progress | None) -> ProgressCallback | None:
    """A `planner.api` progress callback drawing each record on its own task (None without a display)."""
    if progress is None:
        return None
    task: TaskID = progress.add_task("plan", total=None, detail="", start=True)
    shown: Phase | None = None

    def show(record: PlanProgress) -> None:
        nonlocal shown
        # A new phase is drawn at once: a short one (a small model's trace) would otherwise end between two of
        # the display's timed refreshes and never appear.
        new, shown = record.phase is not shown, record.phase
        progress.update(task, description=record.phase.value, detail=describe(record), refresh=new)

    return show


def scenario_callback(progress: Progress | None) -> Callable[[int, int], None] | None:
    """`whatif`'s callback (scenarios done, total) as a line (None without a display)."""
    if progress is None:
        return None
    task: TaskID = progress.add_task("what-if", total=None, detail="")

    def show(done: int, total: int) -> None:
        progress.update(task, detail=f"{done}/{total} scenarios planned")

    return show
