"""Expert parallelism: the experts of every mixture-of-experts layer are split over the plan's ep ranks.

Layout (GShard, Lepikhin et al. 2021, sec. 2.2-3; Megatron-LM's expert parallelism; priced by
`costmodel.expert_parallel`): an ep group is `ep` consecutive tp x dp ranks (`PlanMeshes.ep`,
`costmodel.strategy.expert_span`); rank j of the group keeps experts [j E/ep, (j+1) E/ep) of each layer. Every rank routes its own tokens as before; the experts module
receives per-expert token buffers (E, N, h) -- the zoo's `Experts` layout (models/feedforward.py): a module with
an integer `num_experts` whose parameters stack one matrix per expert on dim 0 -- and here
1. an all-to-all *dispatch* sends each expert's buffer to the rank that holds the expert, which then holds
   (E/ep, ep * N, h): its experts' tokens from every rank of the group;
2. the module's own forward runs on its local experts (its parameters are this rank's E/ep slices);
3. an all-to-all *combine* sends the results back, giving (E, N, h') in expert order.
Both all-to-alls are differentiable (`torch.distributed._functional_collectives.all_to_all_single`, whose
backward is the reverse all-to-all).

Gradients: an expert's gradient on its owner sums the contributions of the ep ranks whose tokens it took -- the
tokens of ep_dp data-parallel replicas (`Strategy.ep_dp`; their tp ranks hold disjoint slots, below) -- and the
expert replicas ((dp / ep_dp) x cp ranks, `PlanMeshes.expert_replicas`) then average it, which would be ep_dp
times the single-process gradient (dense parameters average over dp x cp ranks, each of which contributes once).
So the gradient reaching the experts' output is divided by ep_dp, and the gradient leaving their input multiplied
by ep_dp again: expert weights get 1/ep_dp of the sum, tokens their exact gradient (exact in floating point for
powers of 2).

Tensor parallelism (tp > 1) leaves the experts whole on every tp rank, and the MoE layer runs replicated over the
tp group on the gathered sequence (`apply_tp.replicated_islands`). So that the tp ranks do not all compute every
expert slot, each takes 1/tp of every expert's slots (`apply_expert_token_split`; Megatron-Core's expert tensor
parallel size 1, which splits the tokens over the tp ranks): the buffers (E, N, h) are padded to a multiple of tp
slots, rank r keeps slots [r N/tp, (r+1) N/tp) -- before the all-to-all when ep > 1, so the ep group exchanges
slices -- and the results are all-gathered over tp. Upstream of the gather the island is replicated, so the
gather's backward keeps this rank's slice of the (identical) gradient and the slice's backward gathers the slices'
gradients: tokens get their exact gradient. Each rank's expert gradients then hold only its slots'
contributions: where several ranks of a tp group hold the same experts (ep < tp, `PlanMeshes.expert_tp_sum`)
`train_step.sync_split_expert_gradients` sums their gradients after the backward (the data-parallel reduction over the
expert replicas has already run on each of them alike, and sums commute); where ep groups take whole tp groups,
the all-to-alls bring every slot of the group's replicas to the expert's one owner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.errors import UserError


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `factor` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_gradient(x: torch.Tensor, factor: float) -> torch.Tensor:
    return _ScaleGradient.apply(x, factor)


@dataclass(frozen=True, slots=True)
class EpGroup:
    """This rank's place in its expert-parallel group and the group's process group."""

    size: int
    rank: int
    group: Any

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable all-to-all of equal dim-0 chunks: chunk j goes to rank j; output chunk j came from
        rank j."""
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_to_all_single(x.contiguous(), None, None, self.group))


def is_experts_module(module: nn.Module) -> bool:
    """The zoo's experts layout: an int `num_experts` and direct parameters that all stack `num_experts`
    matrices on dim 0 (at least one a 3-D weight: a router's (E, h) weight with `num_experts` is not experts)."""
    experts = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (isinstance(experts, int) and experts > 0 and any(p.dim() >= 3 for p in params)
            and all(p.dim() >= 2 and p.size(0) == experts for p in params))


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def _takes_expert_buffers(module: nn.Module) -> bool:
    """Whether the module's forward takes a single required argument (the per-expert buffers), as the zoo's
    `Experts` does; token-choice experts (Hugging Face's Mixtral: tokens, top-k indices and weights) do not."""
    import inspect

    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is inspect.Parameter.empty
                and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(required) == 1


class ExpertParallelForward:
    """An experts module's forward with all-to-all dispatch and combine around its local experts (set as the
    instance's `forward`, so FQNs, hooks, FSDP2 and checkpointing see the module unchanged)."""

    def __init__(self, forward: Callable[..., Any], ep: EpGroup, num_experts: int, path: str,
                 replicas: int) -> None:
        self.forward = forward
        self.ep = ep
        self.num_experts = num_experts
        self.path = path
        self.replicas = replicas
        """Data-parallel replicas whose tokens the group's experts take (`Strategy.ep_dp`, module docstring)."""

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        ep, experts = self.ep.size, self.num_experts
        if x.dim() != 3 or x.size(0) != experts:
            raise UserError(f"expert parallelism: {self.path} expects per-expert buffers (experts={experts}, "
                            f"tokens, features), got shape {tuple(x.shape)}")
        local, tokens = experts // ep, x.size(1)
        received = self.ep.all_to_all(x)  # (ep [source rank], local, N, h) flattened on dim 0
        mine = received.unflatten(0, (ep, local)).transpose(0, 1).flatten(1, 2)  # (local, ep * N, h)
        out = self.forward(scale_gradient(mine, float(self.replicas)), *args, **kwargs)  # (local, ep * N, h')
        out = scale_gradient(out, 1.0 / self.replicas)
        back = out.unflatten(1, (ep, tokens)).transpose(0, 1).flatten(0, 1)  # (ep [owner], local, N, h')
        return self.ep.all_to_all(back)  # (E, N, h') in expert order


