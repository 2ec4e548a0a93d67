"""Long items assigned to ranks first at a full cap, then short items as the filler.

At max_tokens = the pack length with a strongly quadratic cost, the imbalance sits in the long items, and every
rank must end almost exactly at the goal. Moving cost between two full ranks is dear (an item of surplus
q L^2 >= T goes one way and about as many tokens back, ~2 sqrt(T / q) tokens for a transfer T); into a rank
with free tokens it is cheap (~T tokens of short items). So the plan is made in the order its cost is decided:
1. `_assign_long`: which rank holds each long item; 2. `_place_long`: those moves; 3. `_short_flow`: short
items as the filler. The incremental method and the full-cap trades then finish what is left (pipeline.py).
"""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.refine import _apply_swap
from hf_dp_balance.core.planner.state import _FEW_SLOTS, _Members, _State, _smallest_room

_LONG = 0.25  # items over this share of the cap are assigned first (8192 tokens at 32K packs)
_DENSITY = 1.5  # cost per token at which the estimate has short items carry a rank's excess
_DEAD = 3.0  # tokens charged per unit of a load deficit no free tokens can fill (a trade between full ranks)
_DEAD_TOKENS = 6.0  # tokens charged per token over M x cap that the rank's load excess does not carry out
_NEAR = 32  # candidates per long item and side: receivers nearest in load room, partners nearest in cost


