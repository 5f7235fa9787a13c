"""Candidates: what the outer level of the search enumerates, and the space they come from.

A `Candidate` fixes everything but the stage partition and the recomputation: the mesh (dp, tp, pp [, cp, ep] and
their rank order, `planner.search.meshes`), the micro-batch size and count, the schedule (with its virtual
stages), the ZeRO stage and sequence parallelism. `enumerate_candidates` lists them for a chain, cluster, global
batch and `SearchSpace`, per device count (`device_counts`); `mesh_options_for` gives them per mesh, factored into
shapes and settings (`MeshOptions`), which the search bounds before it lists them. The space is spelled out in the
"Formulation" of `planner.search.branch_and_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from costmodel.context_parallel import cp_options
from costmodel.expert_parallel import ep_options
from costmodel.hardware.cluster import Cluster
from costmodel.hardware.host import host_of
from costmodel.pipeline import schedule_problem, split_backward_problem
from costmodel.strategy import Offload, Recompute, RuntimeOptions, Schedule, StageSpec, Strategy
from ir.layer_chain import LayerChain
from planner.search.device_groups import mesh_type_problem
from planner.search.interleaved_layout import ChainUnits, InterleavedLayout
from planner.search.meshes import MeshCandidate, divisors, enumerate_meshes
from planner.search.space import Objective, SearchSpace
from planner.strategy_label import Detail, strategy_label

_SCHEDULE_ORDER: dict[Schedule, int] = {s: i for i, s in enumerate(Schedule)}
_OFFLOAD_ORDER: dict[Offload, int] = {o: i for i, o in enumerate(Offload)}
"""Declaration order of the schedules, for `Candidate.sort_key` (a dict: `list(Schedule)` per call costs tens of
microseconds, and the search sorts thousands of candidates)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """Everything of a strategy except the stage partition and the recomputation (which the DP chooses)."""

    mesh: MeshCandidate
    microbatch_size: int
    num_microbatches: int
    schedule: Schedule
    virtual_stages: int
    zero_stage: int
    sequence_parallel: bool
    runtime: RuntimeOptions = RuntimeOptions()

    def strategy(self, stages: Sequence[StageSpec] = (), recompute: Recompute = Recompute.NONE) -> Strategy:
        m = self.mesh
        return Strategy(dp=m.dp, tp=m.tp, pp=m.pp, cp=m.cp, ep=m.ep, microbatch_size=self.microbatch_size,
                        num_microbatches=self.num_microbatches, schedule=self.schedule,
                        virtual_stages=self.virtual_stages, zero_stage=self.zero_stage,
                        sequence_parallel=self.sequence_parallel, recompute=recompute, stages=tuple(stages),
                        mesh_order=m.mesh_order, runtime=self.runtime)

    @classmethod
    def of(cls, strategy: Strategy) -> Candidate:
        """The candidate a given strategy belongs to (the inverse of `strategy`, without stages)."""
        s = strategy
        mesh = MeshCandidate(dp=s.dp, tp=s.tp, pp=s.pp, cp=s.cp, ep=s.ep, mesh_order=s.mesh_order)
        return cls(mesh, s.microbatch_size, s.num_microbatches, s.schedule, s.virtual_stages, s.zero_stage,
                   s.sequence_parallel, s.runtime)

    @property
    def sort_key(self) -> tuple:
        """Deterministic order among candidates of equal priority."""
        m = self.mesh
        return (m.tp, m.pp, m.dp, m.cp, m.ep, tuple(a.value for a in m.mesh_order), self.microbatch_size,
                _SCHEDULE_ORDER[self.schedule], self.virtual_stages, self.zero_stage, self.sequence_parallel,
                _OFFLOAD_ORDER[self.runtime.offload])

    @property
    def label(self) -> str:
        return strategy_label(self.strategy(), Detail.CANDIDATE)


def head_problem(chain: LayerChain, tp: int) -> str:
    """Why tensor parallelism of degree tp cannot shard the attention heads ('' when it can)."""
    for n in chain.graph.nodes:
        h = n.attr("num_heads")
        if h is not None and int(h) % tp:
            return f"tp={tp} does not divide heads={h}"
        kv = n.attr("num_kv_heads")
        if kv is not None and int(kv) % tp and tp % int(kv):
            return f"tp={tp} and kv heads={kv}: neither divides the other"
    return ""


