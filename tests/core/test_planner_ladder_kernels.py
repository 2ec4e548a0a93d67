"""Same-result shortcuts inside the ladder trades (core/planner/chain.py): each equals the plain loop it
replaces, on float tokens too (where sums and running subtractions round differently)."""

from types import SimpleNamespace

import numpy as np

from hf_dp_balance.core.planner.chain import _place_back
from hf_dp_balance.core.planner.trade_index import _ranges


def _place_back_loop(state, order, base, n_back, h, ma, ta):
    """`_place_back` as it was before the leading items went in by `_into_own_slot`: item by item from
    the first one of every spilling trade."""
    cap = state.cap
    size = n_back
    first = np.cumsum(size) - size
    pos, of = _ranges(base, base + size)
    back = order[pos]
    to = np.repeat(ma, size)
    ok = np.ones(h.size, dtype=bool)
    if back.size == 0:
        return back, to, ok
    room_ma = cap - state.slot_tok[h, ma] + ta
    cum = np.cumsum(state.tokens[back])
    cum -= np.repeat(np.concatenate(([0.0], cum))[first], size)
    spills = np.zeros(h.size, dtype=bool)
    spills[of[cum > room_ma[of]]] = True
    t = np.flatnonzero(spills)
    room = cap - state.slot_tok[h[t]]
    row = np.arange(t.size)
    room[row, ma[t]] += ta[t]
    for k in range(int(size[t].max()) if t.size else 0):
        go = np.flatnonzero(size[t] > k)
        t, row = t[go], row[go]
        p = first[t] + k
        tk = state.tokens[back[p]]
        s = np.where(room[row, ma[t]] >= tk, ma[t], np.argmax(room[row], axis=1))
        fits = room[row, s] >= tk
        ok[t[~fits]] = False
        t, row, p, s, tk = t[fits], row[fits], p[fits], s[fits], tk[fits]
        room[row, s] -= tk
        to[p] = s
    return back, to, ok


def test_the_pay_back_skipping_the_items_that_fit_a_s_slot_places_as_the_item_by_item_loop():
    rng = np.random.default_rng(5)
    spilled = failed = 0
    for trial in range(300):
        R, M, cap = int(rng.integers(2, 9)), int(rng.integers(1, 5)), 1000.0
        n = int(rng.integers(20, 200))
        whole = trial % 2 == 0  # integer tokens, and floats whose sums round
        tokens = rng.integers(1, 120, n).astype(float) if whole else rng.uniform(0.1, 120.0, n) / 3.0
        slot_tok = rng.uniform(0.5, 1.0, (R, M)) * cap
        state = SimpleNamespace(cap=cap, tokens=tokens, slot_tok=slot_tok)
        T = int(rng.integers(1, R + 1))
        h = rng.choice(R, size=T, replace=False)
        ma = rng.integers(0, M, T)
        ta = rng.uniform(0.0, 400.0, T)
        n_back = rng.integers(0, 12, T)
        order = rng.permutation(n)
        base = np.concatenate(([0], np.cumsum(n_back)[:-1]))  # disjoint stretches of the ladder
        base = np.minimum(base, n - n_back)
        want = _place_back_loop(state, order, base, n_back, h, ma, ta)
        got = _place_back(state, order, base, n_back, h, ma, ta)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(g, w, err_msg=str(trial))
        spilled += int(np.any(want[1] != np.repeat(ma, n_back)))
        failed += int(not want[2].all())
    assert spilled > 50 and failed > 10  # both the spilling and the failing branches were exercised


def test_each_rank_s_cost_keys_lie_in_its_own_half_unit_so_a_swap_search_stays_in_its_stretch():
    """The swap search of `_round` reads np.searchsorted of all ranks' large-item cost keys at rank + c x scale
    (c no more than any large item's cost) and takes lo - 1 below l's stretch: that holds because rank r's keys
    lie in [r, r + 1/2), ascending, its stretch [l_lo[r], l_hi[r]) holding exactly its unmoved large items."""
    from hf_dp_balance.core.planner.chain import _make_ladders
    from hf_dp_balance.core.planner.state import _State
    from test_planner_chain import _long_tail

    rng = np.random.default_rng(9)
    below = 0
    for seed in range(6):
        R, M, cap = 20 + 5 * seed, 8, 32768
        tokens, owners, mbs = _long_tail(seed, R, M, cap)
        costs = 1.4e-4 * tokens ** 2 + tokens + 64.0
        load = np.bincount(owners, weights=costs, minlength=R)
        state = _State(costs, tokens, float(cap), np.ones(R), owners, mbs, M, load, M)
        lad = _make_ladders(state, False)
        assert np.all(np.diff(lad.cost_key) >= 0)
        ranks = np.repeat(np.arange(R), lad.l_hi - lad.l_lo)
        np.testing.assert_array_equal(state.dest[lad.by_cost], ranks)
        assert np.all((lad.cost_key >= ranks) & (lad.cost_key < ranks + 0.5))
        large = np.flatnonzero(tokens > cap / 16)
        assert np.array_equal(np.sort(lad.by_cost), large)
        # a target rank + c x scale with c x scale in [-0.6, 1/2) (c < 0: l should keep more than a costs)
        # falls inside l's stretch, or below it only where c < 0 (no b of l is then worth the swap)
        r = rng.integers(0, R, 400)
        target = r + rng.uniform(-0.6, 0.5, r.size)
        got = np.searchsorted(lad.cost_key, target)
        assert np.all(got <= lad.l_hi[r])
        assert np.all((got >= lad.l_lo[r]) | (target < r))
        below += int(np.count_nonzero(got < lad.l_lo[r]))
    assert below > 20  # the searches that fall below a stretch were exercised
