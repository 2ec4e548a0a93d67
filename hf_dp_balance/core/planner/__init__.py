"""Balancing planner: which sample moves to which data-parallel rank.

Pure numpy, no torch. Every rank runs the same function on the same gathered
metadata and gets the same plan bit for bit (float64, stable sorts, ties broken
by index, no randomness, no set / dict iteration order).

Objective of `plan_balance`: minimise the slowest rank's time
``max_r (prior_loads[r] + sum of costs on r) / speeds[r]`` under the hard cap
``sum of tokens on r <= max_tokens``, starting from the current placement so
that few items move (moving a sample is the overhead that eats the gain).

The method, from the current placement (zero moves), toward per-rank budgets
(lower bound x speed; per-micro-batch levels for ``sync="micro_batch"``):

1. *Shed* (vectorised rounds): every rank above ``budget * (1 + tolerance/2)``
   gives away, per round, the lightest item that covers its remaining excess
   on its own, else its heaviest item (few moves, little overshoot). Items
   heavier than the largest free room anywhere stay, except a long sample over
   its own slow rank's budget that a faster rank can hold (relocated; the plan
   without relocation is made too and the better one kept).
2. *Place* (best-fit decreasing): heaviest first onto the rank with the
   smallest room that holds it and whose emptiest slot holds its tokens, else
   the roomiest rank with token room. A second shed/place pass if needed.
3. *Refine*: while a rank is above ``budget * (1 + tolerance)``, the best
   single move or 1-for-1 swap between the fullest rank that can still be
   helped and the two emptiest ranks (a rank nothing helps is skipped).
4. *Exchange* (one-for-many), while the fullest rank is above the goal: a heavy
   item of it that fits no other rank's room moves to the rank that makes room
   by shedding the fewest of its own items (those fitting rooms elsewhere);
   they are placed by best fit, then refine again. Kept only if the fullest
   rank drops.
5. *Repack fallback*, only if still above the goal: the over-full ranks and
   the K emptiest give up all their items, which go back by capped LPT onto
   those ranks only; the ranks are renamed by a maximum-weight matching
   (scipy ``linear_sum_assignment``) so most items stay with their owner; then
   steps 3-4. K doubles until the goal is met or every rank is in (a
   from-scratch LPT). Among all attempts: the lowest fullest rank, and among
   those within ``tolerance`` of it, the fewest moves.

Cost: O(n) numpy passes plus Python steps proportional to the moved items
(refinement adds one sort of the destinations; each exchange one O(n log n)
sort; a repack O(pooled items x log K) plus the matching). ``sync="micro_batch"``
runs steps 1-3 only (its per-micro-batch levels are loose, so 4-5 rarely pay).

The plan is kept only if it beats keeping everything in place by at least
`min_gain` (relative), unless the current placement breaks the token cap, in
which case fixing it is required.
"""

from __future__ import annotations

import copy
from bisect import bisect_left
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["Plan", "StepPlan", "plan_balance", "plan_step", "lower_bound"]

_SYNC_MODES = ("step", "micro_batch")
_SCAN = 16  # best-fit positions tried before a full search for token room
_EXTRA_PASSES = 2  # shed / place passes after the first, before the (slower) pairwise refinement


# ----------------------------------------------------------------------------- results


class _GainMixin:
    """`gain` of a plan result: the relative cut of the slowest rank, 1 - after / before (0 when skipped)."""

    @property
    def gain(self) -> float:
        if not self.applied or self.makespan_before <= 0:
            return 0.0
        return 1.0 - self.makespan_after / self.makespan_before


@dataclass(frozen=True)
class Plan(_GainMixin):
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


@dataclass(frozen=True)
class StepPlan(_GainMixin):
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
        raise ValueError(f"tokens[{i}]={float(tok[i])!r} exceeds max_tokens={cap!r} on its own: no placement can hold it")
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


class _Infeasible(Exception):
    """No placement found that meets the token cap / item counts; `where` says where it failed."""

    def __init__(self, where):
        super().__init__(where)
        self.where = where


class _State:
    """Working placement of one planning call (local to the call, never shared).

    R ranks with M slots each (micro-batches; M = 1 for plan_balance). Cost is
    balanced per rank, tokens are capped per slot. Tokens per slot are tracked
    under a cap, and with M > 1 (to spread arriving items over the slots; items
    count 1 each when no tokens are given). Items per rank are tracked only when
    ranks need a minimum count.
    """

    def __init__(self, costs, tokens, cap, speeds, dest, micro, num_slots, load, min_count, fixed=None):
        R = speeds.shape[0]
        self.fixed = np.zeros(R) if fixed is None else fixed  # load that cannot move (prior_loads)
        self.costs = costs
        self.cap = cap  # tokens per slot, or None
        self.speeds = speeds
        self.M = num_slots
        self.dest = dest.copy()
        self.prev = dest.copy()  # rank an item was last taken from (its way back)
        self.micro = micro.copy()
        self.load = load.copy()  # prior + costs per rank
        track = cap is not None or num_slots > 1
        self.tokens = tokens if tokens is not None else (np.ones(costs.shape[0]) if track else None)
        self.slot_tok = (np.bincount(dest * num_slots + micro, weights=self.tokens, minlength=R * num_slots)
                         .reshape(R, num_slots) if track else None)
        self.count = None if min_count <= 0 else np.bincount(dest, minlength=R)
        self.min_count = min_count

    def move(self, item: int, to: int, slot: int) -> None:
        frm, m = int(self.dest[item]), int(self.micro[item])
        c = self.costs[item]
        self.load[frm] -= c
        self.load[to] += c
        if self.slot_tok is not None:
            t = self.tokens[item]
            self.slot_tok[frm, m] -= t
            self.slot_tok[to, slot] += t
        if self.count is not None:
            self.count[frm] -= 1
            self.count[to] += 1
        self.dest[item] = to
        self.micro[item] = slot


def _remove(state: _State, items: np.ndarray) -> None:
    """Take items off their ranks (dest becomes -1 until placed)."""
    src = state.dest[items]
    R = state.load.shape[0]
    state.load -= np.bincount(src, weights=state.costs[items], minlength=R)
    if state.slot_tok is not None:
        flat = state.slot_tok.reshape(-1)
        flat -= np.bincount(src * state.M + state.micro[items], weights=state.tokens[items], minlength=flat.size)
    if state.count is not None:
        state.count -= np.bincount(src, minlength=R)
    state.prev[items] = src
    state.dest[items] = -1


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """Start offsets of the runs of equal values in a sorted array."""
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))


