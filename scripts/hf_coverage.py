"""Which transformers causal-LM model types `hf:` covers, as a markdown table:

    python scripts/hf_coverage.py                      # every causal-LM model type of the installed transformers
    python scripts/hf_coverage.py deepseek_v3 qwen3    # only these
    python scripts/hf_coverage.py -o docs/hf_coverage.md

Each model type is built from its config class's defaults with `num_hidden_layers=2` (when the config has the
field; the published widths stay) on the meta device, traced at 64 tokens, and cut into its layer chain. A row is
*covered* when the traced parameter count equals the built model's `num_parameters(only_trainable=True)` (frozen
parameters -- a router's load-balancing bias, fixed sinusoidal position tables -- have no gradient or optimizer
state, and the tracer does not count them); otherwise it is *refused*
with the one-line reason `hf:` itself gives (`stratagem trace hf:MODEL_TYPE` prints the same line).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SEQ = 64
LAYERS = 2


@dataclass(frozen=True)
class Row:
    model_type: str
    covered: bool
    params: int
    block_classes: int
    experts: str
    """"E x top-k" of the routed experts, "" for a dense model."""
    reason: str
    seconds: float


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def check(model_type: str) -> Row:
    import ir
    from ir.moe_structure import routed_experts
    from models import hf
    from models.registry import ModelError, build_model
    from planner.errors import UserError

    start = time.perf_counter()
    try:
        sets = (f"num_hidden_layers={LAYERS}",) if "num_hidden_layers" in hf.setting_types(model_type) else ()
        built = build_model(f"hf:{model_type}", sets, seq=SEQ)
        graph = ir.trace(built.module, built.example_inputs, model_name=model_type)
        chain = ir.build_layer_chain(graph)
    except Exception as e:  # a sweep over every model type: one that breaks the tracer is a row, not the end
        # hf:'s own refusals are one line already; anything else says what raised it
        named = isinstance(e, ModelError | UserError)
        reason = " ".join(str(e).split())
        reason = reason.removeprefix(f"model hf:{model_type}: ") if named else f"{type(e).__name__}: {reason}"
        return Row(model_type, False, 0, 0, "", reason[:400], time.perf_counter() - start)
    # Trainable parameters, what the tracer counts (optimizer state and gradients follow them): frozen ones, such
    # as a router's load-balancing bias or fixed sinusoidal position tables, are weights without either.
    expected = built.module.num_parameters(only_trainable=True)
    found = routed_experts(graph.nodes)
    blocks = {s.class_id for s in chain.segments if s.name[-1:].isdigit()}
    reason = "" if graph.param_count == expected else f"traced {graph.param_count} parameters, model has {expected}"
    return Row(model_type, not reason, expected, len(blocks),
               f"{found.num_experts} x {found.top_k}" if found else "", reason, time.perf_counter() - start)


def markdown(rows: list[Row]) -> str:
    import transformers

    lines = ["# `hf:` coverage of transformers' causal-LM model types", "",
             f"`python scripts/hf_coverage.py -o docs/hf_coverage.md` with transformers {transformers.__version__}: "
             f"each model type is built from its config class's defaults with {LAYERS} layers on the meta device, "
             f"traced at {SEQ} tokens and cut into its layer chain. *Covered*: the traced parameters equal the built "
             "model's trainable ones, `num_parameters(only_trainable=True)` (frozen parameters such as a router's "
             "load-balancing bias or fixed sinusoidal position tables have no gradient or optimizer state); otherwise the row gives the one-line reason `stratagem trace "
             "hf:MODEL_TYPE` prints. A refusal inside transformers itself (a default config that does not "
             "validate or build) says so; a multimodal config names its text model type.", "",
             "| model type | covered | parameters (2 layers) | block classes | routed experts (E x k) | reason |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| `{r.model_type}` | {'yes' if r.covered else 'no'} | {r.params or ''} | "
                     f"{r.block_classes or ''} | {r.experts} | {r.reason.replace('|', '/')} |")
    covered = sum(r.covered for r in rows)
    return "\n".join([*lines, "", f"{covered} of {len(rows)} model types covered."]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model_types", nargs="*")
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for model_type in args.model_types or causal_lm_types():
        row = check(model_type)
        print(f"{row.model_type}: {'covered' if row.covered else 'refused: ' + row.reason} ({row.seconds:.1f} s)",
              file=sys.stderr)
        rows.append(row)
        if args.output:  # after every row: a sweep cut short keeps what it checked
            args.output.write_text(markdown(rows))
    if not args.output:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
