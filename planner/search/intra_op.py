"""Intra-operator sharding: choose every op's tensor-parallel strategy in one layer with an ILP (OR-Tools CP-SAT).

Formulation
-----------
``costmodel.sharding.cost.build_sharding_model`` prices a segment; its integer form
``costmodel.sharding.problem.ShardingProblem`` has nodes ``n`` with options ``s`` (strategies) of cost ``c[n, s]``
(compute + per-step gradient sync + memory_weight * memory, in picoseconds), and flows (tensors) ``f`` written by
a source and read by readers, with a forward price ``F_f(a, l)`` per pair (layout written, layout wanted), a
backward price ``B_f(e, g)`` per pair (gradient layout the source expects, gradient layout a reader produces), and
forbidden pairs (moves that cannot happen between two ops of a segment, ``costmodel.sharding.layout.allowed_inside``).
Sources and readers fixed by the segment boundary have one option. One function per family below:

* choice (``_add_choices``):  ``x[n, s] in {0, 1}``,  ``sum_s x[n, s] = 1``  for every node;
* layout indicators (linear expressions, no variables): ``W_f[a] = sum {x[src, s] : src writes a under s}``,
  ``L_fr[l] = sum {x[r, s] : r wants l under s}``, and alike for gradient layouts;
* pair products (``_pair_indicators``), per flow and node reader: ``p_fr[a, l] in {0, 1}`` with
  ``sum_l p_fr[a, l] = W_f[a]`` and ``sum_a p_fr[a, l] = L_fr[l]`` -- the transportation form of
  ``p = W * L``: exact on 0/1 points, and its LP relaxation is much tighter than ``p >= W + L - 1`` (a 4x faster
  proof on a GPT block). A fixed side needs no variable: the product is the other side's indicator;
* moves paid once (``_add_moves``): ``m_f[a, l] >= p_fr[a, l]`` for every reader ``r``: a tensor is moved once
  per distinct target layout however many nodes read it there (and in backward, gradients arriving in the same
  layout are summed locally and moved once); a flow with one reader uses ``p`` itself;
* forbidden moves (``_add_forbidden_moves``): ``W_f[a] + L_fr[l] <= 1`` for every forbidden pair and node reader.

Objective: minimize ``sum c[n, s] x[n, s] + sum_f sum F_f(a, l) m_f[a, l] + sum_f sum B_f(e, g) m'_f[e, g]``. All
prices are non-negative, so at the optimum each ``m`` equals the OR it bounds and the objective equals
``ShardingProblem.objective`` of the chosen assignment (checked after every solve, with feasibility). Pairs with
zero price get no variable. The replicated assignment (every node's option 0) never needs a forbidden move, so a
built model is always feasible; it is given as a hint.

Scaling: costs count picoseconds, so an extreme layer (a batch of 10^12 samples, a sequence of 10^7 tokens) can
price a segment past what CP-SAT's int64 arithmetic and the double it reports the objective in hold exactly
(2^53). ``_scaled`` then divides every cost by one integer factor so that no assignment costs more than
``MAX_OBJECTIVE``; the solve is exact for the scaled costs, each rounded by at most half the factor, a relative
error below 1e-12 of the objective, and the reported objective is the original problem's.

Determinism: one worker, a fixed seed, and the limit in CP-SAT's *deterministic* time, so the same problem gives
the same assignment on any machine. Identical layers (same structural key) are solved once per setting through a
``ShardingCache`` the caller passes in (never a global); settings that price the same tokens (a micro-batch of 2
split over a context-parallel group of 2, a micro-batch of 1 whole) are one setting.

Reuse: the variables and constraints above depend on the problem's structure (options, layouts, readers, which
pairs are priced), not on its prices, and a layer's settings (tp, micro-batch size, context split) share a handful
of structures (12 for DeepSeek-V3's 216 settings). The cache keeps one CP-SAT model per structure and a new problem
of that structure only sets its objective, which gives the model a fresh build would make, variable for variable:
the same proto, hence the same assignment whatever was solved before.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ortools.sat.python import cp_model

from costmodel.float8 import Float8Recipe
from costmodel.framework import FrameworkCosts
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.collectives import CommGroup
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_cost import LayerCost
from costmodel.profile_db import OpProfile
from costmodel.sharding.cost import (
    DEFAULT_MEMORY_WEIGHT,
    build_sharding_model,
    default_outputs,
    make_pricer,
    structural_key,
)
from costmodel.sharding.layout import module_prefix, relative_module
from costmodel.sharding.model import ShardingModel
from costmodel.sharding.problem import FIXED, NO_GRAD, UNITS_PER_SECOND, ProblemFlow, ShardingProblem
from costmodel.sharding.rules import Style
from costmodel.training_loss import with_training_loss
from ir.graph import Node
from planner.errors import UserError
from planner.plan import ModuleSharding

MAX_OBJECTIVE = 2**50
"""Largest objective the CP-SAT model may reach: exact in the double CP-SAT reports, far from int64 overflow."""

DEFAULT_TIME_LIMIT = 20.0
"""CP-SAT deterministic-time limit per solve (its "deterministic seconds", about wall seconds on one core)."""


_INFEASIBLE = ("no sharding of these {n} ops is feasible: some op cannot read its input in any layout reachable "
               "inside the segment; allow its replicated strategy or lower tp")


class SolveStatus(enum.StrEnum):
    OPTIMAL = "optimal"      # proven optimal
    FEASIBLE = "feasible"    # best found before the limit; `lower_bound` bounds the optimum
    TRIVIAL = "trivial"      # every node has one option (tp == 1): nothing to solve


class IntraOpInfeasibleError(UserError):
    """The sharding ILP returned no assignment; the message says what to relax."""


@dataclass(frozen=True, slots=True)
class Solution:
    """An assignment (option index per node) with its objective and the solver's proof status."""

    assignment: tuple[int, ...]
    objective: int
    lower_bound: int
    status: SolveStatus


