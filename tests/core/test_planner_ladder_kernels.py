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


def test_ladders_of_the_partners_only_trade_as_the_global_ladders_with_integer_costs():
    """`_ladder_trades(partners_only=True)` builds the ladders of the ranks a round pairs, as rounds
    first pair them; its prefix sums run over those ranks only, so costs sum in another order. With
    integer costs and tokens every sum is exact either way: the trades must be the same."""
    from hf_dp_balance.core.planner.chain import _ladder_trades
    from hf_dp_balance.core.planner.state import _State, _copy_state
    from test_planner_chain import _long_tail

    traded = 0
    for seed in range(8):
        R, M, cap = 16 + 4 * seed, (4, 8)[seed % 2], 32768
        tokens, owners, mbs = _long_tail(seed, R, M, cap)
        costs = np.round(1.4e-4 * tokens ** 2) + tokens + 64.0  # integers
        load = np.bincount(owners, weights=costs, minlength=R)
        state = _State(costs, tokens, float(cap), np.ones(R), owners, mbs, M, load, M)
        budget = np.full(R, load.mean())
        for kw in ({}, {"min_rate": 0.0, "near": True}):
            glob, part = _copy_state(state), _copy_state(state)
            _ladder_trades(glob, budget, 0.005, **kw)
            _ladder_trades(part, budget, 0.005, partners_only=True, **kw)
            np.testing.assert_array_equal(part.dest, glob.dest, err_msg=f"{seed} {kw}")
            np.testing.assert_array_equal(part.micro, glob.micro, err_msg=f"{seed} {kw}")
            np.testing.assert_array_equal(part.load, glob.load)
            traded += int(np.count_nonzero(glob.dest != state.dest))
    assert traded > 100  # the trades moved items


def test_partner_ladders_hold_the_global_large_item_orders_and_swap_searches():
    """Built for every rank, the partner ladders' large items (by surplus, by cost) are the global
    orders rank by rank, and the swap search gives the global answer: inside a rank's stretch the same
    position, below it (a target the lower ranks' keys reach) no item of the rank."""
    from hf_dp_balance.core.planner.chain import _build_partner_ladders, _cost_search, _make_ladders
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
        glob = _make_ladders(state, False, False)
        part = _make_ladders(state, False, True)
        for chunk in np.array_split(rng.permutation(R), 3):  # built in three rounds, in any rank order
            _build_partner_ladders(state, part, chunk)
        for r in range(R):
            g, p = slice(glob.l_lo[r], glob.l_hi[r]), slice(part.l_lo[r], part.l_hi[r])
            np.testing.assert_array_equal(part.large[p], glob.large[g])
            np.testing.assert_array_equal(part.by_cost[p], glob.by_cost[g])
        ranks = rng.integers(0, R, 400)
        # targets in the rank's stretch, above it and below it (into the ranks under it)
        target = ranks + rng.uniform(-0.6, 0.5, ranks.size)
        g_at = _cost_search(glob, ranks, target, glob.l_lo[ranks], glob.l_hi[ranks])
        p_at = _cost_search(part, ranks, target, part.l_lo[ranks], part.l_hi[ranks])
        g_in = (g_at >= glob.l_lo[ranks]) & (g_at <= glob.l_hi[ranks])
        p_in = p_at >= part.l_lo[ranks]
        np.testing.assert_array_equal(p_in, g_in)
        np.testing.assert_array_equal((p_at - part.l_lo[ranks])[p_in], (g_at - glob.l_lo[ranks])[g_in])
        below += int(np.count_nonzero(~g_in))
    assert below > 20  # the searches that fall below a stretch were exercised
