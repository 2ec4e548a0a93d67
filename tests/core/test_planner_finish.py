"""1-for-1 swaps that bring the fullest rank under the trades' limit (core/planner/finish.py)."""

import numpy as np
from hypothesis import given, settings, strategies as st

from hf_dp_balance.core.planner.refine import _swap_down
from hf_dp_balance.core.planner.state import _State


def _state(tokens, owners, micro, R, M, cap, costs=None):
    costs = tokens.copy() if costs is None else costs
    return _State(costs, tokens, cap, np.ones(R), owners, micro, M, np.bincount(owners, weights=costs, minlength=R),
                  1)


def _two_ranks():
    """(tokens, owners, micro-batches): rank 0 holds 60 and 41 tokens, one item per slot; rank 1 holds 58 + 1
    and 39 + 38 (cost = tokens)."""
    return (np.array([60.0, 41.0, 58.0, 39.0, 38.0, 1.0]), np.array([0, 0, 1, 1, 1, 1]),
            np.array([0, 1, 0, 1, 1, 0]))


def _check(state, tokens, costs, R, M, cap):
    slot = np.bincount(state.dest * M + state.micro, weights=tokens, minlength=R * M)
    np.testing.assert_allclose(state.slot_tok.reshape(-1), slot)
    np.testing.assert_allclose(state.load, np.bincount(state.dest, weights=costs, minlength=R))
    assert slot.max() <= cap


def test_a_rank_with_one_item_per_slot_just_over_its_limit_swaps_for_the_fewest_tokens():
    # rank 0 holds one item per slot (the item count forbids a move) and is 1 over its limit of 100; rank 1 has
    # 5 of load room. Swaps that fix it: its 60 for rank 1's 58 (118 tokens sent) or its 41 for the 39 or 38
    # (80 / 79 tokens sent): the last one is made, and nothing else moves
    tokens, owners, micro = _two_ranks()
    R, M, cap = 2, 2, 100.0
    state = _state(tokens, owners, micro, R, M, cap)
    limit = np.array([100.0, 140.0])
    assert state.load.tolist() == [101.0, 136.0]
    assert _swap_down(state, limit, owners.copy()) == 1
    assert state.dest.tolist() == [0, 1, 1, 1, 0, 1]
    assert np.all(state.load <= limit)
    assert np.array_equal(state.count, np.bincount(owners, minlength=R))
    _check(state, tokens, tokens, R, M, cap)


def test_an_item_that_goes_home_costs_nothing_and_wins():
    # item 1 (41 tokens) came from rank 1 and item 3 (39) from rank 0: swapping them back sends no token
    tokens, owners, micro = _two_ranks()
    R, M, cap = 2, 2, 100.0
    state = _state(tokens, owners, micro, R, M, cap)
    start = np.array([0, 1, 1, 0, 1, 1])
    assert _swap_down(state, np.array([100.0, 140.0]), start) == 1
    assert state.dest.tolist() == [0, 1, 1, 0, 1, 1]


def test_no_swap_when_none_keeps_both_ranks_and_slots_within_bounds():
    tokens, owners, micro = _two_ranks()
    R, M = 2, 2
    # rank 1 has no room for a cost difference >= 1; then room, but its slots (58 + 19 and 39 + 38 tokens) take at
    # most 1 more token under a cap of 78 and every swap that fixes rank 0 adds 2 or 3 there
    for filler, limit, cap in ((1.0, np.array([100.0, 136.5]), 100.0), (19.0, np.array([100.0, 158.0]), 78.0)):
        tokens[5] = filler
        state = _state(tokens, owners, micro, R, M, cap)
        before = state.dest.copy(), state.load.copy()
        assert _swap_down(state, limit, owners.copy()) == 0
        assert np.array_equal(state.dest, before[0]) and np.array_equal(state.load, before[1])


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), R=st.integers(2, 12), M=st.integers(1, 4))
def test_swaps_never_raise_the_fullest_rank_nor_break_a_cap_and_keep_every_item_once(seed, R, M):
    rng = np.random.default_rng(seed)
    n = R * M * 3
    tokens = rng.integers(1, 40, n).astype(np.float64)
    costs = tokens ** 2 / 40.0 + tokens
    owners = rng.integers(0, R, n)
    micro = rng.integers(0, M, n)
    cap = float(np.bincount(owners * M + micro, weights=tokens, minlength=R * M).max()) + rng.integers(0, 10)
    state = _state(tokens, owners, micro, R, M, cap, costs)
    limit = np.full(R, float(np.median(state.load)) * (1.0 + rng.random() * 0.2))
    fullest = float(np.max(state.load / limit))
    made = _swap_down(state, limit, owners.copy())
    _check(state, tokens, costs, R, M, cap)
    assert np.array_equal(state.count, np.bincount(owners, minlength=R))
    assert float(np.max(state.load / limit)) <= fullest * (1 + 1e-12)
    before = np.bincount(owners, weights=costs, minlength=R)
    assert np.all(state.load <= np.maximum(before, limit) * (1 + 1e-12))  # no rank taken over its limit
    if made:  # each swap left both of its ranks at or under their limits, so the fullest one moved down or under
        moved = np.flatnonzero(state.dest != owners)
        assert moved.size <= 2 * made


def test_the_other_rank_needs_the_load_room_for_the_difference():
    # as above, but rank 1 has only 0.5 of load room: the cheap swaps with it (79-80 tokens) would take it
    # over its limit; rank 2 (room 10) takes 60 for its 50 instead (110 tokens)
    tokens, owners, micro = _two_ranks()
    tokens, owners, micro = np.append(tokens, [50.0, 30.0]), np.append(owners, [2, 2]), np.append(micro, [0, 1])
    R, M, cap = 3, 2, 100.0
    state = _state(tokens, owners, micro, R, M, cap)
    limit = np.array([100.0, 136.5, 90.0])
    assert _swap_down(state, limit, owners.copy()) == 1
    assert state.dest.tolist() == [2, 0, 1, 1, 1, 1, 0, 2]
    assert np.all(state.load <= limit)
    _check(state, tokens, tokens, R, M, cap)