# ----------------------------------------------------------------------------------------------------------------
# The CP-SAT model, one function per constraint family
# ----------------------------------------------------------------------------------------------------------------

def _add_choices(model: cp_model.CpModel, problem: ShardingProblem) -> list[list[cp_model.IntVar]]:
    x = []
    for n, costs in enumerate(problem.node_costs):
        row = [model.NewBoolVar(f"x_{n}_{s}") for s in range(len(costs))]
        model.AddExactlyOne(row)
        model.AddHint(row[0], 1)  # option 0 is the replicated strategy: always feasible
        for v in row[1:]:
            model.AddHint(v, 0)
        x.append(row)
    return x


def _indicator(x: Sequence[Sequence[cp_model.IntVar]], node: int, table: Sequence[int],
               value: int) -> cp_model.LinearExprT | None:
    """1 when `node`'s chosen option maps to `value` in `table`; None when it never does."""
    if node == FIXED:
        return 1 if table[0] == value else None
    picked = [x[node][s] for s, v in enumerate(table) if v == value]
    return cp_model.LinearExpr.Sum(picked) if picked else None


def _values(table: Sequence[int]) -> list[int]:
    return sorted(set(table) - {NO_GRAD})


def _pair_indicators(model: cp_model.CpModel, x: Sequence[Sequence[cp_model.IntVar]], tag: str, source: int,
                     source_table: Sequence[int], reader: int, reader_table: Sequence[int],
                     wanted: set[tuple[int, int]]) -> dict[tuple[int, int], cp_model.LinearExprT]:
    """0/1 expressions p[u, v] = [source shows u] * [reader shows v] for the pairs in `wanted`, linearized over the
    whole pair table: sum_v p[u, v] <= W[u] and sum_u p[u, v] = L[v] (the transportation form: exact on 0/1
    points and much tighter in the LP relaxation than p >= W + L - 1). A fixed side needs no variables."""
    src = {u: _indicator(x, source, source_table, u) for u in _values(source_table)}
    dst = {v: _indicator(x, reader, reader_table, v) for v in _values(reader_table)}
    if source == FIXED or reader == FIXED:  # the product is the other side's indicator
        return {(u, v): (dst[v] if source == FIXED else src[u]) for u, v in wanted if u in src and v in dst}
    p = {(u, v): model.NewBoolVar(f"{tag}_{u}_{v}") for u in src for v in dst}
    may_lack = NO_GRAD in reader_table
    for u, w_u in src.items():
        row = cp_model.LinearExpr.Sum([p[u, v] for v in dst])
        model.Add(row <= w_u) if may_lack else model.Add(row == w_u)
    for v, l_v in dst.items():
        model.Add(cp_model.LinearExpr.Sum([p[u, v] for u in src]) == l_v)
    return {key: p[key] for key in wanted if key in p}


