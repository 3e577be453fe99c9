"""benchmarks/loss_profile.py at a tiny size: every operator's time is attributed once, the shares add up to 1, and
WEINCE's per-row top-k lands in the function that calls it."""

from __future__ import annotations

import pytest

from tests.conftest import load_script


def test_the_profile_attributes_each_operator_once(one_torch_thread):
    profile = load_script("benchmarks/loss_profile.py", "loss_profile")
    result = profile.profile_loss("weince", batch_size=32, dim=16, repeats=1, seed=0)
    shares = [row["share"] for row in result["by_function"]]
    assert sum(shares) == pytest.approx(1.0, abs=1e-9)
    assert sum(row["ms_per_call"] for row in result["by_function"]) == pytest.approx(result["total_ms_per_call"])
    places = {row["name"] for row in result["by_function"]}
    assert any(name.startswith("st_weince/functional/weince.py") and "hardest_negatives" in name for name in places)
    assert any(name.startswith("backward: ") for name in places)  # the backward pass is in the profile
    assert result["top_operators"][0]["share"] >= result["top_operators"][-1]["share"]  # largest first
