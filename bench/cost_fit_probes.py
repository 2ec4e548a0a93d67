"""Warm-up placements for the step-time fit, side by side on the same draws: can another placement let the fit
correct a prior 2x off in the cells where `core.hedge.probe_plan` misses (the cost-fit study at eff4fc4)?

Same setup, draws and measures as `bench/cost_fit_plans.py`'s "prior" column: every variant's warm-up draws
the same samples and rank noise from the same generator state, and the evaluation steps and single samples
follow as in that bench, so "current" reproduces its column. Only the warm-up placement changes (`VARIANTS`):
  current        `probe_plan` (what the runtime does): tokens, 3x the prior's excess, tokens, the prior
  adaptive       the first cycle as current; then odd steps planned for the fit of the steps timed so far
                 (LAG steps behind, as a loader that prepares steps ahead would be) with its attention ratio x3,
                 then /3, each kept only if its worst excess over the fixed hull (tokens, prior, 3x the prior)
                 is at most the token plan's (the same guarantee); even steps the token plan
  adaptive-wide  the same, the hull widened by the fit's x3 hypothesis
  per-sample     current, the second token step of each cycle replaced by the plan for the tokens plus 64 tokens
                 per sample (ranks with many samples get fewer tokens), hedged over the hull plus that cost
  ridge-pick     odd steps: of the hedged plans for extrapolate(prior, tokens, f), f in FACTORS, the one whose
                 slowest rank differs most between the two ends of the ratio / per-sample ridge around the
                 prior (ratio x1.5 with per sample x0.6, and the inverse); even steps the token plan
  oracle-pick    the same choice made with the truth and the model the fit settles on (ratio x1.5, per sample
                 x0.6 of the truth's): a bound for any rule that chooses among these plans
  lone-pair      not hedged: the rank of the step's longest sample gets (step % 4) x --lone-pair short samples
                 (< 512 tokens) beside it, so its companions' cost shows in the step maximum
  cap-fill       the cycle's second token step (position `--fill-step`) replaced by the token plan with
                 the quarter of the ranks of least attention per token filled with other ranks' shortest samples
                 up to the highest FILL_LEVELS x the mean tokens that keeps probe_plan's guarantee;
                 cap-fill-both also at position 0; fill-medium with the samples nearest the median length
  fill-heavy     the same, the receivers the ranks of several samples with the largest sum L^2; -both also at
                 position 0; -safe never above the token plan's largest rank; -guard also no slower than the
                 token plan under the prior and half its attention share (GUARD_FACTORS)
  refit          after REFIT_FROM probe steps, each step planned with the fit of the steps LAG before
  refit-once     after REFIT_FROM probe steps, the steps from LAG later planned with the fit of those steps (the
                 runtime's first fit); that fit is also scored ("refit-once @first")
  active         (not kept) after --active-from probe steps a provisional fit; from LAG later each step
                 (--token-steps: only the cycle's token-balanced ones) is the token plan with receiver slots
                 (`_receivers`: heavy / light / lone) filled with short samples (`fill_slots`) up to (1 + --slowdown)
                 x the token plan's slowest slot under every bound hypothesis (--active-bound: the probe hull with
                 or without the tokens; --bound-lo / --bound-grid / --bound-per-sample add rows) and the loader's
                 cap (--no-cap: lifted, a diagnostic), the fill whose soft step maximum tells the split (the fit's
                 ratio / --active-k-lo and x --active-k) apart most (`active_probe`); active-refit refits each step
`--unhedged` lets ridge-pick / oracle-pick take any candidate, factors -1, -0.5, 4 and 6 as well. Printed per
variant: median [min] share of the true-cost cut, median single-sample MAPE, fitted / true attention ratio and
per-sample cost (medians), the share per draw; for the oracle and lone-pair also each warm-up step's slowest
rank (true costs) over the token plan's / the hedged probe's.

    python bench/cost_fit_probes.py --mix "bounded images" --ranks 32 --truth "prior 2x high" --steps 12 \\
        --variants current adaptive adaptive-wide per-sample ridge-pick oracle-pick
    python bench/cost_fit_probes.py --mix "video, long tail" --ranks 128 --truth "prior 2x low" --variants lone-pair
    python bench/cost_fit_probes.py --mix "video, long tail" --ranks 128 --truth "prior 2x low" --steps 16 \
        --variants current cap-fill fill-heavy fill-heavy-guard
    python bench/cost_fit_probes.py --mix "video, long tail" --ranks 128 --truth "prior 2x low" --steps 16 --draws 32 \
        --variants current active --active-bound no-tokens --active-k-lo 1 --active-k 2 --token-steps --bound-lo 1.5
"""

from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

