"""From step times alone (FSDP / ZeRO-3): does a plan made from the fitted model cut what the true costs cut?

Held-out mixes (`hf_dp_balance.testing.mix`: long-tail text, Qwen2-VL SFT with video and a long tail, the same
with images bounded at 8K tokens), one fixed-length pack of PACK tokens per rank as the start placement, 3%
multiplicative rank noise, only the slowest rank's time observed per step. The truth is the Qwen2-7B FLOP prior
at a fixed throughput (`cost_fit_synthetic.true_model`: a per-sample cost of 0.1% of a pack and a per-step
constant of 5%) with the attention term off the prior's: "prior right", "prior 2x low" (attention takes 2x its
FLOP share), "prior 2x high" (half), and "held out": quadratic x1.7, linear x0.6, per sample x1.3 (q/l 2.8x off).
Warm-up steps are placed as the runtime places them: with a prior, `core.hedge.probe_plan` (the function
`runtime.step_plan` calls: in turn the token-balanced plan, the plan for 3x the prior's attention share, the
token-balanced plan, the prior's plan, each when it holds up as well as the token-balanced one; cap 1.2x the
mean tokens); without one, the packs as they come.

Fits, side by side on the same warm-up steps:
  soft-max, no prior   the step time fitted to the soft-max of the rank costs, four free coefficients
                       (`step_noise=False`: this project's old fit, close to the published system's soft-max
                       fit, whose code is not in apps/reference.py)
  no prior             the noise-aware fit (`fit_cost_model(mode="step_max")`) without a prior
  prior, hedged        the noise-aware fit with the prior on warm-up steps placed by `core.hedge.hedged_plan`
                       (the previous warm-up: the plan that holds up best under the prior and the tokens)
  prior                the noise-aware fit with the prior as a distribution (`core.fitting.shape_prior`), on
                       the runtime's warm-up placement (`probe_plan`)
  prior, packs         the same fit on warm-up steps left as packs (as the prior-free fits see them)
  unit events          FSDP with `timing="unit_events"`: every rank's own time, fitted as the runtime fits it
                       (`runtime.fitter.fit_ranks`: each rank's time an observation of the noise-aware fit with
                       the prior as a distribution, then `rank_speeds` and the refit), on the hedged warm-up placement the runtime uses for
                       per-rank fits, the same samples and the same 3% rank noise as the columns before. What a
                       rank's spans see is not its true step (`span_view`): 3x the forward of the units, where
                       the attention's backward takes ATTENTION_BACKWARD x its forward (FlashAttention ~2.5,
                       against 2 for the dense layers: the quadratic term is seen x3/3.5), MISSED_LINEAR of the
                       linear term lies outside every unit (the loss over the vocabulary, the root's own code),
                       and the per-step constant (optimizer, exposed reductions) is in no span
  unit events, exact   the same with spans that see the truth's rank costs exactly (backward 2x every forward,
                       nothing missed): what the approximations above cost
  unit events, penalty the "unit events" data fitted with the per-rank fit CPU and DDP use (the prior's penalty
                       rows, strength 0.03) instead of the prior as a distribution (`core.fitting.fit_each_rank`)
With `--micro M` (M > 1 micro-batches per optimizer step, each synchronised as under FSDP / ZeRO-3: the step
takes the sum over micro-batches of the slowest rank; `--tail F` adds F mean slot costs to each step's last
micro-batch, for the gradient reduction, clipping and optimizer step), on the runtime's warm-up placement:
  prior, summed        the step times fitted on each rank's features summed over the micro-batches (the
                       library before per-micro-batch records: max over ranks of each rank's sum)
  prior, per micro-batch   each micro-batch's maximum one step-max observation, the tail kept as measured
  prior, tail dropped      the same without each step's last micro-batch
  prior, tail estimated    the tail estimated and subtracted (`core.fitting.fit_from_micro_batches`' default)
Measures on held-out steps of the same mix: the share of the reachable cut (makespan of the packs minus that of
the plan made from the fitted model, both on the TRUE costs, over the same for the plan made from the true costs;
summed over the evaluation steps) and the single-sample cost MAPE over samples of the mix; medians of draws.

    python bench/cost_fit_plans.py          # 12 warm-up steps, 3 draws, 3 evaluation steps
    python bench/cost_fit_plans.py --full   # 8 and 16 warm-up steps, 8 draws
    python bench/cost_fit_plans.py --ranks 32 128 --truths "prior 2x low" "prior 2x high" --steps 8 16 --draws 8
    python bench/cost_fit_plans.py --sensitivity  # the cut from the true costs with one term perturbed
    python bench/cost_fit_plans.py --ranks 32 128 --steps 8 16 --draws 6 --micro 2 4 --tail 0.05
        # FSDP / ZeRO-3 with M micro-batches a step: summed records vs one step-max observation per micro-batch
    python bench/cost_fit_plans.py --ranks 32 128 --truths "prior 2x low" "prior 2x high" --steps 8 16 --draws 6
        # the "unit events" columns beside "prior" (step times): the FSDP timing that sees every rank
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from cost_fit_synthetic import qwen2_7b_prior, true_model  # bench/ (run as a script: its folder is on sys.path)
from hf_dp_balance.testing.mix import draw_mix, fixed_length_step, truncate
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fitting import fit_cost_model, fit_from_micro_batches
from hf_dp_balance.core.hedge import hedged_plan, probe_plan
from hf_dp_balance.core.planner.api import plan_step
from hf_dp_balance.core.steps import token_cap
from hf_dp_balance.runtime.fitter import fit_ranks

PACK = 16384
MIXES = {"long-tail text": "text-sft", "video, long tail": "qwen2vl-sft", "bounded images": "qwen2vl-sft-bounded"}
TRUTHS = {"prior right": (1.0, 1.0, 1.0), "prior 2x low": (2.0, 1.0, 1.0), "prior 2x high": (0.5, 1.0, 1.0),
          "held out": (1.7, 0.6, 1.3)}  # truth's (quadratic, linear, per sample) over true_model's
FITS = ("soft-max, no prior", "no prior", "prior, hedged", "prior", "prior, packs", "unit events",
        "unit events, exact", "unit events, penalty")
# What FSDP unit spans see of a rank's step (`span_view`): the attention's backward over its forward
# (FlashAttention-2 ~2.5x; the 3x rule assumes 2x, as for the dense layers), and the share of the linear term
# outside every timed part (the loss over the vocabulary and the root module's own code between its children).
ATTENTION_BACKWARD = 2.5
MISSED_LINEAR = 0.04
# with --micro > 1, on the runtime's warm-up: the summed records (the library before), and each micro-batch's
# maximum with the step's tail (`--tail`) in the last one kept, dropped, or estimated and subtracted (the library)
MICRO_FITS = ("prior, summed", "prior, per micro-batch", "prior, tail dropped", "prior, tail estimated")


def truth_of(prior: CostModel, factors) -> CostModel:
    base = true_model(prior, 0.0, PACK)
    q, lin, ps = factors
    return CostModel(base.quadratic * q, base.linear * lin, base.per_sample * ps, base.constant)


def span_view(truth: CostModel, attention_backward: float = ATTENTION_BACKWARD,
              missed_linear: float = MISSED_LINEAR) -> CostModel:
    """What 3x the forward spans of a rank's FSDP units measure of the truth (`timing="unit_events"`): the
    quadratic term's forward is 1 / (1 + attention_backward) of it, so 3x that sees 3 / (1 + backward) of it;
    the linear and per-sample terms (dense layers: backward 2x forward) are seen whole, less the linear share
    outside every unit; the per-step constant is in no span."""
    return CostModel(truth.quadratic * 3.0 / (1.0 + attention_backward), truth.linear * (1.0 - missed_linear),
                     truth.per_sample, 0.0)


def unit_events_fit(feats, times, prior: CostModel, shape_prior: bool = True) -> CostModel:
    """The runtime's fit of every rank's time under `unit_events` (`runtime.fitter.fit_ranks` as
    `CostModelFitter` calls it: the per-rank fit around the prior as a distribution, each rank's speed from
    its residuals and the refit on speed-corrected times); `shape_prior=False`: the penalty-row per-rank fit
    that CPU and DDP keep."""
    return fit_ranks(feats, times, "per_rank", prior, estimate_speeds=True, shape_prior=shape_prior)[0].model


def plan(costs, lengths, owners, ranks):
    """The planner's dest rank for these costs, cap 1.2x the mean tokens (the config's default)."""
    largest = int(np.bincount(owners, weights=lengths, minlength=ranks).max())
    cap = token_cap(lengths, ranks, None, 1.2, largest)
    zeros = np.zeros_like(owners)
    return plan_step(costs, owners, zeros, ranks, 1, tokens=lengths, max_tokens=cap).dest_rank


def makespan(model: CostModel, lengths, dest, ranks) -> float:
    return float(np.bincount(dest, weights=model.sample_costs(lengths), minlength=ranks).max() + model.constant)


def cut_sums(rng, mix, ranks: int, truth: CostModel, models: dict, evals: int) -> dict:
    """Over `evals` held-out steps: name -> [slowest-rank time a plan from that model cuts, the cut a plan
    from the true costs makes], both priced with the true costs."""
    cut = {name: [0.0, 0.0] for name in models}
    for _ in range(evals):
        lengths, owners = fixed_length_step(rng, mix, ranks, PACK)
        base = makespan(truth, lengths, owners, ranks)
        best = makespan(truth, lengths, plan(truth.sample_costs(lengths), lengths, owners, ranks), ranks)
        for name, model in models.items():
            got = makespan(truth, lengths, plan(model.sample_costs(lengths), lengths, owners, ranks), ranks)
            cut[name][0] += base - got
            cut[name][1] += base - best
    return cut


def warmup(rng, mix, ranks, steps, truth, prior, noise, placement="probe", micro=1, tail=0.0, seen=None):
    """Features [steps, micro, ranks, 4] and micro-batch step maxima [steps, micro] of warm-up steps placed
    as the runtime places them (`placement` "probe"; "hedged": the previous warm-up; without a prior the packs
    as they come). `micro` micro-batches per optimizer step, synchronised each (FSDP / ZeRO-3: the forward
    all-gathers parameters): a step is ranks x micro packs, planned as that many slots (sync="micro_batch"
    balances the slots as ranks of their own), slot u is rank u % ranks of micro-batch u // ranks, and a
    micro-batch takes its slowest rank's noisy time. `tail`: the step's last micro-batch also takes this many
    mean slot costs more (the gradient reduction left exposed, clipping, the optimizer step: common to the
    ranks, described by no feature). micro=1, tail=0 draws and times exactly what it did before.
    `seen` (micro=1): every rank's time instead of the maxima, [steps, ranks]: what the spans see of the truth
    (`span_view`) under the same rank noise (the same draws: the columns compare on the same data)."""
    slots = ranks * micro
    feats, times = [], []
    for step in range(steps):
        lengths, owners = fixed_length_step(rng, mix, slots, PACK)
        dest = owners
        zeros = np.zeros_like(owners)

        def plan_costs(costs):
            return plan(costs, lengths, owners, slots), zeros

        if prior is not None and placement == "probe":
            dest = probe_plan(plan_costs, prior.sample_costs(lengths), lengths.astype(float), step, slots, 1)[0]
        elif prior is not None:
            dest = hedged_plan(plan_costs, prior.sample_costs(lengths), lengths.astype(float), owners, zeros, slots,
                               1)[0]
        f = np.stack([features_of(lengths[dest == u]) for u in range(slots)])
        feats.append(f.reshape(micro, ranks, 4))
        rank_noise = rng.lognormal(0.0, noise, slots)
        if seen is not None:
            times.append(seen.predict(f) * rank_noise)
            continue
        maxima = (truth.predict(f) * rank_noise).reshape(micro, ranks).max(axis=1)
        maxima[-1] += tail * float(truth.predict(f).mean())
        times.append(maxima)
    return np.stack(feats), np.stack(times)


def summed(feats, times):
    """What the recorder kept before per-micro-batch records: each rank's features summed over the step's
    micro-batches [steps, ranks, 4] and the step time [steps] (the sum of the micro-batches' maxima)."""
    return feats.sum(axis=1), times.sum(axis=1)


def per_micro_batch(feats, times):
    """Every micro-batch a step-max observation of its own: [steps * micro, ranks, 4], [steps * micro]."""
    return feats.reshape(-1, *feats.shape[2:]), times.reshape(-1)


def fitted_models(rng, mix, ranks, steps, truth, prior, noise, micro=1, tail=0.0, spans=(ATTENTION_BACKWARD,
                  MISSED_LINEAR)) -> dict:
    """fit name -> model; the prior-free fits see the packs as they come, the others the runtime's warm-up
    placement (and the previous, hedged one). With micro > 1 (`MICRO_FITS`): the fit of the step times on
    features summed over the micro-batches (max_r of sums: the library before per-micro-batch records) beside
    the fit of each micro-batch's maximum (the same steps, micro times the observations)."""
    state = rng.bit_generator.state
    if micro > 1:  # the runtime's probe only
        pfeats, ptimes = warmup(rng, mix, ranks, steps, truth, prior, noise, micro=micro, tail=tail)

        def per_micro(how):
            return fit_from_micro_batches(pfeats, ptimes, prior, tail=how, drop_first=False).model

        return {"prior, summed": fit_cost_model(*summed(pfeats, ptimes), mode="step_max", holdout=0, prior=prior).model,
                "prior, per micro-batch": per_micro("keep"), "prior, tail dropped": per_micro("drop"),
                "prior, tail estimated": per_micro("estimate")}
    feats, times = summed(*warmup(rng, mix, ranks, steps, truth, None, noise))
    rng.bit_generator.state = state  # the same samples and noise, placed by the hedge
    hfeats, htimes = summed(*warmup(rng, mix, ranks, steps, truth, prior, noise, "hedged"))
    rng.bit_generator.state = state  # every rank's time as its unit spans see it, on the hedged placement
    ufeats, utimes = warmup(rng, mix, ranks, steps, truth, prior, noise, "hedged", seen=span_view(truth, *spans))
    rng.bit_generator.state = state
    _, exact_times = warmup(rng, mix, ranks, steps, truth, prior, noise, "hedged", seen=span_view(truth, 2.0, 0.0))
    rng.bit_generator.state = state  # and by the runtime's probe
    pfeats, ptimes = summed(*warmup(rng, mix, ranks, steps, truth, prior, noise))
    return {
        "unit events": unit_events_fit(ufeats[:, 0], utimes, prior),
        "unit events, exact": unit_events_fit(ufeats[:, 0], exact_times, prior),
        "unit events, penalty": unit_events_fit(ufeats[:, 0], utimes, prior, shape_prior=False),
        "soft-max, no prior": fit_cost_model(feats, times, mode="step_max", holdout=0, step_noise=False).model,
        "no prior": fit_cost_model(feats, times, mode="step_max", holdout=0).model,
        "prior, hedged": fit_cost_model(hfeats, htimes, mode="step_max", holdout=0, prior=prior).model,
        "prior": fit_cost_model(pfeats, ptimes, mode="step_max", holdout=0, prior=prior).model,
        "prior, packs": fit_cost_model(feats, times, mode="step_max", holdout=0, prior=prior).model,
    }


def scores(rng, mix, ranks, truth, models, evals) -> dict:
    """name -> (share of the true-cost cut a plan from the model reaches over `evals` steps, single-sample
    mean |relative error| on 4000 fresh samples), both drawn from `rng` in this order."""
    cut = cut_sums(rng, mix, ranks, truth, models, evals)
    singles = truncate(draw_mix(mix, 4000, rng), PACK).tokens
    singles = singles[singles > 0]
    true_cost = truth.sample_costs(singles)
    return {name: (cut[name][0] / cut[name][1] if cut[name][1] > 0 else 1.0,
                   float(np.mean(np.abs(model.sample_costs(singles) / true_cost - 1))))
            for name, model in models.items()}

def fits_of(micro: int):
    return FITS if micro == 1 else MICRO_FITS


def cell(mix, ranks, steps, truth, prior, draws, evals, noise, seed, micro=1, tail=0.0,
         spans=(ATTENTION_BACKWARD, MISSED_LINEAR)) -> dict:
    """fit name -> {"share": median cut share, "single": median single-sample MAPE} over draws. The draws
    do not depend on `micro` beyond the warm-up (seeded by ranks, steps, draw), so micro-batch counts compare
    on the same evaluation steps only when the warm-up draws the same number of samples (micro=1 as before)."""
    rows = {name: [] for name in fits_of(micro)}
    for d in range(draws):
        rng = np.random.default_rng([seed, ranks, steps, d])
        models = fitted_models(rng, mix, ranks, steps, truth, prior, noise, micro, tail, spans)
        for name, measured in scores(rng, mix, ranks, truth, models, evals).items():
            rows[name].append(measured)
    return {name: {"share": float(np.median([r[0] for r in v])), "single": float(np.median([r[1] for r in v]))}
            for name, v in rows.items()}


def run(ranks_list=(8, 32, 128), steps_list=(12,), draws=3, evals=4, noise=0.03, seed=0, mixes=None, truths=None,
        micros=(1,), tail=0.0, spans=(ATTENTION_BACKWARD, MISSED_LINEAR)):
    prior = qwen2_7b_prior()
    results = {}
    for label, mix in (mixes or MIXES).items():
        for truth_name, factors in (truths or TRUTHS).items():
            truth = truth_of(prior, factors)
            for ranks in ranks_list:
                for steps in steps_list:
                    for micro in micros:
                        key = (label, truth_name, ranks, steps) + (() if micro == 1 else (micro,))
                        results[key] = cell(mix, ranks, steps, truth, prior, draws, evals, noise, seed, micro, tail,
                                            spans)
    return results


def print_results(results: dict) -> None:
    print(f"\nFrom step times alone: share of the true-cost cut / single-sample MAPE (median of draws; packs of "
          f"{PACK}, 3% rank noise)")
    for micro in sorted({k[4] if len(k) > 4 else 1 for k in results}):
        part = {k[:4]: v for k, v in results.items() if (k[4] if len(k) > 4 else 1) == micro}
        fits = fits_of(micro)
        print(f"\n  {micro} micro-batch(es) per step" + ("" if micro == 1 else
              " (step time = sum over micro-batches of the slowest rank)"))
        print(f"  {'mix':16s} {'truth':14s} {'ranks':>5s} {'steps':>5s} " + " ".join(f"{n:>22s}" for n in fits))
        for (mix, truth, ranks, steps), row in part.items():
            cells = " ".join(f"{100 * row[n]['share']:10.1f}% / {100 * row[n]['single']:5.1f}%" for n in fits)
            print(f"  {mix:16s} {truth:14s} {ranks:5d} {steps:5d} {cells}")
        print("\n  by ranks, over mixes and truths: median [min] share of the cut / median [max] single-sample MAPE")
        for ranks in sorted({k[2] for k in part}):
            for truth in dict.fromkeys(k[1] for k in part):
                keys = [k for k in part if k[2] == ranks and k[1] == truth]
                parts = []
                for n in fits:
                    share = [100 * part[k][n]["share"] for k in keys]
                    single = [100 * part[k][n]["single"] for k in keys]
                    parts.append(f"{np.median(share):5.1f} [{min(share):5.1f}] / {np.median(single):4.1f} "
                                 f"[{max(single):4.1f}]")
                print(f"  {ranks:5d} {truth:14s} " + " | ".join(parts))


def sensitivity(ranks: int = 32, evals: int = 8, seed: int = 1) -> dict:
    """Share of the cut reached by plans from the TRUE costs with one term perturbed (prior-right truth):
    how close a fitted model has to be for the plan to keep the cut. mix -> perturbation -> share."""
    truth = truth_of(qwen2_7b_prior(), TRUTHS["prior right"])
    q, lin, ps, c = truth.coefficients
    variants = {"q x1.2": CostModel(q * 1.2, lin, ps, c), "q x0.8": CostModel(q * 0.8, lin, ps, c),
                "per sample x0": CostModel(q, lin, 0.0, c), "x0.5": CostModel(q, lin, ps * 0.5, c),
                "x2": CostModel(q, lin, ps * 2, c), "x4": CostModel(q, lin, ps * 4, c)}
    out = {}
    for label, mix in MIXES.items():
        rng = np.random.default_rng(seed)
        cut = cut_sums(rng, mix, ranks, truth, variants, evals)
        out[label] = {k: a / b for k, (a, b) in cut.items()}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="8 and 16 warm-up steps, 8 draws, 6 evaluation steps")
    parser.add_argument("--draws", type=int, default=None)
    parser.add_argument("--ranks", type=int, nargs="*", default=[8, 32, 128])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, nargs="*", default=None, help="warm-up steps (default 12; --full: 8 16)")
    parser.add_argument("--truths", nargs="*", default=None, choices=list(TRUTHS), help="default: all")
    parser.add_argument("--mixes", nargs="*", default=None, choices=list(MIXES), help="default: all")
    parser.add_argument("--micro", type=int, nargs="*", default=[1],
                        help="micro-batches per optimizer step, each synchronised (FSDP / ZeRO-3); > 1: the fit of "
                             "summed records beside the per-micro-batch fit (default 1: the table as before)")
    parser.add_argument("--tail", type=float, default=0.0,
                        help="the step's tail in its last micro-batch, in mean slot costs (optimizer, exposed "
                             "gradient reduction; default 0)")
    parser.add_argument("--attention-backward", type=float, default=ATTENTION_BACKWARD,
                        help="the attention's backward over its forward in what unit spans see (default 2.5)")
    parser.add_argument("--missed-linear", type=float, default=MISSED_LINEAR,
                        help="share of the linear term outside every timed part (default 0.04)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="only: the cut reached with the true costs, one term perturbed (32 ranks, 8 steps)")
    args = parser.parse_args(argv)
    if args.sensitivity:
        for mix, row in sensitivity().items():
            print(f"  {mix:16s} " + "  ".join(f"{k} {100 * v:5.1f}%" for k, v in row.items()))
        return 0
    start = time.process_time()
    steps = tuple(args.steps) if args.steps else (8, 16) if args.full else (12,)
    draws = args.draws or (8 if args.full else 3)
    truths = {k: TRUTHS[k] for k in args.truths} if args.truths else None
    mixes = {k: MIXES[k] for k in args.mixes} if args.mixes else None
    results = run(tuple(args.ranks), steps, draws, 6 if args.full else 3, seed=args.seed, truths=truths, mixes=mixes,
                  spans=(args.attention_backward, args.missed_linear),
                  micros=tuple(args.micro), tail=args.tail)
    print_results(results)
    print(f"\n  {time.process_time() - start:.0f} s CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
