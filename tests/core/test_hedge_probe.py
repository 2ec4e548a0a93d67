"""Warm-up placement (`probe_plan`): never worse than the token-balanced plan over its hypotheses, and
step times from it tell the fit how heavy attention really is."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_dp_balance.testing.mix import fixed_length_step
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fitting import fit_cost_model
from hf_dp_balance.core.hedge import (COMPANION_POSITION, PROBE_CYCLE, PROBE_FACTOR, PROBES, extrapolate,
                                     probe_hypotheses, probe_plan, short_companions, worst_excess)
from hf_dp_balance.core.planner import plan_step
from hf_dp_balance.core.steps import slot_loads, step_imbalance, token_cap


def _planner(tokens, owners, micro, ranks, num_micro, sync="step", max_tokens=10 ** 9):
    def plan(costs):
        p = plan_step(costs, owners, micro, ranks, num_micro, tokens=tokens, max_tokens=max_tokens, sync=sync,
                      min_gain=0.0)
        return p.dest_rank, p.dest_micro_batch

    return plan


def test_extrapolate_runs_from_the_tokens_through_the_prior_and_beyond():
    prior, tokens = np.array([1.0, 3.0, 6.0]), np.array([2.0, 3.0, 5.0])
    assert extrapolate(prior, tokens, 0.0) == pytest.approx(tokens / 10)
    assert extrapolate(prior, tokens, 1.0) == pytest.approx(prior / 10)
    # 3x the prior's excess over the tokens: the sample the prior finds cheap per token gets cheaper still
    out = extrapolate(prior, tokens, 3.0)
    assert out == pytest.approx([max(0.2 + 3 * (0.1 - 0.2), 1e-3 * 0.2), 0.3, 0.5 + 3 * 0.1])
    assert np.all(out > 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), ranks=st.integers(2, 5), num_micro=st.integers(1, 3),
       sync=st.sampled_from(["step", "micro_batch"]), step=st.integers(0, 7))
def test_every_warm_up_placement_bounds_the_hull_as_well_as_the_token_plan(seed, ranks, num_micro, sync, step):
    import hf_dp_balance.core.hedge as hedge

    rng = np.random.default_rng(seed)
    n = int(rng.integers(ranks * num_micro, 6 * ranks * num_micro + 1))
    lengths = np.round(np.exp(rng.normal(5.0, 1.0, n))).astype(np.int64) + 1
    prior = rng.uniform(1e-4, 1e-2) * lengths ** 2 + lengths
    owners, micro = rng.integers(0, ranks, n), rng.integers(0, num_micro, n)
    plan = _planner(lengths, owners, micro, ranks, num_micro, sync)
    saved, hedge.MIN_COMPANION_SLOTS = hedge.MIN_COMPANION_SLOTS, 1  # the companion probe at any size here
    try:
        rank, mb, which, score = probe_plan(plan, prior, lengths, step, ranks, num_micro, sync)
    finally:
        hedge.MIN_COMPANION_SLOTS = saved
    # even steps: the token-balanced plan, at COMPANION_POSITION with short companions where that holds up
    assert which in PROBES and (step % 2 == 1 or which in ("tokens", "companions"))
    assert which != "companions" or step % len(PROBE_CYCLE) == COMPANION_POSITION
    hypotheses = probe_hypotheses(prior, lengths)
    assert worst_excess(hypotheses, rank, mb, ranks, num_micro, sync) == pytest.approx(score)
    token_plan = plan(lengths.astype(float))
    assert score <= worst_excess(hypotheses, *token_plan, ranks, num_micro, sync) + 1e-12
    weights = rng.dirichlet(np.ones(3), 12)  # any cost in the hull: tokens, prior, PROBE_FACTOR x the prior
    for w in weights:
        mix = w @ (hypotheses / hypotheses.sum(axis=1, keepdims=True))
        assert step_imbalance(slot_loads(mix, rank, mb, ranks, num_micro), sync) <= score + 1e-9


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), ranks=st.integers(2, 5), step=st.integers(0, 7))
def test_no_warm_up_step_puts_more_beside_a_long_sample_than_the_token_plan_does(seed, ranks, step):
    # Why the step maxima cannot show what short samples cost when one long sample is the slowest rank
    # (video at 128 ranks: a 16K sample fills a pack alone, the cost-fit study at eff4fc4): under the
    # heaviest hypothesis that rank sets the token plan's worst excess, so any more work beside it is worse
    # there; every warm-up step's slowest rank then holds that sample and at most the token plan's companions.
    rng = np.random.default_rng(seed)
    short = np.round(np.exp(rng.normal(5.0, 1.0, int(rng.integers(2 * ranks, 8 * ranks))))).astype(np.int64) + 1
    long = int(short.sum()) + 1  # more tokens than all the short samples together: no other rank can hold as many
    lengths = np.concatenate([short, [long]])
    prior = rng.uniform(1e-4, 1e-2) * lengths.astype(float) ** 2 + lengths
    owners, micro = rng.integers(0, ranks, lengths.size), np.zeros(lengths.size, dtype=np.int64)
    plan = _planner(lengths, owners, micro, ranks, 1)
    hypotheses = probe_hypotheses(prior, lengths)
    token_rank = plan(lengths.astype(float))[0]
    excess = [step_imbalance(slot_loads(h, token_rank, micro, ranks, 1), "step") for h in hypotheses]
    heaviest = hypotheses[int(np.argmax(excess))]
    token_loads = slot_loads(heaviest, token_rank, micro, ranks, 1).ravel()
    assert np.argmax(token_loads) == token_rank[-1]  # the long sample's rank sets the token plan's worst excess
    rank, _, _, _ = probe_plan(plan, prior, lengths, step, ranks, 1)
    beside = heaviest[rank == rank[-1]].sum()
    assert beside <= token_loads[token_rank[-1]] * (1 + 1e-12)


def test_warm_up_steps_cycle_through_the_tokens_a_heavier_attention_share_and_the_prior(monkeypatch):
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.round(rng.lognormal(6.0, 1.0, 48)).astype(np.int64) + 1, 4096)
    prior = 1e-3 * lengths.astype(float) ** 2 + lengths
    owners, micro = np.arange(48) % 4, np.zeros(48, dtype=np.int64)
    plan = _planner(lengths, owners, micro, 4, 1, max_tokens=int(1.2 * lengths.sum() / 4))
    placed = [probe_plan(plan, prior, lengths, step, 4, 1) for step in range(8)]
    assert [p[2] for p in placed] == ["tokens", "extrapolated", "tokens", "prior"] * 2  # 4 slots: no companions
    assert np.array_equal(placed[0][0], plan(lengths.astype(float))[0])
    monkeypatch.setattr("hf_dp_balance.core.hedge.MIN_COMPANION_SLOTS", 4)
    companions = probe_plan(plan, prior, lengths, 2, 4, 1)
    assert companions[2] == "companions"
    token_rank = plan(lengths.astype(float))[0]
    slowest = np.argmax(np.bincount(token_rank, weights=prior, minlength=4))
    assert np.sum(companions[0] == slowest) > np.sum(token_rank == slowest)  # more, shorter samples there
    assert np.array_equal(placed[1][0], plan(extrapolate(prior, lengths, PROBE_FACTOR))[0])
    assert np.array_equal(placed[3][0], plan(prior / prior.sum())[0])
    assert len({placed[k][0].tobytes() for k in (0, 1, 3)}) == 3  # three different placements


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10 ** 6), ranks=st.integers(2, 9), num_micro=st.integers(1, 3),
       share=st.sampled_from([1 / 16, 0.25, 0.5]))
def test_short_companions_trade_the_slowest_slots_companions_for_short_samples(seed, ranks, num_micro, share):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(ranks * num_micro, 12 * ranks * num_micro + 1))
    lengths = np.round(np.exp(rng.normal(5.0, 1.2, n))).astype(np.int64) + 1
    prior = 1e-3 * lengths.astype(float) ** 2 + lengths
    heavy = extrapolate(prior, lengths, PROBE_FACTOR)
    plan = _planner(lengths, rng.integers(0, ranks, n), rng.integers(0, num_micro, n), ranks, num_micro)
    rank, micro = plan(lengths.astype(float))
    new_rank, new_micro = short_companions(rank, micro, prior, lengths, ranks, num_micro, heavy, share)
    assert new_rank.shape == rank.shape and new_micro.shape == micro.shape  # every sample placed once
    assert np.all((new_rank >= 0) & (new_rank < ranks) & (new_micro >= 0) & (new_micro < num_micro))
    before = slot_loads(lengths, rank, micro, ranks, num_micro).ravel()
    after = slot_loads(lengths, new_rank, new_micro, ranks, num_micro).ravel()
    assert after.max() <= before.max()  # within the placement's largest slot: within the loader's cap
    slots, new_slots = rank * num_micro + micro, new_rank * num_micro + new_micro
    receivers = np.argsort(-np.bincount(slots, weights=prior, minlength=ranks * num_micro), kind="stable")
    receivers = receivers[:min(max(1, round(share * ranks * num_micro)), ranks * num_micro - 1)]
    for r in receivers:
        assert after[r] <= before[r]  # no receiver gains tokens
        own = np.flatnonzero(slots == r)
        if own.size:
            assert new_slots[own[np.argmax(lengths[own])]] == r  # it keeps its longest sample
            assert np.sum(new_slots == r) >= own.size  # and holds at least as many samples
    moved = new_slots != slots
    assert np.all(np.isin(new_slots[moved & ~np.isin(slots, receivers)], receivers))  # short samples go to receivers


def test_a_probe_worse_than_the_token_plan_over_the_hull_is_not_kept():
    # one rank's worth of tokens in one long sample and many short ones: the plan for a heavier attention
    # share would pile short samples beside nothing but still leave the long one alone; here it overloads
    # tokens (20% over the mean) more than the token plan overloads any hypothesis
    lengths = np.array([4000, 3000, 2500, 900, 800, 700, 600, 500, 400, 300, 200, 100] * 2)
    prior = 1e-4 * lengths.astype(float) ** 2 + lengths
    owners, micro = np.arange(lengths.size) % 4, np.zeros(lengths.size, dtype=np.int64)
    plan = _planner(lengths, owners, micro, 4, 1, max_tokens=int(1.2 * lengths.sum() / 4))
    hypotheses = probe_hypotheses(prior, lengths)
    heavy_plan, token_plan = plan(hypotheses[2]), plan(lengths.astype(float))
    assert worst_excess(hypotheses, *heavy_plan, 4, 1) > worst_excess(hypotheses, *token_plan, 4, 1)
    rank, _, which, _ = probe_plan(plan, prior, lengths, 1, 4, 1)
    assert which == "tokens" and np.array_equal(rank, token_plan[0])


# --------------------------------------------------------------------------- what the fit learns from it

PACK = 16384
# Qwen2-7B's FLOPs per token (CostModel.from_config): the prior the fit starts from
PRIOR = CostModel(7.02464e-07, 4.24224174e-02, 0.0, 0.0)


def _truth(attention_factor):
    """Seconds: the prior's shape with attention `attention_factor` x its share, a per-sample cost of 0.1% and a
    per-step constant of 5% of a pack's linear time."""
    linear = 1.0 / PACK
    return CostModel(PRIOR.quadratic / PRIOR.linear * linear * attention_factor, linear, 0.001, 0.05)


