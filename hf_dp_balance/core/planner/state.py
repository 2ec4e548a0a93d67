"""The working placement of one planning call (local to the call, never shared), the constants every stage
shares, and the helpers that read, copy or pair it."""

from __future__ import annotations

import copy

import numpy as np

from hf_dp_balance.core.planner.trade_index import _rank_starts, _stable_order

# what every stage reads; sizes as shares of the token cap
_LARGE = 1.0 / 16.0  # items above this are the ones traded: a few per slot, each worth a trade's sends
_OVERHEAD = 1.0 / 64.0  # tokens counted per trade on top of what it sends: fewer, larger trades
_BREADTH = 2  # candidates of each kind a round tries per rank (partners, items, slots): a second rescues most misses
_ROUNDS = 32  # rounds at most of a trade or swap pass (each round: at most one or two moves per over-full rank)
_PASSES = 2  # more passes of a kind after the first (shed / place, ladder residue, roomy): later ones gain little
_FEW_SLOTS = 4  # up to this many micro-batches a rank's slots give a trade little choice (long items go first)


class _Infeasible(Exception):
    """No placement found that meets the token cap / item counts; `where` (the message) says where it failed."""

    where = property(lambda self: self.args[0])


class _State:
    """R ranks of M slots (micro-batches; M = 1 for plan_balance): cost balanced per rank, tokens capped per slot.
    Tokens per slot are tracked under a cap or with M > 1 (to spread arriving items; an item counts 1 without
    tokens), items per rank only when ranks need a minimum count. `move` and `_remove` keep all totals consistent."""

    def __init__(self, costs, tokens, cap, speeds, dest, micro, num_slots, load, min_count, fixed=None,
                 slot_tok=None):
        R = speeds.shape[0]
        self.fixed = np.zeros(R) if fixed is None else fixed  # load that cannot move (prior_loads)
        self.costs, self.cap, self.speeds, self.M = costs, cap, speeds, num_slots  # cap: tokens per slot, or None
        self.dest, self.micro = dest.copy(), micro.copy()
        self.prev = dest.copy()  # rank an item was last taken from (its way back)
        self.load = load.copy()  # prior + costs per rank
        track = cap is not None or num_slots > 1
        self.tokens = tokens if tokens is not None else (np.ones(costs.shape[0]) if track else None)
        if slot_tok is not None:  # the caller's tokens per slot (a copy: this state changes them)
            self.slot_tok = np.array(slot_tok, dtype=np.float64).reshape(R, num_slots)
        else:
            self.slot_tok = (np.bincount(dest * num_slots + micro, weights=self.tokens, minlength=R * num_slots)
                             .reshape(R, num_slots) if track else None)
        self.count = None if min_count <= 0 else np.bincount(dest, minlength=R)
        self.min_count = min_count
        self.path = "incremental"  # "repack" once the repack fallback re-placed it (Plan.path)
        # what is worked out of the items alone (costs, tokens, cap), never of their placement: shared by copies
        self.item_memo = {}

    def move(self, item: int, to: int, slot: int) -> None:
        frm, m, c = int(self.dest[item]), int(self.micro[item]), self.costs[item]
        self.load[frm] -= c
        self.load[to] += c
        if self.slot_tok is not None:
            t = self.tokens[item]
            self.slot_tok[frm, m] -= t
            self.slot_tok[to, slot] += t
        if self.count is not None:
            self.count[frm] -= 1
            self.count[to] += 1
        self.dest[item], self.micro[item] = to, slot


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


def _copy_state(state: _State) -> _State:
    twin = copy.copy(state)
    for name in ("dest", "prev", "micro", "load", "slot_tok", "count"):
        value = getattr(state, name)
        setattr(twin, name, None if value is None else value.copy())
    return twin


def _smallest_room(room: list, t: float) -> int:
    """Index of the smallest room >= t (the first of equal ones), -1 if none: best fit on a short Python list."""
    best, at = np.inf, -1
    for k, v in enumerate(room):
        if t <= v < best:
            best, at = v, k
    return at


def _sent(state: _State, start: np.ndarray) -> float:
    """What a plan sends: tokens of the items that change rank (items when no tokens are given)."""
    away = state.dest != start
    return float(state.tokens[away].sum()) if state.tokens is not None else float(np.count_nonzero(away))


def _pair_ranks(state: _State, budget: np.ndarray, limit: np.ndarray, under_key: np.ndarray, partners: int, k: int):
    """(over-full ranks, h, l) of round k of a trade pass: each rank over `limit`, most over its budget first,
    meets `partners` ranks under budget (by `under_key`, then index) from its own place in that order, shifted
    each round so that a pair that found no trade meets new ranks; h, l are None when no rank is under budget."""
    over = np.flatnonzero(state.load > limit)
    under = np.flatnonzero(state.load < budget)
    if over.size == 0 or under.size == 0:
        return over, None, None
    over = over[np.argsort(budget[over] - state.load[over], kind="stable")]
    under = under[np.argsort(under_key[under], kind="stable")]
    P, K = min(over.size, under.size), min(partners, under.size)
    h = np.repeat(over[:P], K)
    l = under[(np.repeat(np.arange(P), K) + np.tile(np.arange(K), P) * (1 + k) + k) % under.size]
    return over, h, l


def _fullest(state: _State, budget: np.ndarray) -> float:
    return float(np.max(state.load / np.maximum(budget, np.finfo(np.float64).tiny)))


def _group_starts(keys: np.ndarray) -> np.ndarray:
    """Start offsets of the runs of equal values in a sorted array."""
    if keys.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))


class _Members:
    """Items of each rank (index order), built once per `_refine` or long-item pass and patched on every move."""

    def __init__(self, dest: np.ndarray, num_ranks: int):
        self.cache = {}
        self.order = _stable_order(dest, num_ranks)
        self.bounds = _rank_starts(dest, num_ranks)  # (from the counts per rank, not a search of dest[order])

    def of(self, r: int) -> np.ndarray:
        got = self.cache.get(r)
        if got is None:
            got = self.cache[r] = self.order[self.bounds[r]:self.bounds[r + 1]]
        return got

    def moved(self, item: int, frm: int, to: int) -> None:
        src = self.of(frm)
        self.cache[frm] = src[src != item]
        dst = self.of(to)
        self.cache[to] = np.sort(np.append(dst, item))  # index order keeps ties deterministic
