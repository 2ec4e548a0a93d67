"""Balancing planner: which sample moves to which data-parallel rank (and micro-batch).

Pure numpy, no torch. Every rank runs the same function on the same gathered
metadata and gets the same plan bit for bit (float64, stable sorts, ties broken
by index, no randomness, no set / dict iteration order). `plan_balance`
minimises the slowest rank's time ``max_r (prior_loads[r] + costs on r) / speeds[r]``
under a hard token cap, moving few items; `plan_step` does it for the
(rank, micro-batch) slots of one optimizer step. The method, its cost and its
guarantees: docs/planner.md.

Modules: validation (inputs), bounds (lower bounds), state (the working
placement), shed / place / refine / eject (the greedy moves), passes (the
incremental method), repack (the fallback), slots (sync="micro_batch"),
results (`Plan`, `StepPlan`), api (`plan_balance`, `plan_step`).
"""

from hf_dp_balance.core.planner.api import plan_balance, plan_step
from hf_dp_balance.core.planner.bounds import lower_bound
from hf_dp_balance.core.planner.results import Plan, StepPlan

__all__ = ["Plan", "StepPlan", "plan_balance", "plan_step", "lower_bound"]
