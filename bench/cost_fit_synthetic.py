"""Synthetic step times with known coefficients: which fit recovers a single sample's cost from warm-up?

Fixed-length packs (every rank holds samples summing to one pack length, as fixed-length packing makes
them), sample lengths lognormal (median 300, sigma 0.9, WORKLOAD_STATS.md's text mix), 3% multiplicative
noise on each rank's time. The truth is a FLOP prior (`CostModel.from_config`, a Qwen2-7B decoder) in
seconds at a fixed throughput, plus a per-sample and a per-step constant, with the attention term's
efficiency off the prior's by `--attention-off` (real kernels never run attention at the GEMMs' rate).
Fits compared: per-rank, step-max, and both around the prior (`prior=`), on warm-up steps; step-max
both as the soft-max fit of the step time to the slowest rank's cost (`step_noise=False`, "old") and
as the noise-aware maximum-likelihood fit (the default, "new"); held-out MAPE of pack cost (per rank),
of the step (slowest rank; the new fit predicts E[max] under its fitted noise), and of a single
sample's cost over lengths drawn from the same mix. Imported by bench/cost_fit.py (one run: synthetic and real timings).
"""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fit_solvers import expected_step_max
from hf_dp_balance.core.fitting import fit_cost_model

THROUGHPUT = 400e12  # FLOP/s of the synthetic accelerator (only ratios matter)


def qwen2_7b_prior() -> CostModel:
    from transformers import Qwen2Config

    return CostModel.from_config(Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                             num_key_value_heads=4, intermediate_size=18944, vocab_size=152064))


def true_model(prior: CostModel, attention_off: float, pack: int) -> CostModel:
    """Seconds: the prior's FLOPs at THROUGHPUT, attention `attention_off` slower, 2% of a pack's time as a
    per-sample cost (~20 samples per pack) and 5% as a per-step constant."""
    q, lin = prior.quadratic * 1e12 / THROUGHPUT, prior.linear * 1e12 / THROUGHPUT
    pack_s = lin * pack
    return CostModel(quadratic=q * (1 + attention_off), linear=lin, per_sample=0.001 * pack_s, constant=0.05 * pack_s)


def fixed_length_packs(rng, count: int, pack: int) -> list:
    """`count` packs of exactly `pack` tokens from lognormal(median 300, sigma 0.9) samples (last one cut)."""
    out = []
    for _ in range(count):
        lengths, left = [], pack
        while left > 0:
            n = int(min(left, max(16, rng.lognormal(np.log(300), 0.9))))
            lengths.append(n)
            left -= n
        out.append(lengths)
    return out


def simulate(rng, truth: CostModel, steps: int, ranks: int, pack: int, noise: float):
    """(features [steps, ranks, 4], per-rank times [steps, ranks]) of fixed-length packs."""
    packs = fixed_length_packs(rng, steps * ranks, pack)
    feats = np.stack([features_of(p) for p in packs]).reshape(steps, ranks, 4)
    times = truth.predict(feats) * rng.lognormal(0.0, noise, size=(steps, ranks))
    return feats, times


def _mape(pred, true) -> float:
    return float(np.mean(np.abs(np.asarray(pred) - true) / true))


FITS = {  # column: (mode, step_noise, with the prior)
    "per_rank": ("per_rank", False, False),
    "per_rank + prior": ("per_rank", False, True),
    "step_max old": ("step_max", False, False),
    "step_max old + prior": ("step_max", False, True),
    "step_max new": ("step_max", True, False),
    "step_max new + prior": ("step_max", True, True),
}


def fits(prior: CostModel, feats, times, strength) -> dict:
    """name -> (model, rank noise sigma or None) for every fit of FITS; `strength` None: the fit's default."""
    out = {}
    for name, (mode, noise, with_prior) in FITS.items():
        y = times if mode == "per_rank" else times.max(axis=1)
        result = fit_cost_model(feats, y, mode=mode, holdout=0, step_noise=noise, prior=prior if with_prior else None,
                                prior_strength=strength)
        out[name] = (result.model, result.report.step_noise)
    return out


