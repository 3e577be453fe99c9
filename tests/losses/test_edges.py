"""The categories of the held-out fuzz of bad and extreme inputs, a representative case each, so that none comes back:
low precision, zero rows, option storage, functional edges, cached edges, resume errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers.util import cos_sim

from st_weince.functional import WEINCEOptions, check_scores, nt_xent_layout, weince_cross_entropy, weince_statistics
from st_weince.losses import CachedRBSigmoidLoss, CachedWEINCELoss, RBSigmoidLoss, WEINCELoss
from st_weince.training import LOSS_STATE_RECORD, check_resumable, last_complete_checkpoint, prepare_trainer
from tests.conftest import stop_at
from tests.training.test_rb_sigmoid_trainer import make_trainer

LOSSES = (WEINCELoss, RBSigmoidLoss)
ALL_LOSSES = (WEINCELoss, CachedWEINCELoss, RBSigmoidLoss, CachedRBSigmoidLoss)
HALF = (torch.bfloat16, torch.float16)


def columns(batch: int, dim: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """An anchor column and a noisy positive column (losses of order 1, so relative errors mean something)."""
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randn(batch, dim, generator=generator)
    return [anchors.to(dtype), (anchors + 1.5 * torch.randn(batch, dim, generator=generator)).to(dtype)]


def loss_and_input_gradients(loss_fn, inputs, autocast_dtype=None):
    leaves = [column.detach().clone().requires_grad_() for column in inputs]
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = loss_fn.compute_loss_from_embeddings(leaves, None)
    loss.backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


def cached_loss_and_gradients(loss_fn, inputs, split: int):
    leaves = [column.detach().clone().requires_grad_() for column in inputs]
    reps = [[leaf[:split], leaf[split:]] for leaf in leaves]
    return loss_fn.calculate_loss(reps, with_backward=True), [leaf.grad for leaf in leaves]


# ----- low precision -----
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("scale", [20.0, 1e4])
def test_half_precision_embeddings_are_computed_in_float32(loss_cls, dtype, autocast, scale):
    """On bf16/fp16 embeddings (also under autocast, whose matmul would run in bf16/fp16) the loss is the float64
    computation on the same low-precision values to float32 accuracy (1e-5 relative: float32 has 6e-8, the sums
    over a 128 x 128 matrix add a few hundred roundings at most), and the input gradients are that computation's,
    rounded to the input dtype: at most twice the error of rounding the exact gradient (norm over the column)."""
    # RB-Sigmoid's t is capped at max_scale (default 100): raise the cap to reach the extreme scale
    loss_fn = loss_cls(None, scale=scale) if loss_cls is WEINCELoss else loss_cls(None, scale=scale, max_scale=scale)
    inputs = columns(128, 32, dtype, seed=0)
    loss, gradients = loss_and_input_gradients(loss_fn, inputs, dtype if autocast else None)
    exact, exact_gradients = loss_and_input_gradients(loss_fn, [c.double() for c in inputs])
    assert loss.dtype == torch.float32 and exact.dtype == torch.float64
    assert abs(float(loss) - float(exact)) <= 1e-5 * abs(float(exact))
    for gradient, reference in zip(gradients, exact_gradients):
        assert gradient.dtype == dtype
        rounding = (reference.to(dtype).double() - reference).norm()
        assert (gradient.double() - reference).norm() <= 2 * rounding


def test_mode_none_on_bfloat16_is_mnrl_on_float32_copies():
    inputs = columns(64, 32, torch.bfloat16, seed=1)
    loss = WEINCELoss(None, mode="none").compute_loss_from_embeddings(inputs, None)
    as_float = [c.float() for c in inputs]
    mnrl = F.cross_entropy(cos_sim(*as_float) * 20.0, torch.arange(64))  # MultipleNegativesRankingLoss's formula
    assert float(loss) == pytest.approx(float(mnrl), rel=1e-6)


@pytest.mark.parametrize("loss_cls", LOSSES)
def test_mixed_column_dtypes_and_float64(loss_cls):
    inputs = columns(16, 8, torch.float32, seed=2)
    mixed = loss_cls(None).compute_loss_from_embeddings([inputs[0].half(), inputs[1]], None)
    assert mixed.dtype == torch.float32 and torch.isfinite(mixed)
    assert loss_cls(None).compute_loss_from_embeddings([c.double() for c in inputs], None).dtype == torch.float64


def test_nt_xent_layout_scores_in_float32_under_autocast():
    view_a, view_b = columns(8, 16, torch.float32, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores, _, _ = nt_xent_layout(view_a, view_b)
    assert scores.dtype == torch.float32


# ----- zero rows -----
@pytest.mark.parametrize("loss_cls", ALL_LOSSES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("fill", [0.0, 1e-30, 1e-6])
def test_zero_and_tiny_rows_give_finite_loss_and_gradients(loss_cls, dtype, fill):
    """A zero (or tiny) row normalises to the zero vector: its gradient, the upstream one over the norm's floor 1e-12,
    is finite in float32 and is saturated at the input dtype's largest value on the way back to float16."""
    inputs = columns(8, 16, torch.float32, seed=4)
    inputs[0][1] = fill
    inputs[1][2] = fill
    inputs = [c.to(dtype) for c in inputs]
    if loss_cls in (CachedWEINCELoss, CachedRBSigmoidLoss):
        loss, gradients = cached_loss_and_gradients(loss_cls(None, mini_batch_size=3), inputs, split=5)
    else:
        loss, gradients = loss_and_input_gradients(loss_cls(None), inputs)
    assert torch.isfinite(loss)
    assert all(torch.isfinite(gradient).all() for gradient in gradients)


