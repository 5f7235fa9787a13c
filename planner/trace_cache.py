"""The trace cache: a model's traced `LayerChain`, stored once per model configuration, so that planning the same
model again (another cluster or batch, `stratagem replan` after a straggler) skips building and tracing it.

Where: `--trace-cache DIR` (the CLI; `TraceCache(Path(DIR))` in Python), else `$STRATAGEM_CACHE_DIR/traces`,
else `traces/` in the platform's cache folder (`default_cache_root`).

Key: everything that changes the graph -- the MODEL string, the `--set` values as given, `--seq`, the training
dtype, a digest of the code that builds and traces it (the model zoo and `ir/` sources; for `hf:path/config.json`
also the file's bytes) and the versions of torch, transformers (for `hf:` models), Stratagem and this entry
format. The file name is a digest of the first four only, so a configuration has one file however often the code
or the versions change: an entry written by other code is *stale*, ignored and overwritten. User factories
(`package.module:factory`) are never cached: their code may depend on anything.

An entry is one line of header JSON (format, key, model name, settings, graph fingerprint, sha256 of the rest)
and the chain's own JSON (`LayerChain.to_json`). Nothing is unpickled: a loaded entry is parsed as JSON, its
checksum compared, and the decoded chain's fingerprint (`ir.fingerprint`) compared with the header's. An entry
that fails any check, or cannot be read, is ignored with a one-line note and rewritten by the next trace. Writes
go to a temporary file in the same folder, then `os.replace`: two plans racing never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata, util
from pathlib import Path
from typing import Any

import ir
from ir.layer_chain import LayerChain

ENV_VAR = "STRATAGEM_CACHE_DIR"
"""Environment variable naming the root of Stratagem's caches (traces go in its `traces/` folder)."""
ENTRY_FORMAT = "stratagem-trace-cache/1"
"""Bump when the header or the layout of an entry changes; older entries then read as stale."""
HF_PREFIX = "hf:"


def _stderr_note(text: str) -> None:
    print(f"stratagem: note: {text}", file=sys.stderr)


@dataclass(frozen=True)
class TraceKey:
    """What a cached trace was made from; two equal keys always trace to the same graph."""

    model: str
    sets: tuple[str, ...]
    """The `--set KEY=VALUE` strings, sorted: their order does not matter (the registry rejects a key given
    twice)."""
    seq: int | None
    dtype: str
    sources: str
    """sha256 of the code (and config file) that builds and traces the model."""
    versions: tuple[tuple[str, str], ...]
    """(package, version) of everything else the graph depends on, and the entry format."""

    def file_name(self) -> str:
        """One file per model configuration (module docstring): the code and versions are checked inside it."""
        what = json.dumps([self.model, list(self.sets), self.seq, self.dtype])
        return hashlib.sha256(what.encode()).hexdigest()[:32] + ".json"

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "sets": list(self.sets), "seq": self.seq, "dtype": self.dtype,
                "sources": self.sources, "versions": [list(v) for v in self.versions]}


@dataclass(frozen=True)
class TracedModel:
    """A model traced at one sample (`planner.tracing`), with what the plan records about how it was built."""

    name: str
    settings: tuple[tuple[str, Any], ...]
    """The parsed `--set` (and `--seq`) overrides as the plan records them: sorted, JSON values."""
    chain: LayerChain


def trace_key(model: str, sets: Sequence[str], *, seq: int | None, dtype: str) -> TraceKey | None:
    """The cache key of a zoo or `hf:` model; None for a user factory (never cached)."""
    if ":" in model and not model.startswith(HF_PREFIX):
        return None
    versions = [("torch", _version("torch")), ("stratagem", _version("stratagem")), ("entry", ENTRY_FORMAT)]
    sources = _code_digest()
    if model.startswith(HF_PREFIX):
        versions.append(("transformers", _version("transformers")))
        sources = hashlib.sha256((sources + _config_file_digest(model[len(HF_PREFIX):])).encode()).hexdigest()
    return TraceKey(model=model, sets=tuple(sorted(s.strip() for s in sets)), seq=seq, dtype=dtype, sources=sources, versions=tuple(versions))


