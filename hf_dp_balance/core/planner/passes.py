"""The incremental method: shed, place, refine, exchange toward per-rank budgets, then the item-count fixes."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.eject import _eject
from hf_dp_balance.core.planner.place import _place_best_fit
from hf_dp_balance.core.planner.refine import _fill_empty_slots, _fill_short_ranks, _refine
from hf_dp_balance.core.planner.shed import _shed_rounds, _shed_tokens
from hf_dp_balance.core.planner.state import _PASSES, _Infeasible, _State, _copy_state, _fullest


def _balance_incremental(state: _State, budget: np.ndarray, tolerance: float, relocate: bool = True,
                         deep: bool = True, refine: bool = True) -> _State:
    """Shed, place, refine toward per-rank `budget` loads, then the item-count fixes; raises _Infeasible.
    `deep` False: no one-for-many exchanges; `refine` False too: shed and place only (ladder trades follow).

    When the placement breaks the cap and the cost shedding fails (it took an item no slot can hold any more),
    the cap is repaired alone: token shedding (swapping for smaller items where needed), then refine and
    exchanges, which keep the cap. A few small items move, instead of a repack that moves most of them."""
    repair_only = _copy_state(state) if state.cap is not None and bool(np.any(state.slot_tok > state.cap)) else None
    slack = budget * (tolerance / 2.0)
    try:
        return _balance_shedding(state, budget, slack, tolerance, relocate, deep, refine)
    except _Infeasible:
        if repair_only is None:
            raise
        return _balance_once(repair_only, budget, slack, tolerance, False, deep, shed_cost=False, refine=refine)


def _balance_shedding(state: _State, budget: np.ndarray, slack: np.ndarray, tolerance: float,
                      relocate: bool, deep: bool, refine: bool = True) -> _State:
    """`_balance_once`; when an item alone is over its rank's budget (speeds or fixed loads differ), both with
    and without relocating it to a faster rank: the lower fullest rank wins (ties: fewer moves)."""
    misplaced = relocate and state.costs.size and float(state.costs.max()) > float((budget + slack).min()) and bool(
        np.any(state.costs > (budget + slack)[state.dest]))
    if not misplaced:
        return _balance_once(state, budget, slack, tolerance, False, deep, refine=refine)
    start, other = state.dest.copy(), _copy_state(state)
    state = _balance_once(state, budget, slack, tolerance, relocate=True)
    try:
        other = _balance_once(other, budget, slack, tolerance, relocate=False)
    except _Infeasible:
        return state
    score = [(_fullest(st, budget), int(np.count_nonzero(st.dest != start))) for st in (other, state)]
    return other if score[0] < score[1] else state


def _balance_once(state: _State, budget: np.ndarray, slack: np.ndarray, tolerance: float,
                  relocate: bool, deep: bool = True, shed_cost: bool = True, refine: bool = True) -> _State:
    """One shed / place pass (tokens over the cap, and with `shed_cost` load over budget), the extra passes,
    then `_polish`."""
    limit = budget * (1.0 + tolerance / 2.0)
    # the token repair first: then an item the cost shedding takes from a repaired slot still fits back home
    repair = _shed_tokens(state, swap=not shed_cost)  # the retry of a repair swaps long items for smaller ones
    pool = _shed_rounds(state, budget, slack, relocate=relocate) if shed_cost else repair[:0]
    if repair.size:
        pool = np.concatenate((repair, pool))
    if pool.size:
        _place_best_fit(state, pool, limit, lpt_host=relocate)
        if shed_cost:
            _extra_passes(state, budget, slack, limit)
    return _polish(state, budget, slack, tolerance, eject=deep, refine=refine or deep)


def _extra_passes(state: _State, budget: np.ndarray, slack: np.ndarray, limit: np.ndarray) -> None:
    """Up to _PASSES more shed / place passes while some rank is over budget + slack: they shed again what
    the placement could not fit (e.g. the rank that took a long sample; long samples stay)."""
    for _ in range(_PASSES):
        pool = _shed_rounds(state, budget, slack, relocate=False) if np.any(state.load > budget + slack) else []
        if len(pool) == 0:
            return
        _place_best_fit(state, pool, limit)


def _polish(state: _State, budget: np.ndarray, slack: np.ndarray, tolerance: float,
            eject: bool = True, refine: bool = True) -> _State:
    """Refine (unless `refine` is False), one-for-many exchanges while they help (`eject`), then the
    item-count fixes. An exchange is kept only if it lowers the fullest rank (at most R of them)."""
    limit, goal, refine_iters = budget * (1.0 + tolerance / 2.0), 1.0 + tolerance, 2 * budget.shape[0] + 16
    if refine:
        _refine(state, budget, goal, max_iters=refine_iters)
    for _ in range(budget.shape[0] if eject else 0):
        now = _fullest(state, budget)
        if now <= goal:
            break
        for wide in (False, True):
            trial = _copy_state(state)
            try:
                if not _eject(trial, budget, limit, wide):
                    continue
                _extra_passes(trial, budget, slack, limit)
                _refine(trial, budget, goal, max_iters=refine_iters)
            except _Infeasible:
                continue
            if _fullest(trial, budget) < now:
                state = trial
                break
        else:
            break  # neither exchange lowered the fullest rank
    _fill_short_ranks(state)
    _fill_empty_slots(state)
    return state