def _add_moves(model: cp_model.CpModel, x: Sequence[Sequence[cp_model.IntVar]], tag: str, source: int,
               source_table: Sequence[int], readers: Sequence[int], reader_tables: Sequence[Sequence[int]],
               priced: set[tuple[int, int]]) -> list[tuple[tuple[int, int], cp_model.LinearExprT]]:
    """(pair, 0/1 expression) of one flow in one direction: each priced (source value, reader value) pair is paid
    once, when any reader realizes it (m[u, v] >= p_r[u, v] for every reader r); the caller attaches its cost."""
    if not priced or all(v == NO_GRAD for v in source_table):
        return []
    per_reader = [_pair_indicators(model, x, f"{tag}_r{i}", source, source_table, r, table, priced)
                  for i, (r, table) in enumerate(zip(readers, reader_tables, strict=True))]
    terms = []
    for key in sorted(priced):
        realized = [ind[key] for ind in per_reader if key in ind]
        if not realized:
            continue
        if len(realized) == 1:
            terms.append((key, realized[0]))
            continue
        m = model.NewBoolVar(f"{tag}_m_{key[0]}_{key[1]}")
        for ind in realized:
            model.Add(m >= ind)
        terms.append((key, m))
    return terms


def _add_forbidden_moves(model: cp_model.CpModel, x: Sequence[Sequence[cp_model.IntVar]], f: ProblemFlow) -> None:
    """No op of the segment reads a tensor in a layout its writer's layout cannot reach there:
    W[a] + L_r[l] <= 1 for every forbidden pair (a, l) and node reader r."""
    for a, lay in f.forbidden:
        written = _indicator(x, f.source, f.source_layouts, a)
        if written is None:
            continue
        for r, table in zip(f.readers, f.reader_layouts, strict=True):
            wanted = _indicator(x, r, table, lay) if r != FIXED else None
            if wanted is not None:
                model.Add(written + wanted <= 1)


def _forward_prices(f: ProblemFlow) -> dict[tuple[int, int], int]:
    """Forward pairs (layout the source writes, layout a reader wants) with their prices."""
    return {(a, lay): c for a, lay, c in f.forward}


def _backward_prices(f: ProblemFlow) -> dict[tuple[int, int], int]:
    """Backward pairs (gradient layout the source expects, gradient layout a reader produces) with their prices."""
    return {(e, g): c for g, e, c in f.backward}


def _add_forward_moves(model: cp_model.CpModel, x: Sequence[Sequence[cp_model.IntVar]], f: ProblemFlow,
                       k: int) -> list[tuple[tuple[int, int], cp_model.LinearExprT]]:
    return _add_moves(model, x, f"f{k}", f.source, f.source_layouts, f.readers, f.reader_layouts,
                      set(_forward_prices(f)))


def _add_backward_moves(model: cp_model.CpModel, x: Sequence[Sequence[cp_model.IntVar]], f: ProblemFlow,
                        k: int) -> list[tuple[tuple[int, int], cp_model.LinearExprT]]:
    return _add_moves(model, x, f"b{k}", f.source, f.source_grads, f.readers, f.reader_grads,
                      set(_backward_prices(f)))


def _cost_ceiling(problem: ShardingProblem) -> int:
    """An upper bound on the objective of any assignment: every node's dearest option, every priced move."""
    nodes = sum(max(costs) for costs in problem.node_costs)
    return nodes + sum(c for f in problem.flows for *_, c in f.forward + f.backward)


