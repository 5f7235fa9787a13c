"""Hugging Face transformers models, built from their config classes: no weights, no hub access.

A spec (what follows `hf:` in a MODEL name) is an architecture of `ARCHS` ("llama", "gpt2", "mistral", "mixtral",
"qwen2", "bert", "t5"), which starts from a small default config so that tests trace in about a second, or a
path to a local `config.json` (or a folder holding one), e.g. one saved next to a checkpoint. Overrides set any
field of the config class, with the field's declared type; `setting_types(spec)` lists them.

The model is the architecture's language-model head (`LlamaForCausalLM`, `BertForMaskedLM`,
`T5ForConditionalGeneration`, ...), built on the requested device ("meta" allocates nothing; a real device gets
transformers' own initialization from torch's global RNG, which the caller seeds, as for the zoo). Training settings: no KV cache (`use_cache=False`), SDPA
attention without a materialized mask for unpadded batches, and GShard capacity dispatch for mixture-of-experts
layers (`models.hf_tracing` explains both, and why).

Example inputs are token ids (encoder and decoder ids for encoder-decoders); the losses are the zoo's synthetic
ones: next-token cross entropy for causal and encoder-decoder LMs, token reconstruction for masked LMs.

transformers is an optional extra; without it, `build` and `setting_types` raise `ImportError(INSTALL_HINT)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models import hf_tracing
from models.layer_stack import TraceStandIn, stand_in_for
from models.synthetic import next_token_loss, token_ids
from models.validation import require_traceable_depth

INSTALL_HINT = "pip install 'stratagem[hf]'"
"""What to run when transformers is missing."""

MIN_TRANSFORMERS_MAJOR = 5
"""Configs as typed dataclasses, and the attention-mask and experts interfaces `models.hf_tracing` registers."""

DEFAULT_SEQ = 128
"""Tokens per sample for the built-in architectures when no sequence length is given."""

MAX_DEFAULT_SEQ = 4096
"""Cap on the default sequence length of a config.json model (its max_position_embeddings, when smaller)."""


class HFTask(enum.StrEnum):
    """Which head is built, and so which inputs and loss the model gets."""

    CAUSAL_LM = "causal-lm"      # decoder-only: ids -> next-token logits
    MASKED_LM = "masked-lm"      # encoder-only: ids -> per-token logits
    SEQ2SEQ_LM = "seq2seq-lm"    # encoder-decoder: (ids, mask, decoder ids) -> decoder logits


class Json:
    """Setting type marker: a field whose declared type is not a plain scalar (dicts, lists, unions); the value
    is given as JSON and checked by the config class itself."""


@dataclass(frozen=True)
class HFArch:
    """A built-in architecture: transformers classes by name, and its small default config."""

    name: str
    config_class: str
    model_class: str
    task: HFTask
    defaults: tuple[tuple[str, Any], ...]
    """Config overrides of the default model (sorted by key); anything not listed is transformers' default."""
    description: str
    position_limit: str | None = None
    """Config field bounding the sequence length (learned absolute positions), or None."""


# Dropout is 0 in every default (as in the zoo) so a sharded run reproduces the single-process loss.
_DECODER = (("hidden_size", 128), ("intermediate_size", 352), ("max_position_embeddings", 2048),
            ("num_attention_heads", 4), ("num_hidden_layers", 2), ("num_key_value_heads", 2), ("vocab_size", 1024))

