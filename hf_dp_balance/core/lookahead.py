"""Look-ahead for outliers: re-place samples across a window of K upcoming steps.

Within one step no reassignment helps when a single sample outweighs an
average rank: the rank holding it sets the step time, however the rest is
spread. Across steps something can be done. `plan_lookahead` takes the
samples of K consecutive steps and chooses, for every sample, the step in
the same window in which it is trained:

1. *Outliers* (a sample heavier than the window's average rank load, times
   `threshold`) are sorted by cost and grouped, heaviest first, at most one
   per rank and within the step's token budget, into as few steps as possible: several outliers share a step,
   so only those steps are bounded by a single sample, and each group's bound
   is close to the cost of its own members (classic "sort, then chunk"
   minimises the sum of group maxima).
2. *Ordinary samples* then flow between the steps of the window so that the
   steps holding outliers carry more ordinary work (up to `num_ranks` times
   their bound: free, the outlier rank is the slowest anyway) and the other
   steps level out. The target per step is a water-filling over the step
   bounds; a step sheds samples from its end (the latest arrivals first)
   while it is above its target in cost or above the step's token budget,
   and each shed sample goes to the step with the largest cost deficit that
   has the token room.

Guarantees: every sample is assigned exactly one step; it stays in its own
window of K steps, so it moves by at most K-1 steps. The token budget of a
step is the fullest step of the window originally, at most ``slack *
num_ranks * max_tokens``: an ordinary sample is only sent to a step with room
under it, and a step above it (after the outliers gather) sheds ordinary
samples until it is within it, as long as another step has room.
The within-step planner then places the samples on ranks under the hard
per-rank cap.

What it changes about data order: samples are trained up to K-1 steps
earlier or later than the sampler yields them, and outliers (long
documents, long videos) are concentrated into fewer steps. The set of
samples seen over every window of K steps is unchanged.

Cost: O(n log n) for the sort per window plus O(K) per moved sample.
"""

from __future__ import annotations

import numpy as np


def _cost_level_over_bounds(bound_loads: np.ndarray, total: float) -> float:
    """Cost level h per step that the window's `total` fills over the steps' floors: h >= 0 with
    sum_k max(bound_loads[k], h) == total (floors included in `total`); 0 when the floors alone
    exceed it. O(K) over the K steps of a window."""
    b = np.sort(np.asarray(bound_loads, dtype=np.float64))
    above = np.concatenate([np.cumsum(b[::-1])[::-1], [0.0]])  # above[j] = sum(b[j:])
    upper = np.concatenate([b[1:], [np.inf]])
    for j in range(1, b.size + 1):  # j lowest bounds lie under the level
        h = (total - above[j]) / j
        if b[j - 1] <= h <= upper[j - 1]:
            return float(h)
    return 0.0


def plan_lookahead(
    costs,
    tokens,
    steps,
    num_ranks: int,
    *,
    window: int,
    max_tokens: int,
    threshold: float = 1.0,
    slack: float = 0.97,
) -> np.ndarray:
    """New step of every sample, re-placed within aligned windows of `window` steps.

    costs, tokens: per sample (float, int); steps: original step of every sample
    (int, non-decreasing is not required); num_ranks: data-parallel ranks;
    max_tokens: the hard per-rank token cap. Windows are [w*window, (w+1)*window).
    Returns an int64 array of steps, each within the sample's window.
    """
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.int64)
    steps = np.asarray(steps, dtype=np.int64)
    n = costs.size
    if tokens.shape != (n,) or steps.shape != (n,) or costs.ndim != 1:
        raise ValueError(f"plan_lookahead: costs, tokens, steps must be 1-D of one length, got {costs.shape}, {tokens.shape}, {steps.shape}")
    if int(window) < 1:
        raise ValueError(f"plan_lookahead: window={window} must be >= 1")
    if int(num_ranks) < 1:
        raise ValueError(f"plan_lookahead: num_ranks={num_ranks} must be >= 1")
    if max_tokens <= 0:
        raise ValueError(f"plan_lookahead: max_tokens={max_tokens} must be > 0")
    if not 0 < slack <= 1:
        raise ValueError(f"plan_lookahead: slack={slack} must be in (0, 1]")
    bad = np.flatnonzero(~np.isfinite(costs) | (costs < 0))
    if bad.size:
        raise ValueError(f"plan_lookahead: sample {int(bad[0])} has cost {float(costs[bad[0]])} (must be finite, >= 0)")
    bad = np.flatnonzero((tokens < 0) | (tokens > max_tokens))
    if bad.size:
        raise ValueError(f"plan_lookahead: sample {int(bad[0])} has {tokens[bad[0]]} tokens (cap {max_tokens})")
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        raise ValueError(f"plan_lookahead: sample {int(bad[0])} has step {steps[bad[0]]} < 0")
    new_steps = steps.copy()
    if n == 0 or window == 1:
        return new_steps
    window_of = steps // window
    order = np.argsort(window_of, kind="stable")
    bounds = np.flatnonzero(np.diff(window_of[order])) + 1
    for members in np.split(order, bounds):
        w = int(window_of[members[0]])
        new_steps[members] = w * window + _plan_window(
            costs[members], tokens[members], steps[members] - w * window, int(num_ranks), int(window),
            int(max_tokens), float(threshold), float(slack),
        )
    return new_steps


