"""Pipeline stages of a Hugging Face decoder-only language model, whose forward torch.fx cannot trace.

transformers 5 wraps its forwards in decorators (output capture, config defaults, deprecated-kwarg handling) that
`torch.fx` cannot trace, so `apply_pipeline`'s cut of the traced root does not apply. Its decoder-only models do
share one structure, which the stages use instead: `lm_head(model.norm(model.layers[...](model.embed_tokens(
ids))))`, where `model.forward` takes `inputs_embeds` in place of ids and recomputes positions, rotary
embeddings and masks from the hidden state's shape (every stage sees the whole, unpadded sequence).

Stage i is a shallow copy of the model holding only its own blocks (original submodules, so parameter names stay
the model's FQNs, e.g. `model.layers.3.mlp.experts.down_proj`):
- the first stage embeds the ids; the others take the previous stage's hidden state as `inputs_embeds` and hold
  no embedding;
- every stage but the last returns its last block's output (final norm replaced by identity); the last runs the
  final norm and the head and returns the logits.
Each block must lie in one stage, the embedding in the first and the head in the last.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from planner.errors import UserError


def is_decoder_lm(model: nn.Module) -> bool:
    """transformers' causal-LM layout: `model.embed_tokens`, `model.layers` (a ModuleList), `model.norm`,
    `lm_head`, and an inner forward taking `inputs_embeds`."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module) or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return False
    if not all(isinstance(getattr(inner, n, None), nn.Module) for n in ("embed_tokens", "norm")):
        return False
    if not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        return False
    try:
        return "inputs_embeds" in inspect.signature(inner.forward).parameters
    except (TypeError, ValueError):
        return False


def _stage_of(stages_of: Mapping[str, frozenset[int]], path: str) -> int:
    found = stages_of.get(path)
    if found is None:
        raise UserError(f"the plan's layer chain has no operation of {path!r}; was it made for this model?")
    if len(found) != 1:
        raise UserError(f"a pipeline cut falls inside {path!r} (stages {sorted(found)}); cut between blocks")
    (stage,) = found
    return stage


def decoder_stage_modules(model: nn.Module, stages_of: Mapping[str, frozenset[int]], num_stages: int,
                          keep: Sequence[int] | None = None) -> dict[int, nn.Module]:
    """One module per stage index in `keep` (default: all), sharing `model`'s submodules (module docstring)."""
    if _stage_of(stages_of, "model.embed_tokens") != 0 or _stage_of(stages_of, "lm_head") != num_stages - 1:
        raise UserError("the embedding must be on the first pipeline stage and the head on the last")
    blocks: dict[int, dict[str, nn.Module]] = {i: {} for i in range(num_stages)}
    for key, block in model.model.layers._modules.items():
        blocks[_stage_of(stages_of, f"model.layers.{key}")][key] = block
    empty = [i for i in range(num_stages) if not blocks[i] and 0 < i < num_stages - 1]
    if empty:
        raise UserError(f"pipeline stage(s) {empty} hold no block of the model")
    wanted = range(num_stages) if keep is None else keep
    return {i: _stage(model, blocks[i], first=i == 0, last=i == num_stages - 1) for i in wanted}


def _stage(model: nn.Module, blocks: Mapping[str, nn.Module], *, first: bool, last: bool) -> nn.Module:
    outer = copy.copy(model)  # a new object over the same parameters; only its child tables are replaced
    outer._modules = dict(model._modules)
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)
    layers = nn.ModuleList()
    layers._modules = dict(blocks)  # the model's own indices: parameter names stay the model's FQNs
    inner._modules["layers"] = layers
    if not first:
        inner._modules["embed_tokens"] = None
    if not last:
        inner._modules["norm"] = nn.Identity()
        del outer._modules["lm_head"]
    outer._modules["model"] = inner
    outer.forward = types.MethodType(_forward(first=first, last=last), outer)
    return outer


def _forward(*, first: bool, last: bool) -> Any:
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": x} if first else {"inputs_embeds": x}
        if last:
            return type(self).forward(self, **inputs, use_cache=False).logits
        return self.model(**inputs, use_cache=False).last_hidden_state
    return forward