import hf_dp_balance.core.fitting as fitting
from cost_fit_plans import MIXES, PACK, TRUTHS, plan, scores, truth_of
from cost_fit_synthetic import qwen2_7b_prior
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fitting import fit_cost_model
from hf_dp_balance.core.hedge import PROBE_CYCLE, extrapolate, probe_hypotheses, probe_plan, worst_excess
from hf_dp_balance.core.steps import token_cap
from hf_dp_balance.testing.mix import fixed_length_step

LAG = 2  # steps between a step's time and the plan that can use it (the loader prepares steps ahead)
VARIANTS = ("current", "adaptive", "adaptive-wide", "per-sample", "ridge-pick", "oracle-pick", "lone-pair",
            "cap-fill", "cap-fill-both", "fill-medium", "fill-heavy", "fill-heavy-both", "fill-heavy-safe", "fill-heavy-guard", "refit", "refit-once",
            "active", "active-refit")
FILL_LEVELS = (1.2, 1.15, 1.1, 1.05)  # cap-fill: receivers' tokens over the mean, highest that passes the hedge
FILL_SHARE = 0.25  # cap-fill: share of the ranks that receive
FILL_STEP = 2  # cap-fill: the cycle's step it replaces (2: the second token-balanced step)
ACTIVE_FROM = 8  # active: probe steps before the provisional fit that places the rest of the warm-up
ACTIVE_SLOWDOWN = 0.05  # active: no slot above 1 + this x the token plan's slowest, under every hypothesis
ACTIVE_K = 1.5  # active: the split's ratios, the provisional fit's / and x this
ACTIVE_BOUND = "hull"  # active: "hull" probe_hypotheses + the split; "no-tokens" the same less the tokens
ACTIVE_K_LO = None  # active: the lower split's factor when not ACTIVE_K
ACTIVE_RULES = ("heavy", "light")  # active: the receiver rules tried (_receivers: most attention among
# multi-sample slots / least attention per token)
ACTIVE_BOUND_LO = ()  # active: the bound also holds under the provisional fit with its ratio / each of these
ACTIVE_BOUND_GRID = ()  # active: ... and under extrapolate(prior, tokens, f) for each f here
ACTIVE_BOUND_PER_SAMPLE = ()  # active: ... and under the fit with its per-sample cost x each of these
ACTIVE_CAP_RATIO = 1.2  # active, diagnostic: the fills' token cap over the mean (the loader's: 1.2)
ACTIVE_CAP = True  # active: fills keep the loader's token cap (False: a diagnostic only, the cap lifted)
ACTIVE_TOKEN_STEPS = False  # active: only the cycle's token-balanced steps are placed actively
ACTIVE_MIN_GAP = 0.0  # active: below this gap (log units) the step keeps probe_plan's placement
REFIT_FROM = 8  # refit: steps placed by probe_plan before plans from the fit of the steps so far
FACTORS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)  # ridge / oracle candidates: extrapolate(prior, tokens, f)
UNHEDGED_FACTORS = (-1.0, -0.5, 4.0, 6.0)
RIDGE = (1.5, 0.6)  # (ratio, per sample) of the ridge's upper end; the lower end is the inverse


@dataclass
class Probe:
    """One cell's variant settings and what its warm-up did (read after the run)."""

    truth: CostModel
    lone_pair: int = 8
    unhedged: bool = False
    slowdown: list = field(default_factory=list)  # warm-up step's true slowest rank over its reference plan's
    picked: list = field(default_factory=list)  # ridge / oracle: the factor chosen per odd step (0: tokens)
    noise: Optional[float] = None  # active: the provisional fit's step noise
    first_fit: Optional[CostModel] = None  # refit-once: the fit of the first REFIT_FROM steps (reset per draw)

    @property
    def wrong(self) -> CostModel:
        t = self.truth
        return CostModel(t.quadratic * RIDGE[0], t.linear, t.per_sample * RIDGE[1], t.constant)


def _top(costs, dest, ranks) -> float:
    return float(np.bincount(dest, weights=costs, minlength=ranks).max())


def _hedged_pick(plan_costs, hull, probe_costs, tokens, ranks):
    """The plan for `probe_costs` if its worst excess over `hull` is at most the token plan's, else the token plan."""
    token_plan = plan_costs(tokens)
    probe = plan_costs(probe_costs)
    keep = worst_excess(hull, *probe, ranks, 1) <= worst_excess(hull, *token_plan, ranks, 1)
    return probe[0] if keep else token_plan[0]


# Active warm-up (not kept): once a provisional step-time fit exists, a warm-up step placed to tell apart
# two attention ratios that fit cannot, at a bounded slowdown.
ACTIVE_SHARES = (0.0625, 0.125, 0.25)  # receiving ranks tried, as a share of the slots


