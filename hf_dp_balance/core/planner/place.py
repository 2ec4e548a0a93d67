"""Placing pooled items: best-fit decreasing on the ranks' rooms (every stage), and capped LPT (the repack)."""

from __future__ import annotations

import heapq
from bisect import bisect_left

import numpy as np

from hf_dp_balance.core.planner.state import _Infeasible, _State


def _place_best_fit(state: _State, pool: np.ndarray, limit: np.ndarray, lpt_host: bool = False) -> None:
    """Place pooled items by best-fit decreasing on the ranks' rooms (limit - load): heaviest first (ties: most
    tokens), onto the rank with the smallest room that still holds it and whose emptiest slot holds its tokens,
    there onto its slot with the fewest tokens. An item that fits no room goes to the roomiest rank with token
    room (as LPT would), or with `lpt_host` (long samples, unequal speeds) to an LPT host (`_FullSearch.host`).
    No rank with token room -> _Infeasible. Rooms in a sorted Python list: O(log R) bisect + O(R) memmove."""
    costs, tokens, cap = state.costs, state.tokens, state.cap
    if tokens is None:
        pool = pool[np.argsort(-costs[pool], kind="stable")]
    else:
        pool = pool[np.lexsort((pool, -tokens[pool], -costs[pool]))]
    order = np.argsort(limit - state.load, kind="stable")
    rooms, ranks, last = (limit - state.load)[order].tolist(), order.tolist(), order.size - 1  # rooms ascending
    dest, slots, search = [], _SlotTokens(state, pool), _FullSearch(state, limit, lpt_host)
    for k, c in enumerate(costs[pool].tolist()):
        j = bisect_left(rooms, c)
        if j > last and not lpt_host:
            j = last  # fits no room: the roomiest rank (LPT)
        t = slots.item_tok[k] if cap is not None else 0.0
        if j <= last and cap is not None and slots.free[ranks[j]] < t:
            # no token room there: the first of the next 16 larger rooms (from the roomiest: smaller) whose rank has it
            step = -1 if j == last and rooms[j] < c else 1
            near = range(j + step, j + 17 * step, step)
            j = next((x for x in near if 0 <= x <= last and slots.free[ranks[x]] >= t), None)
        if j is None or j > last:
            # no rank near the best fit has token room, or a long sample needs an LPT host: numpy, O(R)
            j = search.host(rooms, ranks, slots.free, int(pool[k]), c, t)
        r, left = ranks.pop(j), rooms.pop(j) - c
        j = bisect_left(rooms, left)
        rooms.insert(j, left)
        ranks.insert(j, r)
        dest.append(r)
        search.placed(r, left)
        slots.add(k, r)
    slots.commit(pool, np.asarray(dest, dtype=np.int64))


def _place_lpt(state: _State, pool: np.ndarray, budget: np.ndarray, ranks: np.ndarray) -> None:
    """Capped LPT of pooled items onto `ranks`: heaviest first (ties: lowest index) onto the least full rank
    (load / budget) whose emptiest slot holds the item's tokens, there onto that slot. A heap of ranks: O(log R)
    per item plus the ranks skipped for token room. No rank with room -> _Infeasible."""
    costs, cap = state.costs, state.cap
    pool = pool[np.lexsort((pool, -costs[pool]))]
    inv = (1.0 / np.maximum(budget, np.finfo(np.float64).tiny)).tolist()
    load = state.load.tolist()
    heap = [(load[r] * inv[r], r) for r in ranks.tolist()]
    heapq.heapify(heap)
    dest, slots = [], _SlotTokens(state, pool)
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
        dest.append(r)
        slots.add(k, r)
    slots.commit(pool, np.asarray(dest, dtype=np.int64))


