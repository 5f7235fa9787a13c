"""Pipeline parallelism: cut a model into the plan's stages and drive them with `torch.distributed.pipelining`.

The plan's stages are ranges of layer-chain segments; every traced IR node knows its owning module, so each
module belongs to the stages its nodes fall in. The root's forward is traced once with `torch.fx`, keeping as
an opaque call every module that lies in a single stage (a transformer block, the embedding, the head) and
inlining only modules that a cut splits (usually just the root). The glue ops of inlined forwards (residual
adds, position ids, reshapes) are placed at the earliest stage where their inputs exist; ops that read only
parameters or constants are copied into each stage that needs them.

Each stage becomes a `GraphModule` that shares the original submodules (so parameter names are the model's own
FQNs, e.g. `blocks.3.attn.q_proj.weight`) and takes / returns the values live across its cuts, in graph order.
A value live across a cut must be a tensor (it is sent with point-to-point communication).

Stage `i` runs on pipeline rank `i % pp` (the looped placement of Megatron-LM's interleaved schedule,
Narayanan et al. SC'21, sec. 2.2), so rank r holds stages r, r + pp, r + 2pp, ...; the V-shaped zero-bubble
schedules (zbv, dualpipev) put stages r and 2pp - 1 - r on rank r, as torch's `ScheduleZBVZeroBubble` and
`ScheduleDualPipeV` expect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from costmodel.pipeline import chunk_stages
from costmodel.strategy import Schedule, StageSpec
from ir.layer_chain import LayerChain
from planner.errors import UserError
from planner.runtime.hf_stages import decoder_stage_modules, is_decoder_lm

_PLACEHOLDER, _OUTPUT, _GET_ATTR, _CALL_MODULE = "placeholder", "output", "get_attr", "call_module"


def segment_stage_index(stages: Sequence[StageSpec], num_segments: int) -> tuple[int, ...]:
    """Stage of each chain segment; the stages must cover `[0, num_segments)` contiguously and in order."""
    owner: list[int] = []
    for i, st in enumerate(stages):
        if st.start != len(owner):
            raise UserError(f"plan stage {i} starts at segment {st.start}, expected {len(owner)}: stages must "
                            "cover the layer chain contiguously and in order")
        owner.extend([i] * st.num_segments)
    if len(owner) != num_segments:
        raise UserError(f"plan stages cover {len(owner)} segments but the model's layer chain has {num_segments}; "
                        "was the plan made for this model?")
    return tuple(owner)


def module_stages(chain: LayerChain, stages: Sequence[StageSpec]) -> dict[str, frozenset[int]]:
    """Module path -> the stages whose IR nodes it owns (ancestors included; the root "" is left out)."""
    owner = segment_stage_index(stages, len(chain))
    return {path: frozenset(owner[i] for i in segs) for path, segs in module_segments(chain).items()}


def module_segments(chain: LayerChain) -> dict[str, frozenset[int]]:
    """Module path -> the chain segments whose IR nodes it owns (ancestors included; the root "" is left out)."""
    found: dict[str, set[int]] = {}
    for seg in chain.segments:
        for node in chain.nodes_of(seg):
            path = node.module_path
            while path:
                found.setdefault(path, set()).add(seg.index)
                path = path.rpartition(".")[0]
    return {p: frozenset(s) for p, s in found.items()}


class _StageTracer(fx.Tracer):
    """Keeps a module opaque when all its IR nodes are in one stage; inlines modules a cut splits."""

    def __init__(self, stages_of: Mapping[str, frozenset[int]]) -> None:
        super().__init__()
        self.stages_of = stages_of

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        stages = self.stages_of.get(module_qualified_name)
        if stages is None:
            return super().is_leaf_module(m, module_qualified_name)
        if len(stages) == 1:
            return True
        if m._forward_hooks or m._forward_pre_hooks:
            raise UserError(f"a pipeline cut falls inside module {module_qualified_name!r}, which carries "
                            "forward hooks (sequence parallelism or recomputation); cut between layers instead")
        if super().is_leaf_module(m, module_qualified_name):
            raise UserError(f"a pipeline cut falls inside the single op module {module_qualified_name!r}")
        return False


def trace_for_stages(model: nn.Module, stages_of: Mapping[str, frozenset[int]]) -> fx.Graph:
    try:
        return _StageTracer(stages_of).trace(model)
    except UserError:
        raise
    except Exception as e:  # fx raises TraceError, TypeError, RuntimeError... for untraceable Python
        raise UserError(f"cannot split {type(model).__name__} into pipeline stages: torch.fx could not trace "
                        f"its forward at the stage-cut level ({type(e).__name__}: {e}); keep data-dependent "
                        "control flow inside the layers") from None


def assign_stages(graph: fx.Graph, stages_of: Mapping[str, frozenset[int]], num_stages: int) -> dict[fx.Node, int]:
    """Stage of every node that depends on the model inputs; nodes missing from the result are *free*
    (parameters, buffers, constants) and are copied into each stage that uses them."""
    stage: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == _PLACEHOLDER:
            stage[node] = 0
            continue
        if node.op == _OUTPUT:
            continue
        deps = [stage[a] for a in node.all_input_nodes if a in stage]
        earliest = max(deps, default=None)
        if node.op == _CALL_MODULE and node.target in stages_of:
            (own,) = stages_of[node.target]
            if earliest is not None and earliest > own:
                raise UserError(f"module {node.target!r} is planned on stage {own} but reads a value computed "
                                f"on stage {earliest}; the plan's cuts do not follow the model's data flow")
            stage[node] = own
        elif earliest is not None:
            stage[node] = earliest
    return stage


def _free_closure(nodes: Sequence[fx.Node], stage: Mapping[fx.Node, int]) -> set[fx.Node]:
    needed: set[fx.Node] = set()
    todo = [a for n in nodes for a in n.all_input_nodes if a not in stage]
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(a for a in n.all_input_nodes if a not in stage)
    return needed


def _live_across(graph: fx.Graph, stage: Mapping[fx.Node, int], cut: int, num_stages: int) -> list[fx.Node]:
    """Values computed at stage <= cut and read at a later stage (graph order)."""
    live = []
    for node in graph.nodes:
        if node not in stage or stage[node] > cut:
            continue
        readers = [num_stages - 1 if u.op == _OUTPUT else stage.get(u, -1) for u in node.users]
        if any(r > cut for r in readers):
            live.append(node)
    return live


def check_stage_outputs(names: tuple[str, ...], *values: Any) -> Any:
    """Runs at each stage's end: values sent to the next stage must be tensors. A view (the gathered sequence
    of a sequence-parallel block is one) is copied: the zero-bubble schedules detach every stage output in
    place after its input-gradient pass, which torch refuses for a view."""
    for name, v in zip(names, values, strict=True):
        if not isinstance(v, torch.Tensor):
            raise UserError(f"value {name!r} ({type(v).__name__}) crosses a pipeline cut but is not a tensor; "
                            "move the cut or compute it inside the next layer")
    values = tuple(v.clone() if v._is_view() else v for v in values)
    return values if len(values) > 1 else values[0]


def build_stage_modules(model: nn.Module, chain: LayerChain, stages: Sequence[StageSpec],
                        keep: Sequence[int] | None = None) -> dict[int, nn.Module]:
    """One module per stage index in `keep` (default: all), sharing `model`'s submodules: a `GraphModule` cut
    from the traced root, or for a transformers decoder LM its own blocks (`hf_stages`)."""
    num_stages = len(stages)
    stages_of = module_stages(chain, stages)
    if is_decoder_lm(model):  # transformers' decorated forwards defeat torch.fx; their common layout does not
        return decoder_stage_modules(model, stages_of, num_stages, keep)
    graph = trace_for_stages(model, stages_of)
    stage = assign_stages(graph, stages_of, num_stages)
    empty = sorted(set(range(num_stages)) - set(stage.values()))
    if empty:
        raise UserError(f"pipeline stage(s) {empty} hold no operation of the traced model")
    output_node = next(n for n in graph.nodes if n.op == _OUTPUT)
    live_in: list[list[fx.Node]] = [[n for n in graph.nodes if n.op == _PLACEHOLDER]]
    for cut in range(num_stages - 1):
        live_in.append(_live_across(graph, stage, cut, num_stages))
    wanted = range(num_stages) if keep is None else keep
    return {i: _stage_module(model, graph, stage, i, live_in[i],
                             live_in[i + 1] if i + 1 < num_stages else None, output_node)
            for i in wanted}


def _stage_module(model: nn.Module, graph: fx.Graph, stage: Mapping[fx.Node, int], index: int,
                  inputs: Sequence[fx.Node], outputs: Sequence[fx.Node] | None, output_node: fx.Node) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        if n.op == _PLACEHOLDER:
            env[n] = g.node_copy(n)
        else:
            env[n] = g.placeholder(n.name)
    own = [n for n in graph.nodes if stage.get(n) == index and n.op != _PLACEHOLDER]
    needed_outputs = list(outputs) if outputs is not None else list(output_node.all_input_nodes)
    free = _free_closure(own + [o for o in needed_outputs if o not in stage], stage)
    for n in graph.nodes:  # graph order keeps each node after its inputs
        if n in free or (n in own and n not in env):
            env[n] = g.node_copy(n, lambda a: env[a])
    if outputs is None:
        g.output(fx.map_arg(output_node.args[0], lambda a: env[a]))
    else:
        names = tuple(n.name for n in outputs)
        checked = g.call_function(check_stage_outputs, (names, *[env[n] for n in outputs]))
        g.output(checked)
    g.lint()
    return fx.GraphModule(model, g, class_name=f"PipelineStage{index}")


def stage_indices_of_rank(pp_rank: int, pp: int, num_stages: int,
                          schedule: Schedule = Schedule.ONE_F_ONE_B) -> tuple[int, ...]:
    """Looped placement: pipeline rank r holds stages r, r + pp, ...; on a V (zbv, dualpipev) r and 2pp - 1 - r
    (`costmodel.pipeline.chunk_stages`, the placement the plan was priced with)."""
    return chunk_stages(schedule, pp, num_stages // pp, pp_rank)


def build_schedule(pipeline_stages: Sequence[Any], schedule: Schedule, num_microbatches: int,
                   loss_fn: Any) -> Any:
    """The `torch.distributed.pipelining` schedule for the plan. Gradients come back summed over micro-batches
    (`train_step` averages them once per parameter)."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    multi = {Schedule.INTERLEAVED: ScheduleInterleaved1F1B, Schedule.INTERLEAVED_ZB: ScheduleInterleavedZeroBubble,
             Schedule.ZBV: ScheduleZBVZeroBubble, Schedule.DUALPIPEV: ScheduleDualPipeV}
    if schedule in multi:
        return multi[schedule](list(pipeline_stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(pipeline_stages) != 1:
        raise UserError(f"schedule {schedule.value} runs one stage per rank, got {len(pipeline_stages)}; "
                        "use a schedule with model chunks (interleaved, interleaved-zb, zbv, dualpipev)")
    # With fewer micro-batches than stages, 1F1B's warm-up already holds every micro-batch, so it runs exactly
    # as GPipe (all forwards, then all backwards); torch's Schedule1F1B refuses that case.
    one_f_one_b = schedule is Schedule.ONE_F_ONE_B and num_microbatches >= pipeline_stages[0].num_stages
    cls = Schedule1F1B if one_f_one_b else ScheduleGPipe
    return cls(pipeline_stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
