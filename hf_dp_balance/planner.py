"""Balancing planner: which sample moves to which data-parallel rank.

Pure numpy, no torch. Every rank runs the same function on the same gathered
metadata and gets the same plan bit for bit (float64, stable sorts, ties broken
by index, no randomness, no set / dict iteration order).

Objective of `plan_balance`: minimise the slowest rank's time
``max_r (prior_loads[r] + sum of costs on r) / speeds[r]`` under the hard cap
``sum of tokens on r <= max_tokens``, starting from the current placement so
that few items move (moving a sample is the overhead that eats the gain).

The method, from the current placement (zero moves):

1. *Target*: the lower bound T (water level of the total load over the
   ranks' speeds, or the heaviest item on its best rank).
2. *Shed*: every rank above ``T * (1 + tolerance / 2)`` gives away a small set
   of items covering its excess: the largest items that fit into the
   remaining excess first, then at most one item that overshoots it (few
   moves, little overshoot, the heaviest items stay where they are).
3. *Place*: the shed items, heaviest first, go to the rank that finishes
   earliest among those with token room (LPT on the residual capacity).
   A receiver without token room may hand back its cheapest-per-token items
   (short samples) to make room; those are placed in turn.
4. *Refine*: while the slowest rank is above ``T * (1 + tolerance)``, the best
   single move or pairwise swap between it and the least-loaded ranks.

The plan is kept only if it beats keeping everything in place by at least
`min_gain` (relative), unless the current placement breaks the token cap, in
which case fixing it is required.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["Plan", "StepPlan", "plan_balance", "plan_step", "lower_bound"]

_SYNC_MODES = ("step", "micro_batch")


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Plan:
    """Destination rank of every item, with the loads that justify it.

    Loads are in cost units (not divided by speed); makespans and the lower
    bound are in time units (load / speed).
    """

    dest: np.ndarray
    applied: bool
    reason: str
    loads_before: np.ndarray
    loads_after: np.ndarray
    lower_bound: float
    makespan_before: float
    makespan_after: float
    moved: int

    @property
    def gain(self) -> float:
        """Relative cut of the slowest rank: 1 - after / before (0 when skipped)."""
        if not self.applied or self.makespan_before <= 0:
            return 0.0
        return 1.0 - self.makespan_after / self.makespan_before


@dataclass(frozen=True)
class StepPlan:
    """Destination (rank, micro-batch) slot of every item of one optimizer step.

    `moved` counts items whose rank changes: moving between micro-batches of one
    rank costs no communication. Makespans follow the sync mode's objective.
    """

    dest_rank: np.ndarray
    dest_micro_batch: np.ndarray
    applied: bool
    reason: str
    loads_before: np.ndarray
    loads_after: np.ndarray
    lower_bound: float
    makespan_before: float
    makespan_after: float
    moved: int

    @property
    def gain(self) -> float:
        if not self.applied or self.makespan_before <= 0:
            return 0.0
        return 1.0 - self.makespan_after / self.makespan_before


# ----------------------------------------------------------------------------- validation


def _as_item_values(values, name: str, n: Optional[int], allow_zero: bool = True) -> np.ndarray:
    """1-D float64 array of finite, non-negative values; errors name the first bad index."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has {arr.shape[0]} entries but costs has {n}")
    bad = ~np.isfinite(arr) | (arr < 0) if allow_zero else ~np.isfinite(arr) | (arr <= 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = "finite and >= 0" if allow_zero else "finite and > 0"
        raise ValueError(f"{name}[{i}]={float(arr[i])!r}: must be {need}")
    return arr


def _as_index_array(values, name: str, n: int, upper: int, upper_name: str) -> np.ndarray:
    """1-D int64 array with every entry in [0, upper); errors name the first bad index."""
    raw = np.asarray(values)
    if raw.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {raw.shape}")
    if raw.shape[0] != n:
        raise ValueError(f"{name} has {raw.shape[0]} entries but costs has {n}")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if raw.dtype.kind not in "iub":
        as_float = raw.astype(np.float64)
        bad = ~np.isfinite(as_float) | (as_float != np.round(as_float))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}[{i}]={raw[i].item()!r}: must be an integer")
    arr = raw.astype(np.int64)
    bad = (arr < 0) | (arr >= upper)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{i}]={int(arr[i])}: out of range for {upper_name}={upper}")
    return arr


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    return int(value)


