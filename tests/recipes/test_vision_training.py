"""recipes/simclr_tools' training step and epoch: bit for bit the loop the SimCLR studies' committed outputs came from,
the presets and arms, the per-step hook, sharding over processes, autocast and the non-finite loss error."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.lab.arms import ARMS, arm_objective, build_run
from st_weince.utils.hotpath import count_host_syncs
from st_weince.vision.objectives import SimCLRObjective
from tests.recipes.test_vision_recipe import recipe, tiny_zip  # noqa: F401 (fixtures)

from simclr_tools.augment import SimCLRAugment
from simclr_tools.data import load_dataset
from simclr_tools.models import SimCLRModel, load_encoder
from simclr_tools.setups import SETUPS
from simclr_tools.training import SimCLRTraining, build_optimizer, data_order

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = {"backbone": "resnet18", "width": 2, "projection_dim": 4, "channels_last": True, "temperature": 0.5}
TINY_SETUPS = {
    "batchnorm-head": {
        **TINY,
        "setup": "batchnorm-head",
        "hidden_dim": 8,
        "lr": 1e-3,
        "weight_decay": 1e-6,
        "beta": 1.0,
    },  # fmt: skip
    "released": {**TINY, "setup": "released", "hidden_dim": None, "lr": 3e-4, "weight_decay": 0.0, "arms": ARMS},
}


def reference_run(arm: str, seed: int, config: dict, images: torch.Tensor, batch_size: int, epochs: int):
    """The SimCLR study's loop as it produced the committed study outputs, written out by hand."""
    torch.manual_seed(seed)
    setup = SETUPS[config["setup"]]
    model = SimCLRModel("resnet18", width=config["width"], hidden_dim=config["hidden_dim"],
                        projection_dim=config["projection_dim"], head_batch_norm=setup.head_batch_norm,
                        head_output_bias=setup.head_output_bias).to(memory_format=torch.channels_last)  # fmt: skip
    entry = config.get("arms", {}).get(arm, {"loss": arm})
    objective = SimCLRObjective(entry["loss"], scale=1.0 / entry.get("temperature", config["temperature"]), beta=1.0,
                                loss_kwargs=dict(entry.get("options", {})))  # fmt: skip
    groups = [{"params": list(model.parameters())}]
    if any(p.requires_grad for p in objective.parameters()):
        groups.append({"params": list(objective.parameters()), "weight_decay": 0.0})
    optimizer = torch.optim.Adam(groups, lr=config["lr"], weight_decay=config["weight_decay"])
    augment = SimCLRAugment(setup.augment, generator=torch.Generator().manual_seed(seed))
    means = []
    model.train()
    for epoch in range(epochs):
        generator = torch.Generator().manual_seed(1_000_003 * (seed + 1) + epoch)
        order = torch.randperm(len(images), generator=generator)
        loss_sum = torch.zeros(())
        for step in range(len(images) // batch_size):
            view_a, view_b = augment(images[order[step * batch_size : (step + 1) * batch_size]])
            z1, z2 = model(torch.cat([view_a, view_b]).contiguous(memory_format=torch.channels_last)).chunk(2)
            loss = objective(z1, z2)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        means.append(float(loss_sum) / (len(images) // batch_size))
    return model, objective, means


def images_of(count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (count, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "setup, arm",
    [
        ("batchnorm-head", "infonce"),
        ("batchnorm-head", "weince"),
        ("batchnorm-head", "rb-sigmoid"),
        ("released", "composite"),
        ("released", "infonce-tau0.2"),
    ],  # fmt: skip
)
def test_epochs_equal_the_study_loop_bit_for_bit(setup, arm):
    config, images = TINY_SETUPS[setup], images_of(20)
    reference_model, reference_objective, reference_means = reference_run(arm, 3, config, images, 8, 2)
    model, objective, optimizer = build_run(arm, 3, config)
    augment = SimCLRAugment(SETUPS[setup].augment, generator=torch.Generator().manual_seed(3))
    training = SimCLRTraining(model, objective, optimizer, augment, channels_last=True)
    steps: list[tuple[int, float]] = []
    means = [training.epoch(images, data_order(20, 3, e), 8, on_step=lambda s, v: steps.append((s, float(v))))
             for e in range(2)]  # fmt: skip
    assert means == reference_means
    for mine, reference in ((model, reference_model), (objective, reference_objective)):
        for (name, value), expected in zip(mine.state_dict().items(), reference.state_dict().values(), strict=True):
            assert torch.equal(value, expected), name
    assert [s for s, _ in steps] == [0, 1, 0, 1]  # the hook sees every step, counted within its epoch
    assert sum(v for _, v in steps[:2]) / 2 == pytest.approx(means[0], rel=1e-6)


def test_arms_and_setups():
    assert arm_objective("composite", TINY_SETUPS["released"]) == (
        "weince", 0.5, {"top_m": {"shortfall_weight": 0.5, "infonce_weight": 0.5}}
    )  # fmt: skip
    assert arm_objective("infonce-tau0.2", TINY_SETUPS["released"])[1] == 0.2
    config = {"temperature": 0.25, "weince_options": {"kappa_rho": 3.0}}
    assert arm_objective("weince", config) == ("weince", 0.25, {"kappa_rho": 3.0})
    assert arm_objective("infonce", config) == ("infonce", 0.25, {})
    assert SETUPS["released"].loss_options["weince"] == ARMS["composite"]["options"]
    head = SETUPS["batchnorm-head"]
    assert (head.lr, head.weight_decay, head.hidden_dim) == (1e-3, 1e-6, 512)
    # STL-10 is normalised with its own statistics, except under the released setup, which never normalises
    assert head.augment_for("stl10").mean == (0.4467, 0.4398, 0.4066)
    assert head.augment_for("cifar10") is head.augment
    assert SETUPS["released"].augment_for("stl10") is SETUPS["released"].augment


def test_shards_of_the_global_batch_and_the_steps_limit():
    images = images_of(24)
    order = data_order(24, 0, 0)
    seen: list[torch.Tensor] = []

    class Recording(SimCLRTraining):
        def step(self, batch: torch.Tensor) -> torch.Tensor:
            seen.append(batch)
            return torch.ones(())

    training = Recording(None, None, None, None)  # type: ignore[arg-type]
    training.model = torch.nn.Identity()
    for index in range(2):
        assert training.epoch(images, order, 3, process_index=index, num_processes=2, steps=3) == 1.0
    first, second = seen[:3], seen[3:]  # each step: 6 indices of the order, every other one per process
    for step in range(3):
        together = torch.stack([first[step], second[step]], 1).reshape(-1, *images.shape[1:])
        assert torch.equal(together, images[order[6 * step : 6 * step + 6]])
    with pytest.raises(ValueError, match="needs at least 50 images"):
        training.epoch(images, order, 25, num_processes=2)


def test_autocast_forward_float32_loss_and_the_non_finite_error():
    # InfoNCE (MNRL) does not check its scores, as WEINCE does: the epoch's mean is then the one check
    model, objective, optimizer = build_run("infonce", 0, TINY_SETUPS["batchnorm-head"])
    augment = SimCLRAugment(SETUPS["batchnorm-head"].augment, generator=torch.Generator().manual_seed(0))
    training = SimCLRTraining(model, objective, optimizer, augment, autocast_dtype=torch.bfloat16)
    loss = training.step(images_of(8))
    assert loss.dtype == torch.float32 and math.isfinite(float(loss)) and not loss.requires_grad
    assert training.augment_seconds > 0
    optimizer.param_groups[0]["lr"] = math.inf
    training.step(images_of(8, 1))  # the weights become non-finite; the next epoch's mean says so
    with pytest.raises(ValueError, match="training loss became nan"):
        training.epoch(images_of(8), torch.arange(8), 8)


@pytest.mark.parametrize("preset, loss", [("batchnorm-head", "rb-sigmoid"), ("released", "weince")])
def test_the_recipe_trains_with_the_same_step(recipe, tiny_zip, tmp_path, preset, loss):  # noqa: F811
    """recipes/simclr.py's run equals SimCLRTraining over data_order bit for bit (3 steps over 2 epochs), so the
    recipe, the studies and gpu_study train alike."""
    argv = ["--preset", preset, "--dataset", "imagefolder", "--data-dir", str(tiny_zip), "--loss", loss, "--seed", "2"]
    argv += ["--width", "2", "--hidden-dim", "8", "--projection-dim", "8", "--batch-size", "6", "--max-steps", "3"]
    argv += ["--limit-train", "12", "--skip-eval", "--log-every", "1", "--output-dir", str(tmp_path)]
    results = recipe.main(argv)
    args = recipe.parse_args(argv)
    torch.manual_seed(2)
    model, objective = recipe.load_model(args), recipe.build_loss(args)
    optimizer = build_optimizer(model, objective, args.lr, args.weight_decay)
    augment = SimCLRAugment(SETUPS[preset].augment, generator=torch.Generator().manual_seed(2))
    training = SimCLRTraining(model, objective, optimizer, augment)
    images = load_dataset("imagefolder", "train", tiny_zip, limit=12).images
    losses: list[float] = []
    for epoch, steps in ((0, 2), (1, 1)):
        training.epoch(images, data_order(12, 2, epoch), 6, steps=steps, on_step=lambda s, v: losses.append(float(v)))
    assert [h["loss"] for h in results["history"]] == losses
    saved = load_encoder(tmp_path)
    for (name, value), expected in zip(saved.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(value, expected), name


@pytest.mark.parametrize("arm, per_step", [("infonce", 0), ("weince", 1)])  # WEINCE: its one input check
def test_host_syncs_per_step_and_epoch(arm, per_step):
    """No host sync in the step beyond the loss's own; one per epoch for its mean. (SGD: Adam's step counter is a
    CPU scalar, read per parameter, which counts here but is no device sync on a GPU.)"""
    model, objective, _ = build_run(arm, 0, TINY_SETUPS["batchnorm-head"])
    augment = SimCLRAugment(SETUPS["batchnorm-head"].augment, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    training = SimCLRTraining(model, objective, optimizer, augment, channels_last=True)
    images = images_of(24)
    training.step(images[:8])  # first-call set-up out of the count
    with count_host_syncs() as step_syncs:
        training.step(images[:8])
    with count_host_syncs() as epoch_syncs:
        training.epoch(images, data_order(24, 0, 0), 8)
    assert step_syncs.total == per_step and epoch_syncs.total == 3 * per_step + 1


def test_views_encoded_separately_get_their_own_batch_norm_statistics():
    """encode_views_separately: the objective sees cat(model(view_a), model(view_b)) (each view's BatchNorm batch
    statistics its own), not model(cat(view_a, view_b)); the default is the one joint pass."""
    images = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8)
    seen = {}
    for separate in (False, True):
        torch.manual_seed(0)
        model = SimCLRModel("resnet18", width=2, hidden_dim=8, projection_dim=4)
        views = SimCLRAugment(SETUPS["released"].augment, generator=torch.Generator().manual_seed(1))(images)
        objective = SimCLRObjective("infonce", scale=2.0)
        recorded = []

        def record(z1, z2, objective=objective, recorded=recorded):
            recorded.append(torch.cat([z1, z2]).detach())
            return objective(z1, z2)

        training = SimCLRTraining(
            model,
            record,
            torch.optim.SGD(model.parameters(), lr=0.0),
            SimCLRAugment(SETUPS["released"].augment, generator=torch.Generator().manual_seed(1)),
            encode_views_separately=separate,
        )
        training.step(images)
        seen[separate] = recorded[0]
        torch.manual_seed(0)
        reference = SimCLRModel("resnet18", width=2, hidden_dim=8, projection_dim=4)
        with torch.no_grad():  # the same views (same generator seed) through a fresh copy of the initial network
            expected = torch.cat([reference(view) for view in views]) if separate else reference(torch.cat(views))
        torch.testing.assert_close(seen[separate], expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(seen[False], seen[True], atol=1e-4)
