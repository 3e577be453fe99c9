"""The narrow-ResNet workaround for oneDNN 3.12's strided 1x1 weight gradient (docs/known-issues.md).

torch 2.14.1's oneDNN corrupts the heap in the weight gradient of a channels_last 1x1 stride-2 convolution with 2-7
input channels on AVX2 CPUs (benchmarks/onednn_strided_1x1.py at commit 82267c0, torch alone). The project's ResNets
route those convolutions through NCHW on the CPU (:class:`StridedPointwiseConv2d`): the values must not change, a narrow
channels_last network must train under glibc's heap checks, and wider layers keep the channels_last kernel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from simclr_tools.models import NARROW_STRIDED_1X1_CHANNELS, CifarResNet, StridedPointwiseConv2d

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.numerics
@pytest.mark.parametrize("channels", [2, 4, 7, 16])
def test_values_and_gradients_equal_an_independent_float64_convolution(channels):
    torch.manual_seed(channels)
    conv = StridedPointwiseConv2d(channels, 2 * channels, kernel_size=1, stride=2, bias=False)
    conv = conv.to(memory_format=torch.channels_last)
    images = torch.randn(6, channels, 9, 9).contiguous(memory_format=torch.channels_last).requires_grad_(True)
    upstream = torch.randn(6, 2 * channels, 5, 5)
    (conv(images) * upstream).sum().backward()

    weight64 = conv.weight.detach().double().requires_grad_(True)
    images64 = images.detach().double().requires_grad_(True)
    out64 = F.conv2d(images64, weight64, stride=2)
    (out64 * upstream.double()).sum().backward()
    # float32 rounding bound: a sum of n products is off by at most about n * eps * (the sum of their magnitudes).
    eps = torch.finfo(torch.float32).eps
    with torch.no_grad():
        out_bound = channels * eps * F.conv2d(images64.abs(), weight64.abs(), stride=2)
        n_weight = 6 * 5 * 5  # terms in one weight-gradient entry
        weight_bound = (
            n_weight
            * eps
            * torch.einsum("nchw,nohw->oc", images64.abs()[:, :, ::2, ::2], upstream.double().abs())[..., None, None]
        )
    assert ((conv(images).double() - out64).abs() <= 2 * out_bound + 1e-30).all()
    assert ((conv.weight.grad.double() - weight64.grad).abs() <= 2 * weight_bound + 1e-30).all()
    input_bound = (
        2
        * channels
        * eps
        * F.conv_transpose2d(upstream.double().abs(), weight64.abs().detach(), stride=2, output_padding=0)
    )
    input_bound = F.pad(input_bound, (0, 9 - input_bound.shape[-1], 0, 9 - input_bound.shape[-2]))
    assert ((images.grad.double() - images64.grad).abs() <= input_bound + 1e-30).all()


def test_only_narrow_strided_pointwise_layers_leave_channels_last():
    """The workaround's output is NCHW; every other layer keeps channels_last (so wide networks are unchanged)."""
    images = torch.randn(2, 4, 8, 8).contiguous(memory_format=torch.channels_last)
    narrow = StridedPointwiseConv2d(4, 8, kernel_size=1, stride=2, bias=False).to(memory_format=torch.channels_last)
    assert narrow(images).is_contiguous()
    wide_images = torch.randn(2, NARROW_STRIDED_1X1_CHANNELS, 8, 8).contiguous(memory_format=torch.channels_last)
    wide = StridedPointwiseConv2d(NARROW_STRIDED_1X1_CHANNELS, 8, kernel_size=1, stride=2, bias=False)
    wide = wide.to(memory_format=torch.channels_last)
    assert wide(wide_images).is_contiguous(memory_format=torch.channels_last)
    unit_stride = StridedPointwiseConv2d(4, 8, kernel_size=1, stride=1, bias=False)
    unit_stride = unit_stride.to(memory_format=torch.channels_last)
    assert unit_stride(images).is_contiguous(memory_format=torch.channels_last)
    # Every downsample convolution of the ResNets is the routed class; the state-dict keys are nn.Conv2d's.
    model = CifarResNet("resnet18", width=2)
    downsamples = [m for name, m in model.named_modules() if name.endswith("downsample.0")]
    assert len(downsamples) == 3 and all(isinstance(m, StridedPointwiseConv2d) for m in downsamples)
    assert "layer2.0.downsample.0.weight" in model.state_dict()


NARROW_RESNETS = [("resnet18", 2), ("resnet18", 3), ("resnet50", 1)]


@pytest.fixture(scope="module")
def heap_checked_runs() -> subprocess.CompletedProcess:
    """One child process under MALLOC_CHECK_=3 and MALLOC_PERTURB_ trains every network of NARROW_RESNETS in turn
    (20 steps each), printing a line per network done: a heap corruption aborts it instead of this one."""
    script = textwrap.dedent(
        f"""
        import torch
        from simclr_tools.models import CifarResNet
        for backbone, width in {NARROW_RESNETS!r}:
            torch.manual_seed(0)
            model = CifarResNet(backbone, width=width).to(memory_format=torch.channels_last)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            for _ in range(20):
                images = torch.randn(16, 3, 16, 16).contiguous(memory_format=torch.channels_last)
                optimizer.zero_grad()
                model(images).square().mean().backward()
                optimizer.step()
            print("trained", backbone, width, flush=True)
        """
    )
    path = os.pathsep.join([REPO, os.path.join(REPO, "recipes")])  # the package and the recipe's simclr_tools
    env = {**os.environ, "MALLOC_CHECK_": "3", "MALLOC_PERTURB_": "165", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("backbone, width", NARROW_RESNETS)
def test_a_narrow_channels_last_resnet_trains_under_glibc_heap_checks(backbone, width, heap_checked_runs):
    """The configuration that aborted on an AVX2 CPU (width 2 on 16x16 images, the study tests' model): 20 steps in
    a child process under glibc's heap checks (one child for the three networks, :func:`heap_checked_runs`)."""
    done = heap_checked_runs
    assert f"trained {backbone} {width}" in done.stdout.splitlines(), f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
