"""The solvers behind `fit_cost_model`: non-negative, relative-residual, robust fits of a `CostModel`.

`fit_per_rank`: one observation per rank and step (NNLS, Huber, inlier refit).
`fit_step_max`: one observation per step, the slowest rank, through a soft-max
over ranks whose temperature is annealed towards the max. `fit_step_max_noisy`:
the same start and inliers, then the maximum-likelihood fit of the step time as
the max over ranks of noisy rank times (`step_max_likelihood`), which estimates
the noise and so removes the bias of E[max] from the coefficients; with a `ShapePrior` it is the
posterior mode instead (the prior as log-normal ratios and half-normal free terms). Inputs are
feature rows already scaled per column (`column_scale`); outputs are scaled
coefficients >= 0 and the inlier mask. The method: docs/cost_model.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
# Bounds of the noise-aware step-max fit's relative rank noise sigma: the lower one keeps the
# likelihood finite on noise-free times (its bias, ~sigma * E[max of R normals], is then < 0.1%).
_MIN_NOISE, _MAX_NOISE = 1e-4, 1.0
# Residual degrees of freedom (steps minus those spent on the coefficients) below which the noise cannot
# be estimated: the noise-aware fit then keeps the soft-max fit (measured: 4 steps of real CPU timings
# without a prior, 22.5% step MAPE with a noise estimate, 18.9% without).
_MIN_NOISE_DOF = 2.0
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def column_scale(x: np.ndarray) -> np.ndarray:
    """Root mean square of each feature column (1 where a column is all zero)."""
    flat = x.reshape(-1, N_FEATURES)
    rms = np.sqrt(np.mean(flat * flat, axis=0))
    return np.where(rms > 0, rms, 1.0)


def _residual_scale(residuals: np.ndarray) -> float:
    """1.4826 * median absolute deviation (0 for no residuals): a normal's sigma, robust to outliers."""
    if residuals.size == 0:
        return 0.0
    return 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))


def _robust_scale(residuals: np.ndarray) -> float:
    """`_residual_scale`, floored at `_MIN_RELATIVE_SCALE`."""
    return max(_residual_scale(residuals), _MIN_RELATIVE_SCALE)


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


# --------------------------------------------------------------------------- step max of noisy ranks


def step_max_likelihood(params: np.ndarray, x: np.ndarray, log_y: np.ndarray, penalty: np.ndarray,
                        penalty_scale: float) -> Tuple[float, np.ndarray]:
    """Negative log-likelihood (and its gradient) of step times as the max over ranks of noisy rank times.

    Model: rank r of step s takes c_sr * exp(sigma * z_sr), c_sr = x_sr @ theta, z_sr ~ N(0, 1) independent;
    the step time y_s is their max. With u = log y and z_sr = (u_s - log c_sr) / sigma, the density of u_s is
    sum_r phi(z_sr) / sigma * prod_{j != r} Phi(z_sj): one rank is the slowest, all others finish at or
    before it (so every rank, not only the slowest, informs the fit). params = (theta [4], log sigma).
    The prior's rows add ||penalty @ theta||^2 / (2 penalty_scale^2): relative residuals of that scale,
    as in the least-squares fits. numpy / scipy; stable in log space (log_ndtr) for any z.
    """
    from scipy.special import log_ndtr

    theta, log_sigma = params[:N_FEATURES], float(params[N_FEATURES])
    sigma = math.exp(log_sigma)
    c = np.maximum(x @ theta, 1e-12 * np.exp(log_y)[:, None])  # a rank of ~no cost: never the slowest
    z = (log_y[:, None] - np.log(c)) / sigma
    log_cdf = log_ndtr(z)
    log_mills = -0.5 * z * z - _LOG_SQRT_2PI - log_cdf  # log(phi / Phi)
    top = log_mills.max(axis=1, keepdims=True)
    e = np.exp(log_mills - top)
    total = e.sum(axis=1, keepdims=True)
    loglik = top[:, 0] + np.log(total[:, 0]) + log_cdf.sum(axis=1) - log_sigma
    mills = np.exp(log_mills)
    dz = (e / total) * (-z - mills) + mills  # d loglik_s / d z_sr
    grad_theta = np.einsum("sr,srk->k", dz / (sigma * c), x)  # dz/dtheta = -x / (sigma c): signs folded
    grad_log_sigma = float(np.sum(dz * z)) + log_y.size
    pull = penalty @ theta
    value = -float(loglik.sum()) + 0.5 * float(pull @ pull) / penalty_scale ** 2
    grad = np.concatenate([grad_theta + penalty.T @ pull / penalty_scale ** 2, [grad_log_sigma]])
    return value, grad