def fill_slots(dest: np.ndarray, tokens: np.ndarray, costs: np.ndarray, limits: np.ndarray,
               receivers: np.ndarray, num_slots: int, max_tokens: Optional[float] = None) -> np.ndarray:
    """`dest` with `receivers` (slot ids) filled, one after the other, with the shortest samples of the other slots
    (never a slot's longest sample: no slot empties) while every hypothesis' slot sum (`costs` [H, n]) stays at
    most `limits` [H] and the slot's tokens at most `max_tokens`. Donors only lose work, so every slot of the
    result is at most max(its start, `limits`) under every hypothesis. O(n log n + receivers x n)."""
    dest = np.array(dest, dtype=np.int64, copy=True)
    tokens = np.asarray(tokens, dtype=np.float64)
    costs = np.atleast_2d(np.asarray(costs, dtype=np.float64))
    receivers = np.asarray(receivers, dtype=np.int64)
    is_receiver = np.zeros(num_slots, dtype=bool)
    is_receiver[receivers] = True
    order = np.lexsort((np.arange(len(tokens)), -tokens, dest))  # per slot, longest first
    first_of_slot = np.ones(len(order), dtype=bool)
    first_of_slot[1:] = dest[order][1:] != dest[order][:-1]
    keeps = np.zeros(len(tokens), dtype=bool)
    keeps[order[first_of_slot]] = True  # each slot's longest sample stays
    pool = np.flatnonzero(~keeps & ~is_receiver[dest])
    pool = pool[np.argsort(tokens[pool], kind="stable")]
    slot_cost = np.stack([np.bincount(dest, weights=h, minlength=num_slots) for h in costs])
    slot_tokens = np.bincount(dest, weights=tokens, minlength=num_slots)
    cap = np.inf if max_tokens is None else float(max_tokens)
    for r in receivers:
        if not pool.size:
            break
        room = np.minimum((limits - slot_cost[:, r])[:, None] - np.cumsum(costs[:, pool], axis=1), np.inf)
        fits = np.all(room >= 0.0, axis=0) & (slot_tokens[r] + np.cumsum(tokens[pool]) <= cap)
        take = int(np.argmin(fits)) if not fits.all() else len(pool)  # the longest prefix that fits
        if take == 0:
            continue
        dest[pool[:take]] = r
        slot_cost[:, r] += costs[:, pool[:take]].sum(axis=1)
        slot_tokens[r] += tokens[pool[:take]].sum()
        pool = pool[take:]
    return dest


def _receivers(dest: np.ndarray, tokens: np.ndarray, num_slots: int, rule: str, count: int) -> np.ndarray:
    sq = np.bincount(dest, weights=tokens * tokens, minlength=num_slots)
    tok = np.bincount(dest, weights=tokens, minlength=num_slots)
    n = np.bincount(dest, minlength=num_slots)
    if rule == "lone":  # the slots of one long sample, longest first: companions beside it show their cost in the max
        order = np.argsort(-np.where(n == 1, tok, -1.0), kind="stable")
        return order[n[order] == 1][:count]
    if rule == "heavy":  # a long sample that does not fill its slot: filled, it nears a lone longer sample
        order = np.argsort(-np.where(n > 1, sq, -1.0), kind="stable")
        order = order[n[order] > 1]
    else:  # nearly all linear work: near the top only when attention is light
        order = np.argsort(sq / np.maximum(tok, 1.0), kind="stable")
    return order[:count]


def _max_gap(dest: np.ndarray, split: np.ndarray, constants: np.ndarray, num_slots: int, noise: float) -> float:
    """log of the expected step maximum under split[0] less under split[1], each a soft maximum of the slots'
    log costs at temperature `noise` (the step noise: a slot within a few sigmas of the top shows in the max)."""
    out = []
    for h, c in zip(split, constants):
        logs = np.log(np.bincount(dest, weights=h, minlength=num_slots) + c) / max(noise, 1e-6)
        top = logs.max()
        out.append((top + np.log(np.exp(logs - top).sum())) * max(noise, 1e-6))
    return float(out[0] - out[1])


