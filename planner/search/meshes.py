"""The outer search: device meshes (dp x tp x pp [x cp], with ep riding on tp x dp) and their order over network
tiers.

Formulation
-----------
For a device count ``N`` the meshes are every ordered factorization ``N = dp * tp * pp * cp`` such that

- ``tp`` stays inside a node (``tp`` divides the devices per node) unless the caller allows it to span nodes,
  because tensor parallelism communicates on every layer (Narayanan et al., SC'21, section 3.3: "tensor model
  parallelism within a node");
- ``dp`` divides the global batch (each replica gets ``global_batch / dp`` samples);
- ``pp`` is at most the number of chain segments (every stage holds at least one segment);
- ``ep`` (expert parallelism) rides on the tensor- and data-parallel ranks: the caller's ``ep_options``
  (divisors of the experts, `costmodel.expert_parallel.ep_options`) that divide ``tp`` or are ``tp`` times a
  divisor of ``dp`` (`costmodel.strategy.expert_span`); it does not multiply the device count. ``cp`` (context parallelism) comes from ``cp_options`` (`costmodel.context_parallel.cp_options`).

Each mesh comes with a rank order (`Strategy.mesh_order`, innermost axis first = stride 1 = fastest tier). ``tp``
is always innermost; the data-parallel and pipeline axes are tried in both orders, because which one crosses the
slow tier decides whether gradient all-reduces or pipeline sends pay for it. Orders that give the same rank
layout (an axis of size 1 anywhere) are generated once.

Lower bounds used to prune whole meshes before any pricing:

- compute: ``T >= W / (N * F)`` where ``W`` is the training FLOPs of one step (forward + backward, no
  recomputation) and ``F`` the best achievable FLOP/s of one device (peak x measured best matmul efficiency);
  no strategy can beat perfect scaling at the best GEMM efficiency;
- memory: a device holds at least ``1 / (tp * pp)`` of the model's parameters (stages and tensor shards split
  them; the largest shard is at least the mean), times the bytes per parameter its ZeRO stage keeps.

Candidates are visited in a fixed order (more devices first, then tp, pp, dp, order) so the search is
deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from costmodel.rank_layout import strides_of
from costmodel.strategy import DEFAULT_MESH_ORDER, MeshAxis, Strategy, expert_span
from planner.strategy_label import Detail, strategy_label

DP_INSIDE_PP: tuple[MeshAxis, ...] = DEFAULT_MESH_ORDER
"""tp, cp, ep, dp, pp: Megatron-LM's rank order; pipeline stages are the outermost (slowest) axis."""
PP_INSIDE_DP: tuple[MeshAxis, ...] = (MeshAxis.TP, MeshAxis.CP, MeshAxis.EP, MeshAxis.PP, MeshAxis.DP)
"""tp, cp, ep, pp, dp: whole pipelines inside fast tiers; gradient all-reduces cross the slow ones."""
MESH_ORDERS: tuple[tuple[MeshAxis, ...], ...] = (DP_INSIDE_PP, PP_INSIDE_DP)


@dataclass(frozen=True, slots=True)
class MeshCandidate:
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    mesh_order: tuple[MeshAxis, ...] = DEFAULT_MESH_ORDER
    _strides: dict[MeshAxis, int] = field(init=False, repr=False, compare=False, hash=False)
    """`costmodel.rank_layout.strides_of` of the mesh, computed once: the search asks for strides hundreds of
    thousands of times (cache keys of every priced candidate)."""
    _span: tuple[int, int] | None = field(init=False, repr=False, compare=False, hash=False)
    """`costmodel.strategy.expert_span` of the mesh, computed once for the same reason."""

    def __post_init__(self) -> None:
        sizes = {MeshAxis.DP: self.dp, MeshAxis.TP: self.tp, MeshAxis.PP: self.pp, MeshAxis.CP: self.cp,
                 MeshAxis.EP: self.ep}
        object.__setattr__(self, "_strides", strides_of(sizes, self.mesh_order))
        object.__setattr__(self, "_span", expert_span(self.tp, self.dp, self.ep))

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def ep_dp(self) -> int:
        """Data-parallel coordinates an expert-parallel group spans (`costmodel.strategy.expert_span`)."""
        assert self._span is not None, "enumerate_meshes places ep where expert_span does"
        return self._span[1]

    def stride(self, axis: MeshAxis) -> int:
        """Rank distance between neighbours along `axis` (`costmodel.rank_layout`, ep's as its group is priced)."""
        return self._strides[axis]

    @property
    def label(self) -> str:
        strategy = Strategy(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, mesh_order=self.mesh_order)
        return strategy_label(strategy, Detail.MESH)