@dataclass(frozen=True)
class ShapePrior:
    """A prior on the shape of the scaled coefficients theta, in log-likelihood units (a MAP term).

    Each priced term k (a FLOP prior's non-zero ones) has log(theta_k / theta_main) ~ N(log_ratios[k], ratio_sigma^2):
    the prior says how attention compares to dense work, with an uncertainty, and never the unit. Each free term
    (the ones the prior does not price: per sample, per step) has theta_k ~ half-normal(free_sigma): a term's RMS
    contribution in seconds is seldom more than a few `free_sigma`, and the data decides below that (a pull of
    strength 1/free_sigma^2, not a zeroing one). Built by `core.fitting.shape_prior`.
    """

    pairs: Tuple[Tuple[int, int], ...]  # (k, main) for every priced term k != main
    log_ratios: Tuple[float, ...]  # the prior's log(theta_k / theta_main), one per pair
    ratio_sigmas: Tuple[float, ...]  # one per pair
    free: Tuple[int, ...]
    free_sigma: float

    def value(self, theta: np.ndarray) -> Tuple[float, np.ndarray]:
        """Negative log prior (up to a constant) and its gradient in theta (priced terms need theta > 0)."""
        value, grad = 0.0, np.zeros(N_FEATURES)
        for (k, main), mu, sigma in zip(self.pairs, self.log_ratios, self.ratio_sigmas):
            r = (math.log(theta[k]) - math.log(theta[main]) - mu) / sigma
            value += 0.5 * r * r
            grad[k] += r / (sigma * theta[k])
            grad[main] -= r / (sigma * theta[main])
        for k in self.free:
            r = theta[k] / self.free_sigma
            value += 0.5 * r * r
            grad[k] += r / self.free_sigma
        return value, grad

    def rows(self, theta: np.ndarray, free: bool = True) -> np.ndarray:
        """Penalty rows [p, 4] whose squared norm is the prior's curvature at theta (Gauss-Newton);
        `free` False: the priced terms' rows only."""
        rows = []
        for (k, main), sigma in zip(self.pairs, self.ratio_sigmas):
            row = np.zeros(N_FEATURES)
            row[k], row[main] = 1.0 / (sigma * theta[k]), -1.0 / (sigma * theta[main])
            rows.append(row)
        for k in self.free if free else ():
            row = np.zeros(N_FEATURES)
            row[k] = 1.0 / self.free_sigma
            rows.append(row)
        return np.array(rows) if rows else np.zeros((0, N_FEATURES))

    @property
    def priced(self) -> Tuple[int, ...]:
        return tuple(sorted({k for pair in self.pairs for k in pair}))


def _effective_parameters(x: np.ndarray, y: np.ndarray, theta: np.ndarray, penalty: np.ndarray,
                          temperature: float) -> float:
    """Degrees of freedom the data spends on theta: trace of the penalised hat matrix of the soft-max
    step fit, tr(J'J (J'J + P'P)^-1), J the Jacobian of the relative residuals (between 0 and 4)."""
    _, weights = _soft_max(x @ theta, temperature * y)
    jac = np.einsum("sr,srk->sk", weights, x) / y[:, None]
    info = jac.T @ jac
    return float(np.trace(info @ np.linalg.pinv(info + penalty.T @ penalty)))


def _posterior(params: np.ndarray, x: np.ndarray, log_y: np.ndarray, penalty: np.ndarray, penalty_scale: float,
               shape: Optional[ShapePrior]) -> Tuple[float, np.ndarray]:
    """`step_max_likelihood` plus the shape prior's negative log density (when there is one)."""
    value, grad = step_max_likelihood(params, x, log_y, penalty, penalty_scale)
    if shape is not None:
        extra, extra_grad = shape.value(params[:N_FEATURES])
        value, grad = value + extra, grad + np.concatenate([extra_grad, [0.0]])
    return value, grad


