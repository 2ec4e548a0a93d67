"""Orders read from an earlier placement's (core/planner/state.py `_Members`, core/planner/eject.py `_pool`) and
sorted as packed integers (core/planner/trade_index.py `_stable_argsort`, the ladders of chain.py): the same
arrays as the plain stable sorts they replace."""

import numpy as np

from hf_dp_balance.core.planner.chain import _by_density, _ladder_trades, _ladders
from hf_dp_balance.core.planner.state import _Members, _copy_state
from hf_dp_balance.core.planner.trade_index import _stable_argsort
from test_planner_chain import _long_tail, _state


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


def test_the_ladders_are_the_items_by_slot_then_density_bin_then_index():
    for seed in range(6):
        R, M = 8 + seed, (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        state, budget = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        _ladder_trades(state, budget, 0.005)  # a placement the trades changed
        bins = state.item_memo["ladder"][0]
        slot = state.dest * M + state.micro
        got = _ladders(bins, slot)
        np.testing.assert_array_equal(got, np.lexsort((np.arange(slot.size), bins, slot)))
        # the two radix passes (the density order kept for the call, then the slots) give the same order
        np.testing.assert_array_equal(_ladders(bins, slot, _by_density(state)), got)
        assert state.item_memo["by_density"] is _by_density(_copy_state(state))  # once per call
        # and as main made them: the density order, then a stable sort by slot
        by_density = np.argsort(bins, kind="stable")
        np.testing.assert_array_equal(got, by_density[np.argsort(slot[by_density], kind="stable")])


def test_the_ladders_past_16_bit_slots_keep_the_packed_sort():
    rng = np.random.default_rng(3)
    bins = rng.integers(0, 1 << 16, 5000).astype(np.uint16)
    for top in (1 << 16, 70001):  # the largest slot: the radix path, then slots that need 17 bits
        slot = rng.integers(0, top, bins.size)
        slot[0] = top - 1
        want = np.lexsort((np.arange(bins.size), bins, slot))
        np.testing.assert_array_equal(_ladders(bins, slot, np.argsort(bins, kind="stable")), want)


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


def test_the_rank_starts_by_counts_are_the_searches_of_the_sorted_keys():
    from hf_dp_balance.core.planner.trade_index import _by_rank_and_cost, _rank_starts

    rng = np.random.default_rng(4)
    for trial in range(30):
        R = int(rng.integers(1, 300))
        n = int(rng.integers(0, 3000))
        rank_of = rng.integers(0, R, n)
        cost = rng.uniform(0.0, 1000.0, n) * (trial % 2)  # all-zero costs too: keys exactly at the ranks
        items = rng.permutation(n)[: n // 2]
        got, starts, key, _ = _by_rank_and_cost(items, rank_of, cost, 1.0 / 2001.0, R)
        np.testing.assert_array_equal(starts, np.searchsorted(key, np.arange(R + 1)), err_msg=str(trial))
        ranks = rank_of[items]
        np.testing.assert_array_equal(_rank_starts(ranks, R),
                                      np.searchsorted(np.sort(ranks), np.arange(R + 1)), err_msg=str(trial))
        unplaced = np.where(rng.random(ranks.size) < 0.1, -1, ranks)  # items not placed yet sort first
        np.testing.assert_array_equal(_rank_starts(unplaced, R),
                                      np.searchsorted(np.sort(unplaced), np.arange(R + 1)), err_msg=str(trial))
        got, starts, key, _ = _by_rank_and_cost(items, np.where(rng.random(n) < 0.1, -1, rank_of), cost,
                                                1.0 / 2001.0, R)
        np.testing.assert_array_equal(starts, np.searchsorted(key, np.arange(R + 1)), err_msg=str(trial))
        assert np.all(np.diff(key) >= 0), trial


def test_the_float_order_is_the_stable_float_sort_either_way():
    from hf_dp_balance.core.planner.trade_index import _float_order

    rng = np.random.default_rng(6)
    for trial in range(20):
        keys = np.round(rng.uniform(0.0, 50.0, int(rng.integers(0, 400))), 1)  # many ties
        if trial % 4 == 1 and keys.size:
            keys[rng.integers(0, keys.size, 3)] = -0.0  # a sign bit set: the float sort
        if trial % 4 == 2:
            keys -= 25.0  # negative keys
        for descending in (False, True):
            want = np.argsort(-keys if descending else keys, kind="stable")
            np.testing.assert_array_equal(_float_order(keys, descending), want, err_msg=f"{trial} {descending}")
