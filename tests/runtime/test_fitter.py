"""CostModelFitter alone (no Trainer): records, fits across 2 real gloo ranks, bounds; what a micro-batch computes."""

import json

import numpy as np
import pytest
import torch

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.runtime.fitter import (MAX_RECORDS, MAX_WINDOW_STEPS, CostModelFitter, StepClock, micro_batch_lengths,
                                          resolve_fit_mode, resolve_timing)
from hf_dp_balance.testing.spawn import run_ranks

DECODER = CostModel(quadratic=2e-7, linear=1e-4, per_sample=1e-3, constant=0.05)
VISION = CostModel(quadratic=4e-8, linear=2e-5, per_sample=2e-3, constant=0.0)


def test_micro_batch_lengths_reads_packed_and_padded_batches():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert micro_batch_lengths({"position_ids": pos}) == [3, 2, 4]
    mrope = torch.stack([pos, pos * 0, pos * 0, pos * 0])  # [4, 1, T]: row 0 is the plain positions
    assert micro_batch_lengths({"position_ids": mrope}) == [3, 2, 4]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert micro_batch_lengths({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask}) == [3, 2]
    assert micro_batch_lengths({"input_ids": torch.zeros(2, 5, dtype=torch.long)}) == [5, 5]


def test_timing_and_fit_mode_resolution():
    assert resolve_timing("auto", "cpu") == "thread_cpu" and resolve_timing("auto", "cuda") == "wall"
    assert resolve_timing("wall", "cpu") == "wall" and resolve_timing("thread_cpu", "cuda") == "thread_cpu"
    assert resolve_fit_mode("auto", "thread_cpu") == "per_rank" and resolve_fit_mode("auto", "wall") == "step_max"
    assert resolve_fit_mode("per_rank", "wall") == "per_rank"
    with pytest.raises(ValueError, match="timing"):
        StepClock("auto")
    with pytest.raises(ValueError, match="timing"):
        DPBalanceConfig(timing="gpu")


def _synthetic_step(rng, rank, step):
    """This rank's step as `end_step` takes it: lengths, seconds (the known models), image patches, tower seconds."""
    lengths = rng.integers(16, 2048, size=rng.integers(1, 8)).tolist()
    patches = rng.integers(64, 1024, size=rng.integers(1, 4)).tolist()
    vision_s = float(VISION.predict(features_of(patches)))
    return lengths, float(DECODER.predict(features_of(lengths))) + vision_s, patches, vision_s


def _fit_on_ranks(rank, world, timing):
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    fitter = CostModelFitter(DPBalanceConfig(warmup_steps=6, refit_every=4), rank=rank, world=world, group=group,
                             timing=timing)
    rng = np.random.default_rng([rank, 7])  # every rank draws its own work
    fitted_at = []
    for step in range(1, 15):
        if fitter.end_step(step, *_synthetic_step(rng, rank, step)):
            fitted_at.append(step)
    return {"fitted_at": fitted_at, "decoder": fitter.decoder.to_dict(), "vision": fitter.vision.to_dict(),
            "reports": list(fitter.fit_reports), "window": fitter.window_metrics(), "mode": fitter.fit_mode}


@pytest.mark.parametrize("timing", ["thread_cpu", "wall"])
def test_two_ranks_fit_the_same_correct_models(timing):
    r0, r1 = run_ranks(_fit_on_ranks, 2, timing, timeout=180)
    assert r0["fitted_at"] == r1["fitted_at"] == [6, 10, 14]  # after warm-up, then every refit_every steps
    assert r0["decoder"] == r1["decoder"] and r0["vision"] == r1["vision"]  # bit-identical on every rank
    assert r0["mode"] == ("per_rank" if timing == "thread_cpu" else "step_max")
    assert [r["mode"] for r in r0["reports"]] == [r0["mode"]] * 3
    assert json.dumps(r0["reports"]) == json.dumps(r1["reports"])  # (NaN held-out scores: compare the text)
    rng = np.random.default_rng(3)
    check = np.stack([features_of(rng.integers(16, 2048, size=4)) for _ in range(32)])
    decoder = CostModel.from_dict(r0["decoder"])
    # exact timings: per-rank recovers the decoder closely; step-max sees only the slowest rank of each step
    tol = 1e-3 if timing == "thread_cpu" else 0.05
    assert np.max(np.abs(decoder.predict(check) / DECODER.predict(check) - 1)) < tol
    vision = CostModel.from_dict(r0["vision"])
    vcheck = np.stack([features_of(rng.integers(64, 1024, size=2)) for _ in range(32)])
    assert np.max(np.abs(vision.predict(vcheck) / VISION.predict(vcheck) - 1)) < 1e-3
    # the measured window covers every step since the start (never logged), the same on both ranks
    assert r0["window"] == r1["window"] and r0["window"]["compute_imbalance"] > 0.0


def test_records_and_window_stay_bounded_when_nothing_logs():
    fitter = CostModelFitter(DPBalanceConfig(refit_every=0), timing="thread_cpu", decoder=DECODER, fitted_step=0)
    for step in range(1, MAX_WINDOW_STEPS + 200):
        assert not fitter.end_step(step, [100, 200], 0.1)  # a given model, no refit: never fits
    assert len(fitter.records) == MAX_RECORDS and len(fitter.window) == MAX_WINDOW_STEPS
    metrics = fitter.window_metrics()
    assert metrics["slowest_rank_compute_s"] == pytest.approx(0.1 * MAX_WINDOW_STEPS)
    assert len(fitter.window) == 0 and fitter.window_metrics() == {}
    assert fitter.model_metrics() == {**{f"cost_{k}": v for k, v in DECODER.to_dict().items()}, "fitted": 1.0}
