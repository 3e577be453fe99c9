"""Image datasets as in-memory uint8 tensors: ImageFolder directories, zips of one, and torchvision downloads.

Small-image datasets (CIFAR, STL-10) fit in memory as ``uint8 [N, 3, H, W]``; augmentations then run batched on
tensors (see :mod:`simclr_tools.augment`), on the training device, instead of image by image in PIL.

Offline layout (``torchvision.datasets.ImageFolder``'s): ``<root>/<split>/<class>/<image>``, as a directory or as a
zip (an optional single top-level folder is allowed), e.g. ``shared/data/cifar10/cifar10-jpg.zip``.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".webp", ".tif", ".tiff")
TORCHVISION_DATASETS = ("cifar10", "cifar100", "stl10")
# Splits used by the recipe: SimCLR training images, labelled images for the probes, and held-out test images.
DEFAULT_SPLITS = {
    "cifar10": {"pretrain": "train", "train": "train", "test": "test"},
    "cifar100": {"pretrain": "train", "train": "train", "test": "test"},
    "stl10": {"pretrain": "train+unlabeled", "train": "train", "test": "test"},
    "imagefolder": {"pretrain": "train", "train": "train", "test": "test"},
}


@dataclass
class ImageTensorDataset:
    """``images`` uint8 [N, 3, H, W], ``labels`` long [N] (-1 for unlabelled images), ``classes`` names."""

    images: Tensor
    labels: Tensor
    classes: list[str]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(f"images must be uint8 [N, 3, H, W], got {self.images.dtype} {tuple(self.images.shape)}")
        if self.labels.shape != (self.images.shape[0],):
            raise ValueError(f"labels must be [N] with N = {self.images.shape[0]}, got {tuple(self.labels.shape)}")

    def __len__(self) -> int:
        return self.images.shape[0]


def balanced_subset(labels: list[int] | Tensor, limit: int | None, seed: int = 0) -> list[int]:
    """Indices of a class-balanced random subset of ``limit`` items (all items when ``limit`` is None).

    The subset depends on ``seed`` only, so runs with different training seeds see the same images.
    """
    labels = torch.as_tensor(labels)
    if limit is None or limit >= len(labels):
        return list(range(len(labels)))
    if limit < 1:
        raise ValueError(f"limit must be a positive number of images, got {limit}")
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(labels), generator=generator)
    classes = torch.unique(labels)
    per_class = [order[labels[order] == c] for c in classes]
    # Round-robin over classes, so every class gets limit / num_classes images (as far as it has them).
    chosen: list[int] = []
    for rank in range(max(len(p) for p in per_class)):
        for members in per_class:
            if rank < len(members):
                chosen.append(int(members[rank]))
                if len(chosen) == limit:
                    return sorted(chosen)
    return sorted(chosen)


def _decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def _stack(arrays: Iterable[np.ndarray], source: str) -> Tensor:
    arrays = list(arrays)
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"images in {source} have different sizes {sorted(shapes)[:4]}; resize them first")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _split_entries(names: list[str], split: str, source: str) -> tuple[list[str], list[str], list[int]]:
    """(files, classes, labels) of ``split`` among archive/directory entry names (relative, '/'-separated)."""
    files = [n for n in names if n.lower().endswith(IMAGE_EXTENSIONS)]
    prefixes = {n.split("/")[0] for n in files}
    # Allow one enclosing folder (zip of "cifar10/" instead of its content).
    if split not in prefixes and len(prefixes) == 1:
        top = next(iter(prefixes))
        files = [n[len(top) + 1 :] for n in files]
        prefixes = {n.split("/")[0] for n in files}
    else:
        top = ""
    if split not in prefixes:
        raise ValueError(
            f"split {split!r} not found in {source}: expected <root>/{split}/<class>/<image>, "
            f"found top-level folders {sorted(prefixes)[:10]}"
        )
    chosen = sorted(n for n in files if n.startswith(split + "/") and n.count("/") == 2)
    if not chosen:
        raise ValueError(f"no images in {source}/{split}/<class>/ (ImageFolder layout expected)")
    classes = sorted({n.split("/")[1] for n in chosen})
    index = {c: i for i, c in enumerate(classes)}
    labels = [index[n.split("/")[1]] for n in chosen]
    full = [f"{top}/{n}" if top else n for n in chosen]
    return full, classes, labels


def load_image_folder(
    path: str | Path, split: str, limit: int | None = None, subset_seed: int = 0
) -> ImageTensorDataset:
    """Read ``<path>/<split>/<class>/<image>`` from a directory or a ``.zip`` into memory (class-balanced subset)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"image folder {path} does not exist")
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise ValueError(f"{path} is a file but not a zip archive")
        with zipfile.ZipFile(path) as archive:
            files, classes, labels = _split_entries(archive.namelist(), split, str(path))
            keep = balanced_subset(labels, limit, subset_seed)
            images = _stack((_decode(archive.read(files[i])) for i in keep), str(path))
    else:
        names = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        files, classes, labels = _split_entries(names, split, str(path))
        keep = balanced_subset(labels, limit, subset_seed)
        images = _stack((_decode((path / files[i]).read_bytes()) for i in keep), str(path))
    return ImageTensorDataset(images, torch.tensor([labels[i] for i in keep], dtype=torch.long), classes)


