"""Fitting a `CostModel` to measured times: per-rank, or step-max (the slowest rank of each step).

Step-max, by default, is the maximum-likelihood fit of the step time as the max over ranks of noisy
rank times (the noise sigma is estimated with the coefficients, so E[max] over ranks' noise is not
read as cost); `step_noise=False` is the plain soft-max fit.

Guarantees: every coefficient is >= 0; residuals are relative (the planner cares about ratios and
timings are heteroscedastic); Huber-weighted, then observations beyond 4 robust sigmas are dropped
and the fit is redone on the inliers. Held-out steps measure R^2 / MAPE. The method and its
reasoning: docs/cost_model.md. Pure numpy / scipy: no torch import here.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from hf_dp_balance.core.choices import FIT_MODES
from hf_dp_balance.core.cost import COEFF_NAMES, FEATURE_NAMES, N_FEATURES, CostModel
from hf_dp_balance.core.fit_solvers import (ANNEAL_TEMPERATURES, ShapePrior, column_scale, expected_step_max,
                                            fit_per_rank, fit_step_max, fit_step_max_noisy)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class FitReport:
    """How well the fitted model predicts.

    `r2` / `mape` are on held-out steps (model fitted on the other steps;
    NaN when too few steps to hold any out), in the fitted mode's target:
    per-rank times for `per_rank`, step times (slowest rank) for `step_max`.
    `step_mape` is always on held-out step times (max over ranks).
    With the noise-aware step-max fit, predicted step times are E[max over ranks] under the fitted
    rank noise `step_noise` (relative sigma of a rank's time; None for the other fits).
    `train_*` are on the training observations of the final fit.
    """

    mode: str
    r2: float
    mape: float
    step_mape: float
    train_r2: float
    train_mape: float
    n_train: int
    n_heldout: int
    n_observations: int
    n_outliers: int
    outlier_steps: Tuple[int, ...]
    temperature: Optional[float]
    prior_scales: Optional[Tuple[float, ...]] = None
    """With a prior: each coefficient over the prior's (NaN where the prior's is 0): seconds per FLOP."""
    step_noise: Optional[float] = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["outlier_steps"] = list(self.outlier_steps)
        if self.prior_scales is not None:
            d["prior_scales"] = list(self.prior_scales)
        return d

    def summary(self) -> str:
        def pct(x: float) -> str:
            return "n/a" if not math.isfinite(x) else f"{100 * x:.2f}%"

        def num(x: float) -> str:
            return "n/a" if not math.isfinite(x) else f"{x:.4f}"

        return (
            f"mode={self.mode} held-out: R^2={num(self.r2)} MAPE={pct(self.mape)} step-MAPE={pct(self.step_mape)} "
            f"({self.n_heldout} steps) | train: R^2={num(self.train_r2)} MAPE={pct(self.train_mape)} "
            f"({self.n_train} steps, {self.n_observations} observations, {self.n_outliers} outliers dropped)"
            + ("" if self.step_noise is None else f" | rank noise {100 * self.step_noise:.2f}%")
        )


@dataclass(frozen=True)
class FitResult:
    """The fitted model (on all steps, outliers dropped) and its report."""

    model: CostModel
    report: FitReport

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "report": self.report.to_dict()}


# --------------------------------------------------------------------------- fitting


def _validate(features, times) -> Tuple[np.ndarray, np.ndarray]:
    """Check shapes and values; returns features [S, R, 4] and times [S] or [S, R] as float64."""
    features = np.asarray(features, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    if features.ndim == 2 and features.shape[-1] == N_FEATURES:
        features = features[:, None, :]  # [steps, 4]: one rank
        if times.ndim == 2 and times.shape[1] != 1:
            raise ValueError(f"features of shape [steps, 4] mean one rank, but times has shape {times.shape}")
    if features.ndim != 3 or features.shape[-1] != N_FEATURES:
        raise ValueError(f"features must have shape [steps, ranks, {N_FEATURES}] {FEATURE_NAMES}, got {features.shape}")
    steps, ranks, _ = features.shape
    if times.ndim not in (1, 2) or times.shape[0] != steps or (times.ndim == 2 and times.shape[1] != ranks):
        raise ValueError(f"times must have shape [steps={steps}] or [steps={steps}, ranks={ranks}], got {times.shape}")
    bad = ~np.isfinite(features)
    if bad.any():
        s, r, k = np.argwhere(bad)[0]
        raise ValueError(f"features[step={s}, rank={r}, {FEATURE_NAMES[k]}]={float(features[s, r, k])!r} is not finite")
    bad = features < 0
    if bad.any():
        s, r, k = np.argwhere(bad)[0]
        raise ValueError(f"features[step={s}, rank={r}, {FEATURE_NAMES[k]}]={float(features[s, r, k])!r} is negative")
    bad = ~(np.isfinite(times) & (times > 0))
    if bad.any():
        idx = tuple(np.argwhere(bad)[0])
        where = f"step={idx[0]}" + (f", rank={idx[1]}" if times.ndim == 2 else "")
        raise ValueError(f"times[{where}]={float(times[idx])!r}: times must be finite and > 0")
    return features, times


# Default pull toward the prior's shape: a deviation d of two terms' scales (relative) costs as much as a
# relative residual of PRIOR_STRENGTH * d on every observation (measured: bench/cost_fit.py).
PRIOR_STRENGTH = 0.03
# The same for the noise-aware step-max fit: its likelihood reads every rank of a step (each finished at
# or before the slowest), so it holds the data more tightly than one residual per step. Measured on
# bench/cost_fit_synthetic.py's grid against 0.03 and 0.3: the narrowest spread at 128 ranks
# (docs/benchmarks/cost_fit.md, the noise-aware step-max fit side by side with the soft-max fit).
STEP_MAX_PRIOR_STRENGTH = 0.1


# The noise-aware step-max fit reads the prior as a distribution (`ShapePrior`), not as penalty rows:
# log(term / main term) ~ N(prior's, PRIOR_RATIO_SIGMA^2). A GPU runs attention at a different fraction of
# peak than GEMMs, by up to several times, so a ratio 2x off the FLOPs' is 1.4 sigma: the data moves it.
PRIOR_RATIO_SIGMA = 0.5
# ... and each term the prior does not price (per sample, per step) as half-normal with sigma this share of
# the median step time: the data decides below a few tenths of a step, the term is never pinned at 0, and
# on packs of equal tokens the constant cannot take the linear term's place unpunished.
FREE_TERM_SHARE = 0.1
# ... but beside a FLOP prior, which prices every sample's work, the per-step constant (optimizer, launches
# outside the samples) gets this narrower share: in fixed-length packs every rank holds the same tokens, so a
# constant of a tenth of a step can stand in for a tenth of the linear term and scale every sample's cost down
# by as much. Measured (bench/cost_fit_runtime.py, truth's constant 3% of a step, warm-up with short
# companions): 0.1 left the 2x-heavy prior at 128 ranks at 9.6% single-sample error (constant 4.6x the truth's
# over the linear term), 0.05 at 10.3%, 0.03 at 1.3%.
PRIOR_FREE_TERM_SHARE = 0.03


# A FLOP prior prices a sample's fixed work at 0, yet every sample costs a few kernel launches, a partly
# filled attention tile per layer, its share of the loss: the shape prior prices it at PER_SAMPLE_TOKENS
# tokens of the linear term, log-normal with sigma PER_SAMPLE_SIGMA (a factor e ~ 2.7 either way is
# 1 sigma). Why a guess and not 0: step times pin this term poorly (a rank's samples vary by ~1% of its time),
# and a planner that believes it is 0 piles short samples onto a rank, which costs more of the cut than a
# per-sample cost a few times too high does (docs/cost_model.md).
PER_SAMPLE_TOKENS = 8.0
PER_SAMPLE_SIGMA = 1.0


def shape_prior(prior: Optional[CostModel], features: np.ndarray, times: np.ndarray, scale: np.ndarray,
                ratio_sigma: Optional[float] = None, free_share: Optional[float] = None) -> ShapePrior:
    """The `ShapePrior` of the noise-aware step-max fit on scaled coefficients (theta = coefficient * scale).

    Priced terms (the prior's non-zero ones): each one's log ratio to the term with the largest share of the
    prior's cost, centred on the prior's, sigma `ratio_sigma`; a per-sample cost the prior leaves at 0 is
    priced at PER_SAMPLE_TOKENS tokens of its linear term, sigma PER_SAMPLE_SIGMA. Free terms (the per-step
    constant; without a prior also the per-sample cost, while the quadratic and linear terms get no prior):
    half-normal, sigma `free_share` x the median step time. None: PRIOR_RATIO_SIGMA, and FREE_TERM_SHARE without a
    prior, PRIOR_FREE_TERM_SHARE with one."""
    ratio_sigma = PRIOR_RATIO_SIGMA if ratio_sigma is None else ratio_sigma
    if free_share is None:
        free_share = FREE_TERM_SHARE if prior is None or not np.any(prior.coefficients > 0) else PRIOR_FREE_TERM_SHARE
    observed = times if times.ndim == 1 else times.max(axis=1)
    free_sigma = free_share * float(np.median(observed))
    coef = np.zeros(N_FEATURES) if prior is None else prior.coefficients.copy()
    sigmas = np.full(N_FEATURES, ratio_sigma)
    if coef[1] > 0 and coef[2] == 0:
        coef[2], sigmas[2] = PER_SAMPLE_TOKENS * coef[1], PER_SAMPLE_SIGMA
    priced = np.flatnonzero(coef > 0)
    if not priced.size:
        return ShapePrior((), (), (), (2, 3), free_sigma)
    main = int(priced[np.argmax(coef[priced] * scale[priced])])
    pairs = tuple((int(k), main) for k in priced if k != main)
    ratios = tuple(math.log(coef[k] * scale[k]) - math.log(coef[main] * scale[main]) for k, _ in pairs)
    free = tuple(k for k in range(N_FEATURES) if coef[k] == 0 and k >= 2)
    return ShapePrior(pairs, ratios, tuple(float(sigmas[k]) for k, _ in pairs), free, free_sigma)


def prior_penalty(prior: Optional[CostModel], features: np.ndarray, times: np.ndarray, scale: np.ndarray,
                  strength: float) -> Optional[np.ndarray]:
    """Penalty rows [p, 4] on the scaled coefficients theta (= coefficient * scale); None without a prior.

    The prior fixes the ratios between the terms it prices, never their unit: each priced term's scale
    (coefficient / prior's, seconds per FLOP) is pulled toward the scale of the term that carries most of
    the prior's cost, relative to a reference scale (median time over prior cost). The terms it leaves at
    0 (per sample, per step) are pulled toward 0 in units of a typical observed time: on fixed-length
    packs sum(L) is the same on every rank and step, so only this pull separates the linear term from
    the constant. Weight `strength * sqrt(observations)`: a relative deviation d costs as much as a
    relative residual of `strength * d` on every observation."""
    if prior is None or strength <= 0:
        return None
    coef = prior.coefficients
    priced = np.flatnonzero(coef > 0)
    predicted = features @ coef  # [S, R]
    observed = times if times.ndim == 2 else times[:, None]
    reference = predicted if times.ndim == 2 else predicted.max(axis=1, keepdims=True)
    ok = reference > 0
    if not priced.size or not ok.any():
        return None
    s_ref = float(np.median(observed[ok] / reference[ok]))
    weight = strength * math.sqrt(times.size)
    main = priced[np.argmax(coef[priced] * scale[priced])]  # the term with the largest share of the prior's cost
    rows = []
    for k in range(N_FEATURES):
        row = np.zeros(N_FEATURES)
        if k in priced and k != main:
            row[k] = weight / (s_ref * scale[k] * coef[k])
            row[main] = -weight / (s_ref * scale[main] * coef[main])
        elif k not in priced:
            row[k] = weight / float(np.median(observed))  # theta_k is the term's RMS contribution in seconds
        else:
            continue
        rows.append(row)
    return np.array(rows) if rows else None


def _fit(features: np.ndarray, times: np.ndarray, mode: str, robust: bool, temperature: Optional[float],
         prior: Optional[CostModel], strength: float, step_noise: bool):
    """Fit on already validated data; returns (CostModel, inlier mask shaped like times, rank noise sigma
    of the noise-aware step-max fit or None)."""
    scale = column_scale(features)
    x = features / scale
    penalty = prior_penalty(prior, features, times, scale, strength)
    sigma = None
    if mode == "per_rank":
        theta, inliers = fit_per_rank(x.reshape(-1, N_FEATURES), times.reshape(-1), robust, penalty)
        inliers = inliers.reshape(times.shape)
    elif step_noise:
        shape = shape_prior(prior if strength > 0 else None, features, times, scale)  # strength 0: no prior
        theta, inliers, sigma = fit_step_max_noisy(x, times, robust, temperature, penalty, shape)
    else:
        theta, inliers = fit_step_max(x, times, robust, temperature, penalty)
    coefficients = np.maximum(theta, 0.0) / scale
    return CostModel(*coefficients.tolist()), inliers, sigma


def _r2(pred: np.ndarray, true: np.ndarray) -> float:
    if true.size < 2:
        return float("nan")
    total = float(np.sum((true - true.mean()) ** 2))
    if total <= 0:
        return float("nan")
    return 1.0 - float(np.sum((pred - true) ** 2)) / total


def _mape(pred: np.ndarray, true: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - true) / true)) if true.size else float("nan")


def _predicted_steps(model: CostModel, features: np.ndarray, sigma: Optional[float]) -> np.ndarray:
    """Predicted step times: the slowest rank's cost, or E[max] under rank noise sigma when fitted."""
    return model.step_time(features) if sigma is None else expected_step_max(model.predict(features), sigma)


def _targets(model: CostModel, features: np.ndarray, times: np.ndarray, mode: str, sigma: Optional[float]):
    """(predicted, observed) in the mode's target: per-rank times or step times."""
    if mode == "per_rank":
        return model.predict(features).ravel(), times.ravel()
    return _predicted_steps(model, features, sigma), times


def _check_options(mode: str, holdout: float, temperature: Optional[float]) -> None:
    if mode not in FIT_MODES:
        raise ValueError(f"mode={mode!r}: must be one of {FIT_MODES}")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout={holdout!r}: must be in [0, 1)")
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0 (relative to the step time) or None")


def _resolve_mode(features: np.ndarray, times: np.ndarray, mode: str) -> Tuple[str, np.ndarray]:
    """The concrete mode and its target times ([S, R] per-rank, [S] step-max); enough observations?"""
    steps, ranks, _ = features.shape
    if mode == "auto":
        mode = "per_rank" if times.ndim == 2 else "step_max"
    if mode == "per_rank" and times.ndim != 2:
        raise ValueError(f"mode='per_rank' needs per-rank times [steps, ranks]; got times of shape {times.shape}")
    if mode == "step_max" and times.ndim == 2:
        times = times.max(axis=1)
    per_step = ranks if mode == "per_rank" else 1
    if steps * per_step < N_FEATURES:
        raise ValueError(
            f"{steps} steps x {per_step} observation(s) per step = {steps * per_step} observations in mode {mode!r}: "
            f"fewer than the {N_FEATURES} unknowns {COEFF_NAMES}; record more warm-up steps"
        )
    return mode, times


def _holdout_steps(steps: int, per_step: int, holdout: float, seed: int) -> np.ndarray:
    """Sorted indices of the held-out steps (a seeded choice); only when enough steps remain to
    determine the 4 unknowns twice over."""
    n_heldout = int(round(steps * holdout))
    min_train_steps = -(-2 * N_FEATURES // per_step)
    n_heldout = max(0, min(n_heldout, steps - min_train_steps))
    return np.sort(np.random.default_rng(seed).permutation(steps)[:n_heldout])


def _heldout_scores(features, times, test_steps, mode, robust, temperature, prior, strength,
                    step_noise) -> Tuple[float, float, float]:
    """(R^2, MAPE, step MAPE) of a model fitted without `test_steps`, on them (NaN when none)."""
    if not test_steps.size:
        return float("nan"), float("nan"), float("nan")
    train_steps = np.setdiff1d(np.arange(features.shape[0]), test_steps)
    trial, _, sigma = _fit(features[train_steps], times[train_steps], mode, robust, temperature, prior, strength,
                           step_noise)
    pred, true = _targets(trial, features[test_steps], times[test_steps], mode, sigma)
    true_step = times[test_steps] if times.ndim == 1 else times[test_steps].max(axis=1)
    return _r2(pred, true), _mape(pred, true), _mape(_predicted_steps(trial, features[test_steps], sigma), true_step)


def fit_cost_model(
    features,
    times,
    *,
    mode: str = "auto",
    holdout: float = 0.25,
    temperature: Optional[float] = None,
    robust: bool = True,
    seed: int = 0,
    prior: Optional[CostModel] = None,
    prior_strength: Optional[float] = None,
    step_noise: bool = True,
) -> FitResult:
    """Fit a non-negative `CostModel` to measured times.

    features: `[steps, ranks, 4]` rows (sum L^2, sum L, n, 1) per rank and step
    (`[steps, 4]` is read as one rank).
    times: `[steps, ranks]` per-rank compute times, or `[steps]` step times
    (the slowest rank).
    mode: `per_rank` (needs 2-D times; `steps*ranks` observations), `step_max`
    (one observation per step: the prediction is a soft-max over ranks, with
    relative `temperature`, annealed 0.1 -> 0.001 when None), or `auto`
    (per-rank when times are 2-D). Per-rank times can also be fitted in
    step-max mode (their max is taken), to compare the two.
    step_noise: in step-max mode, model each rank's time as cost * exp(sigma * z), z ~ N(0, 1), and fit
    the coefficients and sigma by maximum likelihood of the step time as the max over ranks
    (`fit_step_max_noisy`): the noise that makes one of many near-equal ranks the slowest is then not
    read as cost. False: fit the step time to the max of the costs (soft-max), as before.
    holdout: fraction of steps (a seeded random choice) held out to measure R^2
    and MAPE; the returned model is then refitted on all steps.
    robust: Huber loss, then drop observations beyond 4 robust sigmas and refit.
    prior: a `CostModel` whose ratios between its non-zero terms the fit keeps unless the data says
    otherwise (`CostModel.from_config`): each term gets its own non-negative scale, pulled toward one
    common scale with `prior_strength` (`prior_penalty`); terms the prior leaves at 0 are pulled toward 0.
    `prior_strength` None: `STEP_MAX_PRIOR_STRENGTH` for the noise-aware step-max fit, else `PRIOR_STRENGTH`.
    The noise-aware step-max fit uses those rows for its start only and maximises the likelihood with the
    prior as a distribution (`shape_prior`: log ratios with an uncertainty, a per-sample cost priced, the
    constant half-normal); without a prior it keeps the half-normal pulls on per sample and per step.
    Without a prior: four free non-negative coefficients.

    Raises ValueError naming the step / rank / value of bad data, a shape
    mismatch, or fewer observations than the 4 unknowns.
    """
    _check_options(mode, holdout, temperature)
    features, times = _validate(features, times)
    mode, times = _resolve_mode(features, times, mode)
    step_noise = bool(step_noise) and mode == "step_max"
    if prior_strength is None:
        prior_strength = STEP_MAX_PRIOR_STRENGTH if step_noise else PRIOR_STRENGTH
    steps, ranks, _ = features.shape
    test_steps = _holdout_steps(steps, ranks if mode == "per_rank" else 1, holdout, seed)
    r2, mape, step_mape = _heldout_scores(features, times, test_steps, mode, robust, temperature, prior,
                                          prior_strength, step_noise)

    model, inliers, sigma = _fit(features, times, mode, robust, temperature, prior, prior_strength, step_noise)
    pred, true = _targets(model, features, times, mode, sigma)
    keep = inliers.ravel()
    report = FitReport(
        mode=mode,
        r2=r2,
        mape=mape,
        step_mape=step_mape,
        train_r2=_r2(pred[keep], true[keep]),
        train_mape=_mape(pred[keep], true[keep]),
        n_train=steps,
        n_heldout=int(test_steps.size),
        n_observations=int(times.size),
        n_outliers=int((~inliers).sum()),
        outlier_steps=tuple(int(s) for s in np.flatnonzero(~inliers.reshape(steps, -1).all(axis=1))),
        temperature=(temperature if temperature is not None else ANNEAL_TEMPERATURES[-1]) if mode == "step_max" else None,
        prior_scales=None if prior is None else tuple(
            float(c / p) if p > 0 else float("nan") for c, p in zip(model.coefficients, prior.coefficients)),
        step_noise=sigma,
    )
    return FitResult(model=model, report=report)


# --------------------------------------------------------------------------- fitting from training records


# The per-rank fit with the prior as a distribution reads at most this many (step, rank) observations (a seeded
# choice): 2048 single-rank times pin four coefficients many times over, and rank 0 fits while every rank waits.
MAX_RANK_OBSERVATIONS = 2048


def fit_each_rank(features, times, prior: Optional[CostModel] = None, seed: int = 0) -> FitResult:
    """Per-rank times [steps, ranks] of work `features` [steps, ranks, 4], each (step, rank) one observation of
    the noise-aware fit (`fit_step_max_noisy` with one rank: its log-normal noise) around the prior as a
    distribution (`shape_prior`: the prior's quadratic/linear ratio log-normal, sigma 0.5, a per-sample cost it
    does not zero, a half-normal constant). Why not the penalty rows of `fit_cost_model(mode="per_rank")`: at
    strength 0.03 they kept 1.4-1.7x of a prior 2x too high in the quadratic term (0.66-0.79x of 2x too low) on
    FSDP's fixed-length packs, where attention is a few percent of a rank's time (bench/cost_fit_plans.py,
    "unit events"); this fit lands within 8% of the truth there. At most `MAX_RANK_OBSERVATIONS` are read."""
    features = np.asarray(features, dtype=np.float64).reshape(-1, 1, N_FEATURES)
    times = np.asarray(times, dtype=np.float64).reshape(-1)
    if times.size > MAX_RANK_OBSERVATIONS:
        pick = np.sort(np.random.default_rng(seed).choice(times.size, MAX_RANK_OBSERVATIONS, replace=False))
        features, times = features[pick], times[pick]
    return fit_cost_model(features, times, mode="step_max", holdout=0, prior=prior)


def fit_from_records(features, times, mode: str, prior: Optional[CostModel] = None,
                     shape_prior: bool = False, drop_first: bool = True) -> FitResult:
    """Fit the decoder cost model from gathered records: features [steps, ranks, 4], times [steps, ranks].

    The first recorded step is dropped when there are at least 3 (allocator warm-up,
    lazy initialisation; `drop_first=False` keeps it: the caller dropped it); `step_max` fits the slowest
    rank of each step only; `prior` as in `fit_cost_model`; `shape_prior` (per_rank only): every rank's time
    an observation of `fit_each_rank`.
    """
    features = np.asarray(features, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    if drop_first and features.shape[0] >= 3:
        features, times = features[1:], times[1:]
    if mode == "step_max":
        return fit_cost_model(features, times.max(axis=1), mode="step_max", prior=prior)
    if shape_prior:
        return fit_each_rank(features, times, prior)
    return fit_cost_model(features, times, mode="per_rank", prior=prior)


def _stack_micro_batches(features, times) -> Tuple[list, list]:
    """Per step: features [M_s, ranks, 4] and times [M_s, ranks] (or [M_s]) as float64, shapes checked."""
    if len(features) != len(times):
        raise ValueError(f"micro-batch records: {len(features)} steps of features but {len(times)} of times")
    feats, secs = [], []
    for s, (f, t) in enumerate(zip(features, times)):
        f, t = np.asarray(f, dtype=np.float64), np.asarray(t, dtype=np.float64)
        if f.ndim != 3 or f.shape[-1] != N_FEATURES or t.shape[0] != f.shape[0] or t.ndim not in (1, 2) or (
                t.ndim == 2 and t.shape[1] != f.shape[1]) or (feats and f.shape[1] != feats[0].shape[1]):
            raise ValueError(f"micro-batch records of step {s}: features {f.shape} must be "
                             f"[micro, ranks, {N_FEATURES}] "
                             f"and times {t.shape} [micro, ranks] or [micro], with the ranks of every step")
        feats.append(f)
        secs.append(t if t.ndim == 1 else t.max(axis=1))
    return feats, secs


def fit_from_micro_batches(features, times, prior: Optional[CostModel] = None, tail: str = "estimate",
                           drop_first: bool = True) -> FitResult:
    """The step-max fit from synchronised micro-batch times (FSDP / ZeRO-3 with gradient accumulation).

    features: per step [M_s, ranks, 4] (each micro-batch's rows); times: per step [M_s, ranks] or [M_s], the
    wall time of each micro-batch (synchronised at its boundaries; its max over ranks is used). Model: every
    micro-batch synchronises the ranks (the forward all-gathers parameters), so a step takes
    sum_m max_r cost(r, m), and each micro-batch's time is one step-max observation of its own: M observations
    a step instead of one, and the right model (the step's time is not max_r of each rank's sum).
    The first step is dropped when there are 3 or more (as `fit_from_records`; `drop_first=False` keeps it).

    tail: the last micro-batch's interval also holds the step's tail (the gradient reduction left exposed,
    clipping, the optimizer step), which no feature describes. "estimate": fit the other micro-batches, take
    the median excess of the last ones over their predicted time (>= 0), subtract it and refit on all;
    "drop": fit without the last micro-batches (steps of one micro-batch keep theirs); "keep": fit every
    interval as measured (also what the other two do when fewer than 8 micro-batches are left without the
    last ones). Guarantee: coefficients >= 0; with one micro-batch per step it is the step-max fit
    of `fit_from_records` on the same steps."""
    if tail not in ("estimate", "drop", "keep"):
        raise ValueError(f"tail={tail!r}: must be 'estimate', 'drop' or 'keep'")
    feats, secs = _stack_micro_batches(features, times)
    if drop_first and len(feats) >= 3:
        feats, secs = feats[1:], secs[1:]
    if not feats:
        raise ValueError("micro-batch records: no steps")
    last = [len(t) >= 2 for t in secs]  # steps whose last interval holds the tail and something before it
    if tail == "keep" or not any(last):
        return fit_cost_model(np.concatenate(feats), np.concatenate(secs), mode="step_max", prior=prior)
    head_f = np.concatenate([f[:-1] if l else f for f, l in zip(feats, last)])
    head_t = np.concatenate([t[:-1] if l else t for t, l in zip(secs, last)])
    if head_t.size < 2 * N_FEATURES:  # too few to fit without the last micro-batches: keep them as measured
        return fit_cost_model(np.concatenate(feats), np.concatenate(secs), mode="step_max", prior=prior)
    if tail == "drop":
        return fit_cost_model(head_f, head_t, mode="step_max", prior=prior)
    head = fit_cost_model(head_f, head_t, mode="step_max", prior=prior, holdout=0)
    tail_f = np.stack([f[-1] for f, l in zip(feats, last) if l])
    tail_t = np.array([t[-1] for t, l in zip(secs, last) if l])
    excess = max(0.0, float(np.median(tail_t - _predicted_steps(head.model, tail_f, head.report.step_noise))))
    # a tail above the interval's own time would be read as no work at all: keep at least half of it
    cut = [np.concatenate([t[:-1], [max(t[-1] - excess, 0.5 * t[-1])]]) if l else t for t, l in zip(secs, last)]
    return fit_cost_model(np.concatenate(feats), np.concatenate(cut), mode="step_max", prior=prior)


def compute_imbalance(times) -> float:
    """Mean over steps of (slowest rank / mean rank - 1) of a [steps, ranks] time table (NaN if empty)."""
    times = np.asarray(times, dtype=np.float64)
    if times.size == 0:
        return float("nan")
    mean = times.mean(axis=1)
    ok = mean > 0
    if not ok.any():
        return float("nan")
    return float((times.max(axis=1)[ok] / mean[ok] - 1.0).mean())


__all__ = ["FREE_TERM_SHARE", "PRIOR_FREE_TERM_SHARE", "FitReport", "FitResult", "MAX_RANK_OBSERVATIONS", "PER_SAMPLE_SIGMA",
           "PER_SAMPLE_TOKENS", "PRIOR_RATIO_SIGMA", "PRIOR_STRENGTH", "STEP_MAX_PRIOR_STRENGTH", "compute_imbalance",
           "fit_cost_model", "fit_each_rank", "fit_from_micro_batches", "fit_from_records",
           "prior_penalty", "shape_prior"]