def _max_likelihood(x: np.ndarray, y: np.ndarray, theta0: np.ndarray, log_sigma0: float, penalty: np.ndarray,
                    penalty_scale: float, sigma_bounds: Tuple[float, float],
                    shape: Optional[ShapePrior] = None) -> Tuple[np.ndarray, float, float]:
    """argmin of `_posterior` over theta >= 0 and sigma in sigma_bounds (L-BFGS-B): (theta, sigma, objective).
    The shape prior's priced terms stay above 1e-9 of the largest start coefficient (their log is taken)."""
    from scipy.optimize import minimize

    lo, hi = math.log(sigma_bounds[0]), math.log(sigma_bounds[1])
    floor = 1e-9 * max(float(np.max(theta0)), 1e-300)
    priced = shape.priced if shape is not None else ()
    lower = [floor if k in priced else 0.0 for k in range(N_FEATURES)]
    start = np.concatenate([np.maximum(theta0, np.maximum(lower, 1e-12)), [min(max(log_sigma0, lo), hi)]])
    result = minimize(_posterior, start, args=(x, np.log(y), penalty, penalty_scale, shape), jac=True,
                      method="L-BFGS-B", bounds=[(b, None) for b in lower] + [(lo, hi)],
                      # tight: near the noise floor the likelihood is steep, and L-BFGS-B's default stop on a
                      # small relative reduction left a noise-free fit 10% off after 11 iterations
                      options={"maxiter": 1000, "ftol": 1e-14, "gtol": 1e-12})
    return np.maximum(result.x[:N_FEATURES], 0.0), math.exp(float(result.x[N_FEATURES])), float(result.fun)


# Shares of the attention term's cost on the slowest ranks that `ridge_starts` moves to the per-sample term.
RIDGE_SHARES = (0.25, 0.5)


def ridge_starts(x: np.ndarray, theta: np.ndarray, shares=RIDGE_SHARES) -> list:
    """Starts [4] along the attention / per-sample ridge of fixed-length packs from theta (scaled coefficients):
    for each share f, the quadratic term cut by f and the per-sample term raised by what that removed from the
    predicted slowest rank of each step (on average), so the step maxima stay about where theta put them.
    Why: in equal-token packs a rank of many samples is a rank of short ones, so a slow step is explained about
    as well by more attention as by more per-sample work, and a local search from a start on one side of that
    ridge stays there (measured: bench/cost_fit_runtime.py, 128 ranks, a start at the truth reached a higher
    posterior than both default starts). Empty when theta has no attention or the steps no samples."""
    slowest = np.argmax(x @ theta, axis=1)
    rows = x[np.arange(x.shape[0]), slowest]  # [S, 4]
    samples = float(rows[:, 2].mean())
    if theta[0] <= 0 or samples <= 0:
        return []
    attention = float(rows[:, 0].mean()) * theta[0]
    out = []
    for f in shares:
        start = theta.copy()
        start[0] *= 1.0 - f
        start[2] += f * attention / samples
        out.append(start)
    return out


