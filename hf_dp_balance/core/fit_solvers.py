"""The solvers behind `fit_cost_model`: non-negative, relative-residual, robust fits of a `CostModel`.

`fit_per_rank`: one observation per rank and step (NNLS, Huber, inlier refit).
`fit_step_max`: one observation per step, the slowest rank, through a soft-max
over ranks whose temperature is annealed towards the max. Inputs are feature
rows already scaled per column (`column_scale`); outputs are scaled
coefficients >= 0 and the inlier mask. The method: docs/cost_model.md.
"""

from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from hf_dp_balance.core.cost import N_FEATURES

# Relative soft-max temperatures of the step-max fit, coarse to fine: a high
# temperature makes the landscape smooth for the first solves, the last one is
# close to the true max (bias <= temperature * log(ranks) relative).
ANNEAL_TEMPERATURES = (0.1, 0.03, 0.01, 0.003, 0.001)
# Outliers: relative residual beyond this many robust sigmas (1.4826 * MAD).
_OUTLIER_SIGMAS = 4.0
# Floor of the robust residual scale: timings never repeat better than ~1%,
# and a noise-free fit must not flag every observation as an outlier.
_MIN_RELATIVE_SCALE = 0.01


def column_scale(x: np.ndarray) -> np.ndarray:
    """Root mean square of each feature column (1 where a column is all zero)."""
    flat = x.reshape(-1, N_FEATURES)
    rms = np.sqrt(np.mean(flat * flat, axis=0))
    return np.where(rms > 0, rms, 1.0)


def _robust_scale(residuals: np.ndarray) -> float:
    """1.4826 * median absolute deviation, floored at `_MIN_RELATIVE_SCALE`."""
    if residuals.size == 0:
        return _MIN_RELATIVE_SCALE
    mad = np.median(np.abs(residuals - np.median(residuals)))
    return max(1.4826 * float(mad), _MIN_RELATIVE_SCALE)


def _nnls_penalised(a: np.ndarray, b: np.ndarray, penalty: Optional[np.ndarray]) -> np.ndarray:
    """argmin ||a t - b||^2 + ||penalty t||^2 over t >= 0 (penalty rows: target 0)."""
    from scipy.optimize import nnls

    if penalty is not None and penalty.size:
        a = np.vstack([a, penalty])
        b = np.concatenate([b, np.zeros(penalty.shape[0])])
    return nnls(a, b)[0]


