"""Long items assigned to ranks first at a full cap, then short items as the filler.

At max_tokens = the pack length, 2-4 micro-batches and a strongly quadratic cost, the imbalance sits in the
long items (over a quarter of the cap): load sent to a rank with free tokens is cheap (about its tokens of
short items), between two full ranks dear (an item one way, as many tokens back). So a descent over moves and
swaps of long items between ranks picks their ranks first, minimising their tokens away from home plus what
the ranks' short items are then expected to send (`_assign_long`); each moves into its rank's roomiest slot
(room made inside the rank: `_mend`); short items of ranks over their limit flow to ranks with room, and
slots left over the cap are mended or spill (`_short_flow`).
"""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.state import _FEW_SLOTS, _Members, _State, _smallest_room

_LONG = 0.25  # items over this share of the cap are assigned first (8192 tokens at 32K packs)
_DENSITY = 1.5  # cost per token at which the estimate has short items carry a rank's excess
_DEAD = 3.0  # tokens charged per unit of a load deficit no free tokens can fill (a trade between full ranks)
_DEAD_TOKENS = 6.0  # tokens charged per token over M x cap that the rank's load excess does not carry out
_NEAR = 32  # candidates per long item and side: receivers nearest in load room, partners nearest in cost


def _rank_charge(x: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Estimated tokens a rank's short items will send, from its load over the limit `x` and its free tokens
    `room`: those that carry the excess out at _DENSITY, 1 + _DEAD_TOKENS per token over M x cap beyond them,
    and _DEAD per unit of a load deficit that the free tokens cannot take at _DENSITY."""
    carried = np.maximum(x, 0.0) / _DENSITY
    return (carried + (1.0 + _DEAD_TOKENS) * np.maximum(-room - carried, 0.0)
            + _DEAD * np.maximum(-x - _DENSITY * np.maximum(room, 0.0), 0.0))


def _assign_long(state: _State, budget: np.ndarray, tolerance: float, sweeps: int = 128, stop_share: float = 1e-4):
    """(long items, their ranks, the estimate there in tokens): a descent on the long items' tokens away from
    home plus `_rank_charge` summed over the ranks. A sweep applies the improving best options (`_best_option`)
    of the long items on ranks with a charge, best first, each rank and item at most once; the next scores the
    items of changed ranks and those whose option lost (all when none), until a full one gains < `stop_share`."""
    R, tok, lg = state.load.shape[0], state.tokens, np.flatnonzero(state.tokens > state.cap * _LONG)
    if lg.size == 0:
        return lg, lg, 0.0
    home, cl, tl = state.dest[lg], state.costs[lg], tok[lg]
    d, by_cost, off = home.copy(), np.argsort(cl, kind="stable"), _offsets(R)
    CL, TL = np.bincount(d, weights=cl, minlength=R), np.bincount(d, weights=tl, minlength=R)
    base_x = state.load - CL - budget * (1.0 + tolerance / 2.0)  # the short items' load against the limit
    base_room = state.cap * state.M - state.slot_tok.sum(axis=1) + TL
    todo, stop = np.ones(lg.size, dtype=bool), stop_share * float(tok.sum())
    for _ in range(sweeps):
        x, room = base_x + CL, base_room - TL
        f = _rank_charge(x, room)
        act = np.flatnonzero((f[d] > 0) & todo)
        # in blocks whose temporaries stay in cache (1.3-1.5x the whole call without, at 512-2048 x 4)
        g, to, mate = (np.concatenate(v) for v in zip((np.zeros(0, dtype=np.int64),) * 3, *[_best_option(
            act[b:b + 256], d, home, cl, tl, x, room, f, by_cost, off) for b in range(0, act.size, 256)]))
        good = np.flatnonzero(g < -1e-6)
        good = [v[good[np.argsort(g[good], kind="stable")]] for v in (act, to, mate, g)]
        used_rank, used, gained = np.zeros(R, dtype=bool), np.zeros(lg.size, dtype=bool), 0.0
        for a, s, b, gk in zip(*(v.tolist() for v in good)):
            r = d[a]  # (an item applied earlier marks its later options used: their ranks are stale)
            if not (used_rank[r] or used_rank[s] or used[a] or (b >= 0 and used[b])):
                used_rank[r] = used_rank[s] = used[a] = True
                d[a], gained = s, gained - gk
                if b >= 0:  # a swap: b goes back
                    used[b], d[b] = True, r
        if todo.all() and gained < stop:
            break
        CL, TL = np.bincount(d, weights=cl, minlength=R), np.bincount(d, weights=tl, minlength=R)
        todo = used_rank[d]  # the items of changed ranks, and options that lost to another
        todo[good[0]] |= ~used[good[0]]
        todo |= not todo.any()
    return lg, d, float(tl[d != home].sum() + _rank_charge(base_x + CL, base_room - TL).sum())


def _best_option(act, d, home, cl, tl, x, room, f, by_cost, off):
    """(gain, other rank, swap partner or -1 for a move) of the best option of each long item a in `act`: a move
    to a rank at `off` around a's best fit in load room, or a swap with a long item at `off` around the cost
    that leaves a's rank at its limit. A gain: both ranks' charges and the items' tokens away, after - before."""
    r, ca, ta, ha = d[act], cl[act][:, None], tl[act][:, None], home[act][:, None]
    away = (r[:, None] != ha) * 1.0
    f_left = _rank_charge(x[r] - cl[act], room[r] + tl[act]) - f[r]
    by_x = np.argsort(x, kind="stable")
    s = by_x[np.clip(np.searchsorted(x[by_x], -cl[act])[:, None] + off, 0, x.shape[0] - 1)]
    gain_m = _rank_charge(x[s] + ca, room[s] - ta) - f[s] + f_left[:, None] + ((s != ha) - away) * ta
    gain_m[s == r[:, None]] = np.inf
    want = cl[act] - np.maximum(x[r], 0.0)  # the partner's cost that leaves r at its limit
    p = by_cost[np.clip(np.searchsorted(cl[by_cost], want)[:, None] + off, 0, by_cost.shape[0] - 1)]
    rb, dc, dt, r2 = d[p], ca - cl[p], ta - tl[p], r[:, None]
    gain_s = (_rank_charge(x[r2] - dc, room[r2] + dt) - f[r2] + _rank_charge(x[rb] + dc, room[rb] - dt) - f[rb]
              + ((rb != ha) - away) * ta + ((r2 != home[p]) * 1.0 - (rb != home[p])) * tl[p])
    gain_s[rb == r2] = np.inf
    rows, jm, js = np.arange(act.size), np.argmin(gain_m, axis=1), np.argmin(gain_s, axis=1)
    gm, gs = gain_m[rows, jm], gain_s[rows, js]
    move = gm <= gs
    return np.minimum(gm, gs), np.where(move, s[rows, jm], rb[rows, js]), np.where(move, -1, p[rows, js])


def _offsets(num_ranks: int) -> np.ndarray:
    """A best fit's window: _NEAR places each side, spread above 512 ranks to span an eighth of them."""
    return np.arange(-_NEAR, _NEAR) * max(1, num_ranks // 512)


def _long_first_applies(state: _State) -> bool:
    """A token cap, tokens, and 2 to _FEW_SLOTS micro-batches."""
    return state.cap is not None and state.tokens is not None and 2 <= state.M <= _FEW_SLOTS


def _long_first(state: _State, budget: np.ndarray, tolerance: float, assigned=None) -> None:
    """The module docstring's method after `_assign_long` (its result `assigned`, else it runs here), on
    `state`; the caller checks `_long_first_applies`. No move leaves a rank under `state.min_count` items."""
    items, ranks, _ = _assign_long(state, budget, tolerance) if assigned is None else assigned
    if items.size == 0:
        return
    order = np.argsort(-state.tokens[items], kind="stable")  # longest first
    members = _Members(state.dest, state.load.shape[0])  # the items of each rank before the moves
    for i, r in zip(items[order].tolist(), ranks[order].tolist()):
        if state.dest[i] != r and (state.count is None or state.count[state.dest[i]] > state.min_count):
            m = int(np.argmax(state.cap - state.slot_tok[r]))
            _mend(state, r, m, float(state.tokens[i]), members.of(r))
            state.move(i, r, m)
    _short_flow(state, budget * (1.0 + tolerance / 2.0), tolerance, state.cap * _LONG)


def _mend(state: _State, r: int, m: int, need: float, members: np.ndarray, steps: int = 64) -> bool:
    """Free `need` tokens in slot (r, m) (True if done) by moving an item of m, or swapping it for a smaller one,
    into another of r's slots with room: the step that covers the shortfall (else the most of it) shifting the
    fewest tokens, until done or none helps. `members`: indexes that hold r's items (others may be among them)."""
    items, M = members[state.dest[members] == r], state.M
    for _ in range(steps):
        room = state.cap - state.slot_tok[r]
        short = need - float(room[m])
        if short <= 0:
            return True
        mine, other = items[state.micro[items] == m], items[state.micro[items] != m]
        to = np.concatenate((np.arange(M), state.micro[other]))  # a move to slot s: a swap for nothing in s
        shed = state.tokens[mine][:, None] - np.concatenate((np.zeros(M), state.tokens[other]))[None, :]
        score = np.where((shed > 0) & (shed <= room[to]) & (to != m), np.maximum(short - shed, 0.0) * 1e6 + shed,
                         np.inf).reshape(-1)
        k = int(np.argmin(score)) if score.size else 0
        if not score.size or not np.isfinite(score[k]):
            return False
        a, b = divmod(k, to.size)
        state.move(int(mine[a]), r, int(to[b]))
        if b >= M:
            state.move(int(other[b - M]), r, m)
    return False


def _short_flow(state: _State, limit: np.ndarray, tolerance: float, small: float, over_shoot: float = 0.5) -> None:
    """Ranks over their `limit` (most over first) send items of at most `small` tokens and of at most twice their
    excess (or it plus `over_shoot` x their half tolerance) until under it, each to the rank with load and token
    room whose load room per free token is nearest the item's cost per token, into its best-fitting slot; then
    `_repair`."""
    R, cap, full, tok = state.load.shape[0], state.cap, state.cap * state.M, state.tokens
    dens = state.costs / np.maximum(tok, 1e-300)
    room, fit, ratio = np.empty(R), np.empty(R), np.empty(R)
    def update(r):  # load room, the largest item the rank's tokens take, log(load room per free token)
        room[r] = limit[r] - state.load[r]
        free = full - state.slot_tok[r].sum(axis=-1)
        ratio[r] = np.log(np.maximum(room[r], 1e-9) / np.maximum(free, 1.0))
        fit[r] = np.minimum((cap - state.slot_tok[r]).max(axis=-1), free)
    update(np.arange(R))
    members, over = _Members(state.dest, R), state.load - limit
    for h in np.flatnonzero(over > 0)[np.argsort(-over[over > 0], kind="stable")].tolist():
        mine = members.of(h)[tok[members.of(h)] <= small]  # (all still on h: only h sends them)
        over_load, over_tok = float(state.load[h] - limit[h]), float(state.slot_tok[h].sum() - full)
        # densest first (fewest tokens for the load); over in tokens too: the density that ends both
        key = np.abs(np.log(dens[mine]) - np.log(over_load / over_tok)) if over_tok > 0 else -dens[mine]
        for i in mine[np.argsort(key, kind="stable")].tolist():
            if over_load <= 0 or (state.count is not None and state.count[h] <= state.min_count):
                break
            ci, ti = float(state.costs[i]), float(tok[i])
            if ci > over_load + over_shoot * tolerance / 2.0 * limit[h] and ci > 2.0 * over_load:
                continue
            near = np.where((room >= ci) & (fit >= ti), np.abs(ratio - np.log(max(dens[i], 1e-300))), np.inf)
            near[h] = np.inf
            r = int(np.argmin(near))
            if near[r] < np.inf:  # a rank with room for it
                state.move(i, r, max(_smallest_room((cap - state.slot_tok[r]).tolist(), ti), 0))
                update([h, r])
                over_load = float(state.load[h] - limit[h])
    _repair(state, limit)


def _repair(state: _State, limit: np.ndarray) -> None:
    """Every slot over the cap is mended inside its rank (`_mend`), else sends its smallest items but one, each
    to the slot with room on another rank that ends least full against its `limit` (the trades mend loads)."""
    cap, tok, members = state.cap, state.tokens, _Members(state.dest, state.load.shape[0])
    for h in np.flatnonzero((state.slot_tok > cap).any(axis=1)).tolist():
        for m in np.flatnonzero(state.slot_tok[h] > cap).tolist():
            if _mend(state, h, m, 0.0, members.of(h)):
                continue
            mine = np.flatnonzero((state.dest == h) & (state.micro == m))
            for i in mine[np.argsort(tok[mine], kind="stable")][:-1].tolist():
                free = cap - state.slot_tok
                fits = (free >= tok[i]) & (np.arange(free.shape[0]) != h)[:, None]
                if state.slot_tok[h, m] <= cap or not fits.any() or (state.count is not None
                                                                     and state.count[h] <= state.min_count):
                    break
                r = int(np.argmin(np.where(fits.any(axis=1), (state.load + state.costs[i]) / limit, np.inf)))
                state.move(i, r, int(np.argmin(np.where(fits[r], free[r], np.inf))))
