"""Image encoders for SimCLR-style training: CIFAR-stem ResNets (with a width option) and the projection head.

The CIFAR stem (a 3x3 convolution with stride 1 and no max-pool) keeps 32x32 inputs at full resolution in the first
stage, as in the SimCLR CIFAR experiments. ``width`` scales every stage (64 -> standard ResNet); the reduced-scale CPU
comparison of this project uses a narrow network (see docs/vision.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torchvision.models.resnet import BasicBlock, Bottleneck

BACKBONES: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet34": (BasicBlock, [3, 4, 6, 3]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}


# oneDNN 3.12 (torch 2.14.1) corrupts the heap in the weight gradient of a 1x1 convolution with stride > 1 on
# channels_last CPU tensors with few input channels (its jit_1x1:avx2 backward_weights kernel; measured on an
# AVX2 AMD EPYC: 2-7 input channels crash at 16x16, 1 and 8-24 do not;
# docs/known-issues.md; its reproducer benchmarks/onednn_strided_1x1.py reruns from commit 82267c0).
# Below this many input channels such a convolution runs in NCHW on the CPU (same values, another kernel); 16 rather
# than 8 leaves a margin for AVX-512's 16-wide channel blocks, where the bound was not measured.
NARROW_STRIDED_1X1_CHANNELS = 16


class StridedPointwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` for the ResNet downsample path (1x1, stride 2) that avoids oneDNN's channels_last kernel on the
    CPU when it has fewer than :data:`NARROW_STRIDED_1X1_CHANNELS` input channels (see the note above): the input
    and the weight are made NCHW-contiguous for that call. Everywhere else (GPUs, wider or unit-stride layers) it is
    ``nn.Conv2d`` unchanged; its parameters and state-dict keys are ``nn.Conv2d``'s. The choice reads only tensor
    metadata (device, layout), so it adds no host sync and no graph break."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if (
            input.device.type == "cpu"
            and self.in_channels < NARROW_STRIDED_1X1_CHANNELS
            and self.kernel_size == (1, 1)
            and self.stride != (1, 1)
        ):
            # Both, whatever the input's layout: torch takes the channels_last kernel when either one is.
            # A 1x1 weight in channels_last is also "contiguous" (its strides are ambiguous), so contiguous() would
            # return it unchanged and torch would still pick the channels_last kernel: clone it to NCHW strides.
            input, weight = input.contiguous(), weight.clone(memory_format=torch.contiguous_format)
        return super()._conv_forward(input, weight, bias)


class CifarResNet(nn.Module):
    """ResNet with the CIFAR stem; ``forward`` returns the pooled feature vector (``feature_dim`` values).

    Args:
        backbone: "resnet18", "resnet34" or "resnet50".
        width: channels of the first stage (64 for the standard networks); stages use width, 2x, 4x, 8x.
        cifar_stem: 3x3 stride-1 stem without max-pool (True, for 32x32 and 96x96 inputs) or the ImageNet stem.
    """

    def __init__(self, backbone: str = "resnet18", width: int = 64, cifar_stem: bool = True) -> None:
        super().__init__()
        if backbone not in BACKBONES:
            raise ValueError(f"unknown backbone {backbone!r}; choose one of {sorted(BACKBONES)}")
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive integer, got {width!r}")
        block, layers = BACKBONES[backbone]
        self.config = {"backbone": backbone, "width": width, "cifar_stem": cifar_stem}
        self.inplanes = width
        if cifar_stem:
            self.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = self._make_layer(block, width, layers[0], stride=1)
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = 8 * width * block.expansion
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int
    ) -> nn.Module:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                StridedPointwiseConv2d(
                    self.inplanes, planes * block.expansion, kernel_size=1, stride=stride, bias=False
                ),
                nn.BatchNorm2d(planes * block.expansion),
            )
        # torchvision's Bottleneck derives its inner width from base_width=64; scale it with ours.
        extra = {"base_width": 64} if block is Bottleneck else {}
        layers = [block(self.inplanes, planes, stride, downsample, **extra)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, **extra) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, images: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)


class ProjectionHead(nn.Module):
    """SimCLR projection head: Linear(feature_dim, hidden, no bias) - [BatchNorm] - ReLU - Linear(hidden, out_dim).

    Args:
        feature_dim: width of the backbone features.
        hidden_dim: width of the hidden layer.
        out_dim: width of the projections the loss sees (64 in the released WEINCE setup).
        batch_norm: BatchNorm after the first layer (the batchnorm-head setup); the released setup has none.
        output_bias: a bias in the last layer (batchnorm-head setup); the released setup has none.

    The released WEINCE setup (docs/algorithms.md 1.2b) is ``ProjectionHead(f, f, 64, batch_norm=False,
    output_bias=False)``: Linear(f, f, no bias) - ReLU - Linear(f, 64, no bias). Evaluation uses the backbone
    features before the head.
    """

    def __init__(
        self,
        feature_dim: int,
        hidden_dim: int = 512,
        out_dim: int = 64,
        *,
        batch_norm: bool = True,
        output_bias: bool = True,
    ) -> None:
        super().__init__()
        if min(feature_dim, hidden_dim, out_dim) < 1:
            raise ValueError(f"dimensions must be positive, got {feature_dim}, {hidden_dim}, {out_dim}")
        layers: list[nn.Module] = [nn.Linear(feature_dim, hidden_dim, bias=False)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(hidden_dim))
        layers += [nn.ReLU(inplace=True), nn.Linear(hidden_dim, out_dim, bias=output_bias)]
        self.net = nn.Sequential(*layers)

    def forward(self, features: Tensor) -> Tensor:
        return self.net(features)


class SimCLRModel(nn.Module):
    """Backbone plus projection head; ``forward`` returns projections, ``encode`` the backbone features.

    ``hidden_dim=None`` makes the head's hidden layer as wide as the backbone features (the released setup);
    ``head_batch_norm`` and ``head_output_bias`` as in :class:`ProjectionHead`.
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        width: int = 64,
        cifar_stem: bool = True,
        hidden_dim: int | None = 512,
        projection_dim: int = 64,
        head_batch_norm: bool = True,
        head_output_bias: bool = True,
    ) -> None:
        super().__init__()
        self.encoder = CifarResNet(backbone, width=width, cifar_stem=cifar_stem)
        hidden_dim = self.encoder.feature_dim if hidden_dim is None else hidden_dim
        self.head = ProjectionHead(
            self.encoder.feature_dim,
            hidden_dim,
            projection_dim,
            batch_norm=head_batch_norm,
            output_bias=head_output_bias,
        )
        self.config: dict[str, Any] = {
            **self.encoder.config,
            "hidden_dim": hidden_dim,
            "projection_dim": projection_dim,
            "head_batch_norm": head_batch_norm,
            "head_output_bias": head_output_bias,
        }

    def forward(self, images: Tensor) -> Tensor:
        return self.head(self.encoder(images))

    def encode(self, images: Tensor) -> Tensor:
        return self.encoder(images)


def save_encoder(model: SimCLRModel, directory: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``model.pt`` (state dict of backbone and head) and ``model_config.json`` into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), directory / "model.pt")
    (directory / "model_config.json").write_text(json.dumps({**model.config, **(extra or {})}, indent=2) + "\n")
    return directory


def load_encoder(directory: str | Path, map_location: str | torch.device = "cpu") -> SimCLRModel:
    """Load a model saved by :func:`save_encoder` (e.g. ``runs/simclr-compare/weince-seed0``), in eval mode."""
    directory = Path(directory)
    config_path = directory / "model_config.json"
    if not config_path.exists():
        raise ValueError(f"{config_path} not found: not a directory written by save_encoder")
    config = json.loads(config_path.read_text())
    keys = ("backbone", "width", "cifar_stem", "hidden_dim", "projection_dim")
    # models saved before the head options existed have the BatchNorm head with an output bias
    head = {
        "head_batch_norm": config.get("head_batch_norm", True),
        "head_output_bias": config.get("head_output_bias", True),
    }
    model = SimCLRModel(**{key: config[key] for key in keys}, **head)
    model.load_state_dict(torch.load(directory / "model.pt", map_location=map_location, weights_only=True))
    return model.eval()
