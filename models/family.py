"""What every zoo family provides, as one typed record, so the preset table and the CLI registry treat them alike."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ExampleInputs = Callable[[Any, int, int | None, torch.device | str], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class Family:
    """One model family of the zoo: its config type and the functions that build, feed and train it."""

    name: str
    """Registry name, e.g. "gpt"."""
    description: str
    config_type: type
    """The family's frozen, kw-only config dataclass; its default instance is the family's default model."""
    build: Callable[[Any, torch.device | str], nn.Module]
    """`build(config, device)`: the model on `device` ("meta" allocates nothing), initialized unless on meta."""
    example_inputs: ExampleInputs
    """`example_inputs(config, batch, seq, device)`: positional forward inputs; `seq=None` means the config's."""
    loss: Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]
    """`loss(output, inputs)`: a scalar synthetic training loss, computed per sample so batch splits agree."""
    num_params: Callable[[Any], int]
    """Parameter count from the config alone (closed form), equal to the built model's unique parameters."""
    sequence_length: Callable[[Any], int | None]
    """Tokens per sample the model processes (None for models without a sequence, e.g. ResNet, DLRM)."""
    seq_field: str | None
    """Config field that `--seq` overrides, or None when the sequence length is not a free setting."""
