"""Batched SimCLR augmentations against torchvision's per-image reference operations."""

from __future__ import annotations

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from simclr_tools.augment import (
    SimCLRAugment,
    SimCLRAugmentConfig,
    color_jitter,
    crop_and_flip,
    eval_transform,
    hsv_to_rgb,
    random_resized_crop_boxes,
    rgb_to_hsv,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture()
def images() -> torch.Tensor:
    return torch.rand(6, 3, 12, 10, generator=torch.Generator().manual_seed(0))


def test_hsv_round_trip(images):
    assert torch.allclose(hsv_to_rgb(rgb_to_hsv(images)), images, atol=1e-5)


def test_color_jitter_matches_torchvision_per_image(images):
    brightness = torch.tensor([0.6, 1.0, 1.4, 0.9, 1.2, 0.7])
    contrast = torch.tensor([1.3, 0.6, 1.0, 0.8, 1.1, 1.4])
    saturation = torch.tensor([0.6, 1.4, 1.0, 0.0, 1.2, 0.9])
    hue = torch.tensor([0.1, -0.1, 0.0, 0.05, -0.03, 0.08])
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]):
        ours = color_jitter(images, brightness, contrast, saturation, hue, order)
        for i in range(images.shape[0]):
            expected = images[i]
            for op in order:
                if op == 0:
                    expected = TF.adjust_brightness(expected, float(brightness[i]))
                elif op == 1:
                    expected = TF.adjust_contrast(expected, float(contrast[i]))
                elif op == 2:
                    expected = TF.adjust_saturation(expected, float(saturation[i]))
                else:
                    expected = TF.adjust_hue(expected, float(hue[i]))
            assert torch.allclose(ours[i], expected, atol=1e-4), (order, i)


def test_crop_without_resize_copies_pixels_and_flip_mirrors(images):
    boxes = torch.tensor([[2.0, 3.0, 6.0, 8.0]]).repeat(6, 1)
    no_flip = torch.zeros(6, dtype=torch.bool)
    crop = crop_and_flip(images, boxes, no_flip, out_size=(8, 6))
    assert torch.allclose(crop, images[:, :, 3:11, 2:8], atol=1e-5)
    flipped = crop_and_flip(images, boxes, torch.ones(6, dtype=torch.bool), out_size=(8, 6))
    assert torch.allclose(flipped, torch.flip(images[:, :, 3:11, 2:8], dims=[3]), atol=1e-5)
    whole = torch.tensor([[0.0, 0.0, 10.0, 12.0]]).repeat(6, 1)
    assert torch.allclose(crop_and_flip(images, whole, no_flip), images, atol=1e-5)


def test_crop_boxes_lie_inside_and_follow_the_scale_range():
    generator = torch.Generator().manual_seed(1)
    boxes = random_resized_crop_boxes(4000, 32, 32, (0.08, 1.0), (3 / 4, 4 / 3), generator)
    x0, y0, w, h = boxes.unbind(1)
    assert (x0 >= 0).all() and (y0 >= 0).all() and (x0 + w <= 32).all() and (y0 + h <= 32).all()
    area = w * h / (32 * 32)
    assert area.min() >= 0.06 and area.max() <= 1.0  # rounding of w, h only
    assert 0.45 < float(area.mean()) < 0.6  # uniform area in [0.08, 1]: mean 0.54 before rejection


def test_augment_is_reproducible_and_gives_two_different_views():
    images = torch.randint(0, 256, (5, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    a1, b1 = SimCLRAugment(generator=torch.Generator().manual_seed(7))(images)
    a2, b2 = SimCLRAugment(generator=torch.Generator().manual_seed(7))(images)
    assert a1.shape == b1.shape == (5, 3, 16, 16) and a1.dtype == torch.float32
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    assert not torch.allclose(a1, b1)
    assert torch.isfinite(a1).all()


def test_identity_config_gives_the_evaluation_transform():
    images = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    config = SimCLRAugmentConfig(
        crop_scale=(1.0, 1.0), crop_ratio=(1.0, 1.0), flip_p=0.0, jitter_p=0.0, grayscale_p=0.0
    )
    view = SimCLRAugment(config).view(images)
    assert torch.allclose(view, eval_transform(images), atol=1e-5)


def test_bad_configuration_and_input_raise():
    with pytest.raises(ValueError, match="crop_scale"):
        SimCLRAugmentConfig(crop_scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="probability"):
        SimCLRAugmentConfig(jitter_p=1.5)
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        SimCLRAugment().view(torch.zeros(2, 1, 8, 8))
