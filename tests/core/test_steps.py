"""core/steps.py: what each step quantity computes, on small hand-checked arrays ([ranks, micro_batches])."""

import numpy as np
import pytest

from hf_dp_balance.core.steps import plan_hash, slot_loads, step_imbalance, step_makespan, token_cap

# costs 1, 2, 3, 4 in slots (0,0), (0,1), (1,0), (1,0): rank 0 = [1, 2], rank 1 = [7, 0]
COSTS = np.array([1.0, 2.0, 3.0, 4.0])
RANKS = np.array([0, 0, 1, 1])
MICRO = np.array([0, 1, 0, 0])


def test_slot_loads_are_ranks_by_micro_batches():
    loads = slot_loads(COSTS, RANKS, MICRO, 2, 2)
    assert loads.dtype == np.float64
    np.testing.assert_array_equal(loads, [[1.0, 2.0], [7.0, 0.0]])
    # three ranks, one micro-batch: a column, not a row
    assert slot_loads(COSTS, np.array([0, 1, 2, 2]), np.zeros(4, dtype=np.int64), 3, 1).shape == (3, 1)


def test_makespan_per_sync_mode():
    loads = slot_loads(COSTS, RANKS, MICRO, 2, 2)
    assert step_makespan(loads, "step") == 7.0  # slowest rank's row sum: max(1 + 2, 7 + 0)
    assert step_makespan(loads, "micro_batch") == 9.0  # sum of column maxima: max(1, 7) + max(2, 0)
    # speeds divide each rank's row: rank 1 twice as fast -> [[1, 2], [3.5, 0]]
    assert step_makespan(loads, "step", np.array([1.0, 2.0])) == 3.5
    assert step_makespan(loads, "micro_batch", np.array([1.0, 2.0])) == 5.5
    assert step_makespan(np.zeros((0, 2)), "step") == 0.0
    with pytest.raises(ValueError, match="sync"):
        step_makespan(loads, "epoch")


def test_imbalance_is_makespan_over_ideal_minus_one():
    loads = slot_loads(COSTS, RANKS, MICRO, 2, 2)
    assert step_imbalance(loads, "step") == pytest.approx(7.0 / 5.0 - 1.0)  # ideal: total 10 over 2 ranks
    assert step_imbalance(loads, "micro_batch") == pytest.approx(9.0 / 5.0 - 1.0)
    # with speeds: times [[1, 2], [3.5, 0]], total 6.5, ideal 3.25 per rank
    assert step_imbalance(loads, "step", np.array([1.0, 2.0])) == pytest.approx(3.5 / 3.25 - 1.0)
    assert step_imbalance(np.full((4, 1), 2.5), "step") == 0.0  # balanced
    assert step_imbalance(np.zeros((3, 2)), "step") == 0.0  # nothing to do
    # one micro-batch per rank: max / mean - 1 (the vision balancer's stats use this too)
    assert step_imbalance(np.array([[3.0], [1.0]]), "step") == pytest.approx(3.0 / 2.0 - 1.0)


def test_token_cap_takes_plain_numbers():
    tokens = np.array([10, 10, 10, 10])
    assert token_cap(tokens, 4, None, 1.2) == 12  # ceil(1.2 x mean per slot)
    assert token_cap(np.array([100, 1, 1, 2]), 4, None, 1.2) == 100  # never below the longest sample
    assert token_cap(tokens, 4, None, 1.2, largest_slot=20) == 20  # "no move" stays feasible
    assert token_cap(np.array([10]), 4, 64, 1.2) == 64  # an absolute cap wins
    assert token_cap(np.zeros(0, dtype=np.int64), 4, None, 1.2) == 0


def test_plan_hash_is_16_hex_of_both_arrays():
    h = plan_hash(np.array([0, 1, 1]), np.array([0, 0, 1]))
    assert len(h) == 16 and int(h, 16) >= 0
    assert h == plan_hash(np.array([0, 1, 1], dtype=np.int32), [0, 0, 1])  # dtype does not matter
    assert h != plan_hash(np.array([0, 1, 1]), np.array([0, 1, 0]))


def test_every_layer_uses_this_one_definition():
    from hf_dp_balance.core.planner import plan_step
    from hf_dp_balance.runtime import loader

    assert loader.slot_loads is slot_loads and loader.step_imbalance is step_imbalance
    assert loader.plan_hash is plan_hash
    plan = plan_step(COSTS, RANKS, MICRO, 2, 2, sync="micro_batch", min_gain=0.0)
    np.testing.assert_array_equal(plan.loads_before, slot_loads(COSTS, RANKS, MICRO, 2, 2))
    assert plan.makespan_before == step_makespan(plan.loads_before, "micro_batch")
