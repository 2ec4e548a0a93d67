"""`trade_index._search_within(whole=True)`: the stretch search without a bound test per step, for
arrays sorted as a whole (the ladders' running sums), gives the answers of the bounded search."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dp_balance.core.planner.trade_index import _search_within


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 5.0, 8.0]), min_size=1, max_size=60),
       queries=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 60),
                                  st.sampled_from([-1.0, 0.0, 0.5, 2.0, 2.5, 8.0, 30.0])),
                        min_size=1, max_size=30),
       side=st.sampled_from(["left", "right"]), clamp=st.sampled_from(["high", "both"]))
def test_whole_search_answers_as_the_bounded_one(values, queries, side, clamp):
    """Ties, zero runs, steps that read past hi and past the array's end (finite queries: the callers
    ask for token counts)."""
    a = np.cumsum(np.asarray(values))  # running sums of non-negative values, as CT / CC
    lo = np.asarray([min(start, a.size) for start, _, _ in queries], dtype=np.int64)
    hi = np.minimum(lo + np.asarray([width for _, width, _ in queries], dtype=np.int64), a.size)
    v = np.asarray([q for _, _, q in queries])
    want = _search_within(a, v, lo, hi, side, clamp)
    got = _search_within(a, v, lo, hi, side, clamp, whole=True)
    assert np.array_equal(got, want)
    numpy = np.searchsorted(a, v, side=side)
    assert np.array_equal(got, np.clip(numpy, lo, hi) if clamp == "both" else np.minimum(numpy, hi))


def test_whole_search_needs_the_clamp_past_hi():
    """An answer above the stretch comes back as hi (a step past hi passes there): were the final
    clamp missing, these would read lo + 3 and lo + 7."""
    a = np.arange(1.0, 21.0)
    lo, hi = np.array([0, 10]), np.array([2, 13])
    got = _search_within(a, np.array([100.0, 100.0]), lo, hi, "left", "both", whole=True)
    assert got.tolist() == [2, 13]