def _torchvision_split(name: str, root: Path, split: str, download: bool) -> tuple[np.ndarray, list[int], list[str]]:
    from torchvision import datasets

    if name in ("cifar10", "cifar100"):
        if split not in ("train", "test"):
            raise ValueError(f"{name} has splits 'train' and 'test', got {split!r}")
        cls = datasets.CIFAR10 if name == "cifar10" else datasets.CIFAR100
        data = cls(str(root), train=split == "train", download=download)
        return np.asarray(data.data), list(data.targets), list(data.classes)
    data = datasets.STL10(str(root), split=split, download=download)
    return np.asarray(data.data).transpose(0, 2, 3, 1), [int(x) for x in data.labels], list(data.classes)


def load_dataset(
    name: str,
    split: str,
    data_dir: str | Path | None = None,
    limit: int | None = None,
    subset_seed: int = 0,
    download: bool = True,
) -> ImageTensorDataset:
    """One split of ``name`` ("cifar10", "cifar100", "stl10" or "imagefolder") as an in-memory tensor dataset.

    ``data_dir`` holding an ImageFolder layout (a directory with ``<split>/`` or a zip) is read offline; otherwise
    the torchvision dataset is loaded from ``data_dir`` (downloaded there when ``download`` and online).
    """
    if name not in DEFAULT_SPLITS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DEFAULT_SPLITS)}")
    path = Path(data_dir) if data_dir is not None else None
    if path is not None and (path.is_file() or (path / split.split("+")[0]).is_dir()):
        return load_image_folder(path, split, limit, subset_seed)
    if name == "imagefolder":
        raise ValueError(
            f"--dataset imagefolder needs --data-dir with <split>/<class>/<image> or a zip, got {data_dir}"
        )
    root = path if path is not None else Path("data")
    try:
        images, labels, classes = _torchvision_split(name, root, split, download)
    except (RuntimeError, OSError) as error:  # missing files (RuntimeError) or no network (URLError is an OSError)
        raise ValueError(
            f"could not load {name} ({split}) from {root}: {error}. Offline, pass --data-dir with an ImageFolder "
            "directory or zip (e.g. ../shared/data/cifar10/cifar10-jpg.zip)"
        ) from error
    keep = balanced_subset(labels, limit, subset_seed)
    tensor = torch.from_numpy(np.ascontiguousarray(images[keep])).permute(0, 3, 1, 2).contiguous()
    return ImageTensorDataset(tensor, torch.tensor([labels[i] for i in keep], dtype=torch.long), classes)
