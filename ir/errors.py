"""Errors raised while tracing a model into the graph IR.

`ir/` sits below `planner/` and must not import it, so `TraceError` is a `ValueError`: library code raises it,
and the CLI turns it into a one-line user error (exit 2).
"""

from __future__ import annotations


class TraceError(ValueError):
    """A model (or its example inputs) that cannot be traced.

    The message is one line: what failed (model, module path, op), why, and what to try
    (leaf modules, the torch.export fallback, rewriting a value-dependent branch).
    """

    def __init__(self, message: str, *, module_path: str | None = None, op: str | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.module_path = module_path
        """Dotted path of the module that failed ("" for the top level), when known."""
        self.op = op
        """The operation that failed, when known."""
