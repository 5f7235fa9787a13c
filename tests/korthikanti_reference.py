"""Korthikanti et al. 2022 reproduced with Stratagem's cost model: the published runs and the predictions for them.

Source: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198,
MLSys'23), Tables 3-5, transcribed in shared/data/korthikanti2022_*.csv. GPT models on A100-80GB (Selene,
8 per node, NVLink 3 + 8x200 Gb/s HDR InfiniBand), seq 2048, vocab 51200, fp16, explicit attention with Megatron's fused scale-mask-softmax and dropout 0.1,
tensor parallel 8, the published pipeline/data/batch/interleaving settings; two configurations per model:
full activation recomputation, and selective recomputation + sequence parallelism.

The whole pipeline is exercised: the zoo GPT (`attn_impl=fused_softmax`, `dropout=0.1`, `fused_dropout_add=true`)
is built on the meta device, traced by `ir.trace`, cut by `ir.build_layer_chain`, each layer class is sharded over
tp=8 by the planner's CP-SAT sharding model (`planner.search.intra_op.solve_layer_sharding`), and
`costmodel.estimate` prices the strategy.
Nothing in the cost model is fitted to these numbers (see costmodel/operators.py for what was fitted, and on what).
Used by tests/test_korthikanti.py and bench/costmodel_validation.py (which prints the table).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from costmodel import Cluster, Estimate, LayerCost, Recompute, Schedule, Strategy
from costmodel.estimate import estimate
from costmodel.hardware.collectives import Collective, CommGroup, collective_time
from costmodel.hardware.device import DeviceSpec
from costmodel.layer_pricing import region_inputs, selective_recompute_region
from costmodel.operators import node_time, retype_ratio
from costmodel.strategy import RuntimeOptions
from ir.graph import Node, OpKind, dtype_bytes
from ir.layer_chain import LayerChain, Segment

SEQ = 2048
VOCAB = 51200
DEVICE = "a100-80gb"
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class KorthikantiRow:
    """One model of Korthikanti et al. 2022 Tables 3 and 5 (iteration time in seconds)."""

    model: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    microbatch: int
    interleave: int
    full_recompute_s: float
    selective_sp_s: float
    mfu: float
    hfu: float


# korthikanti2022_selective_recompute.csv, rows "Table3+Table5" (interleave blank = 1: no interleaving).
ROWS: tuple[KorthikantiRow, ...] = (
    KorthikantiRow("22B", 64, 6144, 48, 8, 1, 1, 4, 4, 1, 1.42, 1.10, 0.415, 0.437),
    KorthikantiRow("175B", 96, 12288, 96, 8, 8, 1, 64, 1, 3, 18.13, 13.75, 0.514, 0.528),
    KorthikantiRow("530B", 128, 20480, 105, 8, 35, 1, 280, 1, 3, 49.05, 37.83, 0.560, 0.570),
    KorthikantiRow("1T", 160, 25600, 128, 8, 64, 1, 512, 1, 1, 94.42, 71.49, 0.563, 0.570),
)

# korthikanti2022_layer_time_and_formulas.csv: one 22B layer at tp=8 (Table 4), milliseconds (forward, backward).
LAYER_22B_MS: Mapping[str, tuple[float, float]] = {
    "baseline no recompute": (7.7, 11.9),
    "sequence parallelism": (7.2, 11.8),
    "baseline with (full) recompute": (7.7, 19.5),
    "selective recompute": (7.7, 13.2),
    "selective + sequence": (7.2, 13.1),
}
LAYER_22B_SETTINGS: Mapping[str, tuple[Recompute, bool]] = {
    "baseline no recompute": (Recompute.NONE, False),
    "sequence parallelism": (Recompute.NONE, True),
    "baseline with (full) recompute": (Recompute.FULL, False),
    "selective recompute": (Recompute.SELECTIVE, False),
    "selective + sequence": (Recompute.SELECTIVE, True),
}

MODES: Mapping[str, tuple[Recompute, bool]] = {
    "full": (Recompute.FULL, False),
    "selective+sp": (Recompute.SELECTIVE, True),
}


def build_chain(row: KorthikantiRow, *, dtype: str = "bfloat16") -> LayerChain:
    """Trace the zoo GPT with the row's shape at its micro-batch size (meta device, no weights allocated)."""
    import ir
    from models.registry import build_model

    sets = (f"layers={row.layers}", f"hidden={row.hidden}", f"heads={row.heads}", f"vocab={VOCAB}", f"seq={SEQ}",
            "attn_impl=fused_softmax", "dropout=0.1", "fused_dropout_add=true")
    built = build_model("gpt", sets, batch=row.microbatch, seq=SEQ, device="meta")
    graph = ir.trace(built.module, built.example_inputs, model_name=f"gpt-{row.model}", dtype=dtype)
    return ir.build_layer_chain(graph)