def _shed_rounds(state: _State, budget: np.ndarray, slack: np.ndarray, max_rounds: int = 64,
                 relocate: bool = True) -> np.ndarray:
    """Items to take off every over-budget rank, chosen in vectorised rounds; removed from `state`.

    Each round takes at most one item per rank that is still above budget + slack:
    the lightest item that covers the remaining excess on its own (one move,
    little overshoot), or, if none does, the heaviest item (fewest moves toward
    it). With `relocate`, an item over its own rank's budget on its own (a long
    sample on a slow rank) leaves first, if some rank's budget can hold it.
    Items heavier than the largest free room anywhere (budget - load of the
    emptiest rank) are never taken: no rank could receive them without becoming
    the new slowest. A rank keeps at least `state.min_count` items.
    Cost: O(items on over ranks) numpy per round.
    """
    costs, owners = state.costs, state.dest
    excess = state.load - budget
    room = float(np.max(-excess))
    over = excess > slack
    if not over.any():
        return np.zeros(0, dtype=np.int64)
    sel = np.flatnonzero(over[owners])
    so = owners[sel]
    if so.size > 1 and np.any(so[1:] < so[:-1]):
        order = np.argsort(so, kind="stable")  # items grouped by owner, index order inside
        sel, so = sel[order], so[order]
    sc = costs[sel]
    movable = (sc > 0) & (sc <= room)
    taken_all = []
    starts = _group_starts(so)
    ranks = so[starts]
    rem = excess[ranks]
    lim = slack[ranks]
    left = state.count[ranks] - state.min_count if state.count is not None else np.full(ranks.size, sel.size)
    # an item over its own rank's budget on its own, that fits the budget of some other rank
    # (e.g. a long sample on a slow rank), leaves first whatever the free room says
    misplaced = (sc > budget[so] + slack[so]) & (sc <= float(budget.max()))
    if relocate and misplaced.any():
        hit = np.flatnonzero(misplaced)
        g = np.searchsorted(starts, hit, side="right") - 1
        first = np.concatenate(([True], g[1:] != g[:-1]))  # one per rank (the lowest index)
        hit, g = hit[first], g[first]
        hit, g = hit[left[g] > 0], g[left[g] > 0]
        taken_all.append(sel[hit])
        movable[hit] = False
        rem[g] -= sc[hit]
        left[g] -= 1
    for _ in range(max_rounds):
        active = (rem > lim) & (left > 0)
        if not active.all():
            # keep only the ranks still over budget (smaller arrays for the next rounds)
            keep_items = np.repeat(active, np.diff(np.append(starts, sel.size)))
            sel, so, sc, movable = sel[keep_items], so[keep_items], sc[keep_items], movable[keep_items]
            rem, lim, left, ranks = rem[active], lim[active], left[active], ranks[active]
            if sel.size == 0:
                break
            starts = _group_starts(so)
        group = np.repeat(np.arange(starts.size), np.diff(np.append(starts, sel.size)))
        need = (rem - lim)[group]
        min_cover = np.minimum.reduceat(np.where(movable & (sc >= need), sc, np.inf), starts)
        max_free = np.maximum.reduceat(np.where(movable, sc, -np.inf), starts)
        pick = np.where(np.isfinite(min_cover), min_cover, max_free)
        ok = np.isfinite(pick)
        if not ok.any():
            break
        hit = np.flatnonzero(movable & (sc == pick[group]) & ok[group])
        g = group[hit]
        first = np.concatenate(([True], g[1:] != g[:-1]))  # lowest index wins ties
        hit, g = hit[first], g[first]
        taken_all.append(sel[hit])
        movable[hit] = False
        rem[g] -= sc[hit]
        left[g] -= 1
        left[~ok] = 0  # nothing movable left on these ranks
    if not taken_all:
        return np.zeros(0, dtype=np.int64)
    pool = np.sort(np.concatenate(taken_all))
    _remove(state, pool)
    return pool


def _shed_tokens(state: _State) -> np.ndarray:
    """Items to take off every slot over the token cap (most tokens first); removed from `state`.

    Only needed when the current placement already breaks the cap. Python over
    the items of the offending slots.
    """
    if state.cap is None:
        return np.zeros(0, dtype=np.int64)
    over = np.flatnonzero(state.slot_tok.reshape(-1) > state.cap)
    if over.size == 0:
        return np.zeros(0, dtype=np.int64)
    slot_of = state.dest * state.M + state.micro
    pool = []
    for s in over.tolist():
        items = np.flatnonzero(slot_of == s)
        items = items[np.lexsort((items, -state.tokens[items]))].tolist()
        excess = float(state.slot_tok.reshape(-1)[s]) - state.cap
        r = s // state.M
        left = int(state.count[r]) - state.min_count if state.count is not None else len(items)
        for i in items:
            if excess <= 0:
                break
            if left <= 0:
                raise _Infeasible(f"slot (rank {r}, micro-batch {s % state.M}) cannot shed tokens and keep "
                                  f"{state.min_count} items")
            pool.append(i)
            excess -= float(state.tokens[i])
            left -= 1
    pool = np.asarray(pool, dtype=np.int64)
    _remove(state, pool)
    return pool


