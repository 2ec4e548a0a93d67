"""The runtime's first step-time fit and one refit at twice the warm-up, on the bar's cells (the cost-fit study at eff4fc4).

`bench/cost_fit_probes.py`'s draws and measures, variant "refit-once": warm-up steps placed by `probe_plan`, the
first fit on the first `--first` steps, the steps after it (LAG later) planned with that fit as the runtime plans
them, and a refit on all `--steps` steps. Printed per cell, on the same evaluation steps: the first fit (what the
runtime plans with from the warm-up on) and the refit (median [min] share of the true-cost cut, median single-sample
MAPE, fitted / true attention ratio, and in brackets the draws >= 95% of the cut and <= 8% single sample), and beside them the fit of `--steps` steps all placed by `probe_plan` (the
runtime's warm-up of that length, "probe all"; `bench/cost_fit_plans.py`'s "prior" column at that step count).

    python bench/cost_fit_refit.py --first 16 --steps 32
    python bench/cost_fit_refit.py --first 8 --steps 16 --ranks 32 --mixes "bounded images" --truths "prior 2x high"
    python bench/cost_fit_refit.py --first 8 --steps 16 --micro 4 --draws 6   # the defaults at 4 micro-batches
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cost_fit_probes as probes
from cost_fit_plans import MIXES, PACK, TRUTHS, plan, scores, truth_of
from cost_fit_synthetic import qwen2_7b_prior
from hf_dp_balance.core.cost import features_of
from hf_dp_balance.core.fitting import fit_from_micro_batches
from hf_dp_balance.core.hedge import probe_plan
from hf_dp_balance.testing.mix import fixed_length_step


def micro_cell(mix, ranks, steps, first, truth, prior, draws, micro, evals=3, noise=0.03, seed=0):
    """With `micro` micro-batches a step (each synchronised, FSDP / ZeRO-3; `bench/cost_fit_plans.py --micro`'s
    warm-up and per-micro-batch fit, tail estimated): the first fit on `first` probe steps, the steps from LAG
    after it planned as `micro x ranks` slots with that fit, the refit on all. name -> per-draw rows (share,
    single, fitted / true ratio)."""
    out = {"refit-once @first": [], "refit-once": []}
    slots = ranks * micro
    for d in range(draws):
        rng = np.random.default_rng([seed, ranks, steps, d])
        feats, times, first_fit = [], [], None
        for step in range(steps):
            lengths, owners = fixed_length_step(rng, mix, slots, PACK)
            zeros = np.zeros_like(owners)
            if step == first:
                first_fit = fit_from_micro_batches(np.stack(feats), np.stack(times), prior, drop_first=False).model
            if first_fit is None or step < first + probes.LAG:
                dest = probe_plan(lambda c: (plan(c, lengths, owners, slots), zeros), prior.sample_costs(lengths),
                                  lengths.astype(float), step, slots, 1)[0]
            else:
                dest = plan(first_fit.sample_costs(lengths), lengths, owners, slots)
            f = np.stack([features_of(lengths[dest == u]) for u in range(slots)])
            feats.append(f.reshape(micro, ranks, 4))
            times.append((truth.predict(f) * rng.lognormal(0.0, noise, slots)).reshape(micro, ranks).max(axis=1))
        models = {"refit-once @first": first_fit,
                  "refit-once": fit_from_micro_batches(np.stack(feats), np.stack(times), prior, drop_first=False).model}
        for name, (share, single) in scores(rng, mix, ranks, truth, models, evals).items():
            m = models[name]
            out[name].append((share, single, (m.quadratic / m.linear) / (truth.quadratic / truth.linear)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first", type=int, default=16, help="steps of the first fit (the runtime's warmup_steps)")
    parser.add_argument("--steps", type=int, default=32, help="steps of the refit")
    parser.add_argument("--ranks", type=int, nargs="*", default=[32, 128])
    parser.add_argument("--truths", nargs="*", default=["prior 2x low", "prior 2x high"], choices=list(TRUTHS))
    parser.add_argument("--mixes", nargs="*", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--no-probe-all", action="store_true", help="only the first fit and the refit")
    parser.add_argument("--micro", type=int, default=1,
                        help="micro-batches a step, each a step-max observation (FSDP / ZeRO-3); > 1 implies "
                             "--no-probe-all")
    args = parser.parse_args(argv)
    probes.REFIT_FROM = args.first
    prior = qwen2_7b_prior()
    start = time.process_time()
    print(f"first fit at {args.first} steps, refit at {args.steps}; {args.draws} draws: median [min] share of the cut / "
          f"median single-sample MAPE / median fitted over true ratio")
    for mix in args.mixes:
        for truth in args.truths:
            for ranks in args.ranks:
                if args.micro > 1:
                    args.no_probe_all = True
                    rows = micro_cell(MIXES[mix], ranks, args.steps, args.first, truth_of(prior, TRUTHS[truth]),
                                      prior, args.draws, args.micro)
                else:
                    rows, _ = probes.cell(MIXES[mix], ranks, args.steps, truth_of(prior, TRUTHS[truth]), prior,
                                          args.draws, ["refit-once"] + ([] if args.no_probe_all else ["current"]))
                parts = []
                for v in ("refit-once @first", "refit-once") + (() if args.no_probe_all else ("current",)):
                    a = np.array(rows[v])
                    parts.append(f"{100 * np.median(a[:, 0]):5.1f}% [{100 * a[:, 0].min():5.1f}] / "
                                 f"{100 * np.median(a[:, 1]):4.1f}% / {np.median(a[:, 2]):.2f}x "
                                 f"({(a[:, 0] >= 0.95).sum()}, {(a[:, 1] <= 0.08).sum()} of {len(a)})")
                print(f"  {mix:16s} {truth:14s} {ranks:4d}  first {parts[0]}  |  refit {parts[1]}"
                      + ("" if args.no_probe_all else f"  |  probe all {parts[2]}"), flush=True)
    print(f"  {time.process_time() - start:.0f} s CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
