"""Ladder trades for a full token cap: a large item for the cheapest-per-token items of one slot.

When every slot is filled to the cap and the cost is strongly quadratic, the imbalance sits in a
few long samples: a rank holding two 30K-token samples is far over the mean, and no move fits
anywhere. A long sample costs more per token than the short ones, so sending it to a light rank
and taking back the same tokens of that slot's cheapest-per-token items sheds most of its cost
while every slot keeps its tokens. Each slot's items, cheapest per token first, form a "ladder":
its prefix sums say, for any tokens to free, the fewest items that free them and what they cost,
so every option is one binary search (no Python loop over items).
"""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.state import _State

_ROUNDS = 32  # trade rounds at most (every round: at most one trade per over-full rank)
_IDLE = 3  # rounds in a row without a trade that end the pass
_LARGE = 1.0 / 16.0  # items above this share of the cap are the ones sent
_CHOICES = 4  # large items of h tried per round: those whose cost most exceeds what their tokens cost back
_PARTNERS = 3  # ranks under budget each over-full rank considers per round
_OVERHEAD = 1.0 / 64.0  # tokens of cap counted per trade on top of the tokens it sends (favours fewer trades)
_MIN_RATE = 0.2  # a trade sheds at least this share of the mean cost per token per token it sends
_DENSITY_BINS = 1 << 16  # cost per token is ordered on this many log-spaced bins (a radix sort)


def _ladder_trades(state: _State, budget: np.ndarray, tolerance: float, rounds: int = _ROUNDS) -> bool:
    """Trade toward `budget` until no rank is above budget x (1 + tolerance / 2); True if it got there.

    A trade sends a large item `a` (over cap x _LARGE tokens, never moved) of an over-full rank h
    to a slot (l, m) of a rank l under its budget, and brings back to a's slot on h a prefix of
    the ladder of (l, m): its original items, cheapest per token first. The prefix is the
    shortest one that (i) frees the tokens a needs in (l, m), and (ii) costs enough that l stays
    within budget x (1 + tolerance / 2); it must fit a's slot on h (tokens at most a's plus that
    slot's room) and take less cost than a brings. A slot gives back once (its ladder is then
    stale); a slot any item left is no ladder any more.

    Every round pairs the over-full ranks, most over first, with _PARTNERS ranks under budget each
    (furthest under first, the partners shifting every round), tries h's _CHOICES large items
    with the most cost above their tokens at the cheapest density, into every slot of each
    partner, and keeps per h the trade with the most load taken off h (no more than its excess)
    per token sent (+ cap x _OVERHEAD); each partner takes at most one trade per round.

    Guarantees: every item keeps one (rank, slot); no slot goes over the cap; no rank goes over
    budget x (1 + tolerance / 2) unless it was already; a rank keeps at least `state.min_count`
    items and a slot with items keeps one. Cost: one O(n) radix sort (density bins, then slots),
    then per round O(over-full ranks x _PARTNERS x _CHOICES x M) numpy, no loop over items.
    """
    cap = state.cap
    R, M = state.load.shape[0], state.M
    limit = budget * (1.0 + tolerance / 2.0)
    if cap is None or R < 2 or not np.any(state.load > limit):
        return not np.any(state.load > limit)
    tok, cost = state.tokens, state.costs
    n = cost.shape[0]
    S = R * M
    slot = state.dest * M + state.micro
    order = _ladders(cost, tok, slot, S)
    starts = np.zeros(S + 1, dtype=np.int64)
    np.cumsum(np.bincount(slot, minlength=S), out=starts[1:])
    # prefix sums along the ladders (one leading 0): a prefix of slot s is CT[starts[s] + k] - CT[starts[s]]
    CT = np.concatenate(([0.0], np.cumsum(tok[order])))
    CC = np.concatenate(([0.0], np.cumsum(cost[order])))
    slot_items = np.bincount(slot, minlength=S).astype(np.int64)
    stale = np.zeros(S, dtype=bool)  # slots an original item left: their ladders no longer hold
    moved = np.zeros(n, dtype=bool)
    # the large items, grouped by rank, most cost above their tokens at the lowest density first
    large = np.flatnonzero(tok > cap * _LARGE)
    if large.size == 0:
        return False
    d_min = float(np.min(cost / np.maximum(tok, np.finfo(np.float64).tiny)))
    surplus = cost[large] - d_min * tok[large]
    scale = 1.0 / (float(surplus.max()) * 2.0 + 2.0)
    large = large[np.argsort(state.dest[large] + (1.0 - (surplus + 1.0) * scale), kind="stable")]
    l_starts = np.searchsorted(state.dest[large], np.arange(R + 1))
    overhead = cap * _OVERHEAD
    min_rate = _MIN_RATE * float(cost.sum()) / max(float(tok.sum()), 1e-300)
    idle = 0
    for k in range(rounds):
        over = np.flatnonzero(state.load > limit)
        if over.size == 0:
            return True
        under = np.flatnonzero(state.load < budget)
        if under.size == 0:
            return False
        over = over[np.lexsort((over, budget[over] - state.load[over]))]
        under = under[np.lexsort((under, state.load[under] - budget[under]))]
        P = min(over.size, under.size)
        K = min(_PARTNERS, under.size)
        h = np.repeat(over[:P], K)
        l = under[(np.repeat(np.arange(P), K) + np.tile(np.arange(K), P) * (1 + k) + k) % under.size]
        if _round(state, h, l, budget, limit, order, starts, CT, CC, slot_items, stale, moved, large,
                  l_starts, overhead, min_rate):
            idle = 0
        else:
            idle += 1  # the partners shift: the next round may still find trades
            if idle >= _IDLE:
                return False
    return not np.any(state.load > limit)