def scaled_prior(prior: CostModel, feats, times) -> CostModel:
    """The prior times one scale fitted to per-rank times (what planning with the prior assumes)."""
    pred = prior.predict(feats).ravel()
    k = float(np.sum(pred / times.ravel()) / np.sum((pred / times.ravel()) ** 2))
    return CostModel(*(prior.coefficients * k))


def predicted_steps(model: CostModel, sigma, features) -> np.ndarray:
    """Step times a fit predicts: the slowest rank's cost, or E[max] under its fitted rank noise sigma."""
    return model.step_time(features) if sigma is None else expected_step_max(model.predict(features), sigma)


def evaluate(truth: CostModel, model: CostModel, sigma, test_feats, test_times, singles) -> dict:
    """Held-out MAPE of pack, step (E[max] under the fitted rank noise sigma when there is one), single
    sample, and single sample after one best common scale."""
    pred = model.predict(test_feats)
    mine, true = model.sample_costs(singles), truth.sample_costs(singles)
    k = float(np.sum(mine / true) / np.sum((mine / true) ** 2))  # best common scale: what placement sees
    return {"pack": _mape(pred.ravel(), test_times.ravel()),
            "step": _mape(predicted_steps(model, sigma, test_feats), test_times.max(axis=1)),
            "single": _mape(mine, true), "shape": _mape(k * mine, true)}


def run(ranks_list=(8, 32, 128), warmup_list=(8, 16), draws: int = 5, pack: int = 8192, noise: float = 0.03,
        attention_off=(0.0, 0.5), strength=None, seed: int = 0) -> dict:
    """Median over `draws` of each fit's held-out errors, per (attention_off, ranks, warm-up steps);
    `strength` None: each fit's default prior strength."""
    prior = qwen2_7b_prior()
    results = {}
    for off in attention_off:
        truth = true_model(prior, off, pack)
        for ranks in ranks_list:
            for warmup in warmup_list:
                cells = {}
                for d in range(draws):
                    rng = np.random.default_rng([seed, ranks, warmup, d])
                    feats, times = simulate(rng, truth, warmup, ranks, pack, noise)
                    test_feats, test_times = simulate(rng, truth, 20, ranks, pack, noise)
                    singles = np.concatenate(fixed_length_packs(rng, 20, pack))
                    models = fits(prior, feats, times, strength)
                    models["prior alone (scaled)"] = (scaled_prior(prior, feats, times), None)
                    for name, (model, sigma) in models.items():
                        cells.setdefault(name, []).append(
                            evaluate(truth, model, sigma, test_feats, test_times, singles))
                results[(off, ranks, warmup)] = {
                    name: {k: float(np.median([c[k] for c in rows])) for k in ("pack", "step", "single", "shape")}
                    for name, rows in cells.items()}
    return results


def balanced_steps(rng, prior: CostModel, truth: CostModel, steps: int, ranks: int, per_rank: int, noise: float,
                   balanced: bool):
    """Warm-up steps of variable-length samples (`per_rank` a rank on average), either as the sampler deals
    them (equal counts) or placed by the prior (greedy longest-first onto the least-loaded rank: equal
    predicted cost on every rank, what planning from step 1 makes the fit see)."""
    feats = np.zeros((steps, ranks, 4))
    for s in range(steps):
        lengths = np.maximum(16, rng.lognormal(np.log(300), 0.9, size=per_rank * ranks)).astype(int)
        if balanced:
            loads, owner = np.zeros(ranks), np.zeros(lengths.size, dtype=int)
            for i in np.argsort(-prior.sample_costs(lengths)):
                owner[i] = int(np.argmin(loads))
                loads[owner[i]] += prior.sample_costs(lengths[i])
        else:
            owner = np.arange(lengths.size) % ranks
        feats[s] = np.stack([features_of(lengths[owner == r]) for r in range(ranks)])
    return feats, truth.predict(feats) * rng.lognormal(0.0, noise, size=(steps, ranks))