def _rank_charge(x: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Estimated tokens a rank's short items will send, from its load over the limit `x` (negative: under) and
    its free tokens `room` (negative: over M x cap): the tokens that carry the load excess out (at _DENSITY cost
    per token) or those over M x cap, whichever is more; plus _DEAD per unit of a deficit the free tokens cannot
    take at _DENSITY; plus, over M x cap, _DEAD_TOKENS per token the load excess does not carry out. Overwrites
    x and room (in the search, temporaries cost most of its time)."""
    dead = np.maximum(room, 0.0)
    dead *= _DENSITY
    dead += x
    np.maximum(np.negative(dead, out=dead), 0.0, out=dead)
    dead *= _DEAD
    carried = np.maximum(x, 0.0, out=x)
    carried /= _DENSITY
    over = np.negative(room, out=room)
    charge = np.maximum(carried, over)
    charge += dead
    over -= carried
    charge += np.multiply(np.maximum(over, 0.0, out=over), _DEAD_TOKENS, out=over)
    return charge


def _assign_long(state: _State, budget: np.ndarray, tolerance: float, sweeps: int = 128, full_every: int = 8,
                 stop_share: float = 1e-4):
    """(long items, their ranks, the estimate at those ranks in tokens): a local search over moves (a long item
    to another rank) and swaps (two long items of two ranks), minimising the long items' tokens away from their
    rank now plus `_rank_charge` summed over the ranks. Each sweep scores the long items of the ranks with a
    charge (`_score_sweep`) and applies the improving options best first, each rank at most once
    (`_apply_sweep`); at most `sweeps` sweeps, a full one every `full_every` (between them only the items of
    ranks that changed and those whose option lost to another), until a full sweep finds nothing or gains less
    than `stop_share` of the step's tokens. The state is not changed. Cost per sweep: O(long items x _NEAR)
    numpy and a Python loop over the improving options; O(n) before the first."""
    R, tok = state.load.shape[0], state.tokens
    limit = budget * (1.0 + tolerance / 2.0)
    lg = np.flatnonzero(tok > state.cap * _LONG)
    if lg.size == 0:
        return lg, lg, 0.0
    home, cl, tl = state.dest[lg], state.costs[lg], tok[lg]
    d = home.copy()
    CL, TL = np.bincount(d, weights=cl, minlength=R), np.bincount(d, weights=tl, minlength=R)
    base_x = state.load - CL - limit  # the rest's load against the limit
    base_room = state.cap * state.M - state.slot_tok.sum(axis=1) + TL
    by_cost = np.argsort(cl, kind="stable")
    partners = (by_cost, cl[by_cost], tl[by_cost], home[by_cost])  # the partners' arrays in cost order
    off = _offsets(R)
    cl_list, tl_list = cl.tolist(), tl.tolist()  # (Python floats: per move, scalar updates cost less than numpy's)
    watch, dirty = np.ones(lg.size, dtype=bool), np.zeros(R, dtype=bool)
    full, since_full, stop = True, 0, stop_share * float(tok.sum())
    for sweep in range(sweeps):
        x_all, room_all = base_x + CL, base_room - TL
        fr = _rank_charge(x_all.copy(), room_all.copy())
        pick = fr[d] > 0
        act = np.flatnonzero(pick if full else pick & (watch | dirty[d]))
        good = act
        if act.size:
            # in blocks of rows whose temporaries stay in cache (without: 1.3-1.5x the whole call at 512-2048 x 4)
            g, to, partner = (np.concatenate(x) for x in zip(*[
                _score_sweep(act[b:b + 256], d, home, cl, tl, x_all, room_all, fr, partners, off)
                for b in range(0, act.size, 256)]))
            good = np.flatnonzero(g < -1e-6)
        if good.size == 0:
            if full:
                break
            full = True
            continue
        good = good[np.argsort(g[good], kind="stable")]
        gained, used_item, dirty = _apply_sweep(act[good], to[good], partner[good], g[good], d, cl_list, tl_list,
                                                CL, TL)
        watch[:] = False
        watch[act[good]] = ~used_item[act[good]]  # options that lost to another (applied: their ranks are dirty)
        since_full = 0 if full else since_full + 1
        if full and gained < stop and sweep > 0:
            break  # a full sweep gained too little to go on
        full = since_full + 1 >= full_every
    return lg, d, float(tl[d != home].sum() + _rank_charge(base_x + CL, base_room - TL).sum())


def _score_sweep(act, d, home, cl, tl, x_all, room_all, fr, partners, off):
    """The best option of each long item a in `act` (on rank r = d[a]): (its gain, the other rank, the swap
    partner or -1 for a move). Receivers: the ranks at `off` around a's best fit in load room (x + c_a just
    under 0); partners: the long items at `off` around the cost that leaves r at its limit. A gain: both ranks'
    charges after - before plus the items' tokens away after - before (a rank with itself: no option)."""
    by_cost, cost_sorted, tok_sorted, home_sorted = partners
    r = d[act]
    ca, ta, home_a = cl[act][:, None], tl[act][:, None], home[act][:, None]
    away_now = (r != home[act]).astype(np.float64)[:, None]
    f_left = _rank_charge(x_all[r] - cl[act], room_all[r] + tl[act]) - fr[r]
    by_x = np.argsort(x_all, kind="stable")
    s = by_x[np.clip(np.searchsorted(x_all[by_x], -cl[act])[:, None] + off, 0, x_all.shape[0] - 1)]
    gain_m = _rank_charge(x_all[s] + ca, room_all[s] - ta) + f_left[:, None] - fr[s] + ((s != home_a) - away_now) * ta
    gain_m[s == r[:, None]] = np.inf
    want = cl[act] - np.maximum(x_all[r], 0.0)  # the cost that leaves r at its limit
    q = np.clip(np.searchsorted(cost_sorted, want)[:, None] + off, 0, cost_sorted.shape[0] - 1)
    rb, dc, t_b, home_b = d[by_cost[q]], ca - cost_sorted[q], tok_sorted[q], home_sorted[q]
    dt = ta - t_b
    gain_s = (_rank_charge(x_all[r][:, None] - dc, room_all[r][:, None] + dt) - fr[r][:, None]
              + _rank_charge(x_all[rb] + dc, room_all[rb] - dt) - fr[rb] + ((rb != home_a) - away_now) * ta
              + ((r[:, None] != home_b) * 1.0 - (rb != home_b)) * t_b)
    gain_s[rb == r[:, None]] = np.inf
    rows = np.arange(act.size)
    jm, js = np.argmin(gain_m, axis=1), np.argmin(gain_s, axis=1)
    gm, gs = gain_m[rows, jm], gain_s[rows, js]
    move = gm <= gs
    return np.minimum(gm, gs), np.where(move, s[rows, jm], rb[rows, js]), np.where(move, -1, by_cost[q[rows, js]])


