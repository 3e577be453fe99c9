"""SimCLR augmentations, batched on tensors (CPU or GPU), with per-image random parameters.

The pipeline of SimCLR's CIFAR experiments: random resized crop (scale 0.08-1, aspect ratio 3/4-4/3) with horizontal
flip, colour jitter (brightness, contrast, saturation 0.4, hue 0.1) with probability 0.8, grayscale with
probability 0.2, then per-channel normalisation (the batchnorm-head setup; the released WEINCE setup is
:data:`RELEASED_AUGMENT`: stronger jitter 0.8/0.8/0.8/0.2 and no normalisation). Crop and flip are one affine
resampling (``grid_sample``) for the whole batch. One difference to torchvision's per-image ``ColorJitter``: the
order of the four jitter operations is drawn once per batch, not once per image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)
_GRAY_WEIGHTS = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class SimCLRAugmentConfig:
    """Parameters of :class:`SimCLRAugment` (defaults: SimCLR's CIFAR setting, colour strength 0.5)."""

    crop_scale: tuple[float, float] = (0.08, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip_p: float = 0.5
    jitter_p: float = 0.8
    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4
    hue: float = 0.1
    grayscale_p: float = 0.2
    mean: tuple[float, float, float] = CIFAR_MEAN
    std: tuple[float, float, float] = CIFAR_STD

    def __post_init__(self) -> None:
        low, high = self.crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {self.crop_scale}")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must satisfy 0 < low <= high, got {self.crop_ratio}")
        for name in ("flip_p", "jitter_p", "grayscale_p"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be a probability in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.hue <= 0.5:
            raise ValueError(f"hue must lie in [0, 0.5], got {self.hue}")


# The released WEINCE setup's augmentation (docs/algorithms.md 1.2b): torchvision's RandomResizedCrop defaults,
# horizontal flip, colour jitter (0.8, 0.8, 0.8, 0.2) with p = 0.8, grayscale p = 0.2, then ToTensor only: mean 0 and
# std 1 make the normalisation the identity (exactly: x - 0 and x / 1 are exact in floating point).
RELEASED_AUGMENT = SimCLRAugmentConfig(
    brightness=0.8, contrast=0.8, saturation=0.8, hue=0.2, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)
)


def to_float(images: Tensor) -> Tensor:
    """uint8 [B, 3, H, W] in 0..255 -> float32 in [0, 1] (float input is returned as float32 unchanged)."""
    if images.dtype == torch.uint8:
        return images.float().div_(255.0)
    if not images.is_floating_point():
        raise ValueError(f"images must be uint8 or floating point, got {images.dtype}")
    return images.float()


def normalize(images: Tensor, mean: tuple[float, ...] = CIFAR_MEAN, std: tuple[float, ...] = CIFAR_STD) -> Tensor:
    """Per-channel normalisation of float images in [0, 1]."""
    mean_t = torch.tensor(mean, device=images.device, dtype=images.dtype)[None, :, None, None]
    std_t = torch.tensor(std, device=images.device, dtype=images.dtype)[None, :, None, None]
    return (images - mean_t) / std_t


def grayscale(images: Tensor) -> Tensor:
    """ITU-R 601 luma [B, 1, H, W] of RGB images [B, 3, H, W]."""
    weights = torch.tensor(_GRAY_WEIGHTS, device=images.device, dtype=images.dtype)
    return (images * weights[None, :, None, None]).sum(1, keepdim=True)


def rgb_to_hsv(images: Tensor) -> Tensor:
    """RGB in [0, 1] -> HSV with hue in [0, 1), batched [B, 3, H, W]."""
    r, g, b = images.unbind(1)
    maxc, _ = images.max(1)
    minc, _ = images.min(1)
    delta = maxc - minc
    safe_delta = torch.where(delta > 0, delta, torch.ones_like(delta))
    saturation = torch.where(
        maxc > 0, delta / torch.where(maxc > 0, maxc, torch.ones_like(maxc)), torch.zeros_like(maxc)
    )
    rc, gc, bc = (maxc - r) / safe_delta, (maxc - g) / safe_delta, (maxc - b) / safe_delta
    hue = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    hue = torch.where(delta > 0, (hue / 6.0) % 1.0, torch.zeros_like(hue))
    return torch.stack([hue, saturation, maxc], dim=1)


def hsv_to_rgb(images: Tensor) -> Tensor:
    """Inverse of :func:`rgb_to_hsv`."""
    hue, saturation, value = images.unbind(1)
    sector = torch.floor(hue * 6.0)
    fraction = hue * 6.0 - sector
    sector = sector.long() % 6
    p = value * (1.0 - saturation)
    q = value * (1.0 - saturation * fraction)
    t = value * (1.0 - saturation * (1.0 - fraction))
    choices = torch.stack(
        [
            torch.stack([value, t, p], 1),
            torch.stack([q, value, p], 1),
            torch.stack([p, value, t], 1),
            torch.stack([p, q, value], 1),
            torch.stack([t, p, value], 1),
            torch.stack([value, p, q], 1),
        ],
        dim=1,
    )  # [B, 6, 3, H, W]
    index = sector[:, None, None].expand(-1, 1, 3, -1, -1)
    return choices.gather(1, index).squeeze(1)


def random_resized_crop_boxes(
    batch: int,
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    generator: torch.Generator | None = None,
    attempts: int = 10,
) -> Tensor:
    """Crop boxes ``(x0, y0, w, h)`` in pixels [B, 4], sampled like torchvision's RandomResizedCrop.

    Up to ``attempts`` (area, log-aspect) draws per image; the first that fits is used, else the whole image's
    centre crop clamped to the ratio range (torchvision's fallback).
    """
    area = height * width
    target = area * torch.empty(batch, attempts).uniform_(scale[0], scale[1], generator=generator)
    log_ratio = torch.empty(batch, attempts).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = torch.exp(log_ratio)
    w = torch.round(torch.sqrt(target * aspect))
    h = torch.round(torch.sqrt(target / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = torch.where(fits.any(1), fits.float().argmax(1), torch.full((batch,), -1, dtype=torch.long))
    rows = torch.arange(batch)
    w_pick, h_pick = w[rows, first.clamp_min(0)], h[rows, first.clamp_min(0)]
    # Fallback: centre crop of the whole image, aspect clamped into the ratio range.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        fallback_w, fallback_h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        fallback_w, fallback_h = round(height * ratio[1]), height
    else:
        fallback_w, fallback_h = width, height
    ok = first >= 0
    w_pick = torch.where(ok, w_pick, torch.full_like(w_pick, float(fallback_w)))
    h_pick = torch.where(ok, h_pick, torch.full_like(h_pick, float(fallback_h)))
    x0 = torch.floor(torch.rand(batch, generator=generator) * (width - w_pick + 1))
    y0 = torch.floor(torch.rand(batch, generator=generator) * (height - h_pick + 1))
    x0 = torch.where(ok, x0, torch.full_like(x0, float((width - fallback_w) // 2)))
    y0 = torch.where(ok, y0, torch.full_like(y0, float((height - fallback_h) // 2)))
    return torch.stack([x0, y0, w_pick, h_pick], dim=1)


def crop_and_flip(images: Tensor, boxes: Tensor, flip: Tensor, out_size: tuple[int, int] | None = None) -> Tensor:
    """Resample each image's box to ``out_size`` (default: the input size), mirrored where ``flip``; bilinear."""
    batch, _, height, width = images.shape
    out_h, out_w = out_size or (height, width)
    boxes = boxes.to(images.device, images.dtype)
    x0, y0, w, h = boxes.unbind(1)
    theta = torch.zeros(batch, 2, 3, device=images.device, dtype=images.dtype)
    sign = 1.0 - 2.0 * flip.to(images.device, images.dtype)
    theta[:, 0, 0] = sign * w / width
    theta[:, 0, 2] = (2 * x0 + w) / width - 1.0
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * y0 + h) / height - 1.0
    grid = F.affine_grid(theta, [batch, 3, out_h, out_w], align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="border", align_corners=False)


def _blend(a: Tensor, b: Tensor, factor: Tensor) -> Tensor:
    return (factor[:, None, None, None] * a + (1.0 - factor[:, None, None, None]) * b).clamp_(0.0, 1.0)


def color_jitter(
    images: Tensor,
    brightness: Tensor,
    contrast: Tensor,
    saturation: Tensor,
    hue: Tensor,
    order: list[int] | tuple[int, ...] = (0, 1, 2, 3),
) -> Tensor:
    """torchvision's ColorJitter with per-image factors [B] (hue shift in [-0.5, 0.5] of a turn), float [0, 1]."""
    for op in order:
        if op == 0:
            images = (images * brightness[:, None, None, None]).clamp_(0.0, 1.0)
        elif op == 1:
            mean = grayscale(images).mean(dim=(1, 2, 3), keepdim=True)
            images = _blend(images, mean.expand_as(images), contrast)
        elif op == 2:
            images = _blend(images, grayscale(images).expand_as(images), saturation)
        elif op == 3:
            hsv = rgb_to_hsv(images)
            hsv = torch.stack([(hsv[:, 0] + hue[:, None, None]) % 1.0, hsv[:, 1], hsv[:, 2]], dim=1)
            images = hsv_to_rgb(hsv)
        else:
            raise ValueError(f"unknown jitter operation {op}")
    return images


class SimCLRAugment:
    """Two independent random views per image, batched: ``view_a, view_b = augment(images_uint8)``.

    Random parameters are drawn on the CPU from ``generator`` (reproducible), the pixel work runs on the images'
    device.
    """

    def __init__(self, config: SimCLRAugmentConfig | None = None, generator: torch.Generator | None = None) -> None:
        self.config = config or SimCLRAugmentConfig()
        self.generator = generator

    def _uniform(self, batch: int, low: float, high: float) -> Tensor:
        return torch.empty(batch).uniform_(low, high, generator=self.generator)

    def _bernoulli(self, batch: int, p: float) -> Tensor:
        return torch.rand(batch, generator=self.generator) < p

    def view(self, images: Tensor) -> Tensor:
        """One augmented, normalised view of each image of a uint8/float batch [B, 3, H, W]."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [B, 3, H, W], got {tuple(images.shape)}")
        cfg = self.config
        batch, _, height, width = images.shape
        device = images.device
        x = to_float(images)
        boxes = random_resized_crop_boxes(batch, height, width, cfg.crop_scale, cfg.crop_ratio, self.generator)
        x = crop_and_flip(x, boxes, self._bernoulli(batch, cfg.flip_p)).clamp_(0.0, 1.0)

        jitter = self._bernoulli(batch, cfg.jitter_p)

        # Images without jitter get the identity factors.
        def factors(strength: float) -> Tensor:
            values = self._uniform(batch, max(0.0, 1.0 - strength), 1.0 + strength)
            return torch.where(jitter, values, torch.ones_like(values)).to(device)

        brightness, contrast, saturation = factors(cfg.brightness), factors(cfg.contrast), factors(cfg.saturation)
        hue = torch.where(jitter, self._uniform(batch, -cfg.hue, cfg.hue), torch.zeros(batch)).to(device)
        order = torch.randperm(4, generator=self.generator).tolist()
        if not cfg.hue:
            order = [op for op in order if op != 3]
        x = color_jitter(x, brightness, contrast, saturation, hue, order)

        gray = self._bernoulli(batch, cfg.grayscale_p).to(device)
        x = torch.where(gray[:, None, None, None], grayscale(x).expand_as(x), x)
        return normalize(x, cfg.mean, cfg.std)

    def __call__(self, images: Tensor) -> tuple[Tensor, Tensor]:
        return self.view(images), self.view(images)


def eval_transform(images: Tensor, mean: tuple[float, ...] = CIFAR_MEAN, std: tuple[float, ...] = CIFAR_STD) -> Tensor:
    """The evaluation transform: uint8 -> float, normalised, no augmentation."""
    return normalize(to_float(images), mean, std)
