"""Placing pooled items: best-fit decreasing on the ranks' rooms (every stage), and capped LPT (the repack)."""

from __future__ import annotations

import heapq
from bisect import bisect_left

import numpy as np

from hf_dp_balance.core.planner.state import _Infeasible, _State

def _place_best_fit(state: _State, pool: np.ndarray, limit: np.ndarray, lpt_host: bool = False) -> None:
    """Place pooled items by best-fit decreasing on the ranks' rooms (limit - load).

    Heaviest item first (ties: most tokens), onto the rank with the smallest
    room that still holds it and whose emptiest slot holds its tokens; an item
    that fits no room goes to the roomiest rank with token room (as LPT would), or,
    with `lpt_host` (long samples and unequal speeds), to the rank where it
    finishes first counting only fixed load and long samples sent there.
    On its rank an item goes to the slot with the fewest tokens. No rank with
    token room at all -> _Infeasible. Rooms are kept in a sorted Python list
    (bisect): O(log R) search plus an O(R) memmove per item.
    """
    costs, tokens, cap = state.costs, state.tokens, state.cap
    if tokens is None:
        pool = pool[np.argsort(-costs[pool], kind="stable")]
    else:
        pool = pool[np.lexsort((pool, -tokens[pool], -costs[pool]))]
    room = limit - state.load
    order = np.argsort(room, kind="stable")
    rooms = room[order].tolist()  # ascending
    ranks = order.tolist()
    item_cost = costs[pool].tolist()
    dest = [0] * len(item_cost)
    last = len(rooms) - 1
    slots = _SlotTokens(state, pool)
    search = _FullSearch(state, limit, lpt_host)
    for k, c in enumerate(item_cost):
        j = bisect_left(rooms, c)
        if j > last and not lpt_host:
            j = last  # fits no room: the roomiest rank (LPT)
        t = slots.item_tok[k] if cap is not None else 0.0
        found = j <= last and (cap is None or slots.free[ranks[j]] >= t)  # the common case
        if not found and j <= last:
            # the best fit lacks token room: try a few larger rooms (or, from the roomiest, smaller ones)
            nearby = _scan_token_room(slots.free, ranks, j, t, downward=j == last and rooms[j] < c)
            if nearby is not None:
                j, found = nearby, True
        if not found:
            # no rank near the best fit has token room, or a long sample needs an LPT host: numpy, O(R)
            r0, room_r0 = search.host(rooms, ranks, slots.free, int(pool[k]), c, t)
            j = _position(rooms, ranks, room_r0, r0)
        r = ranks.pop(j)
        left = rooms.pop(j) - c
        j = bisect_left(rooms, left)
        rooms.insert(j, left)
        ranks.insert(j, r)
        dest[k] = r
        search.placed(r, left)
        slots.add(k, r)
    slots.commit(pool, np.asarray(dest, dtype=np.int64))


def _place_lpt(state: _State, pool: np.ndarray, budget: np.ndarray, ranks: np.ndarray) -> None:
    """Capped LPT of pooled items onto `ranks`: heaviest first (ties: lowest index) onto the least
    full rank (load / budget) whose emptiest slot holds the item's tokens, there onto that slot. A
    heap of ranks: O(log R) per item plus the ranks skipped for token room. No rank with room ->
    _Infeasible."""
    costs, cap = state.costs, state.cap
    pool = pool[np.lexsort((pool, -costs[pool]))]
    inv = (1.0 / np.maximum(budget, np.finfo(np.float64).tiny)).tolist()
    load = state.load.tolist()
    heap = [(load[r] * inv[r], r) for r in ranks.tolist()]
    heapq.heapify(heap)
    slots = _SlotTokens(state, pool)
    dest = [0] * pool.size
    for k, c in enumerate(costs[pool].tolist()):
        t = slots.item_tok[k] if cap is not None else 0.0
        aside = []  # ranks less full than the one chosen, without the token room: back in the heap after
        while heap and cap is not None and slots.free[heap[0][1]] < t:
            aside.append(heapq.heappop(heap))
        if not heap:
            raise _Infeasible(f"item {int(pool[k])} ({t:.0f} tokens) has no room: every rank's emptiest slot "
                              f"already holds >= {cap - max(slots.free[r] for r in ranks.tolist()):.0f} "
                              f"tokens, cap {cap:.0f}")
        r = heap[0][1]
        load[r] += c
        heapq.heapreplace(heap, (load[r] * inv[r], r))
        for entry in aside:
            heapq.heappush(heap, entry)
        dest[k] = r
        slots.add(k, r)
    slots.commit(pool, np.asarray(dest, dtype=np.int64))


