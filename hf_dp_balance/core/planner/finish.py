"""The last tenths after long items first: 1-for-1 swaps that bring the fullest rank under the trades' limit.

Long items first (core/planner/assign.py) can leave a rank just over the trades' limit that holds
little but its own long items: its short items all sent away, one item per micro-batch (which the
item count forbids it to give away), e.g. two 26K samples at 1.0029 x the budget. The ladder and
small-change trades pair it with the two emptiest ranks only and find nothing there, and then the
trades alone ran again from the start (2048 x 4: 20.9% of the tokens sent instead of 12.5%). A swap
of one of its items `a` for a slightly cheaper item `b` of any other rank with the load room for the
difference fixes it for a few hundred tokens: nothing changes anywhere else.
"""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.state import _State

_ROUNDS = 32  # swaps at most per call (each one brings one rank under the limit)


def _swap_down(state: _State, limit: np.ndarray, start: np.ndarray, rounds: int = _ROUNDS) -> int:
    """While the fullest rank h (load / limit) is over `limit`: the swap of an item a of h with an
    item b of another rank l that leaves both at or under their limits and both slots within the
    cap, the fewest tokens newly sent (against `start`) first, then the lowest (a, b) indexes. Stops at
    the first h with no such swap. Item counts never change. Returns the swaps made. Cost per
    swap: O(n) numpy (the items of h, and the items whose cost is within the largest load room of
    each item of h)."""
    cap, tok, cost = state.cap, state.tokens, state.costs
    by_cost = np.argsort(cost, kind="stable")
    cost_sorted = cost[by_cost]
    made = 0
    scale = np.maximum(limit, np.finfo(np.float64).tiny)
    for _ in range(rounds):
        h = int(np.argmax(state.load / scale))
        excess = float(state.load[h] - limit[h])
        if excess <= 0:
            break
        room = limit - state.load  # load room per rank (h's is negative)
        most = float(room.max())
        if most <= 0:
            break
        best = None
        for a in np.flatnonzero(state.dest == h).tolist():
            ca, ta, ma = float(cost[a]), float(tok[a]), int(state.micro[a])
            # b: c_a - c_b in [excess, most], b on another rank whose load room takes c_a - c_b
            lo = np.searchsorted(cost_sorted, ca - most, side="left")
            hi = np.searchsorted(cost_sorted, ca - excess, side="right")
            if hi <= lo:
                continue
            b = by_cost[lo:hi]
            l = state.dest[b]
            diff = ca - cost[b]
            ok = (l != h) & (diff <= room[l]) & (diff >= excess)
            ok &= state.slot_tok[l, state.micro[b]] - tok[b] + ta <= cap  # a in b's slot
            ok &= state.slot_tok[h, ma] - ta + tok[b] <= cap  # b in a's slot
            if not ok.any():
                continue
            b, l = b[ok], l[ok]
            sent = ta * ((l != start[a]).astype(np.float64) - float(h != start[a]))
            sent += tok[b] * ((start[b] != h).astype(np.float64) - (start[b] != l))
            k = int(np.lexsort((b, sent))[0])
            if best is None or (sent[k], a, int(b[k])) < best[:3]:
                best = (float(sent[k]), a, int(b[k]), int(l[k]))
        if best is None:
            break
        _, a, b, l = best
        ma, mb = int(state.micro[a]), int(state.micro[b])
        state.move(a, l, mb)
        state.move(b, h, ma)
        made += 1
    return made