ARCHS: Mapping[str, HFArch] = types.MappingProxyType({a.name: a for a in (
    HFArch("llama", "LlamaConfig", "LlamaForCausalLM", HFTask.CAUSAL_LM, _DECODER,
           "Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU"),
    HFArch("mistral", "MistralConfig", "MistralForCausalLM", HFTask.CAUSAL_LM, _DECODER,
           "Mistral: Llama blocks with sliding-window attention"),
    HFArch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", HFTask.CAUSAL_LM, _DECODER,
           "Qwen2: Llama blocks with q/k/v biases"),
    HFArch("mixtral", "MixtralConfig", "MixtralForCausalLM", HFTask.CAUSAL_LM,
           tuple(sorted((*_DECODER, ("num_local_experts", 4), ("num_experts_per_tok", 2)))),
           "Mixtral: Mistral blocks with top-k routed SwiGLU experts"),
    HFArch("gpt2", "GPT2Config", "GPT2LMHeadModel", HFTask.CAUSAL_LM,
           (("attn_pdrop", 0.0), ("embd_pdrop", 0.0), ("n_embd", 128), ("n_head", 4), ("n_layer", 2),
            ("n_positions", 1024), ("resid_pdrop", 0.0), ("vocab_size", 1024)),
           "GPT-2: LayerNorm, learned positions, GELU MLP, tied head", position_limit="n_positions"),
    HFArch("bert", "BertConfig", "BertForMaskedLM", HFTask.MASKED_LM,
           (("attention_probs_dropout_prob", 0.0), ("hidden_dropout_prob", 0.0), ("hidden_size", 128),
            ("intermediate_size", 512), ("max_position_embeddings", 512), ("num_attention_heads", 4),
            ("num_hidden_layers", 2), ("vocab_size", 1024)),
           "BERT: post-LayerNorm encoder with a masked-LM head", position_limit="max_position_embeddings"),
    HFArch("t5", "T5Config", "T5ForConditionalGeneration", HFTask.SEQ2SEQ_LM,
           (("d_ff", 512), ("d_kv", 32), ("d_model", 128), ("dropout_rate", 0.0), ("num_decoder_layers", 2),
            ("num_heads", 4), ("num_layers", 2), ("vocab_size", 1024)),
           "T5: encoder-decoder, relative position buckets, ReLU MLP"),
)})
"""Built-in architectures by name (`hf:NAME`)."""

EXTRA_SETTINGS: Mapping[str, type] = types.MappingProxyType({"capacity_factor": float})
"""Settings that are not config fields: the expert capacity factor of mixture-of-experts models."""

_BOOKKEEPING = ("model_type", "transformers_version", "architectures")
"""config.json keys that describe the file rather than the model (not settable, not constructor arguments)."""

_FORCED = {"use_cache": False}
"""Config values training needs (a KV cache is an inference output, and not traceable)."""


@dataclass(frozen=True)
class HFModel:
    """A transformers model ready to trace or train."""

    spec: str
    """What followed `hf:`."""
    model_type: str
    """transformers' model type ("llama", ...)."""
    task: HFTask
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    """Positional forward inputs for the requested batch (shape-only on the meta device)."""
    seq_len: int
    config: Any
    """The transformers config the model was built from."""
    loss: Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]


