"""What a traced call *is*: its stable target name, its `OpKind`, and the attributes sharding and pricing need.

The tracer sees three shapes of call (fx `call_module` on a leaf module, fx `call_function`/`call_method`, and
ATen overloads from the torch.export fallback). All three are reduced to a *base name* ("linear", "softmax",
"view", "add", ...), and one table maps base names to kinds, so both front ends classify the same way.

Attributes (`Node.attrs`) set here, when they apply (the keys other packages rely on, see INTERFACES.md):
- LINEAR: ("in_features", int), ("out_features", int), ("bias", bool)
- ATTENTION: ("num_heads", int), ("num_kv_heads", int), ("head_dim", int), ("is_causal", bool), ("window", int)
  and ("has_sinks", bool) for `stratagem::windowed_attention` (causal over the last `window` keys), ("window", k)
  and ("sparse", True) for `stratagem::sparse_attention` (causal over k keys a top-k picked),
  ("dropout_p", float), ("has_mask", bool), and ("attention_core", True) for the fused SDPA call
- SOFTMAX / NORM / REDUCTION: ("dim", int | tuple[int, ...]) counted from the end (-1 is the last dim) so the value
  does not depend on leading batch dims; NORM also ("norm_type", "layer" | "rms" | "batch" | "group" | ...)
- EMBEDDING: ("num_embeddings", int), ("embedding_dim", int); CONV: channels, kernel, stride, groups
- ROUTING: ("k", int) and ("num_experts", int) on top-k routing; ("num_classes", int) on one_hot

The one graph-level rule, explicit "math" attention, is `ir.attention_core.mark_attention_core`.
"""

from __future__ import annotations

import builtins
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ir.graph import OpKind

# ---------------------------------------------------------------------------------------------------------------
# Base name -> kind. Base names are function / method / ATen op names without leading underscores or a trailing
# in-place underscore ("_softmax" -> "softmax", "add_" -> "add").
# ---------------------------------------------------------------------------------------------------------------

