"""Compute cost model of one rank's work, and its fitting from real timings.

Cost model (one instance per module: the decoder over sample lengths, the
vision encoder over images with L = patches of an image)::

    cost(items) = quadratic * sum(L^2) + linear * sum(L) + per_sample * n + constant

`quadratic` is attention (causal: ~6 * d_model * layers FLOPs per L^2),
`linear` the dense layers (~6 * parameters FLOPs per token), `per_sample` the
per-segment overhead (kernel launches, varlen bookkeeping), `constant` the
per-step overhead. The feature row of one rank is `(sum L^2, sum L, n, 1)`,
so a rank's cost is a dot product and the planner can treat every item's cost
`quadratic*L^2 + linear*L + per_sample` as additive.

Fitting (`fit_cost_model`) takes per-rank times (`ranks` observations per
step: clean when the timed region holds no collective) or only step times (the
slowest rank: one observation per step, fitted through a smooth soft-max over
ranks). All coefficients are non-negative; features are scaled per column for
conditioning; residuals are relative (the planner cares about ratios, and
timings are heteroscedastic), Huber-weighted, then outliers beyond a robust
threshold are dropped and the fit is redone on the inliers.

Pure numpy / scipy: no torch import here.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

N_FEATURES = 4
FEATURE_NAMES = ("sum_L2", "sum_L", "n", "one")
_COEFF_NAMES = ("quadratic", "linear", "per_sample", "constant")
_MODES = ("auto", "per_rank", "step_max")

# Relative soft-max temperatures of the step-max fit, coarse to fine: a high
# temperature makes the landscape smooth for the first solves, the last one is
# close to the true max (bias <= temperature * log(ranks) relative).
_ANNEAL_TEMPERATURES = (0.1, 0.03, 0.01, 0.003, 0.001)
# Outliers: relative residual beyond this many robust sigmas (1.4826 * MAD).
_OUTLIER_SIGMAS = 4.0
# Floor of the robust residual scale: timings never repeat better than ~1%,
# and a noise-free fit must not flag every observation as an outlier.
_MIN_RELATIVE_SCALE = 0.01


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class CostModel:
    """cost = quadratic*sum(L^2) + linear*sum(L) + per_sample*n + constant (all >= 0).

    Units are whatever the model was fitted in (seconds for a fitted model;
    TFLOPs for the FLOP-shaped priors `default_decoder` / `default_vision`).
    Only ratios matter to the planner.
    """

    quadratic: float
    linear: float
    per_sample: float = 0.0
    constant: float = 0.0

    def __post_init__(self) -> None:
        for name in _COEFF_NAMES:
            value = getattr(self, name)
            if not isinstance(value, (int, float, np.floating, np.integer)) or not math.isfinite(float(value)) or value < 0:
                raise ValueError(f"CostModel.{name}={value!r}: must be a finite number >= 0")
            object.__setattr__(self, name, float(value))

    # -- evaluation -------------------------------------------------------------

    @property
    def coefficients(self) -> np.ndarray:
        """(quadratic, linear, per_sample, constant) as float64, in feature order."""
        return np.array([self.quadratic, self.linear, self.per_sample, self.constant], dtype=np.float64)

    def sample_costs(self, lengths) -> np.ndarray:
        """Additive cost of each item: quadratic*L^2 + linear*L + per_sample (float64, same shape)."""
        lengths = _as_lengths(lengths, "lengths")
        return self.quadratic * lengths * lengths + self.linear * lengths + self.per_sample

    def predict(self, features) -> np.ndarray:
        """Cost of feature rows `[..., 4]` = (sum L^2, sum L, n, 1); returns shape `[...]`."""
        features = np.asarray(features, dtype=np.float64)
        if features.ndim == 0 or features.shape[-1] != N_FEATURES:
            raise ValueError(f"features must have a last axis of {N_FEATURES} {FEATURE_NAMES}, got shape {features.shape}")
        return features @ self.coefficients

    def step_cost(self, lengths) -> float:
        """Cost of one rank holding items of these lengths (including the constant)."""
        return float(self.predict(features_of(lengths)))

    def step_time(self, features) -> np.ndarray:
        """Step time of feature blocks `[..., ranks, 4]`: the slowest rank, shape `[...]`."""
        return self.predict(features).max(axis=-1)

    # -- priors -----------------------------------------------------------------

    @classmethod
    def from_flops(cls, params: float, hidden_size: int, num_layers: int, *, causal: bool = True) -> "CostModel":
        """FLOP-shaped prior in TFLOPs (forward + backward = 3x forward).

        Dense layers: 6 * params per token. Attention per layer, forward:
        2*L^2*d (QK^T) + 2*L^2*d (AV); x3 for backward; causal halves it:
        6*d per L^2 per layer causal, 12*d bidirectional.
        """
        if params <= 0 or hidden_size <= 0 or num_layers <= 0:
            raise ValueError(f"from_flops: params, hidden_size, num_layers must be > 0, got {params}, {hidden_size}, {num_layers}")
        per_l2 = (6.0 if causal else 12.0) * hidden_size * num_layers
        return cls(quadratic=per_l2 / 1e12, linear=6.0 * params / 1e12, per_sample=0.0, constant=0.0)

    @classmethod
    def default_decoder(cls) -> "CostModel":
        """Prior before fitting: a 7B decoder (d=4096, 32 layers, causal); attention equals the
        dense layers near L = 53K tokens."""
        return cls.from_flops(7e9, 4096, 32, causal=True)

    @classmethod
    def default_vision(cls) -> "CostModel":
        """Prior before fitting: the Qwen2-VL ViT (675M params, d=1280, 32 layers, full attention
        per image); cost = a*patches^2 + b*patches, equal near 8.2K patches."""
        return cls.from_flops(675e6, 1280, 32, causal=False)

    # -- serialisation ----------------------------------------------------------

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in _COEFF_NAMES}

    @classmethod
    def from_dict(cls, d) -> "CostModel":
        if not isinstance(d, dict):
            raise ValueError(f"CostModel.from_dict: expected a dict, got {type(d).__name__}")
        missing = [k for k in ("quadratic", "linear") if k not in d]
        unknown = sorted(set(d) - set(_COEFF_NAMES))
        if missing or unknown:
            raise ValueError(f"CostModel.from_dict: missing keys {missing}, unknown keys {unknown}")
        return cls(**{k: d[k] for k in _COEFF_NAMES if k in d})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        data = json.loads(text)
        # A file written by `hf-dp-balance fit` holds {"model": {...}, "report": {...}}.
        if isinstance(data, dict) and "model" in data and isinstance(data["model"], dict):
            data = data["model"]
        return cls.from_dict(data)

    def save(self, path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path) -> "CostModel":
        with open(path, "r", encoding="utf-8") as f:
            return cls.from_json(f.read())


def _as_lengths(lengths, what: str) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr < 0)):
        bad = int(np.flatnonzero(~(np.isfinite(arr.ravel()) & (arr.ravel() >= 0)))[0])
        raise ValueError(f"{what}[{bad}]={float(arr.ravel()[bad])!r}: lengths must be finite and >= 0")
    return arr


def features_of(lengths) -> np.ndarray:
    """Feature row (sum L^2, sum L, n, 1) of one rank's items (float64, shape [4])."""
    lengths = _as_lengths(lengths, "lengths").ravel()
    return np.array([np.dot(lengths, lengths), lengths.sum(), float(lengths.size), 1.0], dtype=np.float64)