class _SlotTokens:
    """Tokens per slot while a pool is placed (Python lists of the ranks placed on only: a pool is small), each
    rank's token room (`free`: cap - its emptiest slot's tokens; None without a cap); `commit` writes them back."""

    def __init__(self, state: _State, pool: np.ndarray):
        self.state, self.slots, self.rows, self.free = state, [0] * pool.size, {}, None
        self.tracked = state.slot_tok is not None
        if self.tracked:
            self.item_tok = state.tokens[pool].tolist()
            if state.cap is not None:
                self.free = (state.cap - state.slot_tok.min(axis=1)).tolist()

    def add(self, k: int, r: int) -> None:
        """Item k of the pool goes to rank r: its slot with the fewest tokens."""
        if self.tracked:
            if r not in self.rows:
                self.rows[r] = self.state.slot_tok[r].tolist()
            row = self.rows[r]
            m = row.index(min(row))
            row[m] += self.item_tok[k]
            self.slots[k] = m
            if self.state.cap is not None:
                self.free[r] = self.state.cap - min(row)

    def commit(self, pool: np.ndarray, dest: np.ndarray) -> None:
        state, R = self.state, self.state.load.shape[0]
        state.load += np.bincount(dest, weights=state.costs[pool], minlength=R)
        if self.tracked:
            if self.rows:
                state.slot_tok[list(self.rows)] = list(self.rows.values())
            state.micro[pool] = self.slots
        if state.count is not None:
            state.count += np.bincount(dest, minlength=R)
        state.dest[pool] = dest


class _FullSearch:
    """The O(R) numpy search of `_place_best_fit` for an item the sorted rooms could not place: numpy copies of
    the rooms and token rooms, built on the first search and patched with the ranks placed on since."""

    def __init__(self, state: _State, limit: np.ndarray, lpt_host: bool):
        self.state, self.limit, self.lpt_host = state, limit, lpt_host
        self.claimed = state.fixed.copy()  # per rank: fixed load + long samples sent there by this call (LPT host)
        self.room, self.free, self.dirty = None, None, {}  # dirty: rank -> its room, placed on since the last sync

    def placed(self, r: int, left: float) -> None:
        if self.room is not None:
            self.dirty[r] = left

    def host(self, rooms: list, ranks: list, free, item: int, c: float, t: float) -> int:
        """Position in `rooms` of the rank with the smallest room that holds cost c with t tokens of room, else
        of the LPT host (`lpt_host`: where c finishes first counting only the fixed load and the long samples
        sent there; ties: least load, then lowest index) or the roomiest rank with token room; else of the
        item's previous rank if it has the token room; else _Infeasible."""
        cap = self.state.cap
        if self.room is None:
            self.room = np.empty(len(rooms))
            self.room[ranks] = rooms
            self.free = None if cap is None else np.asarray(free, dtype=np.float64)
        elif self.dirty:
            idx = list(self.dirty)
            self.room[idx] = list(self.dirty.values())
            if cap is not None:
                self.free[idx] = [free[x] for x in idx]
            self.dirty.clear()
        ok = np.ones(self.room.size, dtype=bool) if cap is None else self.free >= t  # ranks with token room
        if not ok.any():
            home = int(self.state.prev[item])
            if free[home] < t:
                raise _Infeasible(f"item {item} ({t:.0f} tokens) has no room: under the token cap {cap:.0f} "
                                  f"the roomiest rank has {float(np.max(free)):.0f} tokens left, its home rank "
                                  f"{home} {float(free[home]):.0f}")
            ok[home] = True  # back where it came from (its tokens left that rank)
        # (`rooms` ascends: when the largest is under c, no rank holds it, and the mask is not built)
        if rooms[-1] >= c and (holds := ok & (self.room >= c)).any():  # the smallest room that holds it
            r0 = int(np.argmin(np.where(holds, self.room, np.inf)))
        elif self.lpt_host:  # (the next shedding pass moves the rest away)
            finish = np.where(ok, (self.claimed + c) / np.maximum(self.limit, np.finfo(np.float64).tiny), np.inf)
            best = np.flatnonzero(finish == finish.min())
            r0 = int(best[np.argmax(self.room[best])])
            self.claimed[r0] += c
        else:  # the roomiest rank with token room
            r0 = int(np.argmax(np.where(ok, self.room, -np.inf)))
        j = bisect_left(rooms, float(self.room[r0]))
        while ranks[j] != r0:
            j += 1
        return j

