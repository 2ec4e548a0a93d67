"""Speed-only rewrites of the planner's per-call work: each checked
against the code it replaced, kept here as the reference, on the same inputs."""

import numpy as np

from hf_dp_balance.core.planner.chain import _ladder_trades
from hf_dp_balance.core.planner.home import _WORTH, _send_home
from hf_dp_balance.core.planner.state import _BREADTH as _NEAR
from hf_dp_balance.core.planner.state import _Members, _copy_state
from hf_dp_balance.core.planner.trade import _apply
from test_planner_chain import _long_tail, _state


def _send_home_before(state, start, ceiling, rounds=4):
    """home._send_home in its plain form: every candidate tested again every round."""
    cap, M, R = state.cap, state.M, state.load.shape[0]
    tok, cost = state.tokens, state.costs
    away = np.flatnonzero(state.dest != start)
    if away.size < 2 or float(tok[away].sum()) < _WORTH * float(tok.sum()):
        return 0, 0
    scale = 1.0 / (2.0 * float(cost[away].max()) + 2.0)
    key = state.dest[away] + cost[away] * scale
    by = np.argsort(key, kind="stable")
    ys, key = away[by], key[by]
    bounds = np.searchsorted(state.dest[ys], np.arange(R + 1))
    home = start[away]
    at = np.searchsorted(key, home + cost[away] * scale)
    pos = at[:, None] + np.arange(-(_NEAR // 2), _NEAR - _NEAR // 2)[None, :]
    ok = (pos >= bounds[home][:, None]) & (pos < bounds[home + 1][:, None])
    x = np.broadcast_to(away[:, None], pos.shape)[ok]
    y = ys[pos[ok]]
    A, B = start[x], state.dest[x]
    saving = tok[x] + np.where(start[y] == B, tok[y], 0.0)
    o = np.argsort(-saving, kind="stable")
    x, y, A, B, saving = x[o], y[o], A[o], B[o], saving[o]
    saved_total, applied = 0.0, 0
    for _ in range(rounds):
        dc = cost[x] - cost[y]
        sx, sy = state.micro[x], state.micro[y]
        good = ((state.dest[x] == B) & (state.dest[y] == A)
                & (state.load[A] + dc <= np.maximum(ceiling[A], state.load[A]))
                & (state.load[B] - dc <= np.maximum(ceiling[B], state.load[B]))
                & (state.slot_tok[B, sx] - tok[x] + tok[y] <= cap)
                & (state.slot_tok[A, sy] - tok[y] + tok[x] <= cap))
        g = np.flatnonzero(good)
        if g.size == 0:
            break
        touched = np.full(R, g.size, dtype=np.int64)
        np.minimum.at(touched, A[g], np.arange(g.size))
        np.minimum.at(touched, B[g], np.arange(g.size))
        win = g[(touched[A[g]] == np.arange(g.size)) & (touched[B[g]] == np.arange(g.size))]
        _apply(state, np.concatenate((x[win], y[win])), np.concatenate((A[win], B[win])),
               np.concatenate((sy[win], sx[win])))
        saved_total += float(saving[win].sum())
        applied += 1
        keep = np.ones(x.size, dtype=bool)
        keep[win] = False
        x, y, A, B, saving = x[keep], y[keep], A[keep], B[keep], saving[keep]
    return saved_total, applied


def test_send_home_retesting_only_the_changed_ranks_candidates_redirects_as_before():
    later_rounds = 0
    for seed in range(12):
        R, M = (16, 24, 48, 64)[seed % 4], (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        state, budget = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        start = state.dest.copy()
        _ladder_trades(state, budget, 0.005)
        _ladder_trades(state, budget, 0.005, min_rate=0.0, near=True)
        for ceiling in (budget * 1.0025, budget * 1.02, state.load.copy()):
            old, new = _copy_state(state), _copy_state(state)
            saved_old, rounds_old = _send_home_before(old, start, ceiling)
            saved_new = _send_home(new, start, ceiling)
            assert saved_new == saved_old, seed
            for name in ("dest", "micro", "load", "slot_tok", "prev"):
                assert np.array_equal(getattr(new, name), getattr(old, name)), (seed, name)
            later_rounds += rounds_old >= 2
    assert later_rounds >= 4  # the candidates kept from one round to the next were exercised


def test_members_bounds_from_counts_equal_the_search_of_the_sorted_ranks():
    rng = np.random.default_rng(3)
    for R in (1, 3, 17, 300):
        dest = rng.integers(0, R, size=5000)
        dest[dest == R // 2] = 0  # a rank with no items
        members = _Members(dest, R)
        assert np.array_equal(members.bounds, np.searchsorted(dest[members.order], np.arange(R + 1)))
        assert [members.of(r).tolist() for r in range(R)] == [np.flatnonzero(dest == r).tolist() for r in range(R)]
    dest[:10] = -1  # items not placed: the search (they sort first)
    members = _Members(dest, 300)
    assert members.bounds[0] == 10 and members.of(0).tolist() == np.flatnonzero(dest == 0).tolist()


def test_lumpy_decides_at_its_edge():
    from types import SimpleNamespace

    from hf_dp_balance.core.planner.pipeline import _lumpy

    # the large items cost exactly _LUMPY x the rest per token (>=: lumpy), just under it, just over it
    tokens = np.array([4096.0] * 3 + [100.0] * 50)
    got = [_lumpy(SimpleNamespace(tokens=tokens, costs=np.where(tokens > 2048, dearer, 1.0) * tokens, cap=32768.0))
           for dearer in (2.0, 2.0 * (1 - 1e-9), 2.0 * (1 + 1e-9))]
    assert got == [True, False, True]
    assert not _lumpy(SimpleNamespace(tokens=np.array([100.0, 0.0]), costs=np.array([5.0, 0.0]), cap=32768.0))
    assert not _lumpy(SimpleNamespace(tokens=np.array([4096.0, 0.0]), costs=np.array([5.0, 3.0]), cap=32768.0))


def test_plan_step_loads_are_the_step_loads_of_steps_slot_loads():
    """api.plan_step sums the slot loads itself (one slot index per placement): the same floats as
    `steps.slot_loads`, before and after, for both sync modes, capped or not."""
    from hf_dp_balance.core.planner import plan_step
    from hf_dp_balance.core.steps import slot_loads

    for seed in range(6):
        R, M = (8, 16, 24)[seed % 3], (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        costs = 1.4e-4 * tokens ** 2 + tokens
        for sync, cap in (("step", 32768), ("step", None), ("micro_batch", 32768)):
            p = plan_step(costs, owners, mbs, R, M, tokens=tokens, max_tokens=cap, sync=sync, min_gain=0.0)
            assert np.array_equal(p.loads_before, slot_loads(costs, owners, mbs, R, M))
            assert np.array_equal(p.loads_after, slot_loads(costs, p.dest_rank, p.dest_micro_batch, R, M))


def _item_keys_before(tok, cost, cap):
    """chain._item_keys in its plain form (every guard applied)."""
    from hf_dp_balance.core.planner.state import _LARGE
    from hf_dp_balance.core.planner.trade_index import _RADIX as _DENSITY_BINS

    dens = np.log(np.maximum(cost, 1e-300) / np.maximum(tok, 1e-300))
    lo, hi = float(dens.min()), float(dens.max())
    bins = ((dens - lo) * ((_DENSITY_BINS - 1) / max(hi - lo, 1e-12))).astype(np.uint16)
    large = np.flatnonzero(tok > cap * _LARGE)
    if large.size == 0:
        return (bins, large, None, None, None, None)
    d_min = float(np.min(cost / np.maximum(tok, np.finfo(np.float64).tiny)))
    surplus = cost[large] - d_min * tok[large]
    return (bins, large, surplus, 1.0 / (float(surplus.max()) * 2.0 + 2.0),
            1.0 / (float(cost[large].max()) * 2.0 + 2.0), float(cost.sum()) / max(float(tok.sum()), 1e-300))


def test_item_keys_with_one_division_and_the_surplus_order_by_bits_are_as_before():
    from hf_dp_balance.core.planner import chain

    rng = np.random.default_rng(4)
    for trial in range(12):
        R, M = 6, 4
        tokens, owners, mbs = _long_tail(trial, R, M, 32768)
        state, _ = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        if trial % 3 == 1:
            state.tokens = state.tokens.copy()
            state.tokens[rng.integers(0, tokens.size, 3)] = 0.0  # the guarded path
        if trial % 3 == 2:
            state.costs = state.costs.copy()
            state.costs[rng.integers(0, tokens.size, 3)] = 0.0
        with np.errstate(over="ignore"):  # (a zero token count: cost / tiny, as before)
            got = chain._item_keys(state)
            want = _item_keys_before(state.tokens, state.costs, state.cap)
        assert len(got) == len(want)
        np.testing.assert_array_equal(got[0], np.argsort(want[0], kind="stable"), err_msg=str(trial))
        for g, w in zip(got[1:], want[1:]):
            assert (g is None and w is None) or np.array_equal(g, w), trial
        lad = chain._make_ladders(state, False)
        if lad is not None:  # the large items by rank and surplus key: the stable float sort's order
            _, large, surplus, scale, _, _ = want
            key = state.dest[large] + (1.0 - (surplus + 1.0) * scale)
            assert np.array_equal(lad.large, large[np.argsort(key, kind="stable")]), trial


def test_send_home_orders_by_bits_as_by_floats_with_a_negative_zero_token_count():
    # tokens of -0.0 pass the input checks (>= 0): savings then hold -0.0 and the float sort is kept
    tokens = np.array([1000.0, 1000.0, -0.0, -0.0, 500.0, 500.0])
    start = np.array([0, 1, 0, 1, 0, 1])
    dest = np.array([1, 0, 1, 0, 0, 1])
    from hf_dp_balance.core.planner.state import _State

    for toks in (tokens, np.abs(tokens)):
        load = np.bincount(dest, weights=toks + 1.0, minlength=2)
        states = [_State(toks + 1.0, toks, 2000.0, np.ones(2), dest, np.zeros(6, dtype=np.int64), 1, load, 0)
                  for _ in range(2)]
        saved_old, _ = _send_home_before(states[0], start, np.full(2, 1e9))
        assert _send_home(states[1], start, np.full(2, 1e9)) == saved_old
        assert np.array_equal(states[0].dest, states[1].dest)