def features_of_ranks(lengths_per_rank: Sequence) -> np.ndarray:
    """Feature rows `[ranks, 4]` from one list of item lengths per rank."""
    return np.stack([features_of(x) for x in lengths_per_rank]) if len(lengths_per_rank) else np.zeros((0, N_FEATURES))


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class FitReport:
    """How well the fitted model predicts.

    `r2` / `mape` are on held-out steps (model fitted on the other steps;
    NaN when too few steps to hold any out), in the fitted mode's target:
    per-rank times for `per_rank`, step times (slowest rank) for `step_max`.
    `step_mape` is always on held-out step times (max over ranks).
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

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["outlier_steps"] = list(self.outlier_steps)
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


def _column_scale(x: np.ndarray) -> np.ndarray:
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


def _fit_per_rank(x: np.ndarray, y: np.ndarray, robust: bool) -> Tuple[np.ndarray, np.ndarray]:
    """Non-negative fit of y ~ x @ theta minimising relative residuals (x already scaled).

    x [m, 4], y [m]. NNLS start; then Huber (bounded least_squares) and a
    refit on the observations whose relative residual is within
    `_OUTLIER_SIGMAS` robust sigmas. Returns (theta, inlier mask).
    """
    from scipy.optimize import least_squares, nnls

    a = x / y[:, None]
    ones = np.ones_like(y)
    theta, _ = nnls(a, ones)
    inliers = np.ones(y.shape, dtype=bool)
    if not robust:
        return theta, inliers
    scale = _robust_scale(a @ theta - 1.0)
    huber = least_squares(
        lambda t: a @ t - 1.0, np.maximum(theta, 1e-12), jac=lambda t: a, bounds=(0.0, np.inf),
        loss="huber", f_scale=scale, method="trf",
    )
    theta = huber.x
    residual = a @ theta - 1.0
    scale = _robust_scale(residual)
    inliers = np.abs(residual - np.median(residual)) <= _OUTLIER_SIGMAS * scale
    if inliers.sum() >= N_FEATURES and not inliers.all():
        theta, _ = nnls(a[inliers], ones[inliers])
    else:
        inliers[:] = True
        theta, _ = nnls(a, ones)
    return theta, inliers


def _soft_max(c: np.ndarray, tau: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """tau * log sum_r exp(c_r / tau) per step and its weights (softmax), c [S, R], tau [S]."""
    z = c / tau[:, None]
    zmax = z.max(axis=1, keepdims=True)
    e = np.exp(z - zmax)
    total = e.sum(axis=1, keepdims=True)
    value = tau * (zmax[:, 0] + np.log(total[:, 0]))
    return value, e / total


def _step_max_solve(x: np.ndarray, y: np.ndarray, theta0: np.ndarray, temperatures, loss: str, scale: float) -> np.ndarray:
    """Bounded least squares of relative residuals softmax_tau(x @ theta)/y - 1, annealing tau."""
    from scipy.optimize import least_squares

    theta = np.maximum(theta0, 1e-12)
    for temp in temperatures:
        tau = temp * y

        def residual(t, tau=tau):
            value, _ = _soft_max(x @ t, tau)
            return value / y - 1.0

        def jacobian(t, tau=tau):
            _, w = _soft_max(x @ t, tau)
            return np.einsum("sr,srk->sk", w, x) / y[:, None]

        theta = least_squares(residual, theta, jac=jacobian, bounds=(0.0, np.inf), loss=loss, f_scale=scale, method="trf").x
        theta = np.maximum(theta, 1e-15)  # trf wants a strictly feasible start for the next temperature
    return theta


def _fit_step_max(x: np.ndarray, y: np.ndarray, robust: bool, temperature: Optional[float]) -> Tuple[np.ndarray, np.ndarray]:
    """Non-negative fit of step times y [S] ~ max_r x[S, r] @ theta (x scaled), via a soft-max.

    Start: alternate "which rank is the slowest under theta" and NNLS on those
    ranks' rows (a few rounds). Then bounded least squares through a soft-max
    whose temperature is relative to each step's time, annealed towards the
    max; Huber and an inlier refit as in the per-rank fit.
    """
    from scipy.optimize import nnls

    ones = np.ones_like(y)
    theta, _ = nnls(x.mean(axis=1) / y[:, None], ones)  # the mean rank: a start that underestimates
    for _ in range(8):
        slowest = np.argmax(x @ theta, axis=1)
        rows = x[np.arange(len(y)), slowest]
        new, _ = nnls(rows / y[:, None], ones)
        if np.allclose(new, theta, rtol=1e-6, atol=1e-12):
            break
        theta = new
    temps = (temperature,) if temperature is not None else _ANNEAL_TEMPERATURES
    inliers = np.ones(y.shape, dtype=bool)
    if not robust:
        return _step_max_solve(x, y, theta, temps, "linear", 1.0), inliers
    slowest_value = (x @ theta).max(axis=1)
    scale = _robust_scale(slowest_value / y - 1.0)
    theta = _step_max_solve(x, y, theta, temps, "huber", scale)
    value, _ = _soft_max(x @ theta, temps[-1] * y)
    residual = value / y - 1.0
    scale = _robust_scale(residual)
    inliers = np.abs(residual - np.median(residual)) <= _OUTLIER_SIGMAS * scale
    if inliers.sum() >= N_FEATURES and not inliers.all():
        theta = _step_max_solve(x[inliers], y[inliers], theta, temps[-1:], "linear", 1.0)
    else:
        inliers[:] = True
        theta = _step_max_solve(x, y, theta, temps[-1:], "linear", 1.0)
    return theta, inliers


def _fit(features: np.ndarray, times: np.ndarray, mode: str, robust: bool, temperature: Optional[float]):
    """Fit on already validated data; returns (CostModel, inlier mask shaped like times)."""
    scale = _column_scale(features)
    x = features / scale
    if mode == "per_rank":
        theta, inliers = _fit_per_rank(x.reshape(-1, N_FEATURES), times.reshape(-1), robust)
        inliers = inliers.reshape(times.shape)
    else:
        theta, inliers = _fit_step_max(x, times, robust, temperature)
    coefficients = np.maximum(theta, 0.0) / scale
    return CostModel(*coefficients.tolist()), inliers


def _r2(pred: np.ndarray, true: np.ndarray) -> float:
    if true.size < 2:
        return float("nan")
    total = float(np.sum((true - true.mean()) ** 2))
    if total <= 0:
        return float("nan")
    return 1.0 - float(np.sum((pred - true) ** 2)) / total


def _mape(pred: np.ndarray, true: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - true) / true)) if true.size else float("nan")


def _targets(model: CostModel, features: np.ndarray, times: np.ndarray, mode: str):
    """(predicted, observed) in the mode's target: per-rank times or step times."""
    if mode == "per_rank":
        return model.predict(features).ravel(), times.ravel()
    return model.step_time(features), times


