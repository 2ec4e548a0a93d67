"""Plans within a fixed set of partners per rank: each rank trades with at most `max_partners` peers
for the whole run, so that point-to-point connections made on first use stay few.

Cost model: as `plan_step`'s. Every item has a cost and tokens; a rank's time is the sum of its items'
costs over its speed (``sync="step"``: the slowest rank's total sets the step), every slot (rank,
micro-batch) holds at most `max_tokens`.

Partners: two fixed partitions of the ranks into blocks. The first ("node blocks") cuts the ranks into
runs of whole nodes of at most `s1` ranks; the second ("cross blocks") of at most `s2` ranks takes its
ranks from different node blocks, interleaved so that the blocks of the two partitions form one
connected graph. A rank's partners are the other ranks of its node block and of its cross block:
at most ``(s1 - 1) + (s2 - 1) <= max_partners``.

Method (`plan_step_with_partners`, ``sync="step"`` with M >= 2 micro-batches): the slots of a step
are split in two halves, the first ``M // 2`` micro-batches and the rest. Stage one moves only items
of the first half, only within node blocks; stage two only items of the second half, only within
cross blocks. Each item is in exactly one stage and no slot is in both, so an item moves at most once
(owner -> destination, no relay), to a partner, and each stage's caps are exact. Both stages call
`plan_step` once per block, steering each rank to a goal through `speeds` (the planner equalises
load / speed, so speed = goal makes the load meet the goal, the goals of a block summing to its load).
Stage one evens out each node block's first half and moves, between a node block's ranks, the load
that every cross block lacks in all (a least-squares flow on the graph of the two partitions'
blocks); stage two, inside each cross block, gives each rank the second-half load that completes its
target (its share of the step's total, by speed). The bound is then missed only by the two stages'
tolerances and by what the blocks' items cannot express (docs/benchmarks/partners.md). With M = 1
or ``sync="micro_batch"`` (ranks meet in every micro-batch, so one stage must balance each
micro-batch across the world) it plans each node block alone: the partners still hold, the plan is
only as good as blocks of `s1` ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hf_dp_balance.core.planner import StepPlan, lower_bound, plan_step
from hf_dp_balance.core.planner.results import _verdict
from hf_dp_balance.core.planner.validation import _as_index_array, _check_count
from hf_dp_balance.core.steps import SYNC_MODES, slot_sums, step_makespan

__all__ = ["PartnerSets", "partner_sets", "plan_step_with_partners"]

# The planner's path names, strongest first: a combined plan reports the strongest of its blocks'.
_PATH_ORDER = ("repack", "trades", "incremental")


@dataclass(frozen=True, eq=False)
class PartnerSets:
    """Every rank's fixed partners: the other ranks of its node block and of its cross block.

    `node_block[r]` / `cross_block[r]`: the block of rank r in each partition (block ids count from 0).
    Symmetric (r partners q exactly when q partners r), at most `max_partners` per rank, the same for
    the same arguments. `complete` when every rank's partners are all other ranks."""

    num_ranks: int
    max_partners: int
    ranks_per_node: int
    node_block: np.ndarray
    cross_block: np.ndarray

    @property
    def complete(self) -> bool:
        return int(self.node_block.max(initial=0)) == 0

    def of(self, rank: int) -> np.ndarray:
        """The partners of `rank`, sorted (never the rank itself)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is not in [0, {self.num_ranks})")
        same = (self.node_block == self.node_block[rank]) | (self.cross_block == self.cross_block[rank])
        same[rank] = False
        return np.flatnonzero(same)

    def allows(self, src, dst) -> np.ndarray:
        """bool per pair: `dst` is `src` itself or one of its partners."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        return ((src == dst) | (self.node_block[src] == self.node_block[dst])
                | (self.cross_block[src] == self.cross_block[dst]))


