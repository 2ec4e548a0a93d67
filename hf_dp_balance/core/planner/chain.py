"""Ladder trades for a full token cap: a large item for the cheapest-per-token items of one slot.

At a full cap with a strongly quadratic cost the imbalance sits in a few long samples, and no move
fits. A long sample costs more per token than short ones, so sending it to a light rank and taking
back as many tokens of that slot's cheapest-per-token items sheds most of its cost while every slot
keeps its tokens. A slot's items, cheapest per token first, form a "ladder": its prefix sums give,
for any tokens to free, the fewest items that free them and their cost, one binary search per option.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from hf_dp_balance.core.planner.state import _BREADTH, _LARGE, _OVERHEAD, _ROUNDS, _Members, _State, _pair_ranks
from hf_dp_balance.core.planner.trade import _apply
from hf_dp_balance.core.planner.trade_index import (_RADIX, _first_best, _float_order, _ranges, _search_within,
                                                    _stable_order)

_MIN_RATE = 0.2  # a trade sheds at least this share of the mean cost per token per token it sends


def _ladder_trades(state: _State, budget: np.ndarray, tolerance: float, min_rate: float = _MIN_RATE,
                   near: bool = False, partners_only: bool = False) -> bool:
    """Trade toward `budget` until no rank is above budget x (1 + tolerance / 2); True if it got there.

    A trade sends a large item `a` (over cap x _LARGE tokens) of an over-full rank h to a slot (l, m)
    of a rank l under budget, alone or in place of a large item `b` of that slot (b takes a's slot);
    (l, m) frees what a needs with a prefix of its ladder: its first items move to l's other slots
    while they have room, the rest go back to h. Each round pairs the over-full ranks, most over
    first, with _BREADTH partners each (`_pair_ranks`), tries h's large items (most cost above their
    tokens first; with `near`, those whose surplus just covers h's excess) and keeps per h the
    option with the most load taken off h per token sent (+ cap x _OVERHEAD), if at least `min_rate`
    x the mean cost per token; each partner takes one trade per round, an item moves once, a slot
    gives back once. A pass ends after 3 rounds in a row that trade for at most 2% of the over-full
    ranks (the partners shift, so a round or two may still find trades).

    Guarantees: every item keeps one (rank, slot); no slot goes over the cap; a trade lowers the
    larger of its two ranks' loads, so the fullest rank never rises; a rank keeps `state.min_count`
    items and a slot with items keeps one. Cost: one O(n) radix sort, then per round O(over-full
    ranks x 2 _BREADTH^3) binary searches inside one slot's ladder each.

    `partners_only`: build the ladders of the ranks a round pairs as it pairs them, not every slot's
    at the start (a residue pass with few over-full ranks reads few ladders); the same trades up to
    the last bits of the costs' prefix sums.
    """
    cap = state.cap
    R = state.load.shape[0]
    limit = budget * (1.0 + tolerance / 2.0)
    if cap is None or R < 2 or not np.any(state.load > limit):
        return not np.any(state.load > limit)
    lad = _make_ladders(state, near, partners_only)
    if lad is None:
        return False
    mean_rate = lad.mean_rate
    overhead = cap * _OVERHEAD
    min_rate = min_rate * mean_rate
    idle = 0
    for k in range(_ROUNDS):
        over, h, l = _pair_ranks(state, budget, limit, state.load - budget, _BREADTH, k)
        if over.size == 0:
            return True
        if h is None:
            return False
        if partners_only:
            _build_partner_ladders(state, lad, np.concatenate((h, l)))
        idle = 0 if _round(state, h, l, budget, limit, lad, overhead, min_rate) > 0.02 * over.size else idle + 1
        if idle >= 3:
            return False
    return not np.any(state.load > limit)


def _make_ladders(state: _State, near: bool, partners_only: bool):
    """What the rounds of `_ladder_trades` read (None without large items): every slot's ladder and its
    prefix sums (with `partners_only`: room for them), the large items by rank, by surplus and by cost."""
    R, M = state.load.shape[0], state.M
    tok, cost = state.tokens, state.costs
    n = cost.shape[0]
    S = R * M
    bins, large, _, scale, cost_scale, mean_rate = _item_keys(state)
    if large.size == 0:
        return None
    slot = state.dest * M + state.micro
    slot_items = np.bincount(slot, minlength=S)
    lad = SimpleNamespace(slot_items=slot_items.astype(np.int64),
                          stale=np.zeros(S, dtype=bool),  # slots an original item left: their ladders no longer hold
                          moved=np.zeros(n, dtype=bool))
    if partners_only:
        # slot s's ladder: order[lo[s]:hi[s]] once its rank is built; prefix sums with one leading 0
        lad.order, lad.CT, lad.CC = np.zeros(0, dtype=np.int64), np.zeros(1), np.zeros(1)
        lad.lo, lad.hi = np.zeros(S, dtype=np.int64), np.zeros(S, dtype=np.int64)
        lad.rank_of = np.zeros(n, dtype=np.int64)
        lad.built = np.zeros(R, dtype=bool)
        lad.members, lad.bins = _Members(state.dest, R), bins
    else:
        order = _ladders(bins, slot, _by_density(state) if S <= _RADIX else None)
        starts = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(slot_items, out=starts[1:])
        # prefix sums along the ladders (one leading 0): a prefix of slot s is CT[starts[s] + k] - CT[starts[s]]
        CT, CC = np.zeros(n + 1), np.zeros(n + 1)
        np.cumsum(tok[order], out=CT[1:])
        np.cumsum(cost[order], out=CC[1:])
        lad.order, lad.CT, lad.CC, lad.lo, lad.hi = order, CT, CC, starts[:-1], starts[1:]
        lad.rank_of = np.empty(n, dtype=np.int64)
        lad.rank_of[order] = np.arange(n)  # ladder position of every item
    lad.surplus_scale, lad.cost_scale, lad.near, lad.mean_rate = scale, cost_scale, near, mean_rate
    # rank r's large items once r is built: large[l_lo[r]:l_hi[r]], most cost above their tokens at the
    # lowest density first (the ones h sends), and by_cost[l_lo[r]:l_hi[r]] (those l gives back for a)
    lad.large, lad.surplus_key = np.zeros(0, dtype=np.int64), np.zeros(0)
    lad.by_cost, lad.cost_key = np.zeros(0, dtype=np.int64), np.zeros(0)
    lad.l_lo, lad.l_hi = np.zeros(R, dtype=np.int64), np.zeros(R, dtype=np.int64)
    # the largest cost key of the ranks below each rank (what the keys of all ranks hold just before its
    # stretch): a swap search whose answer falls below a partner's stretch finds no b there either
    ranks = state.dest[large]
    top = np.full(R, -np.inf)
    np.maximum.at(top, ranks, ranks + cost[large] * cost_scale)
    lad.below_top = np.concatenate(([-np.inf], np.maximum.accumulate(top)[:-1]))
    if not partners_only:
        by_rank = _stable_order(ranks, R)
        _append_large(state, lad, np.arange(R), large[by_rank], ranks[by_rank])
    return lad


def _cost_search(lad, ranks: np.ndarray, target: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """np.searchsorted(the cost keys of all ranks, target) for targets rank + c x scale (c x scale < 1/2):
    searched inside the rank's stretch [lo, hi], lo - 1 where the keys below the stretch reach it."""
    near = _search_within(lad.cost_key, target, lo, hi, clamp="both")
    return np.where(lad.below_top[ranks] >= target, lo - 1, near)


def _build_partner_ladders(state: _State, lad, ranks: np.ndarray) -> None:
    """Append the ladders of the slots of `ranks` not built yet, as a build of all at once holds them
    (items of the rank at the start of the pass by slot, density bin, index; moved ones left stale
    slots), and their large items by surplus and by cost (`_ladder_trades` with `partners_only`)."""
    new = np.unique(ranks[~lad.built[ranks]])
    if new.size == 0:
        return
    lad.built[new] = True
    M = state.M
    per_rank = [lad.members.of(int(r)) for r in new.tolist()]
    held = np.concatenate(per_rank)  # the ranks' items at the start of the pass, rank by rank, index order
    held_rank = np.repeat(new, [x.size for x in per_rank])
    items = held[~lad.moved[held]]
    slot = state.dest[items] * M + state.micro[items]
    items = items[np.lexsort((lad.bins[items], slot))]  # (stable: index order among ties)
    slot = state.dest[items] * M + state.micro[items]
    at = lad.order.size
    wanted = (new[:, None] * M + np.arange(M)[None, :]).reshape(-1)
    lad.lo[wanted] = at + np.searchsorted(slot, wanted, side="left")
    lad.hi[wanted] = at + np.searchsorted(slot, wanted, side="right")
    lad.rank_of[items] = at + np.arange(items.size)
    lad.order = np.concatenate((lad.order, items))
    lad.CT = np.concatenate((lad.CT, lad.CT[-1] + np.cumsum(state.tokens[items])))
    lad.CC = np.concatenate((lad.CC, lad.CC[-1] + np.cumsum(state.costs[items])))
    big = state.tokens[held] > state.cap * _LARGE  # (the large items of `_item_keys`; moved ones filtered where read)
    _append_large(state, lad, new, held[big], held_rank[big])


def _append_large(state: _State, lad, new: np.ndarray, mine: np.ndarray, ranks: np.ndarray) -> None:
    """Append the large items `mine` of ranks `new` (ascending; `ranks`: theirs, ascending, index order
    within one) by surplus and by cost: keys rank + a share under 1/2, ties by index."""
    _, large, surplus, scale, cost_scale, _ = _item_keys(state)
    at = lad.large.size
    starts = at + np.searchsorted(ranks, new)  # (`new` ascends, and so do the ranks of `mine`)
    lad.l_lo[new], lad.l_hi[new] = starts, np.append(starts[1:], at + mine.size)
    key = ranks + (1.0 - (surplus[np.searchsorted(large, mine)] + 1.0) * scale)
    by = _float_order(key)
    lad.large, lad.surplus_key = np.concatenate((lad.large, mine[by])), np.concatenate((lad.surplus_key, key[by]))
    key = ranks + state.costs[mine] * cost_scale
    by = _float_order(key)
    lad.by_cost, lad.cost_key = np.concatenate((lad.by_cost, mine[by])), np.concatenate((lad.cost_key, key[by]))


def _item_keys(state: _State):
    """Of the items alone, once per planning call (`state.item_memo`): log-spaced density bins (uint16),
    the large items, their cost above their tokens at the lowest density and its key scale, the scale of
    the large items' cost key, the mean cost per token."""
    got = state.item_memo.get("ladder")
    if got is None:
        tok, cost = state.tokens, state.costs
        dens = np.log(np.maximum(cost, 1e-300) / np.maximum(tok, 1e-300))
        d_min = float(np.min(cost / np.maximum(tok, np.finfo(np.float64).tiny)))
        lo, hi = float(dens.min()), float(dens.max())
        dens -= lo  # (in place: `dens` is this call's own array; the same floats as (dens - lo) * step)
        dens *= (_RADIX - 1) / max(hi - lo, 1e-12)
        bins = dens.astype(np.uint16)
        large = np.flatnonzero(tok > state.cap * _LARGE)
        if large.size == 0:
            got = (bins, large, None, None, None, None)
        else:
            surplus = cost[large] - d_min * tok[large]
            got = (bins, large, surplus, 1.0 / (float(surplus.max()) * 2.0 + 2.0),
                   1.0 / (float(cost[large].max()) * 2.0 + 2.0), float(cost.sum()) / max(float(tok.sum()), 1e-300))
        state.item_memo["ladder"] = got
    return got


def _by_density(state: _State) -> np.ndarray:
    """The items by density bin (ties: index), once per planning call (`state.item_memo`)."""
    got = state.item_memo.get("by_density")
    if got is None:
        got = state.item_memo["by_density"] = np.argsort(_item_keys(state)[0], kind="stable")
    return got


def _ladders(bins: np.ndarray, slot: np.ndarray, by_density=None) -> np.ndarray:
    """Items grouped by slot, cheapest per token first within a slot (ties: index): a radix sort of the
    slots in `by_density` order where every slot is under 2^16 (~2.3x faster), else a lexsort."""
    if by_density is not None and (slot.size == 0 or int(slot.max()) < _RADIX):
        # (narrowed before the gather: a random read of 1 MB, not 4 MB)
        return by_density[np.argsort(slot.astype(np.uint16)[by_density], kind="stable")]
    return np.lexsort((bins, slot))


def _round(state, h, l, budget, limit, lad, overhead, min_rate) -> int:
    """One trade per over-full rank h of the pairs (h[i], l[i]), every l in at most one; applied; returns
    how many. Options: a large item `a` of h into the _BREADTH roomiest slots of l, or in place of one of
    the _BREADTH large items `b` of l nearest in cost to what a should leave behind (`_evaluate`)."""
    M = state.M
    tok, cost = state.tokens, state.costs
    P = h.size
    # h's first unmoved large items (the list is short per rank: a window of twice the choices), or
    # (`near`) those whose surplus is nearest h's excess: a small excess is shed by a small trade
    first = lad.l_lo[h]
    if lad.near:
        # (a search of h's stretch only: h's keys are the ones in [h, h + 1), the target is under h + 1, and
        # an answer below h's first key is raised to it here anyway)
        at = _search_within(lad.surplus_key, h + (1.0 - (state.load[h] - budget[h] + 1.0) * lad.surplus_scale),
                            first, lad.l_hi[h], clamp="both")
        first = np.maximum(at - _BREADTH, first)
    pos = first[:, None] + np.arange(2 * _BREADTH)[None, :]
    inside = pos < lad.l_hi[h][:, None]
    pair = np.repeat(np.arange(P), inside.sum(axis=1))  # (the rows of `inside`, in order)
    a = lad.large[pos[inside]]
    keep = ~lad.moved[a]
    a, pair = a[keep], pair[keep]
    rank_in_pair = np.arange(a.size) - np.searchsorted(pair, pair)
    a, pair = a[rank_in_pair < _BREADTH], pair[rank_in_pair < _BREADTH]
    excess = state.load - budget
    # any trade of a scores at most h's excess per token of a (`_evaluate`): an a under min_rate by
    # that bound has no option that can score (late in a pass, most of them: h's excess is small)
    worth = np.flatnonzero(excess[h[pair]] / (tok[a] + overhead) >= min_rate)
    a, pair = a[worth], pair[worth]
    if a.size == 0:
        return 0
    want = np.minimum(excess[h], limit[l] - state.load[l])  # what a trade of pair i should move
    # a into the _BREADTH roomiest slots of l that still give back, no b
    W = min(_BREADTH, M)
    slots = _roomiest(np.where(lad.stale.reshape(-1, M)[l], np.inf, state.slot_tok[l]), W)
    a1 = np.repeat(a, W)
    p1 = np.repeat(pair, W)
    m1 = slots[p1, np.tile(np.arange(W), a.size)]
    # a in place of l's large items b nearest in cost to c_a - want
    lo, hi = lad.l_lo[l[pair]], lad.l_hi[l[pair]]
    # (np.searchsorted's answer, searched in l's stretch of the keys first: random queries of the whole
    # array miss the cache at every level)
    near = _cost_search(lad, l[pair], l[pair] + (cost[a] - want[pair]) * lad.cost_scale, lo, hi)
    pb = near[:, None] + np.arange(-(_BREADTH // 2), _BREADTH - _BREADTH // 2)[None, :]
    ok = (pb >= lo[:, None]) & (pb < hi[:, None])
    per_a = ok.sum(axis=1)
    a2, p2 = np.repeat(a, per_a), np.repeat(pair, per_a)
    b2 = lad.by_cost[pb[ok]]
    ok = ~lad.moved[b2]
    a2, p2, b2 = a2[ok], p2[ok], b2[ok]
    a = np.concatenate((a1, a2))
    pair = np.concatenate((p1, p2))
    b = np.concatenate((np.full(a1.size, -1, dtype=np.int64), b2))
    m = np.concatenate((m1, state.micro[b2]))
    opt = _evaluate(state, budget, limit, lad, a, b, h[pair], l[pair], m, want[pair], overhead, min_rate)
    if opt is None:
        return 0
    score = opt["score"]
    # per over-full rank its best trade (ties: the first option); then every l once, most over first
    first_of_pair = _first_best(pair, score, P)
    hw = h[pair[first_of_pair]]
    o = np.lexsort((first_of_pair, -score[first_of_pair], hw))
    chosen = first_of_pair[o]
    chosen = chosen[np.concatenate(([True], hw[o][1:] != hw[o][:-1]))]  # one per h
    chosen = chosen[np.argsort(pair[chosen], kind="stable")]  # over-full order
    lc = l[pair[chosen]]
    taken = np.full(state.load.shape[0], chosen.size, dtype=np.int64)
    np.minimum.at(taken, lc, np.arange(chosen.size))
    chosen = chosen[taken[lc] == np.arange(chosen.size)]
    return _carry_out(state, lad, {k: v[chosen] for k, v in opt.items()})


def _roomiest(full: np.ndarray, W: int) -> np.ndarray:
    """[P, W]: per row of `full` (tokens per slot) the W least full slots, ties by the lowest slot."""
    P, M = full.shape
    if W >= M:
        return np.broadcast_to(np.arange(M), (P, M))
    return np.argsort(full, axis=1, kind="stable")[:, :W]


def _evaluate(state, budget, limit, lad, a, b, hl, ll, m, want, overhead, min_rate, prune=True):
    """Every option's ladder cut and score (cost taken off h per token sent); None if none is feasible.

    (l, m) frees what a needs (beyond b's tokens) with a ladder prefix: its first items move to l's
    other slots while they have room (free: same rank; 10% kept for the packing; only without b), the
    rest go back to h, costing what h should shed as far as l can take it (`want`); where h's room
    allows no more pay-back, l may end over its limit if both end under h's load now."""
    cap, M = state.cap, state.M
    tok, cost = state.tokens, state.costs
    dst = ll * M + m
    ma = state.micro[a]
    src = hl * M + ma
    has_b = b >= 0
    bs = np.maximum(b, 0)
    tb = np.where(has_b, tok[bs], 0.0)
    cb = np.where(has_b, cost[bs], 0.0)
    ta, ca = tok[a], cost[a]
    flat_tok = state.slot_tok.reshape(-1)
    ok = ~lad.stale[dst] & (tb <= ta + cap - flat_tok[src])  # b fits a's slot
    # a score is at most h's excess per token of a and b (gain <= excess, tokens sent >= ta + tb, in floating
    # point too): an option under min_rate by that bound scores -inf (`prune`)
    if prune:
        ok &= (state.load[hl] - budget[hl]) / (ta + tb + overhead) >= min_rate
    if not ok.any():
        return None
    base = lad.lo[dst]
    end = lad.hi[dst]
    CT, CC = lad.CT, lad.CC
    room_l = cap - flat_tok[dst]
    rank_tok = state.slot_tok.sum(axis=1)  # (each row's sum as a gathered row sums it: the same floats)
    other = np.where(has_b, 0.0, cap * M - rank_tok[ll] - room_l)
    # the searches of the receiving slot's stretch of the ladders, base .. end: an answer past end + 1 (or
    # below j_in, from j_in on) changes none of the values below, so the searches are clamped there
    # (CT and CC are running sums of non-negative values over all the ladders: sorted as a whole)
    j_free = _search_within(CT, CT[base] + np.maximum(ta - tb - room_l, 0.0), base, end + 1, "left", "high")
    j_in = np.clip(_search_within(CT, CT[base] + 0.9 * other, base, end + 1, "right", "both") - 1, base,
                   np.minimum(j_free, end))
    room_h = ta - tb + (cap * M - rank_tok[hl])
    j_hi = np.minimum(_search_within(CT, CT[j_in] + room_h, j_in, end + 1, "right", "both") - 1, end)
    j = np.clip(_search_within(CC, CC[j_in] + ca - cb - want, j_in, end + 1, "left", "both"), j_free,
                np.maximum(j_hi, j_free))
    ok &= (j_free <= j_hi) & (j_free <= end) & (room_h >= 0)
    j = np.minimum(j, end)
    ok &= ~has_b | (lad.rank_of[bs] >= j)  # b is not in the ladder prefix
    back_tok = CT[j] - CT[j_in]
    n_back = j - j_in
    delta = ca - cb - (CC[j] - CC[j_in])
    load_h, load_l = state.load[hl], state.load[ll]
    after = np.maximum(load_h - delta, load_l + delta)
    ok &= (delta > 0) & (after < load_h * (1.0 - 1e-9))
    n_in = n_back + has_b
    ok &= (n_in > 0) | (lad.slot_items[src] > 1)  # a's slot keeps an item
    if state.count is not None:
        ok &= (state.count[hl] - 1 + n_in >= state.min_count) & (state.count[ll] + 1 - n_in >= state.min_count)
    gain = load_h - np.maximum(after, budget[hl])
    score = np.where(ok, gain / (ta + tb + back_tok + overhead), -np.inf)
    score[score < min_rate] = -np.inf
    if not np.isfinite(score).any():
        return None
    return {"score": score, "base": base, "j_in": j_in, "j": j, "a": a, "b": b, "h": hl, "l": ll, "m": m, "ma": ma}


def _carry_out(state, lad, t) -> int:
    """Apply the chosen trades `t`: a -> (l, m), b -> (h, ma), ladder [j_in, j) -> h, [base, j_in) -> l's
    other slots; a trade whose items do not fit is dropped (its slot takes no more); returns how many."""
    M = state.M
    tok = state.tokens
    has_b = t["b"] >= 0
    ta_net = tok[t["a"]] - np.where(has_b, tok[np.maximum(t["b"], 0)], 0.0)
    n_back = t["j"] - t["j_in"]
    n_intra = t["j_in"] - t["base"]
    back, to_back, ok = _place_back(state, lad.order, t["j_in"], n_back, t["h"], t["ma"], ta_net)
    intra, to_intra, ok_intra = _place_intra(state, lad.order, t["base"], t["j_in"], t["l"], t["m"])
    ok &= ok_intra
    lad.stale[(t["l"] * M + t["m"])[~ok]] = True  # the same trade would fail again
    of = np.repeat(np.arange(ok.size), n_back)
    back, to_back, of = back[ok[of]], to_back[ok[of]], of[ok[of]]
    of_in = np.repeat(np.arange(ok.size), n_intra)
    intra, to_intra, of_in = intra[ok[of_in]], to_intra[ok[of_in]], of_in[ok[of_in]]
    wb = np.flatnonzero(ok & has_b)
    items = np.concatenate((t["a"][ok], t["b"][wb], back, intra))
    to_rank = np.concatenate((t["l"][ok], t["h"][wb], t["h"][of], t["l"][of_in]))
    to_slot = np.concatenate((t["m"][ok], t["ma"][wb], to_back, to_intra))
    from_slot = state.dest[items] * M + state.micro[items]
    _apply(state, items, to_rank, to_slot)
    S = lad.slot_items.size
    lad.slot_items += np.bincount(to_rank * M + to_slot, minlength=S) - np.bincount(from_slot, minlength=S)
    lad.stale[from_slot] = True
    lad.moved[items] = True
    return int(np.count_nonzero(ok))


def _place_back(state, order, base, n_back, h, ma, ta):
    """(items, their slots on h, trade ok) of the pay-backs (ladder base .. base + n_back): into a's slot
    while it has room, else h's roomiest slot; a trade whose pay-back does not fit is not ok."""
    cap = state.cap
    size = n_back
    first = np.cumsum(size) - size
    pos, of = _ranges(base, base + size)
    back = order[pos]
    to = np.repeat(ma, size)
    ok = np.ones(h.size, dtype=bool)
    if back.size == 0:
        return back, to, ok
    room_ma = cap - state.slot_tok[h, ma] + ta
    cum = np.cumsum(state.tokens[back])
    cum -= np.repeat(np.concatenate(([0.0], cum))[first], size)  # within each trade
    spills = np.zeros(h.size, dtype=bool)
    spills[of[cum > room_ma[of]]] = True
    # the rest goes to h's other slots, roomiest first: item by item, all spilling trades at once
    t = np.flatnonzero(spills)
    room = cap - state.slot_tok[h[t]]
    room[np.arange(t.size), ma[t]] += ta[t]
    _fit_one_by_one(state.tokens[back], first, size, t, room, to, ok, lambda room, row, t, tk: np.where(
        room[row, ma[t]] >= tk, ma[t], np.argmax(room[row], axis=1)))
    return back, to, ok


def _place_intra(state, order, lo, hi, l, m):
    """(items, their new slots on l, trade ok): ladder lo .. hi leaves (l, m) for l's other slots: next
    fit, roomiest first, if that holds them all, else best fit, largest first; else not ok."""
    cap = state.cap
    size = hi - lo
    first = np.cumsum(size) - size
    pos, of = _ranges(lo, hi)
    items = order[pos]
    ok = np.ones(l.size, dtype=bool)
    # next fit over l's other slots, roomiest first, in ladder order (one search), checked per slot
    T = l.size
    room = cap - state.slot_tok[l].astype(np.float64)
    room[np.arange(T), m] = 0.0
    by_room = np.argsort(-room, axis=1, kind="stable")
    rooms = np.take_along_axis(room, by_room, axis=1)
    Mx = room.shape[1]
    t_items = state.tokens[items]
    end = np.cumsum(t_items)
    end -= np.repeat(np.concatenate(([0.0], end))[first], size)  # within each trade
    big = 4.0 * cap * Mx + 4.0
    cum = np.cumsum(rooms, axis=1) + (np.arange(T) * big)[:, None]
    at = np.searchsorted(cum.reshape(-1), end + of * big, side="left") - of * Mx
    at = np.minimum(at, Mx - 1)
    to = by_room[of, at]
    used = np.bincount(of * Mx + at, weights=t_items, minlength=T * Mx).reshape(T, Mx)
    overfull = (used > rooms).any(axis=1)  # a slot over its room (or no room left): the exact loop
    # else best fit, largest first (the ladder runs cheapest per token first: about shortest first):
    # item by item, all such trades at once
    t = np.flatnonzero((size > 0) & overfull)
    room = cap - state.slot_tok[l[t]]
    room[np.arange(t.size), m[t]] = -np.inf
    _fit_one_by_one(t_items, first, size, t, room, to, ok, lambda room, row, t, tk: np.argmin(
        np.where(room[row] >= tk[:, None], room[row], np.inf), axis=1), reverse=True)
    return items, to, ok


def _fit_one_by_one(tok, first, size, t, room, to, ok, choose, reverse=False) -> None:
    """Place the items of trades `t` one by one, all trades at once: item k of trade t is position
    first[t] + k (from the end with `reverse`) of `tok` (their tokens), into the slot `choose(room, row,
    t, tk)` picks in its row of `room` (tokens free per slot), written to `to`; a trade with an item
    that fits nowhere is not ok (`ok` False, its later items not placed)."""
    row = np.arange(t.size)
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
