"""`_place_best_fit`'s search for a host with token room (core/planner/place.py `_FullSearch`): the scan of the
sorted rooms finds what the numpy search over every rank finds, ties (equal rooms: the lowest rank) included."""

import numpy as np
import pytest

from hf_dp_balance.core.planner import place
from hf_dp_balance.core.planner.place import _place_best_fit
from hf_dp_balance.core.planner.state import _State, _copy_state
from test_planner_chain import _long_tail


def _instance(rng, seed, R, M, ties):
    """Full packs (every slot near the cap): the shed items' best fits mostly lack token room."""
    tokens, owners, mbs = _long_tail(seed, R, M, 32768)
    costs = 1.4e-4 * tokens ** 2 + tokens + 64.0
    if ties:  # few cost values: many ranks end with equal rooms
        costs = np.round(costs / 4000.0) * 4000.0 + 4000.0
    load = np.bincount(owners, weights=costs, minlength=R)
    state = _State(costs, tokens, 32768.0, np.ones(R), owners, mbs, M, load, M)
    # the pool: a few of the largest items of the ranks over the mean, as shedding takes them
    over = load[owners] > load.mean()
    big = np.flatnonzero(over & (tokens > np.quantile(tokens, 0.8)))
    pool = rng.choice(big, size=max(1, big.size // 2), replace=False) if big.size else np.arange(1)
    return state, load, pool


@pytest.mark.parametrize("lpt_host", [False, True])
def test_the_scan_of_the_sorted_rooms_places_as_the_numpy_search(monkeypatch, lpt_host):
    rng = np.random.default_rng(11)
    scanned = 0
    for trial in range(60):
        R, M = int(rng.integers(8, 64)), int(rng.integers(1, 5))
        state, load, pool = _instance(rng, trial, R, M, ties=trial % 2 == 1)
        limit = np.full(R, float(np.round(load.mean() * rng.uniform(1.0, 1.05))))
        plain, fast = _copy_state(state), _copy_state(state)
        for st in (plain, fast):
            st.load -= np.bincount(st.dest[pool], weights=st.costs[pool], minlength=R)
            np.subtract.at(st.slot_tok, (st.dest[pool], st.micro[pool]), st.tokens[pool])
            st.count -= np.bincount(st.dest[pool], minlength=R)
        real = place._FullSearch._scan
        monkeypatch.setattr(place._FullSearch, "_scan", lambda self, *a: real(self, *a, reach=0))  # numpy's search
        try:
            _place_best_fit(plain, pool, limit, lpt_host=lpt_host)
        except place._Infeasible:
            continue
        calls = []

        def counting(self, *args):
            got = real(self, *args)
            calls.append(got is not None)
            return got

        monkeypatch.setattr(place._FullSearch, "_scan", counting)
        _place_best_fit(fast, pool, limit, lpt_host=lpt_host)
        monkeypatch.setattr(place._FullSearch, "_scan", real)
        scanned += sum(calls)
        np.testing.assert_array_equal(fast.dest, plain.dest, err_msg=str(trial))
        np.testing.assert_array_equal(fast.micro, plain.micro, err_msg=str(trial))
        np.testing.assert_array_equal(fast.load, plain.load)
    assert scanned > 20  # the scan answered for many hosts
