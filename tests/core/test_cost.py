"""Cost model and its fitting: recovery of known coefficients, robustness, bad data, JSON."""

import json

import numpy as np
import pytest

from hf_dp_balance.apps.fit import load_timings
from hf_dp_balance.core.cost import CostModel, features_of, features_of_ranks
from hf_dp_balance.core.fitting import FitResult, fit_cost_model

TRUE = CostModel(quadratic=2e-9, linear=3e-5, per_sample=5e-3, constant=5e-2)


def synthetic_features(rng, steps, ranks):
    """Per rank a pack of 1024..8192 tokens split into 1..32 samples of uneven lengths."""
    features = np.zeros((steps, ranks, 4))
    for s in range(steps):
        for r in range(ranks):
            n = 2 ** int(rng.integers(0, 6))
            tokens = int(rng.integers(1024, 8193))
            lengths = np.maximum(np.round(rng.dirichlet(np.full(n, rng.uniform(0.3, 3.0))) * tokens), 1)
            features[s, r] = features_of(lengths)
    return features


def noisy_times(rng, features, noise=0.03):
    return TRUE.predict(features) * (1.0 + rng.normal(0.0, noise, features.shape[:2]))


def relative_error(model, reference=TRUE):
    return np.abs(model.coefficients / reference.coefficients - 1.0)


# ----------------------------------------------------------------------------- model


def test_step_cost_is_sum_of_sample_costs_plus_constant():
    lengths = [5, 100, 3000]
    assert TRUE.step_cost(lengths) == pytest.approx(TRUE.sample_costs(lengths).sum() + TRUE.constant, rel=1e-12)
    assert np.allclose(features_of(lengths), [5**2 + 100**2 + 3000**2, 3105, 3, 1])
    blocks = np.stack([features_of_ranks([[1, 2], [3000]]), features_of_ranks([[10], [20, 30]])])
    assert np.allclose(TRUE.step_time(blocks), [TRUE.step_cost([3000]), TRUE.step_cost([20, 30])])


def test_flop_priors_have_the_documented_crossover():
    decoder = CostModel.default_decoder()
    crossover = decoder.linear / decoder.quadratic  # attention == dense layers at this sample length
    assert 50_000 < crossover < 56_000
    vision = CostModel.default_vision()
    assert 7_000 < vision.linear / vision.quadratic < 9_000


def test_negative_or_nan_coefficients_and_lengths_are_rejected():
    with pytest.raises(ValueError, match="quadratic"):
        CostModel(quadratic=-1.0, linear=1.0)
    with pytest.raises(ValueError, match="constant"):
        CostModel(quadratic=1.0, linear=1.0, constant=float("nan"))
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        TRUE.sample_costs([3, -2])


def test_json_round_trip(tmp_path):
    model = CostModel(quadratic=1.25e-9, linear=3.5e-5, per_sample=0.0, constant=7e-3)
    assert CostModel.from_json(model.to_json()) == model
    assert CostModel.from_dict(model.to_dict()) == model
    path = tmp_path / "cost.json"
    model.save(path)
    assert CostModel.load(path) == model
    with pytest.raises(ValueError, match="unknown keys"):
        CostModel.from_dict({"quadratic": 1.0, "linear": 1.0, "cubic": 2.0})


# ----------------------------------------------------------------------------- fitting


def test_per_rank_fit_recovers_coefficients_within_10_percent():
    rng = np.random.default_rng(0)
    features = synthetic_features(rng, 40, 8)
    result = fit_cost_model(features, noisy_times(rng, features))
    assert isinstance(result, FitResult)
    assert result.report.mode == "per_rank"
    assert np.all(relative_error(result.model) < 0.10), result.model
    assert result.report.mape < 0.05 and result.report.r2 > 0.9
    assert result.report.n_heldout == 10 and result.report.n_observations == 320


def test_step_max_fit_recovers_coefficients_within_10_percent():
    """Only the slowest of 8 ranks is observed per step (times = max over ranks of cost*noise).

    The heaviest ranks carry most tokens, so there the constant is a small part of
    the cost and trades off against the linear term: it is checked by its
    contribution to the step cost, the other three coefficients relatively.
    """
    rng = np.random.default_rng(1)
    features = synthetic_features(rng, 200, 8)
    step_times = noisy_times(rng, features).max(axis=1)
    result = fit_cost_model(features, step_times)
    assert result.report.mode == "step_max"
    assert np.all(relative_error(result.model)[:3] < 0.10), result.model
    slowest = features[np.arange(200), TRUE.predict(features).argmax(axis=1)]
    constant_share = abs(result.model.constant - TRUE.constant) / TRUE.predict(slowest).mean()
    assert constant_share < 0.05
    assert result.report.mape < 0.05


