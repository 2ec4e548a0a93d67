"""Trades for a full token cap: one item for a few small ones, between paired ranks, in vectorised rounds.

With fixed-length packing every slot is filled to the cap, so an item moves only where a slot has room for it
(a few hundred tokens): only exchanges help. An exchange costs the tokens it sends (both ways), so a trade is
judged by the load it takes off the fuller rank per token sent."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.state import _BREADTH, _FEW_SLOTS, _LARGE, _OVERHEAD, _ROUNDS, _State, _pair_ranks
from hf_dp_balance.core.planner.trade_index import (_by_rank_and_cost, _first_best, _PayBack, _ranges,
                                                    _rank_starts, _stable_order)


def _trade(state: _State, budget: np.ndarray, tolerance: float) -> bool:
    """Trade toward `budget` until no rank is above budget x (1 + tolerance / 2); True if it got there.

    Each round pairs the over-full ranks h, most over first, with _BREADTH ranks l under budget (one beyond
    _FEW_SLOTS slots). A trade sends h's item `a` to l: a large one (over cap x _LARGE tokens) into l's roomiest
    slot or for a large item `b` of l, that slot paying back the fewest small items (at most half a large one's
    tokens) that make room; or a smaller one alone where it fits. Per h, the trade taking the most load off h
    per token sent (+ cap x _OVERHEAD) that keeps l within its limit; a partner trades once per round, an item
    moves once. The items tried are the 2 x _BREADTH each side of the cost h should shed, twice as many after
    a round where h found none. Never breaks the cap or `state.min_count`; the fullest rank never rises.
    Cost: one O(n) grouping, then O(items of the pairs' windows x options) numpy per round."""
    cap, R = state.cap, state.load.shape[0]
    limit = budget * (1.0 + tolerance / 2.0)
    if cap is None or R < 2 or not np.any(state.load > limit):
        return not np.any(state.load > limit)
    moved = np.zeros(state.costs.shape[0], dtype=bool)
    order, slot_starts, large, rest = _trade_index(state, limit)
    pay_back = _PayBack(order, slot_starts, state.tokens, state.costs, cap * _LARGE / 2.0, moved)
    reach = np.full(R, 2 * _BREADTH, dtype=np.int64)  # items each side tried per rank
    most = int(max(np.diff(large[1]).max(), np.diff(rest[1]).max()))  # the most items a rank has in one index
    partners = _BREADTH if state.M <= _FEW_SLOTS else 1
    for k in range(_ROUNDS * _BREADTH // partners):
        over, h, l = _pair_ranks(state, budget, limit, state.load - limit, partners, k)
        if over.size == 0 or h is None:
            return over.size == 0
        traded = _round(state, h, l, reach[h], budget, limit, pay_back, rest, large, moved, cap * _OVERHEAD)
        if traded.size == 0 and bool(np.all(reach[h] >= most)):
            return False  # every rank has tried all its items
        failed = h[~np.isin(h, traded)]  # repeats are harmless: every copy writes the same value
        reach[failed] = np.minimum(reach[failed] * 2, most)
    return not np.any(state.load > limit)


def _trade_index(state: _State, limit: np.ndarray):
    """What the rounds of `_trade` read: the items grouped by slot (`order`, where each slot's begin), and
    by rank, cheapest first (`_by_rank_and_cost`): the large items of every rank, the others of the ranks
    over `limit` (only they shed: a trade never puts a rank over)."""
    R, M, cost = state.load.shape[0], state.M, state.costs
    slot = state.dest * M + state.micro
    order, slot_starts = _stable_order(slot, R * M), _rank_starts(slot, R * M)  # items by slot, so by rank
    scale = 1.0 / (float(cost.max()) * 2.0 + 1.0)
    is_large = state.tokens[order] > state.cap * _LARGE
    rank_starts = slot_starts[::M]  # `order` is rank-major: a rank's items are one stretch of it
    over = np.flatnonzero(state.load > limit)
    at, _ = _ranges(rank_starts[over], rank_starts[over + 1])
    large, rest = order[np.flatnonzero(is_large)], order[at[np.flatnonzero(~is_large[at])]]
    return order, slot_starts, *(_by_rank_and_cost(x, state.dest, cost, scale, R) for x in (large, rest))


def _window(index: tuple, ranks: np.ndarray, want: np.ndarray, reach: np.ndarray, moved: np.ndarray):
    """(items, pair of each): the never-moved of the `reach` items of `index` of each of `ranks` each side of
    the cost `want` it should shed (a cheaper one sheds less, a dearer one overshoots or needs more sent back)."""
    items, starts, key, scale = index
    near = np.searchsorted(key, ranks + np.minimum(want * scale, 0.5))
    lo = np.maximum(near - reach, starts[ranks])
    pos, pair = _ranges(lo, np.maximum(np.minimum(near + reach, starts[ranks + 1]), lo))
    keep = np.flatnonzero(~moved[items[pos]])  # index arrays, not boolean masks: faster on random masks
    return items[pos[keep]], pair[keep]


def _round(state, h, l, reach, budget, limit, pay_back, rest, large, moved, overhead) -> np.ndarray:
    """Apply the best trade of each over-full rank h (pairs h[i], l[i], a run per h), each rank under budget in
    at most one, the most over first; returns the ranks h that traded. Tried: h's other items alone into l's
    roomiest slot where they fit it as it is (h's first partner only), and its large items into that slot or for
    the b of l nearest in cost below and above c_a - want, the receiving slot paying back the fewest small items
    that make room (`_PayBack`). Per h its best (ties: the first tried), and its second best too when the best
    leaves it over budget and the two share no item and no slot of h."""
    tok, cost, micro, cap = state.tokens, state.costs, state.micro, state.cap
    excess = state.load - budget
    want = np.minimum(excess[h], limit[l] - state.load[l])
    recv = np.argmin(state.slot_tok[l], axis=1)
    first = np.flatnonzero(np.concatenate(([True], h[1:] != h[:-1])))
    alone, g = _window(rest, h[first], want[first], reach[first], moved)
    g = first[g]
    fit = np.flatnonzero(tok[alone] <= cap - state.slot_tok[l[g], recv[g]])
    options = [(alone[fit], g[fit], np.full(fit.size, -1))]
    items, starts, key, scale = large
    a, g = _window(large, h, want, reach, moved)
    options.append((a, g, np.full(a.size, -1)))
    ll = l[g]
    p_hi = np.searchsorted(key, ll + np.maximum(cost[a] - want[g], 0.0) * scale)
    for p_b in (p_hi - 1, p_hi):
        inside = np.flatnonzero((p_b >= starts[ll]) & (p_b < starts[ll + 1]))
        inside = inside[np.flatnonzero(~moved[items[p_b[inside]]])]
        options.append((a[inside], g[inside], items[p_b[inside]]))
    a, g, b = (np.concatenate(x) for x in zip(*options))  # the moves first (as they were tried first)
    has_b, hl, ll, ta, ma = b >= 0, h[g], l[g], tok[a], micro[a]
    b_or_a = np.where(has_b, b, a)
    m, tb, cb = np.where(has_b, micro[b_or_a], recv[g]), *(np.where(has_b, x[b_or_a], 0.0) for x in (tok, cost))
    need = np.maximum(ta - tb - (cap - state.slot_tok[ll, m]), 0.0)  # what a small pay-back must free
    # no option scores above its `bound`: one below what a move of its pair scores is not searched (need inf)
    move = (b < 0) & (need <= 0) & (cost[a] > 0) & (state.load[ll] + cost[a] <= limit[ll]) & (
        True if state.count is None else state.count[hl] > state.min_count)
    best = np.full(h.size, -np.inf)
    np.maximum.at(best, g[move], (np.minimum(cost[a], excess[hl]) / (ta + overhead))[move])
    bound = np.minimum(np.minimum(cost[a] - cb, excess[hl]), limit[ll] - state.load[ll]) / (ta + tb + need + overhead)
    need[bound < best[g]] = np.inf
    (back_tok, back_cost, n_back), lo, j, ok = pay_back.search(ll * state.M + m, need)
    back_tok = np.where(ok, back_tok, np.inf) + tb
    delta = cost[a] - (back_cost + cb)
    n_back = n_back + has_b
    ok &= (back_tok <= ta + (cap - state.slot_tok[hl, ma])) & (delta > 0) & (state.load[ll] + delta <= limit[ll])
    if state.count is not None:  # h sends one item and takes n_back; both keep state.min_count
        ok &= (state.count[hl] - 1 + n_back >= state.min_count) & (state.count[ll] + 1 - n_back >= state.min_count)
    score = np.where(ok, np.minimum(delta, excess[hl]) / (ta + back_tok + overhead), -np.inf)
    chosen = _first_best(g, score, h.size)  # ascending pair = over-full order, a run per h
    if chosen.size == 0:
        return h[:0]
    chosen = chosen[np.lexsort((chosen, -score[chosen], hl[chosen]))]  # within each h: best first
    hc = hl[chosen]
    lead = np.concatenate(([True], hc[1:] != hc[:-1]))
    c0 = chosen[np.maximum.accumulate(np.where(lead, np.arange(chosen.size), 0))]  # the best of its h
    second = (~lead & np.concatenate(([False], lead[:-1]))  # the second of its h
              & (delta[c0] < state.load[hc] - budget[hc]) & (a[chosen] != a[c0]) & (ma[chosen] != ma[c0]))
    t = np.concatenate((chosen[lead], chosen[second]))
    t = t[_first_touching(state.load.shape[0], ll[t])]
    paid, pg = pay_back.paid(lo[t], j[t])  # the receiving slot's small items up to the position found
    with_b = np.flatnonzero(b[t] >= 0)
    moving = np.concatenate((a[t], paid, b[t][with_b]))  # a to l, the rest back to h
    back_of = np.concatenate((pg, with_b))
    _apply(state, moving, np.concatenate((ll[t], hl[t][back_of])), np.concatenate((m[t], ma[t][back_of])))
    moved[moving] = True
    return hl[t]


def _first_touching(num_ranks: int, *ranks: np.ndarray) -> np.ndarray:
    """Which candidates come first (in their order) at every rank they name: taking those, each rank is in one."""
    n = ranks[0].size
    first = np.full(num_ranks, n, dtype=np.int64)
    for r in ranks:
        np.minimum.at(first, r, np.arange(n))
    return np.logical_and.reduce([first[r] == np.arange(n) for r in ranks])


def _apply(state: _State, allx, rank, slot) -> None:
    """Move items `allx` to (rank, slot) each, updating the sums."""
    R, M = state.load.shape[0], state.M
    src, c = state.dest[allx], state.costs[allx]
    state.load += np.bincount(rank, weights=c, minlength=R) - np.bincount(src, weights=c, minlength=R)
    if state.slot_tok is not None:
        t = state.tokens[allx]
        state.slot_tok.reshape(-1)[:] += (np.bincount(rank * M + slot, weights=t, minlength=R * M)
                                          - np.bincount(src * M + state.micro[allx], weights=t, minlength=R * M))
    if state.count is not None:
        state.count += np.bincount(rank, minlength=R) - np.bincount(src, minlength=R)
    state.prev[allx] = src
    state.dest[allx] = rank
    state.micro[allx] = slot
