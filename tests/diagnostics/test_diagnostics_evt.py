"""POT/GPD fits: known shapes from data with a known endpoint, agreement with scipy, intervals, errors."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from st_weince.diagnostics import fit_gpd, gpd_loglik, gpd_quantile, pot_fit, threshold_stability
from st_weince.diagnostics.evt import pot_fit_rows, profile_loglik, summarize_shapes


def test_beta_power_tail_is_exactly_gpd_with_xi_minus_one_over_a() -> None:
    # s = 1 - D, D ~ Beta(a, 1): P(D < d) = d^a, so the exceedances of s above 1 - d0 are GPD(-1/a, d0 / a) exactly.
    a = 3.0
    rng = np.random.default_rng(1)
    s = 1.0 - rng.beta(a, 1.0, 60_000)
    fit = pot_fit(s, threshold_quantile=0.95)
    assert fit.num_exceedances == pytest.approx(3000, abs=2)
    assert fit.xi_ci[0] < -1 / a < fit.xi_ci[1]
    assert fit.xi == pytest.approx(-1 / a, abs=0.05)
    assert fit.sigma == pytest.approx((1.0 - fit.threshold) / a, rel=0.08)
    assert fit.endpoint == pytest.approx(1.0, abs=0.01)
    assert fit.ci_method == "profile likelihood"


@pytest.mark.parametrize(("a", "b"), [(2.0, 3.0), (4.0, 2.0)])
def test_beta_tail_shape_recovered(a: float, b: float) -> None:
    # D ~ Beta(a, b): the density near 0 is ~ d^(a-1), domain of attraction with xi = -1/a (second-order bias
    # shrinks as the threshold rises).
    rng = np.random.default_rng(2)
    s = 1.0 - rng.beta(a, b, 200_000)
    fit = pot_fit(s, threshold_quantile=0.99)
    assert fit.xi_ci[0] < -1 / a < fit.xi_ci[1]
    assert fit.xi < 0 and fit.xi_ci[1] < 0
    assert fit.p_value_xi0 < 1e-6  # xi = 0 (Gumbel domain) rejected


def test_mle_matches_scipy_and_loglik_matches_scipy_logpdf() -> None:
    rng = np.random.default_rng(3)
    y = stats.genpareto.rvs(-0.3, scale=0.05, size=2000, random_state=rng)
    ours = fit_gpd(y)
    c, _, scale = stats.genpareto.fit(y, floc=0)
    assert ours["xi"] == pytest.approx(c, abs=2e-3)
    assert ours["sigma"] == pytest.approx(scale, rel=5e-3)
    scipy_ll = stats.genpareto.logpdf(y, c, scale=scale).sum()
    assert ours["loglik"] >= scipy_ll - 1e-6
    for xi, sigma in [(-0.3, 0.05), (0.2, 0.03), (0.0, 0.04)]:
        expected = stats.genpareto.logpdf(y, xi, scale=sigma).sum()
        assert gpd_loglik(y, xi, sigma) == pytest.approx(expected, rel=1e-10)
    assert gpd_loglik(y, -0.5, 0.5 * y.max() * 0.9) == -np.inf  # a point beyond the endpoint
    sigmas = np.array([0.5 * y.max() * 0.9, 0.01, 0.05, 0.2])  # an array of scales, the first beyond the support
    for xi in (-0.999, -0.5, 0.0, 0.4, 1.5):  # the written-out formula is scipy's logpdf, summed
        expected = stats.genpareto.logpdf(y[None, :], xi, scale=sigmas[:, None]).sum(1)
        np.testing.assert_allclose(gpd_loglik(y, xi, sigmas), expected, rtol=1e-10)


def test_profile_interval_ends_sit_at_the_chi2_cutoff() -> None:
    rng = np.random.default_rng(4)
    y = stats.genpareto.rvs(-0.2, scale=1.0, size=800, random_state=rng)
    fit = fit_gpd(y, ci_level=0.9)
    crit = stats.chi2.ppf(0.9, df=1)
    for end in fit["xi_ci"]:
        assert 2 * (fit["loglik"] - profile_loglik(y, end)) == pytest.approx(crit, abs=1e-3)
    assert fit["xi_ci"][0] < fit["xi"] < fit["xi_ci"][1]


def test_gumbel_and_frechet_domains() -> None:
    rng = np.random.default_rng(5)
    exp_fit = pot_fit(rng.exponential(size=40_000), threshold_quantile=0.95)
    assert exp_fit.xi_ci[0] < 0.0 < exp_fit.xi_ci[1]
    assert exp_fit.endpoint is None or exp_fit.xi < 0
    pareto_fit = pot_fit(rng.pareto(4.0, size=40_000), threshold_quantile=0.95)  # Lomax tail: xi = 1/4
    assert pareto_fit.xi_ci[0] < 0.25 < pareto_fit.xi_ci[1]
    assert pareto_fit.xi_ci[0] > 0 and pareto_fit.endpoint is None


def test_explicit_threshold_and_quantile_function() -> None:
    rng = np.random.default_rng(6)
    s = 1.0 - rng.beta(2.0, 1.0, 20_000)
    fit = pot_fit(s, threshold=0.9)
    assert fit.threshold == 0.9 and fit.threshold_quantile is None
    assert fit.num_exceedances == int((s > 0.9).sum())
    p = np.array([0.1, 0.5, 0.9])
    assert np.allclose(gpd_quantile(p, -0.3, 0.1), stats.genpareto.ppf(p, -0.3, scale=0.1))
    assert np.allclose(gpd_quantile(p, 0.0, 0.1), stats.expon.ppf(p, scale=0.1))


def test_threshold_stability_orders_and_skips_thin_tails() -> None:
    rng = np.random.default_rng(7)
    s = 1.0 - rng.beta(3.0, 1.0, 10_000)
    fits = threshold_stability(s, quantiles=(0.9, 0.95, 0.99, 0.9999))  # 0.9999 leaves 1 point: skipped
    assert [f.threshold_quantile for f in fits] == [0.9, 0.95, 0.99]
    assert all(f1.threshold < f2.threshold for f1, f2 in zip(fits, fits[1:]))
    assert all(f.xi_ci[0] < -1 / 3 < f.xi_ci[1] for f in fits)


def test_bad_input_raises_clear_errors() -> None:
    good = np.linspace(0.0, 1.0, 1000)
    with pytest.raises(ValueError, match="NaN or Inf"):
        pot_fit(np.append(good, np.nan))
    with pytest.raises(ValueError, match="threshold_quantile"):
        pot_fit(good, threshold_quantile=1.0)
    with pytest.raises(ValueError, match="only 10 values lie above"):
        pot_fit(good, threshold_quantile=0.99)
    with pytest.raises(ValueError, match="empty"):
        pot_fit([])
    with pytest.raises(ValueError, match="> 0"):
        fit_gpd(np.array([0.0] + [1.0] * 20))
    with pytest.raises(ValueError, match="no threshold quantile"):
        threshold_stability(good[:50], quantiles=(0.9,))


def test_per_row_fits_and_their_summary() -> None:
    rng = np.random.default_rng(8)
    rows = [1.0 - rng.beta(2.0, 1.0, 2000) for _ in range(6)] + [rng.exponential(size=2000)] + [np.arange(20.0)]
    fits = pot_fit_rows(rows, threshold_quantile=0.9)
    assert fits[-1] is None  # 2 exceedances only
    assert all(f.xi_ci[0] < -0.5 < f.xi_ci[1] for f in fits[:6])
    summary = summarize_shapes(fits)
    assert summary["rows_fitted"] == 7 and summary["rows_skipped"] == 1
    assert summary["share_ci_below_zero"] == pytest.approx(6 / 7)
    assert summary["xi_quantiles"]["0.5"] == pytest.approx(np.median([f.xi for f in fits[:7]]))
    with pytest.raises(ValueError, match="no row"):
        summarize_shapes([None])


def test_pool_of_uniform_points_on_a_sphere_has_the_geometric_shape() -> None:
    # Cosines of uniform points on S^(k-1) have density ~ (1 - s)^((k-3)/2) near the cap: xi = -2 / (k - 1).
    import torch

    from st_weince.diagnostics.collect import negative_pool

    k = 5
    points = torch.randn(800, k, generator=torch.Generator().manual_seed(0))
    fit = pot_fit(negative_pool(points), threshold_quantile=0.999)  # ~320 exceedances: past the second-order bias
    assert fit.xi_ci[0] < -2 / (k - 1) < fit.xi_ci[1]
    assert fit.endpoint == pytest.approx(1.0, abs=0.01)
