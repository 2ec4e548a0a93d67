"""Placement before any timing: of a few candidate plans, the one that holds up under every cost hypothesis.

Before the first fit the loader prices samples with the FLOP prior, whose shape (attention against dense work,
vision against text) can be off on the machine at hand: on a CPU, or for a small model, per-token work weighs
more than its FLOPs. A plan that is perfect for the prior can then put a rank above what fixed-length packing
(equal tokens per rank) would give. `hedged_choice` scores each candidate placement by its worst slowest-rank
excess over the mean across the hypotheses (the prior's costs, the tokens) and keeps the lowest.

Guarantee: for every per-sample cost that is a non-negative combination of the hypotheses, the chosen
placement's makespan over the ideal is at most 1 + its score (that ratio is quasi-convex along any mix of
the hypotheses, so its largest value is at a hypothesis itself), and its score is at most every other
candidate's: the token-balanced plan, the loader's stand-in for fixed-length packing, among them.
Cost: O(hypotheses x candidates x samples).

Warm-up steps before a step-time fit (FSDP / ZeRO-3: `fit_mode="step_max"`) are placed by `probe_plan`
instead; per-rank fits see every rank's time and keep `hedged_plan`. The step-time fit only sees the slowest rank, and a plan
balanced under the prior makes that rank's work look alike on every step (or a long indivisible sample
pins it), which leaves the attention term to the prior. The steps cycle through plans for three shapes of
cost (`PROBE_CYCLE`): the tokens (the slowest rank is then the one with the most attention work at equal
tokens), `PROBE_FACTOR` times the prior's excess cost per token over the tokens (`extrapolate`), and the
prior; under the true cost the slowest rank has a different composition in each. From MIN_COMPANION_SLOTS
slots the cycle's second token step (`COMPANION_POSITION`) trades the slowest slots' companions for short
samples (`short_companions`): beside the same long sample, many samples in one step and few in another, so the
step maxima tell per-sample work apart from attention (in fixed-length packs a rank of many samples is
otherwise a rank of short ones; bench/cost_fit_runtime.py, docs/benchmarks/cost_fit.md). Guarantee: every warm-up
placement's worst excess over `probe_hypotheses` (the tokens, the prior, the extrapolated costs) is at most
the token-balanced plan's, so for every cost in that wider hull (attention from none up to PROBE_FACTOR
times the prior's share over the tokens) it is no worse than fixed-length packing's stand-in. Measured:
bench/cost_fit_plans.py (docs/benchmarks/cost_fit.md, warm-up steps placed to inform the fit).
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from hf_dp_balance.core.steps import slot_loads, slot_sums, step_imbalance


def blend(hypotheses: np.ndarray) -> np.ndarray:
    """[n] costs that weigh every hypothesis [H, n] alike: each row scaled to sum 1, then summed."""
    h = np.asarray(hypotheses, dtype=np.float64)
    totals = h.sum(axis=1, keepdims=True)
    return (h / np.where(totals > 0, totals, 1.0)).sum(axis=0)


def worst_excess(hypotheses: np.ndarray, dest_rank: np.ndarray, dest_micro: np.ndarray, num_ranks: int,
                 num_micro: int, sync: str = "step", speeds: Optional[np.ndarray] = None) -> float:
    """max over hypotheses [H, n] of `step_imbalance` of the placement (slowest rank over the mean, minus 1)."""
    return max(step_imbalance(slot_loads(h, dest_rank, dest_micro, num_ranks, num_micro), sync, speeds)
               for h in np.asarray(hypotheses, dtype=np.float64))


def hedged_choice(hypotheses: np.ndarray, candidates: Sequence[Tuple[np.ndarray, np.ndarray]], num_ranks: int,
                  num_micro: int, sync: str = "step", speeds: Optional[np.ndarray] = None) -> Tuple[int, list]:
    """(index of the candidate (dest_rank, dest_micro) with the lowest `worst_excess`, every score).

    Ties go to the earlier candidate: list the preferred plan (the prior's) first.
    """
    if not len(candidates):
        raise ValueError("hedged_choice: no candidate placement")
    scores = [worst_excess(hypotheses, r, m, num_ranks, num_micro, sync, speeds) for r, m in candidates]
    return int(np.argmin(scores)), scores


CANDIDATES = ("prior", "blend", "tokens", "kept")


def hedged_plan(plan_costs: Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]], prior_costs: np.ndarray,
                tokens: np.ndarray, owners: np.ndarray, micro: np.ndarray, num_ranks: int, num_micro: int,
                sync: str = "step", speeds: Optional[np.ndarray] = None):
    """(dest_rank, dest_micro, which, scores): the placement of `CANDIDATES` that `hedged_choice` keeps.

    `plan_costs(costs)` plans the step for one cost vector (the planner under the loader's cap); it runs
    for the prior's costs, for their `blend` with the tokens, and for the tokens; the start placement
    (`owners`, `micro`) is the fourth candidate. `which` names the kept one. Three planner calls.
    """
    hypotheses = np.stack([np.asarray(prior_costs, dtype=np.float64), np.asarray(tokens, dtype=np.float64)])
    candidates = [plan_costs(c) for c in (hypotheses[0], blend(hypotheses), hypotheses[1])] + [(owners, micro)]
    best, scores = hedged_choice(hypotheses, candidates, num_ranks, num_micro, sync, speeds)
    return candidates[best][0], candidates[best][1], CANDIDATES[best], scores


# The probe's heavy hypothesis: the prior's excess cost per token over the tokens, times this (3 covers a
# prior 2x low with room; the tokens bound the other side).
PROBE_FACTOR = 3.0
# Warm-up step s is planned for `extrapolate(prior, tokens, PROBE_CYCLE[s % 4])`: 0 the tokens, 1 the prior.
# Measured (bench/cost_fit_plans.py, 32 / 128 ranks, prior 2x off, 12 steps, 5 draws): tokens / heavy
# alternating left 3 of 12 cells under 94% of the cut; with the prior's plan every fourth step, 1.
PROBE_CYCLE = (0.0, PROBE_FACTOR, 0.0, 1.0)
# The cycle position whose token-balanced plan has its slowest slots' companions traded for short samples
# (`short_companions`), so the step maxima alternate between few and many samples beside the longest one.
COMPANION_POSITION = 2
# ... from this many slots: with fewer, the token plan's slowest slot already differs in composition from step to
# step, and the swap cost the 12-step study (bench/cost_fit.py --plans) points of the cut at 8 and 32 ranks.
MIN_COMPANION_SLOTS = 64


def extrapolate(prior_costs: np.ndarray, tokens: np.ndarray, factor: float) -> np.ndarray:
    """[n] costs t + factor * (p - t), p and t the prior's costs and the tokens each scaled to sum 1: factor 0
    is the tokens, 1 the prior, > 1 a cost whose non-linear part (attention, vision) weighs `factor` times the
    prior's against the tokens. Floored at 1e-3 of the tokens' share (short samples never cost nothing)."""
    p = np.asarray(prior_costs, dtype=np.float64)
    t = np.asarray(tokens, dtype=np.float64)
    p = p / p.sum() if p.sum() > 0 else p
    t = t / t.sum() if t.sum() > 0 else t
    return np.maximum(t + factor * (p - t), 1e-3 * t)


def probe_hypotheses(prior_costs: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """[3, n]: the prior's costs, the tokens, and the prior extrapolated by PROBE_FACTOR."""
    prior = np.asarray(prior_costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    return np.stack([prior, tokens, extrapolate(prior, tokens, PROBE_FACTOR)])


PROBES = ("tokens", "prior", "extrapolated", "companions")

# Slots (the highest under the prior, at least one) whose companions `short_companions` trades for short samples.
RECEIVER_SHARE = 1.0 / 16
# ... each of them only where its longest sample carries at least this share of its load under the heavy hypothesis.
PINNED_SHARE = 0.5
# A companion stays where it is when none of the this many lightest donors can take it (bounded work: 0.1 s at
# 1,024 slots of ~40 samples, measured).
DONOR_TRIES = 32


def short_companions(dest_rank: np.ndarray, dest_micro: np.ndarray, prior_costs: np.ndarray, tokens: np.ndarray,
                     num_ranks: int, num_micro: int, heavy_costs: np.ndarray,
                     receiver_share: float = RECEIVER_SHARE) -> Tuple[np.ndarray, np.ndarray]:
    """(dest_rank, dest_micro): the placement with the slowest slots' companions traded for short samples.

    The receivers are the `receiver_share` of the slots with the highest load under `prior_costs` whose longest
    sample carries at least `PINNED_SHARE` of their load under `heavy_costs`. Each keeps its longest sample;
    each of its other samples (a companion, longest first) is swapped with the shortest samples of one other
    slot, as many as fit in the companion's tokens (at least two): of the `DONOR_TRIES` non-receiver slots with
    the lowest load under `heavy_costs`, the lightest that stays within the placement's largest slot in tokens
    after the swap (none: the companion stays). Every sample stays placed exactly once; no receiver gains
    tokens and no slot passes the placement's largest (a plan within the loader's cap stays within it). Why:
    in fixed-length packs the slowest rank of a warm-up step is pinned by its longest sample and its companions
    are whatever fills the pack; with many short companions in some steps and few long ones in others, the
    step maxima tell the per-sample cost apart from attention (a rank of many samples is otherwise a rank of
    short ones). Cost: O(samples log samples) plus O(companions x DONOR_TRIES)."""
    rank = np.asarray(dest_rank, dtype=np.int64)
    micro = np.asarray(dest_micro, dtype=np.int64)
    tokens = np.asarray(tokens, dtype=np.float64)
    heavy = np.asarray(heavy_costs, dtype=np.float64)
    slots = num_ranks * num_micro
    slot = rank * num_micro + micro
    prior_load = slot_sums(prior_costs, slot, num_ranks, num_micro).ravel()
    heavy_load = slot_sums(heavy, slot, num_ranks, num_micro).ravel()
    token_load = slot_sums(tokens, slot, num_ranks, num_micro).ravel()
    ceiling = float(token_load.max())
    n_receivers = min(max(1, int(round(receiver_share * slots))), slots - 1)
    receivers = np.argsort(-prior_load, kind="stable")[:n_receivers]
    is_receiver = np.zeros(slots, dtype=bool)
    is_receiver[receivers] = True
    by_slot = np.lexsort((tokens, slot))  # by slot, shortest first within one
    bounds = np.concatenate([[0], np.cumsum(np.bincount(slot, minlength=slots))])
    members = [by_slot[bounds[d]:bounds[d + 1]].tolist() for d in range(slots)]
    lightest = [(float(heavy_load[d]), int(d)) for d in np.flatnonzero(~is_receiver)]  # donors by heavy load
    heapq.heapify(lightest)
    for r in receivers:
        own = members[int(r)]
        if len(own) < 2 or heavy[own[-1]] < PINNED_SHARE * heavy_load[r]:
            continue  # not pinned by its longest sample: its companions carry the attention the step shows
        for m in own[-2::-1]:  # its companions, longest first (own is shortest first; the last one stays)
            best, passed = None, []
            while lightest and best is None and len(passed) < DONOR_TRIES:  # the lightest donor that can take m
                load, d = heapq.heappop(lightest)
                if load != heavy_load[d]:
                    continue  # a stale entry: the donor's current load is queued too
                passed.append((load, d))
                shorts, room = [], tokens[m]
                for i in members[d]:
                    if tokens[i] > room:
                        break
                    shorts.append(i)
                    room -= tokens[i]
                if len(shorts) >= 2:
                    given = tokens[shorts].sum()
                    if token_load[d] + tokens[m] - given <= ceiling:
                        best = d, shorts, given
            for entry in passed:
                heapq.heappush(lightest, entry)
            if best is None:
                continue
            d, shorts, moved_tokens = best
            moved_heavy = heavy[shorts].sum()
            slot[shorts], slot[m] = r, d
            token_load[r] += moved_tokens - tokens[m]
            token_load[d] += tokens[m] - moved_tokens
            heavy_load[r] += moved_heavy - heavy[m]
            heavy_load[d] += heavy[m] - moved_heavy
            gone = set(shorts)
            members[d] = sorted([i for i in members[d] if i not in gone] + [m], key=lambda i: tokens[i])
            heapq.heappush(lightest, (float(heavy_load[d]), d))
    return slot // num_micro, slot % num_micro


def probe_plan(plan_costs: Callable[[np.ndarray], Tuple[np.ndarray, np.ndarray]], prior_costs: np.ndarray,
               tokens: np.ndarray, step: int, num_ranks: int, num_micro: int, sync: str = "step",
               speeds: Optional[np.ndarray] = None):
    """(dest_rank, dest_micro, which, score): warm-up step `step`'s placement (see the module's docstring).

    The step's factor in `PROBE_CYCLE`: 0, the token-balanced plan (at `COMPANION_POSITION`, from
    `MIN_COMPANION_SLOTS` slots, with `short_companions`); else the plan for `extrapolate(..., factor)`; a probe
    is kept when its `worst_excess` over `probe_hypotheses` is at most the token-balanced plan's, else that plan. `which` names the kept one
    (`PROBES`: factor 0, 1, other, companions), `score` its worst excess. One planner call for the tokens, one
    more for another factor.
    """
    hypotheses = probe_hypotheses(prior_costs, tokens)
    token_plan = plan_costs(hypotheses[1])
    token_score = worst_excess(hypotheses, *token_plan, num_ranks, num_micro, sync, speeds)
    position = step % len(PROBE_CYCLE)
    factor = float(PROBE_CYCLE[position])
    if factor == 0.0:
        if position == COMPANION_POSITION and num_ranks * num_micro >= MIN_COMPANION_SLOTS:
            probe = short_companions(*token_plan, prior_costs, tokens, num_ranks, num_micro, hypotheses[2])
            score = worst_excess(hypotheses, *probe, num_ranks, num_micro, sync, speeds)
            if score <= token_score:
                return probe[0], probe[1], PROBES[3], score
        return token_plan[0], token_plan[1], PROBES[0], token_score
    probe = plan_costs(extrapolate(prior_costs, tokens, factor))
    score = worst_excess(hypotheses, *probe, num_ranks, num_micro, sync, speeds)
    if score <= token_score:
        return probe[0], probe[1], PROBES[1 if factor == 1.0 else 2], score
    return token_plan[0], token_plan[1], PROBES[0], token_score


__all__ = ["CANDIDATES", "COMPANION_POSITION", "DONOR_TRIES", "MIN_COMPANION_SLOTS", "PINNED_SHARE", "PROBES",
           "PROBE_CYCLE", "PROBE_FACTOR", "RECEIVER_SHARE", "blend", "extrapolate", "hedged_choice", "hedged_plan",
           "probe_hypotheses", "probe_plan", "short_companions", "worst_excess"]
