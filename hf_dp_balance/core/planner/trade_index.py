"""Indexes the trades of `trade.py` build once per call and patch per round (no O(n) work per round).

`_PayBack`: every slot's small items (index order) as one segment of cumulative tokens / costs /
items, so the fewest that free t tokens are one search of one sorted key. `_by_tokens`: the items
a move may take, grouped by rank, fewest tokens first, so a round reads only those that fit.
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


def _uint_key(values: np.ndarray, below: int) -> np.ndarray:
    """`values` (non-negative integers < `below`) as the narrowest unsigned type: numpy's stable sort
    of 8- / 16-bit keys is a radix sort (O(n)), much faster than its merge sort of wider ones."""
    if below <= 1 << 16:
        return values.astype(np.uint16)
    return values.astype(np.int64)


class _PayBack:
    """Cumulative tokens / costs / items of the small items of every slot, in index order, kept
    only for items that never moved (a moved item counts 0: it left the slot; arrivals moved too).

    Slot s is the segment [head[s], head[s] + size[s]] of the arrays, its first entry a 0 (no
    pay-back)."""

    def __init__(self, items: np.ndarray, slot_of: np.ndarray, tok: np.ndarray, cost: np.ndarray, num_slots: int):
        # items: the small items grouped by slot, index order within one
        where = slot_of[items]
        self.size = np.bincount(where, minlength=num_slots)
        self.head = np.cumsum(self.size + 1) - (self.size + 1)
        at = np.arange(items.size) + where + 1  # slot s's items follow s heads and the earlier slots' items
        self.at = np.full(tok.shape[0], -1, dtype=np.int64)  # an item's position in the arrays
        self.at[items] = at
        length = items.size + num_slots
        self.item = np.full(length, -1, dtype=np.int64)
        self.item[at] = items
        self.tok, self.cost, self.count = np.zeros(length), np.zeros(length), np.zeros(length)
        self.tok[at] = tok[items]
        self.cost[at] = cost[items]
        self.count[at] = 1.0
        self.slot_of = slot_of
        self.steps = int(self.size.max(initial=0) + 1).bit_length()  # bisection steps over a segment
        seg = np.repeat(np.arange(num_slots), self.size + 1)
        self.ct, self.cc, self.cn = (self._within(np.cumsum(v), self.head, seg) for v in (self.tok, self.cost, self.count))

    @staticmethod
    def _within(run: np.ndarray, heads: np.ndarray, seg: np.ndarray) -> np.ndarray:
        """Running sums from the start of every segment (each head entry is 0: its sum is the base)."""
        return run - run[heads][seg]

    def search(self, slot: np.ndarray, need: np.ndarray):
        """(position of the fewest small items of `slot` (index order) that free `need` tokens,
        clipped into the arrays; whether the slot has them)."""
        # bisection within each segment (running sums ascend there): its first entry >= need
        lo = self.head[slot]
        end = lo + self.size[slot]
        hi = end + 1
        ct = self.ct
        for _ in range(self.steps):
            mid = (lo + hi) >> 1
            short = ct[np.minimum(mid, end)] < need
            up = short & (lo < hi)
            lo = np.where(up, mid + 1, lo)
            hi = np.where(short, hi, mid)
        return np.minimum(lo, end), lo <= end

    def items(self, slot: np.ndarray, j: np.ndarray):
        """(items, index into `slot` of each): the small items of slot[i] that count, up to position j[i]."""
        pos, grp = _ranges(self.head[slot] + 1, j + 1)
        live = self.count[pos] > 0
        return self.item[pos[live]], grp[live]

    def moved(self, items: np.ndarray) -> None:
        """`items` left their slots: their entries count 0; their slots' sums are recomputed."""
        items = items[self.at[items] >= 0]
        if items.size == 0:
            return
        pos = self.at[items]
        self.tok[pos] = 0.0
        self.cost[pos] = 0.0
        self.count[pos] = 0.0
        slots = np.unique(self.slot_of[items])
        sizes = self.size[slots] + 1
        pos, grp = _ranges(self.head[slots], self.head[slots] + sizes)
        heads = np.cumsum(sizes) - sizes
        self.ct[pos], self.cc[pos], self.cn[pos] = (self._within(np.cumsum(v[pos]), heads, grp)
                                                     for v in (self.tok, self.cost, self.count))


def _by_rank_and_cost(items: np.ndarray, rank_of: np.ndarray, cost: np.ndarray, scale: float, num_ranks: int):
    """(items, starts, key, scale): `items` (grouped by rank) sorted by rank, then cost (ties: their
    order), starts[r] where rank r's begin; key = rank + cost x scale (scale < 1 / (2 max cost)), sorted."""
    key = rank_of[items] + cost[items] * scale
    o = np.argsort(key, kind="stable")  # runs of one rank each: the merge sort is near linear
    items, key = items[o], key[o]
    starts = np.zeros(num_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(rank_of[items], minlength=num_ranks), out=starts[1:])
    return items, starts, key, scale
