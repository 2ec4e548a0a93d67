"""Lower bounds on the slowest rank's time: what no placement can beat (token cap ignored)."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.validation import _as_item_values, _check_count, _per_rank


def lower_bound(costs, num_ranks: int, *, prior_loads=None, speeds=None) -> float:
    """Makespan (time units) that no placement can beat, ignoring the token cap.

    The larger of: the water level T with ``sum_r max(0, T*s_r - p_r) = total`` (no rank can finish before the
    fixed work it already has: ``max_r p_r/s_r`` is included), and the heaviest item on the rank where it would
    finish first, ``min_r (p_r + c_max) / s_r``. O(n + R log R).
    """
    num_ranks = _check_count(num_ranks, "num_ranks")
    return _lower_bound(_as_item_values(costs, "costs", None),
                        _per_rank(prior_loads, "prior_loads", num_ranks, 0.0, positive=False),
                        _per_rank(speeds, "speeds", num_ranks, 1.0, positive=True))


def _fill_time(total: float, prior: np.ndarray, speeds: np.ndarray) -> float:
    """The smallest time T at which the ranks absorb `total` work on top of their fixed loads:
    sum_r max(0, T*s_r - p_r) >= total (piecewise linear, increasing in T). O(R log R)."""
    start = prior / speeds
    order = np.argsort(start, kind="stable")
    a, cum_s, cum_p = start[order], np.cumsum(speeds[order]), np.cumsum(prior[order])
    k = int(np.searchsorted(a * cum_s - cum_p, total, side="right")) - 1  # (load below level a[k] on ranks 0..k)
    return float(max((total + cum_p[k]) / cum_s[k], a[k]))


def _lower_bound(c: np.ndarray, prior: np.ndarray, speeds: np.ndarray) -> float:
    """`lower_bound` of checked arrays."""
    level = max(_fill_time(float(c.sum()), prior, speeds), float(np.max(prior / speeds)))
    return max(level, float(np.min((prior + c.max()) / speeds))) if c.size else level