_KIND_BY_BASE: Mapping[str, OpKind] = {
    **dict.fromkeys(["linear", "bilinear"], OpKind.LINEAR),
    **dict.fromkeys(
        ["matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "mv", "dot", "tensordot", "outer",
         "lightning_indexer"],
        OpKind.MATMUL,
    ),
    **dict.fromkeys(
        ["scaled_dot_product_attention", "multi_head_attention_forward", "flex_attention", "windowed_attention",
         "sparse_attention"],
        OpKind.ATTENTION,
    ),
    **dict.fromkeys(["softmax", "log_softmax", "softmin", "scale_causal_softmax"], OpKind.SOFTMAX),
    **dict.fromkeys(
        ["layer_norm", "native_layer_norm", "rms_norm", "batch_norm", "native_batch_norm", "group_norm",
         "native_group_norm", "instance_norm", "local_response_norm", "normalize"],
        OpKind.NORM,
    ),
    **dict.fromkeys(["embedding", "embedding_bag"], OpKind.EMBEDDING),
    **dict.fromkeys(
        ["sum", "mean", "max", "min", "amax", "amin", "prod", "std", "var", "norm", "logsumexp", "all", "any",
         "argmax", "argmin", "count_nonzero", "nansum", "nanmean", "var_mean", "std_mean", "cumsum", "cumprod",
         "linalg_vector_norm", "vector_norm", "aminmax"],
        OpKind.REDUCTION,
    ),
    **dict.fromkeys(
        ["view", "unsafe_view", "reshape", "transpose", "permute", "t", "T", "mT", "contiguous", "expand",
         "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten", "split", "split_with_sizes", "chunk",
         "unbind", "narrow", "select", "slice", "getitem", "cat", "concat", "concatenate", "stack", "hstack",
         "vstack", "movedim", "moveaxis", "view_as", "reshape_as", "tensor_split", "flip", "roll", "repeat",
         "tile", "repeat_interleave", "swapaxes", "swapdims", "alias", "as_strided", "detach", "pad",
         "constant_pad_nd", "diagonal", "identity", "clone", "unfold", "pixel_shuffle", "channel_shuffle"],
        OpKind.VIEW,
    ),
    **dict.fromkeys(
        ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
         "conv"],
        OpKind.CONV,
    ),
    **dict.fromkeys(
        ["max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
         "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
         "adaptive_max_pool2d", "adaptive_max_pool3d", "lp_pool1d", "lp_pool2d", "max_pool2d_with_indices",
         "pool"],
        OpKind.POOL,
    ),
    **dict.fromkeys(
        ["topk", "gather", "scatter", "scatter_add", "scatter_reduce", "index_select", "index_add",
         "index_copy", "index_put", "index", "one_hot", "nonzero", "argsort", "sort", "masked_select", "take",
         "take_along_dim", "bincount", "searchsorted", "masked_scatter"],
        OpKind.ROUTING,
    ),
    **dict.fromkeys(
        ["cross_entropy", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss", "smooth_l1_loss",
         "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "cosine_embedding_loss",
         "margin_ranking_loss", "ctc_loss", "triplet_margin_loss", "soft_margin_loss", "multilabel_margin_loss"],
        OpKind.LOSS,
    ),
    **dict.fromkeys(
        ["add", "sub", "rsub", "mul", "truediv", "div", "floordiv", "floor_divide", "mod", "remainder", "pow",
         "neg", "abs", "exp", "exp2", "expm1", "log", "log1p", "log2", "sqrt", "rsqrt", "sin", "cos", "tan",
         "tanh", "sigmoid", "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu",
         "softplus", "softsign", "hardswish", "hardsigmoid", "hardtanh", "logsigmoid", "threshold", "prelu",
         "glu", "dropout", "native_dropout", "dropout_add", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
         "feature_alpha_dropout", "masked_fill", "where", "clamp", "clamp_min", "clamp_max", "clip", "maximum",
         "minimum", "to", "to_copy", "float", "half", "bfloat16", "double", "long", "int", "short", "bool", "byte",
         "char", "type", "type_as", "eq", "ne", "lt",
         "gt", "le", "ge", "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and",
         "bitwise_or", "bitwise_not", "and_", "or_", "xor", "invert", "not_", "reciprocal", "square", "erf",
         "erfc", "lerp", "addcmul", "addcdiv", "zeros_like", "ones_like", "full_like", "empty_like",
         "rand_like", "randn_like", "fill", "sign", "floor", "ceil", "round", "trunc", "frac", "isinf", "isnan",
         "isfinite", "nan_to_num", "tril", "triu", "copy", "atan", "asin", "acos", "sinh", "cosh", "atan2",
         "hypot", "bernoulli", "polar", "view_as_real", "view_as_complex", "real", "imag", "mul_scalar",
         "interpolate", "upsample_nearest2d", "upsample_bilinear2d", "softshrink", "hardshrink",
         "rrelu", "tanhshrink"],
        OpKind.ELEMENTWISE,
    ),
}

_INPLACE_OPERATORS: Mapping[Callable[..., Any], str] = {
    operator.iadd: "add", operator.isub: "sub", operator.imul: "mul", operator.itruediv: "truediv",
    operator.ifloordiv: "floordiv", operator.imod: "mod", operator.ipow: "pow", operator.iand: "and_",
    operator.ior: "or_", operator.ixor: "xor",
}

