"""Context parallelism: every sample's sequence is split over the plan's cp ranks inside the transformer blocks.

Layout (the load-balanced causal split of Dubey et al. 2024 "The Llama 3 Herd of Models", sec. 3.3.2, and of
Megatron-LM's context parallelism): the sequence of T tokens is cut into 2 * cp chunks of T / (2 cp) and cp rank r
holds chunks r and 2cp-1-r, so every rank does the same causal-attention work. `costmodel.context_parallel`
prices this layout.

Where the sequence is split: at the transformer blocks (`model.blocks`, the zoo's layout rule), as sequence
parallelism does for tp. The first block's input is split (a local selection, no communication) and the last
block's output all-gathered and put back in position order, so the code outside the blocks -- embeddings with
learned positions, final norm, head and the user's loss -- sees whole sequences and needs no change. The head
and loss then run on the whole sequence on every cp rank (redundant, but exact for any loss function).

Exact gradients: every cp rank computes the same loss L from the gathered output; the all-gather's backward is a
reduce-scatter (sum), so rank r's blocks receive cp * dL/d(its tokens), and their parameter gradients are cp times
their tokens' share. Parameters outside the blocks get the full gradient on every rank. Averaging gradients over
the flattened (dp, cp) ranks (FSDP2 / replicate, `PlanMeshes.replicas`) thus gives the single-process gradient
for both: mean over cp of cp * share_r = sum of the shares, and the mean of identical full gradients is itself.

Attention: each attention op all-gathers K and V over the cp ranks (Llama 3's all-gather context parallelism,
sec. 3.3.2; the same bytes per device as a ring, whose volume the cost model prices; with grouped-query attention
only the KV heads, not their copies for every query head) and runs
`F.scaled_dot_product_attention` of the local queries against all keys with the causal mask built from global
positions. The all-gather's backward reduce-scatters dK and dV to their owners. It intercepts
`F.scaled_dot_product_attention` (a `TorchFunctionMode` active only inside the blocks' attention modules); an
attention module that computes attention without it (the zoo's attn_impl="math") or with an explicit mask or
bias is refused when it runs, as the planner's `cp_problem` refuses it.

Positions inside the blocks: modules holding rotary position tables (buffers `cos` and `sin` indexed by position
on dim 0 and read as rows [0, T) of the T tokens they see on dim -2 of their input, the zoo's RoPE layout in
models/rope.py) read the rows of their tokens' global positions instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from planner.errors import UserError
from planner.runtime.apply_recompute import attention_modules
from planner.runtime.apply_tp import BLOCKS_ATTR, SEQUENCE_DIM

POSITION_TABLES: tuple[str, ...] = ("cos", "sin")
"""Buffers of a rotary-embedding module that hold one row per position (models/rope.py)."""


@dataclass(frozen=True, slots=True)
class SequenceShard:
    """Which tokens of a sequence this cp rank holds: chunks `rank` and `2 cp - 1 - rank` of `2 cp`."""

    cp: int
    rank: int

    def __post_init__(self) -> None:
        if self.cp < 1 or not 0 <= self.rank < self.cp:
            raise ValueError(f"cp rank {self.rank} is not in [0, {self.cp})")

    def check(self, seq_len: int) -> None:
        if seq_len % (2 * self.cp):
            raise UserError(f"sequence length {seq_len} does not split into 2*cp={2 * self.cp} equal chunks; "
                            f"context parallelism needs a multiple of {2 * self.cp}")

    def chunks(self, seq_len: int, rank: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """(start, length) of the two chunks of `rank` (default: this rank)."""
        self.check(seq_len)
        r = self.rank if rank is None else rank
        size = seq_len // (2 * self.cp)
        return (r * size, size), ((2 * self.cp - 1 - r) * size, size)

    def positions(self, seq_len: int, device: torch.device | str = "cpu", rank: int | None = None) -> torch.Tensor:
        """Global positions of the local tokens, in local order, (seq_len / cp,) int64."""
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.chunks(seq_len, rank)])

    def gathered_positions(self, seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of the tokens of an all-gather over the cp ranks (rank-major), (seq_len,)."""
        return torch.cat([self.positions(seq_len, device, r) for r in range(self.cp)])

    def split(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's tokens of `x` along `dim` (two narrow views, concatenated)."""
        return torch.cat([x.narrow(dim, s, n) for s, n in self.chunks(x.size(dim))], dim=dim)

    def restore_order(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        """Put the rank-major tokens of an all-gather along `dim` back in position order."""
        order = torch.argsort(self.gathered_positions(gathered.size(dim), gathered.device))
        return gathered.index_select(dim, order)


def causal_mask(shard: SequenceShard, seq_len: int, device: torch.device | str) -> torch.Tensor:
    """(seq_len / cp, seq_len) bool, True where a local query may attend to a gathered key (key position <= query
    position), the causal mask of the whole sequence restricted to this rank's queries."""
    q = shard.positions(seq_len, device)
    k = shard.gathered_positions(seq_len, device)
    return q[:, None] >= k[None, :]


@dataclass(frozen=True, slots=True)
class CpGroup:
    """This rank's shard and the process group of its cp ranks."""

    shard: SequenceShard
    group: Any

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Differentiable all-gather along `dim` (rank-major); the backward reduce-scatters (sums) gradients."""
        import torch.distributed._functional_collectives as funcol

        moved = x.movedim(dim, 0).contiguous()  # funcol gathers along dim 0
        gathered = funcol.wait_tensor(funcol.all_gather_single(moved, 0, self.group))
        return gathered.movedim(0, dim)

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence, in position order, from every rank's tokens along `dim`."""
        return self.shard.restore_order(self.all_gather(x, dim), dim)


def _gather_kv(cp: CpGroup, x: torch.Tensor, groups: int) -> torch.Tensor:
    """All ranks' tokens of K or V (..., heads, T / cp, d) -> (..., heads, T, d). When each run of `groups`
    consecutive heads is one KV head repeated, one head per run is sent and the run rebuilt after the gather (the
    sum of the run's gradients reaches the head the model repeated)."""
    if groups <= 1 or x.dim() < 3 or x.size(-3) % groups:
        return cp.all_gather(x, -2)
    return cp.all_gather(x[..., ::groups, :, :], -2).repeat_interleave(groups, dim=-3)


def context_parallel_attention(cp: CpGroup, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                               is_causal: bool = False, scale: float | None = None, *, kv_groups: int = 1,
                               **kwargs: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention` of this rank's queries against the keys and values of all cp ranks.

    query, key, value: (..., T / cp, d) local tokens. Returns (..., T / cp, d_v). `kv_groups`: the module repeated
    each KV head to this many consecutive query heads before the call (grouped-query attention); only the KV
    heads are exchanged, as the cost model prices it."""
    if attn_mask is not None:
        raise UserError("context parallelism needs attention without an explicit mask or position bias "
                        "(the mask would have to be split over the sequence too); plan with cp=1")
    if key.size(-2) != query.size(-2):
        raise UserError(f"context parallelism splits self-attention; got {query.size(-2)} local queries but "
                        f"{key.size(-2)} keys (cross-attention); plan with cp=1")
    seq_len = query.size(-2) * cp.shard.cp
    keys, values = (_gather_kv(cp, t, kv_groups if t.size(-3) == query.size(-3) else 1) for t in (key, value))
    mask = causal_mask(cp.shard, seq_len, query.device) if is_causal else None
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=False, scale=scale, **kwargs)


class _ContextParallelMode(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` to `context_parallel_attention`; counts the calls."""

    def __init__(self, cp: CpGroup, kv_groups: int = 1) -> None:
        super().__init__()
        self.cp = cp
        self.kv_groups = kv_groups
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return context_parallel_attention(self.cp, *args, kv_groups=self.kv_groups, **kwargs)
        return func(*args, **kwargs)


class ContextParallelForward:
    """An attention module's forward run under `_ContextParallelMode` (set as the instance's `forward`, so FQNs,
    hooks, FSDP2 and checkpointing see the module unchanged)."""

    def __init__(self, forward: Callable[..., Any], cp: CpGroup, path: str, kv_groups: int = 1) -> None:
        self.forward = forward
        self.cp = cp
        self.path = path
        self.kv_groups = kv_groups

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mode = _ContextParallelMode(self.cp, self.kv_groups)
        with mode:
            out = self.forward(*args, **kwargs)
        if mode.calls == 0:
            raise UserError(f"context parallelism: {self.path} computed attention without "
                            "F.scaled_dot_product_attention (explicit 'math' attention cannot see the other "
                            "ranks' keys); build the model with attn_impl=sdpa or plan with cp=1")
        return out


class GlobalPositionForward:
    """A rotary-embedding module's forward that reads the position-table rows of its tokens' global positions:
    the tables are swapped for those rows during the call (and put back after it)."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any], cp: CpGroup, path: str) -> None:
        self.module = module
        self.forward = forward
        self.cp = cp
        self.path = path

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        buffers = self.module._buffers
        saved = {name: buffers[name] for name in POSITION_TABLES}
        seq_len = x.size(-2) * self.cp.shard.cp
        rows = min(t.size(0) for t in saved.values())
        if rows < seq_len:
            raise UserError(f"{self.path}: position tables have {rows} rows, fewer than the {seq_len} positions "
                            "of the sequence")
        positions = self.cp.shard.positions(seq_len, x.device)
        try:
            for name, table in saved.items():
                buffers[name] = table.index_select(0, positions)
            return self.forward(x, *args, **kwargs)
        finally:
            buffers.update(saved)


def _kv_groups(module: nn.Module) -> int:
    """Query heads per KV head that the attention module repeats K and V to before SDPA: the zoo's `kv_groups`
    (`repeat_interleave`) or transformers' `num_key_value_groups` (`repeat_kv`), both runs of consecutive heads."""
    for name in ("kv_groups", "num_key_value_groups"):
        groups = getattr(module, name, None)
        if isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1:
            return groups
    return 1


def _is_position_table_module(module: nn.Module) -> bool:
    tables = [module._buffers.get(name) for name in POSITION_TABLES]
    return all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tables)


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(model, BLOCKS_ATTR, None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise UserError(f"context parallelism splits the sequence inside the transformer blocks, an "
                        f"nn.ModuleList named {BLOCKS_ATTR!r}; {type(model).__name__} has none (plan with cp=1)")
    return blocks


def apply_context_parallel(model: nn.Module, cp: CpGroup) -> list[str]:
    """Route the blocks' attention through `context_parallel_attention` and their rotary tables to global
    positions; returns the module paths changed. Install the split / gather hooks separately
    (`install_split_hook`, `install_gather_hook`), after activation checkpointing."""
    blocks = _blocks(model)
    changed = []
    for i, block in enumerate(blocks):
        prefix = f"{BLOCKS_ATTR}.{i}"
        names = {id(m): n for n, m in block.named_modules()}
        attention = attention_modules(block)
        if not attention:
            raise UserError(f"context parallelism: {prefix} has no attention module (a module with a q_proj "
                            "linear or a class name ending in 'Attention'); plan with cp=1")
        for module in attention:
            path = f"{prefix}.{names[id(module)]}".rstrip(".")
            module.forward = ContextParallelForward(module.forward, cp, path, kv_groups=_kv_groups(module))
            changed.append(path)
        for name, module in block.named_modules():
            if _is_position_table_module(module):
                path = f"{prefix}.{name}"
                module.forward = GlobalPositionForward(module, module.forward, cp, path)
                changed.append(path)
    return changed


def install_split_hook(model: nn.Module, cp: CpGroup) -> None:
    """Split the first block's input over the sequence (this rank's two chunks). Install it *after* activation
    checkpointing, so a checkpointed first block keeps the whole input and recomputation splits it again."""

    def split_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (cp.shard.split(args[0], SEQUENCE_DIM), *args[1:])

    _blocks(model)[0].register_forward_pre_hook(split_input)


def install_gather_hook(model: nn.Module, cp: CpGroup) -> None:
    """All-gather the last block's output over the cp ranks, in position order. Install it after sequence
    parallelism's hooks, so that tp's gather runs first."""

    def gather_output(_module: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        full = cp.gather_sequence(first, SEQUENCE_DIM)
        return (full, *out[1:]) if isinstance(out, tuple) else full

    blocks = _blocks(model)
    blocks[len(blocks) - 1].register_forward_hook(gather_output)