def _plan_window(costs, tokens, local_step, num_ranks, window, max_tokens, threshold, slack) -> np.ndarray:
    """Steps 0..window-1 for the samples of one window (see `plan_lookahead`)."""
    n_steps = int(local_step.max()) + 1  # the last window of a stream may be short
    step = local_step.copy()
    avg_rank = costs.sum() / (n_steps * num_ranks)
    is_outlier = costs > threshold * avg_rank
    out_idx = np.flatnonzero(is_outlier)
    if out_idx.size == 0:
        return step

    # 1. Outliers: heaviest first, in groups of at most num_ranks, one group per step.
    #    Group g goes to the step that already holds most of its members (fewest moves).
    orig_tokens = np.bincount(local_step, weights=tokens, minlength=n_steps)
    token_budget = min(float(orig_tokens.max()), slack * num_ranks * max_tokens)
    out_sorted = out_idx[np.argsort(-costs[out_idx], kind="stable")]
    groups = _chunk(out_sorted, tokens, num_ranks, token_budget)
    if len(groups) <= n_steps:
        free = np.ones(n_steps, dtype=bool)
        for g in groups:
            held = np.bincount(step[g], minlength=n_steps).astype(np.float64)
            held[~free] = -1.0
            target = int(np.argmax(held))
            step[g] = target
            free[target] = False
    # (More groups than steps: outliers are the bulk of the work; leave them where they are.)

    # 2. Ordinary samples level the steps: targets from water-filling over the step bounds.
    bound = np.zeros(n_steps)
    np.maximum.at(bound, step[out_idx], costs[out_idx])
    level = _cost_level_over_bounds(bound * num_ranks, float(costs.sum()))
    target_cost = np.maximum(bound * num_ranks, level)
    load = np.bincount(step, weights=costs, minlength=n_steps)
    held_tokens = np.bincount(step, weights=tokens, minlength=n_steps)

    ordinary = np.flatnonzero(~is_outlier)
    for k in range(n_steps):
        excess_cost = load[k] - target_cost[k]
        excess_tokens = held_tokens[k] - token_budget
        if excess_cost <= 0 and excess_tokens <= 0:
            continue
        # Shed from the end of the step: the latest arrivals move first. When only tokens are
        # in excess, shed the cheapest per token first, so the step keeps its work.
        mine = ordinary[step[ordinary] == k]
        if excess_cost <= 0:
            mine = mine[np.argsort(costs[mine] / np.maximum(tokens[mine], 1), kind="stable")]
        else:
            mine = mine[::-1]
        for i in mine.tolist():
            if load[k] <= target_cost[k] and held_tokens[k] <= token_budget:
                break
            room = (held_tokens + tokens[i] <= token_budget)
            room[k] = False
            if not room.any():
                continue
            deficit = np.where(room, target_cost - load, -np.inf)
            j = int(np.argmax(deficit))
            if deficit[j] <= 0 and held_tokens[k] <= token_budget:
                break  # every step is at its target: moving would only shift the excess
            step[i] = j
            load[k] -= costs[i]
            load[j] += costs[i]
            held_tokens[k] -= tokens[i]
            held_tokens[j] += tokens[i]
    return step