def _check_fraction(value, name: str) -> float:
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r}: must be in [0, 1)")
    return value


def _per_rank(values, name: str, num_ranks: int, default: float, positive: bool) -> np.ndarray:
    if values is None:
        return np.full(num_ranks, default, dtype=np.float64)
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1 or arr.shape[0] != num_ranks:
        raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got shape {arr.shape}")
    bad = ~np.isfinite(arr) | ((arr <= 0) if positive else (arr < 0))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        need = "finite and > 0" if positive else "finite and >= 0"
        raise ValueError(f"{name}[{r}]={float(arr[r])!r} (rank {r}): must be {need}")
    return arr


def _check_tokens(tokens, max_tokens, n: int):
    """Validated (tokens, cap) pair; cap is None when there is no token limit."""
    tok = None if tokens is None else _as_item_values(tokens, "tokens", n)
    if max_tokens is None:
        return tok, None
    cap = float(max_tokens)
    if not np.isfinite(cap) or cap <= 0:
        raise ValueError(f"max_tokens={max_tokens!r}: must be a positive token count or None")
    if tok is None:
        raise ValueError("max_tokens is given but tokens is None: the cap needs each item's token count")
    over = np.flatnonzero(tok > cap)
    if over.size:
        i = int(over[0])
        raise ValueError(f"tokens[{i}]={float(tok[i])!r} exceeds max_tokens={max_tokens!r} on its own: no placement can hold it")
    return tok, cap


# ----------------------------------------------------------------------------- bounds


def lower_bound(costs, num_ranks: int, *, prior_loads=None, speeds=None) -> float:
    """Makespan (time units) that no placement can beat, ignoring the token cap.

    The larger of: the water level T with ``sum_r max(0, T*s_r - p_r) = total``
    (no rank can finish before the fixed work it already has: ``max_r p_r/s_r``
    is included), and the heaviest item on the rank where it would finish
    first, ``min_r (p_r + c_max) / s_r``. O(n + R log R).
    """
    num_ranks = _check_count(num_ranks, "num_ranks")
    c = _as_item_values(costs, "costs", None)
    prior = _per_rank(prior_loads, "prior_loads", num_ranks, 0.0, positive=False)
    speeds = _per_rank(speeds, "speeds", num_ranks, 1.0, positive=True)
    return _lower_bound(c, prior, speeds)


def _water_level(total: float, prior: np.ndarray, speeds: np.ndarray) -> float:
    """Smallest T with sum_r max(0, T*s_r - p_r) >= total (piecewise linear, increasing)."""
    start = prior / speeds
    order = np.argsort(start, kind="stable")
    a = start[order]
    cum_s = np.cumsum(speeds[order])
    cum_p = np.cumsum(prior[order])
    filled_at = a * cum_s - cum_p  # load that fits below level a[k] on ranks 0..k
    k = int(np.searchsorted(filled_at, total, side="right")) - 1
    return float(max((total + cum_p[k]) / cum_s[k], a[k]))


def _lower_bound(c: np.ndarray, prior: np.ndarray, speeds: np.ndarray) -> float:
    level = _water_level(float(c.sum()), prior, speeds)
    level = max(level, float(np.max(prior / speeds)))
    if c.size:
        level = max(level, float(np.min((prior + c.max()) / speeds)))
    return level


# ----------------------------------------------------------------------------- core


class _State:
    """Mutable working placement of one planning call (local to the call, never shared)."""

    def __init__(self, costs, owners, tokens, caps, prior, speeds, min_count):
        num_ranks = speeds.shape[0]
        self.costs = costs
        self.tokens = tokens
        self.caps = caps  # float64 [R] or None
        self.speeds = speeds
        self.dest = owners.copy()
        self.load = prior + np.bincount(owners, weights=costs, minlength=num_ranks)
        self.ntok = None if tokens is None else np.bincount(owners, weights=tokens, minlength=num_ranks)
        self.count = np.bincount(owners, minlength=num_ranks)
        self.min_count = min_count

    def time(self) -> np.ndarray:
        return self.load / self.speeds

    def move(self, item: int, to: int) -> None:
        frm = int(self.dest[item])
        c = self.costs[item]
        self.load[frm] -= c
        self.load[to] += c
        if self.ntok is not None:
            t = self.tokens[item]
            self.ntok[frm] -= t
            self.ntok[to] += t
        self.count[frm] -= 1
        self.count[to] += 1
        self.dest[item] = to