def _place_best_fit(state: _State, pool: np.ndarray, limit: np.ndarray, lpt_host: bool = False) -> None:
    """Place pooled items by best-fit decreasing on the ranks' rooms (limit - load).

    Heaviest item first (ties: most tokens), onto the rank with the smallest
    room that still holds it and whose emptiest slot holds its tokens; an item
    that fits no room goes to the roomiest rank with token room (as LPT would), or,
    with `lpt_host` (long samples and unequal speeds), to the rank where it
    finishes first counting only fixed load and long samples sent there.
    On its rank an item goes to the slot with the fewest tokens. No rank with
    token room at all -> _Infeasible. Rooms are kept in a sorted Python list
    (bisect): O(log R) search plus an O(R) memmove per item.
    """
    costs, tokens, cap = state.costs, state.tokens, state.cap
    if tokens is None:
        pool = pool[np.argsort(-costs[pool], kind="stable")]
    else:
        pool = pool[np.lexsort((pool, -tokens[pool], -costs[pool]))]
    room = limit - state.load
    claimed = state.fixed.copy()  # per rank: fixed load + long samples sent there by this call
    order = np.argsort(room, kind="stable")
    rooms = room[order].tolist()  # ascending
    ranks = order.tolist()
    item_cost = costs[pool].tolist()
    dest = [0] * len(item_cost)
    slots = [0] * len(item_cost)
    last = len(rooms) - 1
    tracked = state.slot_tok is not None
    single = tracked and cap is not None and state.M == 1  # plan_balance: one slot per rank
    if tracked:
        item_tok = tokens[pool].tolist()
        if single:
            free = (cap - state.slot_tok[:, 0]).tolist()
        else:
            slot_tok = state.slot_tok.tolist()
            if cap is not None:
                free = [cap - min(row) for row in slot_tok]
    mirror, room_of, dirty = None, None, set()
    for k, c in enumerate(item_cost):
        j = bisect_left(rooms, c)
        if j > last and not lpt_host:
            j = last  # fits no room: the roomiest rank (LPT)
        t = item_tok[k] if cap is not None else 0.0
        found = j <= last and (cap is None or free[ranks[j]] >= t)  # the common case
        if not found and j <= last:
            # the best fit lacks token room: try a few larger rooms (or, from the roomiest, smaller ones)
            nearby = _scan_token_room(free, ranks, j, t, downward=j == last and rooms[j] < c)
            if nearby is not None:
                j, found = nearby, True
        if not found:
            # no rank near the best fit has token room, or a long sample needs an LPT host: numpy, O(R)
            if mirror is None:  # numpy copies of rooms / token room, kept in sync lazily
                mirror = [np.empty(len(rooms)), None if cap is None else np.asarray(free, dtype=np.float64)]
                mirror[0][ranks] = rooms
                room_of = mirror[0].tolist()
            elif dirty:
                idx = list(dirty)
                mirror[0][idx] = [room_of[x] for x in idx]
                if cap is not None:
                    mirror[1][idx] = [free[x] for x in idx]
                dirty.clear()
            room_arr = mirror[0]
            ok = None
            if cap is not None:
                ok = mirror[1] >= t
                if not ok.any():
                    home = int(state.prev[pool[k]])
                    if free[home] < t:
                        raise _Infeasible(f"item {int(pool[k])} ({t:.0f} tokens) fits on no rank")
                    ok[home] = True  # back where it came from (its tokens left that rank)
            holds = room_arr >= c if ok is None else ok & (room_arr >= c)
            if holds.any():  # the smallest room that holds it
                r0 = int(np.argmin(np.where(holds, room_arr, np.inf)))
            else:
                if lpt_host:
                    r0 = _no_room_host(limit, room_arr, claimed, ok, c)
                else:  # the roomiest rank with token room
                    r0 = int(np.argmax(room_arr if ok is None else np.where(ok, room_arr, -np.inf)))
                claimed[r0] += c
            j = _position(rooms, ranks, float(room_arr[r0]), r0)
        r = ranks.pop(j)
        left = rooms.pop(j) - c
        j = bisect_left(rooms, left)
        rooms.insert(j, left)
        ranks.insert(j, r)
        dest[k] = r
        if mirror is not None:
            room_of[r] = left
            dirty.add(r)
        if single:
            free[r] -= item_tok[k]
        elif tracked:
            row = slot_tok[r]
            m = row.index(min(row))
            row[m] += item_tok[k]
            slots[k] = m
            if cap is not None:
                free[r] = cap - min(row)
    dest_arr = np.asarray(dest, dtype=np.int64)
    R = state.load.shape[0]
    state.load += np.bincount(dest_arr, weights=costs[pool], minlength=R)
    if single:
        state.slot_tok[:, 0] = cap - np.asarray(free)
    elif tracked:
        state.slot_tok[:] = slot_tok
        state.micro[pool] = slots
    if state.count is not None:
        state.count += np.bincount(dest_arr, minlength=R)
    state.dest[pool] = dest_arr


def _scan_token_room(free: list, ranks: list, j: int, t: float, downward: bool):
    """The next position from j (up: larger rooms; or down from the roomiest) whose rank has
    `t` tokens of room, within _SCAN steps; None if none."""
    step = -1 if downward else 1
    for _ in range(_SCAN):
        j += step
        if j < 0 or j >= len(ranks):
            return None
        if free[ranks[j]] >= t:
            return j
    return None


def _no_room_host(limit: np.ndarray, room: np.ndarray, claimed: np.ndarray, ok, cost: float) -> int:
    """Rank for an item that fits no room (a long sample): where it would finish first if the
    rank kept only its fixed load and the long samples already sent there (`claimed`) — the
    next shedding pass moves the rest away. Ties: least load, then lowest index."""
    finish = (claimed + cost) / np.maximum(limit, np.finfo(np.float64).tiny)
    if ok is not None:
        finish = np.where(ok, finish, np.inf)
    best = np.flatnonzero(finish == finish.min())
    return int(best[np.argmax(room[best])])


def _position(rooms: list, ranks: list, room: float, rank: int) -> int:
    """Index of `rank` in the sorted room list."""
    j = bisect_left(rooms, room)
    while ranks[j] != rank:
        j += 1
    return j


class _Members:
    """Items of each rank, built once (stable sort of dest) and patched on every move."""

    def __init__(self, dest: np.ndarray, num_ranks: int):
        self.order = np.argsort(dest, kind="stable")
        self.bounds = np.searchsorted(dest[self.order], np.arange(num_ranks + 1))
        self.cache = {}

    def of(self, r: int) -> np.ndarray:
        got = self.cache.get(r)
        if got is None:
            got = self.order[self.bounds[r]:self.bounds[r + 1]]
            self.cache[r] = got
        return got

    def moved(self, item: int, frm: int, to: int) -> None:
        src = self.of(frm)
        self.cache[frm] = src[src != item]
        dst = self.of(to)
        self.cache[to] = np.sort(np.append(dst, item))  # index order keeps ties deterministic


