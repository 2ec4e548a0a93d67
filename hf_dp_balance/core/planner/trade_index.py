"""Indexes the trades read, so that a round does no O(n) work: running sums of small items (`_PayBack`), items by
rank and cost under one sorted key (`_by_rank_and_cost`), searches within known stretches (`_search_within`)."""

from __future__ import annotations

import numpy as np

_RADIX = 1 << 16  # keys below this sort as 16 bits: numpy's stable sort of them is a radix sort (O(n))


def _ranges(lo: np.ndarray, hi: np.ndarray):
    """(positions, group of each): the concatenated index ranges [lo[g], hi[g]) of every group g."""
    size = hi - lo
    first = np.cumsum(size) - size
    return np.arange(int(size.sum())) + np.repeat(lo - first, size), np.repeat(np.arange(lo.size), size)


def _search_within(a: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray, side: str = "left",
                   clamp: str = "") -> np.ndarray:
    """np.searchsorted(a, v, side) for queries whose answers mostly lie in [lo, hi]: a vectorised binary search
    of each stretch a[lo:hi] (numpy's search of a long `a` in random order misses the cache at every level).
    `clamp` "both": answers clamped to [lo, hi]; "high": to at most hi; else one outside is searched in all `a`."""
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    if v.size == 0 or a.size == 0:  # (an empty `a` has only the stretch [0, 0]: every answer is 0)
        return lo.copy()
    passes = np.less if side == "left" else np.less_equal  # the entries before the answer: a prefix of a[lo:hi]
    # pos = lo + how many of a[lo:hi] pass, by steps of halving powers of two (a block passes by its last entry)
    pos = lo.copy()
    step = 1 << max(int(np.max(hi - lo)).bit_length() - 1, 0)
    while step:
        last = pos + (step - 1)
        pos += ((last < hi) & passes(a.take(last, mode="clip"), v)) * step
        step >>= 1
    if clamp == "both":
        return pos
    # pos is the answer unless a[lo - 1] fails (it lies below lo) or a[hi] passes (above hi); NaN sorts last
    outside = (lo > 0) & ~passes(a[np.maximum(lo - 1, 0)], v) | np.isnan(v)
    if clamp != "high":
        outside |= (hi < a.size) & passes(a[np.minimum(hi, a.size - 1)], v)
    again = np.flatnonzero(outside)
    pos[again] = np.minimum(np.searchsorted(a, v[again], side=side), hi[again] if clamp == "high" else a.size)
    return pos


def _stable_order(values: np.ndarray, below: int) -> np.ndarray:
    """np.argsort(values, kind="stable") of ints < `below`: as uint16 (a radix sort) where all lie in [0, _RADIX)."""
    narrow = below <= _RADIX and (values.size == 0 or int(values.min()) >= 0)
    return np.argsort(values.astype(np.uint16) if narrow else values, kind="stable")


class _PayBack:
    """The small items that never moved of the slots a round searches (index order), as running sums of
    tokens and costs; built per search for the slots asked only (a few hundred of 32K at DP 4096 x 8)."""

    def __init__(self, order: np.ndarray, starts: np.ndarray, tok: np.ndarray, cost: np.ndarray, small: float,
                 moved: np.ndarray):
        self.order, self.tok, self.cost, self.small, self.moved = order, tok, cost, small, moved
        self.starts = starts  # slot s's items are order[starts[s]:starts[s + 1]]
        self.items = order[:0]  # the last search's small items, grouped by the slots it read

    def search(self, slot: np.ndarray, need: np.ndarray):
        """((tokens, cost, count) of the fewest small items of `slot` (index order) that free `need` tokens,
        their first and last position in `items` (last = first - 1 if none), whether the slot has them)."""
        n = slot.size
        back_tok, back_cost, count = np.zeros(n), np.zeros(n), np.zeros(n)
        lo, j, found = np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64), need <= 0
        idx = np.flatnonzero(~found & (need < np.inf))  # (inf: not searched)
        used, inv = np.unique(slot[idx], return_inverse=True)  # the slots asked, each query's among them
        pos, grp = _ranges(self.starts[used], self.starts[used + 1])
        keep = np.flatnonzero((self.tok[self.order[pos]] <= self.small) & ~self.moved[self.order[pos]])
        self.items = self.order[pos[keep]]  # (index arrays, not boolean masks: faster)
        size = np.bincount(grp[keep], minlength=used.size)
        first, size = (np.cumsum(size) - size)[inv], size[inv]
        run_t, run_c = (np.concatenate(([0.0], np.cumsum(x[self.items]))) for x in (self.tok, self.cost))
        # run_t[q] (the sum of items[:q]) never decreases: a search clamped to the slot's stretch is the
        # first q there that frees `need` (past the stretch if none)
        q = _search_within(run_t, need[idx] + run_t[first], first + 1, first + size + 1, clamp="both")
        got = np.flatnonzero(q <= first + size)
        idx, a, q = idx[got], first[got], q[got]
        lo[idx], j[idx], found[idx] = a, q - 1, True
        back_tok[idx], back_cost[idx], count[idx] = run_t[q] - run_t[a], run_c[q] - run_c[a], q - a
        return (back_tok, back_cost, count), lo, j, found

    def paid(self, lo: np.ndarray, j: np.ndarray):
        """(items, index of each into lo / j): the small items at positions lo[i]..j[i] of the last search."""
        pos, grp = _ranges(lo, j + 1)
        return self.items[pos], grp


def _by_rank_and_cost(items: np.ndarray, rank_of: np.ndarray, cost: np.ndarray, scale: float, num_ranks: int):
    """(items, starts, key, scale): `items` by rank, then cost (ties: their order), starts[r] where rank r's
    begin, and the sorted key rank + cost x scale (scale < 1 / (2 max cost): rank r's keys lie in [r, r + 1/2))."""
    ranks = rank_of[items]
    key = ranks + cost[items] * scale
    o = _float_order(key)  # (items grouped by rank sort faster: only each rank's stretch moves)
    return items[o], _rank_starts(ranks, num_ranks), key[o], scale


def _first_best(group: np.ndarray, score: np.ndarray, groups: int) -> np.ndarray:
    """Of every group (ascending) with a finite score, the first candidate with the group's best score."""
    best = np.full(groups, -np.inf)
    np.maximum.at(best, group, score)
    win = np.flatnonzero(np.isfinite(score) & (score == best[group]))
    pick = np.full(groups, group.size, dtype=np.int64)
    np.minimum.at(pick, group[win], win)
    return pick[pick < group.size]


def _float_order(keys: np.ndarray, descending: bool = False) -> np.ndarray:
    """np.argsort(keys, kind="stable") of floats (-keys with `descending`), faster as int64 bits where all >= +0.0."""
    bits = keys.view(np.int64)
    if keys.size and int(bits.min()) < 0:
        return np.argsort(-keys if descending else keys, kind="stable")
    return np.argsort(-bits if descending else bits, kind="stable")


def _rank_starts(ranks: np.ndarray, num_ranks: int) -> np.ndarray:
    """Where each rank's stretch begins in `ranks` sorted, by counts (a -1, not placed, comes first)."""
    starts = np.zeros(num_ranks + 1, dtype=np.int64)
    if ranks.size and int(ranks.min()) < 0:
        placed = ranks[ranks >= 0]
        starts[:] = ranks.size - placed.size
        ranks = placed
    starts[1:] += np.cumsum(np.bincount(ranks, minlength=num_ranks))
    return starts
