"""The cost-model gate (core.fit_gate), pure: held-out folds, calibrated errors, the verdict, the schedule, and a
noisy warm-up whose ungated fit plans worse than the prior it replaces."""

import math

import numpy as np
import pytest

from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fit_gate import (HEDGE_SHARE, TOKENS, calibrated_error, gate_decision, gate_fit,
                                         heldout_error, heldout_folds, heldout_split, next_fit_step, settled,
                                         uncertain)
from hf_dp_balance.core.planner.api import plan_step
from hf_dp_balance.core.steps import token_cap
from hf_dp_balance.runtime.fitter import fit_ranks

TRUTH = CostModel(quadratic=2e-7, linear=1e-4, per_sample=1e-3, constant=0.05)
# the truth's shape in FLOP-like units, no per-sample or per-step term: what a FLOP prior gives
PRIOR = CostModel(quadratic=2e-4, linear=0.1)
RANKS, PER_RANK = 4, 16


def test_heldout_split_and_folds_keep_enough_training_steps():
    train, test = heldout_split(8, per_step=1)
    assert len(test) == 0  # 8 step times are the least that fit 4 unknowns twice over: nothing to hold out
    train, test = heldout_split(16, per_step=1, seed=3)
    assert len(test) == 4 and len(train) == 12 and not set(train) & set(test)
    folds = heldout_folds(3, per_step=4)  # 3 steps x 4 ranks: each step held out once, 8 observations left
    assert [len(t) for _, t in folds] == [1, 1, 1]
    assert sorted(int(s) for _, t in folds for s in t) == [0, 1, 2]
    folds = heldout_folds(32, per_step=1, seed=1)
    assert len(folds) == 4 and sorted(int(s) for _, t in folds for s in t) == list(range(32))
    assert heldout_folds(2, per_step=2) == []


def test_the_calibrated_error_ignores_scale_and_constant():
    rng = np.random.default_rng(0)
    predicted = rng.uniform(1, 10, 40)
    observed = 3.0 * predicted + 2.0  # a model right up to what no plan reads
    assert calibrated_error(predicted[:30], observed[:30], predicted[30:], observed[30:]) < 1e-12
    assert calibrated_error(predicted[:30], observed[:30], predicted[30:], predicted[30:] ** 1.5) > 0.1
    assert math.isnan(calibrated_error(predicted, observed, [], []))
    feats = rng.uniform(1, 100, (10, 3, 4))
    times = TRUTH.predict(feats)
    train, test = np.arange(7), np.arange(7, 10)
    assert heldout_error(TRUTH, feats, times, train, test) < 1e-12  # per-rank times
    assert heldout_error(TRUTH, feats, times.max(axis=1), train, test) < 1e-12  # step times: the slowest rank


def test_the_verdict():
    assert gate_decision(0.2, 0.1).adopt is False
    assert gate_decision(0.1, 0.2).adopt is True
    assert gate_decision(0.199, 0.2).adopt is False  # within the margin: the model in force stays
    assert gate_decision(0.3, float("nan"), has_model_in_force=False).adopt is True
    assert gate_decision(float("nan"), float("nan")).adopt is False  # no evidence: the model in force stays
    assert settled([0.10, 0.11]) and not settled([0.30, 0.10]) and not settled([0.1])
    assert uncertain(None, 0.2) and uncertain(0.15, 0.2) and not uncertain(HEDGE_SHARE * 0.2 - 1e-3, 0.2)


def test_the_schedule_refits_early_until_settled_then_every_refit_every():
    assert next_fit_step(5, 5, 100, is_settled=False, has_fitted_model=True) == 10
    assert next_fit_step(10, 5, 100, is_settled=False, has_fitted_model=True) == 20
    assert next_fit_step(20, 5, 100, is_settled=True, has_fitted_model=True) == 120
    assert next_fit_step(16, 16, 20, is_settled=False, has_fitted_model=True) == 32
    assert next_fit_step(32, 16, 20, is_settled=False, has_fitted_model=True) == 52  # never later than refit_every
    assert next_fit_step(3, 3, 2, is_settled=False, has_fitted_model=True) == 5  # refits as frequent already
    # a rejected first fit waits for the next early step, not the next step
    assert next_fit_step(5, 5, 100, is_settled=False, has_fitted_model=False) == 10
    assert next_fit_step(5, 5, 0, is_settled=False, has_fitted_model=False) == 10
    assert next_fit_step(5, 5, 0, is_settled=False, has_fitted_model=True) is None  # refit_every 0: no refits


# --------------------------------------------------------------------------- a noisy warm-up


def _step(rng):
    lengths = np.clip(rng.lognormal(6.5, 1.0, RANKS * PER_RANK), 16, 8192).astype(int)
    return lengths, np.repeat(np.arange(RANKS), PER_RANK)