def _refine(state: _State, budget: np.ndarray, goal: float, max_iters: int, candidates: int = 2) -> None:
    """Best single move or swap between the fullest rank and the emptiest ranks, until `goal`.

    Fullness is load / budget. Each iteration takes the fullest rank h and the
    `candidates` emptiest ranks and applies, over all of them at once, the move
    (an item of h to a candidate's emptiest slot) or swap (an item of h with an
    item of a candidate, each taking the other's slot) that minimises the larger
    fullness of the two ranks within the token cap. A rank nothing helps is skipped
    (the next fullest goes on: the exchanges of `_polish` need the others within
    reach of their budgets); stops when the fullest rank not skipped is at or
    under `goal`. O(items of h x items of the candidates) per iteration.
    """
    costs, tokens, cap = state.costs, state.tokens, state.cap
    budget = np.maximum(budget, np.finfo(np.float64).tiny)  # a zero budget: any load is "very full"
    members = None
    stuck = np.zeros(budget.shape[0], dtype=bool)  # ranks nothing helped (skipped, the next fullest goes on)
    for _ in range(max_iters):
        full = state.load / budget
        h = int(np.argmax(np.where(stuck, -np.inf, full)))
        fh = float(full[h])
        if fh <= goal or stuck[h]:
            return
        if members is None:
            members = _Members(state.dest, budget.shape[0])
        mine = members.of(h)
        if mine.size == 0:
            stuck[h] = True
            continue
        pick = full.copy()
        pick[h] = np.inf
        cand = []
        for _ in range(min(candidates, pick.size - 1)):  # the emptiest ranks, lowest index on ties
            l = int(np.argmin(pick))
            cand.append(l)
            pick[l] = np.inf
        cand = np.asarray(cand, dtype=np.int64)
        if cand.size == 0:
            return
        ca = costs[mine]
        left_h = state.load[h] - ca  # [a]
        best_move = np.inf
        if state.count is None or mine.size > state.min_count:
            worst = np.maximum((left_h / budget[h])[:, None],
                               (state.load[cand][None, :] + ca[:, None]) / budget[cand][None, :])  # [a, l]
            if state.slot_tok is not None:
                to_slot = np.argmin(state.slot_tok[cand], axis=1)
                if cap is not None:
                    room = cap - state.slot_tok[cand, to_slot]
                    worst = np.where(tokens[mine][:, None] <= room[None, :], worst, np.inf)
            k_move = int(np.argmin(worst))
            best_move = float(worst.flat[k_move])
        groups = [members.of(int(l)) for l in cand]
        theirs = np.concatenate(groups)
        best_swap = np.inf
        if theirs.size:
            col_rank = np.repeat(cand, [g.size for g in groups])
            delta = ca[:, None] - costs[theirs][None, :]  # load leaving h
            worst_s = np.maximum((state.load[h] - delta) / budget[h],
                                 (state.load[col_rank][None, :] + delta) / budget[col_rank][None, :])
            if cap is not None:
                ta, tb = tokens[mine][:, None], tokens[theirs][None, :]
                into_l = state.slot_tok[col_rank, state.micro[theirs]][None, :] - tb + ta
                into_h = state.slot_tok[h, state.micro[mine]][:, None] - ta + tb
                worst_s = np.where((into_l <= cap) & (into_h <= cap), worst_s, np.inf)
            k_swap = int(np.argmin(worst_s))
            best_swap = float(worst_s.flat[k_swap])
        if not min(best_move, best_swap) < fh:
            stuck[h] = True
            continue
        if best_move <= best_swap:
            a, j = divmod(k_move, cand.size)
            l = int(cand[j])
            slot = int(to_slot[j]) if state.slot_tok is not None else 0
            state.move(int(mine[a]), l, slot)
            members.moved(int(mine[a]), h, l)
        else:
            a, j = divmod(k_swap, theirs.size)
            item_a, item_b, l = int(mine[a]), int(theirs[j]), int(col_rank[j])
            slot_a, slot_b = int(state.micro[item_a]), int(state.micro[item_b])
            state.move(item_b, h, slot_a)
            state.move(item_a, l, slot_b)
            members.moved(item_b, l, h)
            members.moved(item_a, h, l)


def _fill_short_ranks(state: _State) -> None:
    """Give every rank at least `min_count` items: a short rank takes the cheapest item (ties:
    lowest index) of the rank with the most items that fits its emptiest slot."""
    if state.count is None:
        return
    short = np.flatnonzero(state.count < state.min_count)
    for r in short.tolist():
        while state.count[r] < state.min_count:
            donors = np.flatnonzero(state.count > state.min_count)
            if donors.size == 0:
                raise _Infeasible(f"rank {r} has {state.count[r]} items, no rank can spare one")
            d = int(donors[np.argmax(state.count[donors])])
            cand = np.flatnonzero(state.dest == d)
            slot = int(np.argmin(state.slot_tok[r])) if state.slot_tok is not None else 0
            if state.cap is not None:
                cand = cand[state.slot_tok[r, slot] + state.tokens[cand] <= state.cap]
                if cand.size == 0:
                    raise _Infeasible(f"rank {r} has {state.count[r]} items and no token room for another")
            i = int(cand[np.lexsort((cand, state.costs[cand]))[0]])
            state.move(i, r, slot)


def _fill_empty_slots(state: _State) -> None:
    """On every rank with at least M items, give each empty slot one item: the fewest-token
    item (ties: lowest index) of the rank's slot with the most items. Stays on the rank."""
    R, M = state.load.shape[0], state.M
    if M == 1:
        return
    slot_of = state.dest * M + state.micro
    cnt = np.bincount(slot_of, minlength=R * M).reshape(R, M)
    todo = np.flatnonzero((cnt == 0).any(axis=1) & (cnt.sum(axis=1) >= M))
    for r in todo.tolist():
        row = cnt[r]
        for m in np.flatnonzero(row == 0).tolist():
            donor = int(np.argmax(row))  # >= 2 items there: M items, an empty slot
            items = np.flatnonzero(slot_of == r * M + donor)
            i = int(items[np.lexsort((items, state.tokens[items]))[0]])
            state.move(i, r, m)
            slot_of[i] = r * M + m
            row[donor] -= 1
            row[m] += 1


_REPACK_START = 8  # emptiest ranks joined to the over-full ones in the first partial repack


def _balance(state: _State, budget: np.ndarray, tolerance: float, relocate: bool = True,
             deep: bool = True) -> _State:
    """The incremental method, then, only if it stops above the goal, repacks that move more.

    A repack pools every item of a set of ranks (those still above the goal and the
    K emptiest), places them again by capped LPT on those ranks only, renames those
    ranks so that most items stay with their owner, and polishes (refine, exchanges).
    K = 2 x (over-full ranks) + 8, doubled until the plan is within the goal or the set
    is every rank (a from-scratch LPT). The kept plan has the lowest fullest rank;
    among plans within `tolerance` of it, the fewest moves (earlier attempts win ties).
    Raises _Infeasible only when no attempt finds a feasible plan.
    """
    if not deep:  # sync="micro_batch": its per-micro-batch levels are loose; exchanges / repacks seldom pay
        return _balance_incremental(state, budget, tolerance, relocate, deep=False)
    goal = 1.0 + tolerance
    R = budget.shape[0]
    start = state.dest.copy()
    origin = _copy_state(state)
    tried = []
    try:
        tried.append(_balance_incremental(state, budget, tolerance, relocate))
    except _Infeasible:
        pass
    if tried and _fullest(tried[0], budget) <= goal:
        return tried[0]
    base = tried[0] if tried else origin
    safe = np.maximum(budget, np.finfo(np.float64).tiny)
    full = base.load / safe
    over = int(np.count_nonzero(full > goal))
    k = 2 * over + _REPACK_START
    failure = None
    while True:
        k = min(k, R)
        # the over-full ranks and then the emptiest ones (ties: lowest index)
        ranks = np.sort(np.lexsort((np.arange(R), -full))[:over].tolist() +
                        [r for r in np.lexsort((np.arange(R), full)).tolist()
                         if full[r] <= goal][:max(k - over, 0)])
        try:
            tried.append(_repack(_copy_state(base if k < R else origin), budget, tolerance, ranks, start))
        except _Infeasible as exc:
            failure = exc
        if (len(tried) and _fullest(tried[-1], budget) <= goal) or k >= R:
            break
        k *= 2
    if not tried:
        raise failure
    best = min(_fullest(st, budget) for st in tried)
    near = [st for st in tried if _fullest(st, budget) <= best * (1.0 + tolerance)]
    return min(near, key=lambda st: int(np.count_nonzero(st.dest != start)))  # first wins ties


