"""The one-for-one kernels: the best move or swap from the fullest rank (`_refine`), swaps that bring a rank just
over a limit under it (`_swap_down`), the item-count fixes. Swaps: tested by `_swap_fits`, made by `_apply_swap`."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.state import _ROUNDS, _Infeasible, _Members, _State
from hf_dp_balance.core.planner.trade_index import _ranges


def _refine(state: _State, budget: np.ndarray, goal: float, max_iters: int, candidates: int = 2) -> None:
    """Best single move or swap between the fullest rank and the emptiest ranks, until `goal`.

    Fullness is load / budget. Each iteration applies, between the fullest rank h and the `candidates` emptiest,
    the move (an item of h to a candidate's emptiest slot) or swap within the cap and item counts that minimises
    the larger fullness of the two, if it lowers h's. A rank nothing helps is skipped (the exchanges of `_polish`
    need the others near their budgets) until the fullest rank left is within `goal`. O(items of h x items of
    the candidates) per iteration, O(its items x log theirs) for a rank the screens rule out."""
    budget = np.maximum(budget, np.finfo(np.float64).tiny)  # a zero budget: any load is "very full"
    members = None
    stuck = np.zeros(budget.shape[0], dtype=bool)  # ranks nothing helped (skipped, the next fullest goes on)
    for _ in range(max_iters):
        full = state.load / budget
        h = int(np.argmax(np.where(stuck, -np.inf, full)))
        if full[h] <= goal or stuck[h]:
            return
        if members is None:
            members = _Members(state.dest, budget.shape[0])
        mine, cand = members.of(h), _emptiest(full, h, candidates)
        if mine.size and cand.size == 0:
            return
        move = _best_move(state, budget, h, mine, cand) if mine.size else (np.inf,)
        swap = _best_swap(state, budget, h, mine, cand, members) if mine.size else (np.inf,)
        if not min(move[0], swap[0]) < full[h]:
            stuck[h] = True
        elif move[0] <= swap[0]:
            _, item, l, slot = move
            state.move(item, l, slot)
            members.moved(item, h, l)
        else:
            _, item_a, item_b, l = swap
            _apply_swap(state, item_a, item_b)
            members.moved(item_b, l, h)
            members.moved(item_a, h, l)


def _emptiest(full: np.ndarray, h: int, candidates: int) -> np.ndarray:
    """The `candidates` least full ranks other than h, lowest index on ties."""
    pick, cand = full.copy(), []
    pick[h] = np.inf
    for _ in range(min(candidates, pick.size - 1)):
        cand.append(int(np.argmin(pick)))
        pick[cand[-1]] = np.inf
    return np.asarray(cand, dtype=np.int64)


def _least_worst(state: _State, budget: np.ndarray, h: int, delta: np.ndarray, ranks: np.ndarray, fits):
    """(larger fullness after, row, column) of the best of a matrix of one-for-one changes: `delta`[row,
    column] load leaves h for rank `ranks`[column], where `fits` (all if None); the first on ties."""
    worst = np.maximum((state.load[h] - delta) / budget[h],
                       (state.load[ranks][None, :] + delta) / budget[ranks][None, :])
    if fits is not None:
        worst = np.where(fits, worst, np.inf)
    k = int(np.argmin(worst))
    return (float(worst.flat[k]),) + divmod(k, ranks.size)


def _best_move(state: _State, budget: np.ndarray, h: int, mine: np.ndarray, cand: np.ndarray):
    """(larger fullness after, item, to rank, to slot) of the best move of an item of h to a candidate's
    emptiest slot within the cap; (inf, ...) when h may not give an item away."""
    if state.count is not None and mine.size <= state.min_count:
        return np.inf, -1, -1, 0
    to_slot = fits = None
    if state.slot_tok is not None:
        to_slot = np.argmin(state.slot_tok[cand], axis=1)
        if state.cap is not None:
            room = state.cap - state.slot_tok[cand, to_slot]
            if float(state.tokens[mine].min()) > float(room.max()):  # no item fits: every entry below is inf
                return np.inf, -1, -1, 0
            fits = state.tokens[mine][:, None] <= room[None, :]
    worst, a, j = _least_worst(state, budget, h, state.costs[mine][:, None], cand, fits)
    return worst, int(mine[a]), int(cand[j]), int(to_slot[j]) if to_slot is not None else 0


def _best_swap(state: _State, budget: np.ndarray, h: int, mine: np.ndarray, cand: np.ndarray, members):
    """(larger fullness after, item of h, item of a candidate, that candidate) of the best swap within the
    cap; (inf, ...) when the candidates hold no item or no swap can lower h (`_swap_may_fit`)."""
    groups = [members.of(int(l)) for l in cand]
    theirs = np.concatenate(groups)
    if not theirs.size or (state.cap is not None and not _swap_may_fit(state, mine, theirs, cand)):
        return np.inf, -1, -1, -1
    col_rank = np.repeat(cand, [g.size for g in groups])
    fits = _swap_fits(state, h, mine[:, None], theirs[None, :], col_rank[None, :]) if state.cap is not None else None
    delta = state.costs[mine][:, None] - state.costs[theirs][None, :]  # load leaving h
    worst, a, j = _least_worst(state, budget, h, delta, col_rank, fits)
    return worst, int(mine[a]), int(theirs[j]), int(col_rank[j])


def _swap_fits(state: _State, h: int, a, b, l) -> np.ndarray:
    """Whether item a of rank h and item b of rank l (arrays broadcast) can trade slots within the cap."""
    ta, tb = state.tokens[a], state.tokens[b]
    into_l = state.slot_tok[l, state.micro[b]] - tb + ta
    into_h = state.slot_tok[h, state.micro[a]] - ta + tb
    return (into_l <= state.cap) & (into_h <= state.cap)


def _apply_swap(state: _State, a: int, b: int) -> None:
    """Items a and b trade ranks and slots."""
    ra, ma, rb, mb = int(state.dest[a]), int(state.micro[a]), int(state.dest[b]), int(state.micro[b])
    state.move(b, ra, ma)
    state.move(a, rb, mb)


def _swap_may_fit(state: _State, mine: np.ndarray, theirs: np.ndarray, cand: np.ndarray) -> bool:
    """False only if no swap of an item a of h for a cheaper item b of a candidate fits the candidate's
    roomiest slot (t_a - t_b <= its room, loose by 1e-6 of the cap): then no swap lowers h's fullness.
    At a full cap most ranks nothing helps fail it, in O((mine + theirs) log theirs)."""
    ct = state.costs[theirs]
    by_cost = np.argsort(ct, kind="stable")
    most = np.maximum.accumulate(state.tokens[theirs][by_cost])  # the most tokens of a b cheaper than each a
    cheaper = np.searchsorted(ct[by_cost], state.costs[mine], side="left")
    room = state.cap - float(state.slot_tok[cand].min())
    close = most[np.maximum(cheaper - 1, 0)] >= state.tokens[mine] - room - 1e-6 * state.cap
    return bool(((cheaper > 0) & close).any())


def _fill_short_ranks(state: _State) -> None:
    """Every rank gets `min_count` items: a short rank takes the cheapest fitting item of the rank with the most."""
    if state.count is None:
        return
    for r in np.flatnonzero(state.count < state.min_count).tolist():
        while state.count[r] < state.min_count:
            donors = np.flatnonzero(state.count > state.min_count)
            if donors.size == 0:
                raise _Infeasible(f"rank {r} has {state.count[r]} items, no rank can spare one")
            cand = np.flatnonzero(state.dest == int(donors[np.argmax(state.count[donors])]))
            slot = int(np.argmin(state.slot_tok[r])) if state.slot_tok is not None else 0
            if state.cap is not None:
                cand = cand[state.slot_tok[r, slot] + state.tokens[cand] <= state.cap]
                if cand.size == 0:
                    raise _Infeasible(f"rank {r} has {state.count[r]} items and no token room for another")
            state.move(int(cand[np.argmin(state.costs[cand])]), r, slot)


def _fill_empty_slots(state: _State) -> None:
    """On every rank with at least M items, give each empty slot one item: the fewest-token item (ties:
    lowest index) of the rank's slot with the most items. Stays on the rank."""
    R, M = state.load.shape[0], state.M
    if M == 1:
        return
    if state.slot_tok is not None and state.tokens.size:
        # a slot with half the fewest tokens of any item is not empty (the running sums err far less): no O(n) count
        least = float(state.tokens.min())
        if least > 0 and float(state.slot_tok.min()) >= 0.5 * least:
            return
    slot_of = state.dest * M + state.micro
    cnt = np.bincount(slot_of, minlength=R * M).reshape(R, M)
    for r in np.flatnonzero((cnt == 0).any(axis=1) & (cnt.sum(axis=1) >= M)).tolist():
        row = cnt[r]
        for m in np.flatnonzero(row == 0).tolist():
            donor = int(np.argmax(row))  # >= 2 items there: M items, an empty slot
            items = np.flatnonzero(slot_of == r * M + donor)
            i = int(items[np.argmin(state.tokens[items])])
            state.move(i, r, m)
            slot_of[i] = r * M + m
            row[donor] -= 1
            row[m] += 1


