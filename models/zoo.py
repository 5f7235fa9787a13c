"""The zoo's families and named presets. Each preset's parameter count is checked against its published
figure in tests/test_models.py; `published_params` is the figure as the reference states it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from models import bert, dlrm, gpt, llama, moe, resnet, t5, vit
from models.bert import BertConfig
from models.dlrm import DLRMConfig
from models.family import Family
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.moe import MoEConfig
from models.resnet import ResNetConfig
from models.t5 import T5Config
from models.vit import ViTConfig

FAMILIES: Mapping[str, Family] = MappingProxyType(
    {f.name: f for f in (gpt.FAMILY, llama.FAMILY, moe.FAMILY, bert.FAMILY, t5.FAMILY, vit.FAMILY,
                         resnet.FAMILY, dlrm.FAMILY)}
)
"""Family name -> Family. A family's default model is its config type's default instance."""


@dataclass(frozen=True)
class Preset:
    """A named configuration of a family."""

    name: str
    family: str
    config: Any
    description: str
    published_params: int | None
    """Parameter count as the reference states it; None for test-size presets and where the reference gives
    only layer sizes (dlrm-mlperf: tests check it against the reference's table and MLP sizes instead)."""
    reference: str
    """Where the architecture and the count come from."""


# GPT-3 sizes as trained by Megatron-LM: vocabulary padded to 51200, context 2048.
_MEGATRON_GPT = {"vocab": 51200, "seq": 2048}

_PRESETS: tuple[Preset, ...] = (
    Preset("gpt2", "gpt", GPTConfig(), "GPT-2 small (124M)", 124_000_000,
           "Radford et al. 2019 (the paper's 117M is a miscount; 124M per the released checkpoint)"),
    Preset("gpt3-1.3b", "gpt", GPTConfig(layers=24, hidden=2048, heads=16, **_MEGATRON_GPT),
           "GPT-3 XL", 1_300_000_000, "Brown et al. 2020, Table 2.1"),
    Preset("gpt3-6.7b", "gpt", GPTConfig(layers=32, hidden=4096, heads=32, **_MEGATRON_GPT),
           "GPT-3 6.7B", 6_700_000_000, "Brown et al. 2020, Table 2.1"),
    Preset("gpt3-13b", "gpt", GPTConfig(layers=40, hidden=5120, heads=40, **_MEGATRON_GPT),
           "GPT-3 13B", 13_000_000_000,
           "Brown et al. 2020, Table 2.1 (d_model printed as 5140; 40 heads x 128 = 5120 is used)"),
    Preset("gpt3-175b", "gpt", GPTConfig(layers=96, hidden=12288, heads=96, **_MEGATRON_GPT),
           "GPT-3 175B", 174_600_000_000,
           "Brown et al. 2020, Table 2.1; 174.6B with vocab 51200, seq 2048, tied embeddings "
           "(Narayanan et al. SC'21 eq. 2)"),
    Preset("gpt-22b", "gpt", GPTConfig(layers=48, hidden=6144, heads=64, **_MEGATRON_GPT),
           "Megatron-LM 22B", 22_000_000_000, "Korthikanti et al. 2022, Table 3"),
    Preset("gpt-530b", "gpt", GPTConfig(layers=105, hidden=20480, heads=128, **_MEGATRON_GPT),
           "Megatron-Turing NLG 530B", 530_000_000_000, "Smith et al. 2022; Korthikanti et al. 2022, Table 3"),
    Preset("gpt-1t", "gpt", GPTConfig(layers=128, hidden=25600, heads=160, **_MEGATRON_GPT),
           "Megatron-LM 1T", 1_008_000_000_000, "Narayanan et al. SC'21, Table 1 (1008B)"),
    Preset("gpt-tiny", "gpt", GPTConfig(vocab=512, hidden=128, layers=4, heads=8, seq=64),
           "test-size GPT (tp up to 8, pp up to 4)", None, "test size"),
    Preset("llama2-7b", "llama",
           LlamaConfig(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, ffn_hidden=11008, seq=4096,
                       rope_theta=10000.0),
           "Llama 2 7B", 6_738_415_616, "Touvron et al. 2023; meta-llama/Llama-2-7b-hf num_parameters()"),
    Preset("llama3-8b", "llama", LlamaConfig(), "Llama 3 8B", 8_030_261_248,
           "Dubey et al. 2024, Table 3; meta-llama/Meta-Llama-3-8B num_parameters()"),
    Preset("llama3-70b", "llama", LlamaConfig(hidden=8192, layers=80, heads=64, ffn_hidden=28672),
           "Llama 3 70B", 70_553_706_496, "Dubey et al. 2024, Table 3; meta-llama/Meta-Llama-3-70B"),
    Preset("llama3-405b", "llama", LlamaConfig(hidden=16384, layers=126, heads=128, ffn_hidden=53248),
           "Llama 3.1 405B (8K planning context; no long-context RoPE scaling)", 405_853_388_800,
           "Dubey et al. 2024, Table 3; meta-llama/Llama-3.1-405B"),
    Preset("llama-tiny", "llama",
           LlamaConfig(vocab=512, hidden=128, layers=4, heads=8, kv_heads=4, ffn_hidden=384, seq=64,
                       rope_theta=10000.0),
           "test-size Llama with GQA (tp up to 4, pp up to 4)", None, "test size"),
    Preset("mixtral-8x7b", "moe", MoEConfig(), "Mixtral 8x7B, top-2 of 8 experts", 46_702_792_704,
           "Jiang et al. 2024; mistralai/Mixtral-8x7B-v0.1 num_parameters() (46.7B)"),
    Preset("moe-tiny", "moe",
           MoEConfig(vocab=512, hidden=128, layers=4, heads=8, kv_heads=4, ffn_hidden=256, seq=64, experts=4,
                     top_k=2, group_size=16, rope_theta=10000.0),
           "test-size MoE, top-2 of 4 experts (ep up to 4)", None, "test size"),
    Preset("bert-base", "bert", BertConfig(), "BERT-Base with MLM head", 110_000_000,
           "Devlin et al. 2019 (110M); bert-base-uncased BertForMaskedLM has 109,514,298"),
    Preset("bert-large", "bert", BertConfig(hidden=1024, layers=24, heads=16), "BERT-Large with MLM head",
           335_000_000, "Devlin et al. 2019 (reported as 340M); bert-large-uncased has 335M"),
    Preset("bert-tiny", "bert", BertConfig(hidden=128, layers=2, heads=2), "BERT-Tiny (L=2, H=128)",
           4_400_000, "Turc et al. 2019, 'Well-Read Students Learn Better' (4.4M)"),
    Preset("t5-small", "t5", T5Config(hidden=512, ffn_hidden=2048, heads=8, layers=6), "T5-Small", 60_506_624,
           "Raffel et al. 2020 (60M); t5-small num_parameters()"),
    Preset("t5-base", "t5", T5Config(), "T5-Base", 222_903_552,
           "Raffel et al. 2020 (220M); t5-base num_parameters()"),
    Preset("t5-tiny", "t5",
           T5Config(vocab=512, hidden=64, heads=4, head_dim=16, ffn_hidden=128, layers=2, seq=32, decoder_seq=16),
           "test-size T5", None, "test size"),
    Preset("vit-base", "vit", ViTConfig(), "ViT-B/16 at 224", 86_567_656,
           "Dosovitskiy et al. 2021, Table 1 (86M); timm vit_base_patch16_224"),
    Preset("vit-large", "vit", ViTConfig(hidden=1024, layers=24, heads=16), "ViT-L/16 at 224", 304_326_632,
           "Dosovitskiy et al. 2021, Table 1 (307M); timm vit_large_patch16_224"),
    Preset("vit-tiny", "vit", ViTConfig(hidden=192, heads=3), "ViT-Ti/16 at 224 (DeiT-Ti)", 5_717_416,
           "Touvron et al. 2021 (DeiT), Table 1 (5M); timm vit_tiny_patch16_224"),
    Preset("resnet-50", "resnet", ResNetConfig(), "ResNet-50", 25_557_032,
           "He et al. 2016, Table 1 (25.6M); torchvision resnet50"),
    Preset("resnet-101", "resnet", ResNetConfig(depths=(3, 4, 23, 3)), "ResNet-101", 44_549_160,
           "He et al. 2016, Table 1 (44.5M); torchvision resnet101"),
    Preset("resnet-tiny", "resnet", ResNetConfig(depths=(1, 1), width=8, classes=10, image_size=32),
           "test-size bottleneck ResNet", None, "test size"),
    Preset("dlrm-mlperf", "dlrm", DLRMConfig(), "DLRM, MLPerf Training Criteo 1TB (26 tables, 128-wide)",
           None,
           "MLPerf Training DLRM reference (facebookresearch/dlrm dlrm_s_pytorch.py, --max-ind-range=40000000)"),
    Preset("dlrm-small", "dlrm",
           DLRMConfig(tables=(1000, 500, 200, 100, 50, 20, 10, 5), embed_dim=16, bottom_mlp=(64, 16),
                      top_mlp=(64, 1)),
           "test-size DLRM (8 small tables)", None, "test size"),
)

PRESETS: Mapping[str, Preset] = MappingProxyType({p.name: p for p in _PRESETS})
"""Preset name -> Preset, in table order."""

