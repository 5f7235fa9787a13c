"""What-if sweeps: re-plan a model for each value of one or more cluster or training knobs.

The scenarios come from `--vary KEY=V1,V2,...` (`planner.scenarios.variations`, where the keys are listed).

Every scenario is planned by the search (`planner.search.branch_and_bound`, one `PlanningSession` per sequence
length so that layer prices are shared between scenarios with the same devices and links); a cluster of several
device types is also planned with group data parallelism (`planner.scenarios.group_data_parallel`) and the better
plan is kept. Objectives:

- time (default): the fastest plan of each scenario; the fastest scenario is marked.
- cost, with an optional throughput floor X (`--min-throughput`, tokens/s, or samples/s for models without a
  sequence): in each scenario the cheapest plan per step among the cost search's best (`top_k`) that reaches X,
  else the fastest plan if it reaches X; the cheapest scenario that reaches X is marked. Cost per step is step
  time x the hourly price of the devices the plan uses / 3600.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from costmodel.hardware.cluster import Cluster
from costmodel.rank_layout import device_map
from costmodel.strategy import Strategy
from ir.layer_chain import LayerChain
from planner.errors import UserError
from planner.scenarios.group_data_parallel import GroupDataParallelPlan, plan_group_data_parallel, searching
from planner.scenarios.replan import PlanningSession
from planner.scenarios.variations import Scenario
from planner.search.outcome import SearchOptions
from planner.search.space import Objective, SearchSpace
from planner.strategy_label import strategy_label

# ---- planning one scenario ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WhatIfRow:
    """The plan chosen for one scenario."""

    values: tuple[tuple[str, str], ...]
    cluster: str
    global_batch: int
    seq: int | None
    summary: str
    """What the plan does (degrees, micro-batching, schedule; or the groups' shares)."""
    num_devices: int
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    price_per_hour: float | None
    """Hourly price of the devices the plan uses (None when the spec has no prices)."""
    error: str = ""
    """Why nothing was planned ('' when a plan was found)."""
    meets_floor: bool | None = None
    """Whether it reaches --min-throughput (None without a floor)."""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def throughput(self) -> float:
        return self.tokens_per_s if self.tokens_per_s is not None else self.samples_per_s

    @property
    def cost_per_step(self) -> float | None:
        return None if self.price_per_hour is None or not self.ok else self.price_per_hour / 3600 * self.step_time_s

    @property
    def cost_per_million(self) -> float | None:
        """Cost per million tokens (per million samples for models without a sequence)."""
        c = self.cost_per_step
        if c is None:
            return None
        per_step = self.global_batch * (self.seq or 1)
        return c / per_step * 1e6

    def to_dict(self) -> dict[str, Any]:
        return {"values": dict(self.values), "cluster": self.cluster, "global_batch": self.global_batch,
                "seq": self.seq, "summary": self.summary, "num_devices": self.num_devices,
                "step_time_s": self.step_time_s if self.ok else None,
                "samples_per_s": self.samples_per_s if self.ok else None,
                "tokens_per_s": self.tokens_per_s if self.ok else None, "mfu": self.mfu if self.ok else None,
                "price_per_hour": self.price_per_hour, "cost_per_step": self.cost_per_step,
                "cost_per_million": self.cost_per_million, "meets_floor": self.meets_floor, "error": self.error}


@dataclass(frozen=True)
class _Outcome:
    summary: str
    num_devices: int
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    price_per_hour: float | None


def used_price_per_hour(cluster: Cluster, strategy: Strategy) -> float | None:
    """Hourly price of the physical devices `strategy` runs on (None when one of them has no price)."""
    total = 0.0
    for placement in device_map(cluster, strategy):
        for r in placement.ranks:
            price = cluster.group_of(r).price_per_device_hour
            if price is None:
                return None
            total += price
    return total


def _from_search(cluster: Cluster, ranked: Any) -> _Outcome:
    e = ranked.estimate
    return _Outcome(strategy_label(ranked.strategy), ranked.strategy.num_devices, e.step_time_s, e.samples_per_s,
                    e.tokens_per_s, e.mfu, used_price_per_hour(cluster, ranked.strategy))


def _from_groups(plan: GroupDataParallelPlan) -> _Outcome:
    parts = [f"{s.group} {s.samples}/{plan.global_batch}: {strategy_label(s.strategy)}" for s in plan.shares
             if s.samples]
    return _Outcome("group dp [" + "; ".join(parts) + "]", plan.num_devices, plan.step_time_s, plan.samples_per_s,
                    plan.tokens_per_s, plan.mfu, plan.price_per_hour)


def _cost(o: _Outcome) -> float:
    return math.inf if o.price_per_hour is None else o.price_per_hour * o.step_time_s


@dataclass(frozen=True)
class WhatIfOptions:
    objective: Objective = Objective.TIME
    min_throughput: float | None = None
    """Tokens/s (samples/s for models without a sequence) a plan must reach; with objective cost."""
    space: SearchSpace | None = None
    top_k: int = 8
    """Cost objective: how many of the cheapest strategies per scenario are checked against the floor."""
    time_limit_s: float | None = None
    """Per scenario and search."""
    group_data_parallel: bool = True
    """Also plan clusters of several device types with group data parallelism."""


def plan_scenario(scenario: Scenario, session: PlanningSession, options: WhatIfOptions) -> WhatIfRow:
    """The best plan of one scenario for the objective (module docstring); a row with `error` when none runs."""
    outcomes: list[_Outcome] = []
    cluster = scenario.cluster
    floor = options.min_throughput

    def meets(o: _Outcome) -> bool:
        rate = o.tokens_per_s if o.tokens_per_s is not None else o.samples_per_s
        return floor is None or rate >= floor

    try:
        if options.objective is Objective.COST:
            if any(g.price_per_device_hour is None for g in cluster.groups):
                raise UserError(f"--objective cost needs a price for every device group of {cluster.name!r}")
            cheap = session.search(cluster, global_batch=scenario.global_batch, space=options.space,
                                   options=SearchOptions.for_users(objective=Objective.COST, top_k=options.top_k,
                                                                   time_limit_s=options.time_limit_s))
            outcomes += [_from_search(cluster, r) for r in cheap.ranked]
        fast = session.search(cluster, global_batch=scenario.global_batch, space=options.space,
                              options=SearchOptions.for_users(time_limit_s=options.time_limit_s))
        outcomes.append(_from_search(cluster, fast.best))
    except UserError as e:  # nothing fits / nothing valid: still a row, try group data parallelism below
        error = str(e)
    else:
        error = ""
    if options.group_data_parallel and not cluster.is_homogeneous:
        try:
            run = searching(options.space, dtype=session.dtype, time_limit_s=options.time_limit_s)
            outcomes.append(_from_groups(plan_group_data_parallel(session.chain, cluster, scenario.global_batch, run,
                                                                  dtype=session.dtype)))
        except UserError as e:
            error = error or str(e)
    base = dict(values=scenario.values, cluster=cluster.name, global_batch=scenario.global_batch,
                seq=session.chain.graph.seq_len)
    if not outcomes:
        return WhatIfRow(**base, summary="", num_devices=0, step_time_s=math.nan, samples_per_s=math.nan,
                         tokens_per_s=None, mfu=math.nan, price_per_hour=None, error=error or "no plan")
    if options.objective is Objective.COST:
        meeting = [o for o in outcomes if meets(o)]
        pool = meeting or outcomes
        best = min(pool, key=lambda o: (_cost(o), o.step_time_s))
    else:
        best = min(outcomes, key=lambda o: (o.step_time_s, _cost(o)))
    return WhatIfRow(**base, summary=best.summary, num_devices=best.num_devices, step_time_s=best.step_time_s,
                     samples_per_s=best.samples_per_s, tokens_per_s=best.tokens_per_s, mfu=best.mfu,
                     price_per_hour=best.price_per_hour, meets_floor=None if floor is None else meets(best))


@dataclass(frozen=True)
class WhatIf:
    rows: tuple[WhatIfRow, ...]
    keys: tuple[str, ...]
    objective: Objective
    min_throughput: float | None
    best: int | None
    """Index of the fastest row (time) or the cheapest row reaching the floor (cost); None when there is none."""
    throughput_unit: str

    def to_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "objective": self.objective.value, "min_throughput": self.min_throughput,
                "throughput_unit": self.throughput_unit, "best": self.best, "rows": [r.to_dict() for r in self.rows]}