def default_cache_root() -> Path:
    """`$STRATAGEM_CACHE_DIR`, else the platform's per-user cache folder: `%LOCALAPPDATA%\\stratagem\\Cache` on
    Windows, `~/Library/Caches/stratagem` on macOS, `$XDG_CACHE_HOME/stratagem` (default `~/.cache/stratagem`)
    elsewhere."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "stratagem" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "stratagem"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "stratagem"


@dataclass(frozen=True)
class TraceCache:
    """Traced models stored as files in `directory` (module docstring)."""

    directory: Path
    note: Callable[[str], None] = field(default=_stderr_note, compare=False)
    """Where the one-line notes about an entry that was ignored or could not be written go (stderr)."""

    @classmethod
    def default(cls) -> TraceCache:
        return cls(default_cache_root() / "traces")

    def path(self, key: TraceKey) -> Path:
        return self.directory / key.file_name()

    def load(self, key: TraceKey) -> TracedModel | None:
        """The cached trace, or None when there is none or it fails a check (then with a note)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # no entry (a folder that cannot exist is noted on store)
            return None
        except OSError as e:
            self.note(f"cannot read trace cache entry {path} ({e.strerror or e}); tracing again")
            return None
        try:
            return _decode(data, key)
        except _Stale as e:
            self.note(f"trace cache entry {path} is stale ({e}); tracing again")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            self.note(f"trace cache entry {path} is corrupt ({_one_line(e)}); tracing again")
        return None

    def store(self, key: TraceKey, traced: TracedModel) -> None:
        """Write the entry atomically; a cache that cannot be written is skipped with a note, never an error."""
        path = self.path(key)
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(_encode(key, traced))
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            self.note(f"cannot write the trace cache in {self.directory} ({e.strerror or e}); continuing without it")


class _Stale(ValueError):
    """An intact entry made from other code or versions than the running ones."""


def _encode(key: TraceKey, traced: TracedModel) -> bytes:
    body = traced.chain.to_json().encode()
    header = {"format": ENTRY_FORMAT, "key": key.to_dict(), "name": traced.name,
              "settings": [list(kv) for kv in traced.settings], "fingerprint": ir.fingerprint(traced.chain.graph),
              "sha256": hashlib.sha256(body).hexdigest()}
    return json.dumps(header, sort_keys=True).encode() + b"\n" + body


def _decode(data: bytes, key: TraceKey) -> TracedModel:
    head, sep, body = data.partition(b"\n")
    if not sep:
        raise ValueError("no header line")
    header = json.loads(head)
    if header.get("format") != ENTRY_FORMAT:
        raise _Stale(f"format {header.get('format')!r}, this Stratagem writes {ENTRY_FORMAT!r}")
    stored = header["key"]
    if stored != key.to_dict():
        changed = sorted(k for k in stored.keys() | key.to_dict().keys() if stored.get(k) != key.to_dict().get(k))
        raise _Stale(f"made with other {', '.join(changed)}")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise ValueError("checksum mismatch")
    chain = LayerChain.from_json(body.decode())
    if ir.fingerprint(chain.graph) != header["fingerprint"]:
        raise ValueError("graph fingerprint mismatch")
    settings = tuple((str(k), v) for k, v in header["settings"])
    return TracedModel(name=str(header["name"]), settings=settings, chain=chain)


@cache
def _code_digest() -> str:
    """sha256 over the sources that build and trace a model (`ir/`, the model zoo, `planner/tracing.py`): a change
    in how a graph is made is a different key even when the version number stays the same (a development
    checkout)."""
    files = [*sorted(Path(ir.__file__).parent.glob("*.py")), *sorted(_package_folder("models").glob("*.py")),
             Path(__file__).with_name("tracing.py")]
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _package_folder(name: str) -> Path:
    spec = util.find_spec(name)  # does not import the zoo (which imports torch)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"package {name} not found")
    return Path(next(iter(spec.submodule_search_locations)))


def _config_file_digest(spec: str) -> str:
    """sha256 of an `hf:` spec's config.json (a path or a folder holding one); "" for a built-in architecture."""
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
    except OSError:
        return ""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