def _swap_down(state: _State, limit: np.ndarray, start: np.ndarray, rounds: int = _ROUNDS) -> int:
    """One-for-one swaps for a rank a few tenths over a limit that holds little but its own long items, one per
    micro-batch (the item count keeps them there). While the fullest rank h (load / limit) is over its limit:
    the swap of an item a of h with an item b of another rank l that leaves both within their limits and slots
    within the cap, fewest tokens newly sent (against `start`) first, then lowest (a, b). Stops at the first h
    with none; item counts never change. Returns the swaps made. O(n) numpy per swap."""
    tok, cost = state.tokens, state.costs
    by_cost = np.argsort(cost, kind="stable")
    cost_sorted = cost[by_cost]
    scale = np.maximum(limit, np.finfo(np.float64).tiny)
    for made in range(rounds):
        h = int(np.argmax(state.load / scale))
        excess = float(state.load[h] - limit[h])
        room = limit - state.load  # load room per rank (h's is negative)
        most = float(room.max())
        if excess <= 0 or most <= 0:
            return made
        # b for each a of h: c_a - c_b in [excess, most], on another rank whose load room takes c_a - c_b
        mine = np.flatnonzero(state.dest == h)
        lo = np.searchsorted(cost_sorted, cost[mine] - most)
        pos, g = _ranges(lo, np.maximum(np.searchsorted(cost_sorted, cost[mine] - excess, "right"), lo))
        a, b = mine[g], by_cost[pos]
        l, diff = state.dest[b], cost[a] - cost[b]
        ok = np.flatnonzero((l != h) & (diff <= room[l]) & (diff >= excess) & _swap_fits(state, h, a, b, l))
        if ok.size == 0:
            return made
        a, b, l = a[ok], b[ok], l[ok]
        sent = tok[a] * ((l != start[a]).astype(np.float64) - (h != start[a]))
        sent += tok[b] * ((start[b] != h).astype(np.float64) - (start[b] != l))
        k = int(np.lexsort((b, a, sent))[0])
        _apply_swap(state, int(a[k]), int(b[k]))
    return rounds