def _shed(state: _State, owners: np.ndarray, budget: np.ndarray, slack: np.ndarray) -> list:
    """Items to take off every over-budget (or over-cap) rank; their loads are removed from `state`.

    Per rank, items are visited heaviest first and taken when they fit into the
    remaining excess (classic subset-sum greedy: few items, small remainder);
    if more than `slack` remains, the lightest item not yet taken covers it.
    A rank never drops below `state.min_count` items. Ranks over the token cap
    then give up their largest-token items until they fit.
    """
    costs, tokens = state.costs, state.tokens
    over_cost = state.load > budget + slack
    over_tok = (state.ntok > state.caps) if state.caps is not None else np.zeros_like(over_cost)
    over = np.flatnonzero(over_cost | over_tok)
    if over.size == 0:
        return []
    n = costs.shape[0]
    on_over = np.isin(owners, over)
    idx = np.flatnonzero(on_over)
    order = idx[np.lexsort((idx, -costs[idx], owners[idx]))]  # by rank, cost desc, index
    bounds = np.searchsorted(owners[order], over, side="left")
    ends = np.searchsorted(owners[order], over, side="right")
    pool = []
    for r, lo, hi in zip(over.tolist(), bounds.tolist(), ends.tolist()):
        items = order[lo:hi].tolist()
        cs = costs[order[lo:hi]].tolist()
        keep_min = state.min_count
        left = len(items)
        taken = [False] * len(items)
        rem = float(state.load[r] - budget[r])
        lim = float(slack[r])
        if rem > lim:
            for k, c in enumerate(cs):
                if rem <= lim or left <= keep_min:
                    break
                if c <= rem and c > 0:
                    taken[k] = True
                    rem -= c
                    left -= 1
            if rem > lim and left > keep_min:
                for k in range(len(items) - 1, -1, -1):  # lightest untaken item covers the rest
                    if not taken[k] and cs[k] > 0:
                        taken[k] = True
                        rem -= cs[k]
                        left -= 1
                        break
        if state.caps is not None:
            tok_over = float(state.ntok[r] - state.caps[r]) - sum(
                tokens[items[k]] for k in range(len(items)) if taken[k])
            if tok_over > 0:
                by_tokens = sorted((k for k in range(len(items)) if not taken[k]),
                                   key=lambda k: (-tokens[items[k]], items[k]))
                for k in by_tokens:
                    if tok_over <= 0:
                        break
                    taken[k] = True
                    tok_over -= tokens[items[k]]
        for k in range(len(items)):
            if taken[k]:
                pool.append(items[k])
    pool = np.asarray(pool, dtype=np.int64)
    # take the shed items off their ranks (they are re-placed by _place)
    src = state.dest[pool]
    np.subtract.at(state.load, src, costs[pool])
    if state.ntok is not None:
        np.subtract.at(state.ntok, src, tokens[pool])
    np.subtract.at(state.count, src, 1)
    state.dest[pool] = -1
    return pool.tolist()


def _place(state: _State, pool: list, owners: np.ndarray, evict: bool) -> None:
    """Place shed items heaviest first on the earliest-finishing rank with token room.

    A heap of (current time, rank) gives the least-loaded ranks in order; the
    first few with token room are compared by finish time (speeds differ).
    With `evict`, a receiver short of tokens hands back its cheapest-per-token
    items to make room (they re-enter the pool); an item that fits nowhere goes
    back to its owner.
    """
    costs, tokens, speeds = state.costs, state.tokens, state.speeds
    caps = state.caps
    load = state.load
    heap = [(float(t), r) for r, t in enumerate((load / speeds).tolist())]
    heapq.heapify(heap)
    # pool as a heap by (-cost, index): evicted items re-enter in cost order
    work = [(-float(costs[i]), int(i)) for i in pool]
    heapq.heapify(work)
    look = 4
    while work:
        _, i = heapq.heappop(work)
        c = float(costs[i])
        t = float(tokens[i]) if caps is not None else 0.0
        aside = []
        best = -1
        best_finish = np.inf
        fitting = 0
        while heap and fitting < look:
            tr, r = heapq.heappop(heap)
            if tr != float(load[r] / speeds[r]):
                continue  # stale entry
            aside.append((tr, r))
            if caps is None or state.ntok[r] + t <= caps[r]:
                fitting += 1
                finish = (load[r] + c) / speeds[r]
                if finish < best_finish:
                    best_finish, best = finish, r
        for entry in aside:
            heapq.heappush(heap, entry)
        if best < 0:
            best = int(owners[i])
            if caps is not None and state.ntok[best] + t > caps[best]:
                raise _Infeasible(best)
        state.load[best] += c
        if caps is not None:
            state.ntok[best] += t
        state.count[best] += 1
        state.dest[i] = best
        heapq.heappush(heap, (float(load[best] / speeds[best]), best))


