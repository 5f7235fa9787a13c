"""Per-layer-class prices for one (device type, tp, sequence parallel, micro-batch): the middle level of the search.

Identical layers share a class (`Segment.class_id`), so a class is priced once per key and the result reused by
every segment of the class: the 96 blocks of GPT-3 cost one solve. With ``tp == 1`` a class is priced replicated
(`costmodel.layer_pricing.price_segment`); with ``tp > 1`` the intra-operator sharding ILP
(`planner.search.intra_op.solve_layer_sharding`) chooses every op's sharding and returns its `LayerCost` and module
styles. `LayerCostTable` is the cache: one per search (or per `planner.estimate` call), never global.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from costmodel.float8 import Float8Recipe
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.layer_pricing import (
    fp8_fields,
    owned_param_tensors,
    price_segment,
    segment_glue,
    weight_grad_share,
)
from costmodel.rank_layout import type_group
from costmodel.strategy import RuntimeOptions
from ir.graph import Node
from ir.layer_chain import LayerChain
from planner.plan import ModuleSharding


@dataclass(frozen=True, slots=True)
class AxisSplit:
    """Context- and expert-parallel degrees of a candidate and their rank strides: segment prices
    at (tp, sp, mbs) are turned into cp / ep prices by `costmodel.context_parallel` and
    `costmodel.expert_parallel`."""

    cp: int = 1
    cp_stride: int = 1
    ep: int = 1
    ep_stride: int = 1
    num_devices: int = 1
    """Devices of the mesh: how many cp rings / ep groups run at once."""


@dataclass(frozen=True, slots=True)
class ClassPrices:
    """Prices of every layer class for one key; `sharding` maps class id -> module styles (relative paths)."""

    costs: Mapping[int, LayerCost]
    sharding: Mapping[int, tuple[ModuleSharding, ...]]


@dataclass
class LayerCostTable:
    """Cache of `ClassPrices` per (device name, tp, tp stride, sequence parallel, micro-batch size)."""

    chain: LayerChain
    cluster: Cluster
    dtype: str = "bfloat16"
    profile: Any = None
    fp8: Float8Recipe | None = None
    """Linear layers in FP8 with this recipe (`costmodel.float8`), as `RuntimeOptions.fp8` of every candidate."""
    ep_dedup: bool = False
    """Expert-parallel dispatch deduplicated per node (`RuntimeOptions.ep_dedup` of every candidate)."""
    sharded_weights: bool = False
    """Every linear's and token embedding's weight split over tp (`RuntimeOptions.tp_sharded_weights` of every
    candidate)."""
    regathers_inputs: bool = False
    """Column-parallel inputs gathered from a sequence shard kept as the shard, as Megatron-LM's linear does
    (`LayerCost.regathered`; `RuntimeOptions.tp_grad_overlap` of every candidate)."""
    solves: int = 0
    """Class-level pricings actually computed (cache misses), for the search statistics."""
    _cache: dict[tuple[str, int, int, bool, int, int], ClassPrices] = field(default_factory=dict)
    _split_cache: dict[tuple, dict[int, LayerCost]] = field(default_factory=dict)
    _sharding_cache: Any = None
    _has_experts: bool | None = None
    _expert_layers: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def for_runtime(cls, chain: LayerChain, cluster: Cluster, runtime: RuntimeOptions, *, dtype: str = "bfloat16",
                    profile: Any = None) -> LayerCostTable:
        """A table whose prices hold for every candidate running `runtime` (`prices_for`)."""
        return cls(chain, cluster, dtype=dtype, profile=profile, fp8=runtime.fp8, ep_dedup=runtime.ep_dedup,
                   sharded_weights=runtime.tp_sharded_weights, regathers_inputs=runtime.tp_grad_overlap)

    @staticmethod
    def pricing_key(runtime: RuntimeOptions) -> tuple:
        """What of `runtime` the layer prices depend on: FP8, expert dispatch, weight split and kept inputs."""
        return runtime.fp8, runtime.ep_dedup, runtime.tp_sharded_weights, runtime.tp_grad_overlap

    def prices_for(self, runtime: RuntimeOptions) -> bool:
        """Whether this table's prices hold for `runtime` (`pricing_key`)."""
        return (self.fp8, self.ep_dedup, self.sharded_weights, self.regathers_inputs) == self.pricing_key(runtime)

    def prices(self, device: DeviceSpec, *, tp: int, tp_stride: int, sequence_parallel: bool,
               microbatch_size: int, token_divisor: int = 1) -> ClassPrices:
        """Prices for a micro-batch of `microbatch_size` samples of which the tp group holds 1 / `token_divisor`
        of every sample's tokens."""
        key = (device.name, tp, tp_stride, sequence_parallel, microbatch_size, token_divisor)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._price(device, tp, tp_stride, sequence_parallel, microbatch_size, token_divisor)
            self._cache[key] = hit
        return hit

    def is_cached(self, device: DeviceSpec, *, tp: int, tp_stride: int, sequence_parallel: bool,
                  microbatch_size: int) -> bool:
        return (device.name, tp, tp_stride, sequence_parallel, microbatch_size, 1) in self._cache

    def rank_prices(self, device: DeviceSpec, *, tp: int, tp_stride: int, sequence_parallel: bool,
                    microbatch_size: int, cp: int = 1) -> ClassPrices:
        """Prices of what one context-parallel rank of `cp` runs for a micro-batch (its sharding is the one the
        runtime applies): exactly the work of microbatch_size / cp whole samples (`costmodel.context_parallel`),
        priced at that many samples when cp divides the micro-batch (shared with cp = 1 prices), else at the
        micro-batch with 1 / cp of every sample's tokens."""
        divides = microbatch_size % cp == 0
        return self.prices(device, tp=tp, tp_stride=tp_stride, sequence_parallel=sequence_parallel,
                           microbatch_size=microbatch_size // cp if divides else microbatch_size,
                           token_divisor=1 if divides else cp)

    def segment_costs(self, device: DeviceSpec, *, tp: int, tp_stride: int, sequence_parallel: bool,
                      microbatch_size: int, split: AxisSplit | None = None) -> tuple[LayerCost, ...]:
        """One `LayerCost` per chain segment (segments of a class share the object); `split` adds context and
        expert parallelism, and prices routed experts as they run (`costmodel.expert_parallel`). Without a
        split, routed experts get `expert_parallel.bound_cost`: below their price at every ep, for the
        search's lower bounds."""
        prices = self.prices(device, tp=tp, tp_stride=tp_stride, sequence_parallel=sequence_parallel,
                             microbatch_size=microbatch_size)
        if split is None and self.has_experts:
            key = (device.name, tp, tp_stride, sequence_parallel, microbatch_size, None)
            costs = self._split_cache.get(key)
            if costs is None:
                costs = self._split_cache[key] = self._bound(device, prices, microbatch_size, tp)
            return tuple(costs[s.class_id] for s in self.chain.segments)
        if split is not None and (split.cp > 1 or split.ep > 1 or self.has_experts):  # on top of the tp prices
            key = (device.name, tp, tp_stride, sequence_parallel, microbatch_size, split)
            costs = self._split_cache.get(key)
            if costs is None:
                costs = self._split_cache[key] = self._split(device, tp, tp_stride, sequence_parallel,
                                                             microbatch_size, split)
            return tuple(costs[s.class_id] for s in self.chain.segments)
        return tuple(prices.costs[s.class_id] for s in self.chain.segments)

    def _split(self, device: DeviceSpec, tp: int, tp_stride: int, sp: bool, mbs: int, split: AxisSplit
               ) -> dict[int, LayerCost]:
        from costmodel.context_parallel import context_parallel_cost
        from costmodel.expert_parallel import ExpertSetting, expert_cost

        out: dict[int, LayerCost] = {}
        batch = self.chain.graph.batch_size
        prices = self.rank_prices(device, tp=tp, tp_stride=tp_stride, sequence_parallel=sp, microbatch_size=mbs,
                                  cp=split.cp)
        for cid, cost in prices.costs.items():
            segment = self.chain.representative(cid)
            nodes = self.chain.nodes_of(segment)
            cost = context_parallel_cost(cost, nodes, device, self.cluster, cp=split.cp,
                                         group=type_group(self.cluster, device.name, split.cp, split.cp_stride),
                                         concurrent=split.num_devices // split.cp, microbatch_size=mbs,
                                         traced_batch=batch, tp=tp, dtype=self.dtype, profile=self.profile)
            setting = ExpertSetting(
                ep=split.ep, microbatch_size=mbs, traced_batch=batch,
                traced_dtype=self.chain.graph.dtype, dtype=self.dtype, token_divisor=split.cp,
                group=type_group(self.cluster, device.name, split.ep, split.ep_stride),
                concurrent=split.num_devices // split.ep, imbalance=self.expert_imbalance, dedup=self.ep_dedup,
                tp=tp, tp_group=type_group(self.cluster, device.name, tp, tp_stride),
                tp_concurrent=split.num_devices // tp, fp8=self.fp8)
            out[cid] = expert_cost(cost, self.expert_layer(cid), device, self.cluster, setting=setting,
                                   segment_params=segment.param_count, profile=self.profile)
        return out

    def _bound(self, device: DeviceSpec, prices: ClassPrices, mbs: int, tp: int) -> dict[int, LayerCost]:
        from costmodel.expert_parallel import ExpertSetting, bound_cost

        setting = ExpertSetting(ep=1, microbatch_size=mbs, traced_batch=self.chain.graph.batch_size,
                                traced_dtype=self.chain.graph.dtype, dtype=self.dtype,
                                imbalance=self.expert_imbalance, tp=tp, fp8=self.fp8)
        return {cid: bound_cost(cost, self.expert_layer(cid), device, setting, self.profile)
                for cid, cost in prices.costs.items()}

    def expert_layer(self, class_id: int) -> Any:
        """The routed experts of a layer class (`expert_parallel.expert_layer`), found once."""
        if class_id not in self._expert_layers:
            from costmodel.expert_parallel import expert_layer

            self._expert_layers[class_id] = expert_layer(self.chain.nodes_of(self.chain.representative(class_id)))
        return self._expert_layers[class_id]

    @property
    def has_experts(self) -> bool:
        """Whether the chain has routed experts (priced on top of the per-class prices)."""
        if self._has_experts is None:
            from costmodel.expert_parallel import num_experts

            self._has_experts = num_experts(self.chain.graph.nodes) is not None
        return self._has_experts

    @property
    def expert_imbalance(self) -> float:
        from costmodel.expert_parallel import EXPERT_IMBALANCE

        return self.cluster.expert_imbalance or EXPERT_IMBALANCE

    def _price(self, device: DeviceSpec, tp: int, tp_stride: int, sp: bool, mbs: int, divisor: int
               ) -> ClassPrices:
        costs: dict[int, LayerCost] = {}
        sharding: dict[int, tuple[ModuleSharding, ...]] = {}
        for cid in sorted({s.class_id for s in self.chain.segments}):
            segment = self.chain.representative(cid)
            self.solves += 1
            if tp == 1:
                costs[cid] = price_segment(self.chain, segment, device, microbatch_size=mbs, dtype=self.dtype,
                                           profile=self.profile, fp8=self.fp8, token_divisor=divisor)
                sharding[cid] = ()
                continue
            from planner.search.intra_op import ShardingCache, solve_layer_sharding

            if self._sharding_cache is None:
                self._sharding_cache = ShardingCache()
            solved = solve_layer_sharding(
                self.chain.nodes_of(segment), self.cluster, device, tp=tp,
                tp_group=type_group(self.cluster, device.name, tp, tp_stride),
                microbatch_size=mbs, traced_batch=self.chain.graph.batch_size, sequence_parallel=sp,
                dtype=self.dtype, cache=self._sharding_cache, profile=self.profile, fp8=self.fp8,
                token_divisor=divisor, sharded_weights=self.sharded_weights)
            owned = owned_param_tensors(self.chain, segment)
            cost = _without_earlier_params(solved.cost, segment.param_count, self.chain.nodes_of(segment))
            # The layer's glue between its ops (module calls, Python) is paid whole on every tp rank.
            glue = segment_glue(segment, device, microbatch_size=mbs, dtype=self.dtype, profile=self.profile)
            if self.regathers_inputs:
                cost = cost.regathered()
            costs[cid] = dataclasses.replace(
                cost, param_tensors=owned, dtensor_param_tensors=min(cost.dtensor_param_tensors, owned),
                fwd_compute_s=cost.fwd_compute_s + glue.forward_s, bwd_compute_s=cost.bwd_compute_s + glue.backward_s,
                recompute_full_s=cost.recompute_full_s + glue.forward_s,
                weight_grad_share=weight_grad_share(self.chain.nodes_of(segment)),
                # a tensor-parallel rank holds 1/tp of each weight, column- or row-sharded alike
                **fp8_fields(self.chain.nodes_of(segment), device, self.fp8, param_scale=1 / tp, dtype=self.dtype))
            sharding[cid] = tuple(solved.module_styles())
        return ClassPrices(costs, sharding)


def _without_earlier_params(cost: LayerCost, chain_params: int, nodes: Sequence[Node]) -> LayerCost:
    """Drop parameters an earlier segment owns (a tied LM head reuses the embedding table).

    The chain counts a shared parameter once, in the first segment that uses it, and `costmodel.estimate` adds the
    copy the last pipeline stage keeps; the ILP sees only this segment's nodes and would count it again. Scaling
    by the owned fraction is exact when, as for the tied head, the foreign parameter is the segment's only large
    one."""
    seen: dict[str, int] = {}
    for node in nodes:
        for name, spec in zip(node.param_names, node.param_specs, strict=False):
            seen.setdefault(name, spec.numel)
    used = sum(seen.values())
    if used <= chain_params or used == 0:
        return cost
    keep = chain_params / used
    return dataclasses.replace(cost, param_count=round(cost.param_count * keep),
                               param_bytes=round(cost.param_bytes * keep),
                               grad_sync_bytes=round(cost.grad_sync_bytes * keep))


def class_prefixes(chain: LayerChain) -> dict[int, str]:
    """Per class, the module path that owns its segments with differing components as "*" ("blocks.*").

    Module styles come back relative to a segment's owning module (`costmodel.sharding.layout.module_prefix`); this is
    that prefix generalized over every segment of the class, so one pattern covers blocks.0 .. blocks.95."""
    from costmodel.sharding.layout import module_prefix

    prefixes: dict[int, list[list[str]]] = {}
    for s in chain.segments:
        prefixes.setdefault(s.class_id, []).append(module_prefix(chain.nodes_of(s)).split("."))
    out: dict[int, str] = {}
    for cid, members in prefixes.items():
        first = members[0]
        if all(len(m) == len(first) for m in members):
            out[cid] = ".".join(p if all(m[i] == p for m in members) else "*" for i, p in enumerate(first))
        else:
            out[cid] = ".".join(first)
    return out


def module_sharding(chain: LayerChain, prices: ClassPrices) -> tuple[ModuleSharding, ...]:
    """Full-path module styles of the whole model: each class's relative styles under its prefix pattern.

    Entries are unique and sorted by module pattern so plans are deterministic."""
    prefixes = class_prefixes(chain) if any(prices.sharding.values()) else {}
    seen: dict[str, ModuleSharding] = {}
    for cid in sorted(prices.sharding):
        for ms in prices.sharding[cid]:
            prefix = prefixes[cid]
            module = f"{prefix}.{ms.module}" if prefix and ms.module else (ms.module or prefix)
            if module and module not in seen:
                seen[module] = ModuleSharding(module=module, style=ms.style)
    return tuple(seen[k] for k in sorted(seen))