def test_float16_zero_row_issue_case():
    loss = WEINCELoss(None).compute_loss_from_embeddings([torch.zeros(2, 16).half(), torch.randn(2, 16).half()])
    assert torch.isfinite(loss)


# ----- option storage -----
@pytest.mark.parametrize(
    ("loss_cls", "options", "message"),
    [
        (RBSigmoidLoss, {"scale": 1e39}, "scale = 1e\\+39 overflows float32 as stored"),
        (RBSigmoidLoss, {"scale": 1e-46}, "scale = 1e-46 underflows float32 as stored"),
        (RBSigmoidLoss, {"relative_bias": 1e39}, "relative_bias = 1e\\+39 overflows torch.float32"),
        (
            RBSigmoidLoss,
            {"parametrization": "absolute", "scale": 1e30, "max_scale": 1e30, "relative_bias": 1e10},
            "bias = .* overflows",
        ),
        (RBSigmoidLoss, {"adapter_logit": -1e40, "locked_adapter": True}, "adapter_logit = .* overflows"),
        (WEINCELoss, {"scale": 1e300}, "scale = 1e\\+300 overflows torch.float32"),
        (WEINCELoss, {"scale": 1e-300}, "scale = 1e-300 underflows torch.float32"),
        (WEINCELoss, {"gate": {"kappa_rho": 1e300}}, "kappa_rho = 1e\\+300 overflows"),
        (WEINCELoss, {"beta": 1e-50}, "beta = 1e-50 underflows"),
        (WEINCELoss, {"eps": 1e-45}, "eps = 1e-45 underflows"),
    ],
)
def test_options_are_validated_in_the_dtype_they_are_stored_in(loss_cls, options, message):
    with pytest.raises(ValueError, match=message):
        loss_cls(None, **options)