def node_size(cluster: Cluster) -> int:
    return math.gcd(*(g.devices_per_node for g in cluster.groups))


def device_counts(cluster: Cluster, space: SearchSpace, objective: Objective) -> tuple[int, ...]:
    """Device counts to plan for, largest first.

    Always every available device. Also whole-node subsets: for `--objective cost` all of them (fewer devices can
    be cheaper); for time 2^i and 3 * 2^i nodes, so that a mesh that does not divide the available devices (after a
    failure, say) can still use at least 2/3 of the nodes -- with powers of two alone one failed GPU of 1,024 left 512
    (GPT-3 175B, batch 1536, on `examples/clusters/stragglers-1024.yaml`: 36.8 s per step on 512 A100 against
    24.9 s on 768); the factor 3 also divides the batches people pick (1536, 3072, 6144) -- and every count up
    to the node size (the counts one node is searched with). So a cluster's counts include those of any cluster
    with 2^i or 3 * 2^i of its nodes, and going from such a cluster to this one never makes the best time worse
    (from 5 nodes to 7 it can: 5 nodes' worth of devices is not searched on 7). With `--objective cost`, counts
    below a node only within one node or with `SearchSpace.whole_nodes_only` False. The level-0 bound prunes the
    small counts unexpanded whenever a larger one already does better, so they cost nothing for a model that
    needs the devices."""
    n = cluster.num_available
    per_node = node_size(cluster)
    nodes = n // per_node
    if objective is Objective.COST:
        counts = {n} | {k * per_node for k in range(1, nodes + 1)}
    else:
        counts = {n} | {(m << i) * per_node for m in (1, 3) for i in range(nodes.bit_length()) if (m << i) <= nodes}
    if objective is not Objective.COST or not space.whole_nodes_only or n <= per_node:
        counts |= set(range(1, min(n, per_node) + 1))
    return tuple(sorted(counts, reverse=True))


def offload_options(space: SearchSpace, cluster: Cluster) -> tuple[Offload, ...]:
    """What the search tries to offload: the pin, else nothing and, where every device type of the cluster has
    host data with a known host memory and is not the host itself (`costmodel.hardware.host`), the optimizer and
    the parameters."""
    if space.offload is not None:
        return (space.offload,)
    hosts = [host_of(g.device.name) for g in cluster.groups]
    if all(h is not None and h.host_memory_bytes > 0 and not h.host_is_device for h in hosts):
        return tuple(Offload)
    return (Offload.NONE,)


def _offload_applies(offload: Offload, zero: int, dp_size: int, space: SearchSpace) -> bool:
    """FSDP2 offloads parameters only when it shards them (ZeRO-3). With data parallelism and the ZeRO stage free,
    the optimizer is offloaded only with its state sharded (ZeRO >= 1), as DeepSpeed (`offload_optimizer`) and
    Megatron-LM (`--optimizer-cpu-offload` needs its distributed optimizer) run it: the CPU then steps 1/dp of
    the parameters for the same device memory."""
    if offload is Offload.PARAMS:
        return zero == 3
    return offload is Offload.NONE or zero >= 1 or dp_size == 1 or space.zero_stage is not None