def _chunk(order: np.ndarray, tokens: np.ndarray, max_count: int, max_tokens: float) -> list:
    """Split `order` into consecutive groups of at most `max_count` items and `max_tokens` tokens
    (an item alone over `max_tokens` forms its own group)."""
    groups, start, held = [], 0, 0.0
    for pos, i in enumerate(order.tolist()):
        if pos > start and (pos - start >= max_count or held + tokens[i] > max_tokens):
            groups.append(order[start:pos])
            start, held = pos, 0.0
        held += float(tokens[i])
    groups.append(order[start:])
    return groups


def assign_slots(tokens, old_steps, new_steps, old_slots, num_slots: int, max_tokens: int) -> np.ndarray:
    """Slot (rank, or rank x micro-batch) of every sample after the look-ahead.

    A sample that stays in its step keeps its slot. Samples that enter a step
    are dealt, longest first, to the slot with the most free tokens of that
    step (worst-fit decreasing). When even that slot has no room (a long
    outlier needs most of a slot), the slot's shortest residents (samples that
    stayed) are evicted into the queue until it fits, and dealt in turn; a dealt
    sample is never evicted, so every sample is dealt at most once. So a step starts
    within the per-slot cap whenever this greedy finds a way; the within-step
    planner then balances the cost. In a real run the slot is the rank whose
    loader hands the sample over. Cost: O(m log m + m log S) for m dealt
    samples and S slots.
    """
    import heapq

    tokens = np.asarray(tokens, dtype=np.int64)
    old_steps = np.asarray(old_steps, dtype=np.int64)
    new_steps = np.asarray(new_steps, dtype=np.int64)
    slots = np.asarray(old_slots, dtype=np.int64).copy()
    if not (tokens.shape == old_steps.shape == new_steps.shape == slots.shape):
        raise ValueError("assign_slots: tokens, old_steps, new_steps, old_slots must have one shape")
    if slots.size and (slots.min() < 0 or slots.max() >= num_slots):
        bad = int(np.flatnonzero((slots < 0) | (slots >= num_slots))[0])
        raise ValueError(f"assign_slots: sample {bad} has slot {slots[bad]} outside 0..{num_slots - 1}")
    moved = np.flatnonzero(old_steps != new_steps)
    tok = tokens.tolist()
    for k in np.unique(new_steps[moved]).tolist():
        stay = np.flatnonzero((new_steps == k) & (old_steps == k))
        held = np.bincount(slots[stay], weights=tokens[stay], minlength=num_slots)
        free = max_tokens - held
        evictable = held.copy()  # tokens of residents that may still be evicted
        # Residents of each slot, longest first, so that pop() evicts the shortest.
        residents = [[] for _ in range(num_slots)]
        for i in stay[np.lexsort((stay, -tokens[stay]))].tolist():
            residents[slots[i]].append(i)
        incoming = moved[new_steps[moved] == k]
        queue = [(-tok[i], i) for i in incoming.tolist()]
        heapq.heapify(queue)
        while queue:
            _, i = heapq.heappop(queue)
            sl = int(np.argmax(free))
            if free[sl] < tok[i]:
                # No slot has room: take the roomiest slot that has room once its residents go.
                fits = free + evictable >= tok[i]
                if fits.any():
                    sl = int(np.argmax(np.where(fits, free, -np.inf)))
            while free[sl] < tok[i] and residents[sl]:
                j = residents[sl].pop()
                free[sl] += tok[j]
                evictable[sl] -= tok[j]
                heapq.heappush(queue, (-tok[j], j))
            slots[i] = sl  # dealt samples are never evicted again: the loop ends
            free[sl] -= tok[i]
    return slots
