"""Apply a plan's per-module tensor-parallel sharding with DTensor (`parallelize_module`).

`Plan.sharding` says *what* is sharded (a `Style` per module pattern); the layouts between modules follow
from the model's structure, as in Megatron-LM (Shoeybi et al. 2019, sec. 3) and torchtitan's Llama plan:

- COLWISE linear: weight split on output features. Its output stays sharded on the last dim when a ROWWISE
  module in the same parent consumes it (q/k/v -> o_proj, up/gate -> down_proj); a colwise module with no
  rowwise partner (the LM head) gathers its output.
- ROWWISE linear: weight split on input features; the partial sums are all-reduced (or, under sequence
  parallelism, reduce-scattered over the sequence dim).
- VOCAB embedding: the table split on rows, output all-reduced.
- SEQUENCE (norms, dropout): under sequence parallelism (Korthikanti et al. 2022) they run on a sequence shard;
  without it they stay replicated.
- HEADS / REPLICATE: nothing to do; attention runs on the local heads because the zoo reshapes heads with -1.
A plan that shards nothing (the planner found tp's communication dearer than its savings) leaves the model
whole: the tp ranks then compute the same thing.

Sequence parallelism is applied to the transformer blocks (`model.blocks`): the first block's input is split
over the sequence dim (a local slice, no communication) and the last block's output gathered back, so code
outside the blocks (position embeddings, final norm, head, loss) sees full-sequence tensors; SEQUENCE styles
outside the blocks run replicated. Keeping the final norm replicated costs one small all-gather and keeps
models with learned position embeddings correct. Inside the blocks every norm runs on the sequence shard
(see `sequence_parallel_styles`), each colwise/rowwise pair's parent all-gathers its input once, and a
sub-layer with parameters but no sharded module (an MoE feed-forward with unsharded experts, or attention the
plan keeps replicated) runs replicated on the gathered sequence (`replicated_islands`).
Loss parallelism (vocab-sharded cross-entropy) is not applied: the head's logits are gathered.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from costmodel.sharding.rules import Style
from planner.errors import UserError
from planner.plan import ModuleSharding

BLOCKS_ATTR = "blocks"
"""The `nn.ModuleList` that holds a transformer's blocks (the zoo's layout rule)."""

SEQUENCE_DIM = 1
"""Batch-first activations (batch, seq, hidden): the sequence dim that sequence parallelism shards."""

_LINEAR_LIKE: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding)


def resolve_styles(model: nn.Module, sharding: Sequence[ModuleSharding]) -> dict[str, Style]:
    """Module path -> style for every module a pattern matches (the first matching pattern wins).

    Raises UserError when a pattern matches no module: the plan was made for a model with other module names.
    """
    paths = [name for name, _ in model.named_modules() if name]
    styles: dict[str, Style] = {}
    for entry in sharding:
        matched = [p for p in paths if fnmatch.fnmatchcase(p, entry.module)]
        if not matched:
            sample = ", ".join(paths[:8]) + (", ..." if len(paths) > 8 else "")
            raise UserError(f"plan shards module pattern {entry.module!r} but the model has no such module "
                            f"(modules: {sample}); was the plan made for this model?")
        for p in matched:
            styles.setdefault(p, entry.style)
    return styles


def _check_module_types(model: nn.Module, styles: Mapping[str, Style]) -> None:
    for path, style in styles.items():
        module = model.get_submodule(path)
        if style in (Style.COLWISE, Style.ROWWISE) and not isinstance(module, _LINEAR_LIKE):
            raise UserError(f"module {path} ({type(module).__name__}) cannot be {style.value}-sharded; "
                            f"{style.value} applies to nn.Linear and nn.Embedding")
        if style is Style.VOCAB and not isinstance(module, nn.Embedding):
            raise UserError(f"module {path} ({type(module).__name__}) cannot be vocab-sharded; "
                            "vocab sharding applies to nn.Embedding")


def shared_parameters(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module path, parameter name) that hold the same Parameter object (tied weights)."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), [])
            if (mod_name, p_name) not in owners[id(p)]:
                owners[id(p)].append((mod_name, p_name))
    return [group for group in owners.values() if len(group) > 1]


def _retie(model: nn.Module, groups: Sequence[Sequence[tuple[str, str]]]) -> None:
    """`parallelize_module` distributes each module's parameters separately, which unties shared weights
    (the GPT head tied to the token embedding). Tie them again when every holder ended up with the same layout
    (vocab-sharded embedding and colwise head both shard the table's rows); refuse otherwise."""
    from torch.distributed.tensor import DTensor

    for group in groups:
        params = [getattr(model.get_submodule(m), n) for m, n in group]
        layouts = {(p.placements if isinstance(p, DTensor) else None) for p in params}
        names = ", ".join(f"{m}.{n}" if m else n for m, n in group)
        if len(layouts) > 1:
            raise UserError(f"tied parameter shared by {names} gets different tensor-parallel layouts "
                            f"({sorted(map(str, layouts))}); shard all its holders alike or untie the weights "
                            "(e.g. --set tie_embeddings=false)")
        first = params[0]
        for (m, n), p in zip(group[1:], params[1:], strict=True):
            if p is not first:
                setattr(model.get_submodule(m), n, first)


def _in_blocks(path: str) -> bool:
    return path.startswith(BLOCKS_ATTR + ".")


def _check_pairs(model: nn.Module, styles: Mapping[str, Style]) -> None:
    """A rowwise linear reads the feature shards its colwise siblings produce (q/k/v -> o_proj, up/gate ->
    down_proj); a replicated sibling linear would hand the shared core full-width tensors. Refuse such plans.
    Low-rank down projections that a colwise sibling expands again (multi-head latent attention's q_a_proj /
    kv_a_proj_with_mqa feed q_b_proj / kv_b_proj) are refused with their own reason: MLA's rotary key is one
    head shared by all, computed from the replicated kv_a_proj_with_mqa and broadcast over this rank's heads, so
    its gradient is a partial sum over the tp ranks that this runtime does not reduce (Megatron-LM does)."""
    for path, style in sorted(styles.items()):
        if style is not Style.ROWWISE:
            continue
        parent_path = path.rpartition(".")[0]
        parent = model.get_submodule(parent_path) if parent_path else model
        linears = {f"{parent_path}.{n}" if parent_path else n: m for n, m in parent.named_children()
                   if isinstance(m, nn.Linear)}
        colwise_inputs = [m.in_features for p, m in linears.items() if styles.get(p) is Style.COLWISE]
        odd = [p for p, m in linears.items() if styles.get(p, Style.REPLICATE) is Style.REPLICATE]
        low_rank = [p for p in odd if linears[p].out_features < linears[p].in_features
                    and any(i <= linears[p].out_features for i in colwise_inputs)]
        if low_rank:
            raise UserError(f"{path} splits multi-head latent attention over tp, which this runtime does not run: "
                            f"the rotary key shared by all heads comes from the replicated {', '.join(low_rank)} "
                            "and its gradient would need a reduction over tp; plan with this attention replicated "
                            "(its MLP may still be split) or run the plan in Megatron-LM")
        if odd:
            raise UserError(f"{path} is rowwise-sharded but its sibling linear(s) {', '.join(odd)} are replicated; "
                            "a rowwise module needs its colwise partners sharded too (plan inconsistent with "
                            "this model)")


def _check_kv_heads(model: nn.Module, styles: Mapping[str, Style], tp: int) -> None:
    """Grouped-query attention split over more tp ranks than it has KV heads would cut a KV head in pieces (or
    leave a rank's query heads without theirs): the planner prices such attention replicated over the tp ranks
    (`costmodel.sharding.rules`: heads shard only when every operand's head count divides), and this runtime
    refuses a plan that splits its projections anyway, instead of failing inside the model."""
    for path, style in sorted(styles.items()):
        if style is Style.REPLICATE or "." not in path:
            continue
        parent = model.get_submodule(path.rpartition(".")[0])
        kv_heads = getattr(getattr(parent, "config", None), "num_key_value_heads", None)
        if hasattr(parent, "num_key_value_groups") and isinstance(kv_heads, int) and kv_heads % tp:
            raise UserError(f"{path} is split over tp={tp} ranks but its attention has {kv_heads} KV heads: this "
                            "runtime splits whole heads only; plan with the attention replicated over tp (as the "
                            f"planner prices tp > {kv_heads}) or tp dividing {kv_heads}")


def _has_rowwise_partner(path: str, styles: Mapping[str, Style]) -> bool:
    parent = path.rpartition(".")[0]
    if not parent:
        return False
    return any(s is Style.ROWWISE and p.startswith(parent + ".") for p, s in styles.items())


_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.endswith("Norm")


def sequence_parallel_styles(model: nn.Module, styles: Mapping[str, Style]) -> dict[str, Style]:
    """Under sequence parallelism every norm inside the blocks runs on a sequence shard: a replicated norm fed
    a shard would leave its weight gradients unreduced over tp, so unsharded norms are promoted to SEQUENCE."""
    promoted = dict(styles)
    for path, module in model.named_modules():
        if _in_blocks(path) and _is_norm(module) and styles.get(path, Style.REPLICATE) is Style.REPLICATE:
            promoted[path] = Style.SEQUENCE
    return promoted


def parallel_styles(model: nn.Module, styles: Mapping[str, Style], *,
                    sequence_parallel: bool) -> dict[str, Any]:
    """Module path -> torch `ParallelStyle` with the input/output layouts implied by the module's neighbours.

    Under sequence parallelism the residual stream inside the blocks is a local sequence shard; norms return a
    sequence-sharded DTensor (so `x.size()` in the next module sees the full sequence), and the parent of each
    colwise/rowwise pair (`attn`, `mlp`) all-gathers it once, as in torchtitan's Llama plan.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for path in sorted(styles):
        style = styles[path]
        sp = sequence_parallel and _in_blocks(path)
        if style is Style.COLWISE:
            paired = isinstance(model.get_submodule(path), nn.Linear) and _has_rowwise_partner(path, styles)
            plan[path] = ColwiseParallel(output_layouts=Shard(-1) if paired else Replicate())
            if sp and paired:
                parent = path.rpartition(".")[0]
                plan[parent] = PrepareModuleInput(input_layouts=(Shard(SEQUENCE_DIM),),
                                                  desired_input_layouts=(Replicate(),))
        elif style is Style.ROWWISE:
            plan[path] = RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM) if sp else Replicate())
        elif style is Style.VOCAB:
            plan[path] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif style is Style.SEQUENCE and sp:
            # A norm hands on a sequence-sharded DTensor (the next module reads the full size from it); a linear
            # run on the shard (replicated weight) hands back the local shard the residual stream adds to.
            plan[path] = SequenceParallel(sequence_dim=SEQUENCE_DIM,
                                          use_local_output=not _is_norm(model.get_submodule(path)))
    if sequence_parallel:
        for path in replicated_islands(model, styles):
            plan[path] = PrepareModuleInputOutput(
                input_layouts=(Shard(SEQUENCE_DIM),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(SEQUENCE_DIM),), use_local_output=True)
    return plan


def replicated_islands(model: nn.Module, styles: Mapping[str, Style]) -> list[str]:
    """Sub-layers of the blocks with parameters but no colwise/rowwise pair and no sequence-sharded module (an
    MoE feed-forward whose experts are not sharded, or an MLP whose up projection alone is colwise). Under
    sequence parallelism they run replicated on the gathered sequence and hand back their sequence shard, so
    their weights see every token and get identical gradients on all tp ranks. A colwise linear without a
    rowwise partner gathers its output (`Replicate`), so it may sit in an island: it reads the gathered input
    and returns full-sequence, full-width activations; left outside an island it would hand the residual
    stream's sequence shard a full-sequence tensor."""
    blocks = getattr(model, BLOCKS_ATTR, None)
    if not isinstance(blocks, nn.ModuleList):
        return []
    # ROWWISE (and so its colwise partners) reduce-scatters onto the sequence shard itself; SEQUENCE runs on it.
    split = {Style.ROWWISE, Style.SEQUENCE}
    islands = []
    for i, block in enumerate(blocks):
        for name, child in block.named_children():
            path = f"{BLOCKS_ATTR}.{i}.{name}"
            has_params = next(child.parameters(), None) is not None
            styled = any(s in split and (p == path or p.startswith(path + ".")) for p, s in styles.items())
            if has_params and not styled:
                islands.append(path)
    return islands


def install_sequence_parallel_hooks(model: nn.Module, tp_mesh: Any) -> None:
    """Split the first block's input over the sequence dim and gather the last block's output.

    Install these *after* activation checkpointing: the checkpoint's pre-hook must run first and keep the
    unsplit input, so that recomputation, which calls the block again (and thus this hook), splits it the
    same way as the original forward did.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    blocks = getattr(model, BLOCKS_ATTR, None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise UserError(f"sequence parallelism needs the transformer blocks in an nn.ModuleList named "
                        f"{BLOCKS_ATTR!r}; {type(model).__name__} has none (plan with sequence_parallel=false)")

    def split_input(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if x.shape[SEQUENCE_DIM] % tp_mesh.size():
            raise UserError(f"sequence length {x.shape[SEQUENCE_DIM]} is not divisible by tp={tp_mesh.size()}; "
                            "sequence parallelism needs equal shards")
        local = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        return (local.redistribute(tp_mesh, [Shard(SEQUENCE_DIM)]).to_local(), *args[1:])

    def gather_output(_module: nn.Module, _args: tuple[Any, ...], out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        full = DTensor.from_local(first, tp_mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        full = full.redistribute(tp_mesh, [Replicate()]).to_local()
        return (full, *out[1:]) if isinstance(out, tuple) else full

    blocks[0].register_forward_pre_hook(split_input)
    blocks[len(blocks) - 1].register_forward_hook(gather_output)


def apply_tensor_parallel(model: nn.Module, sharding: Sequence[ModuleSharding], tp_mesh: Any, *,
                          sequence_parallel: bool) -> dict[str, Style]:
    """Shard `model` in place over the 1-D `tp_mesh`; returns the style applied to each module path."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = resolve_styles(model, sharding)
    if sequence_parallel:
        styles = sequence_parallel_styles(model, styles)
    _check_module_types(model, styles)
    tied = shared_parameters(model)
    _check_pairs(model, styles)
    _check_kv_heads(model, styles, tp_mesh.size())
    torch_plan = parallel_styles(model, styles, sequence_parallel=sequence_parallel)
    if not torch_plan:
        # Nothing is split (the planner found communication dearer than the compute it would save): the tp
        # ranks simply compute the same thing. Valid, if wasteful; nothing to apply.
        return styles
    parallelize_module(model, tp_mesh, torch_plan)
    _retie(model, tied)
    return styles
