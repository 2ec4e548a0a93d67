"""Sending items home after full-cap trades. Trades in several passes leave detours: rank A sent x to B and
later took y from C. Where x and y are alike, y takes x's place on B and x goes home to A: A and B change by
c_x - c_y, every slot keeps its item count, and x no longer crosses the network (nor y, when B is y's home)."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.refine import _swap_fits
from hf_dp_balance.core.planner.state import _BREADTH, _State
from hf_dp_balance.core.planner.trade import _apply, _first_touching
from hf_dp_balance.core.planner.trade_index import _by_rank_and_cost, _float_order

_WORTH = 0.05  # runs only where the plan sends at least this share of the tokens (below, little to save)


def _send_home(state: _State, start: np.ndarray, ceiling: np.ndarray, rounds: int = 4) -> int:
    """Swap pairs (x away from its home A, now on B; y now on A, from C != A): y -> (B, x's slot), x ->
    (A, y's slot), where both fit, A and B end at or under `ceiling` and fewer tokens are sent; per round
    every x's _BREADTH candidates y nearest in cost, then pairs touching each rank once, most saved
    first. Returns the tokens saved. Guarantees: no slot goes over the cap; every rank and slot keeps
    its item count; no rank ends above max(its load now, `ceiling`)."""
    R, tok, cost = state.load.shape[0], state.tokens, state.costs  # (after full-cap trades: a cap, tokens)
    away = np.flatnonzero(state.dest != start)
    if away.size < 2 or float(tok[away].sum()) < _WORTH * float(tok.sum()):
        return 0
    # the items away from home by the rank they are on, cheapest first: a key rank + cost x scale
    ys, bounds, key, scale = _by_rank_and_cost(away, state.dest, cost, 1.0 / (2.0 * float(cost[away].max()) + 2.0), R)
    home = start[away]
    at = np.searchsorted(key, home + cost[away] * scale)
    pos = at[:, None] + np.arange(-(_BREADTH // 2), _BREADTH - _BREADTH // 2)[None, :]
    ok = (pos >= bounds[home][:, None]) & (pos < bounds[home + 1][:, None])
    x, y = np.broadcast_to(away[:, None], pos.shape)[ok], ys[pos[ok]]
    # most tokens saved first (ties: the candidates' (x, y position) order); one holds while x and y stay put
    saving = tok[x] + np.where(start[y] == state.dest[x], tok[y], 0.0)
    o = _float_order(saving, descending=True)
    x, y, saving = x[o], y[o], saving[o]
    A, B, dc = start[x], state.dest[x], cost[x] - cost[y]
    saved_total = 0.0
    for _ in range(rounds):
        load_A, load_B = state.load[A], state.load[B]
        g = np.flatnonzero((state.dest[x] == B) & (state.dest[y] == A)  # both still in place
                           & (load_A + dc <= np.maximum(ceiling[A], load_A))
                           & (load_B - dc <= np.maximum(ceiling[B], load_B))
                           & _swap_fits(state, A, y, x, B))  # a one-for-one swap of y on A and x on B
        if g.size == 0:
            break
        win = g[_first_touching(R, A[g], B[g])]  # every rank in at most one pair, the first (most saved)
        _apply(state, np.concatenate((x[win], y[win])), np.concatenate((A[win], B[win])),
               np.concatenate((state.micro[y[win]], state.micro[x[win]])))
        saved_total += float(saving[win].sum())
    return saved_total