class _Infeasible(Exception):
    def __init__(self, rank):
        super().__init__(rank)
        self.rank = rank


def _refine(state: _State, goal: float, max_iters: int, candidates: int = 4) -> None:
    """Best single move or swap between the slowest rank and the least-loaded ranks, until `goal`.

    Each iteration looks at the slowest rank h and the `candidates` fastest ranks
    l, and applies the move (item of h to l) or swap (item a of h with item b of
    l) that minimises max(new time of h, new time of l) while keeping both
    under the token cap. Stops when h is at or under `goal` or nothing helps h.
    """
    costs, tokens, speeds, caps = state.costs, state.tokens, state.speeds, state.caps
    for _ in range(max_iters):
        times = state.load / speeds
        h = int(np.argmax(times))
        th = float(times[h])
        if th <= goal:
            return
        mine = np.flatnonzero(state.dest == h)
        if mine.size == 0:
            return
        can_move = mine.size > state.min_count
        order = np.argsort(times, kind="stable")
        best = None  # (new_max, kind, a, b, l)
        for l in order[:candidates].tolist():
            if l == h:
                continue
            ca = costs[mine]
            # single moves h -> l
            nh = (state.load[h] - ca) / speeds[h]
            nl = (state.load[l] + ca) / speeds[l]
            worst = np.maximum(nh, nl)
            if caps is not None:
                worst = np.where(state.ntok[l] + tokens[mine] <= caps[l], worst, np.inf)
            k = int(np.argmin(worst))
            if can_move and worst[k] < th and (best is None or worst[k] < best[0]):
                best = (float(worst[k]), "move", int(mine[k]), -1, l)
            theirs = np.flatnonzero(state.dest == l)
            if theirs.size == 0:
                continue
            cb = costs[theirs]
            delta = ca[:, None] - cb[None, :]  # load leaving h
            nh = (state.load[h] - delta) / speeds[h]
            nl = (state.load[l] + delta) / speeds[l]
            worst = np.maximum(nh, nl)
            if caps is not None:
                dt = tokens[mine][:, None] - tokens[theirs][None, :]
                ok = (state.ntok[l] + dt <= caps[l]) & (state.ntok[h] - dt <= caps[h])
                worst = np.where(ok, worst, np.inf)
            k = int(np.argmin(worst))
            a, b = divmod(k, theirs.size)
            if worst.flat[k] < th and (best is None or worst.flat[k] < best[0]):
                best = (float(worst.flat[k]), "swap", int(mine[a]), int(theirs[b]), l)
        if best is None:
            return
        _, kind, a, b, l = best
        state.move(a, l)
        if kind == "swap":
            state.move(b, h)


def _balance(costs, owners, tokens, caps, prior, speeds, target, tolerance, min_count=0):
    """Destination of every item: shed, place, refine (module docstring). Raises _Infeasible."""
    state = _State(costs, owners, tokens, caps, prior, speeds, min_count)
    budget = target * speeds
    slack = budget * (tolerance / 2.0)
    pool = _shed(state, owners, budget, slack)
    if pool:
        _place(state, pool, owners, evict=False)
    goal = target * (1.0 + tolerance)
    _refine(state, goal, max_iters=2 * speeds.shape[0] + 16)
    return state.dest


