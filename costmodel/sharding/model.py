"""The priced sharding model of one segment: each node's options (strategies with their per-device prices), each
tensor's moves, and what an assignment of options costs (`ShardingModel.objective_s`, its integer problem for
the ILP, and its `LayerCost`). `costmodel.sharding.cost` builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from costmodel.framework import ZERO_PASS, PassCost
from costmodel.layer_cost import LayerCost
from costmodel.memory import GRAD_BYTES, OPTIMIZER_BYTES_MIXED
from costmodel.operators import GEMM_KINDS
from costmodel.sharding.layout import REPLICATED, Layout, Move, grad_layout_of, local_fraction, redistribution
from costmodel.sharding.problem import FIXED, NO_GRAD, ProblemFlow, ShardingProblem, to_units
from costmodel.sharding.rules import NodeStrategy
from ir.graph import Node

BYTES_PER_PARAM_MIXED_ADAM = 2 + GRAD_BYTES + OPTIMIZER_BYTES_MIXED
"""bf16 weight (2) + fp32 gradient (`memory.GRAD_BYTES`, as Megatron-LM and FSDP2 keep it) + fp32 master weight,
momentum, variance (12; Rajbhandari et al. 2020, ZeRO §3.1, the "K = 12" of mixed-precision Adam): the bytes
`costmodel.memory.model_state_bytes` counts per unsharded parameter."""

NodeTimeFn = Callable[[Node, float, float, float], tuple[float, float]]
"""(node, flops scale, activation-bytes scale, parameter-bytes scale) -> (forward s, backward s), as
`costmodel.operators.node_time`."""
CastTimeFn = Callable[[Node, float, float, float], tuple[float, float]]
"""(node, input share, output-gradient share, parameter share) -> (forward s, backward s) of an FP8-converted
linear's operand casts (`costmodel.operators.fp8_cast_times`); (0, 0) for any other node."""
MoveTimeFn = Callable[[Move, float], float]
"""(move, logical tensor bytes) -> seconds over the tensor-parallel group."""


@dataclass(frozen=True, slots=True)
class Pricer:
    """How a sharding model prices work: compute per node, moves over the tensor-parallel group."""

    node_time: NodeTimeFn
    move_time: MoveTimeFn
    sharded_module: PassCost = ZERO_PASS
    """Framework overhead of one call of a module that runs sharded (DTensor dispatch and layout hooks,
    `costmodel.framework`): added to every node with parameters whose strategy is not replicated."""
    grad_sync_per_tensor_s: float = 0.0
    """Measured seconds per partial-gradient tensor of the step's flat gradient sync (`costmodel.framework`),
    added to the all-reduce of its bytes (as `step_time.tp_grad_sync_time` prices it)."""
    fp8_cast_time: CastTimeFn | None = None
    """With FP8 linear layers: their operand casts, priced per operand's own share (`node_time` then leaves
    them out)."""


@dataclass(frozen=True, slots=True)
class NodeOption:
    """A strategy of one node with its per-device prices for one micro-batch."""

    strategy: NodeStrategy
    fwd_s: float
    bwd_s: float
    extra_fwd_comm_s: float
    param_locals: tuple[int, ...]
    """Elements of each parameter held by one device."""
    param_local_bytes: tuple[float, ...]
    """Bytes of each parameter held by one device, in the priced dtype."""
    saved_bytes: int
    grad_sync_bytes: int
    grad_sync_s: float
    """Gradient all-reduce of replicated parameters whose gradients are partial, per micro-batch (once per step,
    spread over the step's micro-batches)."""
    out_bytes: int
    memory_weight: float
    saved_whole_inputs: tuple[float, ...] = ()
    """Per input, bytes this strategy saves of it whole (a replicated input saved for backward), else 0."""

    @property
    def param_count(self) -> int:
        return sum(self.param_locals)

    @property
    def memory_bytes(self) -> int:
        return self.param_count * BYTES_PER_PARAM_MIXED_ADAM + self.saved_bytes

    @property
    def objective_s(self) -> float:
        return (self.fwd_s + self.bwd_s + self.extra_fwd_comm_s + self.grad_sync_s
                + self.memory_weight * self.memory_bytes)


@dataclass(frozen=True, slots=True)
class Reader:
    """One use of a tensor: input ``input_index`` of node ``node``, or the segment boundary (node FIXED)."""

    node: int
    input_index: int
    layouts: tuple[Layout, ...]
    grads: tuple[Layout | None, ...]


