"""The default warm-up of the step-time fit follows the step-max observations a step gives (one per micro-batch
where each micro-batch meets across the ranks: FSDP / ZeRO-3), and an explicit `warmup_steps` stays."""

import numpy as np
import pytest

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.runtime.fitter import CostModelFitter, resolve_warmup_steps

DECODER = CostModel(quadratic=2e-7, linear=1e-4, per_sample=1e-3, constant=0.05)


def test_the_step_time_warm_up_shrinks_with_micro_batches_to_a_floor():
    assert [resolve_warmup_steps(None, "step_max", m) for m in (1, 2, 3, 4, 8, 64)] == [16, 16, 11, 8, 8, 8]
    assert resolve_warmup_steps(None, "step_max") == 16  # one observation a step
    assert resolve_warmup_steps(None, "per_rank", 4) == 5  # every rank seen: micro-batches do not matter
    assert resolve_warmup_steps(12, "step_max", 4) == 12  # set: kept


def _step(rng, micro):
    lengths = [rng.integers(16, 2048, size=rng.integers(1, 8)).tolist() for _ in range(micro)]
    seconds = [float(DECODER.predict(features_of(x))) for x in lengths]
    return [n for x in lengths for n in x], sum(seconds), (lengths, seconds, [0.0] * micro)


@pytest.mark.parametrize("sync, micro, first_fit", [("micro_batch", 4, 8), ("micro_batch", 2, 16), ("auto", 4, 8),
                                                    ("step", 4, 16), ("micro_batch", 1, 16)])
def test_the_first_step_time_fit_comes_after_enough_micro_batch_maxima(sync, micro, first_fit):
    # Under FSDP / ZeRO-3 each micro-batch is an observation: 4 a step reach the 32 the fit needs in 8 steps;
    # DDP (`sync="step"`) fits the step's sums, one observation a step, and keeps 16.
    rng = np.random.default_rng(2)
    fitter = CostModelFitter(DPBalanceConfig(refit_every=0, prior=False, sync=sync), timing="wall")
    fits = []
    for step in range(1, 21):
        lengths, seconds, batches = _step(rng, micro)
        if fitter.end_step(step, lengths, seconds, micro=batches):
            fits.append(step)
    assert fitter.warmup_steps == first_fit and fits == [first_fit] and fitter.decoder is not None


@pytest.mark.parametrize("timing, refit_every, fits", [("wall", 100, [16, 32]), ("wall", 10, [16, 26, 36]),
                                                       ("wall", 0, [16]), ("thread_cpu", 100, [5, 10, 20])])
def test_the_step_time_fit_refits_once_a_warm_up_after_its_first_fit(timing, refit_every, fits):
    # From step times alone the first fit keeps much of a prior's error in attention; the steps planned with it
    # inform the refit. Early refits at 2x, 4x the warm-up in every fit mode until the held-out error settles
    # (here the step-time fit settles at 32, the per-rank one at 20); refit_every at most the warm-up: regular
    # refits only; 0: never.
    rng = np.random.default_rng(4)
    fitter = CostModelFitter(DPBalanceConfig(refit_every=refit_every, prior=False, sync="step"), timing=timing)
    done = []
    for step in range(1, 41):
        lengths, seconds, _ = _step(rng, 1)
        if fitter.end_step(step, lengths, seconds):
            done.append(step)
    assert done == fits


def test_a_given_model_gets_no_early_refit():
    fitter = CostModelFitter(DPBalanceConfig(refit_every=100), timing="wall", decoder=DECODER, fitted_step=0)
    rng = np.random.default_rng(5)
    assert not any(fitter.end_step(step, *_step(rng, 1)[:2]) for step in range(1, 41))