# Leaf-module classes -> base name. Order matters only for subclasses (checked with isinstance, first match wins).
_MODULE_BASES: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.Linear, "linear"),
    (nn.Bilinear, "bilinear"),
    (nn.MultiheadAttention, "multi_head_attention_forward"),
    (nn.LayerNorm, "layer_norm"),
    (nn.RMSNorm, "rms_norm"),
    (nn.modules.batchnorm._BatchNorm, "batch_norm"),
    (nn.GroupNorm, "group_norm"),
    (nn.modules.instancenorm._InstanceNorm, "instance_norm"),
    (nn.LocalResponseNorm, "local_response_norm"),
    (nn.Embedding, "embedding"),
    (nn.EmbeddingBag, "embedding_bag"),
    (nn.modules.conv._ConvTransposeNd, "conv_transpose"),
    (nn.modules.conv._ConvNd, "conv"),
    (nn.modules.dropout._DropoutNd, "dropout"),
    (nn.Softmax, "softmax"),
    (nn.LogSoftmax, "log_softmax"),
    (nn.Softmin, "softmin"),
    (nn.modules.pooling._MaxPoolNd, "pool"),
    (nn.modules.pooling._AvgPoolNd, "pool"),
    (nn.modules.pooling._AdaptiveAvgPoolNd, "pool"),
    (nn.modules.pooling._AdaptiveMaxPoolNd, "pool"),
    (nn.modules.pooling._LPPoolNd, "pool"),
    (nn.Flatten, "flatten"),
    (nn.Unflatten, "unflatten"),
    (nn.Identity, "identity"),
    (nn.modules.loss._Loss, "loss"),
    (nn.Upsample, "interpolate"),
)

# Activation modules: their base name is the lowercased class name ("GELU" -> "gelu", "ReLU6" -> "relu6").
_ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.GELU, nn.ReLU, nn.ReLU6, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU,
    nn.Softplus, nn.Softsign, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.LogSigmoid, nn.PReLU, nn.GLU,
    nn.Threshold, nn.Tanhshrink, nn.Softshrink, nn.Hardshrink,
)

LEAF_MODULE_TYPES: tuple[type[nn.Module], ...] = tuple(t for t, _ in _MODULE_BASES) + _ACTIVATION_MODULES
"""torch.nn modules the tracer keeps whole (one graph node each) instead of tracing into them."""


# ---------------------------------------------------------------------------------------------------------------
# Stable names
# ---------------------------------------------------------------------------------------------------------------