@dataclass(frozen=True, slots=True)
class Flow:
    """A tensor of the segment: its layouts per option and the price of each move, in seconds."""

    name: str
    nbytes: float
    """Logical bytes for the priced micro-batch."""
    source: int
    source_layouts: tuple[Layout, ...]
    needs_grad: bool
    readers: tuple[Reader, ...]
    forward_s: tuple[tuple[Layout, Layout, float], ...]
    backward_s: tuple[tuple[Layout, Layout, float], ...]
    forbidden: tuple[tuple[Layout, Layout], ...] = ()
    """(written, wanted) pairs no op of the segment may read it in (`costmodel.sharding.layout.allowed_inside`)."""

    def _pick(self, node: int, table: Sequence[Layout | None], assignment: Sequence[int]) -> Layout | None:
        return table[0] if node == FIXED else table[assignment[node]]

    def pairs(self, assignment: Sequence[int]) -> tuple[set[tuple[Layout, Layout]], set[tuple[Layout, Layout]]]:
        """Distinct (written, wanted) layout pairs in forward and (produced, expected) gradient pairs in backward."""
        a = self._pick(self.source, self.source_layouts, assignment)
        assert a is not None
        fwd: set[tuple[Layout, Layout]] = set()
        bwd: set[tuple[Layout, Layout]] = set()
        for r in self.readers:
            wanted = self._pick(r.node, r.layouts, assignment)
            assert wanted is not None
            fwd.add((a, wanted))
            g = self._pick(r.node, r.grads, assignment)
            if self.needs_grad and g is not None:
                bwd.add((g, grad_layout_of(a)))
        return fwd, bwd

    def times(self, assignment: Sequence[int]) -> tuple[float, float]:
        fwd_pairs, bwd_pairs = self.pairs(assignment)
        fwd = {(x, y): c for x, y, c in self.forward_s}
        bwd = {(x, y): c for x, y, c in self.backward_s}
        # sorted: float sums in a fixed order, whatever the process's hash seed
        return (sum(fwd.get(p, 0.0) for p in sorted(fwd_pairs)), sum(bwd.get(p, 0.0) for p in sorted(bwd_pairs)))


