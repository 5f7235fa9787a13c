"""`stratagem trace MODEL [--set k=v ...] [--batch B] [--seq S] [--dtype D] [--json]`: the IR summary.

Prints the parameter count, FLOPs for one step of the given batch and sequence, and the layer chain: its
segments grouped into runs of one layer class (the 96 blocks of GPT-3 are one row), with parameters and FLOPs
per segment. `--json` prints the same as JSON with the keys DESIGN.md promises (`params`, `forward_flops`,
`layers` with `class_id`, `num_layer_classes`); two runs with the same arguments print identical JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from costmodel.model_flops import model_flops
from planner.cli.common import add_model_arguments, positive_int
from planner.cli.models_cmd import human_count
from planner.errors import UserError

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("trace", help="trace a model: parameters, FLOPs, layer chain and classes",
                              description=__doc__.splitlines()[0])
    add_model_arguments(p)
    p.add_argument("--batch", type=positive_int, default=1, help="samples in the traced batch (default 1)")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="training dtype for activation/parameter bytes (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    summary = trace_summary(args.model, args.sets, batch=args.batch, seq=args.seq, dtype=args.dtype)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        print(format_summary(summary))
    return 0


def trace_summary(model: str, sets: Sequence[str] = (), *, batch: int = 1, seq: int | None = None,
                  dtype: str = "bfloat16") -> dict[str, Any]:
    """Build, trace and cut MODEL; the JSON-ready summary `stratagem trace --json` prints."""
    import ir
    from models.registry import build_model
    from planner.tracing import trace_built

    built = build_model(model, sets, batch=batch, seq=seq, device="meta")
    try:
        graph = trace_built(built, dtype=dtype)
        if built.seq_len is not None and graph.seq_len != built.seq_len:
            graph = dataclasses.replace(graph, seq_len=built.seq_len)
        chain = ir.build_layer_chain(graph)
    except ValueError as e:  # TraceError and friends: one line for the user
        raise UserError(" ".join(str(e).split())) from None
    return _summary(built, graph, chain)


def _summary(built: Any, graph: Any, chain: Any) -> dict[str, Any]:
    import ir

    layers = [
        {
            "index": s.index, "name": s.name, "class_id": s.class_id, "params": s.param_count,
            "forward_flops": s.forward_flops, "backward_flops": s.backward_flops,
            "saved_bytes": s.saved_bytes, "boundary_bytes": s.boundary_bytes, "num_nodes": s.stop - s.start,
        }
        for s in chain.segments
    ]
    classes: dict[int, dict[str, Any]] = {}
    for s in chain.segments:
        entry = classes.setdefault(s.class_id, {
            "class_id": s.class_id, "count": 0, "first": s.name, "params_per_layer": s.param_count,
            "forward_flops_per_layer": s.forward_flops, "backward_flops_per_layer": s.backward_flops,
            "saved_bytes_per_layer": s.saved_bytes, "structural_hash": s.structural_hash,
        })
        entry["count"] += 1
    return {
        "model": built.name,
        "family": built.family,
        "settings": [[k, _jsonable(v)] for k, v in built.settings],
        "batch": graph.batch_size,
        "seq": graph.seq_len,
        "dtype": graph.dtype,
        "tracer": graph.tracer,
        "fingerprint": ir.fingerprint(graph),
        "params": graph.param_count,
        "param_bytes": graph.param_bytes,
        "forward_flops": graph.forward_flops,
        "backward_flops": graph.backward_flops,
        "model_flops": model_flops(chain),
        "num_nodes": len(graph.nodes),
        "num_layers": len(chain.segments),
        "num_layer_classes": chain.num_classes,
        "layers": layers,
        "classes": [classes[c] for c in sorted(classes)],
    }


def _jsonable(v: Any) -> Any:
    if isinstance(v, bool | int | float | str) or v is None:
        return v
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    return str(v)


# ---------------------------------------------------------------------------------------------------------------
# Text output
# ---------------------------------------------------------------------------------------------------------------


def format_summary(s: dict[str, Any]) -> str:
    seq = f", seq {s['seq']}" if s["seq"] is not None else ""
    settings = ", ".join(f"{k}={v}" for k, v in s["settings"])
    lines = [
        f"model      {s['model']} ({s['family']}{'; ' + settings if settings else ''})",
        f"traced     batch {s['batch']}{seq}, {s['dtype']}, {s['num_nodes']} ops via torch.{s['tracer']}",
        f"params     {human_count(s['params'])} ({s['params']:,})",
        f"FLOPs      forward {_count(s['forward_flops'])}, backward {_count(s['backward_flops'])} "
        f"per step of batch {s['batch']}{seq}",
        *([f"           model FLOPs (what MFU counts) {_count(s['model_flops'])}: routed experts at each token's "
           "choices, not the trace's expert slots"]
          if s["model_flops"] != s["forward_flops"] + s["backward_flops"] else []),
        f"chain      {s['num_layers']} layers, {s['num_layer_classes']} classes",
        "",
    ]
    header = ("layers", "class", "count", "params/layer", "fwd FLOPs/layer", "saved/layer", "boundary")
    rows = [header]
    for group in _runs(s["layers"]):
        first, last = group[0], group[-1]
        name = first["name"] if len(group) == 1 else f"{first['name']} .. {last['name']}"
        rows.append((name, str(first["class_id"]), str(len(group)), human_count(first["params"]),
                     _count(first["forward_flops"]), _bytes(first["saved_bytes"]), _bytes(first["boundary_bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _runs(layers: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Consecutive layers of one class, grouped for the table (a run of 96 identical blocks is one row)."""
    groups: list[list[dict[str, Any]]] = []
    for layer in layers:
        if groups and groups[-1][0]["class_id"] == layer["class_id"]:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return groups


def _count(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:g}"


def _bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} B"
