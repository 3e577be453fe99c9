"""A torch-only reproducer of the heap corruption in oneDNN's weight gradient of a strided 1x1 convolution.

torch 2.14.1 ships oneDNN 3.12.0. On an AVX2 CPU (measured: AMD EPYC, family 25) the weight gradient of
``Conv2d(C, 2C, kernel_size=1, stride=2, bias=False)`` on a channels_last input with C = 2..7 input channels
(16x16 images) corrupts the heap: glibc aborts in ``free`` ("corrupted double-linked list", "double free or
corruption") or the
process segfaults, inside ``mkldnn_convolution_backward_weights`` (oneDNN's ``jit_1x1:avx2`` backward_weights
kernel, shown by ``ONEDNN_VERBOSE=1``). NCHW inputs, stride 1, and 1 or 8+ input channels run clean, and so does
``ONEDNN_MAX_CPU_ISA=AVX`` or ``SSE41``. No line of st-weince is involved: the case below is torch alone.

Every case runs in its own process (a crash would end this one) under glibc's heap checks (``MALLOC_CHECK_=3``), so
a corruption aborts at once instead of later; the table goes to stdout and, with ``--output``, to a JSON file.

    python benchmarks/onednn_strided_1x1.py --output benchmarks/results/onednn_strided_1x1.json

st_weince.vision.models.StridedPointwiseConv2d avoids the kernel in the project's ResNets (docs/known-issues.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The whole reproducer: torch only, 200 backward passes of one strided 1x1 convolution.
CASE = """
import sys, torch
channels, stride, channels_last = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
torch.manual_seed(0)
torch.set_num_threads(1)
memory_format = torch.channels_last if channels_last else torch.contiguous_format
conv = torch.nn.Conv2d(channels, 2 * channels, kernel_size=1, stride=stride, bias=False).to(memory_format=memory_format)
images = torch.randn(16, channels, 16, 16).contiguous(memory_format=memory_format)
for _ in range(200):
    conv(images).sum().backward()
"""

CASES = [(c, 2, True, None) for c in range(1, 10)] + [
    (4, 1, True, None),  # stride 1: no crash
    (4, 2, False, None),  # NCHW: no crash
    (4, 2, True, "AVX"),  # oneDNN below AVX2: another kernel, no crash
    (4, 2, True, "SSE41"),
]


def run_case(channels: int, stride: int, channels_last: bool, max_isa: str | None) -> dict:
    env = {**os.environ, "MALLOC_CHECK_": "3", "OMP_NUM_THREADS": "1"}
    if max_isa is not None:
        env["ONEDNN_MAX_CPU_ISA"] = max_isa
    args = [sys.executable, "-c", CASE, str(channels), str(stride), "1" if channels_last else "0"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    message = (done.stderr.strip().splitlines() or [""])[-1]
    return {
        "in_channels": channels,
        "stride": stride,
        "channels_last": channels_last,
        "onednn_max_cpu_isa": max_isa,
        "exit_code": done.returncode,  # -6: abort (glibc's heap check), -11: segfault
        "crashed": done.returncode != 0,
        "last_stderr_line": message,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, help="write the table and the machine record here (JSON)")
    args = parser.parse_args(argv)
    import torch

    from st_weince.utils.provenance import provenance

    rows = []
    for case in CASES:
        rows.append(run_case(*case))
        row = rows[-1]
        print(
            f"in_channels={row['in_channels']} stride={row['stride']} channels_last={row['channels_last']} "
            f"max_isa={row['onednn_max_cpu_isa']}: {'CRASH ' + row['last_stderr_line'] if row['crashed'] else 'ok'}",
            flush=True,
        )
    result = {"torch": torch.__version__}
    result["onednn_build"] = next(
        (line.strip() for line in torch.__config__.show().splitlines() if "MKL-DNN" in line), None
    )
    result.update({"cases": rows, "provenance": provenance(argv)})
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
