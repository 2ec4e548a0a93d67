"""The published system's balancing method, as the baseline to compare against.

LoongForge-style greedy:

1. sort all items by cost, heaviest first, and put each on the least-loaded
   rank whose token count stays within ``max_token_ratio`` x the average
   tokens per rank (if none has room, on the rank with the fewest tokens);
2. then up to ``max_iters`` refinement iterations between the most and the
   least loaded rank: stop when their gap is within ``tolerance`` of the
   largest load; otherwise apply the single move, or else the swap, that
   brings the pair closest to even without breaking the token cap.

Published skip rules (on in the simulator, off in the planner benchmark):
keep everything in place when the current imbalance ``max/mean - 1`` is below
``skip_imbalance``, and when one item is heavier than the average rank load
(``skip_single_sample``).

Straightforward Python: it is the baseline, not the product.
"""

from __future__ import annotations

import heapq

import numpy as np

from hf_dp_balance.core.planner.bounds import _lower_bound
from hf_dp_balance.core.planner.results import Plan
from hf_dp_balance.core.planner.validation import _as_index_array, _as_item_values, _check_count

__all__ = ["plan_reference_greedy"]


def plan_reference_greedy(costs, owners, num_ranks, *, tokens=None, max_token_ratio=1.2, max_iters=20,
                          tolerance=0.05, skip_imbalance=0.2, skip_single_sample=True) -> Plan:
    """Re-place every item from scratch (sorted greedy + pairwise refinement); see the module docstring."""
    num_ranks = _check_count(num_ranks, "num_ranks")
    c = _as_item_values(costs, "costs", None)
    n = c.shape[0]
    own = _as_index_array(owners, "owners", n, num_ranks, "num_ranks")
    tok = np.ones(n) if tokens is None else _as_item_values(tokens, "tokens", n)
    if not max_token_ratio >= 1.0:
        raise ValueError(f"max_token_ratio={max_token_ratio!r}: must be >= 1")
    loads_before = np.bincount(own, weights=c, minlength=num_ranks)
    mk_before = float(loads_before.max())
    lb = _lower_bound(c, np.zeros(num_ranks), np.ones(num_ranks))

    def keep(reason):
        return Plan(dest=own.copy(), applied=False, reason=reason, loads_before=loads_before,
                    loads_after=loads_before.copy(), lower_bound=lb, makespan_before=mk_before,
                    makespan_after=mk_before, moved=0, path="kept")

    if n == 0 or mk_before <= 0:
        return keep("nothing to balance")
    mean = float(loads_before.mean())
    imbalance = mk_before / mean - 1.0
    if imbalance < skip_imbalance:
        return keep(f"imbalance {100 * imbalance:.1f}% < {100 * skip_imbalance:.1f}%")
    if skip_single_sample and float(c.max()) > mean:
        return keep("a single sample is heavier than the average rank")

    placement = _Placement(c.tolist(), tok.tolist(), num_ranks, max_token_ratio * float(tok.sum()) / num_ranks)
    _sorted_greedy(placement)
    _refine_pairs(placement, max_iters, tolerance)
    dest_arr = np.asarray(placement.dest, dtype=np.int64)
    loads_after = np.bincount(dest_arr, weights=c, minlength=num_ranks)
    return Plan(dest=dest_arr, applied=True, reason=f"imbalance {100 * imbalance:.1f}%: re-placed greedily",
                loads_before=loads_before, loads_after=loads_after, lower_bound=lb, makespan_before=mk_before,
                makespan_after=float(loads_after.max()), moved=int(np.count_nonzero(dest_arr != own)),
                path="reference")


class _Placement:
    """Loads, token counts and members of every rank while the greedy runs (plain Python lists)."""

    def __init__(self, costs: list, tokens: list, num_ranks: int, cap: float):
        self.costs, self.tokens, self.num_ranks, self.cap = costs, tokens, num_ranks, cap
        self.load = [0.0] * num_ranks
        self.ntok = [0.0] * num_ranks
        self.members = [[] for _ in range(num_ranks)]
        self.dest = [0] * len(costs)

    def put(self, i: int, r: int) -> None:
        self.load[r] += self.costs[i]
        self.ntok[r] += self.tokens[i]
        self.members[r].append(i)
        self.dest[i] = r

    def move(self, i: int, frm: int, to: int) -> None:
        self.members[frm].remove(i)
        self.members[to].append(i)
        self.load[frm] -= self.costs[i]
        self.load[to] += self.costs[i]
        self.ntok[frm] -= self.tokens[i]
        self.ntok[to] += self.tokens[i]
        self.dest[i] = to


def _sorted_greedy(p: _Placement) -> None:
    """Step 1: heaviest first onto the least-loaded rank with token room (else the rank with the
    fewest tokens, which then leaves the heap). A heap of (load, rank)."""
    heap = [(0.0, r) for r in range(p.num_ranks)]
    for i in sorted(range(len(p.costs)), key=lambda i: (-p.costs[i], i)):
        aside = []
        chosen = None
        while heap:
            entry = heapq.heappop(heap)
            if p.ntok[entry[1]] + p.tokens[i] <= p.cap:
                chosen = entry[1]
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(heap, entry)
        if chosen is None:
            chosen = min(range(p.num_ranks), key=lambda r: (p.ntok[r], r))
            heap = [e for e in heap if e[1] != chosen]
            heapq.heapify(heap)
        p.put(i, chosen)
        heapq.heappush(heap, (p.load[chosen], chosen))


def _refine_pairs(p: _Placement, max_iters: int, tolerance: float) -> None:
    """Step 2: up to `max_iters` times, the move (else swap) between the most and the least loaded
    rank that brings them closest to even within the token cap; stops when their gap is within
    `tolerance` of the larger load or nothing helps."""
    for _ in range(max_iters):
        hi = max(range(p.num_ranks), key=lambda r: (p.load[r], -r))
        lo = min(range(p.num_ranks), key=lambda r: (p.load[r], r))
        gap = p.load[hi] - p.load[lo]
        if hi == lo or gap <= tolerance * p.load[hi]:
            return
        best = _best_pair_move(p, hi, lo, gap)
        if best is None:
            return
        _, a, b = best
        p.move(a, hi, lo)
        if b is not None:
            p.move(b, lo, hi)


def _best_pair_move(p: _Placement, hi: int, lo: int, gap: float):
    """(resulting |gap|, item from hi, item from lo or None): the best single move hi -> lo, or,
    if there is none, the best swap; None when neither narrows the gap within the cap."""
    best = None
    for a in p.members[hi]:
        ca = p.costs[a]
        if 0 < ca < gap and p.ntok[lo] + p.tokens[a] <= p.cap:
            after = abs(gap - 2 * ca)
            if best is None or after < best[0]:
                best = (after, a, None)
    if best is not None:
        return best
    for a in p.members[hi]:
        for b in p.members[lo]:
            d = p.costs[a] - p.costs[b]
            dt = p.tokens[a] - p.tokens[b]
            if 0 < d < gap and p.ntok[lo] + dt <= p.cap and p.ntok[hi] - dt <= p.cap:
                after = abs(gap - 2 * d)
                if best is None or after < best[0]:
                    best = (after, a, b)
    return best
