"""plan_step's slot planning for sync="micro_batch": the R*M slots balanced as ranks of their own."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner.bounds import _fill_time
from hf_dp_balance.core.planner.pipeline import _balance
from hf_dp_balance.core.planner.state import _State


def _plan_step_slots(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots):
    """Balance the R*M slots as ranks of their own, toward one level per micro-batch.

    1. Each rank sorts its micro-batches by load, heaviest first (free: nothing leaves the rank). For the given
       slot contents this minimises the sum over micro-batches of the slowest slot, and it gathers the heavy
       samples of all ranks in the first micro-batches.
    2. Items above the flat water level are heavy: micro-batch m cannot finish before F_m = max_r (heavy load
       of slot (r, m)) / s_r. Its level is T_m = max(F_m, W), W the common level at which the slots hold the
       light load: a micro-batch that waits for a heavy item anyway is filled up to it, the others get less.
    3. Shed / place / refine the slots toward budgets T_m * s_r."""
    R, S = spd.shape[0], spd.shape[0] * num_mb
    load = np.bincount(own * num_mb + mb, weights=c, minlength=S).reshape(R, num_mb)
    perm = np.argsort(-load, axis=1, kind="stable")  # perm[r, k]: old micro-batch that becomes k
    slot = own * num_mb + np.argsort(perm, axis=1)[own, mb]  # (the inverse permutation: new micro-batch of old)
    slot_spd = np.repeat(spd, num_mb)
    level = _fill_time(float(c.sum()), np.zeros(S), slot_spd)
    heavy = c > level * float(slot_spd.min())
    fixed = np.bincount(slot[heavy], weights=c[heavy], minlength=S).reshape(R, num_mb)
    floor = (fixed / spd[:, None]).max(axis=0)  # [M]
    light = float(c[~heavy].sum())
    token_limit = np.inf
    if cap is not None:
        # a slot holds at most `cap` tokens: light load it can take ~ its token room x light cost per token
        heavy_tok = np.bincount(slot[heavy], weights=tok[heavy], minlength=S).reshape(R, num_mb)
        light_tok = float(tok[~heavy].sum())
        token_limit = np.maximum(cap - heavy_tok, 0.0) * (light / light_tok if light_tok > 0 else 0.0)
    lo, hi = 0.0, max(level, float(floor.max())) * 2.0 + 1.0
    for _ in range(60):  # bisection on the common level W (the light load the slots take rises with W)
        mid = 0.5 * (lo + hi)
        took = np.minimum(np.maximum(np.maximum(floor, mid)[None, :] * spd[:, None] - fixed, 0.0), token_limit)
        lo, hi = (lo, mid) if float(took.sum()) >= light else (mid, hi)
    budget = (np.maximum(floor, hi)[None, :] * spd[:, None]).reshape(-1)
    slot_load = np.take_along_axis(load, perm, axis=1).reshape(-1)  # the slots in their new order
    state = _State(c, tok, cap, slot_spd, slot, np.zeros(c.shape[0], dtype=np.int64), 1, slot_load,
                   int(need_all_slots))
    # heavy samples are placed by the levels above (their micro-batch waits for them anyway): no relocation
    state = _balance(state, budget, tolerance, relocate=False, deep=False)
    return state.dest // num_mb, state.dest % num_mb, state.path
