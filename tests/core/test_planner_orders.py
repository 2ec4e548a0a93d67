"""Orders sorted by radix passes (the ladders of chain.py) and per-rank starts by counts: the same arrays as the
plain stable sorts they replace."""

import numpy as np

from hf_dp_balance.core.planner.chain import _item_keys, _ladder_trades, _ladders, _make_ladders
from hf_dp_balance.core.planner.state import _copy_state
from hf_dp_balance.core.planner.trade_index import _RADIX
from test_planner_chain import _long_tail, _state


def test_the_ladders_are_the_items_by_slot_then_density_bin_then_index():
    for seed in range(6):
        R, M = 8 + seed, (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(seed, R, M, 32768)
        state, budget = _state(tokens, owners, mbs, R, M, 32768, 1.4e-4)
        _ladder_trades(state, budget, 0.005)  # a placement the trades changed
        dens = np.log(state.costs / state.tokens)
        bins = ((dens - dens.min()) * ((_RADIX - 1) / (dens.max() - dens.min()))).astype(np.uint16)
        slot = state.dest * M + state.micro
        lad = _make_ladders(state, False)
        np.testing.assert_array_equal(lad.order, np.lexsort((np.arange(slot.size), bins, slot)))
        # the density order is kept for the planning call (copies share it)
        assert state.item_memo["ladder"][0] is _item_keys(_copy_state(state))[0]


def test_the_ladders_past_16_bit_slots_keep_the_plain_sort():
    rng = np.random.default_rng(3)
    bins = rng.integers(0, 1 << 16, 5000).astype(np.uint16)
    for top in (1 << 16, 70001):  # the largest slot: the radix path, then slots that need 17 bits
        slot = rng.integers(0, top, bins.size)
        slot[0] = top - 1
        want = np.lexsort((np.arange(bins.size), bins, slot))
        np.testing.assert_array_equal(_ladders(np.argsort(bins, kind="stable"), slot, top), want)


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