def test_largest_storable_scales_give_finite_losses():
    inputs = columns(8, 16, torch.float32, seed=5)
    assert torch.isfinite(RBSigmoidLoss(None, scale=1e38, max_scale=1e38).compute_loss_from_embeddings(inputs, None))
    assert torch.isfinite(WEINCELoss(None, scale=1e38).compute_loss_from_embeddings(inputs, None))


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"scale": "20"}, TypeError),
        ({"scale": 0.0}, ValueError),
        ({"check_inputs": 1}, TypeError),
        ({"gather_across_devices": "yes"}, TypeError),
        ({"directions": "query_to_doc"}, TypeError),
        ({"directions": ("doc_to_doc",)}, ValueError),
        ({"false_negative_filter": ("sideways", 0.1)}, ValueError),
        ({"no_such_option": 1}, TypeError),
    ],
)
def test_all_four_losses_raise_the_same_exception_for_the_same_mistake(options, error):
    for loss_cls in ALL_LOSSES:
        with pytest.raises(error):
            loss_cls(None, **options)
    for loss_cls in (CachedWEINCELoss, CachedRBSigmoidLoss):
        with pytest.raises(TypeError, match="mini_batch_size"):
            loss_cls(None, mini_batch_size="32")
        with pytest.raises(ValueError, match="mini_batch_size"):
            loss_cls(None, mini_batch_size=0)


# ----- functional edges -----
def test_cross_entropy_of_constant_scores_is_log_k_at_any_scale():
    for scale in (1e-3, 20.0, 1e8, 3e38):
        value = weince_cross_entropy(torch.ones(33, 66), torch.arange(33), None, WEINCEOptions(scale=scale))
        assert float(value) == pytest.approx(math.log(66), rel=1e-6)


@pytest.mark.parametrize("partition_mode", ["joint", "per_direction"])
def test_loss_of_identical_embeddings_is_log_k_at_any_scale(partition_mode):
    """Every score 1: each softmax is uniform over its candidates, at any scale (the joint one over the 8 documents of
    the query and the 8 queries of its document, two groups of statistics in one softmax; per direction, 8 each)."""
    directions = ("query_to_doc", "doc_to_query")
    inputs = [torch.ones(8, 4), torch.ones(8, 4)]
    expected = math.log(16) if partition_mode == "joint" else math.log(8)
    for scale in (20.0, 1e8):
        loss = WEINCELoss(None, scale=scale, directions=directions, partition_mode=partition_mode)
        assert float(loss.compute_loss_from_embeddings(inputs, None)) == pytest.approx(expected, rel=1e-6)