def cluster_for(row: KorthikantiRow) -> Cluster:
    gpus = row.tp * row.pp * row.dp
    return Cluster.parse(f"{max(gpus // GPUS_PER_NODE, 1)}x{min(gpus, GPUS_PER_NODE)}x{DEVICE}")


def sharded_costs(chain: LayerChain, cluster: Cluster, device: DeviceSpec, *, tp: int, sequence_parallel: bool,
                  microbatch_size: int, dtype: str = "bfloat16") -> dict[tuple[int, str], LayerCost]:
    """tp-sharded LayerCost of every layer class, from the planner's sharding ILP (tp ranks are adjacent)."""
    from planner.search.intra_op import solve_layer_sharding

    out: dict[tuple[int, str], LayerCost] = {}
    for cid in sorted({s.class_id for s in chain.segments}):
        seg = chain.representative(cid)
        solved = solve_layer_sharding(chain.nodes_of(seg), cluster, device, tp=tp, tp_group=CommGroup(tp, 1),
                                      microbatch_size=microbatch_size, traced_batch=chain.graph.batch_size,
                                      sequence_parallel=sequence_parallel, dtype=dtype)
        out[(cid, device.name)] = solved.cost
    return out


COLUMN_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "up_proj", "gate_proj", "lm_head"})
ROW_MODULES = frozenset({"o_proj", "down_proj"})


