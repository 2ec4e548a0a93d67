"""Balancing planner: which sample moves to which data-parallel rank (and micro-batch).

Pure numpy, no torch. Every rank runs the same function on the same gathered metadata and gets the same plan
bit for bit (float64, stable sorts, ties broken by index, no randomness, no set / dict iteration order).
`plan_balance` minimises the slowest rank's time ``max_r (prior_loads[r] + costs on r) / speeds[r]`` under a
hard token cap, moving few items; `plan_step` does it for the (rank, micro-batch) slots of one optimizer step.

The method: from the current placement, move the fewest tokens that bring every rank within the tolerance of
its share of the lower bound. Items leave the over-full ranks and go where they fit best; where the slots are
full, ranks exchange items instead (a large item for small ones of about its tokens), each exchange judged by
the load it sheds per token it sends; only if that ends far from the bound are whole ranks re-placed. The
stages, in order, and when each runs: `pipeline`'s docstring and docs/planner.md.

Package map:
- `api`: `plan_balance`, `plan_step`: validate, plan, check the result exactly, keep it or skip
- `validation`: input checks; errors name the first bad item or rank
- `bounds`: `lower_bound` (the speed-weighted water level and the heaviest item)
- `results`: `Plan`, `StepPlan`, reasons and errors
- `state`: the working placement of one call, the constants every stage shares, the pairing of trade rounds
- `pipeline`: the driver: which stage runs when (its docstring is the pipeline)
- `passes`: the incremental method: shed, place, refine, exchange, item-count fixes
- `shed`: the shed kernel: which items leave over-full ranks (cost) and over-full slots (tokens)
- `place`: the place kernel: best-fit decreasing on the ranks' rooms, and capped LPT (the repack's)
- `refine`: the one-for-one kernels: the best move or swap from the fullest rank, the swaps that bring a rank
  just over the limit under it, and the item-count fixes
- `eject`: the one-for-many exchange of the incremental method (a heavy item for a receiver's shed items)
- `chain`: ladder trades: a large item for a prefix of a slot's cheapest-per-token items
- `trade`: small-change trades: a large item for small change, between paired ranks
- `trade_index`: the sorted indexes and searches the trades read
- `assign`: long items assigned to ranks first at a full cap, short items as the filler
- `home`: sending home the items a detour of trades took away
- `repack`: the repack fallback: ranks re-placed by capped LPT and renamed toward their items' owners
- `slots`: `sync="micro_batch"`: slot levels, and the R*M slots balanced as ranks
"""

from hf_dp_balance.core.planner.api import plan_balance, plan_step
from hf_dp_balance.core.planner.bounds import lower_bound
from hf_dp_balance.core.planner.results import Plan, StepPlan

__all__ = ["Plan", "StepPlan", "plan_balance", "plan_step", "lower_bound"]
