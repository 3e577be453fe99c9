"""Offline image data: ImageFolder directories, zips of one (built here in tmp), subsets, the shared CIFAR-10 zip."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from simclr_tools.data import balanced_subset, load_dataset, load_image_folder

CLASSES = ["cat", "dog", "frog"]


def _write_folder(root: Path, per_class: dict[str, int], size: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Random PNG images (lossless) in ``root/<split>/<class>/NNNN.png``; returns {relative path: pixels}."""
    rng = np.random.default_rng(seed)
    pixels = {}
    for split, count in per_class.items():
        for name in CLASSES:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for index in range(count):
                array = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
                relative = f"{split}/{name}/{index:04d}.png"
                Image.fromarray(array).save(root / relative)
                pixels[relative] = array
    return pixels


def _zip(folder: Path, target: Path, prefix: str = "") -> Path:
    with zipfile.ZipFile(target, "w") as archive:
        for path in sorted(folder.rglob("*")):
            archive.write(path, prefix + path.relative_to(folder).as_posix())
    return target


@pytest.fixture()
def image_folder(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path / "folder"
    return root, _write_folder(root, {"train": 4, "test": 2})


def test_zip_and_directory_give_the_same_images_and_labels(image_folder, tmp_path):
    root, pixels = image_folder
    archive = _zip(root, tmp_path / "images.zip")
    from_dir = load_image_folder(root, "train")
    from_zip = load_dataset("imagefolder", "train", data_dir=archive)
    assert from_zip.classes == CLASSES
    assert from_zip.images.shape == (12, 3, 8, 8) and from_zip.images.dtype == torch.uint8
    assert torch.equal(from_dir.images, from_zip.images) and torch.equal(from_dir.labels, from_zip.labels)
    # Files are sorted by class then name: image 5 is dog/0001.png, pixel for pixel.
    assert int(from_zip.labels[5]) == CLASSES.index("dog")
    assert torch.equal(from_zip.images[5].permute(1, 2, 0), torch.from_numpy(pixels["train/dog/0001.png"]))


def test_zip_with_one_enclosing_folder_and_limit(image_folder, tmp_path):
    root, _ = image_folder
    archive = _zip(root, tmp_path / "wrapped.zip", prefix="mydata/")
    test = load_dataset("cifar10", "test", data_dir=archive, limit=3)
    assert len(test) == 3 and sorted(test.labels.tolist()) == [0, 1, 2]  # one per class


def test_missing_split_and_bad_paths_raise(image_folder, tmp_path):
    root, _ = image_folder
    with pytest.raises(ValueError, match="split 'val' not found"):
        load_image_folder(root, "val")
    with pytest.raises(ValueError, match="does not exist"):
        load_image_folder(tmp_path / "nowhere", "train")
    not_zip = tmp_path / "notes.txt"
    not_zip.write_text("hello")
    with pytest.raises(ValueError, match="not a zip"):
        load_image_folder(not_zip, "train")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("mnist", "train", data_dir=root)


def test_images_of_different_sizes_raise(image_folder):
    root, _ = image_folder
    Image.fromarray(np.zeros((5, 7, 3), dtype=np.uint8)).save(root / "train" / "cat" / "9999.png")
    with pytest.raises(ValueError, match="different sizes"):
        load_image_folder(root, "train")


def test_balanced_subset_is_balanced_and_depends_only_on_its_seed():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 5)
    subset = balanced_subset(labels, 12, seed=3)
    assert len(subset) == 12 and len(set(subset)) == 12
    assert torch.bincount(labels[subset]).tolist() == [4, 4, 4]
    assert subset == balanced_subset(labels, 12, seed=3)
    assert subset != balanced_subset(labels, 12, seed=4)
    # A small class contributes all it has; the others fill up.
    assert torch.bincount(labels[balanced_subset(labels, 30, seed=0)]).tolist() == [13, 12, 5]
    assert balanced_subset(labels, None) == list(range(85))
    with pytest.raises(ValueError, match="positive"):
        balanced_subset(labels, 0)


def test_shared_cifar10_zip_offline(shared_data):
    source = shared_data / "cifar10" / "cifar10-jpg.zip"
    if not source.exists():
        pytest.skip("cifar10-jpg.zip not in shared data")
    # Read straight from the read-only shared zip: the loader never writes next to its input.
    test = load_dataset("cifar10", "test", data_dir=source, limit=20, download=False)
    assert test.images.shape == (20, 3, 32, 32)
    assert len(test.classes) == 10 and "airplane" in test.classes
    assert torch.bincount(test.labels, minlength=10).tolist() == [2] * 10
    assert 20 < float(test.images.float().mean()) < 235  # real photographs, not blank decodes
