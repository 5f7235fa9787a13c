"""Every test runs hermetic: the trace cache (`planner.trace_cache`) lives in a temporary folder, never in the
user's cache folder, for the test process and for every CLI process it starts (they inherit the environment).

The session's folder is set first, so that module- and session-scoped fixtures that run the CLI use it too; each
test then gets a fresh folder of its own, so no test sees what another traced.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from planner.trace_cache import ENV_VAR


@pytest.fixture(autouse=True, scope="session")
def _session_trace_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    folder = tmp_path_factory.mktemp("stratagem-cache-session")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_VAR, str(folder))
        yield folder


@pytest.fixture(autouse=True)
def _trace_cache_in_tmp(_session_trace_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                        monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path_factory.mktemp("stratagem-cache")
    monkeypatch.setenv(ENV_VAR, str(folder))
    return folder