# ----------------------------------------------------------------------------- plan_balance


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def plan_balance(costs, owners, num_ranks, *, tokens=None, max_tokens=None, prior_loads=None,
                 speeds=None, min_gain=0.02, tolerance=0.005) -> Plan:
    """Move few items so that the slowest rank finishes as early as possible.

    Objective: minimise ``max_r (prior_loads[r] + sum of costs on r) / speeds[r]``
    under the hard cap ``sum of tokens on r <= max_tokens``. Among plans within
    `tolerance` of the target it stops at the first found from the current
    placement, so it moves few items. Kept only when it cuts the slowest rank by
    at least `min_gain`, or when the current placement breaks the cap (then fixing
    it is required; a cap that cannot be met raises ValueError).

    Cost: O(n log n) numpy plus Python work proportional to the ranks touched and
    the items moved.
    """
    num_ranks = _check_count(num_ranks, "num_ranks")
    c = _as_item_values(costs, "costs", None)
    n = c.shape[0]
    own = _as_index_array(owners, "owners", n, num_ranks, "num_ranks")
    tok, cap = _check_tokens(tokens, max_tokens, n)
    prior = _per_rank(prior_loads, "prior_loads", num_ranks, 0.0, positive=False)
    spd = _per_rank(speeds, "speeds", num_ranks, 1.0, positive=True)
    min_gain = _check_fraction(min_gain, "min_gain")
    tolerance = _check_fraction(tolerance, "tolerance")
    caps = None if cap is None else np.full(num_ranks, cap)
    return _plan_ranks(c, own, tok, caps, prior, spd, min_gain, tolerance, min_count=0)


def _plan_ranks(c, own, tok, caps, prior, spd, min_gain, tolerance, min_count) -> Plan:
    """plan_balance on validated arrays (caps per rank, or None)."""
    num_ranks = spd.shape[0]
    loads_before = prior + np.bincount(own, weights=c, minlength=num_ranks)
    mk_before = float(np.max(loads_before / spd))
    lb = _lower_bound(c, prior, spd)
    violated = _cap_violation(own, tok, caps)
    short = _count_shortfall(own, num_ranks, min_count)

    def keep(reason: str) -> Plan:
        return Plan(dest=own.copy(), applied=False, reason=reason, loads_before=loads_before,
                    loads_after=loads_before.copy(), lower_bound=lb, makespan_before=mk_before,
                    makespan_after=mk_before, moved=0)

    if violated is None and short is None and (c.size == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if c.size == 0 or mk_before <= 0 else "already at the lower bound")
    try:
        dest = _balance(c, own, tok, caps, prior, spd, lb, tolerance, min_count)
        dest = _fill_short_ranks(c, dest, tok, caps, spd, prior, min_count)
    except _Infeasible as exc:
        if violated is None and short is None:
            return keep("no feasible plan found; kept in place")
        raise _cap_error(own, tok, caps, exc.rank) from None
    loads_after = prior + np.bincount(dest, weights=c, minlength=num_ranks)
    mk_after = float(np.max(loads_after / spd))
    still = _cap_violation(dest, tok, caps)
    if still is not None:
        if violated is None and short is None:
            return keep("no feasible plan found; kept in place")
        raise _cap_error(dest, tok, caps, still)
    moved = int(np.count_nonzero(dest != own))
    made = Plan(dest=dest, applied=True, reason="", loads_before=loads_before, loads_after=loads_after,
                lower_bound=lb, makespan_before=mk_before, makespan_after=mk_after, moved=moved)
    if violated is not None:
        ntok = np.bincount(own, weights=tok, minlength=num_ranks)
        return _with_reason(made, f"required: rank {violated} holds {ntok[violated]:.0f} tokens > cap {caps[violated]:.0f}")
    if short is not None:
        return _with_reason(made, f"required: rank {short} has fewer than {min_count} items")
    if mk_after >= mk_before:
        return keep("no plan beats keeping in place")
    gain = 1.0 - mk_after / mk_before
    if gain < min_gain:
        return keep(f"gain {_pct(gain)} < min_gain {_pct(min_gain)}")
    return _with_reason(made, f"gain {_pct(gain)} >= min_gain {_pct(min_gain)}")


def _with_reason(plan: Plan, reason: str) -> Plan:
    return Plan(**{**plan.__dict__, "reason": reason})


def _cap_violation(dest, tok, caps) -> Optional[int]:
    if caps is None:
        return None
    ntok = np.bincount(dest, weights=tok, minlength=caps.shape[0])
    bad = np.flatnonzero(ntok > caps)
    return int(bad[0]) if bad.size else None


def _count_shortfall(dest, num_ranks, min_count) -> Optional[int]:
    if min_count <= 0:
        return None
    bad = np.flatnonzero(np.bincount(dest, minlength=num_ranks) < min_count)
    return int(bad[0]) if bad.size else None


def _cap_error(dest, tok, caps, rank) -> ValueError:
    ntok = np.bincount(dest, weights=tok, minlength=caps.shape[0])
    return ValueError(
        f"token cap cannot be met: rank {rank} holds {ntok[rank]:.0f} tokens > cap {caps[rank]:.0f} "
        f"(all ranks: {ntok.sum():.0f} tokens, total capacity {caps.sum():.0f})")


