"""The published greedy baseline (hf_dp_balance.apps.reference): its rules, not its speed."""

import numpy as np
import pytest

from hf_dp_balance.apps.reference import plan_reference_greedy


def instance(seed=0, num_ranks=16, per_rank=12):
    rng = np.random.default_rng(seed)
    n = num_ranks * per_rank
    lengths = np.clip(rng.lognormal(np.log(1500), 1.0, n), 32, 8192).round()
    costs = lengths ** 2 / 53000.0 + lengths + 64.0
    owners = np.repeat(np.arange(num_ranks), per_rank)
    return costs, lengths, owners


def test_reference_rebalances_under_the_token_cap():
    costs, tokens, owners = instance()
    plan = plan_reference_greedy(costs, owners, 16, tokens=tokens, skip_imbalance=0.0, skip_single_sample=False)
    assert plan.applied
    cap = 1.2 * tokens.sum() / 16
    assert np.bincount(plan.dest, weights=tokens, minlength=16).max() <= cap
    assert plan.makespan_after < plan.makespan_before
    assert plan.makespan_after <= 1.05 * plan.lower_bound
    # it re-places from scratch: most items change rank
    assert plan.moved > 0.5 * costs.size
    np.testing.assert_allclose(plan.loads_after, np.bincount(plan.dest, weights=costs, minlength=16))


def test_reference_skip_rules():
    costs, tokens, owners = instance(1)
    imbalance = np.bincount(owners, weights=costs).max() / np.bincount(owners, weights=costs).mean() - 1
    kept = plan_reference_greedy(costs, owners, 16, tokens=tokens, skip_imbalance=imbalance + 0.01)
    assert not kept.applied and "imbalance" in kept.reason and np.array_equal(kept.dest, owners)
    # one sample heavier than the average rank: the published rule skips, with the rule off it balances
    costs = np.append(costs, 10 * costs.sum() / 16)
    owners = np.append(owners, 0)
    tokens = np.append(tokens, 100.0)
    kept = plan_reference_greedy(costs, owners, 16, tokens=tokens, skip_imbalance=0.0)
    assert not kept.applied and "single sample" in kept.reason
    done = plan_reference_greedy(costs, owners, 16, tokens=tokens, skip_imbalance=0.0, skip_single_sample=False)
    assert done.applied


def test_reference_is_deterministic_and_validates():
    costs, tokens, owners = instance(2)
    a = plan_reference_greedy(costs, owners, 16, tokens=tokens, skip_imbalance=0.0)
    b = plan_reference_greedy(costs, owners, 16, tokens=tokens, skip_imbalance=0.0)
    assert np.array_equal(a.dest, b.dest)
    with pytest.raises(ValueError, match=r"costs\[1\]=nan"):
        plan_reference_greedy([1.0, np.nan], [0, 0], 1)
    with pytest.raises(ValueError, match=r"owners\[0\]=5"):
        plan_reference_greedy([1.0], [5], 2)