def active_probe(token_dest: np.ndarray, tokens: np.ndarray, split: np.ndarray, constants: np.ndarray,
                 bound: np.ndarray, slowdown: float, num_slots: int, max_tokens: Optional[float] = None,
                 noise: float = 0.03,
                 shares: Sequence[float] = ACTIVE_SHARES, rules: Sequence[str] = ACTIVE_RULES):
    """(dest, gap): of the token plan `token_dest` filled per `fill_slots` (receivers by `rules` x `shares`), the
    placement whose slowest slot tells the two hypotheses `split` [2, n] (per-sample costs; `constants` [2] their
    per-step constants) apart the most: gap = |log top_0 - log top_1| less the token plan's (the fit's free scale).
    Bound: under every row of `bound` [H, n] (with `split`'s rows added), no slot above (1 + slowdown) x the token
    plan's slowest slot. gap 0 and the token plan when no fill tells them apart more."""
    tokens = np.asarray(tokens, dtype=np.float64)
    split = np.asarray(split, dtype=np.float64)
    hypotheses = np.vstack([np.atleast_2d(np.asarray(bound, dtype=np.float64)), split])
    tops = np.array([np.bincount(token_dest, weights=h, minlength=num_slots).max() for h in hypotheses])
    limits = (1.0 + float(slowdown)) * tops
    reference = _max_gap(token_dest, split, constants, num_slots, noise)
    best, best_gap = np.asarray(token_dest), 0.0
    if slowdown <= 0.0:
        return best, best_gap
    for rule in rules:
        for share in shares:
            count = max(1, int(round(share * num_slots)))
            dest = fill_slots(token_dest, tokens, hypotheses, limits,
                              _receivers(np.asarray(token_dest), tokens, num_slots, rule, count), num_slots,
                              max_tokens)
            gap = abs(_max_gap(dest, split, constants, num_slots, noise) - reference)
            if gap > best_gap + 1e-12:
                best, best_gap = dest, gap
    return best, best_gap


def _scaled_ratio(model: CostModel, factor: float) -> CostModel:
    return CostModel(model.quadratic * factor, model.linear, model.per_sample, model.constant)


def _pick(probe: Probe, step, lengths, plan_costs, prior_costs, tokens, hull, ranks, one: CostModel,
          other: CostModel):
    """Odd steps: of the candidate plans (hedged unless `probe.unhedged`), the one whose slowest rank tells `one`
    from `other` the most (|log ratio of the slowest rank's cost under the two|, `other` scaled to agree with
    `one` on the token plan: the fit's free scale); even steps the token plan."""
    token_plan = plan_costs(tokens)
    if step % 2 == 0:
        return token_plan[0]
    limit = worst_excess(hull, *token_plan, ranks, 1)
    a, b = one.sample_costs(lengths), other.sample_costs(lengths)
    norm = np.log(_top(a, token_plan[0], ranks)) - np.log(_top(b, token_plan[0], ranks))
    best, best_gap, best_f = token_plan[0], 0.0, 0.0
    for f in FACTORS + (UNHEDGED_FACTORS if probe.unhedged else ()):
        dest = plan_costs(extrapolate(prior_costs, tokens, f))
        if not probe.unhedged and worst_excess(hull, *dest, ranks, 1) > limit:
            continue
        gap = abs(np.log(_top(a, dest[0], ranks)) - np.log(_top(b, dest[0], ranks)) - norm)
        if gap > best_gap:
            best, best_gap, best_f = dest[0], gap, f
    probe.picked.append(best_f)
    real = probe.truth.sample_costs(lengths)
    probe.slowdown.append(_top(real, best, ranks) / _top(real, token_plan[0], ranks))
    return best


def fill_plan(base, lengths, ranks, level, share=FILL_SHARE, medium=False, heavy=False, safe=False):
    """`base` with the ranks of least attention per token (sum L^2 / sum L) filled to `level` x the mean tokens
    with the shortest samples of the other ranks (never a rank's only sample): ranks whose work is nearly all
    linear sit near the step's slowest, so the step maximum tells the linear term from the quadratic one."""
    dest = base.copy()
    lengths = lengths.astype(np.int64)
    tok = np.bincount(dest, weights=lengths, minlength=ranks)
    sq = np.bincount(dest, weights=lengths.astype(float) ** 2, minlength=ranks)
    count = np.bincount(dest, minlength=ranks)
    if heavy:  # the ranks of several samples with the most attention (a long sample that does not fill the rank)
        order = np.argsort(-np.where(count > 1, sq, -1.0))
        order = order[count[order] > 1]
    else:
        order = np.argsort(sq / np.maximum(tok, 1.0))
    receivers = order[: max(1, int(round(share * ranks)))]
    is_receiver = np.zeros(ranks, bool)
    is_receiver[receivers] = True
    room = np.zeros(ranks)
    target = level * lengths.sum() / ranks
    if safe:  # never above the token plan's largest rank: the loader's cap holds without knowing it
        target = min(target, float(tok.max()))
    room[receivers] = target - tok[receivers]
    if medium:  # samples nearest the median length first (the receivers' attention and sample count both moderate)
        order_samples = np.argsort(np.abs(np.log(lengths) - np.log(np.median(lengths))), kind="stable")
    else:
        order_samples = np.argsort(lengths, kind="stable")
    for i in order_samples:
        src = dest[i]
        if is_receiver[src] or count[src] <= 1:
            continue
        fits = np.flatnonzero(room >= lengths[i])
        if not fits.size:
            if not medium and room.max() < lengths[i]:
                break
            continue
        r = fits[np.argmax(room[fits])]
        dest[i] = r
        room[r] -= lengths[i]
        count[src] -= 1
        count[r] += 1
    return dest