def _repack(state: _State, budget: np.ndarray, tolerance: float, ranks: np.ndarray,
            start: np.ndarray) -> _State:
    """Re-place every item of `ranks` by capped LPT onto `ranks` (heaviest first to the least
    full, load / budget, whose emptiest slot has token room), rename those ranks toward the
    items' owners in `start`, then shed / place, refine and exchange as the incremental
    method. Cost: O(n) numpy + O(pooled items x log |ranks|) Python + the matching."""
    inside = np.zeros(budget.shape[0], dtype=bool)
    inside[ranks] = True
    pool = np.flatnonzero(inside[state.dest])
    if pool.size:
        _remove(state, pool)
        _place_lpt(state, pool, budget, ranks)
        _relabel(state, budget, ranks, pool, start)
    slack = budget * (tolerance / 2.0)
    limit = budget * (1.0 + tolerance / 2.0)
    _extra_passes(state, budget, slack, limit)
    return _polish(state, budget, slack, tolerance)


def _relabel(state: _State, budget: np.ndarray, ranks: np.ndarray, pool: np.ndarray, start: np.ndarray) -> None:
    """Rename `ranks` (whose items are `pool`, freshly placed) so that most items go back to
    their owner in `start`: a maximum-weight matching (scipy linear_sum_assignment) of the
    new contents to the ranks, weight = items already owned by the rank. Only when those
    ranks have the same budget and no fixed load (then a renaming changes no time).
    O(pool + K^3) for K ranks (fast in practice)."""
    K = ranks.shape[0]
    if K < 2 or np.any(budget[ranks] != budget[ranks[0]]) or np.any(state.fixed[ranks] != 0):
        return
    from scipy.optimize import linear_sum_assignment

    local = np.full(budget.shape[0], -1, dtype=np.int64)
    local[ranks] = np.arange(K)
    owner = local[start[pool]]
    mine = owner >= 0
    kept = np.bincount(local[state.dest[pool[mine]]] * K + owner[mine], minlength=K * K).reshape(K, K)
    rows, cols = linear_sum_assignment(kept, maximize=True)  # new contents `rows` -> rank `cols`
    to = np.arange(budget.shape[0])
    to[ranks[rows]] = ranks[cols]
    state.dest[pool] = to[state.dest[pool]]
    src = ranks[rows]
    dst = ranks[cols]
    load = state.load.copy()
    state.load[dst] = load[src]
    if state.slot_tok is not None:
        slot_tok = state.slot_tok.copy()
        state.slot_tok[dst] = slot_tok[src]
    if state.count is not None:
        count = state.count.copy()
        state.count[dst] = count[src]


def _place_lpt(state: _State, pool: np.ndarray, budget: np.ndarray, ranks: np.ndarray) -> None:
    """Heaviest first (ties: lowest index) onto the least full rank (load / budget) whose
    emptiest slot holds the item's tokens; a heap of ranks, O(log R) per item plus the ranks
    skipped for token room. No rank with room -> _Infeasible."""
    import heapq

    costs, cap = state.costs, state.cap
    pool = pool[np.lexsort((pool, -costs[pool]))]
    safe = np.maximum(budget, np.finfo(np.float64).tiny)
    R = state.load.shape[0]
    inv = (1.0 / safe).tolist()
    load = state.load.tolist()
    heap = [(load[r] * inv[r], r) for r in ranks.tolist()]
    heapq.heapify(heap)
    tracked = state.slot_tok is not None
    slot_tok = state.slot_tok.tolist() if tracked else None
    tok = state.tokens[pool].tolist() if tracked else None
    dest, slots = [0] * pool.size, [0] * pool.size
    for k, c in enumerate(costs[pool].tolist()):
        aside = []
        chosen = None
        while heap:
            entry = heapq.heappop(heap)
            r = entry[1]
            if cap is None or min(slot_tok[r]) + tok[k] <= cap:
                chosen = r
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(heap, entry)
        if chosen is None:
            raise _Infeasible(f"item {int(pool[k])} fits on no rank")
        load[chosen] += c
        heapq.heappush(heap, (load[chosen] * inv[chosen], chosen))
        dest[k] = chosen
        if tracked:
            row = slot_tok[chosen]
            m = row.index(min(row))
            row[m] += tok[k]
            slots[k] = m
    dest_arr = np.asarray(dest, dtype=np.int64)
    state.load += np.bincount(dest_arr, weights=costs[pool], minlength=R)
    if tracked:
        state.slot_tok[:] = slot_tok
        state.micro[pool] = slots
    if state.count is not None:
        state.count += np.bincount(dest_arr, minlength=R)
    state.dest[pool] = dest_arr


def _balance_incremental(state: _State, budget: np.ndarray, tolerance: float, relocate: bool = True,
                         deep: bool = True) -> _State:
    """Shed, place, refine (module docstring) toward per-rank `budget` loads, then the
    item-count fixes; returns the final state. Raises _Infeasible.

    When some item is over its own rank's budget on its own (speeds or fixed loads
    differ), relocating it to a faster rank is tried and so is leaving it; the
    plan with the lower fullest rank wins (ties: fewer moves).
    """
    slack = budget * (tolerance / 2.0)
    heaviest = float(state.costs.max()) if state.costs.size else 0.0
    misplaced = relocate and heaviest > float((budget + slack).min()) and bool(
        np.any(state.costs > (budget + slack)[state.dest]))
    if not misplaced:
        return _balance_once(state, budget, slack, tolerance, relocate=False, deep=deep)
    start = state.dest.copy()
    other = _copy_state(state)
    state = _balance_once(state, budget, slack, tolerance, relocate=True)
    try:
        other = _balance_once(other, budget, slack, tolerance, relocate=False)
    except _Infeasible:
        return state

    def score(st):
        return (float(np.max(st.load / np.maximum(budget, np.finfo(np.float64).tiny))),
                int(np.count_nonzero(st.dest != start)))

    return other if score(other) < score(state) else state


def _copy_state(state: _State) -> _State:
    twin = copy.copy(state)
    for name in ("dest", "prev", "micro", "load", "slot_tok", "count"):
        value = getattr(state, name)
        setattr(twin, name, None if value is None else value.copy())
    return twin