def _plan(costs, lengths, owners):
    cap = token_cap(lengths, RANKS, None, 1.5, int(np.bincount(owners, weights=lengths, minlength=RANKS).max()))
    return plan_step(costs, owners, np.zeros_like(owners), RANKS, 1, tokens=lengths, max_tokens=cap).dest_rank


def _share_of_cut(model, seed, steps=8):
    """Share of the true-cost cut that plans from `model` reach on `steps` fresh steps, priced by the truth."""
    rng = np.random.default_rng(seed)
    got = best = 0.0
    for _ in range(steps):
        lengths, owners = _step(rng)

        def slowest(dest):
            return np.bincount(dest, weights=TRUTH.sample_costs(lengths), minlength=RANKS).max()

        base = slowest(owners)
        got += base - slowest(_plan(model.sample_costs(lengths), lengths, owners))
        best += base - slowest(_plan(TRUTH.sample_costs(lengths), lengths, owners))
    return got / best


def _warmup(seed, noise, prior=PRIOR, steps=4):
    """A `steps`-step warm-up of 4 ranks timed with `noise` (log-normal), the first step dropped as the fitter
    drops it: (fit on step indices, features, times)."""
    rng = np.random.default_rng(seed)
    feats, times = [], []
    for _ in range(steps):
        lengths, owners = _step(rng)
        f = np.stack([features_of(lengths[owners == r]) for r in range(RANKS)])
        feats.append(f)
        times.append(TRUTH.predict(f) * rng.lognormal(0.0, noise, RANKS))
    feats, times = np.array(feats)[1:], np.array(times)[1:]

    def fit(idx):
        return fit_ranks(feats[idx], times[idx], "per_rank", prior, estimate_speeds=True, drop_first=False)

    return fit, feats, times


def test_a_noisy_warm_up_fit_that_plans_worse_than_the_prior_is_not_adopted():
    # 30% rank noise, a 4-step warm-up (3 steps x 4 ranks fitted): the fit the fitter used to install at once
    # plans worse than the prior it replaced on fresh steps; the gate, scoring both on held-out steps, keeps the
    # prior where that loss is largest and in most draws, and loses less of the cut than adopting every fit.
    rows = []
    for seed in range(24):
        fit, feats, times = _warmup(seed, noise=0.3)
        ungated = fit(np.arange(len(times)))[0].model
        verdict = gate_fit(fit, feats, times, np.arange(len(times)), len(times), seed=seed, in_force=PRIOR,
                           prior_in_force=True)
        rows.append((_share_of_cut(ungated, 1000 + seed), _share_of_cut(PRIOR, 1000 + seed), verdict.adopt))
    ungated, prior, adopt = (np.array(c) for c in zip(*rows))
    assert np.all(ungated < prior)  # every ungated fit plans worse than the prior ...
    assert not adopt[np.argmin(ungated)], rows  # ... the gate keeps the prior where the fit loses most ...
    assert adopt.sum() <= len(rows) // 4, rows  # ... and in most draws ...
    gated = np.where(adopt, ungated, prior)
    assert gated.mean() > ungated.mean() + 0.02, rows  # ... so its plans keep more of the cut


def test_a_clean_fit_beats_a_prior_whose_shape_is_wrong_and_is_adopted():
    light = CostModel(quadratic=0.1 * PRIOR.quadratic, linear=PRIOR.linear)  # attention 10x too light
    for seed in range(6):
        fit, feats, times = _warmup(seed, noise=0.03, prior=light, steps=6)
        verdict = gate_fit(fit, feats, times, np.arange(len(times)), len(times), seed=seed, in_force=light,
                           prior_in_force=True)
        assert verdict.adopt and verdict.candidate_error < verdict.tokens_error, verdict
        model = fit(np.arange(len(times)))[0].model
        assert _share_of_cut(model, seed) > _share_of_cut(light, seed) + 0.05


def test_too_few_steps_to_hold_one_out():
    fit, feats, times = _warmup(0, noise=0.0, steps=3)  # 2 steps x 4 ranks: nothing left to hold out
    verdict = gate_fit(fit, feats, times, np.arange(2), 2, seed=0, in_force=PRIOR, prior_in_force=True)
    assert verdict.adopt and math.isnan(verdict.candidate_error)  # over the prior: adopted, unverified (hedged)
    fitted = fit(np.arange(2))[0].model
    kept = gate_fit(fit, feats, times, np.arange(2), 2, seed=0, in_force=fitted, prior_in_force=False)
    assert not kept.adopt  # over a fitted model: no evidence, it stays


def test_tokens_model_is_the_token_count():
    assert TOKENS.sample_costs(np.array([3, 5])).tolist() == [3.0, 5.0]