GUARD_FACTORS = (1.0, 0.5)  # fill-heavy-guard: no slower than the token plan under these attention shares


def _fill_pick(plan_costs, prior_costs, tokens, lengths, ranks, medium=False, heavy=False, safe=False, guard=False):
    """The highest `FILL_LEVELS` fill of the token plan whose worst excess over the probe hull is at most the
    token plan's (probe_plan's guarantee), else the token plan."""
    hull = probe_hypotheses(prior_costs, tokens)
    token_plan = plan_costs(tokens)
    limit = worst_excess(hull, *token_plan, ranks, 1)
    for level in FILL_LEVELS:
        dest = fill_plan(token_plan[0], lengths, ranks, level, FILL_SHARE, medium, heavy, safe)
        if guard and any(_top(h, dest, ranks) > _top(h, token_plan[0], ranks) * (1 + 1e-9) for h in
                         (extrapolate(prior_costs, tokens, f) for f in GUARD_FACTORS)):
            continue
        if worst_excess(hull, dest, token_plan[1], ranks, 1) <= limit:
            return dest, level
    return token_plan[0], 0.0


def placement(variant, probe: Probe, step, lengths, plan_costs, prior: CostModel, history, ranks):
    """The warm-up step's dest rank under `variant`; `history` = (features, times) of the steps before it."""
    tokens = lengths.astype(float)
    prior_costs = prior.sample_costs(lengths)
    hull = probe_hypotheses(prior_costs, tokens)
    if variant == "current" or (variant.startswith("adaptive") and step < 4):
        return probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
    if variant.startswith("adaptive"):
        seen = step - LAG
        if step % 2 == 0 or seen < 4:
            return probe_plan(plan_costs, prior_costs, tokens, 0, ranks, 1)[0]
        fit = fit_cost_model(np.stack(history[0][:seen]), np.array(history[1][:seen]), mode="step_max", holdout=0,
                             prior=prior).model
        costs = _scaled_ratio(fit, 3.0 if step % 4 == 1 else 1.0 / 3.0).sample_costs(lengths)
        if variant == "adaptive-wide":
            hull = np.vstack([hull, _scaled_ratio(fit, 3.0).sample_costs(lengths)])
        return _hedged_pick(plan_costs, hull, costs, tokens, ranks)
    if variant == "per-sample":
        if step % 4 != 2:
            return probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        heavy = tokens + 64.0  # 64 tokens a sample: 4x the truth's, ~2 sigma over the prior's guess of 8
        return _hedged_pick(plan_costs, np.vstack([hull, heavy]), heavy, tokens, ranks)
    if variant == "ridge-pick":
        ps = fitting.PER_SAMPLE_TOKENS * prior.linear  # the shape prior's per-sample guess
        up = CostModel(prior.quadratic * RIDGE[0], prior.linear, ps * RIDGE[1], 0.0)
        down = CostModel(prior.quadratic / RIDGE[0], prior.linear, ps / RIDGE[1], 0.0)
        return _pick(probe, step, lengths, plan_costs, prior_costs, tokens, hull, ranks, up, down)
    if variant == "oracle-pick":
        return _pick(probe, step, lengths, plan_costs, prior_costs, tokens, hull, ranks, probe.truth, probe.wrong)
    if variant in ("cap-fill", "cap-fill-both", "fill-medium", "fill-heavy", "fill-heavy-both", "fill-heavy-safe",
                   "fill-heavy-guard"):
        if step % 4 != FILL_STEP and not (variant.endswith("-both") and step % 4 == 0):
            return probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        dest, level = _fill_pick(plan_costs, prior_costs, tokens, lengths, ranks, variant == "fill-medium",
                                 variant.startswith("fill-heavy"), variant == "fill-heavy-safe",
                                 variant == "fill-heavy-guard")
        probe.picked.append(level)
        real = probe.truth.sample_costs(lengths)
        probe.slowdown.append(_top(real, dest, ranks) / _top(real, plan_costs(tokens)[0], ranks))
        return dest
    if variant in ("active", "active-refit"):
        if step < ACTIVE_FROM + LAG or (ACTIVE_TOKEN_STEPS and PROBE_CYCLE[step % 4] != 0.0):
            return probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        if variant == "active-refit" or probe.first_fit is None:
            seen = ACTIVE_FROM if variant == "active" else step - LAG
            result = fit_cost_model(np.stack(history[0][:seen]), np.array(history[1][:seen]),
                                    mode="step_max", holdout=0, prior=prior)
            probe.first_fit, probe.noise = result.model, result.report.step_noise
        fit = probe.first_fit
        lo, hi = _scaled_ratio(fit, 1.0 / (ACTIVE_K_LO or ACTIVE_K)), _scaled_ratio(fit, ACTIVE_K)
        if ACTIVE_BOUND == "no-tokens":
            hull = hull[[0, 2]]
        extra = [_scaled_ratio(fit, 1.0 / b).sample_costs(lengths) for b in ACTIVE_BOUND_LO]
        extra += [extrapolate(prior_costs, tokens, f) * prior_costs.sum() for f in ACTIVE_BOUND_GRID]
        extra += [CostModel(fit.quadratic, fit.linear, fit.per_sample * m, fit.constant).sample_costs(lengths)
                  for m in ACTIVE_BOUND_PER_SAMPLE]
        if extra:
            hull = np.vstack([hull] + extra)
        split = np.stack([lo.sample_costs(lengths), hi.sample_costs(lengths)])
        token_dest = plan_costs(tokens)[0]
        largest = int(np.bincount(plan_costs.owners, weights=lengths, minlength=ranks).max())
        cap = token_cap(lengths, ranks, None, ACTIVE_CAP_RATIO, largest) if ACTIVE_CAP else None
        dest, gap = active_probe(token_dest, tokens, split, np.array([lo.constant, hi.constant]), hull,
                                 ACTIVE_SLOWDOWN, ranks, cap, probe.noise or 0.03, rules=ACTIVE_RULES)
        if gap <= ACTIVE_MIN_GAP:
            dest = probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        probe.picked.append(round(gap, 2))
        real = probe.truth.sample_costs(lengths)
        probe.slowdown.append(_top(real, dest, ranks) / _top(real, token_dest, ranks))
        return dest
    if variant == "refit-once":  # the runtime's first fit after REFIT_FROM steps, its plans until the refit
        if step < REFIT_FROM + LAG:
            return probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        if probe.first_fit is None:
            probe.first_fit = fit_cost_model(np.stack(history[0][:REFIT_FROM]), np.array(history[1][:REFIT_FROM]),
                                             mode="step_max", holdout=0, prior=prior).model
        return plan_costs(probe.first_fit.sample_costs(lengths))[0]
    if variant == "refit":
        seen = step - LAG
        if step < REFIT_FROM or seen < 4:
            return probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        fit = fit_cost_model(np.stack(history[0][:seen]), np.array(history[1][:seen]), mode="step_max", holdout=0,
                             prior=prior).model
        return plan_costs(fit.sample_costs(lengths))[0]
    if variant == "lone-pair":
        hedged = probe_plan(plan_costs, prior_costs, tokens, step, ranks, 1)[0]
        dest = hedged.copy()
        longest = int(np.argmax(lengths))
        short = np.flatnonzero((lengths < 512) & (dest != dest[longest]))
        dest[short[: (step % 4) * probe.lone_pair]] = dest[longest]
        real = probe.truth.sample_costs(lengths)
        probe.slowdown.append(_top(real, dest, ranks) / _top(real, hedged, ranks))
        return dest
    raise ValueError(f"unknown variant {variant!r}")


