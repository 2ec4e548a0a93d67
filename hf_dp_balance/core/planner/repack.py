"""The repack fallback: the incremental method first, then partial repacks that move more."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.assign import _LONG, _assign_long, _long_first, _long_first_applies
from hf_dp_balance.core.planner.chain import _ladder_trades
from hf_dp_balance.core.planner.finish import _swap_down
from hf_dp_balance.core.planner.home import _send_home
from hf_dp_balance.core.planner.passes import _balance_incremental, _extra_passes, _polish
from hf_dp_balance.core.planner.place import _place_lpt
from hf_dp_balance.core.planner.state import _Infeasible, _State, _copy_state, _fullest, _remove
from hf_dp_balance.core.planner.trade import _LARGE, _trade

_REPACK_START = 8  # emptiest ranks joined to the over-full ones in the first partial repack
_TRUST = 0.5  # long items first go first where the search's estimate is at most this share of the tokens
# (36 instances, long-tail, 64-1024 ranks, M = 2-4, q/l 1.4e-4 / 1e-3, seeds 0-2: where long items first sent
# fewer tokens, M = 3-4 at q/l 1.4e-4, the estimate was 13-41%; where they sent more, M = 2 or q/l 1e-3, 250-3400%)
_NO_SEARCH = 4.0  # x _TRUST: an estimate at the start above this gets no search (at 64-2048 ranks it cut
# 660-760% to 250-400% at q/l 1e-3: not trusted, and the search costs 1.5-2.5 x the trades there)
_FEW_LONG = 128  # at most this many long items: the search always, and long items first also where the
# trades send more than _RETRY (32 x 4 and 48 x 4, q/l 1e-3: long items first sent 0.7-6.5% fewer tokens
# where the estimate was not trusted; from 64 x 4 on they sent more)
_RETRY = 0.10
_RESIDUE_PASSES = 2  # ladder trades at any cost per token, each followed by the incremental method
_ROOMY = 0.125  # a rank with at least this share of the cap free (over its M slots) is "roomy"
_ROOMY_BUDGET = 0.98  # x budget: what the ladder trades of `_roomy_trades` aim roomy ranks at
_ROOMY_PASSES = 3  # `_roomy_trades` each followed by the incremental method, while above the goal


def _balance(state: _State, budget: np.ndarray, tolerance: float, relocate: bool = True,
             deep: bool = True, repack_gain: float = 0.0) -> _State:
    """The incremental method and full-cap trades; if both stop above the goal, repacks that move more.

    Full-cap trades (`_full_cap_trades`) are for slots filled to the cap, where only exchanges help:
    they go first when most slots are full (`_trades_first`), else only after the incremental method.
    Going first, they start with ladder trades of large items (core/planner/chain.py) for a strongly
    quadratic cost (`_lumpy`), with small-change trades (`_trade`) for a milder one; after the
    incremental method, with ladder trades. Moves
    budget: when the incremental method or the trades end within twice the tolerance, the one
    that sends fewer tokens is kept and no repack runs (a repack sends most of the step again).
    A repack pools every item of a set of ranks (those still above the goal and the
    K emptiest), places them again by capped LPT on those ranks only, renames those
    ranks so that most items stay with their owner, and polishes (refine, exchanges).
    K = 2 x (over-full ranks) + 8, doubled until the plan is within the goal or the set
    is every rank (a from-scratch LPT). The kept plan has the lowest fullest rank;
    among plans within `tolerance` of it, the fewest tokens sent (earlier attempts win ties).
    With `repack_gain` > 0 (a cap repair, which is applied whatever it gains), a repack
    replaces the incremental plan only if it cuts the fullest rank by at least that
    fraction: the many moves of a repack must pay for themselves, as any plan must.
    Raises _Infeasible only when no attempt finds a feasible plan.
    """
    if not deep:  # sync="micro_batch": its per-micro-batch levels are loose; exchanges / repacks seldom pay
        return _balance_incremental(state, budget, tolerance, relocate, deep=False)
    goal = 1.0 + tolerance
    R = budget.shape[0]
    start = state.dest.copy()
    origin = _copy_state(state)
    tried = []
    first = _trades_first(origin)
    traded = None
    lumpy = False
    if first:
        # on `state` itself (no copy of the step's arrays): the incremental method below starts
        # from a fresh copy of `origin` instead when the trades find no plan
        lumpy = _lumpy(origin)
        traded = _full_cap_trades(state, budget, tolerance, relocate, copy=False, ladder=lumpy)
        if traded is None:
            state = _copy_state(origin)
    if traded is not None and _fullest(traded, budget) <= goal:
        return traded
    # ladder trades first that ended above the goal: a capped LPT repack that does not beat them stops
    # the doubling (M = 3, long-tail, q/l 1.4e-4, 256-1024 ranks: every repack ended 0.1-1% above
    # the trades' plan, sending 53-81% of the tokens, and took ~80% of the call's time)
    stop_at = _fullest(traded, budget) if traded is not None and lumpy else np.inf
    if traded is not None:
        tried.append(traded)  # they ran steps 1-4 already: the repacks start from them
    else:
        try:
            tried.append(_balance_incremental(state, budget, tolerance, relocate))
        except _Infeasible:
            pass
        if tried and _fullest(tried[0], budget) <= goal:
            return tried[0]
        if not first:
            traded = _full_cap_trades(origin, budget, tolerance, relocate)
            if traded is not None and _fullest(traded, budget) <= goal:
                return traded
    near = [st for st in tried + ([traded] if traded is not None and traded not in tried else [])
            if _fullest(st, budget) <= 1.0 + 2.0 * tolerance]
    if near:  # the moves budget: within twice the tolerance, no repack (it sends most of the step again)
        return min(near, key=lambda st: _sent(st, start))
    base = tried[0] if tried else origin
    safe = np.maximum(budget, np.finfo(np.float64).tiny)
    full = base.load / safe
    if base is origin and base.cap is not None:
        # the incremental method failed on a cap repair: ranks with a slot over the cap go first
        full = np.where((base.slot_tok > base.cap).any(axis=1), np.inf, full)
    over = int(np.count_nonzero(full > goal))
    k = 2 * over + _REPACK_START
    failure = None
    while True:
        k = min(k, R)
        # the over-full ranks and then the emptiest ones (ties: lowest index)
        ranks = np.sort(np.lexsort((np.arange(R), -full))[:over].tolist() +
                        [r for r in np.lexsort((np.arange(R), full)).tolist()
                         if full[r] <= goal][:max(k - over, 0)])
        repacked = None
        try:
            repacked = _repack(_copy_state(base if k < R else origin), budget, tolerance, ranks, start)
            tried.append(repacked)
        except _Infeasible as exc:
            failure = exc
        if (len(tried) and _fullest(tried[-1], budget) <= goal) or k >= R:
            break
        if repacked is not None and _fullest(repacked, budget) >= stop_at:
            break
        k *= 2
    if not tried:
        raise failure
    incremental = tried[0] if base is not origin else None
    if traded is not None and traded not in tried:
        tried.append(traded)
    return _choose(tried, incremental, budget, tolerance, start, repack_gain)


def _full_cap_trades(origin: _State, budget: np.ndarray, tolerance: float, relocate: bool, copy: bool = True,
                     ladder: bool = True):
    """The plan for a placement whose slots are full, where only exchanges help; None when the start
    breaks the cap (a repair: the incremental method's token shedding does it) or no plan is found.
    With `ladder`: ladder trades (core/planner/chain.py), the incremental method, then for what is
    left above the goal up to _RESIDUE_PASSES ladder trades at any cost per token (items whose surplus
    just covers the excess) each with the incremental method. Without: small-change trades (`_trade`)
    and the incremental method (what a milder cost needs first: fewer tokens sent). Then `_trade`
    again and polish. With `ladder` at M <= 4 the long items are assigned first too
    (core/planner/assign.py) where the search's estimate of the tokens sent is at most _TRUST of the
    step's: then that pass goes first and the trades alone run only where it ends above the trades'
    limit; elsewhere the trades alone go first and long items first run only where they end above
    it (or, with at most _FEW_LONG long items, send more than _RETRY of the tokens). Where both run the better plan wins (the lower fullest rank; both within the limit, fewer
    tokens sent). With `copy` False it works on `origin` itself (spoilt when it returns None)."""
    if origin.cap is None or bool(np.any(origin.slot_tok > origin.cap)):
        return None
    if not ladder or not _long_first_applies(origin):
        return _full_cap_pass(origin, budget, tolerance, relocate, copy, ladder, long_first=None)
    start = origin.dest.copy()
    spare = _copy_state(origin)
    trust = _TRUST * float(origin.tokens.sum())
    few = np.count_nonzero(origin.tokens > origin.cap * _LONG) <= _FEW_LONG
    give_up = np.inf if few else _NO_SEARCH * trust
    assigned = _assign_long(origin, budget, tolerance, give_up=give_up)
    trusted = assigned[2] <= trust
    first = _full_cap_pass(origin, budget, tolerance, relocate, copy, ladder,
                           long_first=assigned if trusted else None)
    limit = (1.0 + tolerance / 2.0) * (1.0 + 1e-9)
    if trusted and first is not None and limit < _fullest(first, budget) <= 1.0 + tolerance:
        # within the goal but just over the limit: swaps of single items first (core/planner/finish.py)
        _swap_down(first, budget * (1.0 + tolerance / 2.0), start)
    if (first is not None and _fullest(first, budget) <= limit
            and (trusted or not few or _sent(first, start) <= _RETRY * float(origin.tokens.sum()))):
        return first
    if not trusted and assigned[2] > give_up:  # no search was made: make it now (`spare` is the start)
        assigned = _assign_long(spare, budget, tolerance)
    second = _full_cap_pass(spare, budget, tolerance, relocate, False, ladder,
                            long_first=None if trusted else assigned)
    plans = [p for p in (first, second) if p is not None]
    if not plans:
        return None
    within = [p for p in plans if _fullest(p, budget) <= limit]
    if within:
        return min(within, key=lambda p: _sent(p, start))
    return min(plans, key=lambda p: _fullest(p, budget))


def _full_cap_pass(origin: _State, budget: np.ndarray, tolerance: float, relocate: bool, copy: bool,
                   ladder: bool, long_first):
    """One attempt of `_full_cap_trades` (its docstring); `long_first`: None, or what `_assign_long`
    returned for `origin` (the long items assigned first, as it says)."""
    start = origin.dest.copy()
    state = _copy_state(origin) if copy else origin
    try:
        if ladder:
            if long_first is not None:
                _long_first(state, budget, tolerance, long_first)
            _ladder_trades(state, budget, tolerance)
            deep = _deep_after_ladders(state)
            state = _balance_incremental(state, budget, tolerance, relocate, deep=deep, refine=deep)
            for _ in range(_RESIDUE_PASSES):  # the small excess left: trades at any cost per token
                if _fullest(state, budget) <= 1.0 + tolerance:
                    break
                _ladder_trades(state, budget, tolerance, min_rate=0.0, near=True,
                               partners_only=state.M >= _SHALLOW_M)
                state = _balance_incremental(state, budget, tolerance, relocate)
            for _ in range(_ROOMY_PASSES):  # still above: room made where the free tokens are
                if _fullest(state, budget) <= 1.0 + tolerance:
                    break
                _roomy_trades(state, budget, tolerance)
                state = _balance_incremental(state, budget, tolerance, relocate)
        else:
            _trade(state, budget, tolerance)
            state = _balance_incremental(state, budget, tolerance, relocate)
        _trade(state, budget, tolerance)
        state = _polish(state, budget, budget * (tolerance / 2.0), tolerance)
        # up to the trades' limit, never above the fullest rank now (fewer tokens, not a slower step)
        _send_home(state, start, budget * min(1.0 + tolerance / 2.0, _fullest(state, budget)))
        state.path = "trades"
        return state
    except _Infeasible:
        return None


_SHALLOW_M = 8  # from this many micro-batches on, shed / place only after the first ladder pass


def _deep_after_ladders(state: _State) -> bool:
    """Whether the incremental method after the first ladder pass of `_full_cap_pass` refines and tries
    its one-for-many exchanges (`passes._polish`), or only sheds and places. Only sheds and places
    from _SHALLOW_M micro-batches on: at 4096 x 8 (long-tail, q/l 1.4e-4) the exchange trials keep one
    exchange of tiny gain and the refinement's moves and swaps send tokens for what the residue ladder
    pass then does anyway (seeds 0 / 1 / 2: bound 1.0025 x unchanged, tokens sent 9.020 / 8.829 /
    9.009% -> 9.023 / 8.833 / 9.027%, ~1.4x faster). Below (M <= 4, where long items first also run)
    the plans are kept as they were."""
    return state.M < _SHALLOW_M


def _roomy_trades(state: _State, budget: np.ndarray, tolerance: float) -> None:
    """Ladder trades (core/planner/chain.py, any cost per token) toward a budget cut to _ROOMY_BUDGET
    on the ranks with free tokens (_ROOMY of the cap), the budget elsewhere: load room made where
    the token room is. Why: at a full cap with M = 3 the residue ends with every free token on the
    ranks at or over the limit (they hold a rank-sized item) and every rank with load room
    token-full, so no move fits; these trades send a roomy rank's dense items to the token-full
    ranks for their cheaper tokens, and the incremental method then moves what is over into that
    room. The fullest rank never rises (a ladder trade lowers the larger of its two loads)."""
    roomy = state.cap * state.M - state.slot_tok.sum(axis=1) >= state.cap * _ROOMY
    _ladder_trades(state, np.where(roomy, budget * _ROOMY_BUDGET, budget), tolerance, min_rate=0.0)


def _trades_first(state: _State) -> bool:
    """Fixed-length packing at max_tokens = the pack length (most slots have less token room than
    a large item of `_trade`): only exchanges help, so the trades go first. With a strongly
    quadratic cost the imbalance is in the large items, which no move can place (the incremental
    method would fail, slowly); with a milder one the incremental method gets there too, but with
    more tokens sent (4096 x 8: 4.5% of them against 3.2%) and a fullest rank further from the goal."""
    if state.cap is None or state.slot_tok is None or bool(np.any(state.slot_tok > state.cap)):
        return False
    return float(np.median(state.cap - state.slot_tok)) <= state.cap * _LARGE


_LUMPY = 2.0  # large items cost at least this much more per token than the rest: ladder trades first


def _lumpy(state: _State) -> bool:
    """A cost whose large items are dearer per token than the rest by _LUMPY (a strongly quadratic
    cost): the imbalance is in the large items, so a rank over the goal must trade one of them away
    for many small ones (ladder trades) rather than trade small change."""
    large = np.flatnonzero(state.tokens > state.cap * _LARGE)  # (a gather by index: a mask's is ~7x slower)
    # the four sums by numpy's pairwise sums of the large items and of all (~1 ms at 550k items, where
    # the two-bin bincounts take ~4: each adds into one of two cells, a chain of dependent additions),
    # each within n x eps of all the tokens / costs: decided where that margin cannot change the answer
    t_all, c_all = float(state.tokens.sum()), float(state.costs.sum())
    t_large, c_large = float(state.tokens[large].sum()), float(state.costs[large].sum())
    err = 4.0 * (state.tokens.size + 1) * np.finfo(np.float64).eps
    e_t, e_c = err * t_all, err * c_all
    t_rest, c_rest = t_all - t_large, c_all - c_large
    if t_large - e_t > 0 and t_rest - e_t > 0 and c_large - e_c >= 0 and c_rest - e_c >= 0:
        low = (c_large - e_c) / (t_large + e_t) * (1.0 - err)
        high = (c_large + e_c) / (t_large - e_t) * (1.0 + err)
        at_low = _LUMPY * (c_rest - e_c) / (t_rest + e_t) * (1.0 - err)
        at_high = _LUMPY * (c_rest + e_c) / (t_rest - e_t) * (1.0 + err)
        if low > at_high:
            return True
        if high < at_low:
            return False
    return _lumpy_exact(state)


def _lumpy_exact(state: _State) -> bool:
    """`_lumpy` from the sums of two-bin bincounts (index order): where the fast test cannot decide."""
    large = (state.tokens > state.cap * _LARGE).view(np.int8)  # one pass per sum, no masked copies
    t_rest, t_large = np.bincount(large, weights=state.tokens, minlength=2)
    if t_large <= 0 or t_rest <= 0:
        return False
    c_rest, c_large = np.bincount(large, weights=state.costs, minlength=2)
    return float(c_large) / t_large >= _LUMPY * float(c_rest) / t_rest


def _sent(state: _State, start: np.ndarray) -> float:
    """What a plan sends over the side network: tokens of the items that change rank (items when no
    tokens are given)."""
    away = state.dest != start
    return float(state.tokens[away].sum()) if state.tokens is not None else float(np.count_nonzero(away))


def _choose(tried: list, incremental, budget: np.ndarray, tolerance: float, start: np.ndarray,
            repack_gain: float) -> _State:
    """Among the attempts: the lowest fullest rank, and among those within `tolerance` of it the
    fewest moves (first wins ties); the `incremental` plan instead when the choice is a repack
    that does not beat it by `repack_gain`."""
    best = min(_fullest(st, budget) for st in tried)
    near = [st for st in tried if _fullest(st, budget) <= best * (1.0 + tolerance)]
    chosen = min(near, key=lambda st: _sent(st, start))
    if (repack_gain > 0 and incremental is not None and chosen is not incremental
            and _fullest(chosen, budget) > _fullest(incremental, budget) * (1.0 - repack_gain)):
        return incremental
    return chosen


def _repack(state: _State, budget: np.ndarray, tolerance: float, ranks: np.ndarray,
            start: np.ndarray) -> _State:
    """Re-place every item of `ranks` by capped LPT onto `ranks` (heaviest first to the least
    full, load / budget, whose emptiest slot has token room), rename those ranks toward the
    items' owners in `start`, then shed / place, refine and exchange as the incremental
    method. Cost: O(n) numpy + O(pooled items x log |ranks|) Python + the matching."""
    inside = np.zeros(budget.shape[0], dtype=bool)
    inside[ranks] = True
    pool = np.flatnonzero(inside[state.dest])
    if pool.size:
        _remove(state, pool)
        _place_lpt(state, pool, budget, ranks)
        _relabel(state, budget, ranks, pool, start)
    state.path = "repack"
    slack = budget * (tolerance / 2.0)
    limit = budget * (1.0 + tolerance / 2.0)
    _extra_passes(state, budget, slack, limit)
    return _polish(state, budget, slack, tolerance)


def _relabel(state: _State, budget: np.ndarray, ranks: np.ndarray, pool: np.ndarray, start: np.ndarray) -> None:
    """Rename `ranks` (whose items are `pool`, freshly placed) so that most items go back to
    their owner in `start`: a maximum-weight matching (scipy linear_sum_assignment) of the
    new contents to the ranks, weight = items already owned by the rank. Only when those
    ranks have the same budget and no fixed load (then a renaming changes no time).
    O(pool + K^3) for K ranks (fast in practice)."""
    K = ranks.shape[0]
    if K < 2 or np.any(budget[ranks] != budget[ranks[0]]) or np.any(state.fixed[ranks] != 0):
        return
    from scipy.optimize import linear_sum_assignment

    local = np.full(budget.shape[0], -1, dtype=np.int64)
    local[ranks] = np.arange(K)
    owner = local[start[pool]]
    mine = owner >= 0
    # weight: tokens kept home (the bytes an exchange does not send), items when no tokens are given
    weight = None if state.tokens is None else state.tokens[pool[mine]]
    kept = np.bincount(local[state.dest[pool[mine]]] * K + owner[mine], weights=weight,
                       minlength=K * K).reshape(K, K)
    rows, cols = linear_sum_assignment(kept, maximize=True)  # new contents `rows` -> rank `cols`
    to = np.arange(budget.shape[0])
    to[ranks[rows]] = ranks[cols]
    state.dest[pool] = to[state.dest[pool]]
    src = ranks[rows]
    dst = ranks[cols]
    load = state.load.copy()
    state.load[dst] = load[src]
    if state.slot_tok is not None:
        slot_tok = state.slot_tok.copy()
        state.slot_tok[dst] = slot_tok[src]
    if state.count is not None:
        count = state.count.copy()
        state.count[dst] = count[src]