def is_available() -> bool:
    """Whether transformers can be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def setting_types(spec: str) -> dict[str, Any]:
    """Settable keys of `spec` -> the type their values parse as (`Json` for structured fields)."""
    resolved = _resolve(spec)
    types_ = _config_field_types(resolved.config_class)
    for key in (*_FORCED, *_BOOKKEEPING):
        types_.pop(key, None)
    try:
        with _quiet_transformers():
            moe = _is_moe(resolved.config_class(**_config_kwargs(resolved.base)))
    except Exception:  # noqa: BLE001 - a broken config.json is reported by `build`, with the settings applied
        moe = False
    if moe:
        types_.update(EXTRA_SETTINGS)
    return types_


def build(
    spec: str,
    overrides: Mapping[str, Any] = types.MappingProxyType({}),
    *,
    batch: int = 1,
    seq: int | None = None,
    device: torch.device | str = "meta",
) -> HFModel:
    """Build `spec` with config `overrides` (already parsed to their types) and example inputs of `batch`
    samples of `seq` tokens. Bad specs or values raise ValueError naming them; a missing transformers raises
    ImportError."""
    resolved = _resolve(spec)
    config = _make_config(resolved, dict(overrides))
    _require_token_vocabulary(config)
    require_traceable_depth(_num_layers(config))
    seq_len = _sequence_length(resolved, config, seq)
    module = _construct(resolved.model_class, config, torch.device(device))
    inputs = _example_inputs(resolved.task, config, batch, seq_len, torch.device(device))
    return HFModel(spec=spec, model_type=config.model_type, task=resolved.task, module=module,
                   example_inputs=inputs, seq_len=seq_len, config=config, loss=_LOSSES[resolved.task])


def trace_stand_in(spec: str, overrides: Mapping[str, Any], full: HFModel, *, batch: int = 1) -> TraceStandIn | None:
    """A shorter model of the same config, on the meta device (a trace needs no weights), to trace in place of
    `full` when its layers repeat (`models.layer_stack`); None for encoder-decoders (two stacks) and stacks
    without a repeating tail."""
    if full.task is HFTask.SEQ2SEQ_LM or _num_layers(full.config) != getattr(full.config, "num_hidden_layers", None):
        return None

    def rebuild(cut: dict[str, Any]) -> tuple[nn.Module, Any, tuple[torch.Tensor, ...]]:
        short = build(spec, {**overrides, **cut}, batch=batch, seq=full.seq_len, device="meta")
        return short.module, short.config, short.example_inputs

    return stand_in_for(full.module, full.config, full.config.num_hidden_layers, "num_hidden_layers", rebuild)


def _num_layers(config: Any) -> int:
    """Encoder (or decoder-only) blocks plus decoder blocks of an encoder-decoder. transformers maps its own
    names (n_layer, num_layers, encoder_layers) onto num_hidden_layers, so each stack is counted once."""
    def first(*names: str) -> int:
        return next((v for n in names if isinstance(v := getattr(config, n, None), int)), 0)

    return first("num_hidden_layers", "num_layers", "n_layer") + first("num_decoder_layers", "decoder_layers")


def list_archs() -> tuple[HFArch, ...]:
    """The built-in architectures, in table order."""
    return tuple(ARCHS.values())


# ---------------------------------------------------------------------------------------------------------------
# Spec resolution: a built-in architecture or a config.json
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Resolved:
    config_class: type
    model_class: type
    task: HFTask
    base: dict[str, Any]
    """Config values before overrides (the arch's defaults, or the config.json's contents)."""
    arch: HFArch | None
    default_seq: int


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(f"Hugging Face models need transformers: {INSTALL_HINT}") from None
    major = int(transformers.__version__.split(".")[0])
    if major < MIN_TRANSFORMERS_MAJOR:
        raise ImportError(f"Hugging Face models need transformers>={MIN_TRANSFORMERS_MAJOR}.0, found "
                          f"{transformers.__version__}: {INSTALL_HINT}")
    hf_tracing.register()
    return transformers


def _resolve(spec: str) -> _Resolved:
    transformers = _transformers()
    if spec in ARCHS:
        arch = ARCHS[spec]
        return _Resolved(getattr(transformers, arch.config_class), getattr(transformers, arch.model_class),
                         arch.task, dict(arch.defaults), arch, DEFAULT_SEQ)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _resolve_config_file(transformers, path)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if spec in CONFIG_MAPPING_NAMES:
        return _resolve_model_type(transformers, spec)
    raise ValueError(f"hf:{spec}: not a built-in architecture ({', '.join(ARCHS)}), a transformers model type "
                     "(deepseek_v3, qwen3_moe, ...) nor a config.json file or a folder holding one")


def _resolve_model_type(transformers: Any, model_type: str) -> _Resolved:
    """A transformers model type with its config class's defaults: the published model's sizes
    (`DeepseekV3Config()` is DeepSeek-V3 671B), as `config_class().save_pretrained(dir)` then `hf:dir` gives."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    model_class, task = _head_for(transformers, model_type, {}, Path(model_type))
    try:
        with _quiet_transformers():
            limit = getattr(config_class(), "max_position_embeddings", None) or MAX_DEFAULT_SEQ
    except Exception as e:  # noqa: BLE001 - strict validation of the defaults (see `_make_config`)
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"transformers' default {config_class.__name__} does not validate: {detail}") from None
    return _Resolved(config_class, model_class, task, {}, None, min(int(limit), MAX_DEFAULT_SEQ))


def _resolve_config_file(transformers: Any, path: Path) -> _Resolved:
    try:
        base = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"hf:{path}: cannot read it as JSON: {e}") from None
    model_type = base.get("model_type") if isinstance(base, dict) else None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ValueError(f"hf:{path}: model_type {model_type!r} is not a transformers {transformers.__version__} "
                         "model type")
    config_class = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
    model_class, task = _head_for(transformers, model_type, base, path)
    arch = next((a for a in ARCHS.values() if a.config_class == config_class.__name__), None)
    limit = base.get("max_position_embeddings") or base.get("n_positions") or MAX_DEFAULT_SEQ
    return _Resolved(config_class, model_class, task, base, arch, min(int(limit), MAX_DEFAULT_SEQ))