def test_per_rank_times_can_be_fitted_in_step_max_mode():
    rng = np.random.default_rng(2)
    features = synthetic_features(rng, 12, 4)
    times = noisy_times(rng, features)
    assert fit_cost_model(features, times, mode="step_max").report.n_observations == 12
    assert fit_cost_model(features, times, mode="per_rank").report.n_observations == 48
    with pytest.raises(ValueError, match="per-rank times"):
        fit_cost_model(features, times.max(axis=1), mode="per_rank")


@pytest.mark.parametrize("mode", ["per_rank", "step_max"])
def test_a_few_slow_steps_do_not_move_the_fit(mode):
    rng = np.random.default_rng(3)
    steps = 40 if mode == "per_rank" else 120
    features = synthetic_features(rng, steps, 8)
    times = noisy_times(rng, features)
    if mode == "step_max":
        times = times.max(axis=1)
    clean = fit_cost_model(features, times, holdout=0).model
    slowed = times.copy()
    slowed[[3, 17, 29]] *= 3.0  # e.g. a first step, a GC pause, a checkpoint
    robust = fit_cost_model(features, slowed, holdout=0)
    plain = fit_cost_model(features, slowed, holdout=0, robust=False).model

    def deviation(model):  # worst relative change of any rank's predicted cost
        return np.max(np.abs(model.predict(features) / clean.predict(features) - 1))

    assert deviation(robust.model) < (0.01 if mode == "per_rank" else 0.03)
    assert deviation(plain) > 2 * deviation(robust.model)  # the outliers do matter without the robust fit
    assert {3, 17, 29} <= set(robust.report.outlier_steps)


# ----------------------------------------------------------------------------- bad data


def test_bad_data_is_rejected_with_the_culprit_named():
    rng = np.random.default_rng(4)
    features = synthetic_features(rng, 6, 2)
    times = noisy_times(rng, features)

    nan_features = features.copy()
    nan_features[4, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"step=4, rank=1, n\]=nan is not finite"):
        fit_cost_model(nan_features, times)

    negative_times = times.copy()
    negative_times[2, 0] = -0.5
    with pytest.raises(ValueError, match=r"times\[step=2, rank=0\]=-0.5"):
        fit_cost_model(features, negative_times)

    with pytest.raises(ValueError, match=r"times\[step=5\]=nan"):
        fit_cost_model(features, np.r_[times.max(axis=1)[:5], np.nan])

    negative_features = features.copy()
    negative_features[0, 1, 1] = -3
    with pytest.raises(ValueError, match=r"step=0, rank=1, sum_L\]=-3.0 is negative"):
        fit_cost_model(negative_features, times)

    with pytest.raises(ValueError, match="3 observations .* fewer than the 4 unknowns"):
        fit_cost_model(features[:3], times[:3].max(axis=1))

    with pytest.raises(ValueError, match=r"times must have shape \[steps=6\] or \[steps=6, ranks=2\]"):
        fit_cost_model(features, times[:5])

    with pytest.raises(ValueError, match=r"features must have shape \[steps, ranks, 4\]"):
        fit_cost_model(features[..., :3], times)

    with pytest.raises(ValueError, match="mode='fastest'"):
        fit_cost_model(features, times, mode="fastest")


# ----------------------------------------------------------------------------- CLI


def test_fit_cli_reads_lengths_and_writes_a_loadable_model(tmp_path, capsys):
    from hf_dp_balance.apps.cli import main

    rng = np.random.default_rng(5)
    lengths = [[[int(x) for x in rng.integers(16, 4000, size=int(rng.integers(1, 9)))] for _ in range(4)] for _ in range(16)]
    features = np.stack([features_of_ranks(step) for step in lengths])
    record = tmp_path / "timings.json"
    record.write_text(json.dumps({"lengths": lengths, "times": noisy_times(rng, features).tolist()}))
    features_read, times_read = load_timings(str(record))
    assert np.allclose(features_read, features)

    out = tmp_path / "model.json"
    assert main(["fit", str(record), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mode=per_rank" in printed and "MAPE" in printed
    model = CostModel.load(out)
    assert np.max(np.abs(model.predict(features) / TRUE.predict(features) - 1)) < 0.05
    assert json.loads(out.read_text())["report"]["n_observations"] == 64

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"times": [1.0]}))
    assert main(["fit", str(bad)]) == 2
    assert "needs 'features'" in capsys.readouterr().err