def pick_best(rows: Sequence[WhatIfRow], objective: Objective) -> int | None:
    """The fastest row, or the cheapest per sample among those reaching the floor (ties: faster, then first)."""
    ok = [i for i, r in enumerate(rows) if r.ok and r.meets_floor is not False]
    if objective is Objective.COST:
        priced = [i for i in ok if rows[i].cost_per_million is not None]
        if not priced:
            return None
        return min(priced, key=lambda i: (rows[i].cost_per_million, rows[i].step_time_s, i))
    if not ok:
        return None
    return min(ok, key=lambda i: (rows[i].step_time_s / rows[i].global_batch, i))


def whatif(chain_for: Callable[[int | None], LayerChain], scenario_list: Sequence[Scenario], *,
           options: WhatIfOptions | None = None, dtype: str = "bfloat16",
           progress: Callable[[int, int], None] | None = None) -> WhatIf:
    """Plan every scenario (module docstring). `chain_for(seq)` traces the model at a sequence length (None: the
    model's own); one `PlanningSession` per sequence length shares layer prices between scenarios."""
    options = options or WhatIfOptions()
    if options.min_throughput is not None and options.objective is not Objective.COST:
        raise UserError("--min-throughput applies with --objective cost")
    sessions: dict[int | None, PlanningSession] = {}
    rows = []
    for i, sc in enumerate(scenario_list):
        if sc.seq not in sessions:
            sessions[sc.seq] = PlanningSession(chain_for(sc.seq), dtype=dtype)
        rows.append(plan_scenario(sc, sessions[sc.seq], options))
        if progress:
            progress(i + 1, len(scenario_list))
    has_seq = any(s.chain.graph.seq_len for s in sessions.values())
    keys = tuple(k for k, _ in scenario_list[0].values) if scenario_list else ()
    return WhatIf(rows=tuple(rows), keys=keys, objective=options.objective, min_throughput=options.min_throughput,
                  best=pick_best(rows, options.objective), throughput_unit="tokens/s" if has_seq else "samples/s")