def partner_sets(num_ranks: int, max_partners: int, *, ranks_per_node: int = 1) -> PartnerSets:
    """Fixed partners of every rank, from (num_ranks, max_partners, ranks_per_node) alone.

    `max_partners` 0 (or at least num_ranks - 1): every rank partners every other rank. Otherwise
    the node blocks hold whole nodes (ranks_per_node consecutive ranks) and at most
    s1 = ceil((k + 2) / 2) ranks rounded down to whole nodes, the cross blocks at most
    s2 = k + 2 - s1 (k = max_partners), so no rank has more than k partners and a node's ranks are
    partners of each other. Raises ValueError when k cannot hold a node and one rank outside it
    (k < ranks_per_node, or k = 1 with more than 2 ranks): the partners would not connect the ranks.
    """
    R = _check_count(num_ranks, "num_ranks")
    k = int(max_partners)
    if k != max_partners or k < 0:
        raise ValueError(f"max_partners={max_partners!r}: must be a whole number >= 0 (0: every rank)")
    rpn = _check_count(ranks_per_node, "ranks_per_node")
    if k == 0 or k >= R - 1:
        zero = np.zeros(R, dtype=np.int64)
        return PartnerSets(R, k, rpn, zero, zero.copy())
    if k < max(rpn, 2):
        raise ValueError(f"max_partners={k} with {R} ranks and ranks_per_node={rpn}: must be at least "
                         f"{max(rpn, 2)} (the ranks of a node and one partner outside it), or 0 for every rank")
    s1 = max(rpn, ((k + 3) // 2) // rpn * rpn)
    s2 = k + 2 - s1
    # node blocks: whole nodes, consecutive, as even as whole nodes allow (each at most s1 ranks)
    nodes = -(-R // rpn)
    n1 = -(-nodes // (s1 // rpn))
    node_of_rank = np.arange(R) // rpn
    node_block = node_of_rank * n1 // nodes
    # position of each rank within its node block
    starts = np.searchsorted(node_block, np.arange(n1))
    position = np.arange(R) - starts[node_block]
    # cross blocks: ranks ordered by position, and within position j by node block from block j * h on,
    # cut into runs of at most s2 (a run shorter than n1 never holds two ranks of one node block). h is
    # the first of a fixed list of steps (near n1 / golden ratio first: neighbouring cross blocks then
    # meet spread-out node blocks) for which the two partitions connect every rank.
    n2 = -(-R // s2)
    golden = max(1, int(round(n1 * 0.6180339887)))
    for h in [golden] + [h for h in range(1, n1 + 1) if h != golden]:
        order = np.lexsort(((node_block - position * h) % n1, position))
        cross_block = np.empty(R, dtype=np.int64)
        cross_block[order] = np.arange(R) * n2 // R
        if _connected(node_block, cross_block):
            break
    else:
        raise ValueError(f"max_partners={k} with {R} ranks and ranks_per_node={rpn}: no partner sets of this "
                         f"shape connect every rank; raise max_partners")
    return PartnerSets(R, k, rpn, node_block.astype(np.int64), cross_block)


def plan_step_with_partners(costs, owners, micro_batches, num_ranks, num_micro_batches, *,
                            partners: PartnerSets, **plan_step_keywords) -> StepPlan:
    """`plan_step`, with every item that changes rank sent from its owner to one of its `partners`.

    Same inputs, keywords and result as `plan_step` (module docstring: the method). Guarantees: every
    item is placed once; an item either stays on its owner or goes to a partner of it, and moves at
    most once; every slot holds at most `max_tokens` (a slot over the cap that its block cannot fix
    raises ValueError naming it); the plan is kept only when it cuts the slowest rank by `min_gain`
    or is required (a slot over the cap, or an empty slot with at least R*M items), as in
    `plan_step`. Every slot ends non-empty where its block and half of the step held at least as many
    items as slots (always, when every slot held an item). When every rank's partners are all other
    ranks the result is exactly `plan_step`'s.
    """
    if not isinstance(partners, PartnerSets):
        raise TypeError(f"partners must be a PartnerSets (from partner_sets), not {type(partners).__name__}")
    if int(num_ranks) != partners.num_ranks:
        raise ValueError(f"num_ranks={num_ranks} but the partners were made for {partners.num_ranks} ranks")
    if partners.complete:
        return plan_step(costs, owners, micro_batches, num_ranks, num_micro_batches, **plan_step_keywords)
    unknown = set(plan_step_keywords) - {"tokens", "max_tokens", "speeds", "sync", "min_gain", "tolerance"}
    if unknown:
        raise TypeError(f"plan_step_with_partners got unexpected keywords {sorted(unknown)}")
    R, M = int(num_ranks), int(num_micro_batches)
    c = np.asarray(costs, dtype=np.float64).reshape(-1)
    n = c.shape[0]
    own = _as_index_array(owners, "owners", n, R, "num_ranks")  # plan_step's own checks and messages
    mb = _as_index_array(micro_batches, "micro_batches", n, M, "num_micro_batches")
    tokens = plan_step_keywords.get("tokens")
    tok = None if tokens is None else np.asarray(tokens, dtype=np.float64).reshape(-1)
    if tok is not None and tok.shape[0] != n:
        raise ValueError(f"tokens has {tok.shape[0]} entries for {n} items")
    cap = plan_step_keywords.get("max_tokens")
    speeds = plan_step_keywords.get("speeds")
    spd = np.ones(R) if speeds is None else np.asarray(speeds, dtype=np.float64).reshape(-1)
    if spd.shape[0] != R or not np.all(spd > 0):
        raise ValueError(f"speeds must hold {R} positive values")
    sync = plan_step_keywords.get("sync", "step")
    if sync not in SYNC_MODES:
        raise ValueError(f"sync={sync!r}: must be one of {SYNC_MODES}")
    min_gain = float(plan_step_keywords.get("min_gain", 0.02))
    tolerance = float(plan_step_keywords.get("tolerance", 0.005))
    inner = dict(tokens=tok, max_tokens=cap, min_gain=0.0, tolerance=tolerance)

    before = slot_sums(c, own * M + mb, R, M)
    mk_before = step_makespan(before, sync, spd)
    lb = lower_bound(c, R, speeds=spd) if sync == "step" else (
        max(float(c.sum()) / float(spd.sum()), float(c.max() / spd.max())) if n else 0.0)
    required = _required(own, mb, tok, cap, R, M, n)

    def keep(reason):
        return StepPlan(dest_rank=own.copy(), dest_micro_batch=mb.copy(), applied=False, reason=reason,
                        loads_before=before, loads_after=before.copy(), lower_bound=lb,
                        makespan_before=mk_before, makespan_after=mk_before, moved=0, path="kept")

    if required is None and (n == 0 or mk_before <= 0 or mk_before <= lb * (1.0 + 1e-12)):
        return keep("nothing to balance" if n == 0 or mk_before <= 0 else "already at the lower bound")

    rank, micro, paths = own.copy(), mb.copy(), set()
    if sync == "micro_batch" or M < 2:
        everything = np.ones(n, dtype=bool)
        _plan_blocks(partners.node_block, everything, np.arange(M), M, spd, c, own, mb, rank, micro, paths,
                     dict(inner, sync=sync))
    else:
        first = np.arange(M // 2)
        second = np.arange(M // 2, M)
        in_first = mb < M // 2
        target = spd * (float(c.sum()) / float(spd.sum()))
        half = np.bincount(own[in_first], weights=c[in_first], minlength=R)
        total = before.sum(axis=1)
        goal_first = _first_half_goals(partners, half, total, target)
        _plan_blocks(partners.node_block, in_first, first, M, goal_first, c, own, mb, rank, micro, paths,
                     dict(inner, sync="step"))
        got_first = np.bincount(rank[in_first], weights=c[in_first], minlength=R)
        goal_second = _positive(target - got_first, target)
        _plan_blocks(partners.cross_block, ~in_first, second, M, goal_second, c, own, mb, rank, micro, paths,
                     dict(inner, sync="step"))

    slot = rank * M + micro
    if tok is not None and cap is not None:
        over = np.flatnonzero(np.bincount(slot, weights=tok, minlength=R * M) > cap)
        if over.size:  # each block's plan checked its own slots: this would be a bug, never a plan to keep
            r, m = divmod(int(over[0]), M)
            raise AssertionError(f"slot (rank {r}, micro-batch {m}) over the cap after planning by blocks")
    after = slot_sums(c, slot, R, M)
    mk_after = step_makespan(after, sync, spd)
    path = next((p for p in _PATH_ORDER if p in paths), "incremental")
    made = StepPlan(dest_rank=rank, dest_micro_batch=micro, applied=True, reason="", loads_before=before,
                    loads_after=after, lower_bound=lb, makespan_before=mk_before, makespan_after=mk_after,
                    moved=int(np.count_nonzero(rank != own)), path=path)
    return _verdict(made, keep, required, min_gain)  # plan_step's own skip rule


def _first_half_goals(partners: PartnerSets, half: np.ndarray, total: np.ndarray,
                      target: np.ndarray) -> np.ndarray:
    """Each rank's first-half load goal. Within a node block the first-half load only moves between
    its ranks (sums kept). The goals even out each node block's first half (every rank towards its
    share of the first-half total, its block's mean shortfall kept) and move, between a node block's
    ranks, what each cross block lacks in all, so that stage two can complete every cross block.

    With short_r = target_r - total_r (what the rank lacks in all) and even_r = its first-half
    shortfall minus the node block's mean of it, cross block B needs sum_{r in B} (short_r - even_r)
    more. The least-squares flow f with sum_A f = 0 on every node block A and sum_B f = that need
    is f_r = u_{A(r)} + w_{B(r)}, u_A = -mean_{r in A} w_{B(r)}; w solves the cross blocks' Laplacian
    system (`_cross_weights`).

    Measured on step 0 of bench/partners.py at 512 x 4: evening out each half first and leaving each
    rank's own total to stage two ends 1.0019x / 1.0025x over the bound (7B-like / strongly quadratic);
    asking the first half to cancel the second's excess as well asks for moves that are not there
    (1.0042x / 1.0073x)."""
    A, B = partners.node_block, partners.cross_block
    nA, nB = int(A.max()) + 1, int(B.max()) + 1
    size_a = np.bincount(A, minlength=nA).astype(np.float64)
    size_b = np.bincount(B, minlength=nB).astype(np.float64)
    own_short = target * (half.sum() / max(total.sum(), np.finfo(np.float64).tiny)) - half
    even = own_short - (np.bincount(A, weights=own_short, minlength=nA) / size_a)[A]
    need = np.bincount(B, weights=(target - total) - even, minlength=nB)
    w = _cross_weights(A, B, size_a, size_b, need)
    u = -np.bincount(A, weights=w[B], minlength=nA) / size_a
    return _positive(half + even + u[A] + w[B], np.maximum(half, target * 0.5))


def _cross_weights(A: np.ndarray, B: np.ndarray, size_a: np.ndarray, size_b: np.ndarray,
                   need: np.ndarray) -> np.ndarray:
    """w with S w = need, S w = |B| w_B - sum_{r in B} mean_{q in A(r)} w_{B(q)} (symmetric, positive
    semi-definite, its null space the constant vectors; `need` sums to 0), by conjugate gradients.

    Only bincounts (sequential sums) and exactly rounded inner products (math.fsum): every rank gets
    the same goals bit for bit, whatever its BLAS or thread count (a LAPACK solve need not)."""
    nA, nB = size_a.size, size_b.size

    def apply(v):
        return size_b * v - np.bincount(B, weights=(np.bincount(A, weights=v[B], minlength=nA) / size_a)[A],
                                        minlength=nB)

    def dot(x, y):
        return math.fsum((x * y).tolist())

    w = np.zeros(nB)
    r = need - math.fsum(need.tolist()) / nB
    p = r.copy()
    rr = dot(r, r)
    stop = 1e-24 * rr
    for _ in range(4 * nB + 10):
        if rr <= stop:
            break
        sp = apply(p)
        curve = dot(p, sp)
        if curve <= 0.0:
            break
        step = rr / curve
        w += step * p
        r -= step * sp
        rr, previous = dot(r, r), rr
        p = r + (rr / previous) * p
    return w


def _positive(goal: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Goals as speeds: positive, at least a thousandth of `scale` (a rank already over its target gets
    the smallest goal, so its block sheds what it can of it)."""
    floor = np.maximum(1e-3 * scale, np.finfo(np.float64).tiny)
    return np.maximum(goal, floor)


def _plan_blocks(block_of: np.ndarray, selected: np.ndarray, slots: np.ndarray, num_mb: int, goal: np.ndarray,
                 c, own, mb, rank, micro, paths, keywords) -> None:
    """plan_step on each block's `selected` items over micro-batches `slots`, with speeds `goal`;
    writes the destinations into `rank` / `micro` (global ranks and micro-batches)."""
    tok = keywords.pop("tokens")
    index = np.flatnonzero(selected)
    by_block = np.argsort(block_of[own[index]], kind="stable")
    index = index[by_block]
    bounds = np.searchsorted(block_of[own[index]], np.arange(int(block_of.max()) + 2))
    local_mb = np.full(num_mb, -1, dtype=np.int64)
    local_mb[slots] = np.arange(slots.size)
    for b in range(bounds.size - 1):
        items = index[bounds[b]:bounds[b + 1]]
        members = np.flatnonzero(block_of == b)
        if items.size == 0:  # (a one-rank block still runs: it may have to fix a slot over the cap)
            continue
        local_rank = np.searchsorted(members, own[items])
        try:
            plan = plan_step(c[items], local_rank, local_mb[mb[items]], members.size, slots.size,
                             tokens=None if tok is None else tok[items], speeds=goal[members], **keywords)
        except ValueError as exc:
            raise ValueError(f"no valid plan among partner ranks {members.tolist()} (micro-batches "
                             f"{slots.tolist()}; in that call ranks and micro-batches count from 0): {exc}") from exc
        if plan.applied:
            rank[items] = members[plan.dest_rank]
            micro[items] = slots[plan.dest_micro_batch]
            paths.add(plan.path)


def _required(own, mb, tok, cap, R, M, n):
    """Why a plan is required (a slot over the cap, or an empty slot with at least R*M items), or None."""
    slot = own * M + mb
    if tok is not None and cap is not None:
        held = np.bincount(slot, weights=tok, minlength=R * M)
        over = np.flatnonzero(held > cap)
        if over.size:
            r, m = divmod(int(over[0]), M)
            return f"slot (rank {r}, micro-batch {m}) holds {held[over[0]]:.0f} tokens > cap {cap:.0f}"
    if n >= R * M:
        empty = np.flatnonzero(np.bincount(slot, minlength=R * M) == 0)
        if empty.size:
            r, m = divmod(int(empty[0]), M)
            return f"slot (rank {r}, micro-batch {m}) is empty"
    return None


def _connected(node_block: np.ndarray, cross_block: np.ndarray) -> bool:
    """Whether the ranks form one group when joined through shared node blocks and cross blocks."""
    label = node_block.copy()  # each rank's smallest reachable node block, spread until it settles
    while True:
        by_cross = np.full(int(cross_block.max()) + 1, label.max() + 1)
        np.minimum.at(by_cross, cross_block, label)
        by_node = np.full(int(node_block.max()) + 1, label.max() + 1)
        np.minimum.at(by_node, node_block, by_cross[cross_block])
        new = by_node[node_block]
        if np.array_equal(new, label):
            return bool(np.all(label == 0))
        label = new