def _packed_step(mix, ranks, pack, rng):
    """(lengths, owners, plan_costs) of one step: `mix` drawn into fixed-length packs of `pack` tokens, one per
    rank; `plan_costs(costs)` plans it (one micro-batch, cap 1.2x the mean or the fullest pack)."""
    lengths, owners = fixed_length_step(rng, mix, ranks, pack)
    zeros = np.zeros_like(owners)
    cap = token_cap(lengths, ranks, None, 1.2, int(np.bincount(owners, weights=lengths).max()))

    def plan_costs(costs):
        return plan_step(costs, owners, zeros, ranks, 1, tokens=lengths, max_tokens=cap).dest_rank, zeros

    return lengths, owners, plan_costs


def _warm_up_fit(placement, mix, attention_factor, seed, ranks=32, steps=8, noise=0.03):
    """Fitted over true quadratic-over-linear ratio from `steps` step times (the slowest of `ranks`, 3% noise) of
    fixed-length packs placed by `placement(plan_costs, prior_costs, tokens, owners, step)`."""
    rng = np.random.default_rng(seed)
    truth = _truth(attention_factor)
    feats, times = [], []
    for step in range(steps):
        lengths, owners, plan_costs = _packed_step(mix, ranks, PACK, rng)
        dest = placement(plan_costs, PRIOR.sample_costs(lengths), lengths.astype(float), owners, step)
        f = np.stack([features_of(lengths[dest == r]) for r in range(ranks)])
        feats.append(f)
        times.append(float((truth.predict(f) * rng.lognormal(0.0, noise, ranks)).max()))
    model = fit_cost_model(np.stack(feats), np.array(times), mode="step_max", holdout=0, prior=PRIOR).model
    return (model.quadratic / model.linear) / (truth.quadratic / truth.linear)


