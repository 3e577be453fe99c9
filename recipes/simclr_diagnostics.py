"""The tail diagnostics (``st-weince-diagnostics``) of an image encoder saved by recipes/simclr.py.

The same options and outputs as the diagnostics command line; the encoder, the ImageFolder reader and the two SimCLR
augmentations of each image (the choice data's positives) are the recipe's own (simclr_tools), not the wheel's:

    python recipes/simclr_diagnostics.py --encoder runs/simclr/... --images cifar10-jpg.zip --image-split test \\
        --output-dir DIR

docs/diagnostics.md says what the numbers mean.
"""

from __future__ import annotations

import argparse
import sys

import torch

from st_weince.diagnostics.__main__ import Encoded, Views, main
from st_weince.diagnostics.collect import encode_images

from simclr_tools.augment import SimCLRAugment, eval_transform
from simclr_tools.data import load_image_folder
from simclr_tools.models import load_encoder


def image_views(args: argparse.Namespace) -> Encoded:
    """The frozen embeddings of ``--num-inputs`` images and two SimCLR augmentations of each."""
    if not args.images:
        raise ValueError("--encoder needs --images (an ImageFolder directory or zip)")
    model = load_encoder(args.encoder)
    encoder = model.forward if args.features == "projection" else model.encode
    dataset = load_image_folder(args.images, args.image_split, args.num_inputs, args.seed)
    images = dataset.images
    print(f"encoding {len(images)} images", flush=True)
    bs = args.encode_batch_size
    frozen = encode_images(encoder, images, transform=eval_transform, batch_size=bs, show_progress_bar=True)
    augment = SimCLRAugment(generator=torch.Generator().manual_seed(args.seed))
    views: Views = {
        "augment": (
            encode_images(encoder, images, transform=augment.view, batch_size=bs, show_progress_bar=True),
            encode_images(encoder, images, transform=augment.view, batch_size=bs, show_progress_bar=True),
            {"kind": "two SimCLR augmentations (simclr_tools.augment.SimCLRAugment)"},
        )
    }
    data = {
        "inputs": len(images),
        "input_file": args.images,
        "split": args.image_split,
        "features": args.features,
        "encoder_config": model.config,
    }
    return Encoded(frozen, views, data)


if __name__ == "__main__":
    sys.exit(main(image_views=image_views))
