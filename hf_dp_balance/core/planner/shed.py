"""Shedding: which items leave the over-full ranks (cost) and the over-full slots (tokens)."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

from hf_dp_balance.core.planner.refine import _apply_swap
from hf_dp_balance.core.planner.state import _ROUNDS, _Infeasible, _State, _group_starts, _remove, _smallest_room
from hf_dp_balance.core.planner.trade_index import _stable_order


def _shed_rounds(state: _State, budget: np.ndarray, slack: np.ndarray, max_rounds: int = 64,
                 relocate: bool = True) -> np.ndarray:
    """Items to take off every over-budget rank, chosen in vectorised rounds; removed from `state`.

    Each round takes at most one item per rank still above budget + slack: the lightest that covers the remaining
    excess alone (one move, little overshoot), else the heaviest (fewest moves). With `relocate`, an item over its
    own rank's budget alone (a long sample on a slow rank) leaves first if some rank's budget can hold it. Never
    taken: items heavier than the largest free room (whoever took them would be the new slowest), and a rank's
    last `state.min_count` items. Cost: O(items on over ranks) numpy per round."""
    excess = state.load - budget
    room = float(np.max(-excess))
    over = excess > slack
    if not over.any():
        return np.zeros(0, dtype=np.int64)
    sel = np.flatnonzero(over[state.dest] & (state.dest >= 0))  # not the items the token repair took off
    so = state.dest[sel]
    if so.size > 1 and np.any(so[1:] < so[:-1]):
        order = _stable_order(so, state.load.shape[0])  # items grouped by owner, index order inside
        sel, so = sel[order], so[order]
    sc = state.costs[sel]
    movable = (sc > 0) & (sc <= room)
    taken_all = []
    starts = _group_starts(so)
    ranks = so[starts]
    rem, lim = excess[ranks], slack[ranks]
    left = state.count[ranks] - state.min_count if state.count is not None else np.full(ranks.size, sel.size)
    group = np.repeat(np.arange(starts.size), np.diff(np.append(starts, sel.size)))

    def take(hit):  # of the items at `hit` (sorted), each rank that may give one gives its first
        g = group[hit]
        first = np.concatenate(([True], g[1:] != g[:-1])) & (left[g] > 0)
        hit, g = hit[first], g[first]
        taken_all.append(sel[hit])
        movable[hit] = False
        rem[g] -= sc[hit]
        left[g] -= 1

    misplaced = (sc > budget[so] + slack[so]) & (sc <= float(budget.max()))
    if relocate and misplaced.any():  # whatever the free room says
        take(np.flatnonzero(misplaced))
    for _ in range(max_rounds):
        active = (rem > lim) & (left > 0)
        if not active.all():  # only the ranks still over budget go on (smaller arrays)
            keep_items = active[group]
            sel, so, sc, movable = sel[keep_items], so[keep_items], sc[keep_items], movable[keep_items]
            rem, lim, left = rem[active], lim[active], left[active]
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
        take(np.flatnonzero(movable & (sc == pick[group]) & ok[group]))  # lowest index wins ties
        left[~ok] = 0  # nothing movable left on these ranks
    pool = np.sort(np.concatenate(taken_all)) if taken_all else np.zeros(0, dtype=np.int64)
    _remove(state, pool)
    return pool


def _shed_tokens(state: _State, swap: bool = False) -> np.ndarray:
    """Items to take off every slot over the token cap, few and small; removed from `state`.

    Per slot over the cap, the first rule that works: (1) its items move within its rank (`_repair_within_rank`);
    (2) it sheds the `_cover_excess` items among those some other slot has room for (a slot a few tokens over
    gives away one small item); (3) one item goes for small items of a roomier slot (`_token_swap`: long videos);
    (4) with `swap` (the retry when what it shed found no place), one item goes for a smaller one (`_swap_smaller`)
    and the rules run again, up to _ROUNDS times; (5) it sheds the `_cover_excess` items among all of its items.
    Python over the items of the offending slots."""
    over = np.flatnonzero(state.slot_tok.reshape(-1) > state.cap) if state.cap is not None else []
    if len(over) == 0:
        return np.zeros(0, dtype=np.int64)
    flat_tok = state.slot_tok.reshape(-1)  # a view: moves update it
    slot_of = state.dest * state.M + state.micro
    pool = []
    # room that items shed from earlier slots will fill (best fit): a later slot neither counts on it
    # nor swaps into it, or two repairs plan with the same room and the placement finds none
    reserved = np.zeros(flat_tok.size)
    for s in over.tolist():
        for swaps_left in range(_ROUNDS if swap else 0, -1, -1):  # a swap for a smaller item, the rules again
            items = np.flatnonzero(slot_of == s)
            excess = float(flat_tok[s]) - state.cap
            # within the rank nothing changes rank and no load moves
            if excess <= 0 or _repair_within_rank(state, s, items, slot_of, excess, reserved):
                break
            room = state.cap - flat_tok - reserved
            room[s] = -np.inf
            taken = _cover_excess(items, state.tokens, excess, float(room.max()))  # of those some other slot takes
            if taken is not None or not (_token_swap(state, s, slot_of, excess, reserved)
                                         or swaps_left and _swap_smaller(state, s, slot_of, excess, room)):
                break
        if float(flat_tok[s]) <= state.cap:
            continue  # repaired in place (within its rank or by swaps)
        taken = taken if taken is not None else _cover_excess(items, state.tokens, excess)
        r = s // state.M
        if state.count is not None and len(taken) > int(state.count[r]) - state.min_count:
            raise _Infeasible(f"slot (rank {r}, micro-batch {s % state.M}) cannot shed tokens and keep "
                              f"{state.min_count} items")
        for i, j in _best_fit(room, taken, state.tokens):
            if j >= 0:
                reserved[j] += float(state.tokens[i])
        pool += taken
    pool = np.asarray(pool, dtype=np.int64)
    _remove(state, pool)
    return pool


def _repair_within_rank(state: _State, s: int, items: np.ndarray, slot_of: np.ndarray, excess: float,
                        reserved: np.ndarray) -> bool:
    """Repair slot s by moving items to its rank's other slots (their room less what is `reserved`); True if
    done. The `_cover_excess` items among those that fit the roomiest slot go best fit, all or none, and s keeps
    an item. Free: under sync="step" a rank's load is the sum of its micro-batches'."""
    M, r = state.M, s // state.M
    if M < 2:
        return False
    own = np.arange(r * M, (r + 1) * M)
    own = own[own != s]
    room = state.cap - state.slot_tok.reshape(-1)[own] - reserved[own]
    taken = _cover_excess(items, state.tokens, excess, float(room.max()))
    to = _best_fit(room, taken, state.tokens) if taken is not None and len(taken) < items.size else None
    if to is None or any(j < 0 for _, j in to):
        return False
    for i, j in to:
        state.move(i, r, int(own[j]) % M)
        slot_of[i] = own[j]
    return True


def _best_fit(room: np.ndarray, items: list, tokens: np.ndarray) -> list:
    """(item, position in `room`) for `items`, most tokens first, each into the least room left that
    holds it (-1: none does)."""
    out, rooms = [], room.tolist()
    for i in sorted(items, key=lambda i: -float(tokens[i])):
        j = _smallest_room(rooms, float(tokens[i]))
        if j >= 0:
            rooms[j] -= float(tokens[i])
        out.append((i, j))
    return out


def _cover_excess(items: np.ndarray, tokens: np.ndarray, excess: float, largest: float = np.inf):
    """Items (of one slot, of at most `largest` tokens) covering `excess` tokens: repeatedly the fewest-token
    one that covers what is left alone, else the one with the most tokens (ties: lowest index); None if none."""
    items = items[tokens[items] <= largest]
    items = items[np.lexsort((items, tokens[items]))].tolist()  # fewest tokens first
    values = [float(tokens[i]) for i in items]
    taken = []
    while excess > 0 and items:
        j = bisect_left(values, excess)
        if j == len(values):
            j = bisect_left(values, values[-1])  # none covers it alone: the most tokens
        taken.append(items.pop(j))
        excess -= values.pop(j)
    return taken if excess <= 0 else None


def _swap_smaller(state: _State, s: int, slot_of: np.ndarray, excess: float, room: np.ndarray) -> bool:
    """Swap an item of slot s for a smaller one of a slot whose `room` takes the difference, the smallest covering
    `excess`, else the largest; False if none fits. Loads are left to the refinement after. O(items of s x items)."""
    mine, theirs = np.flatnonzero(slot_of == s), np.flatnonzero((slot_of != s) & (state.dest >= 0))
    drop = state.tokens[mine][:, None] - state.tokens[theirs][None, :]
    fits = (drop > 0) & (drop <= room[slot_of[theirs]][None, :])
    if not fits.any():
        return False
    covers = fits & (drop >= excess)
    k = int(np.argmin(np.where(covers, drop, np.inf) if covers.any() else np.where(fits, -drop, np.inf)))
    a, b = int(mine[k // theirs.size]), int(theirs[k % theirs.size])
    _apply_swap(state, a, b)
    slot_of[a], slot_of[b] = slot_of[b], slot_of[a]
    return True


def _token_swap(state: _State, s: int, slot_of: np.ndarray, excess: float, reserved: np.ndarray) -> bool:
    """Repair slot s, `excess` tokens over the cap, by a one-for-many swap; True if done. An item i of s that
    covers the excess alone (fewest tokens first) goes to a slot s2 with room (the 16 roomiest, most room first;
    `reserved` room is not free), which gives s back its largest items that fit, t_i - room(s2) (so s2 holds i)
    to t_i - excess (so s ends within the cap) tokens in all. Loads are left to the refinement that follows.
    O(items of s x partners)."""
    tok, M = state.tokens, state.M
    free = state.cap - state.slot_tok.reshape(-1) - reserved
    free[s] = -np.inf
    partners = np.lexsort((np.arange(free.size), -free))[:16].tolist()
    mine = np.flatnonzero(slot_of == s)
    mine = mine[np.lexsort((mine, tok[mine]))]
    for i in mine[tok[mine] >= excess].tolist():
        t = float(tok[i])
        for s2 in partners:
            need, upper = t - float(free[s2]), t - excess  # tokens s2 gives back: at least need, at most upper
            if need > upper:
                break  # the other partners have less room still
            theirs = np.flatnonzero(slot_of == s2)
            picked, got = [], 0.0
            for j in theirs[np.lexsort((theirs, -tok[theirs]))].tolist():
                if got >= need:
                    break
                if got + float(tok[j]) <= upper:
                    picked.append(j)
                    got += float(tok[j])
            r, r2 = s // M, s2 // M
            if got < need or (state.count is not None and r2 != r
                              and state.count[r2] - len(picked) + 1 < state.min_count):
                continue
            for j, to in [(i, s2)] + [(j, s) for j in picked]:
                state.move(j, to // M, to % M)
                slot_of[j] = to
            return True
    return False