def _extra_passes(state: _State, budget: np.ndarray, slack: np.ndarray, limit: np.ndarray) -> None:
    """Up to _EXTRA_PASSES more shed / place passes while some rank is over budget + slack."""
    for _ in range(_EXTRA_PASSES):
        if not np.any(state.load > budget + slack):
            return
        # shed again what the placement could not fit (e.g. the rank that took a long sample)
        pool = _shed_rounds(state, budget, slack, relocate=False)  # long samples stay where they are
        if pool.size == 0:
            return
        _place_best_fit(state, pool, limit)


def _fullest(state: _State, budget: np.ndarray) -> float:
    return float(np.max(state.load / np.maximum(budget, np.finfo(np.float64).tiny)))


def _balance_once(state: _State, budget: np.ndarray, slack: np.ndarray, tolerance: float,
                  relocate: bool, deep: bool = True) -> _State:
    limit = budget * (1.0 + tolerance / 2.0)
    pool = _shed_rounds(state, budget, slack, relocate=relocate)
    extra = _shed_tokens(state)
    if extra.size:
        pool = np.concatenate((pool, extra))
    if pool.size:
        _place_best_fit(state, pool, limit, lpt_host=relocate)
        _extra_passes(state, budget, slack, limit)
    return _polish(state, budget, slack, tolerance, eject=deep)


def _polish(state: _State, budget: np.ndarray, slack: np.ndarray, tolerance: float,
            eject: bool = True) -> _State:
    """Refine, one-for-many exchanges while they help, then the item-count fixes."""
    limit = budget * (1.0 + tolerance / 2.0)
    goal = 1.0 + tolerance
    refine_iters = 2 * budget.shape[0] + 16
    _refine(state, budget, goal, max_iters=refine_iters)
    # a heavy item that fits no other rank's room: one-for-many exchanges, each kept only if it
    # lowers the fullest rank (bounded: every kept one lowers it, at most R of them)
    for _ in range(budget.shape[0] if eject else 0):
        now = _fullest(state, budget)
        if now <= goal:
            break
        for wide in (False, True):
            trial = _copy_state(state)
            try:
                if not _eject(trial, budget, limit, wide):
                    continue
                _extra_passes(trial, budget, slack, limit)
                _refine(trial, budget, goal, max_iters=refine_iters)
            except _Infeasible:
                continue
            if _fullest(trial, budget) < now:
                state = trial
                break
        else:
            break  # neither exchange lowered the fullest rank
    _fill_short_ranks(state)
    _fill_empty_slots(state)
    return state


def _eject(state: _State, budget: np.ndarray, limit: np.ndarray, wide: bool) -> bool:
    """One-for-many exchange for the fullest rank h (ranks by load / budget).

    A heavy item `a` of h moves to a receiver rank r even though no rank has room
    for it; r makes room by shedding its heaviest movable items (those that fit
    the largest free room elsewhere) until its load and the tokens of the slot
    that receives `a` are back within limit / cap; the shed items are then placed
    by best fit. Candidates for `a`: the lightest item of h that brings h within
    its limit alone, and h's heaviest item. The receiver is the rank that sheds
    the fewest items (ties: the lowest load after, then the lowest index).
    Applies the exchange and returns True, or returns False when no receiver
    can make room. Cost: one O(n log n) sort plus O(n) numpy per candidate.
    """
    costs, cap = state.costs, state.cap
    R = state.load.shape[0]
    safe = np.maximum(budget, np.finfo(np.float64).tiny)
    h = int(np.argmax(state.load / safe))
    mine = np.flatnonzero(state.dest == h)
    if mine.size == 0 or (state.count is not None and state.count[h] - 1 < state.min_count):
        return False
    cm = costs[mine]
    excess = float(state.load[h] - limit[h])
    covering = np.flatnonzero(cm >= excess)
    cands = [] if covering.size == 0 else [int(mine[covering[np.argmin(cm[covering])]])]
    heaviest = int(mine[np.argmax(cm)])
    if heaviest not in cands:
        cands.append(heaviest)
    tracked = state.slot_tok is not None
    recv_slot = np.argmin(state.slot_tok, axis=1) if tracked else np.zeros(R, dtype=np.int64)
    room = limit - state.load
    room_h = room[h]
    room[h] = -np.inf
    best_other = float(np.max(room))
    # items that could shed: not on h, in the slot of their rank that would receive `a`
    pool = np.flatnonzero((state.dest != h) & (state.micro == recv_slot[state.dest]))
    pool = pool[np.lexsort((pool, -costs[pool], state.dest[pool]))]  # by rank, heaviest first
    best = None
    for a in cands:
        ca = float(costs[a])
        if ca <= 0:
            continue
        # shed items must fit the rooms of other ranks (h's freed room takes at most one of them:
        # counting on it lets r shed large items that end up back on r)
        movable_up_to = max(best_other, room_h + ca) if wide or best_other <= 0 else best_other
        sel = pool[costs[pool] <= movable_up_to]
        sr = state.dest[sel]
        need = state.load + ca - limit  # cost each rank must shed to take `a`
        if tracked and cap is not None:
            tneed = state.slot_tok[np.arange(R), recv_slot] + state.tokens[a] - cap
        else:
            tneed = np.full(R, -np.inf)
        starts = _group_starts(sr)
        ranks = sr[starts]
        sizes = np.diff(np.append(starts, sel.size))
        cum_c = np.cumsum(costs[sel])
        cum_c -= np.repeat(cum_c[starts] - costs[sel][starts], sizes)  # cumulative within each rank
        if tracked:
            cum_t = np.cumsum(state.tokens[sel])
            cum_t -= np.repeat(cum_t[starts] - state.tokens[sel][starts], sizes)
        else:
            cum_t = np.full(sel.size, np.inf)
        done = (cum_c >= need[sr]) & (cum_t >= tneed[sr])
        pos = np.arange(sel.size) - np.repeat(starts, sizes)  # index within the rank's list
        k = np.full(R, np.inf)  # items r must shed (0 when it already has room)
        if sel.size:
            first = np.minimum.reduceat(np.where(done, pos, np.inf), starts)
            k[ranks] = first + 1
        k[(need <= 0) & (tneed <= 0)] = 0
        k[h] = np.inf
        if state.count is not None:
            k[state.count + 1 - k < state.min_count] = np.inf
        if not np.isfinite(k).any():
            continue
        kk = np.where(np.isfinite(k), k, 0).astype(np.int64)
        gone = np.zeros(R)
        if sel.size:
            # load each rank sheds with its first k items
            gather = starts[np.searchsorted(ranks, np.arange(R)).clip(0, max(ranks.size - 1, 0))]
            has = np.isin(np.arange(R), ranks) & (kk > 0)
            gone[has] = cum_c[gather[has] + kk[has] - 1]
        after = np.where(np.isfinite(k), (state.load + ca - gone) / safe, np.inf)
        r = int(np.lexsort((np.arange(R), after, k))[0])
        # prefer the candidate that brings h within its limit, then fewer shed items
        key = (0 if state.load[h] - ca <= limit[h] else 1, float(k[r]), float(after[r]))
        if best is None or key < best[0]:
            n_shed = int(k[r])
            shed = sel[starts[np.searchsorted(ranks, r)]:][:n_shed] if n_shed else sel[:0]
            best = (key, a, r, shed)
    if best is None:
        return False
    _, a, r, shed = best
    shed = np.sort(shed)
    if shed.size:
        _remove(state, shed)
    state.move(a, r, int(recv_slot[r]))
    if shed.size:
        _place_best_fit(state, shed, limit)
    return True