def _fill_short_ranks(c, dest, tok, caps, spd, prior, min_count):
    """Give every rank at least `min_count` items: ranks short of items take the cheapest
    item of the rank with the most items (ties: lowest index) that fits their token room."""
    if min_count <= 0:
        return dest
    num_ranks = spd.shape[0]
    count = np.bincount(dest, minlength=num_ranks)
    short = np.flatnonzero(count < min_count)
    if short.size == 0:
        return dest
    dest = dest.copy()
    ntok = None if caps is None else np.bincount(dest, weights=tok, minlength=num_ranks)
    for r in short.tolist():
        while count[r] < min_count:
            donors = np.flatnonzero(count > min_count)
            if donors.size == 0:
                raise _Infeasible(r)
            d = int(donors[np.argmax(count[donors])])
            cand = np.flatnonzero(dest == d)
            if caps is not None:
                cand = cand[ntok[r] + tok[cand] <= caps[r]]
                if cand.size == 0:
                    raise _Infeasible(r)
            i = int(cand[np.lexsort((cand, c[cand]))[0]])
            dest[i] = r
            count[d] -= 1
            count[r] += 1
            if ntok is not None:
                ntok[d] -= tok[i]
                ntok[r] += tok[i]
    return dest


# ----------------------------------------------------------------------------- plan_step


def _slot_loads(c, rank, mb, num_ranks, num_mb) -> np.ndarray:
    return np.bincount(rank * num_mb + mb, weights=c, minlength=num_ranks * num_mb).reshape(num_ranks, num_mb)


def _step_objective(slot_loads: np.ndarray, spd: np.ndarray, sync: str) -> float:
    times = slot_loads / spd[:, None]
    if sync == "step":
        return float(times.sum(axis=1).max()) if times.size else 0.0
    return float(times.max(axis=0).sum()) if times.size else 0.0


def plan_step(costs, owners, micro_batches, num_ranks, num_micro_batches, *, tokens=None, max_tokens=None,
              speeds=None, sync="step", min_gain=0.02, tolerance=0.005) -> StepPlan:
    """Assign every item of an optimizer step to a (rank, micro-batch) slot.

    `sync="step"` (DDP: ranks meet once per step) minimises the slowest rank's
    total over the step; items keep their micro-batch unless the per-slot token
    cap or an empty slot needs a change. `sync="micro_batch"` (FSDP / ZeRO-3:
    ranks meet in every micro-batch) minimises sum over micro-batches of the
    slowest slot, by balancing the R*M slots around a common level.
    `max_tokens` caps every slot. Whenever n >= R*M every slot gets at least one
    item. `moved` counts rank changes only.
    """
    num_ranks = _check_count(num_ranks, "num_ranks")
    num_mb = _check_count(num_micro_batches, "num_micro_batches")
    c = _as_item_values(costs, "costs", None)
    n = c.shape[0]
    own = _as_index_array(owners, "owners", n, num_ranks, "num_ranks")
    mb = _as_index_array(micro_batches, "micro_batches", n, num_mb, "num_micro_batches")
    tok, cap = _check_tokens(tokens, max_tokens, n)
    spd = _per_rank(speeds, "speeds", num_ranks, 1.0, positive=True)
    min_gain = _check_fraction(min_gain, "min_gain")
    tolerance = _check_fraction(tolerance, "tolerance")
    if sync not in _SYNC_MODES:
        raise ValueError(f"sync={sync!r}: must be one of {_SYNC_MODES}")

    need_all_slots = n >= num_ranks * num_mb
    before = _slot_loads(c, own, mb, num_ranks, num_mb)
    mk_before = _step_objective(before, spd, sync)
    zero = np.zeros(num_ranks)
    if sync == "step":
        lb = _lower_bound(c, zero, spd)
    else:
        lb = max(float(c.sum()) / float(spd.sum()), float(c.max() / spd.max()) if n else 0.0)

    def keep(reason):
        return StepPlan(dest_rank=own.copy(), dest_micro_batch=mb.copy(), applied=False, reason=reason,
                        loads_before=before, loads_after=before.copy(), lower_bound=lb,
                        makespan_before=mk_before, makespan_after=mk_before, moved=0)

    slot = own * num_mb + mb
    slot_tok = None if cap is None else np.bincount(slot, weights=tok, minlength=num_ranks * num_mb)
    slot_count = np.bincount(slot, minlength=num_ranks * num_mb)
    bad_cap = None if slot_tok is None else _first(slot_tok > cap)
    bad_empty = _first(slot_count == 0) if need_all_slots else None
    required = bad_cap is not None or bad_empty is not None
    if not required and (n == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if n == 0 or mk_before <= 0 else "already at the lower bound")

    try:
        if sync == "step":
            rank, micro = _plan_step_ranks(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots)
        else:
            rank, micro = _plan_step_slots(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots)
    except _Infeasible as exc:
        if not required:
            return keep("no feasible plan found; kept in place")
        where = bad_cap if bad_cap is not None else bad_empty
        raise _slot_error(where, slot_tok, cap, num_mb, exc) from None

    after = _slot_loads(c, rank, micro, num_ranks, num_mb)
    mk_after = _step_objective(after, spd, sync)
    moved = int(np.count_nonzero(rank != own))
    made = StepPlan(dest_rank=rank, dest_micro_batch=micro, applied=True, reason="", loads_before=before,
                    loads_after=after, lower_bound=lb, makespan_before=mk_before, makespan_after=mk_after,
                    moved=moved)
    if bad_cap is not None:
        r, m = divmod(bad_cap, num_mb)
        return _step_reason(made, f"required: slot (rank {r}, micro-batch {m}) holds {slot_tok[bad_cap]:.0f} tokens > cap {cap:.0f}")
    if bad_empty is not None:
        r, m = divmod(bad_empty, num_mb)
        return _step_reason(made, f"required: slot (rank {r}, micro-batch {m}) is empty")
    if mk_after >= mk_before:
        return keep("no plan beats keeping in place")
    gain = 1.0 - mk_after / mk_before
    if gain < min_gain:
        return keep(f"gain {_pct(gain)} < min_gain {_pct(min_gain)}")
    return _step_reason(made, f"gain {_pct(gain)} >= min_gain {_pct(min_gain)}")


