"""Look-ahead over K steps: every sample exactly once, within its window; fewer single-sample-bound steps."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dp_balance.core.lookahead import assign_slots, plan_lookahead
from hf_dp_balance.testing.mix import SampleShapes
from hf_dp_balance.apps.sim_model import SampleCost
from hf_dp_balance.apps.sim_runs import simulate_packed
from hf_dp_balance.core.cost import CostModel


def _step_bounds(costs, steps, num_ranks):
    """Per step: the best any within-step plan can do, and whether one sample sets it."""
    out = []
    for k in np.unique(steps):
        c = costs[steps == k]
        out.append((max(c.sum() / num_ranks, c.max()), c.max() > c.sum() / num_ranks))
    return np.array(out)


def _constructed_window():
    # 4 steps x 4 ranks; each step: one outlier (cost 10, 8 tokens) + 12 ordinary (cost 1, 2 tokens).
    costs, tokens, steps = [], [], []
    for k in range(4):
        costs += [10.0] + [1.0] * 12
        tokens += [8] + [2] * 12
        steps += [k] * 13
    return np.array(costs), np.array(tokens), np.array(steps)


def test_outliers_share_a_step_and_the_other_steps_level_out():
    costs, tokens, steps = _constructed_window()
    new = plan_lookahead(costs, tokens, steps, 4, window=4, max_tokens=32)
    before, after = _step_bounds(costs, steps, 4), _step_bounds(costs, new, 4)
    # Before: every step is bound by its outlier (10 > average rank 5.5). After: the four
    # outliers share one step (one per rank: 10 = the average, not above it), the other
    # three steps hold 16 ordinary samples, 4 per rank.
    assert before[:, 1].sum() == 4 and after[:, 1].sum() == 0
    assert before[:, 0].sum() == pytest.approx(40.0)
    assert after[:, 0].sum() == pytest.approx(10.0 + 3 * 4.0)
    assert np.bincount(new, weights=tokens).tolist() == [32.0] * 4  # within the token budget
    assert np.count_nonzero(new != steps) == 3 + 12  # three outliers in, twelve ordinary out


def test_lookahead_raises_simulated_throughput_on_the_constructed_case():
    costs, tokens, steps = _constructed_window()
    # cost = 0.125 L^2 + 0.25 L: 8 tokens -> 10, 2 tokens -> 1, as in the constructed window.
    cost = SampleCost("hand", CostModel(quadratic=0.125, linear=0.25), None, 0.0, "hand")
    samples = SampleShapes.text_only(tokens)
    assert np.allclose(cost.costs(samples), costs)
    # Step k: rank 0 holds the outlier, ranks 1..3 four ordinary samples each (8 tokens per rank).
    pack_of = np.array(sum(([4 * k] + [4 * k + 1 + j // 4 for j in range(12)] for k in range(4)), []))
    row = simulate_packed(samples, pack_of, 4, cost, pack=32, lookahead=4)
    assert row["single_sample_bound_share"] == 1.0
    assert row["single_sample_bound_share_lookahead"] == 0.0
    # Within a step nothing beats the outlier: 4 x 10 s. With look-ahead: 10 + 3 x 4 s.
    assert row["tgs_ours"] == pytest.approx(128 / (4 * 40.0))
    assert row["tgs_lookahead"] == pytest.approx(128 / (4 * 22.0))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),  # window
    st.integers(1, 5),  # ranks
    st.lists(st.tuples(st.floats(0.0, 50.0), st.integers(1, 16)), min_size=1, max_size=120),
    st.integers(0, 3),
)
def test_every_sample_once_within_its_window(window, ranks, items, first_step):
    costs = np.array([c for c, _ in items])
    tokens = np.array([t for _, t in items])
    steps = first_step + np.sort(np.arange(len(items)) % 7)  # several samples per step
    new = plan_lookahead(costs, tokens, steps, ranks, window=window, max_tokens=16)
    assert new.shape == steps.shape  # exactly one step per sample
    assert np.array_equal(new // window, steps // window)  # same window
    assert np.all(np.abs(new - steps) <= window - 1)
    # The window's samples are the same multiset: per window, total cost / tokens unchanged.
    for w in np.unique(steps // window):
        assert costs[new // window == w].sum() == pytest.approx(costs[steps // window == w].sum())
    # Determinism.
    assert np.array_equal(new, plan_lookahead(costs, tokens, steps, ranks, window=window, max_tokens=16))


def test_assign_slots_keeps_stayers_and_respects_the_cap_when_it_can():
    tokens = np.array([10, 10, 10, 10, 30, 4])
    old_steps = np.array([0, 0, 0, 0, 1, 1])
    new_steps = np.array([0, 0, 0, 0, 0, 1])  # the 30-token outlier joins step 0
    old_slots = np.array([0, 0, 1, 1, 0, 0])
    slots = assign_slots(tokens, old_steps, new_steps, old_slots, 3, 32)
    assert slots[[0, 1, 2, 3]].tolist() == [0, 0, 1, 1] and slots[5] == 0
    assert slots[4] == 2  # the empty slot
    # No empty slot: the outlier evicts the shortest residents, which are dealt elsewhere.
    slots = assign_slots(tokens, old_steps, new_steps, old_slots, 2, 40)
    per_slot = np.bincount(slots[new_steps == 0], weights=tokens[new_steps == 0], minlength=2)
    assert per_slot.max() <= 40 and per_slot.sum() == 70


def test_bad_input_names_the_sample():
    with pytest.raises(ValueError, match="sample 1 has cost nan"):
        plan_lookahead([1.0, np.nan], [1, 1], [0, 0], 2, window=2, max_tokens=4)
    with pytest.raises(ValueError, match="sample 0 has 9 tokens"):
        plan_lookahead([1.0], [9], [0], 2, window=2, max_tokens=4)
    with pytest.raises(ValueError, match="window=0"):
        plan_lookahead([1.0], [1], [0], 2, window=0, max_tokens=4)
