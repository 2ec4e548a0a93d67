"""One step's placement from its gathered rows: the planner's, or before the fit the hedged one.

Pure given the gathered rows (every rank calls it with the same rows and gets the same plan);
never raises (a planner failure keeps the start placement and says so: planning never stops training).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core import steps as step_maths
from hf_dp_balance.core.hedge import hedged_plan, probe_plan
from hf_dp_balance.core.steps import slot_loads
from hf_dp_balance.runtime.step_rows import F_COST, F_TOKENS, StepWork, default_plan_fn, validate_plan


def token_cap(tokens: np.ndarray, num_slots: int, config: DPBalanceConfig, largest_slot: int = 0) -> int:
    """`core.steps.token_cap` with the config's `max_tokens` / `max_token_ratio`."""
    return step_maths.token_cap(tokens, num_slots, config.max_tokens, config.max_token_ratio, largest_slot)


def planner_for(world: int, config: DPBalanceConfig, plan_fn: Optional[Callable] = None) -> Callable:
    """The step planner of a run over `world` data-parallel ranks: `plan_fn` when the user gave one, else
    `plan_step`, bounded to fixed partners (`core.partners`) when `config.max_partners` is smaller than the
    world: connections made on first use then stay at most `max_partners` per rank for the whole run."""
    if plan_fn is not None:
        return plan_fn
    if not config.max_partners or world <= config.max_partners + 1:
        return default_plan_fn()
    from functools import partial

    from hf_dp_balance.core.partners import partner_sets, plan_step_with_partners

    partners = partner_sets(world, config.max_partners, ranks_per_node=config.ranks_per_node)
    return partial(plan_step_with_partners, partners=partners)


def plan_work(work: StepWork, balance: bool, speeds: np.ndarray, world: int, config: DPBalanceConfig, sync: str,
              plan_fn: Optional[Callable] = None, hedge: bool = False, probe: bool = False):
    """(dest_rank, dest_micro, applied, reason, failure) from the work's start placement.

    `hedge`: the costs are a FLOP prior's (`BalancedLoader.set_cost_model(prior=True)`, the warm-up before
    the first fit): the placement is `core.hedge.hedged_plan`'s (prior, blend, tokens or kept, whichever
    holds up under both the prior and the tokens; three planner calls), or with `probe` (a step-time fit
    follows) `core.hedge.probe_plan`'s for the step (in turn token-balanced, the plan for a heavier
    attention share, token-balanced with short companions beside the slowest slots' longest samples, the
    prior's plan, each when it holds up as well as the token-balanced one: the fit then sees slowest ranks of
    different shapes; one or two planner calls).
    `failure` is the planner's error message, else None (`agree_plan` then makes every rank fall back together).
    """
    rows, num_micro = work.rows, work.num_micro
    owners, micro, cap = work.start_rank, work.start_micro, work.cap
    if not balance:
        return owners, micro, False, "balancing off (warm-up, disabled or no cost model on some rank)", None
    if world == 1 or rows.shape[0] == 0:
        return owners, micro, False, "nothing to balance", None
    try:
        plan_fn = plan_fn or default_plan_fn()
        tokens = rows[:, F_TOKENS].astype(np.int64)
        if cap is None:
            largest = int(slot_loads(tokens, owners, micro, world, num_micro).max())
            cap = token_cap(tokens, world * num_micro, config, largest)
        spd = None if np.all(speeds == 1.0) else speeds

        def plan(costs):
            return plan_fn(costs, owners, micro, world, num_micro, tokens=tokens, max_tokens=cap, speeds=spd,
                           sync=sync, min_gain=config.min_gain, tolerance=config.move_tolerance)

        def placement(p):
            return validate_plan(p.dest_rank, p.dest_micro_batch, rows.shape[0], world, num_micro)

        if hedge and not probe:
            dest_rank, dest_micro, which, scores = hedged_plan(lambda c: placement(plan(c)), rows[:, F_COST], tokens,
                                                               owners, micro, world, num_micro, sync, spd)
            applied, reason = which != "kept", f"FLOP prior, hedged: {which} plan (worst excess {min(scores):.3f})"
        elif hedge:
            dest_rank, dest_micro, which, score = probe_plan(lambda c: placement(plan(c)), rows[:, F_COST], tokens,
                                                             work.step, world, num_micro, sync, spd)
            applied, reason = True, f"FLOP prior, hedged probe: {which} plan (worst excess {score:.3f})"
        else:
            chosen = plan(rows[:, F_COST])
            dest_rank, dest_micro = placement(chosen)
            applied, reason = bool(getattr(chosen, "applied", True)), str(getattr(chosen, "reason", "planned"))
        applied = applied and bool(np.any(dest_rank != owners) or np.any(dest_micro != micro))
        return dest_rank, dest_micro, applied, reason, None
    except Exception as exc:  # planning never stops training (agree_plan logs it)
        return owners, micro, False, f"planner failed: {exc!r}", f"{type(exc).__name__}: {exc}"


__all__ = ["plan_work", "planner_for", "token_cap"]