def _head_for(transformers: Any, model_type: str, base: Mapping[str, Any], path: Path) -> tuple[type, HFTask]:
    """The config's own `architectures[0]` when it is a language-model head, else the model type's LM head."""
    from transformers.models.auto import modeling_auto as auto

    by_task = (
        (HFTask.SEQ2SEQ_LM, auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        (HFTask.MASKED_LM, auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        (HFTask.CAUSAL_LM, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    )
    named = (base.get("architectures") or [None])[0]
    for task, mapping in by_task:
        if named is not None and named == mapping.get(model_type) and hasattr(transformers, named):
            return getattr(transformers, named), task
    encoder_decoder = bool(base.get("is_encoder_decoder"))
    for task, mapping in by_task:
        if (task is HFTask.SEQ2SEQ_LM) != encoder_decoder or model_type not in mapping:
            continue
        if task is HFTask.MASKED_LM and base.get("is_decoder"):
            continue
        return getattr(transformers, mapping[model_type]), task
    raise ValueError(f"hf:{path}: model type {model_type!r} has no causal, masked or seq2seq language-model head "
                     "in transformers")


# ---------------------------------------------------------------------------------------------------------------
# Config: field types, overrides, validation
# ---------------------------------------------------------------------------------------------------------------


def _config_field_types(config_class: type) -> dict[str, Any]:
    """Config fields -> parse type (transformers 5 configs are dataclasses with declared field types)."""
    return {f.name: _parse_type(f.type) for f in dataclasses.fields(config_class) if not f.name.startswith("_")}


_SCALARS = (bool, int, float, str)


def _parse_type(hint: Any) -> Any:
    """A declared field type as the registry's parser understands it: scalars, Literals and `X | None` of them
    stay; `int | float` becomes float; anything structured is `Json`."""
    if isinstance(hint, type) and issubclass(hint, _SCALARS):
        return hint
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return hint
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if set(options) == {int, float}:
            options = [float]
        if len(options) == 1 and (_parse_type(options[0]) is not Json):
            inner = _parse_type(options[0])
            return inner | None if type(None) in args else inner
    return Json


def _make_config(resolved: _Resolved, overrides: dict[str, Any]) -> Any:
    capacity_factor = overrides.pop("capacity_factor", None)
    for key in _FORCED:
        if key in overrides:
            raise ValueError(f"{key} cannot be set: training builds the model with {key}={_FORCED[key]}")
    try:
        # Strict config validation raises huggingface_hub's StrictDataclassFieldValidationError (not a
        # ValueError) for a mistyped field, so any failure here is reported as the bad settings.
        with _quiet_transformers():
            config = resolved.config_class(**_config_kwargs({**resolved.base, **overrides, **_FORCED}))
    except Exception as e:  # noqa: BLE001 - see above
        detail = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(f"invalid {resolved.config_class.__name__}: {detail}") from None
    if capacity_factor is not None:
        if not _is_moe(config):
            raise ValueError(f"capacity_factor applies to mixture-of-experts models; {config.model_type} has none")
        if not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be a positive number, got {capacity_factor!r}")
    if _is_moe(config):
        setattr(config, hf_tracing.CAPACITY_FACTOR_ATTR,
                hf_tracing.DEFAULT_CAPACITY_FACTOR if capacity_factor is None else float(capacity_factor))
    return config


def _config_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """Constructor keyword arguments from config.json contents (bookkeeping keys dropped)."""
    return {k: v for k, v in values.items() if k not in _BOOKKEEPING}


def _is_moe(config: Any) -> bool:
    """Whether the config declares routed experts: an expert-count field above 1 ("num_local_experts",
    "n_routed_experts", ...; per-token and shared-expert counts aside), whatever the model calls it."""
    fields = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    return any("expert" in key and "per_tok" not in key and "shared" not in key
               and isinstance(value, int) and not isinstance(value, bool) and value > 1
               for key, value in fields.items())


def _sequence_length(resolved: _Resolved, config: Any, seq: int | None) -> int:
    length = resolved.default_seq if seq is None else seq
    limit_field = resolved.arch.position_limit if resolved.arch is not None else None
    if seq is None and limit_field is not None:
        length = min(length, getattr(config, limit_field))
    if limit_field is not None and length > getattr(config, limit_field):
        raise ValueError(f"sequence length {length} exceeds {limit_field}={getattr(config, limit_field)} (learned "
                         f"positions); set {limit_field}={length} or more")
    return length


# ---------------------------------------------------------------------------------------------------------------
# Construction, inputs, losses
# ---------------------------------------------------------------------------------------------------------------


def _require_token_vocabulary(config: Any) -> None:
    """The model reads token ids: a multimodal config keeps its language model's vocabulary in `text_config`."""
    if getattr(config, "vocab_size", None) is not None:
        return
    text = getattr(config, "text_config", None)
    name = type(config).__name__
    if text is not None and getattr(text, "model_type", None):
        raise ValueError(f"{name} is a multimodal config, whose language model is its text_config: plan "
                         f"hf:{text.model_type} (or a config.json of that model type) instead")
    raise ValueError(f"{name} has no vocab_size: not a language model that takes token ids")


def _construct(model_class: type, config: Any, device: torch.device) -> nn.Module:
    if getattr(model_class, "_supports_sdpa", False):
        config._attn_implementation = hf_tracing.ATTENTION
    elif getattr(model_class, "_supports_attention_backend", False):  # GPT-OSS: sinks, no SDPA
        config._attn_implementation = hf_tracing.ATTENTION_BACKEND
    with _quiet_transformers():
        try:
            with device:
                model = model_class(config)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{model_class.__name__}: {' '.join(str(e).split())}") from None
    _use_capacity_experts(model, config)
    hf_tracing.use_sparse_indexers(model)
    model.train()
    return model


def _use_capacity_experts(model: nn.Module, config: Any) -> None:
    """Route every experts module transformers' `use_experts_implementation` built (it reads
    `config._experts_implementation` at each call) through `hf_tracing.EXPERTS`, whatever the model calls its
    expert-count field; set after construction so the config's own checks see transformers' default."""
    experts = [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")
               and isinstance(getattr(m, "num_experts", None), int)]
    for module in experts:
        module.config._experts_implementation = hf_tracing.EXPERTS
        setattr(module, hf_tracing.EXPERT_BUFFERS_ATTR, types.MethodType(hf_tracing.expert_buffers_forward, module))
        if not hasattr(module.config, hf_tracing.CAPACITY_FACTOR_ATTR):
            setattr(module.config, hf_tracing.CAPACITY_FACTOR_ATTR,
                    getattr(config, hf_tracing.CAPACITY_FACTOR_ATTR, hf_tracing.DEFAULT_CAPACITY_FACTOR))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers logs generation-config dumps and vocabulary warnings at model construction; our callers
    report problems as one-line errors instead."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _example_inputs(task: HFTask, config: Any, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = token_ids(batch, seq, config.vocab_size, device, seed=0)  # (B, T)
    if task is not HFTask.SEQ2SEQ_LM:
        return (ids,)
    # Encoder-decoder forward(input_ids, attention_mask, decoder_input_ids): the (all ones) mask is positional
    # only because the decoder ids come third.
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    return ids, mask, token_ids(batch, seq, config.vocab_size, device, seed=1)


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    return logits if logits is not None else output[0]


def _causal_lm_loss(output: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Next-token cross entropy on the input ids."""
    return next_token_loss(_logits(output), inputs[0])


def _masked_lm_loss(output: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross entropy of every position against its own token (reconstruction: the synthetic inputs carry no
    [MASK] corruption; the cost is the MLM head's)."""
    logits = _logits(output)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), inputs[0].reshape(-1))


def _seq2seq_lm_loss(output: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Teacher-forced cross entropy: decoder position t predicts decoder token t+1."""
    return next_token_loss(_logits(output), inputs[2])


_LOSSES: Mapping[HFTask, Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]] = types.MappingProxyType({
    HFTask.CAUSAL_LM: _causal_lm_loss, HFTask.MASKED_LM: _masked_lm_loss, HFTask.SEQ2SEQ_LM: _seq2seq_lm_loss,
})