def test_indices_of_any_integer_dtype_and_errors_naming_the_argument():
    generator = torch.Generator().manual_seed(6)
    scores = torch.rand(6, 6, generator=generator) * 2 - 1
    expected = weince_cross_entropy(scores, torch.arange(6))
    for dtype in (torch.int8, torch.int16, torch.int32, torch.uint8):
        assert torch.equal(weince_cross_entropy(scores, torch.arange(6, dtype=dtype)), expected)
    with pytest.raises(ValueError, match="positive_index >= 0"):
        weince_cross_entropy(scores, torch.tensor([0, 1, 2, 3, 4, -1]))
    with pytest.raises(ValueError, match="positive_index must lie in"):
        weince_cross_entropy(scores, torch.tensor([0, 1, 2, 3, 4, 6]))
    with pytest.raises(ValueError, match="valid_mask must be a bool tensor of the scores' shape"):
        weince_cross_entropy(scores, torch.arange(6), torch.ones(6, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid_mask must be a bool tensor of the scores' shape"):
        check_scores(scores, torch.arange(6), torch.ones(7, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="positive_index must be an integer tensor"):
        weince_statistics(scores, torch.arange(6.0))


def test_large_finite_scores_are_not_called_infinite():
    check_scores(torch.full((3, 3), 3e38), torch.arange(3))  # finite: accepted (their sum would overflow)
    with pytest.raises(ValueError, match="NaN or Inf"):
        check_scores(torch.tensor([[0.0, float("inf")], [0.0, 0.0]]), torch.arange(2))


def test_rho0_override_is_validated():
    scores = torch.rand(12, 12, generator=torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="rho0 must be > 0"):
        weince_statistics(scores, torch.arange(12), rho0=-1.0)
    with pytest.raises(ValueError, match="rho0 must be finite"):
        weince_statistics(scores, torch.arange(12), rho0=float("nan"))
    assert torch.isfinite(weince_statistics(scores, torch.arange(12), rho0=0.5).lam).all()


# ----- cached edges -----
@pytest.mark.parametrize("loss_cls", (CachedWEINCELoss, CachedRBSigmoidLoss))
def test_cached_losses_refuse_empty_batches_in_their_own_words(loss_cls):
    loss_fn = loss_cls(None)
    with pytest.raises(ValueError, match=f"{loss_cls.__name__}: the batch is empty \\(column 0 has no rows\\)"):
        loss_fn.calculate_loss([[], []])
    with pytest.raises(ValueError, match=f"{loss_cls.__name__}: the batch is empty \\(column 1 has no rows\\)"):
        loss_fn.calculate_loss([[torch.randn(4, 8)], [torch.zeros(0, 8)]])


# ----- resume errors -----
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:WEINCELoss at a batch of 4")
def test_resume_names_a_changed_loss_and_an_incomplete_checkpoint(tiny_model_dir, tmp_path, one_torch_thread):
    output = tmp_path / "run"
    make_trainer(tiny_model_dir, output, callbacks=[stop_at(3)]).train()
    checkpoint = output / "checkpoint-3"
    attributes = json.loads((checkpoint / "trainer_state.json").read_text())["stateful_callbacks"][LOSS_STATE_RECORD]
    assert attributes["attributes"]["loss"]["loss"]["class"] == "RBSigmoidLoss"

    # another loss class: named by check_resumable before anything is built, and by the trainer's resume before it
    # loads the optimizer, whose parameter groups differ (torch's own error would name only that; issue 44)
    with pytest.raises(ValueError, match="RBSigmoidLoss in the checkpoint, WEINCELoss now"):
        check_resumable(WEINCELoss(None), checkpoint)
    with pytest.raises(ValueError, match="RBSigmoidLoss in the checkpoint, WEINCELoss now"):
        make_trainer(tiny_model_dir, output, loss_cls=WEINCELoss).train(resume_from_checkpoint=str(checkpoint))
    # the same class, another configuration
    with pytest.raises(ValueError, match="symmetric=False in the checkpoint, True now"):
        make_trainer(tiny_model_dir, output, loss_cls=lambda model: RBSigmoidLoss(model, symmetric=True)).train(
            resume_from_checkpoint=str(checkpoint)
        )

    # a damaged checkpoint: skipped by last_complete_checkpoint, named by check_resumable, renamed by nothing
    shutil.copytree(checkpoint, output / "checkpoint-5")
    (output / "checkpoint-5" / "trainer_state.json").write_text("")
    make_trainer(tiny_model_dir, output)
    assert last_complete_checkpoint(output) == str(checkpoint)
    assert (output / "checkpoint-5" / "trainer_state.json").is_file()
    with pytest.raises(ValueError, match=r"checkpoint-5.trainer_state\.json is empty: this checkpoint is incomplete"):
        check_resumable(RBSigmoidLoss(None), output / "checkpoint-5")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:WEINCELoss at a batch of 4")  # the tiny trainer's batch: InfoNCE, as intended
def test_a_loss_without_parameters_records_its_class_too(tiny_model_dir, tmp_path, one_torch_thread):
    output = tmp_path / "weince"
    trainer = make_trainer(tiny_model_dir, output, loss_cls=WEINCELoss, callbacks=[stop_at(3)])
    trainer.train()
    with pytest.raises(ValueError, match="WEINCELoss in the checkpoint, RBSigmoidLoss now"):
        check_resumable(RBSigmoidLoss(None), output / "checkpoint-3")
    with pytest.raises(ValueError, match="WEINCELoss in the checkpoint, RBSigmoidLoss now"):  # before the optimizer
        make_trainer(tiny_model_dir, output).train(resume_from_checkpoint=str(output / "checkpoint-3"))
    resumed = prepare_trainer(make_trainer(tiny_model_dir, output, loss_cls=WEINCELoss, prepare=False))
    resumed.train(resume_from_checkpoint=str(output / "checkpoint-3"))
    assert resumed.state.global_step == 6
