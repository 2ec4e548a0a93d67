"""Shedding: which items leave the over-full ranks (cost) and the over-full slots (tokens)."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.state import _Infeasible, _State, _group_starts, _remove


def _shed_rounds(state: _State, budget: np.ndarray, slack: np.ndarray, max_rounds: int = 64,
                 relocate: bool = True) -> np.ndarray:
    """Items to take off every over-budget rank, chosen in vectorised rounds; removed from `state`.

    Each round takes at most one item per rank that is still above budget + slack:
    the lightest item that covers the remaining excess on its own (one move,
    little overshoot), or, if none does, the heaviest item (fewest moves toward
    it). With `relocate`, an item over its own rank's budget on its own (a long
    sample on a slow rank) leaves first, if some rank's budget can hold it.
    Items heavier than the largest free room anywhere (budget - load of the
    emptiest rank) are never taken: no rank could receive them without becoming
    the new slowest. A rank keeps at least `state.min_count` items.
    Cost: O(items on over ranks) numpy per round.
    """
    costs, owners = state.costs, state.dest
    excess = state.load - budget
    room = float(np.max(-excess))
    over = excess > slack
    if not over.any():
        return np.zeros(0, dtype=np.int64)
    sel = np.flatnonzero(over[owners])
    so = owners[sel]
    if so.size > 1 and np.any(so[1:] < so[:-1]):
        order = np.argsort(so, kind="stable")  # items grouped by owner, index order inside
        sel, so = sel[order], so[order]
    sc = costs[sel]
    movable = (sc > 0) & (sc <= room)
    taken_all = []
    starts = _group_starts(so)
    ranks = so[starts]
    rem = excess[ranks]
    lim = slack[ranks]
    left = state.count[ranks] - state.min_count if state.count is not None else np.full(ranks.size, sel.size)
    # an item over its own rank's budget on its own, that fits the budget of some other rank
    # (e.g. a long sample on a slow rank), leaves first whatever the free room says
    misplaced = (sc > budget[so] + slack[so]) & (sc <= float(budget.max()))
    if relocate and misplaced.any():
        hit = np.flatnonzero(misplaced)
        g = np.searchsorted(starts, hit, side="right") - 1
        first = np.concatenate(([True], g[1:] != g[:-1]))  # one per rank (the lowest index)
        hit, g = hit[first], g[first]
        hit, g = hit[left[g] > 0], g[left[g] > 0]
        taken_all.append(sel[hit])
        movable[hit] = False
        rem[g] -= sc[hit]
        left[g] -= 1
    for _ in range(max_rounds):
        active = (rem > lim) & (left > 0)
        if not active.all():
            # keep only the ranks still over budget (smaller arrays for the next rounds)
            keep_items = np.repeat(active, np.diff(np.append(starts, sel.size)))
            sel, so, sc, movable = sel[keep_items], so[keep_items], sc[keep_items], movable[keep_items]
            rem, lim, left, ranks = rem[active], lim[active], left[active], ranks[active]
            if sel.size == 0:
                break
            starts = _group_starts(so)
        group = np.repeat(np.arange(starts.size), np.diff(np.append(starts, sel.size)))
        need = (rem - lim)[group]
        min_cover = np.minimum.reduceat(np.where(movable & (sc >= need), sc, np.inf), starts)
        max_free = np.maximum.reduceat(np.where(movable, sc, -np.inf), starts)
        pick = np.where(np.isfinite(min_cover), min_cover, max_free)
        ok = np.isfinite(pick)
        if not ok.any():
            break
        hit = np.flatnonzero(movable & (sc == pick[group]) & ok[group])
        g = group[hit]
        first = np.concatenate(([True], g[1:] != g[:-1]))  # lowest index wins ties
        hit, g = hit[first], g[first]
        taken_all.append(sel[hit])
        movable[hit] = False
        rem[g] -= sc[hit]
        left[g] -= 1
        left[~ok] = 0  # nothing movable left on these ranks
    if not taken_all:
        return np.zeros(0, dtype=np.int64)
    pool = np.sort(np.concatenate(taken_all))
    _remove(state, pool)
    return pool


def _shed_tokens(state: _State) -> np.ndarray:
    """Items to take off every slot over the token cap (most tokens first); removed from `state`.

    Only needed when the current placement already breaks the cap. Python over
    the items of the offending slots.
    """
    if state.cap is None:
        return np.zeros(0, dtype=np.int64)
    over = np.flatnonzero(state.slot_tok.reshape(-1) > state.cap)
    if over.size == 0:
        return np.zeros(0, dtype=np.int64)
    slot_of = state.dest * state.M + state.micro
    pool = []
    for s in over.tolist():
        items = np.flatnonzero(slot_of == s)
        items = items[np.lexsort((items, -state.tokens[items]))].tolist()
        excess = float(state.slot_tok.reshape(-1)[s]) - state.cap
        r = s // state.M
        left = int(state.count[r]) - state.min_count if state.count is not None else len(items)
        for i in items:
            if excess <= 0:
                break
            if left <= 0:
                raise _Infeasible(f"slot (rank {r}, micro-batch {s % state.M}) cannot shed tokens and keep "
                                  f"{state.min_count} items")
            pool.append(i)
            excess -= float(state.tokens[i])
            left -= 1
    pool = np.asarray(pool, dtype=np.int64)
    _remove(state, pool)
    return pool