def fit_per_rank(x: np.ndarray, y: np.ndarray, robust: bool,
                 penalty: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Non-negative fit of y ~ x @ theta minimising relative residuals (x already scaled).

    x [m, 4], y [m]. NNLS start; then Huber (bounded least_squares) and a
    refit on the observations whose relative residual is within
    `_OUTLIER_SIGMAS` robust sigmas. `penalty` [p, 4]: extra residual rows
    `penalty @ theta` (a prior's pull, never outliers). Returns (theta, inlier mask).
    """
    from scipy.optimize import least_squares

    penalty = np.zeros((0, N_FEATURES)) if penalty is None else penalty
    a = x / y[:, None]
    ones = np.ones_like(y)
    theta = _nnls_penalised(a, ones, penalty)
    inliers = np.ones(y.shape, dtype=bool)
    if not robust:
        return theta, inliers
    scale = _robust_scale(a @ theta - 1.0)
    huber = least_squares(
        lambda t: np.concatenate([a @ t - 1.0, penalty @ t]), np.maximum(theta, 1e-12),
        jac=lambda t: np.vstack([a, penalty]), bounds=(0.0, np.inf), loss="huber", f_scale=scale, method="trf",
    )
    theta = huber.x
    residual = a @ theta - 1.0
    scale = _robust_scale(residual)
    inliers = np.abs(residual - np.median(residual)) <= _OUTLIER_SIGMAS * scale
    if inliers.sum() >= N_FEATURES and not inliers.all():
        theta = _nnls_penalised(a[inliers], ones[inliers], penalty)
    else:
        inliers[:] = True
        theta = _nnls_penalised(a, ones, penalty)
    return theta, inliers


def _soft_max(c: np.ndarray, tau: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """tau * log sum_r exp(c_r / tau) per step and its weights (softmax), c [S, R], tau [S]."""
    z = c / tau[:, None]
    zmax = z.max(axis=1, keepdims=True)
    e = np.exp(z - zmax)
    total = e.sum(axis=1, keepdims=True)
    value = tau * (zmax[:, 0] + np.log(total[:, 0]))
    return value, e / total


def _step_max_solve(x: np.ndarray, y: np.ndarray, theta0: np.ndarray, temperatures, loss: str, scale: float,
                    penalty: np.ndarray) -> np.ndarray:
    """Bounded least squares of relative residuals softmax_tau(x @ theta)/y - 1 (and the penalty rows
    penalty @ theta), annealing tau."""
    from scipy.optimize import least_squares

    theta = np.maximum(theta0, 1e-12)
    for temp in temperatures:
        tau = temp * y

        def residual(t, tau=tau):
            value, _ = _soft_max(x @ t, tau)
            return np.concatenate([value / y - 1.0, penalty @ t])

        def jacobian(t, tau=tau):
            _, w = _soft_max(x @ t, tau)
            return np.vstack([np.einsum("sr,srk->sk", w, x) / y[:, None], penalty])

        theta = least_squares(residual, theta, jac=jacobian, bounds=(0.0, np.inf), loss=loss, f_scale=scale, method="trf").x
        theta = np.maximum(theta, 1e-15)  # trf wants a strictly feasible start for the next temperature
    return theta


def fit_step_max(x: np.ndarray, y: np.ndarray, robust: bool, temperature: Optional[float],
                 penalty: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Non-negative fit of step times y [S] ~ max_r x[S, r] @ theta (x scaled), via a soft-max.

    Start: alternate "which rank is the slowest under theta" and NNLS on those
    ranks' rows (a few rounds). Then bounded least squares through a soft-max
    whose temperature is relative to each step's time, annealed towards the
    max; Huber and an inlier refit as in the per-rank fit. `penalty` as in `fit_per_rank`.
    """
    penalty = np.zeros((0, N_FEATURES)) if penalty is None else penalty
    ones = np.ones_like(y)
    theta = _nnls_penalised(x.mean(axis=1) / y[:, None], ones, penalty)  # the mean rank: underestimates
    for _ in range(8):
        slowest = np.argmax(x @ theta, axis=1)
        rows = x[np.arange(len(y)), slowest]
        new = _nnls_penalised(rows / y[:, None], ones, penalty)
        if np.allclose(new, theta, rtol=1e-6, atol=1e-12):
            break
        theta = new
    temps = (temperature,) if temperature is not None else ANNEAL_TEMPERATURES
    inliers = np.ones(y.shape, dtype=bool)
    if not robust:
        return _step_max_solve(x, y, theta, temps, "linear", 1.0, penalty), inliers
    slowest_value = (x @ theta).max(axis=1)
    scale = _robust_scale(slowest_value / y - 1.0)
    theta = _step_max_solve(x, y, theta, temps, "huber", scale, penalty)
    value, _ = _soft_max(x @ theta, temps[-1] * y)
    residual = value / y - 1.0
    scale = _robust_scale(residual)
    inliers = np.abs(residual - np.median(residual)) <= _OUTLIER_SIGMAS * scale
    if inliers.sum() >= N_FEATURES and not inliers.all():
        theta = _step_max_solve(x[inliers], y[inliers], theta, temps[-1:], "linear", 1.0, penalty)
    else:
        inliers[:] = True
        theta = _step_max_solve(x, y, theta, temps[-1:], "linear", 1.0, penalty)
    return theta, inliers


__all__ = ["ANNEAL_TEMPERATURES", "column_scale", "fit_per_rank", "fit_step_max"]