def megatron_layer_cost(chain: LayerChain, segment: Segment, device: DeviceSpec, cluster: Cluster, *, tp: int,
                        sequence_parallel: bool, microbatch_size: int, dtype: str = "bfloat16") -> LayerCost:
    """Reference: the segment priced in Megatron-LM's hand-written layout (Shoeybi et al. 2019; Korthikanti et al.
    2022 Sec. 4.2), independent of the planner's sharding ILP, to validate the time model on its own.

    q/k/v/up (and the LM head) are column-parallel, o/down row-parallel (found by the zoo's module names), every
    op between them (the attention core, GELU) runs on 1/tp of the heads/features; the token embedding is
    vocabulary-parallel; norms, dropouts and residual adds are replicated, or sequence-sharded with SP. Forward:
    an all-reduce after each row-parallel linear and the embedding (SP: reduce-scatter, plus an all-gather before
    each column-parallel group); backward: the duals (all-reduce of the column inputs' gradient; SP: reduce-scatter
    there and all-gather after each row-parallel linear). Pipeline messages carry 1/tp of the boundary activation.
    """
    nodes = chain.nodes_of(segment)
    graph = chain.graph
    scale = microbatch_size / graph.batch_size
    ratio = retype_ratio(graph.dtype, dtype)
    group = CommGroup(tp, 1)

    def leaf(n: Node) -> str:
        return n.module_path.rsplit(".", 1)[-1]

    col = {n.name for n in nodes if n.op_kind is OpKind.LINEAR and leaf(n) in COLUMN_MODULES}
    row = {n.name for n in nodes if n.op_kind is OpKind.LINEAR and leaf(n) in ROW_MODULES}
    vocab = {n.name for n in nodes if n.op_kind is OpKind.EMBEDDING and n.attr("num_embeddings", 0) == VOCAB}
    split = set(col)  # nodes computing on 1/tp of the heads / features
    for n in nodes:
        if n.name not in split and any(i in split and i not in row for i in n.inputs):
            split.add(n.name)
    seq_frac = 1 / tp if sequence_parallel else 1.0

    def frac(n: Node) -> float:
        return 1 / tp if n.name in split and n.name not in col else seq_frac

    fwd = bwd = fwd_comm = bwd_comm = 0.0
    fwd_of: dict[str, float] = {}
    for n in nodes:
        work = 1 / tp if n.name in split else seq_frac
        f, b = node_time(n, device, flops_scale=scale * work, bytes_scale=scale * work, dtype=dtype,
                         param_scale=1 / tp if n.name in split | vocab else 1.0)
        fwd, bwd, fwd_of[n.name] = fwd + f, bwd + b, f

    def t(kind: Collective, nbytes: float) -> float:
        return collective_time(kind, nbytes * scale * ratio, group, cluster)

    col_inputs = {n.inputs[0]: n.input_specs[0].nbytes for n in nodes if n.name in col}
    hidden = 0.0  # the input-gradient reduction runs during the column linears' weight-gradient GEMMs
    for tensor, nbytes in col_inputs.items():
        reduce = t(Collective.REDUCE_SCATTER if sequence_parallel else Collective.ALL_REDUCE, nbytes)
        if sequence_parallel:
            fwd_comm += t(Collective.ALL_GATHER, nbytes)
        bwd_comm += reduce
        hidden += min(reduce, sum(fwd_of[n.name] for n in nodes if n.name in col and n.inputs[0] == tensor))
    for n in nodes:
        if n.name in row or n.name in vocab:
            nbytes = n.output_specs[0].nbytes
            if sequence_parallel:
                fwd_comm += t(Collective.REDUCE_SCATTER, nbytes)
                bwd_comm += t(Collective.ALL_GATHER, nbytes)
            else:
                fwd_comm += t(Collective.ALL_REDUCE, nbytes)

    act = scale * ratio
    none = sum(n.saved_bytes * frac(n) for n in nodes)
    region = selective_recompute_region(nodes)
    kept = region_inputs(nodes, region)
    selective = (sum(n.saved_bytes * frac(n) for n in nodes if n.name not in region)
                 + sum(b / tp for b in kept.values()))
    full = min(segment.input_bytes * seq_frac, none)
    # A weight used by another module (the tied LM head reads tok_embed.weight) belongs to its owner's segment, as
    # Segment.param_count counts it; estimate adds the copy a later pipeline rank keeps.
    own = {n.name: sum(sp.numel for name, sp in zip(n.param_names, n.param_specs, strict=True)
                       if name.startswith(n.module_path + ".")) for n in nodes}
    params = sum(own[n.name] / (tp if n.name in split | vocab else 1) for n in nodes)
    replicated_params = sum(n.param_bytes for n in nodes if n.name not in split | vocab)
    largest = max((n.output_specs[0].nbytes * frac(n) for n in nodes if n.output_specs), default=0.0)
    return LayerCost(
        fwd_compute_s=fwd, bwd_compute_s=bwd, fwd_comm_s=fwd_comm, bwd_comm_s=bwd_comm, bwd_comm_async_s=hidden,
        param_count=round(params),
        param_bytes=round(params * dtype_bytes(dtype)),
        saved_bytes_none=round(none * act), saved_bytes_selective=round(selective * act),
        saved_bytes_full=round(full * act),
        recompute_selective_s=sum(fwd_of[n] for n in region), recompute_full_s=fwd + fwd_comm,
        # Without SP, Megatron's scatter-gather optimization (Narayanan et al. SC'21 Sec. 4.1) sends 1/tp of the
        # boundary activation per device and all-gathers it over NVLink; with SP it is already sequence-sharded.
        boundary_bytes=round(segment.boundary_bytes / tp * act),
        grad_sync_bytes=round(replicated_params * ratio) if sequence_parallel else 0,
        peak_temp_bytes=round(2 * largest * act))


def megatron_costs(chain: LayerChain, cluster: Cluster, device: DeviceSpec, *, tp: int, sequence_parallel: bool,
                   microbatch_size: int, dtype: str = "bfloat16") -> dict[tuple[int, str], LayerCost]:
    return {(cid, device.name): megatron_layer_cost(chain, chain.representative(cid), device, cluster, tp=tp,
                                                     sequence_parallel=sequence_parallel,
                                                     microbatch_size=microbatch_size, dtype=dtype)
            for cid in sorted({s.class_id for s in chain.segments})}