def _schedules(space: SearchSpace, pp: int, m: int, chain: LayerChain, units: ChainUnits
               ) -> list[tuple[Schedule, int]]:
    """(schedule, chunks per rank) the candidate tries with m micro-batches on p ranks."""
    pinned = space.schedule
    allowed = space.schedules
    if pinned is None and allowed == {Schedule.GPIPE}:
        pinned = Schedule.GPIPE  # a trainer that runs GPipe only
    if pinned is Schedule.GPIPE:
        return [(pinned, 1)]
    # GPipe is not searched unless pinned: for the same stages it is never faster than 1F1B (sum F + (m-1) max F
    # + sum B + (m-1) max B >= sum (F+B) + (m-1) max (F+B)) and it keeps all m micro-batches in flight instead of
    # min(p - k, m), with the same drain and tails; so 1F1B is at least as good on every partition.
    out: list[tuple[Schedule, int]] = []
    # Without pipelining the schedule is moot: every trainer runs pp = 1 (written as 1F1B).
    if pinned in (None, Schedule.ONE_F_ONE_B) and (allowed is None or Schedule.ONE_F_ONE_B in allowed or pp == 1):
        out.append((Schedule.ONE_F_ONE_B, 1))
    if pp == 1:
        return out
    for schedule in (Schedule.INTERLEAVED, Schedule.INTERLEAVED_ZB, Schedule.ZBV, Schedule.DUALPIPEV):
        # Zero-bubble schedules run without recomputation (the partition problem drops it) and keep ZeRO-3's
        # gathered weights (`pipeline.split_backward_problem`; the ZeRO stages are filtered below).
        recomputed = space.recompute not in (None, Recompute.NONE)
        if (pinned not in (None, schedule) or (allowed is not None and schedule not in allowed)
                or schedule_problem(schedule, pp, m)
                or split_backward_problem(schedule, recomputed=recomputed, resharded=False)):
            continue
        for v in _chunk_options(space, schedule):
            # Chunks of q or q+1 layers, the embedding and the loss counted as layers (interleaved_layout);
            # one chunk per rank is a contiguous stage.
            if v == 1 or InterleavedLayout.of(chain, pp, v, units, schedule) is not None:
                out.append((schedule, v))
    return out


def _chunk_options(space: SearchSpace, schedule: Schedule) -> list[int]:
    """Chunks per rank a schedule tries: two on a V, 2.. (interleaved) or 1.. (interleaved-zb) up to the most."""
    if schedule.v_shape:
        return [2] if space.virtual_stages in (None, 2) else []
    least = 2 if schedule is Schedule.INTERLEAVED else 1
    if space.virtual_stages is not None:
        return [space.virtual_stages] if space.virtual_stages >= least else []
    return list(range(least, space.max_virtual_stages + 1))


def enumerate_candidates(chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                         objective: Objective = Objective.TIME) -> tuple[list[Candidate], dict[tuple, str]]:
    """Every candidate of the space (module docstring), and the meshes left out with the reason."""
    out: list[Candidate] = []
    invalid: dict[tuple, str] = {}
    for n in device_counts(cluster, space, objective):
        out.extend(candidates_for(n, chain, cluster, global_batch, space, invalid))
    return out, invalid


def candidates_for(num_devices: int, chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                   invalid: dict[tuple, str]) -> list[Candidate]:
    """The candidates on exactly `num_devices` devices; meshes whose tp cannot shard the heads go to `invalid`."""
    return [c for options in mesh_options_for(num_devices, chain, cluster, global_batch, space, invalid)
            for c in options.candidates()]


Shape = tuple[int, int, Schedule, int]
"""(micro-batch size, micro-batches, schedule, chunks per rank) of a candidate."""
Setting = tuple[int, bool, RuntimeOptions]
"""(ZeRO stage, sequence parallelism, runtime) of a candidate."""


@dataclass(frozen=True)
class MeshOptions:
    """The candidates of one mesh, factored: every shape with every setting, except the pairs
    `split_backward_problem` rules out (a zero-bubble schedule with ZeRO-3 resharding after forward). The search
    bounds a mesh as a whole from the two factors before it lists its candidates (`CandidateBounds.mesh_floor`)."""

    mesh: MeshCandidate
    shapes: tuple[Shape, ...]
    settings: tuple[Setting, ...]
    reshard_after_forward: bool

    def pairs(self, shape: Shape) -> bool:
        """Whether `shape` is paired with the ZeRO-3 settings (the others it always is)."""
        return not split_backward_problem(shape[2], recomputed=False, resharded=self.reshard_after_forward)

    def settings_of(self, shape: Shape) -> tuple[Setting, ...]:
        if self.pairs(shape):
            return self.settings
        return tuple(s for s in self.settings if s[0] != 3)

    def candidates(self) -> list[Candidate]:
        """The mesh's candidates, micro-batch size, then schedule and chunks, then ZeRO, SP and runtime in order."""
        return [Candidate(self.mesh, mbs, m, schedule, v, zero, sp, rt)
                for mbs, m, schedule, v in self.shapes for zero, sp, rt in self.settings_of((mbs, m, schedule, v))]

    @property
    def count(self) -> int:
        """How many candidates `candidates` lists."""
        return sum(len(self.settings_of(shape)) for shape in self.shapes)

    @property
    def sort_key(self) -> tuple:
        """The prefix of its candidates' `Candidate.sort_key`."""
        m = self.mesh
        return (m.tp, m.pp, m.dp, m.cp, m.ep, tuple(a.value for a in m.mesh_order))


