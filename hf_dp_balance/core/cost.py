"""The compute cost model of one rank's work: `CostModel`, its feature rows, its JSON form.

    cost(items) = quadratic * sum(L^2) + linear * sum(L) + per_sample * n + constant   (all >= 0)

One instance per module (the decoder over sample lengths, the vision encoder
over images with L = patches). A rank's feature row is `(sum L^2, sum L, n, 1)`,
so its cost is a dot product and every item's cost is additive. Fitting it to
timings: `hf_dp_balance.core.fitting`; the model and the method: docs/cost_model.md.
Pure numpy: no torch import here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

N_FEATURES = 4
FEATURE_NAMES = ("sum_L2", "sum_L", "n", "one")
COEFF_NAMES = ("quadratic", "linear", "per_sample", "constant")


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
        for name in COEFF_NAMES:
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
    def from_config(cls, model_config, module: str = "decoder") -> "CostModel":
        """FLOP prior in TFLOPs from a transformers config: forward + backward of one sample of L tokens
        (`module="decoder"`, causal attention within the sample) or one frame of L patches (`"vision"`).
        Formulas: `core.prior` and docs/cost_model.md. ValueError when the config lacks a needed size."""
        from hf_dp_balance.core.prior import prior_coefficients

        return cls(*(c / 1e12 for c in prior_coefficients(model_config, module)))

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
        return {name: getattr(self, name) for name in COEFF_NAMES}

    @classmethod
    def from_dict(cls, d) -> "CostModel":
        if not isinstance(d, dict):
            raise ValueError(f"CostModel.from_dict: expected a dict, got {type(d).__name__}")
        missing = [k for k in ("quadratic", "linear") if k not in d]
        unknown = sorted(set(d) - set(COEFF_NAMES))
        if missing or unknown:
            raise ValueError(f"CostModel.from_dict: missing keys {missing}, unknown keys {unknown}")
        return cls(**{k: d[k] for k in COEFF_NAMES if k in d})

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


__all__ = ["COEFF_NAMES", "CostModel", "FEATURE_NAMES", "N_FEATURES", "features_of", "features_of_ranks"]