def warmup(rng, variant, probe: Probe, mix, ranks, steps, prior, noise):
    """Features [steps, ranks, 4] and step times (slowest rank, multiplicative rank noise) of the warm-up."""
    feats, times = [], []
    for step in range(steps):
        lengths, owners = fixed_length_step(rng, mix, ranks, PACK)
        zeros = np.zeros_like(owners)

        def plan_costs(costs):
            return plan(costs, lengths, owners, ranks), zeros

        plan_costs.owners = owners
        dest = placement(variant, probe, step, lengths, plan_costs, prior, (feats, times), ranks)
        f = np.stack([features_of(lengths[dest == r]) for r in range(ranks)])
        feats.append(f)
        times.append(float((probe.truth.predict(f) * rng.lognormal(0.0, noise, ranks)).max()))
    return np.stack(feats), np.array(times)


def cell(mix, ranks, steps, truth, prior, draws, variants, evals=3, noise=0.03, seed=0, lone_pair=8,
         unhedged=False):
    """(variant -> per-draw rows (share of the cut, single-sample MAPE, fitted / true ratio, fitted / true per
    sample), variant -> its `Probe`) on `bench/cost_fit_plans.py`'s draws."""
    probes = {v: Probe(truth, lone_pair, unhedged) for v in variants}
    out = {v: [] for v in variants}
    for d in range(draws):
        rng = np.random.default_rng([seed, ranks, steps, d])
        state = rng.bit_generator.state
        models = {}
        for v in variants:
            probes[v].first_fit = None
            rng.bit_generator.state = state  # every warm-up draws the same samples and noise (as the bench's)
            models[v] = fit_cost_model(*warmup(rng, v, probes[v], mix, ranks, steps, prior, noise), mode="step_max",
                                       holdout=0, prior=prior).model
            if probes[v].first_fit is not None:  # refit-once: its first fit scored on the same evaluation steps
                models[v + " @first"] = probes[v].first_fit
        for v, (share, single) in scores(rng, mix, ranks, truth, models, evals).items():
            m = models[v]
            out.setdefault(v, [])
            out[v].append((share, single, (m.quadratic / m.linear) / (truth.quadratic / truth.linear),
                           m.per_sample / truth.per_sample))
    return out, probes


