"""The one-for-many exchange's receiver (core/planner/eject.py `_receiver`): for every rank, the fewest of
its heaviest items that make room for the item it takes, checked against a plain count item by item."""

import numpy as np

from hf_dp_balance.core.planner.eject import _pool, _receiver
from hf_dp_balance.core.planner.state import _State


def _fewest(state, a, sel, recv_slot, limit, r):
    """Items rank r must shed to take `a` (inf when its movable ones are not enough), one at a time."""
    need = state.load[r] + state.costs[a] - limit[r]
    tneed = -np.inf if state.cap is None else state.slot_tok[r, recv_slot[r]] + state.tokens[a] - state.cap
    mine = sel[state.dest[sel] == r]
    shed_c = shed_t = 0.0
    for k in range(mine.size + 1):
        if shed_c >= need and shed_t >= tneed:
            return k
        if k < mine.size:
            shed_c += state.costs[mine[k]]
            shed_t += state.tokens[mine[k]]
    return np.inf


def test_the_receiver_sheds_the_fewest_heaviest_items_that_make_room():
    rng = np.random.default_rng(11)
    checked = 0
    for trial in range(60):
        R, M = int(rng.integers(2, 9)), int(rng.integers(1, 4))
        n = int(rng.integers(R * M, 12 * R * M))
        costs = np.round(rng.pareto(1.3, n) * 10 + 1, 1)
        tokens = np.round(rng.uniform(1, 50, n))
        dest, micro = rng.integers(0, R, n), rng.integers(0, M, n)
        fullest_slot = float(np.bincount(dest * M + micro, weights=tokens).max())
        cap = None if trial % 3 == 0 else fullest_slot * rng.uniform(1.0, 1.3)
        load = np.bincount(dest, weights=costs, minlength=R)
        state = _State(costs, tokens, cap, np.ones(R), dest, micro, M, load, 0)
        limit = np.full(R, load.mean() * rng.uniform(1.0, 1.2))
        h = int(np.argmax(load))
        recv_slot = np.zeros(R, dtype=np.int64) if state.slot_tok is None else np.argmin(state.slot_tok, axis=1)
        pool = _pool(state, h, recv_slot)
        a = int(np.flatnonzero(dest == h)[0])
        found = _receiver(state, a, h, pool, recv_slot, limit, np.ones(R))
        want = np.array([np.inf if r == h else _fewest(state, a, pool, recv_slot, limit, r) for r in range(R)])
        if not np.isfinite(want).any():
            assert found is None, trial
            continue
        _, r, shed = found
        after = (load + costs[a]) - np.array([costs[pool[dest[pool] == q][: int(k)]].sum() if np.isfinite(k) else 0.0
                                              for q, k in enumerate(want)])
        best = min(range(R), key=lambda q: (want[q], after[q] if np.isfinite(want[q]) else np.inf, q))
        assert r == best and shed.size == want[r], (trial, r, best, shed.size, want[r])
        np.testing.assert_array_equal(shed, pool[dest[pool] == r][: shed.size])
        checked += 1
    assert checked > 20, checked