class _SlotTokens:
    """Tokens per slot while `_place_best_fit` runs (Python lists, of the ranks placed on only: a
    pool is small against R x M slots), and each rank's token room (`free`: cap - tokens of its
    emptiest slot); written back to the state by `commit`."""

    def __init__(self, state: _State, pool: np.ndarray):
        self.state = state
        cap = state.cap
        self.tracked = state.slot_tok is not None
        self.single = self.tracked and cap is not None and state.M == 1  # plan_balance: one slot per rank
        self.slots = [0] * pool.size
        self.free = None
        if self.tracked:
            self.item_tok = state.tokens[pool].tolist()
            if self.single:
                self.free = (cap - state.slot_tok[:, 0]).tolist()
            else:
                self.rows = {}  # rank -> its slots' tokens (a Python list), for the ranks placed on only
                if cap is not None:  # (one numpy pass, not R Python min calls: the same values)
                    self.free = (cap - state.slot_tok.min(axis=1)).tolist()

    def add(self, k: int, r: int) -> None:
        """Item k of the pool goes to rank r: its slot with the fewest tokens."""
        if self.single:
            self.free[r] -= self.item_tok[k]
        elif self.tracked:
            row = self.rows.get(r)
            if row is None:
                row = self.rows[r] = self.state.slot_tok[r].tolist()
            m = row.index(min(row))
            row[m] += self.item_tok[k]
            self.slots[k] = m
            if self.state.cap is not None:
                self.free[r] = self.state.cap - min(row)

    def commit(self, pool: np.ndarray, dest_arr: np.ndarray) -> None:
        state = self.state
        R = state.load.shape[0]
        state.load += np.bincount(dest_arr, weights=state.costs[pool], minlength=R)
        if self.single:
            state.slot_tok[:, 0] = state.cap - np.asarray(self.free)
        elif self.tracked:
            if self.rows:
                state.slot_tok[list(self.rows)] = list(self.rows.values())
            state.micro[pool] = self.slots
        if state.count is not None:
            state.count += np.bincount(dest_arr, minlength=R)
        state.dest[pool] = dest_arr


class _FullSearch:
    """The O(R) numpy search of `_place_best_fit` for an item the sorted rooms could not place.

    Keeps numpy copies of the rooms and token rooms, built on the first search and
    patched lazily with the ranks placed since (`placed`)."""

    def __init__(self, state: _State, limit: np.ndarray, lpt_host: bool):
        self.state, self.limit, self.lpt_host = state, limit, lpt_host
        self.claimed = state.fixed.copy()  # per rank: fixed load + long samples sent there by this call
        self.mirror, self.room_of, self.dirty = None, None, set()

    def placed(self, r: int, left: float) -> None:
        if self.mirror is not None:
            self.room_of[r] = left
            self.dirty.add(r)

    def _sync(self, rooms: list, ranks: list, free) -> None:
        cap = self.state.cap
        if self.mirror is None:
            self.mirror = [np.empty(len(rooms)), None if cap is None else np.asarray(free, dtype=np.float64)]
            self.mirror[0][ranks] = rooms
            self.room_of = self.mirror[0].tolist()
        elif self.dirty:
            idx = list(self.dirty)
            self.mirror[0][idx] = [self.room_of[x] for x in idx]
            if cap is not None:
                self.mirror[1][idx] = [free[x] for x in idx]
            self.dirty.clear()

    def host(self, rooms: list, ranks: list, free, item: int, c: float, t: float):
        """(rank, its room): the smallest room that holds cost c with t tokens of room, else the
        LPT host (`_no_room_host`) or the roomiest rank with token room; else the item's previous
        rank if it has the room; else _Infeasible."""
        self._sync(rooms, ranks, free)
        room_arr = self.mirror[0]
        ok = None
        if self.state.cap is not None:
            ok = self.mirror[1] >= t
            if not ok.any():
                home = int(self.state.prev[item])
                if free[home] < t:
                    raise _Infeasible(f"item {item} ({t:.0f} tokens) has no room: under the token cap "
                                      f"{self.state.cap:.0f} the roomiest rank has {float(np.max(free)):.0f} "
                                      f"tokens left, its home rank {home} {float(free[home]):.0f}")
                ok[home] = True  # back where it came from (its tokens left that rank)
        # (`rooms` ascends: when the largest is under c, no rank holds it, and the mask is not built)
        holds = None if rooms[-1] < c else room_arr >= c if ok is None else ok & (room_arr >= c)
        if holds is not None and holds.any():  # the smallest room that holds it
            r0 = int(np.argmin(np.where(holds, room_arr, np.inf)))
        else:
            if self.lpt_host:
                r0 = _no_room_host(self.limit, room_arr, self.claimed, ok, c)
            else:  # the roomiest rank with token room
                r0 = int(np.argmax(room_arr if ok is None else np.where(ok, room_arr, -np.inf)))
            self.claimed[r0] += c
        return r0, float(room_arr[r0])


def _scan_token_room(free: list, ranks: list, j: int, t: float, downward: bool, reach: int = 16):
    """The next position from j (up: larger rooms; or down from the roomiest) whose rank has
    `t` tokens of room, within `reach` steps (then a full search); None if none."""
    step = -1 if downward else 1
    end = len(ranks)
    for _ in range(reach):
        j += step
        if j < 0 or j >= end:
            return None
        if free[ranks[j]] >= t:
            return j
    return None


def _no_room_host(limit: np.ndarray, room: np.ndarray, claimed: np.ndarray, ok, cost: float) -> int:
    """Rank for an item that fits no room (a long sample): where it would finish first if the
    rank kept only its fixed load and the long samples already sent there (`claimed`) — the
    next shedding pass moves the rest away. Ties: least load, then lowest index."""
    finish = (claimed + cost) / np.maximum(limit, np.finfo(np.float64).tiny)
    if ok is not None:
        finish = np.where(ok, finish, np.inf)
    best = np.flatnonzero(finish == finish.min())
    return int(best[np.argmax(room[best])])


def _position(rooms: list, ranks: list, room: float, rank: int) -> int:
    """Index of `rank` in the sorted room list."""
    j = bisect_left(rooms, room)
    while ranks[j] != rank:
        j += 1
    return j
