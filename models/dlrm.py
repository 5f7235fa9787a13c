"""DLRM recommender (Naumov et al. 2019, "Deep Learning Recommendation Model", arXiv:1906.00091).

Dense features go through a bottom MLP; each sparse (categorical) feature looks up one row of its own
embedding table; the pairwise dot products of all these vectors (strict lower triangle, "dot" interaction)
are concatenated with the bottom MLP's output and fed to a top MLP that ends in one click logit.
Embedding tables hold almost all parameters: in the MLPerf Training configuration (Criteo 1TB, rows capped at
40M per table, 128-wide) sum(rows) * 128 = 24,034,227,072 of the model's 24,036,595,969.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from models.family import Family
from models.initialization import construct
from models.synthetic import normal
from models.validation import require_positive, require_positive_tuple

MLPERF_TABLE_ROWS: tuple[int, ...] = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208, 11938,
    155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)
"""Rows of the 26 Criteo Terabyte tables with --max-ind-range=40000000: the MLPerf Training DLRM reference
(facebookresearch/dlrm, dlrm_s_pytorch.py, "Criteo Terabyte MLPerf training"; mlcommons/training)."""


@dataclass(kw_only=True, frozen=True)
class DLRMConfig:
    """A DLRM. Defaults are the MLPerf Training (Criteo 1TB) model."""

    dense_features: int = 13
    """Continuous input features."""
    tables: tuple[int, ...] = MLPERF_TABLE_ROWS
    """Rows of each embedding table (one sparse feature, one lookup per table)."""
    embed_dim: int = 128
    """Embedding width; the bottom MLP's last layer has this width too."""
    bottom_mlp: tuple[int, ...] = (512, 256, 128)
    """Bottom MLP layer widths (after the dense input)."""
    top_mlp: tuple[int, ...] = (1024, 1024, 512, 256, 1)
    """Top MLP layer widths (after the interaction); the last is the logit."""

    def __post_init__(self) -> None:
        require_positive(self, "dense_features", "embed_dim")
        for name in ("tables", "bottom_mlp", "top_mlp"):
            require_positive_tuple(self, name)
        if self.bottom_mlp[-1] != self.embed_dim:
            raise ValueError(f"DLRMConfig.bottom_mlp must end at embed_dim={self.embed_dim}, "
                             f"got {self.bottom_mlp[-1]}")
        if self.top_mlp[-1] != 1:
            raise ValueError(f"DLRMConfig.top_mlp must end in 1 (the click logit), got {self.top_mlp[-1]}")

    @property
    def interaction_width(self) -> int:
        """Top MLP input: n(n-1)/2 pairwise dots of n = tables + 1 vectors, plus the bottom output."""
        n = len(self.tables) + 1
        return n * (n - 1) // 2 + self.embed_dim


def _mlp(widths: tuple[int, ...], *, final_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(pairwise(widths)):
        layers.append(nn.Linear(fan_in, fan_out))
        if final_relu or i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """(dense (B, dense_features) float, sparse (B, tables) int64) -> click logits (B, 1)."""

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        c = self.config = config
        self.bottom_mlp = _mlp((c.dense_features, *c.bottom_mlp), final_relu=True)
        self.tables = nn.ModuleList(nn.Embedding(rows, c.embed_dim) for rows in c.tables)
        self.top_mlp = _mlp((c.interaction_width, *c.top_mlp), final_relu=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Tables U(-1/sqrt(rows), 1/sqrt(rows)); linears N(0, sqrt(2/(fan_in+fan_out))) (DLRM reference)."""
        for table in self.tables:
            bound = table.num_embeddings**-0.5
            nn.init.uniform_(table.weight, -bound, bound)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=(2.0 / (module.in_features + module.out_features)) ** 0.5)
                nn.init.normal_(module.bias, std=(1.0 / module.out_features) ** 0.5)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x = self.bottom_mlp(dense)  # (B, d)
        vectors = [x] + [table(sparse[:, i]) for i, table in enumerate(self.tables)]  # n x (B, d)
        t = torch.stack(vectors, dim=1)  # (B, n, d)
        dots = torch.bmm(t, t.transpose(1, 2))  # (B, n, n)
        n = len(vectors)
        rows, cols = torch.tril_indices(n, n, offset=-1, device=dots.device)  # strict lower triangle
        interaction = torch.cat([x, dots[:, rows, cols]], dim=1)  # (B, d + n(n-1)/2)
        return self.top_mlp(interaction)  # (B, 1)


def num_params(c: DLRMConfig) -> int:
    """Tables plus both MLPs' weights and biases."""
    def mlp(widths: tuple[int, ...]) -> int:
        return sum(a * b + b for a, b in pairwise(widths))

    return sum(c.tables) * c.embed_dim + mlp((c.dense_features, *c.bottom_mlp)) + mlp(
        (c.interaction_width, *c.top_mlp)
    )


def build(config: DLRMConfig, device: torch.device | str = "meta") -> DLRM:
    return construct(lambda: DLRM(config), device)


def example_inputs(
    config: DLRMConfig, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    """Normal dense features and, per table, a uniform row index."""
    if seq is not None:
        raise ValueError("DLRM has no sequence length")
    dense = normal((batch, config.dense_features), device)
    shape = (batch, len(config.tables))
    if torch.device(device).type == "meta":
        return dense, torch.empty(shape, dtype=torch.long, device="meta")
    generator = torch.Generator().manual_seed(1)
    rows = torch.tensor(config.tables, dtype=torch.float64)
    sparse = (torch.rand(shape, generator=generator, dtype=torch.float64) * rows).long().clamp(max=rows.long() - 1)
    return dense, sparse.to(device)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Binary cross entropy; the synthetic click label is the sign of the first dense feature."""
    clicked = (inputs[0][:, 0] > 0).to(torch.float32)
    return F.binary_cross_entropy_with_logits(output[:, 0].float(), clicked)


FAMILY = Family(
    name="dlrm",
    description="DLRM recommender: bottom/top MLPs, one large embedding table per sparse feature",
    config_type=DLRMConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: None,
    seq_field=None,
)