def _gather_slots(x: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 1, group))


class _SliceSlots(torch.autograd.Function):
    """This tp rank's share of dim 1 forward; the shares' gradients gathered over the tp group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: EpGroup) -> torch.Tensor:
        ctx.tp = tp
        n = x.size(1) // tp.size
        return x.narrow(1, tp.rank * n, n).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_slots(grad, ctx.tp.group), None


class _GatherSlots(torch.autograd.Function):
    """The tp ranks' shares of dim 1 gathered forward; this rank's share of the replicated gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: EpGroup) -> torch.Tensor:
        ctx.tp = tp
        return _gather_slots(x, tp.group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        tp = ctx.tp
        n = grad.size(1) // tp.size
        return grad.narrow(1, tp.rank * n, n).contiguous(), None


class TokenSplitForward:
    """An experts module's forward on this tp rank's share of every expert's slots, the results gathered over
    the tp group (module docstring)."""

    def __init__(self, forward: Callable[..., Any], tp: EpGroup) -> None:
        self.forward = forward
        self.tp = tp

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        slots = x.size(1)
        pad = -slots % self.tp.size
        if pad:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad))
        out = _GatherSlots.apply(self.forward(_SliceSlots.apply(x, self.tp), *args, **kwargs), self.tp)
        return out[:, :slots] if pad else out


def apply_expert_token_split(modules: Sequence[nn.Module], tp: EpGroup) -> tuple[nn.Module, ...]:
    """Let each tp rank run 1/tp of every expert's slots (module docstring) of the experts `modules` (those of
    `experts_modules`, or after `apply_expert_parallel` its `ExpertShards.modules`); returns the ones it split.
    Experts modules not called with per-expert buffers are left alone (they run replicated, as priced for them)."""
    done = []
    for module in modules:
        entry = _buffers_entry(module)
        if entry:
            setattr(module, entry, TokenSplitForward(getattr(module, entry), tp))
            done.append(module)
    return tuple(done)


def _buffers_entry(module: nn.Module) -> str:
    """The method that runs the experts on per-expert buffers ('' when the module has none): an experts module
    that routes its own tokens may expose it as `expert_buffers_forward` (models/hf_tracing.py)."""
    if callable(getattr(module, "expert_buffers_forward", None)):
        return "expert_buffers_forward"
    return "forward" if _takes_expert_buffers(module) else ""


@dataclass(frozen=True)
class ExpertShards:
    """What `apply_expert_parallel` changed."""

    modules: tuple[nn.Module, ...]
    """The experts modules (their parameters are now this rank's slices)."""
    param_names: tuple[str, ...]
    """FQNs of the sliced parameters (each a slice of dim 0 over the ep group)."""


def apply_expert_parallel(model: nn.Module, ep: EpGroup, replicas: int | None = None) -> ExpertShards:
    """Keep this rank's slice of every experts module's parameters and route its tokens with all-to-alls;
    `replicas`: the data-parallel replicas an ep group spans (`Strategy.ep_dp`; None: ep, a group of dp ranks)."""
    replicas = ep.size if replicas is None else replicas
    found = experts_modules(model)
    if not found:
        raise UserError(f"expert parallelism (ep={ep.size}): {type(model).__name__} has no experts module (a "
                        "module with num_experts and parameters stacked per expert on dim 0); plan with ep=1")
    shared = {id(p) for _, m in found for p in m.parameters(recurse=False)}
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in shared:
            counts[id(p)] = counts.get(id(p), 0) + 1
    names: list[str] = []
    for path, module in found:
        experts = module.num_experts
        if experts % ep.size:
            raise UserError(f"ep={ep.size} does not divide the {experts} experts of {path}; valid ep: "
                            f"{', '.join(str(d) for d in range(1, experts + 1) if experts % d == 0)}")
        entry = _buffers_entry(module)
        if not entry:
            raise UserError(f"expert parallelism: {path} ({type(module).__name__}) is not called with per-expert "
                            "token buffers (experts, tokens, features), the layout whose dispatch it implements; "
                            "plan with ep=1")
        local = experts // ep.size
        for pname, p in list(module.named_parameters(recurse=False)):
            if counts.get(id(p), 0) > 1:
                raise UserError(f"expert parameter {path}.{pname} is shared with another module; untie it")
            part = p.detach().narrow(0, ep.rank * local, local).clone()
            setattr(module, pname, nn.Parameter(part, requires_grad=p.requires_grad))
            names.append(f"{path}.{pname}" if path else pname)
        setattr(module, entry, ExpertParallelForward(getattr(module, entry), ep, experts, path, replicas))
    return ExpertShards(modules=tuple(m for _, m in found), param_names=tuple(names))