def _first(mask: np.ndarray) -> Optional[int]:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _step_reason(plan: StepPlan, reason: str) -> StepPlan:
    return StepPlan(**{**plan.__dict__, "reason": reason})


def _slot_error(slot_index, slot_tok, cap, num_mb, exc) -> ValueError:
    r, m = divmod(int(slot_index), num_mb)
    held = "" if slot_tok is None else f" holds {slot_tok[slot_index]:.0f} tokens (cap {cap:.0f}, all slots {slot_tok.sum():.0f} tokens)"
    return ValueError(f"cannot make a valid step plan: slot (rank {r}, micro-batch {m}){held}; "
                      f"no placement found that fixes it (failed at {exc.rank})")


def _plan_step_ranks(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots):
    """sync="step": balance rank totals (cap M*max_tokens per rank), then fill each rank's slots.

    If a rank's items cannot be packed into its M slots under the per-slot cap,
    that rank's cap is tightened to M*cap - (M-1)*largest item (then any greedy
    packing fits) and the rank-level plan is redone (at most 3 times).
    """
    num_ranks = spd.shape[0]
    zero = np.zeros(num_ranks)
    lb = _lower_bound(c, zero, spd)
    caps = None if cap is None else np.full(num_ranks, cap * num_mb)
    min_count = num_mb if need_all_slots else 0
    for _ in range(4):
        dest = _balance(c, own, tok, caps, zero, spd, lb, tolerance, min_count)
        dest = _fill_short_ranks(c, dest, tok, caps, spd, zero, min_count)
        micro, failed = _assign_slots(dest, own, mb, tok, cap, num_mb, need_all_slots)
        if failed is None:
            return dest, micro
        tmax = float(tok[dest == failed].max())
        caps[failed] = min(caps[failed], cap * num_mb - (num_mb - 1) * tmax)
    raise _Infeasible(f"rank {failed}")


