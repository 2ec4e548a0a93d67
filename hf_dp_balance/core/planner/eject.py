"""One-for-many exchange: a heavy item of the fullest rank moves to a rank that sheds to make room."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.place import _place_best_fit
from hf_dp_balance.core.planner.state import _State, _remove
from hf_dp_balance.core.planner.trade_index import _rank_starts, _search_within, _stable_order


def _eject(state: _State, budget: np.ndarray, limit: np.ndarray, wide: bool) -> bool:
    """One-for-many exchange for the fullest rank h (load / budget); True if it applied one. A heavy item `a` of
    h (tried: the lightest that alone brings h within its limit, and h's heaviest) goes to the receiver that
    sheds the fewest items (ties: lowest load after, lowest index): its heaviest movable ones (those that fit the
    largest free room elsewhere) until its load and receiving slot are within limit and cap; the shed items are
    placed by best fit. Cost: one O(n log n) sort plus O(n) numpy per candidate."""
    costs, R = state.costs, state.load.shape[0]
    safe = np.maximum(budget, np.finfo(np.float64).tiny)
    h = int(np.argmax(state.load / safe))
    mine = np.flatnonzero(state.dest == h)
    if mine.size == 0 or (state.count is not None and state.count[h] - 1 < state.min_count):
        return False
    cm = costs[mine]
    covering = np.flatnonzero(cm >= float(state.load[h] - limit[h]))
    heaviest = int(mine[np.argmax(cm)])
    cands = [int(mine[covering[np.argmin(cm[covering])]])] if covering.size else []
    cands += [heaviest] if heaviest not in cands else []
    recv_slot = np.argmin(state.slot_tok, axis=1) if state.slot_tok is not None else np.zeros(R, dtype=np.int64)
    room = limit - state.load
    room_h, room[h] = room[h], -np.inf
    best_other = float(np.max(room))
    pool = _pool(state, h, recv_slot)
    best = None
    for a in cands:
        ca = float(costs[a])
        if ca <= 0:
            continue
        # shed items must fit the rooms of other ranks (h's freed room takes at most one of them:
        # counting on it lets r shed large items that end up back on r)
        movable_up_to = max(best_other, room_h + ca) if wide or best_other <= 0 else best_other
        found = _receiver(state, a, h, pool[costs[pool] <= movable_up_to], recv_slot, limit, safe)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], a, found[1], found[2])
    if best is None:
        return False
    _, a, r, shed = best
    shed = np.sort(shed)
    _remove(state, shed)
    state.move(a, r, int(recv_slot[r]))
    if shed.size:
        _place_best_fit(state, shed, limit)
    return True


def _pool(state: _State, h: int, recv_slot: np.ndarray) -> np.ndarray:
    """Items that could shed: not on h, in their rank's receiving slot; by rank, heaviest first (ties: index)."""
    pool = np.flatnonzero((state.dest != h) & (state.micro == recv_slot[state.dest]))
    pool = pool[np.argsort(-state.costs[pool], kind="stable")]
    return pool[_stable_order(state.dest[pool], state.load.shape[0])]


def _receiver(state: _State, a: int, h: int, sel: np.ndarray, recv_slot: np.ndarray, limit: np.ndarray,
              safe: np.ndarray):
    """(key, rank, items it sheds) of the best receiver of item `a` of the fullest rank h, or None. `sel`: the
    items that may shed, by rank, heaviest first; rank r sheds the fewest first ones that bring its load with
    `a` within limit[r] and its receiving slot within the cap (a search of the running sums each). The key
    ranks the candidates `a`: first those that bring h within its limit, then (items shed, load after)."""
    R, ca = state.load.shape[0], float(state.costs[a])
    starts = _rank_starts(state.dest[sel], R)
    lo, hi = starts[:-1], starts[1:]
    run_c = np.concatenate(([0.0], np.cumsum(state.costs[sel])))  # running sums with a leading 0
    need = np.maximum(state.load + ca - limit, 0.0)  # cost each rank must shed to take `a`
    k = _search_within(run_c, run_c[lo] + need, lo, hi + 1, clamp="both")
    if state.slot_tok is not None and state.cap is not None:
        run_t = np.concatenate(([0.0], np.cumsum(state.tokens[sel])))
        tneed = np.maximum(state.slot_tok[np.arange(R), recv_slot] + state.tokens[a] - state.cap, 0.0)
        k = np.maximum(k, _search_within(run_t, run_t[lo] + tneed, lo, hi + 1, clamp="both"))
    k = np.where(k <= hi, k - lo, np.inf)  # items r must shed (inf: all of them are not enough)
    k[h] = np.inf
    if state.count is not None:
        k[state.count + 1 - k < state.min_count] = np.inf
    if not np.isfinite(k).any():
        return None
    shed_to = lo + np.where(np.isfinite(k), k, 0).astype(np.int64)
    after = np.where(np.isfinite(k), (state.load + ca - (run_c[shed_to] - run_c[lo])) / safe, np.inf)
    r = int(np.lexsort((np.arange(R), after, k))[0])
    key = (0 if state.load[h] - ca <= limit[h] else 1, float(k[r]), float(after[r]))
    return key, r, sel[lo[r]:shed_to[r]]
