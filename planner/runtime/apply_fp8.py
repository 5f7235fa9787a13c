"""FP8 linear layers: torchao's float8 training conversion, applied to the modules the plan priced in FP8.

`fp8_modules(model)` names the `nn.Linear` modules the conversion replaces, by the predicate the cost model prices
(`costmodel.float8.converts`: the output layer, MoE routers and linears with a dimension not divisible by 16
stay as they are); it needs no GPU and is what the CPU tests check. `apply_fp8` swaps those modules for torchao's
`Float8Linear` (`torchao.float8.convert_to_float8_training` with `Float8LinearConfig.from_recipe_name`), with
`enable_fsdp_float8_all_gather` for tensorwise scaling under ZeRO-3 -- what torchtitan's float8 converter sets.
It runs first, before tensor parallelism and FSDP2 wrap the modules, as torchtitan converts the model before
parallelizing it. Tensor-parallel styles stay the plain ones (their collectives in BF16, as priced).

FP8 GEMMs (`torch._scaled_mm`) need a CUDA device of compute capability 8.9 or later and torchao (the `fp8`
extra); anywhere else `fp8_runtime_problem` says why the plan cannot run, and `parallelize` refuses it.
"""

from __future__ import annotations

import importlib.util

from torch import nn

from costmodel.float8 import Float8Recipe, converts

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first FP8 tensor cores (Ada, Hopper): torchtitan's `has_cuda_capability(8, 9)`."""


def fp8_modules(model: nn.Module) -> tuple[str, ...]:
    """Qualified names of the `nn.Linear` modules FP8 training converts, in module order."""
    return tuple(name for name, m in model.named_modules()
                 if type(m) is nn.Linear and converts(name, m.in_features, m.out_features))


def fp8_runtime_problem(device_type: str, capability: tuple[int, int] | None = None) -> str:
    """Why FP8 linear layers cannot run on this rank ('' when they can): a CPU, an older GPU, or no torchao."""
    if device_type != "cuda":
        return (f"the plan trains linear layers in FP8, which needs a CUDA device with FP8 tensor cores (compute "
                f"capability {'.'.join(map(str, FP8_MIN_CAPABILITY))} or later); this rank runs on {device_type}: "
                "plan without --fp8 to run here")
    if capability is not None and capability < FP8_MIN_CAPABILITY:
        return (f"the plan trains linear layers in FP8, which needs compute capability "
                f"{'.'.join(map(str, FP8_MIN_CAPABILITY))} or later; this GPU has {'.'.join(map(str, capability))}")
    if importlib.util.find_spec("torchao") is None:
        return "the plan trains linear layers in FP8 with torchao, which is not installed: pip install 'stratagem[fp8]'"
    return ""


def apply_fp8(model: nn.Module, recipe: Float8Recipe, *, fsdp_float8_all_gather: bool) -> tuple[str, ...]:
    """Convert `fp8_modules(model)` to torchao's `Float8Linear` in place; returns their names."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    names = fp8_modules(model)
    chosen = frozenset(names)
    config = Float8LinearConfig.from_recipe_name(recipe.value)
    if fsdp_float8_all_gather and recipe.fp8_all_gather:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # tensorwise is the default recipe
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, fqn: fqn in chosen)
    return names