def _scaled(problem: ShardingProblem) -> tuple[ShardingProblem, int]:
    """(the problem with every cost divided by `factor`, rounded, so no assignment costs more than MAX_OBJECTIVE;
    factor), factor 1 when it already fits (module docstring, "Scaling")."""
    factor = -(-_cost_ceiling(problem) // MAX_OBJECTIVE)
    if factor <= 1:
        return problem, 1

    def down(c: int) -> int:
        return (c + factor // 2) // factor

    flows = tuple(dataclasses.replace(f, forward=tuple((a, b, down(c)) for a, b, c in f.forward),
                                      backward=tuple((a, b, down(c)) for a, b, c in f.backward))
                  for f in problem.flows)
    return ShardingProblem(tuple(tuple(down(c) for c in costs) for costs in problem.node_costs), flows), factor


@dataclass(frozen=True)
class BuiltModel:
    """The CP-SAT model of one problem structure (`structure_of`): its variables and constraints, which do not
    depend on the prices, and per flow the 0/1 expressions of its priced pairs, forward then backward. A problem of
    the same structure with other prices reuses it under a new objective (`_minimize`): the model it then solves
    is the one a fresh build would make, variable for variable (`tests/test_intra_op.py` compares the protos)."""

    model: cp_model.CpModel
    x: list[list[cp_model.IntVar]]
    moves: tuple[tuple[list[tuple[tuple[int, int], cp_model.LinearExprT]],
                       list[tuple[tuple[int, int], cp_model.LinearExprT]]], ...]


def structure_of(problem: ShardingProblem) -> tuple:
    """Everything of a problem the CP-SAT model is built from but its prices: the options per node and, per flow,
    its layout tables, readers, forbidden pairs and which pairs are priced."""
    return (tuple(len(c) for c in problem.node_costs),
            tuple((f.source, f.source_layouts, f.source_grads, f.readers, f.reader_layouts, f.reader_grads,
                   f.forbidden, tuple(p[:2] for p in f.forward), tuple(p[:2] for p in f.backward))
                  for f in problem.flows))


def _build(problem: ShardingProblem) -> BuiltModel:
    model = cp_model.CpModel()
    x = _add_choices(model, problem)
    moves = []
    for k, f in enumerate(problem.flows):
        moves.append((_add_forward_moves(model, x, f, k), _add_backward_moves(model, x, f, k)))
        _add_forbidden_moves(model, x, f)
    return BuiltModel(model, x, tuple(moves))


def _minimize(built: BuiltModel, problem: ShardingProblem) -> None:
    """Set the objective of `problem`'s prices on a model built for its structure."""
    terms: list[tuple[int, cp_model.LinearExprT]] = []
    for n, costs in enumerate(problem.node_costs):
        terms.extend((c, built.x[n][s]) for s, c in enumerate(costs) if c)
    for f, (forward, backward) in zip(problem.flows, built.moves, strict=True):
        fwd, bwd = _forward_prices(f), _backward_prices(f)
        terms.extend((fwd[key], v) for key, v in forward)
        terms.extend((bwd[key], v) for key, v in backward)
    built.model.Minimize(cp_model.LinearExpr.WeightedSum([v for _, v in terms], [c for c, _ in terms]))


def solve_problem(problem: ShardingProblem, *, time_limit: float = DEFAULT_TIME_LIMIT,
                  models: dict[tuple, BuiltModel] | None = None) -> Solution:
    """Minimize `problem.objective` over all assignments (see the module docstring). `models`: CP-SAT models by
    problem structure, reused across calls (the same segment at another micro-batch size or tp)."""
    if all(len(c) == 1 for c in problem.node_costs):
        zero = (0,) * problem.num_nodes
        if not problem.feasible(zero):
            raise IntraOpInfeasibleError(_INFEASIBLE.format(n=problem.num_nodes))
        obj = problem.objective(zero)
        return Solution(zero, obj, obj, SolveStatus.TRIVIAL)
    original, (problem, factor) = problem, _scaled(problem)
    if models is None:
        built = _build(problem)
    else:
        key = structure_of(problem)
        built = models.get(key) or models.setdefault(key, _build(problem))
    _minimize(built, problem)
    model, x = built.model, built.x
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_deterministic_time = time_limit
    solver.parameters.linearization_level = 2  # full LP relaxation: ~7x faster proofs on transformer blocks
    status = solver.Solve(model)
    if status == cp_model.INFEASIBLE:
        raise IntraOpInfeasibleError(_INFEASIBLE.format(n=problem.num_nodes))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise IntraOpInfeasibleError(
            f"the sharding ILP found no assignment ({solver.StatusName(status)}) for {problem.num_nodes} nodes; "
            "raise the time limit, lower tp, or turn off sequence parallelism")
    assignment = tuple(next(s for s, v in enumerate(row) if solver.Value(v)) for row in x)
    if not problem.feasible(assignment):
        raise RuntimeError("the sharding ILP returned an assignment with a forbidden move; the constraint "
                           "families and ShardingProblem.feasible disagree")
    if problem.objective(assignment) != round(solver.ObjectiveValue()):
        raise RuntimeError(f"sharding ILP objective {solver.ObjectiveValue()} differs from the assignment's "
                           f"evaluated cost {problem.objective(assignment)}; the formulation and "
                           "ShardingProblem.objective disagree")
    objective = original.objective(assignment)
    optimal = status == cp_model.OPTIMAL
    bound = objective if optimal else min(objective, int(solver.BestObjectiveBound()) * factor)
    return Solution(assignment, objective, bound, SolveStatus.OPTIMAL if optimal else SolveStatus.FEASIBLE)


# ----------------------------------------------------------------------------------------------------------------
# One layer: solve, cache, report
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerSharding:
    """The chosen sharding of one segment (layer) for one tensor-parallel setting."""

    tp: int
    sequence_parallel: bool
    choices: tuple[tuple[str, str], ...]
    """(node name, strategy name) per node in graph order, e.g. ("blocks_0_attn_q_proj", "colwise")."""
    cost: LayerCost
    module_prefix: str
    """Module path that owns the segment ("blocks.3"); `module_styles` paths are relative to it."""
    styles: tuple[tuple[str, str], ...]
    """(relative module path, Style value) for every module whose strategy has a module form."""
    collectives: tuple[tuple[str, str, str], ...]
    """(tensor, "forward"/"backward", collective) for every collective the layout runs, in graph order."""
    status: SolveStatus
    objective_s: float
    lower_bound_s: float
    solve_time_s: float = field(default=0.0, compare=False)
    """Wall time of the solve (0 for a cache hit); not part of the result's identity."""

    def module_styles(self) -> tuple[ModuleSharding, ...]:
        return tuple(ModuleSharding(module=m, style=Style(s)) for m, s in self.styles)

    def choice(self, node_name: str) -> str:
        for name, strategy in self.choices:
            if name == node_name:
                return strategy
        raise KeyError(f"no node {node_name!r} in this layer; nodes: {', '.join(n for n, _ in self.choices)}")

    def count(self, collective: str, direction: str) -> int:
        return sum(1 for _, d, c in self.collectives if c == collective and d == direction)

    def explain(self) -> str:
        """A readable table of the decision: the chosen strategy of every node and the collectives it costs."""
        lines = [f"tp={self.tp} sequence_parallel={self.sequence_parallel} status={self.status.value} "
                 f"objective={self.objective_s * 1e3:.3f} ms"]
        lines += [f"  {name:<40} {strategy}" for name, strategy in self.choices]
        lines += [f"  {direction:<8} {coll:<15} on {tensor}" for tensor, direction, coll in self.collectives]
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Solved:
    """A cached solve, with names replaced by positions so that every layer of the class can reuse it."""

    sequence_parallel: bool
    strategies: tuple[str, ...]
    cost: LayerCost
    styles: tuple[tuple[str, str], ...]
    collectives: tuple[tuple[int, str, str], ...]
    status: SolveStatus
    objective_s: float
    lower_bound_s: float
    loss_input_bytes: float = 0.0
    """Local bytes of the outputs the training loss reads (`costmodel.training_loss`)."""


@dataclass
class ShardingCache:
    """Solutions per (segment structure, setting). Pass one per search; it belongs to one cluster."""

    hits: int = 0
    misses: int = 0
    _entries: dict[tuple[Any, ...], _Solved] = field(default_factory=dict)
    models: dict[tuple, BuiltModel] = field(default_factory=dict)
    """CP-SAT models by problem structure (`solve_problem`): a layer's settings share a handful of structures."""

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[Any, ...]) -> _Solved | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
        else:
            self.hits += 1
        return found

    def put(self, key: tuple[Any, ...], solved: _Solved) -> None:
        self._entries[key] = solved


def _positional_names(nodes: Sequence[Node]) -> list[str]:
    """Node names, then the names of values read from outside, in first-read order (as `structural_key`)."""
    names = [n.name for n in nodes]
    own = set(names)
    for n in nodes:
        for src in n.inputs:
            if src not in own and src not in names:
                names.append(src)
    return names


def _module_styles(nodes: Sequence[Node], model: ShardingModel, assignment: Sequence[int],
                   prefix: str) -> tuple[tuple[str, str], ...]:
    """A style per module: from its parameter-holding op first (a linear's colwise/rowwise), else from a
    functional op inside it (fused attention's heads). Modules are listed in graph order."""
    strategies = model.strategies(assignment)
    styles: dict[str, Style] = {}
    for with_params in (True, False):
        for node, st in zip(nodes, strategies, strict=True):
            if st.style is None or not node.module_path or bool(node.param_specs) != with_params:
                continue
            styles.setdefault(node.module_path, st.style)
    order = {n.module_path: i for i, n in reversed(list(enumerate(nodes)))}
    return tuple((relative_module(m, prefix), styles[m].value) for m in sorted(styles, key=order.__getitem__))


def _solve_setting(nodes: Sequence[Node], sp: bool, outputs: Sequence[str], build: dict[str, Any],
                   time_limit: float, models: dict[tuple, BuiltModel] | None) -> tuple[_Solved, int]:
    model = build_sharding_model(nodes, sequence_parallel=sp, outputs=outputs, **build)
    try:
        solution = solve_problem(model.problem(), time_limit=time_limit, models=models)
    except IntraOpInfeasibleError:
        if not sp:
            raise
        # Norms forced onto the sequence shard (as the runtime runs them) left no feasible layout: offer all.
        model = build_sharding_model(nodes, sequence_parallel=sp, outputs=outputs, sequence_norms=False, **build)
        solution = solve_problem(model.problem(), time_limit=time_limit, models=models)
    names = _positional_names(nodes)
    position = {name: i for i, name in enumerate(names)}
    colls = tuple((position[t], d, str(m)) for t, d, m in model.comm_moves(solution.assignment))
    solved = _Solved(
        sequence_parallel=sp,
        strategies=tuple(s for _, s in model.choices(solution.assignment)),
        cost=model.layer_cost(solution.assignment),
        styles=_module_styles(nodes, model, solution.assignment, module_prefix(nodes)),
        collectives=colls, status=solution.status,
        objective_s=solution.objective / UNITS_PER_SECOND, lower_bound_s=solution.lower_bound / UNITS_PER_SECOND,
        loss_input_bytes=model.loss_input_bytes(solution.assignment))
    return solved, solution.objective


def _cluster_key(cluster: Cluster) -> tuple[Any, ...]:
    groups = tuple((g.name, g.device.name, g.num_nodes, g.devices_per_node, tuple(sorted(g.slowdown.items())),
                    tuple(sorted(g.unavailable))) for g in cluster.groups)
    return (cluster.name, groups, tuple(cluster.tiers))


def solve_layer_sharding(nodes: Sequence[Node], cluster: Cluster, device: DeviceSpec, *, tp: int, tp_group: CommGroup,
                         microbatch_size: int, traced_batch: int, sequence_parallel: bool | None = None,
                         memory_weight: float = DEFAULT_MEMORY_WEIGHT, dtype: str = "bfloat16",
                         outputs: Sequence[str] | None = None, num_microbatches: int = 1,
                         cache: ShardingCache | None = None, time_limit: float = DEFAULT_TIME_LIMIT,
                         profile: OpProfile | None = None, traced_dtype: str | None = None,
                         fp8: Float8Recipe | None = None, token_divisor: int = 1,
                         sharded_weights: bool = False) -> LayerSharding:
    """Choose the tensor-parallel strategy of every node of one segment (a layer) and price it.

    `nodes` are the segment's nodes in graph order; values they read from outside and the values they hand on
    (`outputs`, default: the nodes nothing inside reads) are in the boundary layout. `tp_group` is the
    `costmodel.hardware.collectives.CommGroup` of the tensor-parallel ranks (its size must be `tp`). `sequence_parallel`:
    True shards the boundary activations on the sequence dim and offers sequence-sharded strategies (Korthikanti
    et al. 2022); False offers none; None solves both and keeps the cheaper. Gradient syncs of replicated
    parameters are spread over `num_microbatches`. `traced_dtype` is the graph's dtype (`Graph.dtype`; inferred
    from the parameters when None): tensors in it are priced in `dtype`; `fp8` runs the linear layers in FP8
    (`costmodel.float8`). `token_divisor`: the group holds that share of every sample's tokens (a context-parallel
    rank), so the sharding is chosen for the tokens it really has. `sharded_weights` splits every linear's and
    token embedding's weight (`RuntimeOptions.tp_sharded_weights`). Results are reused from `cache` for structurally
    identical segments.
    """
    if tp_group.size != tp:
        raise ValueError(f"tp_group has {tp_group.size} ranks but tp={tp}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be > 0 (CP-SAT deterministic seconds), got {time_limit!r}")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallelism needs tp > 1")
    nodes = tuple(nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    outs = tuple(default_outputs(nodes) if outputs is None else outputs)
    missing = [o for o in outs if o not in index]
    if missing:
        raise ValueError(f"outputs {missing} are not nodes of the segment")
    settings = (False,) if tp == 1 else ((False, True) if sequence_parallel is None else (sequence_parallel,))
    # The segment is priced at microbatch_size / token_divisor samples (`build_sharding_model`'s batch scale), so
    # settings with the same ratio (2 samples split over a cp of 2, 1 sample whole) are one problem, solved once.
    common = math.gcd(microbatch_size, token_divisor)
    microbatch_size, token_divisor = microbatch_size // common, token_divisor // common
    key = (structural_key(nodes), tuple(index[o] for o in outs), tp, tp_group, settings,
           microbatch_size, traced_batch, device.name, dtype, memory_weight, num_microbatches, time_limit,
           traced_dtype, _cluster_key(cluster), id(profile) if profile is not None else None, fp8, token_divisor,
           sharded_weights)
    started = time.perf_counter()
    solved = cache.get(key) if cache is not None else None
    if solved is not None:
        return _materialize(nodes, tp, solved, 0.0)
    pricer = make_pricer(cluster, device, tp_group, dtype=dtype, profile=profile,
                         framework=FrameworkCosts.from_profile(profile, device.name), fp8=fp8)
    build = dict(tp=tp, traced_batch=traced_batch, microbatch_size=microbatch_size, pricer=pricer,
                 memory_weight=memory_weight, num_microbatches=num_microbatches, dtype=dtype,
                 traced_dtype=traced_dtype, token_divisor=token_divisor, sharded_weights=sharded_weights)
    models = cache.models if cache is not None else None
    candidates = [_solve_setting(nodes, sp, outs, build, time_limit, models) for sp in settings]
    solved = min(candidates, key=lambda c: c[1])[0]  # the first (no SP) wins ties
    solved = dataclasses.replace(solved, cost=with_training_loss(solved.cost, solved.loss_input_bytes, device, dtype))
    if cache is not None:
        cache.put(key, solved)
    return _materialize(nodes, tp, solved, time.perf_counter() - started)


def _materialize(nodes: Sequence[Node], tp: int, solved: _Solved, elapsed: float) -> LayerSharding:
    names = _positional_names(nodes)
    return LayerSharding(
        tp=tp, sequence_parallel=solved.sequence_parallel,
        choices=tuple((n.name, s) for n, s in zip(nodes, solved.strategies, strict=True)),
        cost=solved.cost, module_prefix=module_prefix(nodes), styles=solved.styles,
        collectives=tuple((names[t], d, c) for t, d, c in solved.collectives),
        status=solved.status, objective_s=solved.objective_s, lower_bound_s=solved.lower_bound_s,
        solve_time_s=elapsed)
