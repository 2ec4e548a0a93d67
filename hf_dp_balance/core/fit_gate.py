"""Whether a new cost model may replace the one in force: judged on steps the new one was not fitted on.

A fit from a short, noisy warm-up can predict worse than the prior it replaces, and a run that adopts it plans
worse from then on. The gate holds out some recorded steps (`heldout_split`), fits the candidate on the others,
and scores the candidate, the model in force and the token count alike on the held-out steps
(`heldout_error`); the candidate is adopted only when its error is below the model in force's by `ADOPT_MARGIN`
(`gate_decision`). The error is the one the planner cares about: after the best non-negative affine
recalibration fitted on the training steps (`calibrated_error`), since neither a common scale nor a per-rank
constant changes a plan, so a FLOP prior (in TFLOPs, no constant) and a fitted model (in seconds) are compared
on their shapes alone. Observations are what was measured: per-rank times, or step times (the slowest rank).

`settled` says when the early refits may stop; `uncertain` when a model's plans are hedged as the prior's are
(`core.hedge`): while it does not explain held-out steps clearly better than the token count does.
Pure numpy: no torch import here.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hf_dp_balance.core.cost import N_FEATURES, CostModel

# A switch must predict the held-out steps this much better (relative) than the model in force: within it, the
# two are alike to the evidence of a few noisy steps (30% rank noise over 3 steps x 4 ranks moves the two errors
# by a few percent either way, tests/core/test_fit_gate.py), and a switch would only churn the plans.
ADOPT_MARGIN = 0.02
# Fraction of the recorded steps held out (at least one when the rest still determine the fit).
HOLDOUT_FRACTION = 0.25
# Folds of the gate's cross-validation (`heldout_folds`): every recorded step is held out once.
MAX_FOLDS = 4
# The candidate's training part keeps at least this many observations per unknown.
MIN_TRAIN_PER_UNKNOWN = 2
# Early refits stop once a fit's held-out error moves by less than this share of the previous one's (or less
# than SETTLE_ABSOLUTE): more warm-up data no longer changes what the model predicts.
SETTLE_RELATIVE = 0.25
SETTLE_ABSOLUTE = 0.01
# A model's plans are hedged while its held-out error is not below this share of the token count's: the
# tokens then remain a plausible cost, and a plan that is exact for the model can be worse than the
# token-balanced one under them.
HEDGE_SHARE = 0.5

TOKENS = CostModel(quadratic=0.0, linear=1.0)
"""The cost the token-balanced plan (fixed-length packing's stand-in) assumes."""


def heldout_split(steps: int, per_step: int, seed: int = 0,
                  fraction: float = HOLDOUT_FRACTION) -> Tuple[np.ndarray, np.ndarray]:
    """(training steps, held-out steps), sorted indices of `steps` recorded steps with `per_step`
    observations each: `fraction` of them held out (a seeded choice, at least one), as long as the training
    steps keep `MIN_TRAIN_PER_UNKNOWN` observations per unknown; else no step is held out (empty)."""
    min_train = -(-MIN_TRAIN_PER_UNKNOWN * N_FEATURES // max(int(per_step), 1))
    n_heldout = min(max(1, int(round(steps * fraction))), steps - min_train)
    if n_heldout < 1:
        return np.arange(steps), np.zeros(0, dtype=np.int64)
    test = np.sort(np.random.default_rng(seed).permutation(steps)[:n_heldout])
    return np.setdiff1d(np.arange(steps), test), test


def _calibration(predicted: np.ndarray, observed: np.ndarray) -> Tuple[float, float]:
    """(a >= 0, b) minimising sum(((a * predicted + b) - observed) / observed)^2: relative least squares."""
    w = 1.0 / observed
    x, y = predicted * w, np.ones_like(observed)  # residual/observed = a*x + b*w - 1
    A = np.stack([x, w], axis=1)
    if A.shape[0] >= 2 and np.linalg.matrix_rank(A) == 2:
        a, b = np.linalg.lstsq(A, y, rcond=None)[0]
        if a >= 0:
            return float(a), float(b)
    # a constant prediction (or a negative slope): the best constant alone
    return 0.0, float(np.sum(w) / np.sum(w * w))


def calibrated_error(predicted_train, observed_train, predicted_test, observed_test) -> float:
    """Mean relative error on the test observations of `a * predicted + b`, (a >= 0, b) fitted on the
    training observations (`_calibration`). NaN without test observations."""
    pt, ot = np.asarray(predicted_train, np.float64).ravel(), np.asarray(observed_train, np.float64).ravel()
    ph, oh = np.asarray(predicted_test, np.float64).ravel(), np.asarray(observed_test, np.float64).ravel()
    if not oh.size or not ot.size:
        return float("nan")
    a, b = _calibration(pt, ot)
    return float(np.mean(np.abs(a * ph + b - oh) / oh))


def predicted_observations(model: CostModel, features: np.ndarray, observed_ndim: int) -> np.ndarray:
    """What `model` predicts for observations of shape [S, R] (per-rank times: `features` [S, R, 4]) or [S]
    (step times: the slowest rank's predicted cost)."""
    predicted = model.predict(features)
    return predicted if observed_ndim == 2 else predicted.max(axis=-1)


def heldout_error(model: CostModel, features: np.ndarray, times: np.ndarray, train: np.ndarray,
                  test: np.ndarray) -> float:
    """`calibrated_error` of `model` on the `test` steps, calibrated on the `train` steps: features
    [S, R, 4], times [S, R] (per-rank) or [S] (step times); NaN without held-out steps."""
    features = np.asarray(features, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    if not len(test):
        return float("nan")
    predicted = predicted_observations(model, features, times.ndim)
    return calibrated_error(predicted[train], times[train], predicted[test], times[test])


class GateDecision(NamedTuple):
    """One gate's verdict: `adopt` the candidate or keep the model in force, with the held-out errors of the
    candidate, the model in force (NaN when none) and the token count, and why."""

    adopt: bool
    candidate_error: float
    in_force_error: float
    tokens_error: float
    reason: str

    def to_dict(self) -> dict:
        return self._asdict()


def gate_decision(candidate_error: float, in_force_error: float, tokens_error: float = float("nan"),
                  has_model_in_force: bool = True) -> GateDecision:
    """Adopt when nothing is in force, else only when the candidate's held-out error is finite and below the
    model in force's by `ADOPT_MARGIN` (relative). Without held-out steps (NaN errors) a model in force stays."""
    if not has_model_in_force:
        return GateDecision(True, candidate_error, in_force_error, tokens_error, "no model in force")
    if not math.isfinite(candidate_error):
        return GateDecision(False, candidate_error, in_force_error, tokens_error,
                            "too few steps to hold one out: the model in force stays")
    if not math.isfinite(in_force_error) or candidate_error <= (1.0 - ADOPT_MARGIN) * in_force_error:
        return GateDecision(True, candidate_error, in_force_error, tokens_error,
                            "predicts the held-out steps better than the model in force")
    return GateDecision(False, candidate_error, in_force_error, tokens_error,
                        "predicts the held-out steps no better than the model in force, which stays")


def heldout_folds(steps: int, per_step: int, seed: int = 0, folds: int = MAX_FOLDS,
                  eligible: Optional[np.ndarray] = None) -> list:
    """[(training steps, held-out steps)] over `steps` recorded steps: the `eligible` steps (None: all) held out
    once each, in up to `folds` groups (a seeded order) of at least `heldout_split`'s size, each fold's training
    steps keeping `MIN_TRAIN_PER_UNKNOWN` observations per unknown (where that caps a group's size, only
    `folds` groups of the eligible steps are held out); [] when no step can be held out."""
    pool = np.arange(steps) if eligible is None else np.asarray(eligible, dtype=np.int64)
    min_train = -(-MIN_TRAIN_PER_UNKNOWN * N_FEATURES // max(int(per_step), 1))
    _, first = heldout_split(steps, per_step, seed)
    size = min(max(len(first), 1, -(-len(pool) // max(int(folds), 1))), steps - min_train)
    if size < 1 or not len(pool):
        return []
    order = np.random.default_rng(seed).permutation(pool)[:size * max(int(folds), 1)]
    out = []
    for start in range(0, len(order), size):
        test = np.sort(order[start:start + size])
        out.append((np.setdiff1d(np.arange(steps), test), test))
    return out


def gate_fit(fit: Callable[[np.ndarray], object], features: np.ndarray, observed: np.ndarray, step_of: np.ndarray,
             n_steps: int, seed: int, in_force: Optional[CostModel], prior_in_force: bool = False,
             unseen: Optional[np.ndarray] = None) -> GateDecision:
    """The gate's verdict on a fit: `fit(step indices)` returns (FitResult, ...) fitted on those steps only;
    `observed` rows (per-rank times [N, R], or step times [N]) of work `features` [N, R, 4], `step_of` the step
    (0 .. n_steps - 1) of each row. Every step is held out once (`heldout_folds`, seeded by `seed`): in each
    fold the candidate fitted without the held-out steps, the model in force and the token count are scored
    on them (`heldout_error`); the errors are the means over the folds, and `gate_decision` rules. With too
    few steps to hold one out: adopted when nothing or only a FLOP prior (`prior_in_force`) is in force
    (unverified: its errors are NaN, so `uncertain` hedges its plans and the next fit is gated), else the
    model in force stays. `unseen`: the steps the model in force was not fitted on (None: every step, as for a
    prior); only they are held out, so both models are scored on steps neither saw."""
    observed = np.asarray(observed, dtype=np.float64)
    step_of = np.asarray(step_of)
    per_step = len(step_of) // max(int(n_steps), 1) * (observed.shape[1] if observed.ndim == 2 else 1)
    folds = heldout_folds(int(n_steps), per_step, seed=seed, eligible=unseen)
    nan = float("nan")
    if not folds:
        if in_force is None or prior_in_force:
            return GateDecision(True, nan, nan, nan, "too few steps to hold one out: adopted unverified, planned hedged")
        return gate_decision(nan, nan, nan)
    sums, count = np.zeros(3), 0
    for train, test in folds:
        rows_train, rows_test = np.flatnonzero(np.isin(step_of, train)), np.flatnonzero(np.isin(step_of, test))
        weight = rows_test.size
        candidate = fit(train)[0].model
        sums += weight * np.array([heldout_error(m, features, observed, rows_train, rows_test) if m is not None
                                   else nan for m in (candidate, in_force, TOKENS)])
        count += weight
    errors = sums / count
    return gate_decision(float(errors[0]), float(errors[1]), float(errors[2]), has_model_in_force=in_force is not None)


def settled(errors: Sequence[float]) -> bool:
    """Whether the last two held-out errors of a model's successive fits agree (`SETTLE_RELATIVE`,
    `SETTLE_ABSOLUTE`): early refits may stop."""
    if len(errors) < 2 or not all(math.isfinite(e) for e in errors[-2:]):
        return False
    previous, last = errors[-2], errors[-1]
    return abs(last - previous) <= max(SETTLE_RELATIVE * previous, SETTLE_ABSOLUTE)


def uncertain(error: Optional[float], tokens_error: Optional[float]) -> bool:
    """Whether a model whose held-out error is `error` is planned hedged: its error is unknown, or not below
    `HEDGE_SHARE` of the token count's (`tokens_error`) on the same steps."""
    if error is None or tokens_error is None or not math.isfinite(error):
        return True
    if not math.isfinite(tokens_error):
        return True
    return error >= HEDGE_SHARE * tokens_error


def next_fit_step(step: int, warmup: int, refit_every: int, is_settled: bool,
                  has_fitted_model: bool) -> Optional[int]:
    """The step of the next fit after one at `step` (None: no more). While the held-out error has not settled
    (or no fitted model is in force: the fit was rejected or failed), the next of 2x, 4x, 8x ... the warm-up
    after `step`, never later than `refit_every` steps on; once settled, or where `refit_every` is at most the
    warm-up (regular refits already as frequent), `refit_every` steps on. `refit_every` 0 (no refits) still
    retries a rejected or failed first fit on the early schedule."""
    early = 2 * max(int(warmup), 1)
    while early <= step:
        early *= 2
    if refit_every <= 0:
        return None if has_fitted_model else early
    if (is_settled and has_fitted_model) or refit_every <= warmup:
        return step + refit_every
    return min(early, step + refit_every)


__all__ = ["ADOPT_MARGIN", "GateDecision", "HEDGE_SHARE", "HOLDOUT_FRACTION", "MIN_TRAIN_PER_UNKNOWN", "SETTLE_ABSOLUTE",
           "SETTLE_RELATIVE", "MAX_FOLDS", "TOKENS", "calibrated_error", "gate_decision", "gate_fit", "heldout_error", "heldout_folds",
           "heldout_split", "next_fit_step",
           "predicted_observations", "settled", "uncertain"]