def _apply_sweep(items, to, partner, gains, d, cl_list, tl_list, CL, TL):
    """Apply the options (item to rank `to`, and for a swap its partner back), best first, each rank and long
    item at most once: (the gain, the long items applied, the ranks changed)."""
    # every option's ranks are read before any is applied: an item applied earlier (whose rank has changed)
    # marks its later options used, so the stale ranks never count
    used, used_item, gained = bytearray(CL.shape[0]), bytearray(d.size), 0.0
    for i, j, a_rank, b_rank, gk in zip(items.tolist(), partner.tolist(), d[items].tolist(), to.tolist(),
                                        gains.tolist()):
        if used[a_rank] or used[b_rank] or used_item[i] or (j >= 0 and used_item[j]):
            continue
        used[a_rank] = used[b_rank] = True
        for item, src, dst in ((i, a_rank, b_rank), (j, b_rank, a_rank))[:1 + (j >= 0)]:  # a swap: j goes back
            used_item[item] = True
            CL[src] -= cl_list[item]
            TL[src] -= tl_list[item]
            CL[dst] += cl_list[item]
            TL[dst] += tl_list[item]
            d[item] = dst
        gained -= gk
    return gained, np.frombuffer(used_item, dtype=bool), np.frombuffer(used, dtype=bool)