def conditioning(ranks: int = 32, warmup: int = 8, draws: int = 5, noise: float = 0.03, seed: int = 0) -> dict:
    """Per-rank fit on warm-up steps as dealt vs balanced by the prior: condition number of the scaled
    relative-residual design and held-out single-sample MAPE (median of draws)."""
    from hf_dp_balance.core.fit_solvers import column_scale

    prior = qwen2_7b_prior()
    truth = true_model(prior, 0.5, 8192)
    out = {}
    for balanced in (False, True):
        conds, errs, errs_prior = [], [], []
        for d in range(draws):
            rng = np.random.default_rng([seed, d, int(balanced)])
            feats, times = balanced_steps(rng, prior, truth, warmup, ranks, 24, noise, balanced)
            x = (feats / column_scale(feats)).reshape(-1, 4) / times.reshape(-1, 1)
            conds.append(float(np.linalg.cond(x)))
            singles = np.maximum(16, rng.lognormal(np.log(300), 0.9, size=2000)).astype(int)
            for prior_or_none, bucket in ((None, errs), (prior, errs_prior)):
                model = fit_cost_model(feats, times, mode="per_rank", holdout=0, prior=prior_or_none).model
                bucket.append(_mape(model.sample_costs(singles), truth.sample_costs(singles)))
        out["balanced by the prior" if balanced else "as dealt (equal counts)"] = {
            "condition": float(np.median(conds)), "single": float(np.median(errs)),
            "single_prior": float(np.median(errs_prior))}
    return out


def print_conditioning(result: dict) -> None:
    print("\nPer-rank fit on warm-up steps (32 ranks, 8 steps, ~24 samples a rank, 3% noise): dealt vs balanced")
    print(f"  {'warm-up steps':26s} {'cond(design)':>12s} {'single MAPE':>11s} {'+ prior':>8s}")
    for name, row in result.items():
        print(f"  {name:26s} {row['condition']:12.1f} {100 * row['single']:10.2f}% {100 * row['single_prior']:7.2f}%")


def print_table(results: dict) -> None:
    print("\nSynthetic step times, known coefficients (Qwen2-7B FLOPs prior; fixed-length packs of 8192; 3% noise);"
          " held-out MAPE pack / step / single sample / single sample up to one common scale, median of draws")
    names = list(next(iter(results.values())))
    print(f"  {'attn off':>8s} {'ranks':>5s} {'warm-up':>7s} " + " ".join(f"{n:>22s}" for n in names))
    for (off, ranks, warmup), row in results.items():
        cells = " ".join(f"{100 * row[n]['pack']:4.1f}/{100 * row[n]['step']:4.1f}/{100 * row[n]['single']:4.1f}/"
                         f"{100 * row[n]['shape']:4.1f}%" for n in names)
        print(f"  {100 * off:7.0f}% {ranks:5d} {warmup:7d} {cells}")
    print_single_summary(results)


def print_single_summary(results: dict) -> None:
    """Single-sample MAPE of the step-max fits by rank count: median and range over the cells."""
    print("\n  single-sample MAPE from step times alone, by ranks (median over cells [min-max])")
    ranks_list = sorted({k[1] for k in results})
    for name in [n for n in next(iter(results.values())) if n.startswith("step_max")]:
        parts = []
        for ranks in ranks_list:
            vals = [100 * row[name]["single"] for k, row in results.items() if k[1] == ranks]
            parts.append(f"{ranks} ranks {np.median(vals):5.1f}% [{min(vals):.1f}-{max(vals):.1f}]")
        every = [100 * row[name]["single"] for row in results.values()]
        print(f"  {name:22s} " + "  ".join(parts) + f"  all {np.median(every):5.1f}%")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=5)
    parser.add_argument("--strength", type=float, default=None)
    args = parser.parse_args()
    print_table(run(draws=args.draws, strength=args.strength))
    print_conditioning(conditioning(draws=args.draws))
