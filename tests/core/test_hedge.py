"""Hedged placement before the fit: the kept plan holds up under the prior, the tokens and every mix of them."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_dp_balance.core.hedge import CANDIDATES, blend, hedged_choice, hedged_plan, worst_excess
from hf_dp_balance.core.planner import plan_step
from hf_dp_balance.core.steps import slot_loads, step_imbalance

# 12 samples on 3 ranks (4 each, sampler order); the prior weighs attention (L^2) far above the tokens
LENGTHS = np.array([157, 89, 156, 437, 56, 60, 215, 103, 449, 42, 49, 102])
PRIOR = 1e-2 * LENGTHS ** 2 + LENGTHS
OWNERS, MICRO = np.repeat(np.arange(3), 4), np.zeros(12, dtype=np.int64)


def _planner(tokens, owners, micro, ranks, num_micro, sync="step"):
    def plan(costs):
        p = plan_step(costs, owners, micro, ranks, num_micro, tokens=tokens, max_tokens=10 ** 9, sync=sync,
                      min_gain=0.0)
        return p.dest_rank, p.dest_micro_batch

    return plan


def test_blend_weighs_every_hypothesis_alike():
    out = blend(np.array([[1.0, 3.0], [10.0, 10.0]]))
    assert out == pytest.approx([0.25 + 0.5, 0.75 + 0.5])
    assert blend(np.array([[0.0, 0.0], [1.0, 1.0]])) == pytest.approx([0.5, 0.5])  # an all-zero row adds nothing


def test_prior_plan_that_overloads_tokens_is_replaced():
    plan = _planner(LENGTHS, OWNERS, MICRO, 3, 1)
    prior_rank, prior_micro = plan(PRIOR)
    hypotheses = np.stack([PRIOR, LENGTHS.astype(float)])
    # the prior's own plan is perfect for the prior but leaves one rank 53% above the mean in tokens
    assert step_imbalance(slot_loads(LENGTHS, prior_rank, prior_micro, 3, 1), "step") > 0.5
    rank, micro, which, scores = hedged_plan(plan, PRIOR, LENGTHS, OWNERS, MICRO, 3, 1)
    assert which != "prior" and len(scores) == len(CANDIDATES)
    kept = worst_excess(hypotheses, rank, micro, 3, 1)
    assert kept == pytest.approx(min(scores)) and kept < 0.2
    token_plan = plan(LENGTHS.astype(float))
    assert kept <= worst_excess(hypotheses, *token_plan, 3, 1) + 1e-12  # never worse than the token-balanced plan


def test_ties_keep_the_earlier_candidate():
    same = (OWNERS, MICRO)
    assert hedged_choice(np.stack([PRIOR, LENGTHS]), [same, same], 3, 1)[0] == 0
    with pytest.raises(ValueError, match="no candidate"):
        hedged_choice(np.stack([PRIOR]), [], 3, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), ranks=st.integers(2, 5), num_micro=st.integers(1, 3),
       sync=st.sampled_from(["step", "micro_batch"]))
def test_kept_plan_bounds_every_mix_of_the_hypotheses(seed, ranks, num_micro, sync):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(ranks * num_micro, 6 * ranks * num_micro + 1))
    lengths = np.round(np.exp(rng.normal(5.0, 1.0, n))).astype(np.int64) + 1
    prior = rng.uniform(1e-4, 1e-2) * lengths ** 2 + lengths
    owners, micro = rng.integers(0, ranks, n), rng.integers(0, num_micro, n)
    plan = _planner(lengths, owners, micro, ranks, num_micro, sync)
    rank, mb, which, scores = hedged_plan(plan, prior, lengths, owners, micro, ranks, num_micro, sync)
    hypotheses = np.stack([prior, lengths.astype(float)])
    kept = worst_excess(hypotheses, rank, mb, ranks, num_micro, sync)
    assert kept <= min(scores) + 1e-12  # the kept candidate is the best of the four ...
    for lam in np.linspace(0.0, 1.0, 11):  # ... and bounds the excess under any mix of prior and tokens
        mix = lam * prior / prior.sum() + (1 - lam) * lengths / lengths.sum()
        assert step_imbalance(slot_loads(mix, rank, mb, ranks, num_micro), sync) <= kept + 1e-9
