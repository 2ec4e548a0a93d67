"""Sorted orders kept between passes and patched where few keys changed (core/planner/state.py `_Members`,
core/planner/chain.py `_ladders`, core/planner/trade_index.py `_patched_order`): the same arrays as a fresh sort."""

import numpy as np

from hf_dp_balance.core.planner.chain import _ladder_trades, _ladders
from hf_dp_balance.core.planner.state import _Members, _copy_state
from hf_dp_balance.core.planner.trade_index import _memo_order, _patched_order, _stable_argsort
from test_planner_chain import _long_tail, _state


def test_a_patched_order_is_the_stable_sort_of_the_new_keys():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(0, 60))
        span = int(rng.integers(1, 8))  # few distinct keys: many ties, broken by index
        old = rng.integers(0, span, n).astype(np.int64)
        new = old.copy()
        changed = np.flatnonzero(rng.random(n) < rng.choice([0.0, 0.05, 0.3, 1.0]))
        new[changed] = rng.integers(0, span + 2, changed.size)
        changed = np.flatnonzero(new != old)
        got = _patched_order(np.argsort(old, kind="stable"), new, changed)
        np.testing.assert_array_equal(got, np.argsort(new, kind="stable"), err_msg=str(trial))


def test_a_patched_order_of_float_keys_breaks_ties_by_index_and_a_memo_rebases():
    rng = np.random.default_rng(2)
    for trial in range(200):
        n = int(rng.integers(1, 80))
        old = rng.choice([0.0, 0.5, 1.25, 3.0, 1e300], n)  # ties everywhere
        new = old.copy()
        changed = np.flatnonzero(rng.random(n) < 0.1)
        new[changed] = rng.choice([0.0, 0.5, 2.0, 1e300], changed.size)
        memo = {}
        _memo_order(memo, "k", old)
        got = _memo_order(memo, "k", new)
        np.testing.assert_array_equal(got, np.argsort(new, kind="stable"), err_msg=str(trial))
        assert memo["k"][0] is new and memo["k"][1] is got  # the new keys are the base of the next call


def _groups(members, R):
    return [members.of(r).tolist() for r in range(R)]


def test_members_from_a_shared_base_equal_a_fresh_build_after_moves():
    rng = np.random.default_rng(1)
    for seed in range(8):
        R, M = 5 + seed, (1, 2, 4, 8)[seed % 4]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        state, _ = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        first = _Members(state.dest, R, state.order_memo)
        assert first.touched is None and "members" in state.order_memo  # the base: a fresh sort
        n = state.dest.size
        for step in range(3):
            twin = _copy_state(state)  # copies share the memo; each build diffs against the same base
            for item in rng.choice(n, size=max(1, n // 100), replace=False).tolist():
                twin.move(item, int(rng.integers(0, R)), int(rng.integers(0, M)))
            patched = _Members(twin.dest, R, twin.order_memo)
            assert patched.touched is not None  # the patched path ran (few items moved)
            assert _groups(patched, R) == _groups(_Members(twin.dest, R), R), (seed, step)
            # and later moves patch it as they patch a fresh one
            fresh = _Members(twin.dest, R)
            for item in rng.choice(n, size=5, replace=False).tolist():
                frm, to = int(twin.dest[item]), int(rng.integers(0, R))
                twin.move(item, to, 0)
                patched.moved(item, frm, to)
                fresh.moved(item, frm, to)
            assert _groups(patched, R) == _groups(fresh, R), (seed, step)


def test_ladders_patched_between_passes_equal_a_fresh_sort():
    for seed in range(6):
        R, M = 8 + seed, (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        state, budget = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        _ladder_trades(state, budget, 0.005)  # the first pass: a fresh sort, kept in the memo
        base = state.order_memo["ladders"]
        bins = state.item_memo["ladder"][0]
        slot = state.dest * M + state.micro
        fresh = np.argsort(slot.astype(np.int64) * 65536 + bins, kind="stable")
        np.testing.assert_array_equal(_ladders(bins, slot, {}), fresh)
        memo = {"ladders": base}
        np.testing.assert_array_equal(_ladders(bins, slot, memo), fresh)
        assert memo["ladders"][1] is not base[1] or np.array_equal(base[0], memo["ladders"][0])
        # the order is (slot, density bin, index)
        key = slot[fresh] * 65536 + bins[fresh]
        assert np.all(np.diff(key) >= 0)


def test_an_exchange_reading_the_pool_of_its_twin_moves_as_one_made_afresh():
    """`_polish` tries both variants of `_eject` on copies of one state: the second reads the pool the
    first kept (`eject._pool`); it must move exactly as `_eject` on a state with no memo, and a state
    that changed since must not read it."""
    from hf_dp_balance.core.planner.eject import _eject, _pool
    from hf_dp_balance.core.planner.state import _State

    def fresh(st):  # the same placement, nothing kept
        return _State(st.costs, st.tokens, st.cap, st.speeds, st.dest, st.micro, st.M, st.load, st.min_count,
                      slot_tok=st.slot_tok)

    checked = 0
    for seed in range(8):
        R, M = 6 + seed, (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        state, budget = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        limit = budget * 1.0025
        for wide in (False, True):
            twin, alone = _copy_state(state), fresh(state)
            assert _eject(twin, budget, limit, wide) == _eject(alone, budget, limit, wide)
            np.testing.assert_array_equal(twin.dest, alone.dest)
            np.testing.assert_array_equal(twin.micro, alone.micro)
            checked += int(not np.array_equal(twin.dest, state.dest))
        # a changed placement (an item of the pool moved within its rank): the kept pool is stale for it
        moved = _copy_state(state)
        h = int(np.argmax(moved.load / budget))
        recv = np.argmin(moved.slot_tok, axis=1)
        _pool(moved, h, recv)
        item = int(np.flatnonzero((moved.dest != h) & (moved.micro == recv[moved.dest]))[0])
        moved.micro[item] = (moved.micro[item] + 1) % M
        for st in (moved, _copy_state(state)):  # stale, then the same placement again
            got = _pool(st, h, recv)
            want = np.flatnonzero((st.dest != h) & (st.micro == recv[st.dest]))
            want = want[np.lexsort((want, -st.costs[want], st.dest[want]))]
            np.testing.assert_array_equal(got, want)
    assert checked > 0  # some exchanges did move items


def test_the_packed_sort_of_integer_keys_is_the_stable_argsort():
    rng = np.random.default_rng(3)
    for trial in range(200):
        n = int(rng.integers(0, 300))
        dtype = rng.choice([np.uint16, np.uint32, np.int64, np.float64])
        keys = rng.integers(0, rng.choice([2, 7, 1000]), n).astype(dtype)
        np.testing.assert_array_equal(_stable_argsort(keys), np.argsort(keys, kind="stable"), err_msg=str(trial))
    big = np.array([1 << 61, 3, 1 << 61, 0, -1], dtype=np.int64)  # no room for the index / negative: a plain sort
    np.testing.assert_array_equal(_stable_argsort(big), [4, 3, 1, 0, 2])
    np.testing.assert_array_equal(_stable_argsort(big[:4]), [3, 1, 0, 2])