@contextlib.contextmanager
def per_sample_prior(tokens: Optional[float], sigma: Optional[float]):
    """Experiment only: the shape prior's per-sample guess (`core.fitting.PER_SAMPLE_TOKENS` / `_SIGMA`) set for
    the block, restored after it."""
    saved = fitting.PER_SAMPLE_TOKENS, fitting.PER_SAMPLE_SIGMA
    fitting.PER_SAMPLE_TOKENS = saved[0] if tokens is None else tokens
    fitting.PER_SAMPLE_SIGMA = saved[1] if sigma is None else sigma
    try:
        yield
    finally:
        fitting.PER_SAMPLE_TOKENS, fitting.PER_SAMPLE_SIGMA = saved


def diagnose(mix, ranks, steps, truth, prior, draws, noise=0.03, seed=0):
    """Per draw of the current warm-up: what the step maxima say. (fitted / true ratio, per sample; the negative
    log-likelihood of the step times (no prior) at the fit and at the truth's shape, each with its best common
    scale and the fit's rank noise; steps whose true slowest rank holds one sample; the heaviest rank holding
    more than one sample over the step's slowest, median)."""
    from scipy.optimize import minimize_scalar

    from hf_dp_balance.core.fit_solvers import column_scale, step_max_likelihood

    rows = []
    for d in range(draws):
        rng = np.random.default_rng([seed, ranks, steps, d])
        probe = Probe(truth)
        feats, times = warmup(rng, "current", probe, mix, ranks, steps, prior, noise)
        result = fit_cost_model(feats, times, mode="step_max", holdout=0, prior=prior)
        model, sigma = result.model, result.report.step_noise
        scale = column_scale(feats)
        x, log_y = feats / scale, np.log(times)

        def nll(coefficients):
            theta = coefficients * scale

            def at(a):
                params = np.concatenate([theta * np.exp(a), [np.log(sigma)]])
                return step_max_likelihood(params, x, log_y, np.zeros((0, 4)), 1.0)[0]

            return float(minimize_scalar(at, bounds=(-3.0, 3.0), method="bounded").fun)

        costs = truth.predict(feats)
        slowest = costs.argmax(axis=1)
        alone = feats[np.arange(steps), slowest, 2] == 1
        several = np.where(feats[..., 2] > 1, costs, 0.0).max(axis=1) / costs.max(axis=1)
        rows.append(((model.quadratic / model.linear) / (truth.quadratic / truth.linear),
                     model.per_sample / truth.per_sample, nll(model.coefficients), nll(truth.coefficients),
                     int(alone.sum()), float(np.median(several))))
    return rows