def _probe(plan_costs, prior_costs, tokens, owners, step):
    return probe_plan(plan_costs, prior_costs, tokens, step, 32, 1)[0]


@pytest.mark.parametrize("attention_factor", [2.0, 0.5])
def test_12_warm_up_steps_at_32_ranks_correct_a_prior_whose_attention_is_2x_off(attention_factor):
    # Images bounded at 8K tokens: the slowest rank of a plan balanced under the prior looks alike on every
    # step. Before (the hedged plan of the prior, `core.hedge.hedged_plan`, on every warm-up step): fitted /
    # true ratio 0.50-0.91 (prior 2x low) and 1.56-1.97 (2x high) over 5 seeds; the probe: 0.72-0.94 and
    # 1.23-1.39. With the per-step constant's prior narrowed (`core.fitting.PRIOR_FREE_TERM_SHARE`, 0.1 -> 0.03;
    # this truth's constant is 5% of a pack's linear time) the 2x-high prior's three seeds went from 1.23 / 1.25 /
    # 1.31 to 1.23 / 1.36 / 1.31.
    off = [abs(np.log(_warm_up_fit(_probe, "qwen2vl-sft-bounded", attention_factor, seed, steps=12)))
           for seed in range(3)]
    assert np.median(off) < np.log(1.35), np.exp(off)