# ----------------------------------------------------------------------------- plan_balance


def _pct(x: float) -> str:
    return f"{100.0 * x:.1f}%"


def _first(mask: np.ndarray) -> Optional[int]:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def plan_balance(costs, owners, num_ranks, *, tokens=None, max_tokens=None, prior_loads=None,
                 speeds=None, min_gain=0.02, tolerance=0.005) -> Plan:
    """Move few items so that the slowest rank finishes as early as possible.

    Objective: minimise ``max_r (prior_loads[r] + sum of costs on r) / speeds[r]``
    under the hard cap ``sum of tokens on r <= max_tokens``. Starting from the
    current placement it stops as soon as the slowest rank is within `tolerance`
    of the lower bound, so it moves few items. Kept only when it cuts the slowest
    rank by at least `min_gain`, or when the current placement breaks the cap
    (then fixing it is required; a cap that cannot be met raises ValueError).

    Cost: O(n) numpy plus Python steps proportional to the items moved; only
    when that stops above the goal, exchanges (one O(n log n) sort each) and
    partial repacks (module docstring).
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

    loads_before = prior + np.bincount(own, weights=c, minlength=num_ranks)
    mk_before = float(np.max(loads_before / spd))
    lb = _lower_bound(c, prior, spd)
    ntok = None if cap is None else np.bincount(own, weights=tok, minlength=num_ranks)
    violated = None if cap is None else _first(ntok > cap)

    def keep(reason: str) -> Plan:
        return Plan(dest=own.copy(), applied=False, reason=reason, loads_before=loads_before,
                    loads_after=loads_before.copy(), lower_bound=lb, makespan_before=mk_before,
                    makespan_after=mk_before, moved=0)

    if violated is None and (n == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if n == 0 or mk_before <= 0 else "already at the lower bound")
    state = _State(c, tok, cap, spd, own, np.zeros(n, dtype=np.int64), 1, loads_before, 0, fixed=prior)
    try:
        state = _balance(state, lb * spd, tolerance)
    except _Infeasible as exc:
        if violated is None:
            return keep("no feasible plan found; kept in place")
        raise _cap_error(ntok, cap, violated, exc.where) from None
    dest = state.dest
    if cap is not None:
        still = _first(np.bincount(dest, weights=tok, minlength=num_ranks) > cap)  # exact, not the running sums
        if still is not None:
            if violated is None:
                return keep("no feasible plan found; kept in place")
            raise _cap_error(ntok, cap, violated, f"rank {still} still over the cap")
    loads_after = prior + np.bincount(dest, weights=c, minlength=num_ranks)
    mk_after = float(np.max(loads_after / spd))
    moved = int(np.count_nonzero(dest != own))
    made = Plan(dest=dest, applied=True, reason="", loads_before=loads_before, loads_after=loads_after,
                lower_bound=lb, makespan_before=mk_before, makespan_after=mk_after, moved=moved)
    if violated is not None:
        return _with_reason(made, f"required: rank {violated} holds {ntok[violated]:.0f} tokens > cap {cap:.0f}")
    if mk_after >= mk_before:
        return keep("no plan beats keeping in place")
    gain = 1.0 - mk_after / mk_before
    if gain < min_gain:
        return keep(f"gain {_pct(gain)} < min_gain {_pct(min_gain)}")
    return _with_reason(made, f"gain {_pct(gain)} >= min_gain {_pct(min_gain)}")


def _with_reason(plan, reason: str):
    return type(plan)(**{**plan.__dict__, "reason": reason})


def _cap_error(ntok, cap, rank, detail="") -> ValueError:
    return ValueError(
        f"token cap cannot be met: rank {rank} holds {ntok[rank]:.0f} tokens > cap {cap:.0f} "
        f"(all ranks: {ntok.sum():.0f} tokens, total capacity {cap * ntok.size:.0f})"
        + (f"; {detail}" if detail else ""))


# ----------------------------------------------------------------------------- plan_step


def _slot_loads(c, rank, mb, num_ranks, num_mb) -> np.ndarray:
    return np.bincount(rank * num_mb + mb, weights=c, minlength=num_ranks * num_mb).reshape(num_ranks, num_mb)


def _step_objective(slot_loads: np.ndarray, spd: np.ndarray, sync: str) -> float:
    times = slot_loads / spd[:, None]
    if times.size == 0:
        return 0.0
    if sync == "step":
        return float(times.sum(axis=1).max())
    return float(times.max(axis=0).sum())


def plan_step(costs, owners, micro_batches, num_ranks, num_micro_batches, *, tokens=None, max_tokens=None,
              speeds=None, sync="step", min_gain=0.02, tolerance=0.005) -> StepPlan:
    """Assign every item of an optimizer step to a (rank, micro-batch) slot.

    `sync="step"` (DDP: ranks meet once per step) minimises the slowest rank's
    total over the step: items that stay on their rank keep their micro-batch,
    arriving items go to the rank's slot with the fewest tokens.
    `sync="micro_batch"` (FSDP / ZeRO-3: ranks meet in every micro-batch)
    minimises the sum over micro-batches of the slowest slot, by balancing the
    R*M slots around a common level (items heavier than that level stay alone).
    `max_tokens` caps every slot. Whenever n >= R*M every slot gets at least one
    item. `moved` counts rank changes only (a new micro-batch on the same rank
    costs no communication).
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

    S = num_ranks * num_mb
    need_all_slots = n >= S
    before = _slot_loads(c, own, mb, num_ranks, num_mb)
    mk_before = _step_objective(before, spd, sync)
    if sync == "step":
        lb = _lower_bound(c, np.zeros(num_ranks), spd)
    else:
        lb = max(float(c.sum()) / float(spd.sum()), float(c.max() / spd.max()) if n else 0.0)

    def keep(reason):
        return StepPlan(dest_rank=own.copy(), dest_micro_batch=mb.copy(), applied=False, reason=reason,
                        loads_before=before, loads_after=before.copy(), lower_bound=lb,
                        makespan_before=mk_before, makespan_after=mk_before, moved=0)

    slot = own * num_mb + mb
    slot_tok = None if cap is None else np.bincount(slot, weights=tok, minlength=S)
    bad_cap = None if cap is None else _first(slot_tok > cap)
    bad_empty = _first(np.bincount(slot, minlength=S) == 0) if need_all_slots else None
    required = bad_cap is not None or bad_empty is not None
    if not required and (n == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if n == 0 or mk_before <= 0 else "already at the lower bound")

    try:
        if sync == "step":
            state = _State(c, tok, cap, spd, own, mb, num_mb, before.sum(axis=1), num_mb if need_all_slots else 0)
            state = _balance(state, lb * spd, tolerance)
            rank, micro = state.dest, state.micro
        else:
            rank, micro = _plan_step_slots(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots)
    except _Infeasible as exc:
        if not required:
            return keep("no feasible plan found; kept in place")
        raise _slot_error(bad_cap if bad_cap is not None else bad_empty, slot_tok, cap, num_mb, exc.where) from None
    new_slot = rank * num_mb + micro
    if cap is not None:
        still = _first(np.bincount(new_slot, weights=tok, minlength=S) > cap)
        if still is not None:
            if not required:
                return keep("no feasible plan found; kept in place")
            raise _slot_error(bad_cap if bad_cap is not None else bad_empty, slot_tok, cap, num_mb,
                              f"slot {divmod(still, num_mb)} still over the cap")

    after = _slot_loads(c, rank, micro, num_ranks, num_mb)
    mk_after = _step_objective(after, spd, sync)
    moved = int(np.count_nonzero(rank != own))
    made = StepPlan(dest_rank=rank, dest_micro_batch=micro, applied=True, reason="", loads_before=before,
                    loads_after=after, lower_bound=lb, makespan_before=mk_before, makespan_after=mk_after,
                    moved=moved)
    if bad_cap is not None:
        r, m = divmod(bad_cap, num_mb)
        return _with_reason(made, f"required: slot (rank {r}, micro-batch {m}) holds {slot_tok[bad_cap]:.0f} "
                                  f"tokens > cap {cap:.0f}")
    if bad_empty is not None:
        r, m = divmod(bad_empty, num_mb)
        return _with_reason(made, f"required: slot (rank {r}, micro-batch {m}) is empty")
    if mk_after >= mk_before:
        return keep("no plan beats keeping in place")
    gain = 1.0 - mk_after / mk_before
    if gain < min_gain:
        return keep(f"gain {_pct(gain)} < min_gain {_pct(min_gain)}")
    return _with_reason(made, f"gain {_pct(gain)} >= min_gain {_pct(min_gain)}")


