"""Input checks of the planner: every array validated once, errors name the first bad entry."""

from __future__ import annotations

from typing import Optional

import numpy as np


def _refuse_first(bad: np.ndarray, message) -> None:
    """Raise ValueError(message(i)) for the first index i where `bad` holds, if any."""
    if bad.any():
        raise ValueError(message(int(np.flatnonzero(bad)[0])))


def _one_d(arr: np.ndarray, name: str, n: Optional[int]) -> np.ndarray:
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries but costs has {n}")
    return arr


def _as_item_values(values, name: str, n: Optional[int]) -> np.ndarray:
    """1-D float64 array of finite, non-negative values."""
    arr = _one_d(np.asarray(values, dtype=np.float64), name, n)
    _refuse_first(~np.isfinite(arr) | (arr < 0), lambda i: f"{name}[{i}]={float(arr[i])!r}: must be finite and >= 0")
    return arr


def _as_index_array(values, name: str, n: int, upper: int, upper_name: str) -> np.ndarray:
    """1-D int64 array with every entry an integer in [0, upper)."""
    raw = _one_d(np.asarray(values), name, n)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.dtype.kind not in "iub":
        as_float = raw.astype(np.float64)
        _refuse_first(~np.isfinite(as_float) | (as_float != np.round(as_float)),
                      lambda i: f"{name}[{i}]={raw[i].item()!r}: must be an integer")
    arr = raw.astype(np.int64, copy=False)  # read only by the planner: the caller's int64 array as it is
    if not (0 <= int(arr.min()) and int(arr.max()) < upper):
        _refuse_first((arr < 0) | (arr >= upper),
                      lambda i: f"{name}[{i}]={int(arr[i])}: out of range for {upper_name}={upper}")
    return arr


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    return int(value)


def _check_fraction(value, name: str) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r}: must be in [0, 1)")
    return value


def _per_rank(values, name: str, num_ranks: int, default: float, positive: bool) -> np.ndarray:
    if values is None:
        return np.full(num_ranks, default, dtype=np.float64)
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] != num_ranks:
        raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got shape {arr.shape}")
    need = "finite and > 0" if positive else "finite and >= 0"
    _refuse_first(~np.isfinite(arr) | ((arr <= 0) if positive else (arr < 0)),
                  lambda r: f"{name}[{r}]={float(arr[r])!r} (rank {r}): must be {need}")
    return arr


def _check_tokens(tokens, max_tokens, n: int):
    """Validated (tokens, cap) pair; cap is None when there is no token limit."""
    tok = None if tokens is None else _as_item_values(tokens, "tokens", n)
    if max_tokens is None:
        return tok, None
    cap = float(max_tokens)
    if not np.isfinite(cap) or cap <= 0:
        raise ValueError(f"max_tokens={max_tokens!r}: must be a positive token count or None")
    if tok is None:
        raise ValueError("max_tokens is given but tokens is None: the cap needs each item's token count")
    _refuse_first(tok > cap, lambda i: f"tokens[{i}]={float(tok[i])!r} exceeds max_tokens={cap!r} on its own: "
                                       "no placement can hold it")
    return tok, cap