def class_name(cls: type) -> str:
    """"torch.nn.Linear" for public torch.nn classes, else "module.QualName" (stable across runs)."""
    if getattr(nn, cls.__name__, None) is cls:
        return f"torch.nn.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def function_name(fn: Any) -> str:
    """A stable public name for a called function: "torch.nn.functional.gelu", "torch.cat", "operator.add",
    "aten.linear.default" (export), falling back to "module.qualname"."""
    if isinstance(fn, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(fn)
    name = getattr(fn, "__name__", None)
    if name is not None:
        if getattr(operator, name, None) is fn:
            return f"operator.{name}"
        if getattr(builtins, name, None) is fn:
            return f"builtins.{name}"
        for prefix, namespace in (("torch.nn.functional", F), ("torch", torch), ("torch.special", torch.special),
                                  ("torch.linalg", torch.linalg), ("torch.fft", torch.fft)):
            if getattr(namespace, name, None) is fn:
                return f"{prefix}.{name}"
        module = getattr(fn, "__module__", None) or "builtins"
        return f"{module}.{getattr(fn, '__qualname__', name)}"
    return repr(fn)


@dataclass(frozen=True, slots=True)
class CallName:
    """The names of one traced call: `target` (stable text for `Node.target`), `base` (classification key)."""

    target: str
    base: str
    inplace: bool


def _strip_base(name: str) -> tuple[str, bool]:
    """("add_" -> "add", in-place), ("_softmax" -> "softmax"); operator names like "and_" are not in-place."""
    if name in ("and_", "or_", "not_"):
        return name, False
    inplace = name.endswith("_") and not name.endswith("__")
    core = name[:-1] if inplace else name
    return core.lstrip("_"), inplace


def name_call(op: str, target: Any, module: nn.Module | None = None, args: Sequence[Any] = ()) -> CallName:
    """Name an fx node's call. `op` is the fx opcode (call_module / call_function / call_method)."""
    if op == "call_module":
        assert module is not None
        return CallName(class_name(type(module)), module_base(module), bool(getattr(module, "inplace", False)))
    if op == "call_method":
        base, inplace = _strip_base(str(target))
        return CallName(f"Tensor.{target}", base, inplace)
    if isinstance(target, torch._ops.OpOverload):
        base, inplace = _strip_base(target._schema.name.split("::")[-1])
        return CallName(str(target), base, inplace)
    if target in _INPLACE_OPERATORS:
        return CallName(function_name(target), _INPLACE_OPERATORS[target], True)
    if target is builtins.getattr and len(args) >= 2:
        return CallName(f"Tensor.{args[1]}", str(args[1]), False)
    name = getattr(target, "__name__", repr(target))
    base, inplace = _strip_base(name)
    return CallName(function_name(target), base, inplace)


def module_base(module: nn.Module) -> str:
    if isinstance(module, _ACTIVATION_MODULES):
        return type(module).__name__.lower()
    for cls, base in _MODULE_BASES:
        if isinstance(module, cls):
            if base == "loss":
                return _loss_base(module)
            return base
    return "module"


def _loss_base(module: nn.Module) -> str:
    names = {nn.CrossEntropyLoss: "cross_entropy", nn.NLLLoss: "nll_loss", nn.MSELoss: "mse_loss",
             nn.L1Loss: "l1_loss", nn.BCEWithLogitsLoss: "binary_cross_entropy_with_logits",
             nn.BCELoss: "binary_cross_entropy", nn.KLDivLoss: "kl_div", nn.SmoothL1Loss: "smooth_l1_loss",
             nn.HuberLoss: "huber_loss"}
    return names.get(type(module), "mse_loss")


# ---------------------------------------------------------------------------------------------------------------
# Classification of one call
# ---------------------------------------------------------------------------------------------------------------

Attrs = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class Classified:
    op_kind: OpKind
    attrs: Attrs


def classify(
    name: CallName,
    module: nn.Module | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    outputs: Sequence[torch.Tensor],
    is_weight: Callable[[torch.Tensor], bool],
) -> Classified:
    """Kind and attributes of one call. `args`/`kwargs` hold the propagated (fake) values, `outputs` the tensor
    outputs, `is_weight(t)` says whether a tensor argument is a parameter (or computed from parameters only)."""
    base = name.base
    tensors = [a for a in _tensor_leaves((args, kwargs))]
    kind = _kind(base, module, args, tensors, is_weight)
    attrs: dict[str, Any] = {}
    if kind is OpKind.LINEAR:
        attrs.update(_linear_attrs(base, module, args, kwargs, tensors, outputs, is_weight))
    elif kind is OpKind.ATTENTION:
        attrs.update(_attention_attrs(module, args, kwargs, custom=base if base in _CUSTOM_ATTENTION else None))
    elif kind is OpKind.SOFTMAX:
        attrs.update(_softmax_attrs(base, module, args, kwargs, tensors))
    elif kind is OpKind.NORM:
        attrs.update(_norm_attrs(base, module, args, kwargs, tensors))
    elif kind is OpKind.REDUCTION:
        attrs.update(_reduction_attrs(args, kwargs, tensors))
    elif kind is OpKind.EMBEDDING:
        attrs.update(_embedding_attrs(module, tensors, is_weight))
    elif kind is OpKind.CONV:
        attrs.update(_conv_attrs(module, tensors, is_weight))
    elif kind is OpKind.ROUTING:
        attrs.update(_routing_attrs(base, args, kwargs, tensors))
    return Classified(kind, tuple(sorted((k, v) for k, v in attrs.items() if v is not None)))


def _kind(
    base: str,
    module: nn.Module | None,
    args: Sequence[Any],
    tensors: Sequence[torch.Tensor],
    is_weight: Callable[[torch.Tensor], bool],
) -> OpKind:
    if module is not None and base == "module":
        return OpKind.OTHER
    if base in ("matmul", "mm", "bmm", "einsum", "mv", "tensordot") and any(is_weight(t) for t in tensors):
        # x @ W with W a parameter is a linear layer for sharding purposes.
        return OpKind.LINEAR
    if base == "addmm" and len(tensors) == 3 and is_weight(tensors[2]):
        return OpKind.LINEAR
    if base == "getitem":
        if args and isinstance(args[0], torch.Tensor) and any(
            isinstance(t, torch.Tensor) for t in _tensor_leaves(args[1:])
        ):
            return OpKind.ROUTING  # advanced (tensor) indexing gathers rows
        return OpKind.VIEW
    if base == "where" and len(args) == 1:
        return OpKind.ROUTING
    return _KIND_BY_BASE.get(base, OpKind.OTHER)


def _tensor_leaves(obj: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _collect(obj, out)
    return out


def _collect(obj: Any, out: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, tuple | list):
        for x in obj:
            _collect(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _collect(x, out)
    elif isinstance(obj, slice):
        _collect((obj.start, obj.stop, obj.step), out)


def _arg(args: Sequence[Any], kwargs: Mapping[str, Any], index: int, key: str, default: Any = None) -> Any:
    if key in kwargs:
        return kwargs[key]
    return args[index] if len(args) > index else default


def _neg_dim(dim: Any, ndim: int) -> Any:
    """A dim counted from the end (-1 = last), or a tuple of such dims; None stays None."""
    if isinstance(dim, int):
        return dim - ndim if dim >= 0 else dim
    if isinstance(dim, list | tuple) and all(isinstance(d, int) for d in dim):
        return tuple(_neg_dim(d, ndim) for d in dim)
    return None


def _linear_attrs(base, module, args, kwargs, tensors, outputs, is_weight) -> dict[str, Any]:
    if isinstance(module, nn.Linear):
        return {"in_features": module.in_features, "out_features": module.out_features,
                "bias": module.bias is not None}
    if base == "linear" and len(tensors) >= 2:
        weight = _arg(args, kwargs, 1, "weight")
        bias = _arg(args, kwargs, 2, "bias")
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return {"in_features": int(weight.shape[1]), "out_features": int(weight.shape[0]),
                    "bias": isinstance(bias, torch.Tensor)}
    acts = [t for t in tensors if not is_weight(t)]
    if acts and outputs and acts[0].dim() >= 1 and outputs[0].dim() >= 1:
        return {"in_features": int(acts[0].shape[-1]), "out_features": int(outputs[0].shape[-1]),
                "bias": base == "addmm"}
    return {}


_CUSTOM_ATTENTION = frozenset({"windowed_attention", "sparse_attention"})
"""`models.windowed_attention` and `models.sparse_attention`: causal, no mask, a window of keys per query."""


def _attention_attrs(module, args, kwargs, *, custom: str | None = None) -> dict[str, Any]:
    if isinstance(module, nn.MultiheadAttention):
        return {"num_heads": module.num_heads, "num_kv_heads": module.num_heads, "head_dim": module.head_dim,
                "batch_first": module.batch_first}
    q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return {"attention_core": True}
    heads = {"num_heads": int(q.shape[-3]) if q.dim() >= 3 else 1,
             "num_kv_heads": int(k.shape[-3]) if k.dim() >= 3 else 1, "head_dim": int(q.shape[-1])}
    if custom == "windowed_attention":  # (query, key, value, window, scale, sinks)
        return {**heads, "is_causal": True, "dropout_p": 0.0, "has_mask": False, "attention_core": True,
                "window": int(_arg(args, kwargs, 3, "window")),
                "has_sinks": isinstance(_arg(args, kwargs, 5, "sinks"), torch.Tensor)}
    if custom == "sparse_attention":  # (query, key, value, indices (B, S, k), scale): as many keys as a k window
        return {**heads, "is_causal": True, "dropout_p": 0.0, "has_mask": False, "attention_core": True,
                "window": int(_arg(args, kwargs, 3, "indices").shape[-1]), "sparse": True}
    mask = _arg(args, kwargs, 3, "attn_mask")
    return {
        **heads,
        "is_causal": bool(_arg(args, kwargs, 5, "is_causal", False)),
        "dropout_p": float(_arg(args, kwargs, 4, "dropout_p", 0.0)),
        "has_mask": isinstance(mask, torch.Tensor),
        "attention_core": True,
    }


def _softmax_attrs(base, module, args, kwargs, tensors) -> dict[str, Any]:
    ndim = tensors[0].dim() if tensors else 0
    if base == "scale_causal_softmax":  # `models.megatron_kernels`: over the keys, the last dim
        return {"dim": -1}
    dim = module.dim if module is not None else _arg(args, kwargs, 1, "dim")
    return {"dim": _neg_dim(dim, ndim)}


def _norm_attrs(base, module, args, kwargs, tensors) -> dict[str, Any]:
    ndim = tensors[0].dim() if tensors else 0
    if isinstance(module, nn.LayerNorm | nn.RMSNorm) or base in ("layer_norm", "native_layer_norm", "rms_norm"):
        shape = module.normalized_shape if module is not None else _arg(args, kwargs, 1, "normalized_shape")
        k = len(shape) if isinstance(shape, list | tuple | torch.Size) else 1
        return {"dim": -k, "normalized_ndim": k, "norm_type": "rms" if "rms" in base else "layer"}
    if base == "normalize":
        return {"dim": _neg_dim(_arg(args, kwargs, 2, "dim", 1), ndim), "norm_type": "lp"}
    # batch / group / instance norms normalize per channel (dim 1 of NC... inputs)
    norm_type = base.replace("native_", "").removesuffix("_norm")
    return {"dim": _neg_dim(1, ndim) if ndim > 1 else None, "norm_type": norm_type}


def _reduction_attrs(args, kwargs, tensors) -> dict[str, Any]:
    ndim = tensors[0].dim() if tensors else 0
    dim = _arg(args, kwargs, 1, "dim")
    keepdim = _arg(args, kwargs, 2, "keepdim", False)
    return {"dim": _neg_dim(dim, ndim), "keepdim": keepdim if isinstance(keepdim, bool) else None}


def _embedding_attrs(module, tensors, is_weight) -> dict[str, Any]:
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return {"num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim}
    weights = [t for t in tensors if is_weight(t) and t.dim() == 2]
    if weights:
        return {"num_embeddings": int(weights[0].shape[0]), "embedding_dim": int(weights[0].shape[1])}
    return {}


def _conv_attrs(module, tensors, is_weight) -> dict[str, Any]:
    if isinstance(module, nn.modules.conv._ConvNd):
        return {"in_channels": module.in_channels, "out_channels": module.out_channels,
                "kernel_size": tuple(module.kernel_size), "stride": tuple(module.stride), "groups": module.groups}
    weights = [t for t in tensors if is_weight(t) and t.dim() >= 3]
    if weights:
        w = weights[0]
        return {"out_channels": int(w.shape[0]), "kernel_size": tuple(int(d) for d in w.shape[2:])}
    return {}


def _routing_attrs(base, args, kwargs, tensors) -> dict[str, Any]:
    if base == "topk" and tensors:
        k = _arg(args, kwargs, 1, "k")
        dim = _arg(args, kwargs, 2, "dim", -1)
        x = tensors[0]
        if isinstance(k, int) and isinstance(dim, int) and x.dim() > 0:
            return {"k": k, "num_experts": int(x.shape[dim])}
    if base == "one_hot":
        # num_classes is the expert count for a router's one-hot but a capacity for GShard's slot one-hot,
        # so it is recorded under its own name.
        n = _arg(args, kwargs, 1, "num_classes")
        if isinstance(n, int) and n > 0:
            return {"num_classes": n}
    return {}
