"""Sending items home after full-cap trades (core/planner/home.py): a detour x: A -> B, y: C -> A
becomes y: C -> B with x back home when A and B stay under the ceiling and every slot holds."""

import numpy as np
from hypothesis import given, settings, strategies as st

from hf_dp_balance.core.planner.chain import _ladder_trades
from hf_dp_balance.core.planner.home import _send_home
from hf_dp_balance.core.planner.state import _State, _copy_state
from test_planner_chain import _check, _long_tail, _state


def _placed(costs, tokens, start, dest, micro, R, M, cap):
    """A state whose items sit at (dest, micro), as trades from `start` left them."""
    load = np.bincount(dest, weights=costs, minlength=R)
    return _State(costs, tokens, float(cap), np.ones(R), dest, micro, M, load, 0)


def test_a_detour_of_like_items_is_sent_home_and_loads_stay():
    # x (item 0): home rank 0, now on rank 1; y (item 1): home rank 2, now on rank 0, same tokens and
    # cost; items 2-4 stay home. Afterwards x is home and y went to rank 1: 1000 tokens fewer sent
    tokens = np.array([1000.0, 1000.0, 500.0, 500.0, 500.0])
    costs = tokens * 1.0
    start = np.array([0, 2, 0, 1, 2])
    dest = np.array([1, 0, 0, 1, 2])
    state = _placed(costs, tokens, start, dest, np.zeros(5, dtype=np.int64), 3, 1, 2000)
    before = _copy_state(state)
    saved = _send_home(state, start, np.full(3, 1500.0))
    assert saved == 1000.0
    assert state.dest.tolist() == [0, 1, 0, 1, 2]
    np.testing.assert_allclose(state.load, before.load)
    _check(before, state, 2000)


def test_y_going_to_its_own_home_saves_both_and_a_rise_over_the_ceiling_is_refused():
    tokens = np.array([1000.0, 1000.0, 500.0, 500.0])
    start = np.array([0, 1, 0, 1])
    dest = np.array([1, 0, 0, 1])  # a swap: both home saves 2000 tokens
    micro = np.zeros(4, dtype=np.int64)
    state = _placed(tokens.copy(), tokens, start, dest, micro, 2, 1, 2000)
    assert _send_home(state, start, np.full(2, 1500.0)) == 2000.0 and np.array_equal(state.dest, start)
    # x costs 300 more than y: rank 0 would end 300 over a ceiling it is at; nothing moves
    costs = tokens + np.array([300.0, 0.0, 0.0, 0.0])
    state = _placed(costs, tokens, start, dest, micro, 2, 1, 2000)
    assert _send_home(state, start, state.load.copy()) == 0 and np.array_equal(state.dest, dest)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), R=st.integers(2, 24), M=st.integers(1, 4),
       q=st.sampled_from([1.9e-5, 1.4e-4, 1e-3]), pack=st.sampled_from([4096, 32768]))
def test_after_ladder_trades_it_keeps_the_placement_valid_under_the_ceiling_and_sends_less(seed, R, M, q, pack):
    tokens, owners, mbs = _long_tail(seed, R, M, pack)
    state, budget = _state(tokens, owners, mbs, R, M, pack, q)
    start = state.dest.copy()
    _ladder_trades(state, budget, 0.005)
    _ladder_trades(state, budget, 0.005, min_rate=0.0, near=True)
    traded = _copy_state(state)
    ceiling = budget * min(1.0025, float(np.max(state.load / budget)))  # as the planner sets it
    sent_before = tokens[traded.dest != start].sum()
    saved = _send_home(state, start, ceiling)
    _check(traded, state, pack)
    assert np.all(state.load <= np.maximum(ceiling, traded.load) * (1 + 1e-12))
    np.testing.assert_allclose(tokens[state.dest != start].sum(), sent_before - saved)
    assert np.array_equal(np.bincount(state.dest * M + state.micro, minlength=R * M),
                          np.bincount(traded.dest * M + traded.micro, minlength=R * M))  # item counts kept


def test_a_plan_that_sends_few_tokens_is_left_as_it_is():
    # the same detour as above next to 60000 tokens that stay home: 2000 of 63500 away (3%), under
    # the 5% at which the pass pays for its work
    tokens = np.array([1000.0, 1000.0, 500.0, 500.0, 500.0, 20000.0, 20000.0, 20000.0])
    start = np.array([0, 2, 0, 1, 2, 0, 1, 2])
    dest = np.array([1, 0, 0, 1, 2, 0, 1, 2])
    state = _placed(tokens.copy(), tokens, start, dest, np.zeros(8, dtype=np.int64), 3, 1, 40000)
    assert _send_home(state, start, np.full(3, 25000.0)) == 0 and np.array_equal(state.dest, dest)