def fit_step_max_noisy(x: np.ndarray, y: np.ndarray, robust: bool, temperature: Optional[float],
                       penalty: Optional[np.ndarray] = None,
                       shape: Optional[ShapePrior] = None) -> Tuple[np.ndarray, np.ndarray, Optional[float]]:
    """Step-max fit that models the rank noise: y_s = max_r c_sr * exp(sigma * z_sr), returns (theta, inliers, sigma).

    Why: the slowest of R ranks of near-equal work is the one with the largest noise draw, so E[y_s] is
    about max_r c_sr * (1 + sigma * E[max of R normals]) (+8% at 128 ranks and 3% noise); a fit of y_s to
    max_r c_sr puts that bias into the coefficients. Here `fit_step_max` gives the start and the inliers,
    then theta and sigma maximise the likelihood of the max (`step_max_likelihood`); sigma is widened by
    sqrt(n / (n - p)) for the p degrees of freedom the fit spent on theta (as the residual variance of a
    regression is), and theta is refitted at that sigma. With fewer than `_MIN_NOISE_DOF` steps left over
    the noise is not estimable: the soft-max fit is returned, sigma None. Guarantee: theta >= 0; on
    noise-free times sigma goes to its floor and the max of the fitted costs matches the step times
    (bias < 0.1%).

    `shape`: a `ShapePrior` that the likelihood is maximised with (a posterior mode) instead of the penalty
    rows, which then only shape the start. Two starts, the soft-max fit with the penalty rows and the one
    without: a start held at the prior's shape sits in that shape's basin when the data says otherwise, so
    the higher posterior of the two wins; with a prior also `ridge_starts` from the first (attention traded for
    per-sample work at equal step maxima), the highest posterior of the four winning. The noise starts at the
    soft-max fit's residual scale floored at 1%; where the soft-max fit matches the step times closer than that,
    its own residual scale is a further start from the soft-max fit (on noise-free times it is the one that
    gives back the truth).
    """
    penalty = np.zeros((0, N_FEATURES)) if penalty is None else penalty
    theta, inliers = fit_step_max(x, y, robust, temperature, penalty)
    x, y = x[inliers], y[inliers]
    temp = temperature if temperature is not None else ANNEAL_TEMPERATURES[-1]
    value, _ = _soft_max(x @ theta, temp * y)
    own_scale = _residual_scale(value / y - 1.0)
    spread = max(own_scale, _MIN_RELATIVE_SCALE)  # the residual scale the least-squares fit saw (`_robust_scale`)
    likelihood_rows = penalty if shape is None else np.zeros((0, N_FEATURES))
    starts = [theta]
    if shape is not None and shape.pairs:  # the prior-free start (without a prior: the same fit again)
        starts.append(fit_step_max(x, y, False, temperature)[0])
        # with a prior, starts along the attention / per-sample ridge too (without a prior they cost a cell of
        # bench/cost_fit.py --plans 30 points)
        starts += ridge_starts(x, theta)
        # in the units of the relative residuals (variance spread^2 each in the likelihood); the weak pulls
        # on the free terms regularise, they do not free degrees of freedom for the noise estimate
        info_rows = spread * shape.rows(np.maximum(theta, 1e-9 * max(float(theta.max()), 1e-300)), free=False)
    else:
        info_rows = penalty
    if y.size - _effective_parameters(x, y, theta, info_rows, temp) < _MIN_NOISE_DOF:
        return theta, inliers, None
    # Noise starts: the least-squares fit's residual scale (floored at 1%, as its outlier test is) for every start,
    # and for the soft-max fit also its own residual scale where that is below: started at 1% on (nearly)
    # noise-free times, theta walks toward the optimum at that noise (a constant 6% low in the 64-rank case of
    # tests/core/test_fit_solvers.py) before sigma shrinks and lands in another basin (4.3% off, 26 nats below
    # the truth). A low start alone lost 2 of 60 low-noise fits to a worse basin: the higher posterior decides.
    pairs = [(start, spread) for start in starts]
    own = min(max(own_scale, _MIN_NOISE), _MAX_NOISE)
    if own < spread:
        pairs.append((starts[0], own))
    best = None
    for start, noise in pairs:
        fitted = _max_likelihood(x, y, start, math.log(noise), likelihood_rows, spread, (_MIN_NOISE, _MAX_NOISE), shape)
        if best is None or fitted[2] < best[2]:
            best = fitted
    theta, sigma, _ = best
    if shape is not None:
        info_rows = spread * shape.rows(np.maximum(theta, 1e-9 * max(float(theta.max()), 1e-300)), free=False)
    spent = _effective_parameters(x, y, theta, info_rows, temp)
    widened = min(max(sigma * math.sqrt(y.size / max(y.size - spent, 1.0)), _MIN_NOISE), _MAX_NOISE)
    theta, sigma, _ = _max_likelihood(x, y, theta, math.log(widened), likelihood_rows, spread, (widened, widened), shape)
    return theta, inliers, sigma


def expected_step_max(costs: np.ndarray, sigma: float, points: int = 257) -> np.ndarray:
    """E[max_r c_r * exp(sigma * z_r)] per step, costs [S, R] >= 0, z_r ~ N(0, 1) independent.

    The step time the noise-aware fit predicts. With U = log of the max, P(U <= u) = prod_r Phi((u - log c_r)
    / sigma), and E[e^U] = e^lo + integral_lo^hi e^u (1 - P(U <= u)) du over lo, hi = max_r log c_r -/+ 8 sigma
    (the mass outside is < 1e-14 per rank), trapezoidal on `points` nodes. sigma = 0: the max.
    """
    from scipy.special import log_ndtr

    costs = np.asarray(costs, dtype=np.float64)
    top = costs.max(axis=-1)
    if sigma <= 0:
        return top
    log_c = np.log(np.maximum(costs, 1e-300))
    grid = np.log(np.maximum(top, 1e-300))[..., None] + sigma * np.linspace(-8.0, 8.0, points)  # [S, G]
    log_cdf = log_ndtr((grid[..., :, None] - log_c[..., None, :]) / sigma).sum(axis=-1)  # [S, G]
    tail = np.exp(grid) * -np.expm1(log_cdf)
    return np.exp(grid[..., 0]) + np.trapezoid(tail, grid, axis=-1)


__all__ = ["ANNEAL_TEMPERATURES", "ShapePrior", "column_scale", "expected_step_max", "fit_per_rank", "fit_step_max",
           "fit_step_max_noisy", "step_max_likelihood"]
