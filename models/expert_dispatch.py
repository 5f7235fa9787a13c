"""GShard capacity dispatch written as a token permutation: the zoo's `moe` and transformers' experts share it.

Routing (Lepikhin et al. 2021, "GShard", Sec. 2.2; Fedus et al. 2022, "Switch Transformer", eq. 3):
- tokens come in groups of S; each token chose k experts, `index` (G, S, k);
- each expert has C slots per group; all first choices claim slots before any second choice, in token order;
  a choice finding its expert full is dropped (that expert adds nothing for the token);
- the experts run on per-expert buffers (E, G*C, h): slot c of group g of expert e holds one token's hidden state.

GShard writes dispatch and combine as einsums with one-hot (G, S, E, C) masks. That computes and stores S*E*C
values per group to move S*k*h numbers: 2S / (3f) of the experts' own FLOPs (33% for DeepSeek-V3's S = 1024,
f = 2048) and a saved mask larger than the layer's hidden states. Trainers move tokens by index instead
(Megatron-Core's `moe_utils.permute` / `unpermute`, MegaBlocks' gather/scatter), which is what this module does:
- dispatch: ``expert_in = x.index_select(0, sources)`` -- a gather of the E*G*C slot rows (no FLOPs, a memory
  pass; its backward scatter-adds into x and saves only the index);
- combine: ``y = sum_k gate_k * expert_out.index_select(0, slot_k)`` -- a gather of k rows per token, weighted
  by the gates (dropped choices weigh 0).
Empty slots take some token's row: their outputs are never gathered back, so they get no gradient and change no
weight (each expert's weight gradient sums only over slots whose output is used). The numbers equal the einsum
formulation's up to summation order; shapes stay static, so the trace and expert parallelism see (E, G*C, h)
buffers as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class CapacityRoute:
    """Where each token choice goes in the (E, G, C) expert buffers, and which token fills each slot."""

    slots: torch.Tensor
    """(G, k, S) long: flat row of each choice in the (E*G*C, h) buffer (a valid row when dropped)."""
    kept: torch.Tensor
    """(G, k, S) bool: the choice found a free slot."""
    sources: torch.Tensor
    """(E*G*C,) long: row of the (G*S, h) tokens each slot takes (an arbitrary token for an empty slot)."""


def capacity_route(index: torch.Tensor, num_experts: int, capacity: int) -> CapacityRoute:
    """The route of top-k choices `index` (G, S, k) into `num_experts` experts of `capacity` slots per group."""
    groups, tokens, top_k = index.shape
    choice_major = index.transpose(1, 2)  # (G, k, S): first choices of every token, then second choices
    flat_choice = choice_major.flatten(1, 2)  # (G, k*S)
    one_hot = F.one_hot(flat_choice, num_experts)  # (G, k*S, E)
    slot = ((torch.cumsum(one_hot, dim=1) - 1) * one_hot).sum(dim=-1)  # (G, k*S): rank within its expert
    kept = slot < capacity
    group_base = torch.arange(groups, device=index.device).unsqueeze(1) * capacity  # (G, 1)
    rows = flat_choice * (groups * capacity) + group_base + slot  # (E, G, C) layout
    num_rows = num_experts * groups * capacity
    sink = torch.full_like(rows, num_rows)  # dropped choices write past the end, then the sink is cut off
    token_rows = (torch.arange(groups * tokens, device=index.device).view(groups, 1, tokens)
                  .expand(groups, top_k, tokens).flatten(1, 2))  # (G, k*S) row of the choosing token
    sources = torch.zeros(num_rows + 1, dtype=torch.long, device=index.device)
    sources = sources.scatter(0, torch.where(kept, rows, sink).flatten(), token_rows.flatten())[:num_rows]
    shape = (groups, top_k, tokens)
    return CapacityRoute(slots=torch.where(kept, rows, torch.zeros_like(rows)).view(shape),
                         kept=kept.view(shape), sources=sources)


def dispatch(x: torch.Tensor, route: CapacityRoute, num_experts: int) -> torch.Tensor:
    """Tokens (G, S, h) -> per-expert buffers (E, G*C, h)."""
    hidden = x.size(-1)
    return x.reshape(-1, hidden).index_select(0, route.sources).view(num_experts, -1, hidden)


def combine(expert_out: torch.Tensor, route: CapacityRoute, gates: torch.Tensor) -> torch.Tensor:
    """Per-expert outputs (E, G*C, h) and the choices' gates (G, S, k) -> tokens (G, S, h)."""
    hidden = expert_out.size(-1)
    groups, top_k, tokens = route.slots.shape
    picked = expert_out.reshape(-1, hidden).index_select(0, route.slots.flatten())  # (G*k*S, h)
    weights = (gates.transpose(1, 2) * route.kept).to(expert_out.dtype)  # (G, k, S); dropped choices weigh 0
    return (picked.view(groups, top_k, tokens, hidden) * weights.unsqueeze(-1)).sum(dim=1)
