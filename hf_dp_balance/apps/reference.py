"""The published system's balancing method, as the baseline to compare against.

LoongForge-style greedy, as issue 2 describes it:

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

from hf_dp_balance.core.planner import Plan, _as_index_array, _as_item_values, _check_count, _lower_bound

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
    zero = np.zeros(num_ranks)
    ones = np.ones(num_ranks)
    loads_before = np.bincount(own, weights=c, minlength=num_ranks)
    mk_before = float(loads_before.max())
    lb = _lower_bound(c, zero, ones)

    def keep(reason):
        return Plan(dest=own.copy(), applied=False, reason=reason, loads_before=loads_before,
                    loads_after=loads_before.copy(), lower_bound=lb, makespan_before=mk_before,
                    makespan_after=mk_before, moved=0)

    if n == 0 or mk_before <= 0:
        return keep("nothing to balance")
    mean = float(loads_before.mean())
    imbalance = mk_before / mean - 1.0
    if imbalance < skip_imbalance:
        return keep(f"imbalance {100 * imbalance:.1f}% < {100 * skip_imbalance:.1f}%")
    if skip_single_sample and float(c.max()) > mean:
        return keep("a single sample is heavier than the average rank")

    cap = max_token_ratio * float(tok.sum()) / num_ranks
    cost_list = c.tolist()
    tok_list = tok.tolist()
    load = [0.0] * num_ranks
    ntok = [0.0] * num_ranks
    members = [[] for _ in range(num_ranks)]
    dest = [0] * n

    # 1. sorted greedy: heaviest first onto the least-loaded rank with token room
    heap = [(0.0, r) for r in range(num_ranks)]
    for i in sorted(range(n), key=lambda i: (-cost_list[i], i)):
        aside = []
        chosen = None
        while heap:
            entry = heapq.heappop(heap)
            if ntok[entry[1]] + tok_list[i] <= cap:
                chosen = entry[1]
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(heap, entry)
        if chosen is None:
            chosen = min(range(num_ranks), key=lambda r: (ntok[r], r))
            heap = [e for e in heap if e[1] != chosen]
            heapq.heapify(heap)
        load[chosen] += cost_list[i]
        ntok[chosen] += tok_list[i]
        members[chosen].append(i)
        dest[i] = chosen
        heapq.heappush(heap, (load[chosen], chosen))

    # 2. pairwise refinement between the most and least loaded rank
    for _ in range(max_iters):
        hi = max(range(num_ranks), key=lambda r: (load[r], -r))
        lo = min(range(num_ranks), key=lambda r: (load[r], r))
        gap = load[hi] - load[lo]
        if hi == lo or gap <= tolerance * load[hi]:
            break
        best = None  # (resulting |gap|, item from hi, item from lo or None)
        for a in members[hi]:
            ca = cost_list[a]
            if 0 < ca < gap and ntok[lo] + tok_list[a] <= cap:
                after = abs(gap - 2 * ca)
                if best is None or after < best[0]:
                    best = (after, a, None)
        if best is None:
            for a in members[hi]:
                for b in members[lo]:
                    d = cost_list[a] - cost_list[b]
                    dt = tok_list[a] - tok_list[b]
                    if 0 < d < gap and ntok[lo] + dt <= cap and ntok[hi] - dt <= cap:
                        after = abs(gap - 2 * d)
                        if best is None or after < best[0]:
                            best = (after, a, b)
        if best is None:
            break
        _, a, b = best
        for item, frm, to in ((a, hi, lo),) + (((b, lo, hi),) if b is not None else ()):
            members[frm].remove(item)
            members[to].append(item)
            load[frm] -= cost_list[item]
            load[to] += cost_list[item]
            ntok[frm] -= tok_list[item]
            ntok[to] += tok_list[item]
            dest[item] = to

    dest_arr = np.asarray(dest, dtype=np.int64)
    loads_after = np.bincount(dest_arr, weights=c, minlength=num_ranks)
    mk_after = float(loads_after.max())
    return Plan(dest=dest_arr, applied=True, reason=f"imbalance {100 * imbalance:.1f}%: re-placed greedily",
                loads_before=loads_before, loads_after=loads_after, lower_bound=lb, makespan_before=mk_before,
                makespan_after=mk_after, moved=int(np.count_nonzero(dest_arr != own)))