def _ladders(cost: np.ndarray, tok: np.ndarray, slot: np.ndarray, S: int) -> np.ndarray:
    """Items grouped by slot, cheapest per token first within a slot (ties: index): two stable
    radix sorts, on log-spaced density bins and on the slot."""
    dens = np.log(np.maximum(cost, 1e-300) / np.maximum(tok, 1e-300))
    lo, hi = float(dens.min()), float(dens.max())
    bins = ((dens - lo) * ((_DENSITY_BINS - 1) / max(hi - lo, 1e-12))).astype(np.uint16)
    by_density = np.argsort(bins, kind="stable")
    key = slot[by_density]
    key = key.astype(np.uint16) if S <= _DENSITY_BINS else key
    return by_density[np.argsort(key, kind="stable")]


def _round(state, h, l, budget, limit, order, starts, CT, CC, slot_items, stale, moved, large, l_starts,
           overhead, min_rate) -> bool:
    """One trade per over-full rank h of the pairs (h[i], l[i]) (each h in one run of adjacent pairs),
    every l in at most one; applies them; False when no pair has a trade."""
    cap, M = state.cap, state.M
    tok, cost = state.tokens, state.costs
    P = h.size
    # h's first unmoved large items (the list is short per rank: a window of twice the choices)
    lo = l_starts[h]
    pos = lo[:, None] + np.arange(2 * _CHOICES)[None, :]
    inside = pos < l_starts[h + 1][:, None]
    pair = np.broadcast_to(np.arange(P)[:, None], pos.shape)[inside]
    a = large[pos[inside]]
    keep = ~moved[a]
    a, pair = a[keep], pair[keep]
    rank_in_pair = np.arange(a.size) - np.searchsorted(pair, pair)
    a, pair = a[rank_in_pair < _CHOICES], pair[rank_in_pair < _CHOICES]
    # every slot m of the partner: options (a, m)
    a = np.repeat(a, M)
    pair = np.repeat(pair, M)
    m = np.tile(np.arange(M), a.size // M)
    hl, ll = h[pair], l[pair]
    dst = ll * M + m
    ma = state.micro[a]
    src = hl * M + ma
    ok = ~stale[dst]
    a, pair, m, hl, ll, dst, ma, src = a[ok], pair[ok], m[ok], hl[ok], ll[ok], dst[ok], ma[ok], src[ok]
    if a.size == 0:
        return False
    ta, ca = tok[a], cost[a]
    flat_tok = state.slot_tok.reshape(-1)
    base = starts[dst]
    end = starts[dst + 1]
    # the pay-back: a ladder prefix that frees the tokens a needs in (l, m), fits a's slot on h,
    # and costs about what evens h and l (no less than leaves h at its budget)
    lo_tok = CT[base] + np.maximum(ta - (cap - flat_tok[dst]), 0.0)
    # h's whole room: the pay-back fills a's slot first, then h's other slots (a new micro-batch on
    # the same rank sends nothing); `_place_back` checks that the items fit
    hi_tok = CT[base] + ta + (cap * M - state.slot_tok[hl].sum(axis=1))
    j_lo = np.searchsorted(CT, lo_tok, side="left")
    j_hi = np.minimum(np.searchsorted(CT, hi_tok, side="right") - 1, end)
    excess = state.load[hl] - budget[hl]
    # what h should shed, as far as l can take it; when the tokens allow no more pay-back, l may end
    # over its limit if both end under h's load now (`even`)
    target = ca - np.minimum(excess, limit[ll] - state.load[ll])
    j = np.clip(np.searchsorted(CC, CC[base] + target, side="left"), j_lo, np.maximum(j_hi, j_lo))
    feasible = (j_lo <= j_hi)
    j = np.minimum(j, end)
    back_tok = CT[j] - CT[base]
    back_cost = CC[j] - CC[base]
    n_back = j - base
    delta = ca - back_cost
    after = np.maximum(state.load[hl] - delta, state.load[ll] + delta)
    feasible &= (delta > 0) & (after < state.load[hl] * (1.0 - 1e-9))
    feasible &= (n_back > 0) | (slot_items[src] > 1)  # a's slot keeps an item
    if state.count is not None:
        feasible &= ((state.count[hl] - 1 + n_back >= state.min_count)
                     & (state.count[ll] + 1 - n_back >= state.min_count))
    gain = state.load[hl] - np.maximum(after, budget[hl])
    score = np.where(feasible, gain / (ta + back_tok + overhead), -np.inf)
    score[score < min_rate] = -np.inf
    if not np.isfinite(score).any():
        return False
    # per over-full rank its best trade (ties: the first option); then every l once, most over first
    best = np.full(P, -np.inf)
    np.maximum.at(best, pair, score)
    win = np.flatnonzero(np.isfinite(score) & (score == best[pair]))
    first_of_pair = win[np.concatenate(([True], pair[win][1:] != pair[win][:-1]))]
    hw = hl[first_of_pair]
    o = np.lexsort((first_of_pair, -score[first_of_pair], hw))
    chosen = first_of_pair[o]
    chosen = chosen[np.concatenate(([True], hw[o][1:] != hw[o][:-1]))]  # one per h
    chosen = np.sort(chosen)  # over-full order
    R = state.load.shape[0]
    taken = np.full(R, chosen.size, dtype=np.int64)
    np.minimum.at(taken, ll[chosen], np.arange(chosen.size))
    chosen = chosen[taken[ll[chosen]] == np.arange(chosen.size)]
    # a's slot, if it is also some chosen trade's pay-back slot (h under and over in one round cannot
    # happen: h is over, l under), is fine; apply: a -> (l, m), the ladder prefix -> (h, ma)
    a_c, l_c, m_c, h_c, ma_c = a[chosen], ll[chosen], m[chosen], hl[chosen], ma[chosen]
    back, to_slot_back, ok = _place_back(state, order, base[chosen], n_back[chosen], h_c, ma_c, ta[chosen])
    a_c, l_c, m_c = a_c[ok], l_c[ok], m_c[ok]
    of = np.repeat(np.arange(ok.size), n_back[chosen])
    keep = ok[of]
    back, to_slot_back, of = back[keep], to_slot_back[keep], of[keep]
    items = np.concatenate((a_c, back))
    to_rank = np.concatenate((l_c, h_c[of]))
    to_slot = np.concatenate((m_c, to_slot_back))
    from_slot = state.dest[items] * M + state.micro[items]
    _apply(state, items, to_rank, to_slot)
    slot_items += (np.bincount(to_rank * M + to_slot, minlength=slot_items.size)
                   - np.bincount(from_slot, minlength=slot_items.size))
    stale[from_slot] = True
    moved[items] = True
    return True


def _place_back(state, order, base, n_back, h, ma, ta):
    """(items, their slots on h, trade ok) of the pay-backs: ladder positions base .. base + n_back of
    every trade, each into a's slot ma while it has room (a's tokens freed it), else h's roomiest slot;
    a trade whose pay-back does not fit is not ok (its items are returned, not to be moved)."""
    cap = state.cap
    size = n_back
    first = np.cumsum(size) - size
    pos = np.arange(int(size.sum())) - np.repeat(first, size) + np.repeat(base, size)
    back = order[pos]
    to = np.repeat(ma, size)
    ok = np.ones(h.size, dtype=bool)
    if back.size == 0:
        return back, to, ok
    room_ma = cap - state.slot_tok[h, ma] + ta
    cum = np.cumsum(state.tokens[back])
    cum -= np.repeat(np.concatenate(([0.0], cum))[first], size)  # within each trade
    spills = np.zeros(h.size, dtype=bool)
    spills[np.repeat(np.arange(h.size), size)[cum > np.repeat(room_ma, size)]] = True
    for t in np.flatnonzero(spills):
        # the rest goes to h's other slots, roomiest first (few trades: a Python loop over their items)
        room = cap - state.slot_tok[h[t]].astype(np.float64)
        room[ma[t]] += ta[t]
        for p in range(first[t], first[t] + size[t]):
            tk = state.tokens[back[p]]
            s = int(ma[t]) if room[ma[t]] >= tk else int(np.argmax(room))
            if room[s] < tk:
                ok[t] = False
                break
            room[s] -= tk
            to[p] = s
    return back, to, ok


def _apply(state: _State, items, rank, slot) -> None:
    """Move `items` to (rank, slot) each, updating the sums."""
    R, M = state.load.shape[0], state.M
    src = state.dest[items]
    c = state.costs[items]
    state.load += np.bincount(rank, weights=c, minlength=R) - np.bincount(src, weights=c, minlength=R)
    t = state.tokens[items]
    flat = state.slot_tok.reshape(-1)
    flat += (np.bincount(rank * M + slot, weights=t, minlength=R * M)
             - np.bincount(src * M + state.micro[items], weights=t, minlength=R * M))
    if state.count is not None:
        state.count += np.bincount(rank, minlength=R) - np.bincount(src, minlength=R)
    state.prev[items] = src
    state.dest[items] = rank
    state.micro[items] = slot
