"""The repack fallback: ranks re-placed from scratch by capped LPT. It sends most items of the ranks it takes,
so the pipeline runs it only where the incremental method and the trades end above twice the tolerance."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.passes import _extra_passes, _polish
from hf_dp_balance.core.planner.place import _place_lpt
from hf_dp_balance.core.planner.state import _Infeasible, _State, _copy_state, _fullest, _remove

_REPACK_START = 8  # emptiest ranks joined to the over-full ones in the first repack (they take the excess)


def _repack_until(base: _State, origin: _State, budget: np.ndarray, tolerance: float, start: np.ndarray,
                  stop_at: float, none_yet: bool) -> list:
    """Repacks of the ranks above the goal in `base` and the K emptiest, K = 2 x (over-full ranks) + _REPACK_START,
    doubled until one is within the goal, one does not beat `stop_at`, or every rank is in (then from `origin`: a
    from-scratch LPT). Returns the plans made; with `none_yet` (no fallback), raises the last _Infeasible if none."""
    goal, R = 1.0 + tolerance, budget.shape[0]
    full = base.load / np.maximum(budget, np.finfo(np.float64).tiny)
    if base is origin and base.cap is not None:
        # the incremental method failed on a cap repair: ranks with a slot over the cap go first
        full = np.where((base.slot_tok > base.cap).any(axis=1), np.inf, full)
    over = int(np.count_nonzero(full > goal))
    k = 2 * over + _REPACK_START
    made, failure = [], None
    while True:
        k = min(k, R)
        ranks = np.sort(np.lexsort((np.arange(R), -full))[:over].tolist() +
                        [r for r in np.lexsort((np.arange(R), full)).tolist() if full[r] <= goal][:max(k - over, 0)])
        repacked = None
        try:
            repacked = _repack(_copy_state(base if k < R else origin), budget, tolerance, ranks, start)
            made.append(repacked)
        except _Infeasible as exc:
            failure = exc
        if k >= R or (repacked is not None and not goal < _fullest(repacked, budget) < stop_at):
            break
        k *= 2
    if not made and none_yet:
        raise failure
    return made


def _repack(state: _State, budget: np.ndarray, tolerance: float, ranks: np.ndarray, start: np.ndarray) -> _State:
    """Re-place every item of `ranks` onto `ranks` by capped LPT, rename them toward the items' owners in `start`
    (`_relabel`), then the extra passes and polish. Cost: O(n) numpy, O(pooled x log |ranks|) Python, the matching."""
    inside = np.zeros(budget.shape[0], dtype=bool)
    inside[ranks] = True
    pool = np.flatnonzero(inside[state.dest])
    if pool.size:
        _remove(state, pool)
        _place_lpt(state, pool, budget, ranks)
        _relabel(state, budget, ranks, pool, start)
    state.path = "repack"
    slack = budget * (tolerance / 2.0)
    _extra_passes(state, budget, slack, budget * (1.0 + tolerance / 2.0))
    return _polish(state, budget, slack, tolerance)


def _relabel(state: _State, budget: np.ndarray, ranks: np.ndarray, pool: np.ndarray, start: np.ndarray) -> None:
    """Rename the K `ranks` (their items `pool`, freshly placed) so that most tokens go back to their owner in `start`:
    a maximum-weight matching (scipy linear_sum_assignment), weight = tokens (items without tokens) a rank already
    owns. Only where those ranks share one budget and no fixed load (renaming then changes no time). O(pool + K^3)."""
    K = ranks.shape[0]
    if K < 2 or np.any(budget[ranks] != budget[ranks[0]]) or np.any(state.fixed[ranks] != 0):
        return
    from scipy.optimize import linear_sum_assignment

    local = np.full(budget.shape[0], -1, dtype=np.int64)
    local[ranks] = np.arange(K)
    owner = local[start[pool]]
    mine = owner >= 0
    weight = None if state.tokens is None else state.tokens[pool[mine]]
    kept = np.bincount(local[state.dest[pool[mine]]] * K + owner[mine], weights=weight,
                       minlength=K * K).reshape(K, K)
    rows, cols = linear_sum_assignment(kept, maximize=True)  # new contents `rows` -> rank `cols`
    to = np.arange(budget.shape[0])
    to[ranks[rows]] = ranks[cols]
    state.dest[pool] = to[state.dest[pool]]
    for name in ("load", "slot_tok", "count"):  # each renamed rank takes its new contents' totals
        value = getattr(state, name)
        if value is not None:
            value[ranks[cols]] = value[ranks[rows]].copy()
