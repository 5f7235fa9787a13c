"""ResNet with bottleneck blocks (He et al. 2016, "Deep Residual Learning", Table 1; ResNet-50: 25.6M).

Stem (7x7/2 conv, BN, ReLU, 3x3/2 max-pool), four stages of bottlenecks (1x1 reduce, 3x3, 1x1 expand x4,
stride on the 3x3 as in torchvision's "v1.5"), a projection shortcut on each stage's first block, global
average pool, linear classifier. All bottlenecks sit in one flat `blocks` list so pipeline cuts can fall
between any two. resnet-50: 25,557,032 parameters (torchvision.models.resnet50).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.family import Family
from models.initialization import construct
from models.synthetic import normal, sign_bit_labels
from models.validation import require_positive, require_positive_tuple

EXPANSION = 4
"""Bottleneck output channels = EXPANSION x its inner width (He et al. 2016 Fig. 5)."""


@dataclass(kw_only=True, frozen=True)
class ResNetConfig:
    """A bottleneck ResNet classifier. Defaults are ResNet-50."""

    depths: tuple[int, ...] = (3, 4, 6, 3)
    """Bottleneck blocks per stage (ResNet-101: 3,4,23,3; ResNet-152: 3,8,36,3)."""
    width: int = 64
    """Inner width of the first stage; each later stage doubles it."""
    classes: int = 1000
    """Output classes."""
    image_size: int = 224
    """Input height and width in pixels (at least 32 so five stride-2 steps leave a pixel)."""
    channels: int = 3
    """Input channels."""

    def __post_init__(self) -> None:
        require_positive_tuple(self, "depths")
        require_positive(self, "width", "classes", "image_size", "channels")
        if self.image_size < 32:
            raise ValueError(f"ResNetConfig.image_size must be >= 32, got {self.image_size}")


class Bottleneck(nn.Module):
    """relu(x' + bn(conv1x1(relu(bn(conv3x3(relu(bn(conv1x1(x))))))))), x' = x or a projected x."""

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * EXPANSION
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Sequential | None = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)  # (B, 4w, H', W')
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + identity)


def _stage_specs(c: ResNetConfig) -> list[tuple[int, int, int]]:
    """(in_channels, width, stride) of every bottleneck, in order."""
    specs, in_channels = [], c.width
    for stage, depth in enumerate(c.depths):
        width = c.width * 2**stage
        for i in range(depth):
            stride = 2 if stage > 0 and i == 0 else 1
            specs.append((in_channels, width, stride))
            in_channels = width * EXPANSION
    return specs


class ResNet(nn.Module):
    """Images (B, C, H, W) -> class logits (B, classes)."""

    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        c = self.config = config
        self.stem = nn.Sequential(
            nn.Conv2d(c.channels, c.width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(c.width),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        self.blocks = nn.ModuleList(Bottleneck(*spec) for spec in _stage_specs(c))
        self.fc = nn.Linear(c.width * 2 ** (len(c.depths) - 1) * EXPANSION, c.classes)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Kaiming-normal convs (fan_out, He et al. 2015), unit BatchNorms, default linear (torchvision)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, (nn.BatchNorm2d, nn.Linear)):
                module.reset_parameters()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)  # (B, w, H/4, W/4)
        for block in self.blocks:
            x = block(x)
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)  # (B, 8w*4)
        return self.fc(x)  # (B, classes)


def num_params(c: ResNetConfig) -> int:
    """Parameter count from the config: conv weights, BatchNorm scale/shift, classifier."""
    total = c.channels * c.width * 49 + 2 * c.width  # stem conv + BN
    for in_channels, width, stride in _stage_specs(c):
        out_channels = width * EXPANSION
        total += in_channels * width + width * width * 9 + width * out_channels  # 1x1, 3x3, 1x1
        total += 2 * (width + width + out_channels)  # three BNs
        if stride != 1 or in_channels != out_channels:
            total += in_channels * out_channels + 2 * out_channels
    features = c.width * 2 ** (len(c.depths) - 1) * EXPANSION
    return total + features * c.classes + c.classes


def build(config: ResNetConfig, device: torch.device | str = "meta") -> ResNet:
    return construct(lambda: ResNet(config), device)


def example_inputs(
    config: ResNetConfig, batch: int, seq: int | None, device: torch.device | str
) -> tuple[torch.Tensor, ...]:
    if seq is not None:
        raise ValueError("ResNet has no sequence length; set image_size instead")
    return (normal((batch, config.channels, config.image_size, config.image_size), device),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross entropy against a per-image synthetic class (see `sign_bit_labels`)."""
    return F.cross_entropy(output.float(), sign_bit_labels(inputs[0], output.size(-1)))


FAMILY = Family(
    name="resnet",
    description="ResNet with bottleneck blocks (ResNet-50 by default)",
    config_type=ResNetConfig,
    build=build,
    example_inputs=example_inputs,
    loss=loss,
    num_params=num_params,
    sequence_length=lambda c: None,
    seq_field=None,
)