def fit_cost_model(
    features,
    times,
    *,
    mode: str = "auto",
    holdout: float = 0.25,
    temperature: Optional[float] = None,
    robust: bool = True,
    seed: int = 0,
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
    holdout: fraction of steps (a seeded random choice) held out to measure R^2
    and MAPE; the returned model is then refitted on all steps.
    robust: Huber loss, then drop observations beyond 4 robust sigmas and refit.

    Raises ValueError naming the step / rank / value of bad data, a shape
    mismatch, or fewer observations than the 4 unknowns.
    """
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}: must be one of {_MODES}")
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout={holdout!r}: must be in [0, 1)")
    if temperature is not None and not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: must be > 0 (relative to the step time) or None")
    features, times = _validate(features, times)
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
            f"fewer than the {N_FEATURES} unknowns {_COEFF_NAMES}; record more warm-up steps"
        )

    # Hold out steps only when enough remain to determine the 4 unknowns twice over.
    n_heldout = int(round(steps * holdout))
    min_train_steps = -(-2 * N_FEATURES // per_step)
    n_heldout = max(0, min(n_heldout, steps - min_train_steps))
    order = np.random.default_rng(seed).permutation(steps)
    test_steps, train_steps = np.sort(order[:n_heldout]), np.sort(order[n_heldout:])

    r2 = mape = step_mape = float("nan")
    if n_heldout:
        trial, _ = _fit(features[train_steps], times[train_steps], mode, robust, temperature)
        pred, true = _targets(trial, features[test_steps], times[test_steps], mode)
        r2, mape = _r2(pred, true), _mape(pred, true)
        true_step = times[test_steps] if times.ndim == 1 else times[test_steps].max(axis=1)
        step_mape = _mape(trial.step_time(features[test_steps]), true_step)

    model, inliers = _fit(features, times, mode, robust, temperature)
    pred, true = _targets(model, features, times, mode)
    keep = inliers.ravel()
    outlier_steps = tuple(int(s) for s in np.flatnonzero(~inliers.reshape(steps, -1).all(axis=1)))
    report = FitReport(
        mode=mode,
        r2=r2,
        mape=mape,
        step_mape=step_mape,
        train_r2=_r2(pred[keep], true[keep]),
        train_mape=_mape(pred[keep], true[keep]),
        n_train=steps,
        n_heldout=n_heldout,
        n_observations=int(times.size),
        n_outliers=int((~inliers).sum()),
        outlier_steps=outlier_steps,
        temperature=(temperature if temperature is not None else _ANNEAL_TEMPERATURES[-1]) if mode == "step_max" else None,
    )
    return FitResult(model=model, report=report)


__all__ = [
    "CostModel",
    "FitReport",
    "FitResult",
    "features_of",
    "features_of_ranks",
    "fit_cost_model",
    "N_FEATURES",
]
