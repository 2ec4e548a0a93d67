"""Ladder trades for a full token cap: a large item for the cheapest-per-token items of one slot.

At a full cap with a strongly quadratic cost no move fits and the imbalance sits in a few long samples,
which cost more per token than short ones: sending one to a light rank and taking back as many tokens of
that slot's cheapest-per-token items sheds most of its cost while every slot keeps its tokens. A slot's
items, cheapest per token first, form its "ladder"; the ladder's running sums give, for any tokens to free,
the fewest items that free them and their cost (one binary search per option).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hf_dp_balance.core.planner.state import _BREADTH, _LARGE, _OVERHEAD, _ROUNDS, _State, _pair_ranks
from hf_dp_balance.core.planner.trade import _apply, _first_touching
from hf_dp_balance.core.planner.trade_index import (_RADIX, _by_rank_and_cost, _first_best, _float_order, _ranges,
                                                    _search_within, _stable_order)

_MIN_RATE = 0.2  # a trade sheds at least this share of the mean cost per token per token it sends


def _ladder_trades(state: _State, budget: np.ndarray, tolerance: float, min_rate: float = _MIN_RATE,
                   near: bool = False) -> bool:
    """Trade toward `budget` until no rank is above budget x (1 + tolerance / 2); True if it got there.

    A trade sends a large item `a` (over cap x _LARGE tokens) of an over-full rank h to a slot (l, m) of a rank
    l under budget, alone or in place of a large item `b` of l (b takes a's slot); (l, m) frees what a needs
    with a prefix of its ladder: the first items go to l's other slots while they have room, the rest back to
    h. A round pairs the over-full ranks, most over first, with _BREADTH partners (`_pair_ranks`), tries h's
    large items (most cost above their tokens first; with `near`, those whose surplus just covers h's excess)
    and keeps per h the option taking the most load off h per token sent (+ cap x _OVERHEAD), if at least
    `min_rate` x the mean cost per token; a partner takes one trade a round, an item moves once, a slot gives
    back once. A pass ends after 3 rounds in a row trading for at most 2% of the over-full ranks.
    Guarantees: every item keeps one (rank, slot); no slot goes over the cap; the fullest rank never rises (a
    trade lowers the larger of its two ranks' loads); a rank keeps `state.min_count` items, a slot with items
    keeps one. Cost: one O(n) radix sort, then per round O(over-full ranks x 2 _BREADTH^3) binary searches.
    """
    limit = budget * (1.0 + tolerance / 2.0)
    if state.cap is None or state.load.shape[0] < 2 or not np.any(state.load > limit):
        return not np.any(state.load > limit)
    # only ranks under budget (partners) or over the limit (senders) ever trade: only their slots need ladders
    lad = _make_ladders(state, near, (state.load < budget) | (state.load > limit))
    if lad is None:
        return False
    overhead, min_rate, idle = state.cap * _OVERHEAD, min_rate * lad.mean_rate, 0
    for k in range(_ROUNDS):
        over, h, l = _pair_ranks(state, budget, limit, state.load - budget, _BREADTH, k)
        if over.size == 0 or h is None:
            return over.size == 0
        idle = 0 if _round(state, h, l, budget, limit, lad, overhead, min_rate) > 0.02 * over.size else idle + 1
        if idle >= 3:
            return False
    return not np.any(state.load > limit)


def _make_ladders(state: _State, near: bool, trading=None):
    """What the rounds of `_ladder_trades` read (None without large items): the large items and the ladders of
    the slots of the `trading` ranks (a mask; None: all), built at the start of the pass (one radix sort)."""
    R, M, n = state.load.shape[0], state.M, state.costs.shape[0]
    by_density, large, surplus, scale, cost_scale, mean_rate = _item_keys(state)
    if large.size == 0:
        return None
    slot = state.dest * M + state.micro
    if trading is not None:
        by_density = by_density[trading[state.dest[by_density]]]
    slot_items = np.bincount(slot[by_density], minlength=R * M).astype(np.int64)
    # slot s's ladder is order[lo[s]:hi[s]] (items by slot, cheapest per token first); CT, CC: running tokens and
    # costs along `order` after a leading 0, so that a prefix of k items of slot s holds CT[lo[s] + k] - CT[lo[s]]
    # tokens; rank_of: each item's place in `order`
    order = _ladders(by_density, slot, R * M)
    hi = np.cumsum(slot_items)
    rank_of = np.full(n, -1, dtype=np.int64)
    rank_of[order] = np.arange(order.size)
    lad = SimpleNamespace(
        near=near, mean_rate=mean_rate, surplus_scale=scale, cost_scale=cost_scale, slot_items=slot_items,
        stale=np.zeros(R * M, dtype=bool),  # slots an original item left: their ladders no longer hold
        moved=np.zeros(n, dtype=bool), order=order, lo=hi - slot_items, hi=hi, rank_of=rank_of,
        CT=np.concatenate(([0.0], np.cumsum(state.tokens[order]))),
        CC=np.concatenate(([0.0], np.cumsum(state.costs[order]))))
    # rank r's large items large[l_lo[r]:l_hi[r]], most cost above their tokens at the lowest density first
    # (the ones h sends), and by_cost[l_lo[r]:l_hi[r]] (those l gives back for a): sorted keys rank + a share
    # of 1 (over 1/2 for large, under for by_cost), ties by index; grouped by rank first (a radix sort), so that
    # the key sorts only move each rank's stretch
    by_rank = _stable_order(state.dest[large], R)
    mine = large[by_rank]
    key = state.dest[mine] + (1.0 - (surplus[by_rank] + 1.0) * scale)
    by = _float_order(key)
    lad.large, lad.surplus_key = mine[by], key[by]
    lad.by_cost, starts, lad.cost_key, _ = _by_rank_and_cost(mine, state.dest, state.costs, cost_scale, R)
    lad.l_lo, lad.l_hi = starts[:-1], starts[1:]
    return lad


def _item_keys(state: _State):
    """Of the items alone, once per planning call (`state.item_memo`): the items by log-spaced density bin (16
    bits; ties: index), the large items, their cost above their tokens at the lowest density, the key scales
    of that surplus and of their cost (rank + value x scale stays under rank + 1/2), the mean cost per token."""
    got = state.item_memo.get("ladder")
    if got is None:
        tok, cost = state.tokens, state.costs
        dens = np.log(np.maximum(cost, 1e-300) / np.maximum(tok, 1e-300))
        lo, hi = float(dens.min()), float(dens.max())
        dens -= lo  # (in place: `dens` is this call's own array; the same floats as (dens - lo) * step)
        dens *= (_RADIX - 1) / max(hi - lo, 1e-12)
        large = np.flatnonzero(tok > state.cap * _LARGE)
        got = (np.argsort(dens.astype(np.uint16), kind="stable"), large, None, None, None, None)
        if large.size:
            surplus = cost[large] - float(np.min(cost / np.maximum(tok, np.finfo(np.float64).tiny))) * tok[large]
            scales = [1.0 / (float(top) * 2.0 + 2.0) for top in (surplus.max(), cost[large].max())]
            got = got[:2] + (surplus, *scales, float(cost.sum()) / max(float(tok.sum()), 1e-300))
        state.item_memo["ladder"] = got
    return got


def _ladders(by_density: np.ndarray, slot: np.ndarray, slots: int) -> np.ndarray:
    """Items grouped by slot, cheapest per token first within a slot (ties: index): a stable sort by slot of
    the density order (a radix sort where the slots fit 16 bits, narrowed before the gather)."""
    return by_density[np.argsort((slot.astype(np.uint16) if slots <= _RADIX else slot)[by_density], kind="stable")]


def _round(state, h, l, budget, limit, lad, overhead, min_rate) -> int:
    """One trade per over-full rank h of the pairs (h[i], l[i]), every l in at most one; applied; returns how
    many. Options: a large item `a` of h into the _BREADTH roomiest slots of l, or in place of one of the
    _BREADTH large items `b` of l nearest in cost to what a should leave behind (`_evaluate`)."""
    M, tok, cost, excess = state.M, state.tokens, state.costs, state.load - budget
    # h's first _BREADTH unmoved large items (read from a window of twice as many), or (`near`) those whose
    # surplus is nearest h's excess: a small excess is shed by a small trade
    first = lad.l_lo[h]
    if lad.near:  # (h's keys lie in [h, h + 1), the target under h + 1: a search of h's stretch only)
        at = _search_within(lad.surplus_key, h + (1.0 - (excess[h] + 1.0) * lad.surplus_scale), first, lad.l_hi[h],
                            clamp="both")
        first = np.maximum(at - _BREADTH, first)
    pos, pair = _ranges(first, np.minimum(first + 2 * _BREADTH, lad.l_hi[h]))
    unmoved = np.flatnonzero(~lad.moved[lad.large[pos]])
    a, pair = lad.large[pos[unmoved]], pair[unmoved]
    # any trade of a scores at most h's excess per token of a (`_evaluate`): an a under min_rate by
    # that bound has no option that can score (late in a pass, most of them: h's excess is small)
    keep = (np.arange(a.size) - np.searchsorted(pair, pair) < _BREADTH) & (
        excess[h[pair]] / (tok[a] + overhead) >= min_rate)
    a, pair = a[keep], pair[keep]
    if a.size == 0:
        return 0
    want = np.minimum(excess[h], limit[l] - state.load[l])  # what a trade of pair i should move
    # a alone into the _BREADTH roomiest slots of l that still give back (ties: the lowest slot)
    W = min(_BREADTH, M)
    slots = np.broadcast_to(np.arange(M), (l.size, M)) if W == M else np.argsort(
        np.where(lad.stale.reshape(-1, M)[l], np.inf, state.slot_tok[l]), axis=1, kind="stable")[:, :W]
    a1, p1, m1 = np.repeat(a, W), np.repeat(pair, W), slots[pair].reshape(-1)
    # a in place of l's large items b nearest in cost to c_a - want (l's keys lie in [l, l + 1/2): a search
    # falling below l's stretch finds no b)
    lp = l[pair]
    lo, hi = lad.l_lo[lp], lad.l_hi[lp]
    near = np.maximum(np.searchsorted(lad.cost_key, lp + (cost[a] - want[pair]) * lad.cost_scale), lo - 1)
    pos, of = _ranges(np.maximum(near - _BREADTH // 2, lo), np.minimum(near + _BREADTH - _BREADTH // 2, hi))
    unmoved = np.flatnonzero(~lad.moved[lad.by_cost[pos]])
    of, b2 = of[unmoved], lad.by_cost[pos[unmoved]]
    a, pair = np.concatenate((a1, a[of])), np.concatenate((p1, pair[of]))
    b = np.concatenate((np.full(a1.size, -1, dtype=np.int64), b2))
    m = np.concatenate((m1, state.micro[b2]))
    opt = _evaluate(state, budget, lad, a, b, h[pair], l[pair], m, want[pair], overhead, min_rate)
    if opt is None:
        return 0
    # per over-full rank its best trade (ties: the first option); in over-full order, every l's first
    chosen = _first_best(h[pair], opt["score"], state.load.shape[0])
    chosen = chosen[np.argsort(pair[chosen], kind="stable")]
    chosen = chosen[_first_touching(state.load.shape[0], l[pair[chosen]])]
    return _carry_out(state, lad, {k: v[chosen] for k, v in opt.items()})


def _evaluate(state, budget, lad, a, b, hl, ll, m, want, overhead, min_rate, prune=True):
    """Every option's ladder cut and score (cost taken off h per token sent); None if none is feasible.
    (l, m) frees what a needs (beyond b's tokens) with a ladder prefix: its first items move to l's other
    slots while they have room (free: same rank; 10% kept for the packing; only without b), the rest go back
    to h, costing what h should shed as far as l can take it (`want`); where h's room allows no more pay-back,
    l may end over its limit if both end under h's load now."""
    cap, M, CT, CC = state.cap, state.M, lad.CT, lad.CC
    dst, ma = ll * M + m, state.micro[a]
    src = hl * M + ma
    has_b, bs = b >= 0, np.maximum(b, 0)
    ta, ca = state.tokens[a], state.costs[a]
    tb, cb = np.where(has_b, state.tokens[bs], 0.0), np.where(has_b, state.costs[bs], 0.0)
    flat_tok = state.slot_tok.reshape(-1)
    ok = ~lad.stale[dst] & (tb <= ta + cap - flat_tok[src])  # b fits a's slot
    # a score is at most h's excess per token of a and b (gain <= excess, tokens sent >= ta + tb, in floating
    # point too): an option under min_rate by that bound scores -inf (`prune`)
    if prune:
        ok &= (state.load[hl] - budget[hl]) / (ta + tb + overhead) >= min_rate
    if not ok.any():
        return None
    base, end = lad.lo[dst], lad.hi[dst]
    room_l = cap - flat_tok[dst]
    rank_tok = state.slot_tok.sum(axis=1)  # (each row's sum as a gathered row sums it: the same floats)
    other = np.where(has_b, 0.0, cap * M - rank_tok[ll] - room_l)
    # the searches of the receiving slot's stretch of the running sums (sorted as a whole), base .. end: an
    # answer past end + 1 (or below j_in, from j_in on) changes none of the values below, hence the clamps
    j_free = _search_within(CT, CT[base] + np.maximum(ta - tb - room_l, 0.0), base, end + 1, "left", "high")
    j_in = np.clip(_search_within(CT, CT[base] + 0.9 * other, base, end + 1, "right", "both") - 1, base,
                   np.minimum(j_free, end))
    room_h = ta - tb + (cap * M - rank_tok[hl])
    j_hi = np.minimum(_search_within(CT, CT[j_in] + room_h, j_in, end + 1, "right", "both") - 1, end)
    j = np.minimum(np.clip(_search_within(CC, CC[j_in] + ca - cb - want, j_in, end + 1, "left", "both"), j_free,
                           np.maximum(j_hi, j_free)), end)
    ok &= (j_free <= j_hi) & (j_free <= end) & (room_h >= 0) & (~has_b | (lad.rank_of[bs] >= j))  # b not in the prefix
    delta = ca - cb - (CC[j] - CC[j_in])
    load_h, load_l = state.load[hl], state.load[ll]
    after = np.maximum(load_h - delta, load_l + delta)
    n_in = j - j_in + has_b
    ok &= (delta > 0) & (after < load_h * (1.0 - 1e-9)) & ((n_in > 0) | (lad.slot_items[src] > 1))  # a's slot keeps one
    if state.count is not None:
        ok &= (state.count[hl] - 1 + n_in >= state.min_count) & (state.count[ll] + 1 - n_in >= state.min_count)
    score = np.where(ok, (load_h - np.maximum(after, budget[hl])) / (ta + tb + (CT[j] - CT[j_in]) + overhead), -np.inf)
    score[score < min_rate] = -np.inf
    if not np.isfinite(score).any():
        return None
    return {"score": score, "base": base, "j_in": j_in, "j": j, "a": a, "b": b, "h": hl, "l": ll, "m": m, "ma": ma}


def _carry_out(state, lad, t) -> int:
    """Apply the chosen trades `t`: a -> (l, m), b -> (h, ma), ladder [j_in, j) -> h, [base, j_in) -> l's
    other slots; a trade whose items do not fit is dropped (its slot takes no more); returns how many."""
    M, tok = state.M, state.tokens
    a, b, h, l, m, ma = t["a"], t["b"], t["h"], t["l"], t["m"], t["ma"]
    with_b = b >= 0
    n_back, n_intra = t["j"] - t["j_in"], t["j_in"] - t["base"]
    back, to_back, ok = _place_back(state, lad.order, t["j_in"], n_back, h, ma,
                                    tok[a] - np.where(with_b, tok[np.maximum(b, 0)], 0.0))
    intra, to_intra, ok_intra = _place_intra(state, lad.order, t["base"], t["j_in"], l, m)
    ok &= ok_intra
    lad.stale[(l * M + m)[~ok]] = True  # the same trade would fail again
    with_b &= ok
    moves = [(a[ok], l[ok], m[ok]), (b[with_b], h[with_b], ma[with_b])]  # (items, to rank, to slot)
    for items, to, size, rank in ((back, to_back, n_back, h), (intra, to_intra, n_intra, l)):
        of = np.repeat(np.arange(ok.size), size)
        moves.append((items[ok[of]], rank[of[ok[of]]], to[ok[of]]))
    items, to_rank, to_slot = (np.concatenate(x) for x in zip(*moves))
    from_slot = state.dest[items] * M + state.micro[items]
    _apply(state, items, to_rank, to_slot)
    S = lad.slot_items.size
    lad.slot_items += np.bincount(to_rank * M + to_slot, minlength=S) - np.bincount(from_slot, minlength=S)
    lad.stale[from_slot] = True
    lad.moved[items] = True
    return int(np.count_nonzero(ok))


def _stretches(state, order, lo, size):
    """(items, their tokens, the trade of each, where each trade's items begin, running tokens within each
    trade) of the ladder stretches order[lo[t]:lo[t] + size[t]] of trades t."""
    pos, of = _ranges(lo, lo + size)
    items = order[pos]
    tk = state.tokens[items]
    first = np.cumsum(size) - size
    run = np.cumsum(tk)
    run -= np.repeat(np.concatenate(([0.0], run))[first], size)
    return items, tk, of, first, run


def _place_back(state, order, base, n_back, h, ma, ta):
    """(items, their slots on h, trade ok) of the pay-backs (ladder base .. base + n_back): into a's slot
    while it has room, else h's roomiest slot; a trade whose pay-back does not fit is not ok."""
    back, tk, of, first, run = _stretches(state, order, base, n_back)
    to = np.repeat(ma, n_back)
    # the trades whose pay-back outgrows a's slot place it item by item into h's slots, all at once
    t = np.unique(of[run > (state.cap - state.slot_tok[h, ma] + ta)[of]])
    room = state.cap - state.slot_tok[h[t]]
    room[np.arange(t.size), ma[t]] += ta[t]
    return back, to, _fit_one_by_one(tk, first, n_back, t, room, to, lambda room, row, t, tk: np.where(
        room[row, ma[t]] >= tk, ma[t], np.argmax(room[row], axis=1)))


def _place_intra(state, order, lo, hi, l, m):
    """(items, their new slots on l, trade ok): ladder lo .. hi leaves (l, m) for l's other slots: next
    fit, roomiest first, if that holds them all, else best fit, largest first; else not ok."""
    cap, T, M = state.cap, l.size, state.M
    items, tk, of, first, end = _stretches(state, order, lo, hi - lo)
    # next fit over l's other slots, roomiest first, in ladder order (one search of all trades' rows, each
    # offset by more than any row's room), checked per slot
    room = cap - state.slot_tok[l].astype(np.float64)
    room[np.arange(T), m] = 0.0
    by_room = np.argsort(-room, axis=1, kind="stable")
    rooms = np.take_along_axis(room, by_room, axis=1)
    big = 4.0 * cap * M + 4.0
    cum = np.cumsum(rooms, axis=1) + (np.arange(T) * big)[:, None]
    at = np.minimum(np.searchsorted(cum.reshape(-1), end + of * big, side="left") - of * M, M - 1)
    to = by_room[of, at]
    used = np.bincount(of * M + at, weights=tk, minlength=T * M).reshape(T, M)
    # a slot over its room (or no room left): best fit, largest first (the ladder runs cheapest per token
    # first: about shortest first), item by item, all such trades at once
    t = np.flatnonzero((hi > lo) & (used > rooms).any(axis=1))
    room = cap - state.slot_tok[l[t]]
    room[np.arange(t.size), m[t]] = -np.inf
    return items, to, _fit_one_by_one(tk, first, hi - lo, t, room, to, lambda room, row, t, tk: np.argmin(
        np.where(room[row] >= tk[:, None], room[row], np.inf), axis=1), reverse=True)


def _fit_one_by_one(tok, first, size, t, room, to, choose, reverse=False) -> np.ndarray:
    """Place the items of trades `t` one by one, all trades at once: item k of trade t, at first[t] + k (from
    the end with `reverse`) of `tok`, into the slot `choose(room, row, t, tk)` picks in its row of `room`
    (tokens free per slot), written to `to`. Returns whether each trade placed all (it stops at an item that
    fits nowhere)."""
    ok, row = np.ones(size.size, dtype=bool), np.arange(t.size)
    for k in range(int(size[t].max()) if t.size else 0):
        go = np.flatnonzero(size[t] > k)  # trades still placing (a failed one is dropped below)
        t, row = t[go], row[go]
        p = first[t] + (size[t] - 1 - k if reverse else k)
        tk = tok[p]
        s = choose(room, row, t, tk)
        fits = room[row, s] >= tk
        ok[t[~fits]] = False
        t, row, p, s, tk = t[fits], row[fits], p[fits], s[fits], tk[fits]
        room[row, s] -= tk
        to[p] = s
    return ok
