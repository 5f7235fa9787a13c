"""`fingerprint(graph)`: a sha256 hex digest of a graph's structure, stable across runs and processes.

It covers, per node in order: kind, target, module path, wiring as positions (not names), input/output/parameter
specs, attributes, and which parameters are shared (as the index of their first use, so tied weights count).
Node names, the model's display name, the front end that traced it and the dtypes are left out, so two traces of
the same model with the same inputs agree, and a plan made for bfloat16 training (the dtype is part of the plan's
training config, not of the model) can check that it is applied to the model it was made for when that model is
run in float32.
"""

from __future__ import annotations

import hashlib
import json

from ir.graph import Graph


def fingerprint(graph: Graph) -> str:
    """sha256 hex of the graph's structure (see the module docstring)."""
    param_index: dict[str, int] = {}
    records = []
    for node in graph.nodes:
        records.append([
            node.op_kind.value,
            node.target,
            node.module_path,
            [graph.position(s) for s in node.inputs],
            [list(s.shape) for s in node.input_specs],
            [list(s.shape) for s in node.output_specs],
            [[list(s.shape), param_index.setdefault(p, len(param_index))]
             for p, s in zip(node.param_names, node.param_specs, strict=True)],
            [[k, v] for k, v in node.attrs],
        ])
    payload = {"param_count": graph.param_count, "nodes": records}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()
