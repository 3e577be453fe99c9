"""Likelihood link selection: how much endpoint (shortfall) logit do observed top-1 winners want?

Each anchor row's winner (its positive) is drawn from ``softmax_c(l[a, c])`` with WEINCE's blended logit
``l = (1 - lambda) s / tau + lambda (-beta log(1 - s))`` (:func:`st_weince.functional.weince.weince_logits`) and one
global ``lambda``, ``beta``, ``tau``; ``lambda = 0`` is the softmax. docs/diagnostics.md ("What is measured", "Link
selection") gives the method; the why of its parts:

- the logit is ``a s + b (-log(1 - s))`` with ``a = (1 - lambda) / tau``, ``b = lambda beta``: with all three free
  ``lambda`` is not identified, so ``beta`` or ``tau`` is fixed;
- the fit runs in ``(a, b)``, where the negative log-likelihood is convex and the constraints are a box (L-BFGS-B,
  global optimum, torch autograd in float64);
- the LR test against the best softmax: with ``beta`` fixed the null is on the boundary, ``p = 0.5 P(chi2_1 > LR)``
  (Self & Liang, 1987); with ``tau`` fixed ``beta`` is unidentified under the null, ``p`` from ``chi2_2`` (said so in
  ``p_value_method``);
- separated data (every winner scores highest) have no finite maximum: ``LinkFit.separated`` flags them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from scipy import optimize, stats
from torch import Tensor

from st_weince.functional.options import RELEASED_COMPOSITE
from st_weince.functional.weince import DEFAULTS, weince_logits

_LOG_BOUND = 12.0  # |log tau|, |log beta| <= 12


@dataclass(frozen=True)
class LinkFit:
    """Result of :func:`fit_link`. Log-likelihoods are sums over anchors (natural log)."""

    lam: float
    beta: float
    tau: float
    free: tuple[str, str]
    loglik: float
    loglik_softmax: float  # best pure softmax of the same family (lambda = 0)
    tau_softmax: float
    lr_statistic: float
    p_value: float
    p_value_method: str
    softmax_coef: float  # a = (1 - lambda) / tau
    shortfall_coef: float  # b = lambda * beta
    lam_ci: tuple[float, float]
    ci_level: float
    num_anchors: int
    mean_candidates: float
    top1_accuracy: float  # share of rows whose winner has the largest score (descriptive)
    loglik_uniform: float  # every valid candidate equally likely (reference point)
    separated: bool  # every winner has the strictly largest score: no finite MLE, lambda not identified
    note: str  # how to read a fit on a boundary ("" when nothing to say)
    profile_lam: list[float] = field(default_factory=list)
    profile_loglik: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["free"] = list(self.free)
        out["lam_ci"] = list(self.lam_ci)
        return out


@dataclass
class _Problem:
    """The data of one fit: the two logit components from weince_logits and the winners."""

    softmax_part: Tensor  # [A, C] float64: s (weince_logits at lambda = 0, tau = 1)
    shortfall_part: Tensor  # [A, C] float64: -log(1 - min(s, 1 - eps)) (weince_logits at lambda = 1, beta = 1)
    valid: Tensor  # [A, C] bool
    winner: Tensor  # [A] long

    def nll(self, a: Tensor | float, b: Tensor | float) -> Tensor:
        """Mean negative log-likelihood of the winners for the logit ``a s + b (-log(1 - s))``.

        ``a = (1 - lambda) / tau``, ``b = lambda beta``: weince_logits' blend, written in its two coefficients.
        """
        logits = a * self.softmax_part + b * self.shortfall_part
        logits = logits.masked_fill(~self.valid, float("-inf"))
        chosen = logits.gather(1, self.winner[:, None]).squeeze(1)
        return (torch.logsumexp(logits, dim=1) - chosen).mean()


def _prepare(
    scores: Tensor, winner_index: Tensor, valid_mask: Tensor | None, eps: float
) -> tuple[_Problem, float, float]:
    if not isinstance(scores, Tensor):
        scores = torch.as_tensor(np.asarray(scores))
    if not isinstance(winner_index, Tensor):
        winner_index = torch.as_tensor(np.asarray(winner_index))
    if scores.dim() != 2 or scores.shape[0] == 0 or scores.shape[1] < 2:
        raise ValueError(
            f"scores must be a [anchors, candidates] matrix with at least 2 columns, got {tuple(scores.shape)}"
        )
    num_anchors, num_candidates = scores.shape
    if winner_index.shape != (num_anchors,) or winner_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"winner_index must be an integer tensor of shape ({num_anchors},), got {tuple(winner_index.shape)}"
        )
    winner_index = winner_index.long()
    if winner_index.min() < 0 or winner_index.max() >= num_candidates:
        raise ValueError(f"winner_index must lie in [0, {num_candidates - 1}]")
    if valid_mask is None:
        valid_mask = torch.ones_like(scores, dtype=torch.bool)
    elif valid_mask.shape != scores.shape or valid_mask.dtype != torch.bool:
        raise ValueError(f"valid_mask must be a bool tensor of shape {tuple(scores.shape)}")
    if not valid_mask.gather(1, winner_index[:, None]).all():
        raise ValueError("a row's winner is masked out by valid_mask")
    if (valid_mask.sum(1) < 2).any():
        raise ValueError("every row needs at least 2 valid candidates (the winner and a competitor)")
    finite = torch.isfinite(scores.masked_fill(~valid_mask, 0.0))
    if not finite.all():
        raise ValueError("scores contain NaN or Inf")
    s = scores.masked_fill(~valid_mask, 0.0)
    if (s > 1.0 + 1e-4).any() or (s < -1.0 - 1e-4).any():
        raise ValueError("scores must be cosine similarities in [-1, 1] (the shortfall logit needs the endpoint 1)")
    zeros = torch.zeros(num_anchors, dtype=torch.float32)
    ones = torch.ones(num_anchors, dtype=torch.float32)
    # The two components of the blended logit, taken from WEINCE's own formula (no second implementation).
    softmax_part = weince_logits(s, zeros, ones, scale=1.0, eps=eps).double()
    shortfall_part = weince_logits(s, ones, ones, scale=1.0, eps=eps).double()
    problem = _Problem(softmax_part, shortfall_part, valid_mask, winner_index)
    masked = s.masked_fill(~valid_mask, float("-inf"))
    top1 = float((masked.argmax(1) == winner_index).double().mean())
    uniform = float(-torch.log(valid_mask.sum(1).double()).sum())
    return problem, top1, uniform


def _separated(problem: _Problem) -> bool:
    """True when every winner has the strictly largest score and shortfall of its row: then the likelihood increases
    without bound along (a, b) -> infinity, there is no finite maximum and lambda is not identified."""
    rows = torch.arange(problem.winner.numel())
    others = problem.valid.clone()
    others[rows, problem.winner] = False
    best_other = problem.softmax_part.masked_fill(~others, float("-inf")).max(1).values
    return bool((problem.softmax_part[rows, problem.winner] > best_other).all())


def _note(separated: bool, free: tuple[str, ...], lam: float, a: float, b: float) -> str:
    notes = []
    if separated:
        notes.append("separated data: no finite maximum, the estimates carry no information about the link")
    if free[1] == "tau" and lam >= 1.0 and a > 0:
        notes.append(
            "lambda = 1 with softmax_coef > 0: the optimum is the limit lambda -> 1, tau -> 0 with "
            "(1 - lambda) / tau = softmax_coef; the shortfall weight wanted exceeds beta = 1, read the coefficients"
        )
    if free[1] == "beta" and lam > 0 and b <= 1e-9:
        notes.append("shortfall_coef = 0: lambda > 0 only lowers the softmax coefficient (a temperature misfit)")
    if free[1] == "beta" and lam <= 0 and b > 1e-9:
        notes.append(
            "lambda = 0 with shortfall_coef > 0: the optimum is the limit lambda -> 0, beta -> infinity with "
            "lambda beta = shortfall_coef; the softmax coefficient wanted exceeds 1 / tau, read the coefficients"
        )
    elif free[1] == "beta" and lam <= 0:
        notes.append("lambda = 0: beta is not identified")
    return "; ".join(notes)


def _crossing(gap: Callable[[float], float], inside: float, bound: float) -> float:
    """Where ``gap`` (negative at the MLE ``inside``) crosses 0 between ``inside`` and ``bound``; ``bound`` if never."""
    if gap(bound) <= 0:
        return bound
    if gap(inside) >= 0:  # numerical corner: the profile at the MLE fell short of the maximum; a one-point interval
        return inside
    low, high = sorted((inside, bound))
    return float(optimize.brentq(gap, low, high, xtol=1e-5))


def _minimise(
    problem: _Problem,
    a_bounds: tuple[float, float | None],
    b_bounds: tuple[float, float | None],
    x0: tuple[float, float],
) -> tuple[float, float, float]:
    """Minimise the mean NLL over the logit coefficients (a, b) in a box; the NLL is convex in (a, b).

    Returns (a, b, mean nll).
    """

    def objective(x_np: np.ndarray) -> tuple[float, np.ndarray]:
        x = torch.tensor(x_np, dtype=torch.float64, requires_grad=True)
        value = problem.nll(x[0], x[1])
        (grad,) = torch.autograd.grad(value, x)
        return float(value.detach()), grad.numpy().copy()

    start = np.array([min(max(v, lo), hi if hi is not None else v) for v, (lo, hi) in zip(x0, (a_bounds, b_bounds))])
    res = optimize.minimize(
        objective,
        start,
        jac=True,
        method="L-BFGS-B",
        bounds=[a_bounds, b_bounds],
        options={"maxiter": 1000, "ftol": 1e-14, "gtol": 1e-10},
    )
    return float(res.x[0]), float(res.x[1]), float(res.fun)


def fit_link(
    scores: Tensor,
    winner_index: Tensor,
    valid_mask: Tensor | None = None,
    *,
    free: Sequence[str] = ("lambda", "tau"),
    beta: float = RELEASED_COMPOSITE.beta,
    temperature: float = 0.05,
    eps: float = DEFAULTS.eps,
    ci_level: float = 0.95,
    profile_points: int = 21,
) -> LinkFit:
    """Maximum-likelihood fit of the blended link to observed top-1 winners, with the LR test against softmax.

    Args:
        scores: [A, C] cosine similarities of A anchors to C candidates.
        winner_index: [A] the observed winner (top-1 choice) of each row, e.g. the positive.
        valid_mask: [A, C] bool, False for entries that are not candidates (e.g. self-pairs).
        free: the fitted parameters: ("lambda", "tau") with ``beta`` fixed (default), or ("lambda", "beta")
            with ``tau`` fixed at ``temperature``. All three cannot be fitted (not identified; see module docs).
        beta: the fixed tail index when ``tau`` is fitted.
        temperature: the fixed ``tau`` when ``beta`` is fitted; also the starting ``tau`` otherwise.
        eps: shortfall clamp of weince_logits.
        ci_level: level of the profile-likelihood interval for ``lambda``.
        profile_points: grid size of the profile log-likelihood over ``lambda`` in [0, 1] (at least 3).

    Example:
        >>> scores = torch.rand(500, 32) * 1.6 - 0.8
        >>> winners = torch.distributions.Categorical(logits=scores / 0.1).sample()
        >>> fit = fit_link(scores, winners)
        >>> fit.lam < 0.3  # softmax data: little shortfall weight
        True
    """
    free_t = tuple(free)
    if free_t not in (("lambda", "tau"), ("lambda", "beta")):
        if set(free_t) == {"lambda", "beta", "tau"}:
            raise ValueError(
                "lambda, beta and tau cannot all be fitted: the logit depends on them only through "
                "(1 - lambda) / tau and lambda * beta, so lambda is not identified; fix beta (free=('lambda', 'tau')) "
                "or tau (free=('lambda', 'beta'))"
            )
        raise ValueError(f"free must be ('lambda', 'tau') or ('lambda', 'beta'), got {free_t}")
    if not (beta > 0 and math.isfinite(beta)):
        raise ValueError(f"beta must be a finite number > 0, got {beta}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if not 0.0 < ci_level < 1.0:
        raise ValueError(f"ci_level must lie in (0, 1), got {ci_level}")
    if profile_points < 3:
        raise ValueError(f"profile_points must be at least 3, got {profile_points}")
    problem, top1, uniform = _prepare(scores, winner_index, valid_mask, eps)
    num_anchors = problem.winner.numel()
    separated = _separated(problem)
    a0 = 1.0 / temperature
    if free_t[1] == "tau":
        # beta fixed: lambda = b / beta in [0, 1] <=> b in [0, beta]; tau = (1 - lambda) / a > 0 <=> a >= 0.
        a_hat, b_hat, nll_hat = _minimise(problem, (0.0, None), (0.0, beta), (a0, 0.1 * beta))
        a_soft, _, nll_soft = _minimise(problem, (0.0, None), (0.0, 0.0), (a0, 0.0))
        lam_hat = b_hat / beta
        beta_hat = beta
        tau_hat = (1.0 - lam_hat) / a_hat if a_hat > 0 else math.inf
        tau_soft = 1.0 / a_soft if a_soft > 0 else math.inf
    else:
        # tau fixed: lambda = 1 - a tau in [0, 1] <=> a in [0, 1 / tau]; beta = b / lambda > 0 <=> b >= 0.
        a_hat, b_hat, nll_hat = _minimise(problem, (0.0, a0), (0.0, None), (0.9 * a0, 0.1))
        nll_soft = float(problem.nll(a0, 0.0))
        lam_hat = 1.0 - a_hat * temperature
        # at lambda = 0: beta -> infinity if the shortfall coefficient is positive (a limit), else not identified
        beta_hat = b_hat / lam_hat if lam_hat > 0 else (math.inf if b_hat > 1e-9 else math.nan)
        tau_hat = tau_soft = temperature
    if nll_soft <= nll_hat:  # the blend family contains the softmax: never report a worse optimum
        nll_hat = nll_soft
        lam_hat = 0.0
        if free_t[1] == "tau":
            a_hat, b_hat, tau_hat = a_soft, 0.0, tau_soft
        else:
            a_hat, b_hat, beta_hat = a0, 0.0, math.nan
    loglik = -nll_hat * num_anchors
    loglik_soft = -nll_soft * num_anchors
    lr = max(2.0 * (loglik - loglik_soft), 0.0)
    if free_t[1] == "tau":
        p_value = 0.5 * float(stats.chi2.sf(lr, df=1)) if lr > 0 else 1.0
        method = "boundary mixture 0.5 chi2_0 + 0.5 chi2_1 (beta fixed)"
    else:
        p_value = float(stats.chi2.sf(lr, df=2))
        method = "chi2_2 approximation (beta unidentified under lambda = 0, tau fixed)"

    # Profile log-likelihood over lambda (each point a 1-D convex fit) and its confidence interval.
    def profile(lam: float) -> float:
        if free_t[1] == "tau":
            b = lam * beta
            return -_minimise(problem, (0.0, None), (b, b), (max(a_hat, 1e-3), b))[2] * num_anchors
        a = (1.0 - lam) / temperature  # at lambda = 0: the limit lambda -> 0+, beta -> inf (b free), the closure
        return -_minimise(problem, (a, a), (0.0, None), (a, max(b_hat, 0.1)))[2] * num_anchors

    crit = float(stats.chi2.ppf(ci_level, df=1))

    def gap(lam: float) -> float:
        return 2.0 * (loglik - profile(lam)) - crit

    if separated:  # no finite maximum: the profile is flat near 0 and carries no information
        grid, prof, low, high = np.zeros(0), np.zeros(0), 0.0, 1.0
    else:
        grid = np.linspace(0.0, 1.0, profile_points)
        prof = np.array([profile(float(lam)) for lam in grid])
        low = 0.0 if lam_hat <= 0.0 else _crossing(gap, lam_hat, 0.0)
        high = 1.0 if lam_hat >= 1.0 else _crossing(gap, lam_hat, 1.0)
    return LinkFit(
        lam=float(lam_hat),
        beta=float(beta_hat),
        tau=float(tau_hat),
        free=free_t,  # type: ignore[arg-type]
        loglik=float(loglik),
        loglik_softmax=float(loglik_soft),
        tau_softmax=float(tau_soft),
        lr_statistic=float(lr),
        p_value=p_value,
        p_value_method=method,
        softmax_coef=float(a_hat),
        shortfall_coef=float(b_hat),
        lam_ci=(float(low), float(high)),
        ci_level=ci_level,
        num_anchors=num_anchors,
        mean_candidates=float(problem.valid.sum(1).double().mean()),
        top1_accuracy=top1,
        loglik_uniform=uniform,
        separated=separated,
        note=_note(separated, free_t, float(lam_hat), float(a_hat), float(b_hat)),
        profile_lam=[float(v) for v in grid],
        profile_loglik=[float(v) for v in prof],
    )


def link_loglik(
    scores: Tensor,
    winner_index: Tensor,
    valid_mask: Tensor | None = None,
    *,
    lam: float,
    beta: float,
    tau: float,
    eps: float = 1e-6,
) -> float:
    """Log-likelihood (sum over rows) of the winners under the blended link, straight from weince_logits."""
    num_anchors = scores.shape[0]
    logits = weince_logits(
        scores,
        torch.full((num_anchors,), float(lam)),
        torch.full((num_anchors,), float(beta)),
        valid_mask,
        scale=1.0 / float(tau),
        eps=eps,
    ).double()
    return float(torch.log_softmax(logits, dim=1).gather(1, winner_index.long()[:, None]).sum())