def divisors(n: int) -> tuple[int, ...]:
    """Positive divisors of n in increasing order."""
    if n < 1:
        raise ValueError(f"divisors of {n}: need a positive integer")
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small) | {n // d for d in small}))


def _distinct_orders(dp: int, pp: int, orders: Sequence[tuple[MeshAxis, ...]], cp: int = 1
                     ) -> list[tuple[MeshAxis, ...]]:
    """Orders that give different rank layouts: with dp == 1 or pp == 1 the dp/pp order does not matter.

    With cp > 1 only orders where cp and dp are neighbours (ep rides on dp and has no stride): the gradient
    reduction spans the dp x cp ranks, which `costmodel.rank_layout.dp_group` prices as one regular group -- exact
    only for neighbouring axes. Pipeline stages between them would be priced as if the reduction stayed inside
    them (a cross-datacenter gradient all-reduce priced as intra-node)."""
    if cp > 1:
        orders = [o for o in orders if _neighbours(o, MeshAxis.CP, MeshAxis.DP)] or [orders[0]]
    if dp == 1 or pp == 1:
        return [orders[0]]
    return list(orders)


def _neighbours(order: Sequence[MeshAxis], a: MeshAxis, b: MeshAxis) -> bool:
    strided = [x for x in order if x is not MeshAxis.EP]
    return abs(strided.index(a) - strided.index(b)) == 1


def enumerate_meshes(num_devices: int, *, devices_per_node: int, global_batch: int, max_pp: int,
                     dp: int | None = None, tp: int | None = None, pp: int | None = None,
                     cp_options: Iterable[int] = (1,), ep_options: Iterable[int] = (1,),
                     tp_across_nodes: bool = False,
                     orders: Sequence[tuple[MeshAxis, ...]] = MESH_ORDERS) -> list[MeshCandidate]:
    """Every mesh of exactly `num_devices` devices allowed by the rules in the module docstring, in a fixed order.

    `dp`, `tp`, `pp` pin a degree (None: free); `cp_options` / `ep_options` are the context- and expert-parallel
    degrees to try (ep only where `expert_span` places it).
    """
    out: list[MeshCandidate] = []
    for cp in sorted(set(cp_options)):
        if num_devices % cp:
            continue
        for t in divisors(num_devices // cp):
            if tp is not None and t != tp:
                continue
            if not tp_across_nodes and devices_per_node % t:
                continue
            if tp_across_nodes and t > devices_per_node and t % devices_per_node:
                continue
            for p in divisors(num_devices // (cp * t)):
                d = num_devices // (cp * t * p)
                if (pp is not None and p != pp) or (dp is not None and d != dp):
                    continue
                if p > max_pp or global_batch % d:
                    continue
                for order in _distinct_orders(d, p, orders, cp):
                    out.extend(MeshCandidate(dp=d, tp=t, pp=p, cp=cp, ep=e, mesh_order=order)
                               for e in sorted(set(ep_options)) if expert_span(t, d, e) is not None)
    return out


def compute_lower_bound_s(step_flops: float, num_devices: int, best_flops_per_device: float) -> float:
    """Seconds no strategy can beat: the step's FLOPs spread perfectly at the best achievable device rate."""
    return step_flops / (num_devices * best_flops_per_device)


def parameter_bytes_lower_bound(param_count: int, bytes_per_param: float, tp: int, pp: int) -> float:
    """Bytes of parameter-related state on the fullest device: at least the mean over the tp x pp shards."""
    return param_count * bytes_per_param / (tp * pp)