def _per_sample_fit(mix, seed, ranks=128, steps=16, pack=32768, noise=0.03):
    """Fitted over true per-sample cost (each over its linear term) from `steps` warm-up step times placed by
    `probe_plan`, on the issue's truth (q 3.1e-9 s/token^2, l 2.2e-5 s/token, 4 ms a sample, 50 ms a step)
    with a prior whose attention is 2x too heavy (in other units, no per-sample or per-step term)."""
    truth = CostModel(3.1e-9, 2.2e-5, 4e-3, 0.05)
    prior = CostModel(truth.quadratic * 2 * 2.5, truth.linear * 2.5)
    rng = np.random.default_rng(seed)
    feats, times = [], []
    for step in range(steps):
        lengths, owners, plan_costs = _packed_step(mix, ranks, pack, rng)
        dest = probe_plan(plan_costs, prior.sample_costs(lengths), lengths.astype(float), step, ranks, 1)[0]
        f = np.stack([features_of(lengths[dest == r]) for r in range(ranks)])
        feats.append(f)
        times.append(float((truth.predict(f) * rng.lognormal(0.0, noise, ranks)).max()))
    model = fit_cost_model(np.stack(feats), np.array(times), mode="step_max", holdout=0, prior=prior).model
    return (model.per_sample / model.linear) / (truth.per_sample / truth.linear)


def test_short_companions_let_128_step_times_show_the_per_sample_cost(monkeypatch):
    # In fixed-length packs at 128 ranks the slowest rank holds a long sample and whatever fills its pack; with
    # the token plan in place of the companion probe the fit keeps the prior's guess of the per-sample cost
    # (8 tokens of linear work, 0.04x the truth's here). Measured on these seeds: see the assertion's message.
    with_companions = [_per_sample_fit("qwen2vl-sft", seed) for seed in range(2)]
    monkeypatch.setattr("hf_dp_balance.core.hedge.COMPANION_POSITION", -1)
    without = [_per_sample_fit("qwen2vl-sft", seed) for seed in range(2)]
    assert max(abs(np.log(with_companions))) < np.log(2.0) < min(abs(np.log(without))), (with_companions, without)