def _slot_error(slot_index, slot_tok, cap, num_mb, detail) -> ValueError:
    r, m = divmod(int(slot_index), num_mb)
    held = "" if slot_tok is None else (f" holds {slot_tok[slot_index]:.0f} tokens (cap {cap:.0f}, "
                                        f"all slots {slot_tok.sum():.0f} tokens)")
    return ValueError(f"cannot make a valid step plan: slot (rank {r}, micro-batch {m}){held}; "
                      f"no placement found that fixes it ({detail})")


def _plan_step_slots(c, own, mb, tok, cap, spd, num_mb, tolerance, need_all_slots):
    """sync="micro_batch": balance the R*M slots as ranks of their own, toward per-micro-batch levels.

    1. Each rank orders its micro-batches by load, heaviest first (free: nothing
       leaves the rank). Aligning the sorted slots minimises the sum over
       micro-batches of the slowest slot for the given slot contents, and it
       gathers the heavy samples of all ranks in the first micro-batches.
    2. Items heavier than the flat water level are "heavy": micro-batch m cannot
       finish before F_m = max_r heavy load of slot (r, m) / s_r. Levels
       T_m = max(F_m, W), with W the common level at which all slots together
       hold the light load: slots of a micro-batch that waits for a heavy item
       anyway are filled up to it, the other micro-batches get less.
    3. Shed / place / refine the slots toward budgets T_m * s_r.
    """
    num_ranks = spd.shape[0]
    S = num_ranks * num_mb
    load = np.bincount(own * num_mb + mb, weights=c, minlength=S).reshape(num_ranks, num_mb)
    perm = np.argsort(-load, axis=1, kind="stable")  # perm[r, k]: old micro-batch that becomes k
    new_of_old = np.empty_like(perm)
    np.put_along_axis(new_of_old, perm, np.arange(num_mb)[None, :], axis=1)
    new_mb = new_of_old[own, mb]
    slot = own * num_mb + new_mb
    slot_spd = np.repeat(spd, num_mb)
    level = _water_level(float(c.sum()), np.zeros(S), slot_spd)
    heavy = c > level * float(slot_spd.min())
    fixed = np.bincount(slot[heavy], weights=c[heavy], minlength=S).reshape(num_ranks, num_mb)
    floor = (fixed / spd[:, None]).max(axis=0)  # [M]
    light = float(c[~heavy].sum())
    if cap is not None:
        # a slot holds at most `cap` tokens: light load it can take ~ its token room x light cost per token
        heavy_tok = np.bincount(slot[heavy], weights=tok[heavy], minlength=S).reshape(num_ranks, num_mb)
        light_tok = float(tok[~heavy].sum())
        density = light / light_tok if light_tok > 0 else 0.0
        token_limit = np.maximum(cap - heavy_tok, 0.0) * density
    else:
        token_limit = np.full((num_ranks, num_mb), np.inf)

    def capacity(w):
        t = np.maximum(floor, w)
        return float(np.minimum(np.maximum(t[None, :] * spd[:, None] - fixed, 0.0), token_limit).sum())

    lo, hi = 0.0, max(level, float(floor.max())) * 2.0 + 1.0
    for _ in range(60):  # bisection on the common level W (capacity is increasing in W)
        mid = 0.5 * (lo + hi)
        if capacity(mid) >= light:
            hi = mid
        else:
            lo = mid
    budget = (np.maximum(floor, hi)[None, :] * spd[:, None]).reshape(-1)
    state = _State(c, tok, cap, slot_spd, slot, np.zeros(c.shape[0], dtype=np.int64), 1, load.reshape(-1)[
        (perm + (np.arange(num_ranks) * num_mb)[:, None]).reshape(-1)], 1 if need_all_slots else 0)
    # heavy samples are placed by the levels above (their micro-batch waits for them anyway): no relocation
    state = _balance(state, budget, tolerance, relocate=False, deep=False)
    return state.dest // num_mb, state.dest % num_mb
