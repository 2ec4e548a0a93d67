"""Indexes the trades of `trade.py` build once per call and patch per round (no O(n) work per round).

`_PayBack`: every slot's small items (index order) as running sums of tokens / costs / items, so
the fewest that free t tokens are a bisection inside the slot. `_by_rank_and_cost`: items grouped
by rank, cheapest first, under one sorted key, so the ones nearest a cost are a search away.
"""

from __future__ import annotations

import numpy as np


def _ranges(lo: np.ndarray, hi: np.ndarray):
    """(positions, group of each): the concatenated index ranges [lo[g], hi[g]) of every group g."""
    size = hi - lo
    total = int(size.sum())
    group = np.repeat(np.arange(lo.size), size)
    first = np.cumsum(size) - size
    pos = np.arange(total) - np.repeat(first, size) + np.repeat(lo, size)
    return pos, group


def _first_at_least(values: np.ndarray, lo: np.ndarray, hi: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """For every i, the first position p in [lo[i], hi[i]) with values[p] >= goal[i] (hi[i] if
    none), `values` ascending on each range: a bisection of all at once, each leaving as it
    converges (the ranges here are slots, most of them short)."""
    out = hi.copy()
    todo = np.flatnonzero(lo < hi)
    a, b, g = lo[todo], hi[todo], goal[todo]
    while todo.size:
        mid = (a + b) >> 1
        short = values[mid] < g
        a = np.where(short, mid + 1, a)
        b = np.where(short, b, mid)
        done = a >= b
        if done.any():
            out[todo[done]] = a[done]
            keep = ~done
            todo, a, b, g = todo[keep], a[keep], b[keep], g[keep]
    return out


def _uint_key(values: np.ndarray, below: int) -> np.ndarray:
    """`values` (non-negative integers < `below`) as the narrowest unsigned type: numpy's stable sort
    of 8- / 16-bit keys is a radix sort (O(n)), much faster than its merge sort of wider ones."""
    if below <= 1 << 16:
        return values.astype(np.uint16)
    return values.astype(np.int64)


class _PayBack:
    """Running sums of tokens / costs / items over the small items of every slot, in index order,
    kept only for items that never moved (a moved item counts 0: it left the slot; arrivals moved too).

    `items` are grouped by slot, slot s from start[s], size[s] of them; the running sums run over
    all slots (no pass to restart them per slot): slot s's first k items sum to sum[start[s] + k - 1]
    - sum[start[s] - 1] (`base`). A touched slot's sums are recomputed from its own base."""

    def __init__(self, items: np.ndarray, slot_of: np.ndarray, tok: np.ndarray, cost: np.ndarray, num_slots: int):
        # items: the small items grouped by slot, index order within one
        self.items, self.slot_of, self.tok, self.cost = items, slot_of, tok, cost
        self.size = np.bincount(slot_of[items], minlength=num_slots)
        self.start = np.cumsum(self.size) - self.size
        self.live = np.ones(items.size, dtype=bool)  # not moved (few arrays: each new one costs page faults)
        self.sums = [np.cumsum(tok[items]), np.cumsum(cost[items]), np.arange(1.0, items.size + 1.0)]
        before = self.start - 1  # the running sums before each slot
        self.base = [np.where(before >= 0, run[np.maximum(before, 0)], 0.0) if run.size else np.zeros(num_slots)
                     for run in self.sums]

    def search(self, slot: np.ndarray, need: np.ndarray):
        """(tokens, cost, items) of the fewest small items of `slot` (index order) that free `need`
        tokens, the position of the last of them (start - 1 if none), and whether the slot has them."""
        start = self.start[slot]
        j, feasible = start - 1, need <= 0
        sums = [np.zeros(slot.size) for _ in self.sums]
        # only the candidates that need a pay-back, and whose slot holds enough, are searched
        idx = np.flatnonzero(~feasible)
        if idx.size == 0 or self.items.size == 0:
            return sums, j, feasible
        s = slot[idx]
        lo, hi = start[idx], start[idx] + self.size[s]
        run, base = self.sums[0], self.base[0][s]
        goal = need[idx] + base
        total = np.where(hi > lo, run[np.maximum(hi - 1, 0)], base)
        ok = total >= goal
        idx, s, lo, hi, goal = idx[ok], s[ok], lo[ok], hi[ok], goal[ok]
        pos = _first_at_least(run, lo, hi, goal)  # below hi: the slot's total reaches the goal
        j[idx] = pos
        feasible[idx] = True
        for out, run_k, base_k in zip(sums, self.sums, self.base):
            out[idx] = run_k[pos] - base_k[s]
        return sums, j, feasible

    def paid(self, slot: np.ndarray, j: np.ndarray):
        """(items, index into `slot` of each): the small items of slot[i] that count, up to position j[i]."""
        pos, grp = _ranges(self.start[slot], j + 1)
        live = self.live[pos]
        return self.items[pos[live]], grp[live]

    def moved(self, items: np.ndarray) -> None:
        """`items` left their slots: they count 0; their slots' running sums are recomputed."""
        slots = self.slot_of[items]
        pos = _first_at_least(self.items, self.start[slots], self.start[slots] + self.size[slots], items)
        found = pos < self.start[slots] + self.size[slots]
        found[found] = self.items[pos[found]] == items[found]  # the small ones (index order in a slot)
        items, pos = items[found], pos[found]
        if items.size == 0:
            return
        self.live[pos] = False
        slots = np.unique(self.slot_of[items])
        sizes = self.size[slots]
        pos, grp = _ranges(self.start[slots], self.start[slots] + sizes)
        first = np.cumsum(sizes) - sizes
        live, at = self.live[pos], self.items[pos]
        for v, run, base in zip((self.tok[at] * live, self.cost[at] * live, live.astype(np.float64)), self.sums,
                                self.base):
            within = np.cumsum(v)
            run[pos] = within - np.repeat(within[first] - v[first], sizes) + base[slots][grp]


def _by_rank_and_cost(items: np.ndarray, rank_of: np.ndarray, cost: np.ndarray, scale: float, num_ranks: int):
    """(items, starts, key, scale): `items` (grouped by rank) sorted by rank, then cost (ties: their
    order), starts[r] where rank r's begin; key = rank + cost x scale (scale < 1 / (2 max cost)), sorted;
    a search for rank + cost x scale (clipped to rank + 1/2) finds where `cost` falls among them."""
    key = rank_of[items] + cost[items] * scale
    o = np.argsort(key, kind="stable")  # grouped by rank already: timsort only orders each rank's stretch
    items, key = items[o], key[o]
    starts = np.zeros(num_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(rank_of[items], minlength=num_ranks), out=starts[1:])
    return items, starts, key, scale

