"""`plan_balance` (one micro-batch per rank) and `plan_step` (a whole optimizer step): validate, plan, check
the result exactly, and keep it only when it is required or pays (docs/planner.md)."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.bounds import _lower_bound
from hf_dp_balance.core.planner.pipeline import _balance
from hf_dp_balance.core.planner.results import Plan, StepPlan, _cap_error, _first, _slot_error, _verdict
from hf_dp_balance.core.planner.slots import _plan_step_slots
from hf_dp_balance.core.planner.state import _Infeasible, _State
from hf_dp_balance.core.planner.validation import (_as_index_array, _as_item_values, _check_count,
                                                   _check_fraction, _check_tokens, _per_rank)
from hf_dp_balance.core.steps import SYNC_MODES, slot_sums, step_makespan


def plan_balance(costs, owners, num_ranks, *, tokens=None, max_tokens=None, prior_loads=None,
                 speeds=None, min_gain=0.02, tolerance=0.005) -> Plan:
    """Move few items so that the slowest rank finishes as early as possible.

    Objective: minimise ``max_r (prior_loads[r] + sum of costs on r) / speeds[r]`` under the hard cap ``sum
    of tokens on r <= max_tokens``. Starting from the current placement it stops as soon as the slowest rank
    is within `tolerance` of the lower bound, so it moves few items. Kept only when it cuts the slowest rank
    by at least `min_gain`, or when the current placement breaks the cap (then fixing it is required; a cap
    that cannot be met raises ValueError).

    Cost: O(n) numpy plus Python steps proportional to the items moved; only when that stops above the goal,
    exchanges (one O(n log n) sort each) and partial repacks (docs/planner.md).
    """
    num_ranks = _check_count(num_ranks, "num_ranks")
    c = _as_item_values(costs, "costs", None)
    n = c.shape[0]
    own = _as_index_array(owners, "owners", n, num_ranks, "num_ranks")
    tok, cap = _check_tokens(tokens, max_tokens, n)
    prior = _per_rank(prior_loads, "prior_loads", num_ranks, 0.0, positive=False)
    spd = _per_rank(speeds, "speeds", num_ranks, 1.0, positive=True)
    min_gain, tolerance = _check_fraction(min_gain, "min_gain"), _check_fraction(tolerance, "tolerance")
    loads_before = prior + np.bincount(own, weights=c, minlength=num_ranks)
    mk_before, lb = float(np.max(loads_before / spd)), _lower_bound(c, prior, spd)
    ntok = None if cap is None else np.bincount(own, weights=tok, minlength=num_ranks)
    violated = None if cap is None else _first(ntok > cap)

    def keep(reason: str) -> Plan:
        return Plan(dest=own.copy(), applied=False, reason=reason, loads_before=loads_before,
                    loads_after=loads_before.copy(), lower_bound=lb, makespan_before=mk_before,
                    makespan_after=mk_before, moved=0, path="kept")

    if violated is None and (n == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if n == 0 or mk_before <= 0 else "already at the lower bound")
    state = _State(c, tok, cap, spd, own, np.zeros(n, dtype=np.int64), 1, loads_before, 0, fixed=prior)
    try:
        # a cap repair is applied whatever it gains: its repacks must still pay for their moves
        state = _balance(state, lb * spd, tolerance, repack_gain=0.0 if violated is None else min_gain)
        # the cap checked exactly, not by the running sums
        still = None if cap is None else _first(np.bincount(state.dest, weights=tok, minlength=num_ranks) > cap)
        if still is not None:
            raise _Infeasible(f"rank {still} still over the cap")
    except _Infeasible as exc:
        if violated is None:
            return keep("no feasible plan found; kept in place")
        raise _cap_error(ntok, cap, violated, exc.where) from None
    dest = state.dest
    loads_after = prior + np.bincount(dest, weights=c, minlength=num_ranks)
    made = Plan(dest=dest, applied=True, reason="", loads_before=loads_before, loads_after=loads_after,
                lower_bound=lb, makespan_before=mk_before, makespan_after=float(np.max(loads_after / spd)),
                moved=int(np.count_nonzero(dest != own)), path=state.path)
    required = None if violated is None else f"rank {violated} holds {ntok[violated]:.0f} tokens > cap {cap:.0f}"
    return _verdict(made, keep, required, min_gain)


def plan_step(costs, owners, micro_batches, num_ranks, num_micro_batches, *, tokens=None, max_tokens=None,
              speeds=None, sync="step", min_gain=0.02, tolerance=0.005) -> StepPlan:
    """Assign every item of an optimizer step to a (rank, micro-batch) slot.

    `sync="step"` (DDP: ranks meet once per step) minimises the slowest rank's total over the step: items
    that stay on their rank keep their micro-batch, arriving items go to the rank's slot with the fewest
    tokens. `sync="micro_batch"` (FSDP / ZeRO-3: ranks meet in every micro-batch) minimises the sum over
    micro-batches of the slowest slot, by balancing the R*M slots around a common level (items heavier than
    that level stay alone). `max_tokens` caps every slot. Whenever n >= R*M every slot gets at least one
    item. `moved` counts rank changes only (a new micro-batch on the same rank costs no communication).
    """
    num_ranks = _check_count(num_ranks, "num_ranks")
    num_mb = _check_count(num_micro_batches, "num_micro_batches")
    c = _as_item_values(costs, "costs", None)
    n = c.shape[0]
    own = _as_index_array(owners, "owners", n, num_ranks, "num_ranks")
    mb = _as_index_array(micro_batches, "micro_batches", n, num_mb, "num_micro_batches")
    tok, cap = _check_tokens(tokens, max_tokens, n)
    spd = _per_rank(speeds, "speeds", num_ranks, 1.0, positive=True)
    min_gain, tolerance = _check_fraction(min_gain, "min_gain"), _check_fraction(tolerance, "tolerance")
    if sync not in SYNC_MODES:
        raise ValueError(f"sync={sync!r}: must be one of {SYNC_MODES}")
    slot = own * num_mb + mb  # (once: the step loads and the cap check read it)
    before = slot_sums(c, slot, num_ranks, num_mb)
    mk_before, lb = step_makespan(before, sync, spd), _step_bound(c, spd, sync)

    def keep(reason):
        return StepPlan(dest_rank=own.copy(), dest_micro_batch=mb.copy(), applied=False, reason=reason,
                        loads_before=before, loads_after=before.copy(), lower_bound=lb,
                        makespan_before=mk_before, makespan_after=mk_before, moved=0, path="kept")

    slot_tok, required, bad_slot = _step_violation(slot, tok, cap, num_ranks, num_mb)
    if required is None and (n == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if n == 0 or mk_before <= 0 else "already at the lower bound")
    need_all_slots = n >= num_ranks * num_mb
    try:
        if sync == "step":
            state = _State(c, tok, cap, spd, own, mb, num_mb, before.sum(axis=1), num_mb if need_all_slots else 0,
                           slot_tok=slot_tok)
            # as in plan_balance: a cap repair's repacks must pay for their moves
            over_cap = slot_tok is not None and bool(np.any(slot_tok > cap))
            state = _balance(state, lb * spd, tolerance, repack_gain=min_gain if over_cap else 0.0)
            rank, micro, path = state.dest, state.micro, state.path
        else:
            rank, micro, path = _plan_step_slots(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots)
        slot = rank * num_mb + micro
        still = None if cap is None else _first(np.bincount(slot, weights=tok, minlength=num_ranks * num_mb) > cap)
        if still is not None:
            raise _Infeasible(f"slot {divmod(still, num_mb)} still over the cap")
    except _Infeasible as exc:
        if required is None:
            return keep("no feasible plan found; kept in place")
        raise _slot_error(bad_slot, slot_tok, cap, num_mb, exc.where) from None
    after = slot_sums(c, slot, num_ranks, num_mb)
    made = StepPlan(dest_rank=rank, dest_micro_batch=micro, applied=True, reason="", loads_before=before,
                    loads_after=after, lower_bound=lb, makespan_before=mk_before,
                    makespan_after=step_makespan(after, sync, spd), moved=int(np.count_nonzero(rank != own)),
                    path=path)
    return _verdict(made, keep, required, min_gain)


def _step_bound(c: np.ndarray, spd: np.ndarray, sync: str) -> float:
    """Lower bound of the step objective: the rank bound (sync="step"), or total over the summed speeds and
    the heaviest item on the fastest rank (sync="micro_batch", loose)."""
    if sync == "step":
        return _lower_bound(c, np.zeros(spd.shape[0]), spd)
    return max(float(c.sum()) / float(spd.sum()), float(c.max() / spd.max()) if c.size else 0.0)


def _step_violation(slot: np.ndarray, tok, cap, num_ranks: int, num_mb: int):
    """(tokens per slot or None, why a plan is required or None, the first offending slot): a slot over the
    cap, or, when there are at least R*M items, an empty slot."""
    S = num_ranks * num_mb
    slot_tok = None if cap is None else np.bincount(slot, weights=tok, minlength=S)
    bad = None if cap is None else _first(slot_tok > cap)
    if bad is not None:
        r, m = divmod(bad, num_mb)
        return slot_tok, f"slot (rank {r}, micro-batch {m}) holds {slot_tok[bad]:.0f} tokens > cap {cap:.0f}", bad
    # a slot holding tokens is not empty: count the items per slot only when one holds none
    if slot.size >= S and (slot_tok is None or bool(slot_tok.min() <= 0)):
        bad = _first(np.bincount(slot, minlength=S) == 0)
        if bad is not None:
            return slot_tok, "slot (rank {}, micro-batch {}) is empty".format(*divmod(bad, num_mb)), bad
    return slot_tok, None, None