@dataclass(frozen=True)
class ShardingModel:
    """One segment priced for one tensor-parallel degree: every node's options and every tensor's moves."""

    nodes: tuple[Node, ...]
    tp: int
    sequence_parallel: bool
    options: tuple[tuple[NodeOption, ...], ...]
    flows: tuple[Flow, ...]
    inputs_saved_bytes: int
    """Per-device bytes of the segment's activation inputs (what full recomputation keeps)."""
    boundary_bytes: int
    """Per-device bytes of the segment's outputs in the boundary layout (what a pipeline cut after it sends)."""
    recompute_region: frozenset[int] = frozenset()
    """Nodes selective recomputation drops and reruns (`layer_pricing.selective_recompute_region`)."""
    loss_inputs: frozenset[int] = frozenset()
    """Nodes whose output the training loss reads (`training_loss.loss_inputs`)."""
    op_kept: frozenset[int] = frozenset()
    """Nodes whose outputs per-op selective checkpointing keeps (`layer_pricing.op_policy_kept`)."""
    region_reads: tuple[tuple[int, int, float], ...] = ()
    """(node, input index, full bytes) of each tensor the region reads from outside it, once per tensor: what
    selective recomputation keeps instead."""

    def problem(self) -> ShardingProblem:
        """The same model with layouts numbered and prices in integer picoseconds, for the ILP."""
        layouts = sorted({lay for f in self.flows for lay in _flow_layouts(f)})
        index = {lay: i for i, lay in enumerate(layouts)}

        def ids(seq: Sequence[Layout | None]) -> tuple[int, ...]:
            return tuple(NO_GRAD if lay is None else index[lay] for lay in seq)

        flows = []
        for f in self.flows:
            no_grads = (None,)
            flows.append(ProblemFlow(
                source=f.source, source_layouts=ids(f.source_layouts),
                source_grads=ids([grad_layout_of(a) if f.needs_grad else None for a in f.source_layouts]),
                readers=tuple(r.node for r in f.readers),
                reader_layouts=tuple(ids(r.layouts) for r in f.readers),
                reader_grads=tuple(ids(r.grads if f.needs_grad else no_grads * len(r.grads)) for r in f.readers),
                forward=tuple((index[x], index[y], to_units(c)) for x, y, c in f.forward_s if to_units(c) > 0),
                backward=tuple((index[x], index[y], to_units(c)) for x, y, c in f.backward_s if to_units(c) > 0),
                forbidden=tuple((index[x], index[y]) for x, y in f.forbidden),
            ))
        costs = tuple(tuple(to_units(o.objective_s) for o in opts) for opts in self.options)
        return ShardingProblem(node_costs=costs, flows=tuple(flows))

    def objective_s(self, assignment: Sequence[int]) -> float:
        total = sum(self.options[n][s].objective_s for n, s in enumerate(assignment))
        return total + sum(sum(f.times(assignment)) for f in self.flows)

    def strategies(self, assignment: Sequence[int]) -> tuple[NodeStrategy, ...]:
        return tuple(self.options[n][s].strategy for n, s in enumerate(assignment))

    def choices(self, assignment: Sequence[int]) -> tuple[tuple[str, str], ...]:
        """(node name, strategy name) per node, in node order."""
        return tuple((node.name, st.name) for node, st in zip(self.nodes, self.strategies(assignment), strict=True))

    def comm_moves(self, assignment: Sequence[int]) -> tuple[tuple[str, str, Move], ...]:
        """Every collective the assignment runs: (tensor, "forward"/"backward", move), local moves left out."""
        found = []
        for f in self.flows:
            fwd, bwd = f.pairs(assignment)
            for direction, pairs in (("forward", fwd), ("backward", bwd)):
                for src, dst in sorted(pairs):
                    found.extend((f.name, direction, m) for m in redistribution(src, dst) if not m.startswith("local"))
        for node, st in zip(self.nodes, self.strategies(assignment), strict=True):
            found.extend((node.name, "forward", m) for m, _ in st.extra_forward)
        return tuple(found)

    def gathered_input_savings(self, assignment: Sequence[int]) -> dict[int, float]:
        """Per node, the bytes it would not keep if an input it saves whole after an all-gather from a shard were
        kept as the shard: Megatron-LM's linear does that and gathers it again in backward, overlapped with the
        gradient GEMMs (Korthikanti et al. 2022, §4.2.2; the "34 / t" of DESIGN.md's activation formula under
        sequence parallelism); DTensor keeps the gathered tensor (`LayerCost.regathered`). The re-gather is not
        charged: Megatron hides it behind computation."""
        saving: dict[int, float] = {}
        for f in self.flows:
            a = f.source_layouts[0 if f.source == FIXED else assignment[f.source]]
            if not a.is_shard:
                continue
            for r in f.readers:
                if r.node == FIXED or r.layouts[assignment[r.node]] != REPLICATED:
                    continue
                whole = self.options[r.node][assignment[r.node]].saved_whole_inputs[r.input_index]
                saving[r.node] = saving.get(r.node, 0.0) + whole * (1 - 1 / self.tp)
        return saving

    def async_grad_hidden_s(self, assignment: Sequence[int]) -> float:
        """Backward seconds of tensor-parallel communication that a trainer running each column-parallel
        linear's input-gradient reduction during its weight-gradient GEMM hides (`RuntimeOptions.tp_grad_overlap`):
        per tensor and gradient move, min(the move, the weight-gradient GEMMs of the linears whose gradient it
        reduces). dW = X^T dY has the forward GEMM's FLOPs and shape class, so each window is the linear's forward
        time."""
        hidden = 0.0
        for f in self.flows:
            if not f.needs_grad:
                continue
            written = grad_layout_of(f.source_layouts[0 if f.source == FIXED else assignment[f.source]])
            windows: dict[tuple[Layout, Layout], float] = {}
            for r in f.readers:
                if r.node == FIXED:
                    continue
                grad, node = r.grads[assignment[r.node]], self.nodes[r.node]
                if grad is not None and node.op_kind in GEMM_KINDS and node.param_specs:
                    pair = (grad, written)
                    windows[pair] = windows.get(pair, 0.0) + self.options[r.node][assignment[r.node]].fwd_s
            moves = {(x, y): c for x, y, c in f.backward_s}
            hidden += sum(min(moves.get(pair, 0.0), window) for pair, window in sorted(windows.items()))
        return hidden

    def loss_input_bytes(self, assignment: Sequence[int]) -> float:
        """Local bytes of the outputs the training loss reads (`out_bytes` counts output and gradient)."""
        return sum(self.options[n][assignment[n]].out_bytes / 2 for n in self.loss_inputs)

    def layer_cost(self, assignment: Sequence[int]) -> LayerCost:
        """The LayerCost of one micro-batch on one device under the given assignment."""
        chosen = [self.options[n][s] for n, s in enumerate(assignment)]
        fwd_comm = sum(o.extra_fwd_comm_s for o in chosen)
        bwd_comm = 0.0
        for f in self.flows:
            fc, bc = f.times(assignment)
            fwd_comm += fc
            bwd_comm += bc
        fwd = sum(o.fwd_s for o in chosen)
        count, nbytes = _unique_param_totals(self.nodes, chosen)
        shards = self.gathered_input_savings(assignment)
        saved = round(sum(o.saved_bytes for o in chosen))
        kept = sum(b * local_fraction(chosen[n].strategy.inputs[k], self.tp) for n, k, b in self.region_reads)
        selective = kept + sum(o.saved_bytes for n, o in enumerate(chosen) if n not in self.recompute_region)
        regathered_selective = sum(v for n, v in shards.items() if n not in self.recompute_region)
        dtensors, syncs = _tensor_counts(self.nodes, chosen)
        return LayerCost(
            fwd_compute_s=fwd, bwd_compute_s=sum(o.bwd_s for o in chosen),
            fwd_comm_s=fwd_comm, bwd_comm_s=bwd_comm, bwd_comm_async_s=self.async_grad_hidden_s(assignment),
            param_count=count, param_bytes=nbytes,
            saved_bytes_none=saved,
            saved_bytes_selective=min(round(selective), saved),
            regathered_bytes_none=round(sum(shards.values())),
            regathered_bytes_selective=round(min(regathered_selective, selective)),
            saved_bytes_full=min(self.inputs_saved_bytes, saved),
            recompute_selective_s=sum(o.fwd_s for n, o in enumerate(chosen) if n in self.recompute_region),
            recompute_full_s=fwd + fwd_comm,
            boundary_bytes=self.boundary_bytes,
            grad_sync_bytes=sum(o.grad_sync_bytes for o in chosen),
            peak_temp_bytes=max((o.out_bytes for o in chosen), default=0),
            dtensor_param_tensors=dtensors, grad_sync_tensors=syncs,
            # out_bytes counts the output and its gradient; the policy keeps the output.
            saved_bytes_op=min(self.inputs_saved_bytes + sum(chosen[n].out_bytes // 2 for n in self.op_kept), saved),
            recompute_op_s=sum(o.fwd_s for n, o in enumerate(chosen) if n not in self.op_kept) + fwd_comm,
        )


def _flow_layouts(f: Flow) -> list[Layout]:
    found: list[Layout] = list(f.source_layouts) + [grad_layout_of(a) for a in f.source_layouts]
    for r in f.readers:
        found.extend(r.layouts)
        found.extend(g for g in r.grads if g is not None)
    return found


def _tensor_counts(nodes: Sequence[Node], chosen: Sequence[NodeOption]) -> tuple[int, int]:
    """(parameter tensors of nodes running a sharded strategy -- DTensors at run time --, tensors whose
    gradients are partial over the group and need the sync); a tied parameter counts once."""
    dtensors: set[str] = set()
    syncs: set[str] = set()
    for node, opt in zip(nodes, chosen, strict=True):
        st = opt.strategy
        if st.is_replicated:
            continue
        for i, dim in enumerate(st.param_dims):
            key = node.param_names[i] if i < len(node.param_names) else f"{node.name}.{i}"
            dtensors.add(key)
            if dim is None and st.output.is_shard:
                syncs.add(key)
    return len(dtensors), len(syncs)


def _unique_param_totals(nodes: Sequence[Node], chosen: Sequence[NodeOption]) -> tuple[int, int]:
    """Per-device parameter count and bytes; a parameter used by several nodes (tied weights) counts once."""
    seen: set[str] = set()
    count, nbytes = 0, 0.0
    for node, opt in zip(nodes, chosen, strict=True):
        for i in range(len(node.param_specs)):
            key = node.param_names[i] if i < len(node.param_names) else f"{node.name}.{i}"
            if key in seen:
                continue
            seen.add(key)
            count += opt.param_locals[i]
            nbytes += opt.param_local_bytes[i]
    return count, round(nbytes)