def test_fit_cli_fits_micro_batch_records_one_maximum_per_micro_batch(tmp_path, capsys):
    # FSDP / ZeRO-3 with gradient accumulation: each micro-batch's synchronised time is one step-max
    # observation. The CLI must fit those (fit_from_micro_batches), not the summed step.
    from hf_dp_balance.apps.cli import main
    from hf_dp_balance.core.fitting import fit_from_micro_batches
    from hf_dp_balance.testing.cost_steps import fixed_length_steps

    _, truth, feats, times = fixed_length_steps(3, steps=12 * 4, ranks=16)
    feats, times = feats.reshape(12, 4, 16, 4), times.reshape(12, 4, 16)
    record = tmp_path / "micro.json"
    record.write_text(json.dumps({"micro_features": feats.tolist(), "micro_times": times.tolist()}))
    out = tmp_path / "model.json"
    assert main(["fit", str(record), "-o", str(out), "--tail", "keep"]) == 0
    assert "mode=step_max" in capsys.readouterr().out
    model = CostModel.load(out)
    direct = fit_from_micro_batches(list(feats), list(times), tail="keep").model
    assert np.isclose(model.quadratic, direct.quadratic) and np.isclose(model.linear, direct.linear)
    # the 12 x 4 maxima (first step dropped: 44) pin the model: within 10% of the truth on a whole pack
    assert np.max(np.abs(model.predict(feats[0]) / truth.predict(feats[0]) - 1)) < 0.10
    assert json.loads(out.read_text())["report"]["n_observations"] == 44

    # lengths instead of features give the same rows
    lengths = [[[[16] * 3, [40, 8]], [[100], [7, 7, 7]]], [[[5], [9, 9]], [[64, 1], [3]]]]
    record.write_text(json.dumps({"micro_lengths": lengths, "micro_times": [[1.0, 2.0], [0.5, 0.7]]}))
    read_feats, read_times = load_timings(str(record))
    assert np.allclose(read_feats[1][1], features_of_ranks([[64, 1], [3]])) and np.allclose(read_times[0], [1.0, 2.0])

    # synchronised micro-batch times carry no per-rank compute: per_rank is refused by name
    record.write_text(json.dumps({"micro_features": feats.tolist(), "micro_times": times.tolist()}))
    assert main(["fit", str(record), "--mode", "per_rank"]) == 2
    assert "per_rank" in capsys.readouterr().err
    record.write_text(json.dumps({"micro_times": times.tolist()}))
    assert main(["fit", str(record)]) == 2
    assert "micro_lengths" in capsys.readouterr().err


# --------------------------------------------------------------------------- fitting from training records


def test_feature_row_and_imbalance():
    from hf_dp_balance.core.fitting import compute_imbalance

    np.testing.assert_allclose(features_of([3, 4]), [25.0, 7.0, 2.0, 1.0])
    assert compute_imbalance(np.array([[1.0, 1.0], [3.0, 1.0]])) == pytest.approx((0.0 + 0.5) / 2)


def test_fit_from_records_recovers_a_known_model():
    from hf_dp_balance.core.fitting import fit_from_records

    rng = np.random.default_rng(0)
    true = CostModel(quadratic=2e-7, linear=1e-4, per_sample=1e-3, constant=0.05)
    lengths = [[rng.integers(16, 2048, size=rng.integers(1, 8)) for _ in range(2)] for _ in range(12)]
    feats = np.array([[features_of(r) for r in step] for step in lengths])
    times = true.predict(feats) * rng.normal(1.0, 0.01, size=(12, 2))
    times[0] *= 5  # a slow first step: dropped
    fitted = fit_from_records(feats, times, "per_rank").model
    pred, ref = fitted.predict(feats[1:]), true.predict(feats[1:])
    assert np.max(np.abs(pred / ref - 1)) < 0.05