def _offsets(num_ranks: int, span: int = 512) -> np.ndarray:
    """The search's candidate window around a best fit: _NEAR places on either side, every (R // span)-th above
    `span` ranks, so that it spans the same share of the ranks (and of the long items, ~R) at any R."""
    step = max(1, num_ranks // span)
    return np.arange(-_NEAR * step, _NEAR * step, step)


def _long_first_applies(state: _State) -> bool:
    """A token cap, tokens, and 2 to _FEW_SLOTS micro-batches."""
    return state.cap is not None and state.tokens is not None and 2 <= state.M <= _FEW_SLOTS


def _long_first(state: _State, budget: np.ndarray, tolerance: float, assigned=None) -> None:
    """Steps 1-3 of the module docstring on `state` (the caller checks `_long_first_applies`); `assigned`: what
    `_assign_long` returned for this state (else it runs here)."""
    items, ranks, _ = _assign_long(state, budget, tolerance) if assigned is None else assigned
    if items.size:
        _place_long(state, items, ranks)
        _short_flow(state, budget, tolerance, state.cap * _LONG)


def _place_long(state: _State, items: np.ndarray, ranks: np.ndarray) -> None:
    """Move `items` to `ranks` (longest first), each into its rank's roomiest slot after that slot passed what
    it can to the rank's other slots (`_make_room`); a slot may end over the cap, which `_short_flow` and the
    token repair of the incremental method then mend. A move that would leave its rank with fewer than
    `state.min_count` items is not made."""
    move = np.flatnonzero(state.dest[items] != ranks)
    items, ranks = items[move], ranks[move]
    order = np.argsort(-state.tokens[items], kind="stable")
    members = _Members(state.dest, state.load.shape[0])  # the items of each rank before the moves
    for i, r in zip(items[order].tolist(), ranks[order].tolist()):
        if state.count is not None and state.count[state.dest[i]] - 1 < state.min_count:
            continue  # the rank keeps its item count (one per micro-batch)
        m = int(np.argmax(state.cap - state.slot_tok[r]))
        _make_room(state, r, m, float(state.tokens[i]), members.of(r))
        state.move(i, r, m)


def _make_room(state: _State, r: int, m: int, need: float, members: np.ndarray) -> None:
    """Free `need` tokens in slot (r, m) by passing its items (largest that fit first) to r's other slots (best
    fit); nothing moves if they cannot. `members`: indexes that hold r's items (others may be among them)."""
    room = state.cap - state.slot_tok[r].astype(np.float64)
    need = need - room[m]
    if need <= 0:
        return
    items = members[(state.dest[members] == r) & (state.micro[members] == m)]
    items = items[np.argsort(-state.tokens[items], kind="stable")]
    other = room.tolist()
    other[m] = -np.inf
    plan, freed = [], 0.0
    for i, t in zip(items.tolist(), state.tokens[items].tolist()):
        s = _smallest_room(other, t)
        if s >= 0:
            other[s] -= t
            plan.append((i, s))
            freed += t
            if freed >= need:  # enough: the passes are made
                for k, s in plan:
                    state.move(k, r, s)
                return


def _short_flow(state: _State, budget: np.ndarray, tolerance: float, small: float, rounds: int = 3,
                over_shoot: float = 0.5) -> int:
    """Ranks over their load limit (most over first), then ranks over M x cap tokens, send items of at most
    `small` tokens (`_send_from`), each to the rank with load and token room whose load room per token of room
    is nearest the item's cost per token (dense items to ranks short of tokens), into its best-fitting slot;
    then a rank with a slot over the cap mends it inside the rank (`_fix_slots`), and what is still over it
    spills (`_spill`). Returns the moves. Cost: O(R) numpy per item tried."""
    limit = budget * (1.0 + tolerance / 2.0)
    dens = state.costs / np.maximum(state.tokens, 1e-300)
    view, moves = _Rooms(state, limit), 0
    for _ in range(rounds):
        made, members = 0, _Members(state.dest, state.load.shape[0])
        for tokens_only in (False, True):
            over = state.slot_tok.sum(axis=1) - state.cap * state.M if tokens_only else state.load - limit
            todo = np.flatnonzero(over > 0)
            for h in (todo if tokens_only else todo[np.argsort(-over[todo], kind="stable")]).tolist():
                slack = over_shoot * float(limit[h] * (tolerance / 2.0))  # a load sender's overshoot allowed
                made += _send_from(state, view, members.of(h), h, small, dens, slack, tokens_only)
        bad = np.flatnonzero((state.slot_tok > state.cap).any(axis=1))
        members = _Members(state.dest, state.load.shape[0]) if bad.size else None
        for r in bad.tolist():
            _fix_slots(state, r, members=members.of(r))
            view.update(state, r)
        moves += made
        if made == 0:
            break
    return moves + _spill(state, limit)


def _spill(state: _State, limit: np.ndarray) -> int:
    """What is still over the cap at the end: a slot over it sends its smallest items, each to the slot with
    room for it on the rank (other than its own) that ends least full against its limit; the loads that this
    raises are left to the trades. Returns the moves."""
    cap, tok, made = state.cap, state.tokens, 0
    for h in np.flatnonzero((state.slot_tok > cap).any(axis=1)).tolist():
        items = np.flatnonzero(state.dest == h)
        for m in np.flatnonzero(state.slot_tok[h] > cap).tolist():
            mine = items[(state.micro[items] == m) & (state.dest[items] == h)]
            for i in mine[np.argsort(tok[mine], kind="stable")][:-1].tolist():  # the slot keeps one item
                if state.slot_tok[h, m] <= cap or (state.count is not None and state.count[h] - 1 < state.min_count):
                    break
                room = cap - state.slot_tok
                fits = room >= tok[i]
                fits[h] = False
                ok = fits.any(axis=1)
                if not ok.any():
                    break
                r = int(np.argmin(np.where(ok, (state.load + state.costs[i]) / limit, np.inf)))
                state.move(i, r, int(np.argmin(np.where(fits[r], room[r], np.inf))))
                made += 1
    return made


class _Rooms:
    """Per rank: load room under the limit, the largest item its tokens take (min(the roomiest slot's room,
    free tokens)), and the log of load room per free token (what a receiver needs per token); updated per rank
    on every move."""

    def __init__(self, state: _State, limit: np.ndarray):
        self.limit = limit
        self.load, self.fit, self.ratio = (np.empty(state.load.shape[0]) for _ in range(3))
        self.update(state, np.arange(state.load.shape[0]))

    def update(self, state: _State, r) -> None:
        self.load[r] = self.limit[r] - state.load[r]
        free = state.cap * state.M - state.slot_tok[r].sum(axis=-1)
        self.ratio[r] = np.log(np.maximum(self.load[r], 1e-9) / np.maximum(free, 1.0))
        self.fit[r] = np.minimum((state.cap - state.slot_tok[r]).max(axis=-1), free)


def _send_from(state, view, mine, h, small, dens, slack, tokens_only, tries: int = 32) -> int:
    """One rank's part of `_short_flow`: its small items `mine` (those still on h) out until its tokens
    (`tokens_only`) or its load are within bounds, densest first where the load is over (fewest tokens for the
    cost shed), else cheapest per token first; it stops after `tries` items in a row find no rank. Returns the
    moves."""
    full, tok, limit = state.cap * state.M, state.tokens, view.limit
    mine = mine[(state.dest[mine] == h) & (tok[mine] <= small)]
    over_load, over_tok = float(state.load[h] - limit[h]), float(state.slot_tok[h].sum() - full)
    key = -dens[mine] if over_load > 0 else dens[mine]
    if over_load > 0 and over_tok > 0:  # over in both: near the density that brings both under together
        key = np.abs(np.log(dens[mine]) - np.log(over_load / over_tok))
    mine = mine[np.argsort(key, kind="stable")]
    log_dens = np.log(np.maximum(dens[mine], 1e-300)).tolist()
    made = misses = 0
    for i, ci, ti, ld in zip(mine.tolist(), state.costs[mine].tolist(), tok[mine].tolist(), log_dens):
        if (over_tok if tokens_only else over_load) <= 0 or misses >= tries:
            break
        if not tokens_only and ci > over_load + slack and ci > 2.0 * over_load:
            continue
        if state.count is not None and state.count[h] - 1 < state.min_count:
            break
        ok = (view.load >= ci) & (view.fit >= ti)
        ok[h] = False
        near = np.where(ok, np.abs(view.ratio - ld), np.inf)
        r = int(np.argmin(near))
        if not near[r] < np.inf:  # no rank with room for it
            misses += 1
            continue
        misses = 0
        state.move(i, r, max(_smallest_room((state.cap - state.slot_tok[r]).tolist(), ti), 0))
        view.update(state, [h, r])
        made += 1
        over_load, over_tok = float(state.load[h] - limit[h]), float(state.slot_tok[h].sum() - full)
    return made


def _fix_slots(state: _State, r: int, steps: int = 64, members=None) -> bool:
    """Mend rank r's slots over the cap by moves and swaps of its items between its own slots (they send
    nothing): the most over slot o passes the item, or swaps the pair, whose tokens just cover o's excess (else
    the largest part of it) into a slot with room. True when no slot is over."""
    cap, tok = state.cap, state.tokens
    items = np.flatnonzero(state.dest == r) if members is None else members[state.dest[members] == r]
    for _ in range(steps):
        fill = state.slot_tok[r]
        o = int(np.argmax(fill))
        excess = float(fill[o] - cap)
        if excess <= 0:
            return True
        room = cap - fill
        mine, others = items[state.micro[items] == o], items[state.micro[items] != o]
        ti = tok[mine][:, None]
        diff = ti - tok[others][None, :]  # what o sheds by a swap
        fits = room[None, :] >= ti
        fits[:, o] = False
        fits_s = (diff > 0) & (diff <= room[state.micro[others]][None, :])
        # score: the overflow left (0 best), then the fewest tokens shifted
        left_m = np.where(fits, np.maximum(excess - ti, 0.0) * 1e6 + ti, np.inf).reshape(-1)
        left_s = np.where(fits_s, np.maximum(excess - diff, 0.0) * 1e6 + diff, np.inf).reshape(-1)
        left = np.concatenate((left_m, left_s, [np.inf]))  # (ties: a move, then the first)
        k = int(np.argmin(left))
        if not np.isfinite(left[k]):
            return False
        if k < left_m.size:
            state.move(int(mine[k // state.M]), r, k % state.M)
        else:
            k -= left_m.size
            _apply_swap(state, int(mine[k // others.size]), int(others[k % others.size]))
    return not (state.slot_tok[r] > cap).any()
