"""Under torchrun: plan a user's own module through the Python API, then parallelize and train it.

Each config plans a small language model built from `torch.nn.TransformerEncoderLayer` (an embedding, a stack of
encoder layers, an LM head: nothing of the zoo) with `planner.api.plan`, tracing example inputs of the whole
global batch, then calls `planner.parallelize` with example inputs of another batch size, trains three steps and
reports the losses beside a single-process run of the same model and data.

    torchrun --standalone --nproc-per-node=N api_round_trip.py OUT.json CONFIG...
"""

from __future__ import annotations

import copy
import datetime
import json
import sys
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import planner
import planner.api
from planner.search.space import SearchSpace
from planner.runtime.worker_exit import exit_without_teardown

VOCAB, HIDDEN, LAYERS, HEADS, SEQ = 128, 64, 4, 4, 32
GLOBAL_BATCH = 8
STEPS = 3
LR = 1e-2
SEED = 0

CONFIGS: dict[str, tuple[str, dict[str, int], int]] = {
    # name: (cluster, pinned search dimensions, batch of the example inputs given to parallelize)
    "dp2": ("1x2xcpu", {"dp": 2}, 1),
    "tp2": ("1x2xcpu", {"tp": 2}, 3),
    "pp2": ("1x2xcpu", {"pp": 2}, 5),
    "tp2_pp2": ("1x4xcpu", {"tp": 2, "pp": 2}, 2),
}


class TinyLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(HIDDEN, HEADS, 4 * HIDDEN, dropout=0.0, batch_first=True)
            for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, h)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)  # (B, T, vocab)


def next_token_loss(logits: torch.Tensor, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    (ids,) = batch
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def reference(model: nn.Module, batches: Sequence[torch.Tensor]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        opt.zero_grad()
        loss = next_token_loss(model(ids), (ids,))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run_config(name: str) -> dict[str, Any]:
    cluster, pins, example_batch = CONFIGS[name]
    torch.manual_seed(SEED)
    model = TinyLM()
    batches = data()
    plan = planner.api.plan(model, (batches[0],), cluster, global_batch=GLOBAL_BATCH, dtype="float32",
                            space=SearchSpace(**pins))
    ref_losses = reference(copy.deepcopy(model), batches)
    pm = planner.parallelize(model, plan, example_inputs=(batches[0][:example_batch],), loss_fn=next_token_loss)
    opt = torch.optim.AdamW(list(pm.parameters()), lr=LR)
    losses = [planner.train_step(pm, planner.local_batch(pm, (ids,)), opt) for ids in batches]
    s = plan.strategy
    return {"losses": losses, "ref_losses": ref_losses,
            "strategy": {"dp": s.dp, "tp": s.tp, "pp": s.pp, "stages": len(s.stages)}}


def main(argv: Sequence[str]) -> int:
    out, names = argv[0], argv[1:]
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    results: dict[str, Any] = {}
    for name in names:
        try:
            mine = run_config(name)
        except Exception as e:  # keep going: one broken config should not hide the others' results
            mine = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"rank {dist.get_rank()} config {name}: {mine['traceback']}", file=sys.stderr, flush=True)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        results[name] = gathered
        # every rank leaves a config's pipeline and mesh groups together: a rank that tears its gloo groups down
        # while a peer still drains the last point-to-point sends aborts the peer
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_without_teardown(main(sys.argv[1:]))  # the results are written
