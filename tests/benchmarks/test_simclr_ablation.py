"""benchmarks/simclr_ablation.py on the tiny synthetic ImageFolder: the released setup reaches the model, the
optimizer and the probes; the arms differ only in the loss; states survive arms added later; the paired summary."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lab import collapse, runlog
from tests.benchmarks.test_simclr_runner import TINY, image_folder, lines, run_study, without_timing  # noqa: F401
from tests.conftest import REPO_ROOT, load_script

# The released probe splits its training images 80/20 per class: all 24 (12 a class) leave 2 a class to validate.
TINY_RELEASED = {**TINY, "hidden_dim": None, "epochs": 2, "full_eval_epochs": [], "probe_subset": None}


@pytest.fixture(scope="module")
def ablation():
    return load_script("benchmarks/simclr_ablation.py", "simclr_ablation")


def run(ablation, image_folder, out, *extra, override=None):  # noqa: F811
    run_study(ablation, image_folder, out, *extra, override={**TINY_RELEASED, **(override or {})})


def test_infonce_and_its_temperature_control_under_the_released_setup(
    ablation,
    image_folder,  # noqa: F811
    tmp_path,
    one_torch_thread,
):
    run(ablation, image_folder, tmp_path, "--runs", "infonce-seed0", "infonce-tau0.2-seed0")
    base = lines(tmp_path / "results" / "infonce-seed0.jsonl")
    control = lines(tmp_path / "results" / "infonce-tau0.2-seed0.jsonl")
    for records in (base, control):
        assert [r["type"] for r in records] == ["header", "checkpoint", "checkpoint", "checkpoint", "final"]
        header, final = records[0], records[-1]
        config = header["config"]
        assert (config["setup"], config["lr"], config["weight_decay"], config["hidden_dim"]) == (
            "released",
            3e-4,
            0,
            None,
        )
        # The released probe protocol: stratified 80/20, five k-NN split seeds, raw features.
        assert final["probe_protocol"] == "released"
        assert final["probe_train_images"] == 24
        assert [split["seed"] for split in final["knn_splits"]] == [1, 2, 3, 4, 5]
        assert final["linear_val_top1"] is not None and final["knn_val_top1_by_k"] is not None
        assert 0.0 <= final["linear_top1"] <= 100.0
    # Only the temperature differs: scale 1 / 0.5 against 1 / 0.2.
    assert base[0]["objective"]["scale"] == pytest.approx(2.0)
    assert control[0]["objective"]["scale"] == pytest.approx(5.0)
    # Same seed: the same initial network (the epoch-0 evaluation is identical), then different training.
    assert without_timing(base[1]) == without_timing(control[1])
    assert base[2]["linear_top1"] != control[2]["linear_top1"] or base[2]["train_loss"] != control[2]["train_loss"]
    # The released head: Linear(f, f, no bias) - ReLU - Linear(f, 64 here 4, no bias), no BatchNorm.
    state = torch.load(tmp_path / "state" / "infonce-seed0" / "state.pt", weights_only=False)
    head = {k: tuple(v.shape) for k, v in state["model"].items() if k.startswith("head.")}
    features = 2 * 8  # ResNet-18 of width 2: 8 x width features
    assert head == {"head.net.0.weight": (features, features), "head.net.2.weight": (TINY["projection_dim"], features)}
    # Adam without weight decay at 3e-4.
    assert [(g["lr"], g["weight_decay"]) for g in state["optimizer"]["param_groups"]] == [(3e-4, 0.0)]
    # The summary pairs the control with InfoNCE of the same seed and lists what is still missing.
    summary = ablation.summarize(tmp_path / "results")
    difference = summary["paired"]["infonce-tau0.2_minus_infonce"]
    assert difference["seeds"] == [0]
    assert difference["per_seed"]["0"]["linear_top1"] == pytest.approx(
        control[-1]["linear_top1"] - base[-1]["linear_top1"]
    )
    assert "interaction" not in summary["paired"] and len(summary["runs_missing"]) == 27
    assert "infonce-tau0.2_minus_infonce" in (tmp_path / "results" / "summary.md").read_text()
    figure = tmp_path / "results" / "paired.png"  # the paired differences as a figure beside the table
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.stat().st_size > 5_000


def test_a_state_resumes_when_arms_are_added_but_not_when_its_own_arm_changes(
    ablation,
    image_folder,  # noqa: F811
    tmp_path,
    one_torch_thread,
):
    only_infonce = {"arms": {"infonce": ablation.ARMS["infonce"]}}
    run(ablation, image_folder, tmp_path, "--runs", "infonce-seed0", "--stop-after-epoch", "1", override=only_infonce)
    run(ablation, image_folder, tmp_path, "--runs", "infonce-seed0")  # all seven arms now
    records = lines(tmp_path / "results" / "infonce-seed0.jsonl")
    assert [r["type"] for r in records] == ["header", "checkpoint", "checkpoint", "resume", "checkpoint", "final"]
    # The same run from scratch, uninterrupted, gives the same lines.
    run(ablation, image_folder, tmp_path / "straight", "--runs", "infonce-seed0")
    straight = lines(tmp_path / "straight" / "results" / "infonce-seed0.jsonl")
    kept = [without_timing(r) for r in records if r["type"] in ("checkpoint", "final")]
    assert kept == [without_timing(r) for r in straight if r["type"] in ("checkpoint", "final")]
    # A changed arm of its own is a different configuration.
    (tmp_path / "results" / "infonce-seed0.jsonl").unlink()
    run(ablation, image_folder, tmp_path, "--runs", "infonce-seed0", "--stop-after-epoch", "1", override=only_infonce)
    changed = {"arms": {"infonce": {"loss": "infonce", "temperature": 0.3}}}
    with pytest.raises(ValueError, match=r"different configuration \(\['arms'\]\)"):
        run(ablation, image_folder, tmp_path, "--runs", "infonce-seed0", override=changed)


def test_unknown_arms_are_refused(ablation, capsys):
    with pytest.raises(SystemExit) as error:
        ablation.main(["--runs", "topm-seed0"])
    assert error.value.code == 2
    assert "run names look like infonce-seed0" in capsys.readouterr().err


def test_paired_differences_and_the_interaction_by_seed(ablation):
    values = {  # (linear, k-NN) by arm and seed
        "infonce": {0: (50.0, 40.0), 1: (52.0, 41.0)},
        "infonce-topm-infonce": {0: (51.0, 40.5), 1: (52.5, 41.0)},
        "infonce-topm-shortfall": {0: (50.5, 41.0), 1: (53.0, 42.0)},
        "blend": {0: (50.0, 39.0), 1: (51.0, 41.5)},
        "composite": {0: (53.0, 42.0), 1: (54.0, 43.0)},
        "infonce-tau0.2": {0: (49.0, 40.0)},
    }
    finals = {
        (arm, seed): {"linear_top1": linear, "knn_top1": knn}
        for arm, by_seed in values.items()
        for seed, (linear, knn) in by_seed.items()
    }
    out = ablation.paired(finals)
    composite = out["composite_minus_infonce"]
    assert composite["per_seed"] == {
        "0": {"linear_top1": 3.0, "knn_top1": 2.0},
        "1": {"linear_top1": 2.0, "knn_top1": 2.0},
    }
    assert composite["linear_top1"]["mean"] == pytest.approx(2.5)
    assert composite["linear_top1"]["std"] == pytest.approx(2**-0.5)
    assert out["infonce-tau0.2_minus_infonce"]["seeds"] == [0]
    # seed 0: linear 3 - (1 + 0.5 + 0) = 1.5, k-NN 2 - (0.5 + 1 - 1) = 1.5; seed 1: 2 - (0.5 + 1 - 1) = 1.5,
    # k-NN 2 - (0 + 1 + 0.5) = 0.5
    interaction = out["interaction"]
    assert interaction["per_seed"]["0"] == pytest.approx({"linear_top1": 1.5, "knn_top1": 1.5})
    assert interaction["per_seed"]["1"] == pytest.approx({"linear_top1": 1.5, "knn_top1": 0.5})
    # No interaction without every part on the same seed.
    del finals[("blend", 1)]
    assert ablation.paired(finals)["interaction"]["seeds"] == [0]


def test_the_top_m_arms_reach_the_loss_and_their_tail_index_survives_a_resume(
    ablation,
    image_folder,  # noqa: F811
    tmp_path,
    one_torch_thread,
):
    """Arms 2-5 build the loss options of their name; the composite's batch tail index is in the run's state, so a
    run stopped and resumed writes the lines of an uninterrupted one."""
    arms = ["infonce-topm-infonce", "infonce-topm-shortfall", "blend", "composite"]
    run(ablation, image_folder, tmp_path / "straight", "--runs", *(f"{arm}-seed0" for arm in arms))
    expected_weights = {
        "infonce-topm-infonce": ("none", 0.0, 0.5),
        "infonce-topm-shortfall": ("none", 0.5, 0.0),
        "blend": ("both", 0.0, 0.0),
        "composite": ("both", 0.5, 0.5),
    }
    for arm in arms:
        records = lines(tmp_path / "straight" / "results" / f"{arm}-seed0.jsonl")
        objective = records[0]["objective"]
        top_m = objective["top_m"] or {"m": 50, "shortfall_weight": 0.0, "infonce_weight": 0.0}  # None: both off
        assert (objective["mode"], top_m["shortfall_weight"], top_m["infonce_weight"]) == expected_weights[arm]
        assert (objective["scale"], objective["beta"], top_m["m"]) == (2.0, 1.0, 50)
        statistics = records[-1]["loss_statistics"]
        assert ("weince_batch_beta" in statistics) == (expected_weights[arm][1] > 0), arm
        assert ("weince_share_blend" in statistics) == (arm != "blend"), arm
    state = torch.load(tmp_path / "straight" / "state" / "composite-seed0" / "state.pt", weights_only=False)
    assert "loss.batch_beta_ema" in state["objective"]["entries"]  # the loss-state record
    # Stopped after epoch 1 and resumed by a new process: the same lines as the uninterrupted run.
    run(ablation, image_folder, tmp_path / "resumed", "--runs", "composite-seed0", "--stop-after-epoch", "1")
    run(ablation, image_folder, tmp_path / "resumed", "--runs", "composite-seed0")
    resumed = lines(tmp_path / "resumed" / "results" / "composite-seed0.jsonl")
    straight = lines(tmp_path / "straight" / "results" / "composite-seed0.jsonl")
    assert [r["type"] for r in resumed] == ["header", "checkpoint", "checkpoint", "resume", "checkpoint", "final"]
    kept = [without_timing(r) for r in resumed if r["type"] in ("checkpoint", "final")]
    assert kept == [without_timing(r) for r in straight if r["type"] in ("checkpoint", "final")]


def test_paired_comparisons_and_interaction_against_hand_arithmetic(ablation):
    """Each arm minus InfoNCE, the composite minus the temperature control and the interaction, per seed and as mean
    +- sample std, from made-up finals whose differences are worked out by hand (exact in binary: multiples of 1/4)."""
    accuracy = {  # arm -> (linear, k-NN) of seed 0; seed 1 adds 1.0 to every linear and 0.5 to every k-NN of InfoNCE
        "infonce": (40.0, 40.0),
        "infonce-topm-infonce": (41.0, 41.5),
        "infonce-topm-shortfall": (40.25, 43.0),
        "blend": (39.75, 40.0),
        "composite": (40.5, 43.25),
        "infonce-tau0.2": (42.0, 43.0),
        "composite-tau0.2": (41.75, 43.5),
    }
    finals = {
        (arm, seed): {"linear_top1": linear + seed, "knn_top1": knn + (0.5 * seed if arm == "infonce" else 0.0)}
        for arm, (linear, knn) in accuracy.items()
        for seed in (0, 1)
    }
    paired = ablation.paired(finals)
    composite = paired["composite_minus_infonce"]
    assert composite["per_seed"] == {"0": {"linear_top1": 0.5, "knn_top1": 3.25}, "1": {"linear_top1": 0.5,
                                                                                       "knn_top1": 2.75}}  # fmt: skip
    assert composite["knn_top1"]["mean"] == 3.0 and composite["knn_top1"]["std"] == pytest.approx(0.5**0.5 / 2)
    assert paired["composite_minus_infonce-tau0.2"]["per_seed"]["0"] == {"linear_top1": -1.5, "knn_top1": 0.25}
    # Both temperatures of the composite against the control, paired (the control's k-NN does not move with the seed).
    assert paired["composite-tau0.2_minus_infonce-tau0.2"]["per_seed"] == {
        "0": {"linear_top1": -0.25, "knn_top1": 0.5},
        "1": {"linear_top1": -0.25, "knn_top1": 0.5},
    }
    assert paired["composite-tau0.2_minus_infonce"]["per_seed"]["1"] == {"linear_top1": 1.75, "knn_top1": 3.0}
    # interaction, seed 0: composite 0.5 - (1.0 + 0.25 - 0.25) linear; 3.25 - (1.5 + 3.0 + 0.0) k-NN
    assert paired["interaction"]["per_seed"]["0"] == {"linear_top1": -0.5, "knn_top1": -1.25}
    # seed 1: InfoNCE's k-NN is 0.5 higher, so each of the four differences loses 0.5: -1.25 - 0.5 + 3 x 0.5
    assert paired["interaction"]["per_seed"]["1"] == {"linear_top1": -0.5, "knn_top1": -0.25}
    assert paired["interaction"]["seeds"] == [0, 1]
    # Without the control's runs there is no comparison with it (and no error).
    without_control = ablation.paired({key: value for key, value in finals.items() if key[0] != "infonce-tau0.2"})
    assert not any(name.endswith("_minus_infonce-tau0.2") for name in without_control)


def test_the_missing_cell_its_top_m_overlap_and_the_paired_t(ablation):
    """Arm 8 (InfoNCE + both top-M terms): the composite minus it, the two top-M terms' overlap, and the paired t and
    sign count of the summary, from made-up finals worked out by hand (multiples of 1/4)."""
    accuracy = {  # (linear, k-NN) by arm and seed
        "infonce": {0: (40.0, 40.0), 1: (41.0, 40.0), 2: (40.0, 40.0)},
        "infonce-topm-infonce": {0: (41.0, 41.0), 1: (42.0, 41.0), 2: (41.0, 41.0)},
        "infonce-topm-shortfall": {0: (40.0, 43.0), 1: (41.0, 43.0), 2: (40.0, 43.0)},
        "infonce-topm-both": {0: (40.5, 43.0), 1: (41.5, 43.5), 2: (40.25, 42.5)},
        "composite": {0: (40.75, 43.0), 1: (41.5, 43.25), 2: (40.0, 43.0)},
    }
    finals = {
        (arm, seed): {"linear_top1": linear, "knn_top1": knn}
        for arm, by_seed in accuracy.items()
        for seed, (linear, knn) in by_seed.items()
    }
    paired = ablation.paired(finals)
    assert paired["composite_minus_infonce-topm-both"]["per_seed"]["0"] == {"linear_top1": 0.25, "knn_top1": 0.0}
    # overlap, seed 0: (0.5 - (1 + 0)) linear, (3 - (1 + 3)) k-NN; seed 1: (0.5 - 1), (3.5 - 4);
    # seed 2: (0.25 - 1), (2.5 - 4)
    overlap = paired["top_m_overlap"]
    assert overlap["per_seed"] == {
        "0": {"linear_top1": -0.5, "knn_top1": -1.0},
        "1": {"linear_top1": -0.5, "knn_top1": -0.5},
        "2": {"linear_top1": -0.75, "knn_top1": -1.5},
    }
    # k-NN: mean -1, sample std 0.5, t = -1 / (0.5 / sqrt 3) = -3.46 (2 degrees of freedom: two-sided p = 0.074);
    # no seed above 0
    assert ablation.paired_t_and_signs(overlap, "knn_top1") == "t = -3.46, p = 0.074, 0 of 3 > 0"
    # One seed has no spread: no t, the sign count only.
    one_seed = ablation.paired({key: value for key, value in finals.items() if key[1] == 0})
    assert ablation.paired_t_and_signs(one_seed["top_m_overlap"], "linear_top1") == "t -, 0 of 1 > 0"


def test_the_matched_arm_its_scale_the_decisive_comparison_and_collapse(ablation):
    """The matched arm's fixed scale is the one recomputed from the committed measurement runs of arm 3; the summary
    pairs arm 3 with it; the summary lists a run whose loss approaches the collapsed encoder's from above with k-NN
    below its start (benchmarks/lab/collapse.py), and not once it trains; the scale probes' verdicts follow from
    their per-step values."""
    assert ablation.MATCHED_SCALE == pytest.approx(ablation.matched_scale(), abs=0.005)
    options = ablation.STUDY_ARMS[ablation.MATCHED]["options"]
    assert options == {"mode": "none", "top_m": {"infonce_weight": 0.5, "infonce_scale": ablation.MATCHED_SCALE}}
    finals = {
        ("infonce", 0): {"linear_top1": 40.0, "knn_top1": 40.0},
        ("infonce-topm-infonce", 0): {"linear_top1": 41.0, "knn_top1": 41.0},
        ("infonce-topm-shortfall", 0): {"linear_top1": 40.5, "knn_top1": 43.0},
        (ablation.MATCHED, 0): {"linear_top1": 41.0, "knn_top1": 42.25},
    }
    paired = ablation.paired(finals)
    assert paired[f"infonce-topm-shortfall_minus_{ablation.MATCHED}"]["per_seed"]["0"] == {
        "linear_top1": -0.5,
        "knn_top1": 0.75,
    }
    assert paired[f"{ablation.MATCHED}_minus_infonce-topm-infonce"]["per_seed"]["0"]["knn_top1"] == 1.25
    # every embedding equal: InfoNCE over 2N - 1 = 511 equal logits, the top-M term over M + 1 = 51
    collapsed = float(torch.log(torch.tensor(511.0, dtype=torch.float64)) + 0.5 * torch.log(torch.tensor(51.0)))
    assert collapse.collapse_loss(ablation.STUDY_ARMS[ablation.MATCHED], 256) == pytest.approx(collapsed, rel=1e-6)
    assert collapse.collapse_loss(ablation.STUDY_ARMS["composite"], 256) is None  # the blend: no closed form here
    header = {"type": "header", "loss": ablation.MATCHED}
    start = {"type": "checkpoint", "epoch": 0, "train_loss": None, "knn_top1": 30.0}
    tight = {"threshold": 1 - collapse.SPREAD / 2}
    epoch_one = {"type": "checkpoint", "epoch": 1, "train_loss": collapsed + 0.06, "knn_top1": 25.0,
                 "pot_projection": tight}  # fmt: skip
    runs = {"a-run": [header, start, epoch_one]}
    row = ablation.collapsed_runs(runs)["a-run"]
    assert (row["collapsed_epochs"], row["collapsed_at_end"], row["knn_top1_epoch0"]) == ([1], True, 30.0)
    # it left: its projections spread again and k-NN passed its start at epoch 2
    epoch_two = {"type": "checkpoint", "epoch": 2, "train_loss": collapsed - 0.04, "knn_top1": 33.0,
                 "pot_projection": {"threshold": 0.98}}  # fmt: skip
    runs["a-run"].append(epoch_two)
    assert not ablation.collapsed_runs(runs)["a-run"]["collapsed_at_end"]
    # each part alone is not collapse: projections spread with k-NN below the start (a healthy epoch 1), projections
    # within SPREAD of one direction with k-NN above the start (the backbone still learns)
    for similarity, knn in ((1 - 2 * collapse.SPREAD, 25.0), (1 - collapse.SPREAD / 2, 31.0)):
        assert not collapse.is_collapsed(similarity, knn, 30.0)
    assert collapse.is_collapsed(1 - 0.99 * collapse.SPREAD, 29.9, 30.0)
    # the probes: collapsed from the first step that is, left at the first of LEAVE_STEPS steps in a row that are not
    search = load_script("benchmarks/matched_scale_search.py", "matched_scale_search")
    probe = {"loss": [9.0, collapsed, collapsed, *[7.0] * search.LEAVE_STEPS], "rho0": [0.03, 0.001, 0.001]}
    probe["rho0"] += [0.02] * search.LEAVE_STEPS
    verdict = search.verdict(probe)
    assert (verdict["first_collapsed_step"], verdict["left_collapse_at_step"], verdict["collapsed"]) == (1, 3, False)


def test_the_collapse_rule_on_every_committed_run_file(ablation):
    """benchmarks/lab/collapse.py on every committed run file of the SimCLR studies with an epoch-0 probe: the runs
    that collapsed (the matched arm, stopped; the scheduled arm of the link-or-temperature study, whose collapse is
    its result) are flagged at every epoch from epoch 1 on, and no other run at any epoch. A new run file is judged
    too: a run of another arm flagged at any epoch, or a collapsed arm's run not flagged, fails here, to be looked
    at."""
    link = load_script("benchmarks/simclr_link_or_temperature.py", "simclr_link_or_temperature")
    collapsing = (f"simclr_ablation/{ablation.MATCHED}-", f"simclr_link_or_temperature/{link.SCHEDULED}-")
    judged, flagged, expected = {}, {}, {}
    for path in sorted((REPO_ROOT / "benchmarks" / "results").glob("simclr*/**/*.jsonl")):
        records = runlog.read_lines(path)
        if not records or records[0].get("type") != "header":
            continue  # the scale probes: per-step lines without k-NN (matched_scale_search.py)
        checkpoints = [r["epoch"] for r in records if r.get("type") == "checkpoint"]
        if 0 not in checkpoints:
            continue  # studies 2-3: no epoch-0 probe
        name = str(path.relative_to(REPO_ROOT / "benchmarks" / "results"))
        judged[name] = collapse.collapsed_epochs(records)
        expected[name] = [e for e in checkpoints if e > 0] if name.startswith(collapsing) else []
        flagged[name] = judged[name]
    assert {name.split("/")[0] for name in judged} >= {"simclr_ablation", "simclr_ablation_matched_scale",
                                                      "simclr_link_or_temperature", "simclr_study"}  # fmt: skip
    assert len(judged) >= 30
    assert sum(1 for name in judged if name.startswith(collapsing)) >= 5  # 3 matched, 2+ scheduled
    assert flagged == expected
    # the earlier rules' misses and false alarms: the scheduled arm's epoch 1 (its mean loss 0.052 above the
    # collapsed value) is flagged; arm 10 seed 0 at epoch 1 (8.1546, below the collapsed 8.202) is not
    assert judged[f"simclr_link_or_temperature/{link.SCHEDULED}-seed0.jsonl"][0] == 1
    assert judged[f"simclr_ablation/{ablation.SHARPEST}-seed0.jsonl"] == []