def _assign_slots(dest, own, mb, tok, cap, num_mb, need_all_slots):
    """Micro-batch of every item on its destination rank.

    Items that stay keep their micro-batch; arriving items (and items evicted
    from a slot over the cap, largest tokens first) go, largest tokens first, to
    the slot with the fewest tokens. An empty slot then takes the lightest item
    of the slot with the most items. Returns (micro, None) or (micro, failing rank).
    """
    micro = mb.copy()
    stays = dest == own
    moved_idx = np.flatnonzero(~stays)
    num_ranks = int(dest.max()) + 1 if dest.size else 0
    slot = dest * num_mb + micro
    nslots = (max(num_ranks, int(own.max()) + 1 if own.size else 0)) * num_mb
    weights = tok if tok is not None else np.ones(dest.shape[0])
    stay_tok = np.bincount(slot[stays], weights=weights[stays], minlength=nslots)
    stay_cnt = np.bincount(slot[stays], minlength=nslots)
    work = np.zeros(max(num_ranks, 1), dtype=bool)
    if moved_idx.size:
        work[np.unique(dest[moved_idx])] = True
    if cap is not None:
        over = stay_tok > cap
        work[np.unique(np.flatnonzero(over) // num_mb)] = True
    if need_all_slots:
        work[np.unique(np.flatnonzero(stay_cnt[: num_ranks * num_mb] == 0) // num_mb)] = True
    ranks = np.flatnonzero(work[:num_ranks])
    if ranks.size == 0:
        return micro, None
    order = np.lexsort((np.arange(dest.shape[0]), dest))
    sorted_dest = dest[order]
    lo = np.searchsorted(sorted_dest, ranks, side="left")
    hi = np.searchsorted(sorted_dest, ranks, side="right")
    limit = np.inf if cap is None else cap
    for r, a, b in zip(ranks.tolist(), lo.tolist(), hi.tolist()):
        items = order[a:b]
        st = stays[items]
        fill = [0.0] * num_mb
        members = [[] for _ in range(num_mb)]
        incoming = items[~st].tolist()
        for i in items[st].tolist():
            members[micro[i]].append(i)
            fill[micro[i]] += float(weights[i])
        if cap is not None:
            for m in range(num_mb):
                if fill[m] > limit:
                    # evict largest-token items until the slot fits
                    for i in sorted(members[m], key=lambda i: (-weights[i], i)):
                        if fill[m] <= limit:
                            break
                        members[m].remove(i)
                        fill[m] -= float(weights[i])
                        incoming.append(i)
        incoming.sort(key=lambda i: (-weights[i], i))
        for i in incoming:
            w = float(weights[i])
            # empty slots first, then the fewest tokens; ties: lowest micro-batch
            m = min(range(num_mb), key=lambda m: (len(members[m]) > 0, fill[m], m))
            if fill[m] + w > limit:
                m = min(range(num_mb), key=lambda m: (fill[m], m))
                if fill[m] + w > limit:
                    return micro, r
            members[m].append(i)
            fill[m] += w
        if need_all_slots:
            for m in range(num_mb):
                if members[m]:
                    continue
                donor = max(range(num_mb), key=lambda d: (len(members[d]), -d))
                if len(members[donor]) < 2:
                    return micro, r
                i = min(members[donor], key=lambda i: (weights[i], i))
                members[donor].remove(i)
                fill[donor] -= float(weights[i])
                members[m].append(i)
                fill[m] += float(weights[i])
        for m in range(num_mb):
            for i in members[m]:
                micro[i] = m
    return micro, None


def _plan_step_slots(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots):
    """sync="micro_batch": balance the R*M slots as ranks of their own (slot speed = rank speed).

    The target level is the water level of the step's load over all slots, with
    items heavier than that level treated as fixed (their slot holds them alone).
    """
    num_ranks = spd.shape[0]
    slot = own * num_mb + mb
    slot_spd = np.repeat(spd, num_mb)
    zero = np.zeros(num_ranks * num_mb)
    caps = None if cap is None else np.full(num_ranks * num_mb, cap)
    target = _water_level(float(c.sum()), zero, slot_spd)
    heavy = c > target * float(slot_spd.max())
    if heavy.any():
        fixed = np.bincount(slot[heavy], weights=c[heavy], minlength=slot_spd.shape[0])
        target = _water_level(float(c[~heavy].sum()), fixed, slot_spd)
    min_count = 1 if need_all_slots else 0
    dest = _balance(c, slot, tok, caps, zero, slot_spd, target, tolerance, min_count)
    dest = _fill_short_ranks(c, dest, tok, caps, slot_spd, zero, min_count)
    if caps is not None and _cap_violation(dest, tok, caps) is not None:
        raise _Infeasible(f"slot {_cap_violation(dest, tok, caps)}")
    return dest // num_mb, dest % num_mb
