"""The functional API's arguments checked at entry (issue 54, item 6): batch_pivot's q as Gate.q (it was not checked
since 0.1.0: q=2 returned the maximum, q=-1 and NaN passed), and an options argument that is not the options class
(None, a Gate, a dict) a TypeError naming the parameter, not an AttributeError deep inside; no host sync added."""

from __future__ import annotations

import pytest
import torch

from st_weince.functional import Gate, TopM, WEINCEOptions, weince_cross_entropy, weince_statistics
from st_weince.functional.batch_tail import batch_negative_tail, batch_tail_size, initial_beta_ema
from st_weince.functional.top_m import top_m_terms
from st_weince.functional.weince import (
    batch_pivot,
    blend_weights,
    negatives_needed,
    statistics_from_fit,
    weince_tail_fit,
)
from st_weince.utils.hotpath import count_host_syncs


@pytest.mark.parametrize(
    ("q", "error", "message"),
    [
        (2, ValueError, r"q must lie in \[0, 1\], got 2\.0"),
        (-1, ValueError, r"q must lie in \[0, 1\], got -1\.0"),
        (float("nan"), ValueError, "q must be finite, got nan"),
        ("0.2", TypeError, "q must be a real number, got str"),
        (None, TypeError, "q must be a real number, got NoneType"),
    ],
)
@pytest.mark.parametrize("has_negatives", [True, torch.ones(16, dtype=torch.bool)], ids=["bool", "tensor"])
def test_batch_pivot_checks_q_as_the_gate_does(q, error, message, has_negatives):
    with pytest.raises(error, match=message):
        batch_pivot(torch.rand(16), has_negatives, q)
    with pytest.raises(error, match=message):  # the same words as the option's
        Gate(q=q)


def test_batch_pivot_at_the_ends_of_q_is_the_minimum_and_the_maximum():
    rho = torch.rand(16, generator=torch.Generator().manual_seed(0))
    assert batch_pivot(rho, True, 0) == rho.min() and batch_pivot(rho, True, 1.0) == rho.max()
    assert batch_pivot(rho, torch.ones(16, dtype=torch.bool), 1) == rho.max()
    with count_host_syncs() as syncs:
        batch_pivot(rho, rho > 0.5, 0.2)
    assert syncs.total == 0


def scores_and_positives():
    generator = torch.Generator().manual_seed(1)
    return torch.rand(6, 12, generator=generator) * 2 - 1, torch.arange(6)


WEINCE_CALLS = {
    "weince_cross_entropy": lambda s, p, o: weince_cross_entropy(s, p, None, o),
    "weince_statistics": lambda s, p, o: weince_statistics(s, p, None, o),
    "weince_tail_fit": lambda s, p, o: weince_tail_fit(s, p, None, o),
    "statistics_from_fit": lambda s, p, o: statistics_from_fit(weince_tail_fit(s, p), o),
    "blend_weights": lambda s, p, o: blend_weights(weince_tail_fit(s, p), 0.5, o),
    "negatives_needed": lambda s, p, o: negatives_needed(o),
}
TOP_M_CALLS = {
    "batch_tail_size": lambda s, p, o: batch_tail_size(100, o),
    "batch_negative_tail": lambda s, p, o: batch_negative_tail(s, p, None, o, eps=1e-6),
    "initial_beta_ema": lambda s, p, o: initial_beta_ema(o),
    "top_m_terms": lambda s, p, o: top_m_terms(s, p, None, o, beta=1.0, scale=20.0, eps=1e-6),
}


@pytest.mark.parametrize("wrong", [None, Gate(), {"scale": 20.0}], ids=["None", "Gate", "dict"])
@pytest.mark.parametrize("call", list(WEINCE_CALLS) + list(TOP_M_CALLS))
def test_an_options_argument_of_another_type_is_a_type_error_naming_it(call, wrong):
    scores, positives = scores_and_positives()
    function = WEINCE_CALLS.get(call) or TOP_M_CALLS[call]
    expected = "WEINCEOptions" if call in WEINCE_CALLS else "TopM"
    hint = rf" \(build it with {expected}\(\*\*d\)\)" if isinstance(wrong, dict) else ""
    with pytest.raises(TypeError, match=rf"^options must be a {expected}, got {type(wrong).__name__} .*{hint}$"):
        function(scores, positives, wrong)
    right = WEINCEOptions() if call in WEINCE_CALLS else TopM()
    function(scores, positives, right)  # the right type passes
