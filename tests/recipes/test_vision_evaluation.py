"""Frozen-feature evaluation (weighted k-NN, recall@k, linear probe) and the image encoders."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from simclr_tools.evaluation import knn_evaluate, linear_probe
from simclr_tools.models import CifarResNet, SimCLRModel, load_encoder, save_encoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _brute_force_knn(train, train_labels, test, test_labels, k, temperature, num_classes):
    """Loop-by-loop reference: weighted vote of the k most similar train rows; recall = any same-class neighbour."""
    correct = hit = 0
    for query, label in zip(test, test_labels):
        sims = [(float(F.cosine_similarity(query, row, dim=0)), int(c)) for row, c in zip(train, train_labels)]
        sims.sort(key=lambda item: -item[0])
        votes = [0.0] * num_classes
        for sim, cls in sims[:k]:
            votes[cls] += math.exp(sim / temperature)
        correct += int(max(range(num_classes), key=lambda c: votes[c]) == int(label))
        hit += int(any(cls == int(label) for _, cls in sims[:k]))
    return 100.0 * correct / len(test), 100.0 * hit / len(test)


def test_knn_matches_a_brute_force_reference():
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 6, generator=generator)
    train_labels = torch.randint(0, 4, (60,), generator=generator)
    test_labels = torch.randint(0, 4, (25,), generator=generator)
    train = centers[train_labels] + 1.2 * torch.randn(60, 6, generator=generator)
    test = centers[test_labels] + 1.2 * torch.randn(25, 6, generator=generator)
    result = knn_evaluate(train, train_labels, test, test_labels, ks=(1, 2, 5, 10, 20, 50), chunk_size=7)
    for k in (1, 2, 5, 10, 20, 50):
        top1, recall = _brute_force_knn(train, train_labels, test, test_labels, k, 0.1, 4)
        assert result.top1[k] == pytest.approx(top1) and result.recall[k] == pytest.approx(recall)
    assert result.top1[1] == result.recall[1]  # with one neighbour, a vote is a hit
    assert all(result.recall[a] <= result.recall[b] for a, b in zip((1, 2, 5, 10, 20), (2, 5, 10, 20, 50)))
    assert 0 < result.top1[20] < 100  # the noise makes this a non-trivial case


def test_knn_temperature_changes_the_vote():
    # Query at distance: one very close class-0 neighbour and two farther class-1 neighbours.
    train = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.8, -0.6]])
    labels = torch.tensor([0, 1, 1])
    query = torch.tensor([[1.0, 0.0]])
    sharp = knn_evaluate(train, labels, query, torch.tensor([0]), ks=(3,), temperature=0.1)
    flat = knn_evaluate(train, labels, query, torch.tensor([0]), ks=(3,), temperature=100.0)
    assert sharp.top1[3] == 100.0 and flat.top1[3] == 0.0


def test_linear_probe_separates_separable_features_and_not_random_labels():
    generator = torch.Generator().manual_seed(1)
    centers = 4 * torch.randn(5, 16, generator=generator)
    labels = torch.arange(5).repeat(40)
    features = centers[labels] + torch.randn(200, 16, generator=generator)
    test_labels = torch.arange(5).repeat(10)
    test = centers[test_labels] + torch.randn(50, 16, generator=generator)
    result = linear_probe(features, labels, test, test_labels, epochs=40, batch_size=32, lr=1e-2)
    assert result["top1"] == 100.0 and result["top5"] == 100.0
    shuffled = linear_probe(
        torch.randn(200, 16), labels, torch.randn(50, 16), test_labels, epochs=40, batch_size=32, lr=1e-2
    )
    assert shuffled["top1"] < 50.0


def test_evaluation_rejects_bad_input():
    features, labels = torch.randn(10, 4), torch.arange(10) % 2
    with pytest.raises(ValueError, match="NaN"):
        knn_evaluate(features, labels, torch.full((3, 4), float("nan")), labels[:3])
    with pytest.raises(ValueError, match="same D"):
        linear_probe(features, labels, torch.randn(3, 5), labels[:3])
    with pytest.raises(ValueError, match="every k"):
        knn_evaluate(features, labels, features, labels, ks=(20,))
    with pytest.raises(ValueError, match="labelled"):
        knn_evaluate(features, -torch.ones(10, dtype=torch.long), features, labels)


@pytest.mark.parametrize(("backbone", "width", "dim"), [("resnet18", 8, 64), ("resnet50", 4, 128)])
def test_cifar_resnet_shapes_and_stem(backbone, width, dim):
    model = CifarResNet(backbone, width=width)
    assert model.feature_dim == dim
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, dim)


def test_standard_width_has_the_resnet18_parameter_count():
    # torchvision's ResNet-18 has 11,689,512 parameters; the CIFAR stem (3x3 instead of 7x7 conv) and no fc layer
    # remove 64*3*(49-9) + 512*1000+1000 of them.
    model = CifarResNet("resnet18", width=64)
    assert sum(p.numel() for p in model.parameters()) == 11_689_512 - 64 * 3 * 40 - 513_000


def test_save_and_load_encoder_round_trip(tmp_path):
    model = SimCLRModel("resnet18", width=4, hidden_dim=16, projection_dim=8).eval()
    images = torch.randn(3, 3, 16, 16)
    save_encoder(model, tmp_path / "enc", {"loss": "weince"})
    loaded = load_encoder(tmp_path / "enc")
    assert torch.equal(loaded.encode(images), model.encode(images)) and torch.equal(loaded(images), model(images))
    with pytest.raises(ValueError, match="model_config.json"):
        load_encoder(tmp_path)
    with pytest.raises(ValueError, match="unknown backbone"):
        CifarResNet("vgg11")