# ---- rendering ----------------------------------------------------------------------------------------------------


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:,.4g}"


def render_table(result: WhatIf) -> str:
    """A fixed-width table, one row per scenario; '*' marks the best."""
    unit = result.throughput_unit
    per = "1M tokens" if unit == "tokens/s" else "1M samples"
    head = [*result.keys, "devices", "step s", unit, "MFU", "$/h", f"$/{per}", "plan"]
    body = []
    for r in result.rows:
        vals = [v for _, v in r.values]
        if not r.ok:
            body.append([*vals, "-", "-", "-", "-", "-", "-", f"no plan: {r.error}"])
            continue
        floor = "" if r.meets_floor is not False else " (below floor)"
        body.append([*vals, str(r.num_devices), f"{r.step_time_s:.4g}", f"{r.throughput:,.0f}",
                     f"{100 * r.mfu:.1f}%", _money(r.price_per_hour), _money(r.cost_per_million),
                     r.summary + floor])
    marks = ["*" if i == result.best else " " for i in range(len(body))]
    widths = [max(len(str(row[c])) for row in [head, *body]) for c in range(len(head) - 1)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=False)) + "  " + head[-1]]
    for m, row in zip(marks, body, strict=True):
        lines.append(f"{m} " + "  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=False)) + "  " + row[-1])
    if result.best is None:
        what = ("no scenario reaches the throughput floor" if result.min_throughput is not None
                else "no scenario has a plan" + (" with prices" if result.objective is Objective.COST else ""))
        lines.append(what)
    else:
        what = "fastest" if result.objective is Objective.TIME else "cheapest"
        if result.min_throughput is not None:
            what += f" reaching {result.min_throughput:,.0f} {unit}"
        lines.append(f"* {what}")
    return "\n".join(lines)
