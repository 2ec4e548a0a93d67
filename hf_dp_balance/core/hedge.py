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
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from hf_dp_balance.core.steps import slot_loads, step_imbalance


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


__all__ = ["CANDIDATES", "blend", "hedged_choice", "hedged_plan", "worst_excess"]