def main(argv=None) -> int:
    global FILL_SHARE, FILL_STEP, REFIT_FROM, ACTIVE_FROM, ACTIVE_SLOWDOWN, ACTIVE_MIN_GAP, ACTIVE_K, ACTIVE_BOUND, ACTIVE_TOKEN_STEPS, ACTIVE_K_LO, ACTIVE_RULES, ACTIVE_CAP, ACTIVE_BOUND_LO, ACTIVE_BOUND_GRID, ACTIVE_BOUND_PER_SAMPLE, ACTIVE_CAP_RATIO
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", default="bounded images", choices=list(MIXES))
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--truth", default="prior 2x high", choices=list(TRUTHS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--variants", nargs="*", default=["current", "adaptive", "ridge-pick"], choices=VARIANTS)
    parser.add_argument("--unhedged", action="store_true", help="ridge-pick / oracle-pick without the hedge")
    parser.add_argument("--lone-pair", type=int, default=8, help="lone-pair: short samples per step of the cycle")
    parser.add_argument("--per-sample-tokens", type=float, default=None,
                        help="experiment: the shape prior's per-sample guess in tokens (default 8)")
    parser.add_argument("--per-sample-sigma", type=float, default=None,
                        help="experiment: its log-normal sigma (default 1.0)")
    parser.add_argument("--diagnose", action="store_true",
                        help="only: per draw of the current warm-up, the evidence for the fit against the truth")
    parser.add_argument("--fill-share", type=float, default=FILL_SHARE, help="cap-fill: share of receiving ranks")
    parser.add_argument("--fill-step", type=int, default=FILL_STEP, help="cap-fill: the cycle step it replaces")
    parser.add_argument("--refit-from", type=int, default=REFIT_FROM, help="refit: probe steps before the fit plans")
    parser.add_argument("--active-from", type=int, default=ACTIVE_FROM, help="active: probe steps before the fit")
    parser.add_argument("--slowdown", type=float, default=ACTIVE_SLOWDOWN, help="active: the slowdown bound")
    parser.add_argument("--min-gap", type=float, default=ACTIVE_MIN_GAP, help="active: smallest gap kept")
    parser.add_argument("--active-k", type=float, default=ACTIVE_K, help="active: the split's ratio factor")
    parser.add_argument("--active-k-lo", type=float, default=None, help="active: the lower split's factor")
    parser.add_argument("--rules", nargs="*", default=list(ACTIVE_RULES), choices=["heavy", "light", "lone"])
    parser.add_argument("--bound-lo", type=float, nargs="*", default=[], help="active: bound also under fit / b")
    parser.add_argument("--bound-grid", type=float, nargs="*", default=[],
                        help="active: bound also under extrapolate(prior, tokens, f)")
    parser.add_argument("--bound-per-sample", type=float, nargs="*", default=[],
                        help="active: bound also under the fit with its per-sample cost x m")
    parser.add_argument("--cap-ratio", type=float, default=ACTIVE_CAP_RATIO,
                        help="active, diagnostic: the fills' token cap over the mean tokens")
    parser.add_argument("--no-cap", action="store_true", help="active, diagnostic: fills ignore the token cap")
    parser.add_argument("--token-steps", action="store_true", help="active: only on the token-balanced steps")
    parser.add_argument("--active-bound", default=ACTIVE_BOUND, choices=["hull", "no-tokens"])
    args = parser.parse_args(argv)
    ACTIVE_FROM, ACTIVE_SLOWDOWN, ACTIVE_MIN_GAP = args.active_from, args.slowdown, args.min_gap
    ACTIVE_K, ACTIVE_BOUND, ACTIVE_TOKEN_STEPS = args.active_k, args.active_bound, args.token_steps
    ACTIVE_K_LO, ACTIVE_RULES, ACTIVE_CAP = args.active_k_lo, tuple(args.rules), not args.no_cap
    ACTIVE_BOUND_LO, ACTIVE_BOUND_GRID = tuple(args.bound_lo), tuple(args.bound_grid)
    ACTIVE_BOUND_PER_SAMPLE, ACTIVE_CAP_RATIO = tuple(args.bound_per_sample), args.cap_ratio
    FILL_SHARE, FILL_STEP, REFIT_FROM = args.fill_share, args.fill_step, args.refit_from
    start = time.process_time()
    prior = qwen2_7b_prior()
    if args.diagnose:
        print(f"{args.mix}, {args.ranks} ranks, {args.truth}, {args.steps} warm-up steps (current warm-up)")
        print("  draw  ratio  per sample  -loglik fit  truth  (truth - fit)  slowest alone  heaviest multi-sample rank")
        for d, r in enumerate(diagnose(MIXES[args.mix], args.ranks, args.steps, truth_of(prior, TRUTHS[args.truth]),
                                       prior, args.draws)):
            print(f"  {d:4d}  {r[0]:.2f}x  {r[1]:.2f}x  {r[2]:10.2f}  {r[3]:7.2f}  {r[3] - r[2]:+6.2f}  "
                  f"{r[4]:4d}/{args.steps}  {r[5]:.3f}")
        print(f"  {time.process_time() - start:.0f} s CPU")
        return 0
    with per_sample_prior(args.per_sample_tokens, args.per_sample_sigma):
        rows, probes = cell(MIXES[args.mix], args.ranks, args.steps, truth_of(prior, TRUTHS[args.truth]), prior,
                            args.draws, args.variants, lone_pair=args.lone_pair, unhedged=args.unhedged)
    print(f"{args.mix}, {args.ranks} ranks, {args.truth}, {args.steps} warm-up steps, {args.draws} draws")
    for v, r in rows.items():
        a = np.array(r)
        print(f"  {v:14s} share {100 * np.median(a[:, 0]):5.1f}% [min {100 * a[:, 0].min():5.1f}]  single "
              f"{100 * np.median(a[:, 1]):4.1f}%  ratio {np.median(a[:, 2]):.2f}x  per sample {np.median(a[:, 3]):.2f}x"
              f"   shares " + " ".join(f"{100 * s:.0f}" for s in a[:, 0]))
        p = probes.get(v, Probe(None))
        if p.slowdown:
            print(f"  {'':14s} warm-up slowest rank over the reference plan's (true costs): median "
                  f"{np.median(p.slowdown):.3f}, max {max(p.slowdown):.3f}")
        if p.picked:
            print(f"  {'':14s} factors picked: {dict((f, p.picked.count(f)) for f in sorted(set(p.picked)))}")
    print(f"  {time.process_time() - start:.0f} s CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