def strategy_for(row: KorthikantiRow, recompute: Recompute, sequence_parallel: bool) -> Strategy:
    interleaved = row.interleave > 1
    return Strategy(dp=row.dp, tp=row.tp, pp=row.pp, microbatch_size=row.microbatch,
                    num_microbatches=row.global_batch // (row.dp * row.microbatch),
                    schedule=Schedule.INTERLEAVED if interleaved else Schedule.ONE_F_ONE_B,
                    virtual_stages=row.interleave, sequence_parallel=sequence_parallel, recompute=recompute,
                    # Megatron-LM of 2022 scattered and gathered pipeline sends (Narayanan et al. 2021 Sec. 4.1),
                    # allocated each receive per transfer and reduced a column-parallel linear's input gradient
                    # during its weight-gradient GEMM.
                    runtime=RuntimeOptions(p2p_scatter_gather=True, tp_grad_overlap=True,
                                           p2p_transient_buffers=row.pp > 1))


@dataclass(frozen=True)
class Prediction:
    model: str
    mode: str
    predicted_s: float
    published_s: float
    estimate: Estimate

    @property
    def error(self) -> float:
        return (self.predicted_s - self.published_s) / self.published_s


SHARDINGS = ("ilp", "megatron")


def layer_costs_for(sharding: str, chain: LayerChain, cluster: Cluster, device: DeviceSpec, *, tp: int,
                    sequence_parallel: bool, microbatch_size: int) -> dict[tuple[int, str], LayerCost]:
    """"ilp": the planner's sharding solution; "megatron": the hand-written reference layout."""
    if sharding not in SHARDINGS:
        raise ValueError(f"unknown sharding {sharding!r}; valid: {', '.join(SHARDINGS)}")
    build = sharded_costs if sharding == "ilp" else megatron_costs
    return build(chain, cluster, device, tp=tp, sequence_parallel=sequence_parallel,
                 microbatch_size=microbatch_size)


def predict_row(row: KorthikantiRow, chain: LayerChain | None = None, *, sharding: str = "ilp"
                ) -> list[Prediction]:
    """Both published configurations of one model."""
    from costmodel.hardware.catalog import get_device

    chain = chain if chain is not None else build_chain(row)
    cluster = cluster_for(row)
    device = get_device(DEVICE)
    out = []
    for mode, (recompute, sp) in MODES.items():
        costs = layer_costs_for(sharding, chain, cluster, device, tp=row.tp, sequence_parallel=sp,
                                microbatch_size=row.microbatch)
        est = estimate(chain, cluster, strategy_for(row, recompute, sp), layer_costs=costs,
                       global_batch=row.global_batch)
        published = row.full_recompute_s if mode == "full" else row.selective_sp_s
        out.append(Prediction(row.model, mode, est.step_time_s, published, est))
    return out


def layer_times_22b(chain: LayerChain, *, sharding: str = "ilp") -> dict[str, tuple[float, float]]:
    """Predicted (forward ms, backward ms) of one 22B transformer layer at tp=8, micro-batch 4 (Table 4)."""
    from collections import Counter

    from costmodel.hardware.catalog import get_device

    row = ROWS[0]
    cluster, device = cluster_for(row), get_device(DEVICE)
    block = Counter(s.class_id for s in chain.segments).most_common(1)[0][0]
    out = {}
    for name, (recompute, sp) in LAYER_22B_SETTINGS.items():
        cost = layer_costs_for(sharding, chain, cluster, device, tp=row.tp, sequence_parallel=sp,
                               microbatch_size=row.microbatch)[(block, device.name)]
        extra = {Recompute.NONE: 0.0, Recompute.SELECTIVE: cost.recompute_selective_s,
                 Recompute.FULL: cost.recompute_full_s}[recompute]
        out[name] = (1e3 * (cost.fwd_compute_s + cost.fwd_comm_s),
                     1e3 * (cost.bwd_compute_s + cost.bwd_comm_s - cost.bwd_comm_async_s + extra))
    return out