def mesh_options_for(num_devices: int, chain: LayerChain, cluster: Cluster, global_batch: int, space: SearchSpace,
                     invalid: dict[tuple, str]) -> list[MeshOptions]:
    """The meshes on exactly `num_devices` devices with their candidates' factors (`candidates_for`, by mesh)."""
    out: list[MeshOptions] = []
    units = ChainUnits.of(chain)
    # Context-parallel degrees the chain allows, expert-parallel degrees dividing its experts.
    cps = [c for c in cp_options(chain, num_devices) if space.cp in (None, c)]
    eps = [e for e in ep_options(chain, num_devices) if space.ep in (None, e)]
    meshes = enumerate_meshes(num_devices, devices_per_node=node_size(cluster), global_batch=global_batch,
                              max_pp=len(chain.segments), dp=space.dp, tp=space.tp, pp=space.pp,
                              tp_across_nodes=space.tp_across_nodes, cp_options=cps, ep_options=eps)
    # One runtime per offload choice, shared by every candidate (hashed and compared in the search's caches).
    runtimes = {o: replace(space.runtime, offload=o) for o in offload_options(space, cluster)}
    heads: dict[int, str] = {}  # head_problem scans every node: once per tp degree, not per mesh
    for mesh in meshes:
        if mesh.tp not in heads:
            heads[mesh.tp] = head_problem(chain, mesh.tp)
        # A tp/dp group never mixes device types (planner.search.device_groups); replicas on different types are
        # planned by group data parallelism, with batch shares that balance them.
        why = heads[mesh.tp] or mesh_type_problem(
            cluster, dp=mesh.dp, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=mesh.ep, mesh_order=mesh.mesh_order)
        if why:
            invalid[(mesh.dp, mesh.tp, mesh.pp)] = why
            continue
        options = _mesh_options(mesh, chain, global_batch, space, units, runtimes)
        if options.shapes:
            out.append(options)
    return out


def _mesh_options(mesh: MeshCandidate, chain: LayerChain, global_batch: int, space: SearchSpace,
                  units: ChainUnits, runtimes: Mapping[Offload, RuntimeOptions]) -> MeshOptions:
    """The shapes and settings of one mesh; `runtimes`: the space's runtime with each offload choice."""
    zeros = ([space.zero_stage] if space.zero_stage is not None
             else [0] if mesh.dp * mesh.cp == 1 else [0, 1, 3] if mesh.pp > 1 else [0, 1, 2, 3])
    sps = ([space.sequence_parallel] if space.sequence_parallel is not None
           else [False] if mesh.tp == 1 else [False, True])
    settings: list[Setting] = []
    if not (mesh.tp == 1 and any(sps)):
        settings = [(zero, sp, rt) for zero in zeros for sp in sps
                    for o, rt in runtimes.items() if _offload_applies(o, zero, mesh.dp * mesh.cp, space)]
    shapes: list[Shape] = []
    per_replica = global_batch // mesh.dp
    for mbs in divisors(per_replica) if settings else ():
        if space.microbatch_size is not None and mbs != space.microbatch_size:
            continue
        # Without pipelining, one micro-batch of the whole per-replica batch is always tried: the simplest way to
        # run it (accumulation only pays for memory or pipeline bubbles), whatever max_microbatch_size says.
        whole = mesh.pp == 1 and mbs == per_replica
        if space.microbatch_size is None and mbs > space.max_microbatch_size and not whole:
            continue
        m = per_replica // mbs
        if space.num_microbatches is not None and m != space.num_microbatches:
            continue
        shapes += [(mbs, m, schedule, v) for schedule, v in _schedules(space, mesh.pp, m, chain, units)]
    return MeshOptions(mesh, tuple(shapes), tuple(settings), space.runtime.reshard_after_forward)
