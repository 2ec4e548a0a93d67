"""Fewer tokens sent at a full cap, slot caps kept: large-neighbourhood search from plan_step's own plan.

The floors of `bench/planner_floor.py` / `bench/planner_dw.py` all relax the micro-batch slots and sit
0.55-0.63 x plan_step. This bench gives the other side: a real plan (every item in one (rank, slot),
every slot <= the pack length and not empty, every rank <= goal x bound) that sends fewer tokens, as an
upper bound on the optimum that keeps the slots.

Start: plan_step's plan on the instance of `bench/planner.py --full-cap`. Repeat: pick k ranks (a
neighbourhood), free the items now on them (or, `--free-short`, those away from home, the long ones and a
random share of the rest), and solve exactly with HiGHS (started from the current plan; or
scipy.optimize.milp, which takes no start, `--solver milp`) where those items go among those ranks'
k x M slots: x[i, r, s] binary, each item once, each slot's tokens <= cap and >= 1 item, each rank's
cost <= goal x bound, the slots of a rank ordered by tokens when all its items are free (they are
interchangeable under sync="step": this removes the M! relabellings); the start (or
with milp a cutoff row) makes a solve that finds nothing better stop on its bound. Items on other ranks
stay. An improvement is accepted; the plan stays valid throughout.

Neighbourhoods (`--kinds`, cycled):
- trade: a rank drawn by the tokens it sends or receives, then the ranks it trades most with (the
  tokens between home and holder, both ways), grown the same way from the ranks added;
- mix: over-full ranks (their home items cost more than the goal) that send most, and the roomiest
  ranks (fewest tokens / lowest cost now), half each;
- random: k ranks at random among those that send or receive.

    python bench/planner_lns.py [--sizes 512x4] [--goal 1.01] [--seed 0] [--ranks 6,8] [--kinds trade]
                                [--free-short 0.3] [--time-limit 5] [--budget 1200] [--save plan.npz]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planner as bench  # noqa: E402  (the full-cap instances of bench/planner.py)

from hf_dp_balance.core.planner import plan_step  # noqa: E402
from hf_dp_balance.core.steps import slot_sums, step_makespan  # noqa: E402
from hf_dp_balance.runtime.step_rows import validate_plan  # noqa: E402


def check_plan(c, L, own, dest, micro, R, M, cap, goal_load):
    """(slowest / goal_load, tokens sent) of a plan, or AssertionError: every item in one valid
    (rank, slot) (the runtime's own check), every slot <= cap tokens and holding an item when there are
    at least R*M items (plan_step's rule), every rank's step cost <= goal_load."""
    dest, micro = validate_plan(dest, micro, L.size, R, M)
    slot = dest * M + micro
    slot_tok = np.bincount(slot, weights=L, minlength=R * M)
    assert slot_tok.max() <= cap, f"slot {int(np.argmax(slot_tok))} holds {slot_tok.max():.0f} > {cap} tokens"
    if L.size >= R * M:
        assert np.bincount(slot, minlength=R * M).min() >= 1, "an empty slot"
    slowest = step_makespan(slot_sums(c, slot, R, M), "step")
    assert slowest <= goal_load * (1.0 + 1e-9), f"slowest {slowest:.6g} > goal {goal_load:.6g}"
    return slowest / goal_load, float(L[dest != own].sum())


def _highs_warm(cost, A, lo, hi, x0, time_limit):
    """(x or None, message) of the 0/1 program min cost.x, lo <= A x <= hi, by HiGHS started from the feasible
    point x0 (scipy.optimize.milp takes no start; this is the HiGHS that scipy ships, `_highspy._core`)."""
    from scipy.optimize._highspy import _core

    A = sparse.csc_matrix(A)
    h = _core._Highs()
    for name, value in (("output_flag", False), ("time_limit", float(time_limit)), ("mip_rel_gap", 0.0),
                        ("threads", 1)):
        h.setOptionValue(name, value)
    lp = _core.HighsLp()
    lp.num_col_, lp.num_row_ = A.shape[1], A.shape[0]
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, np.zeros(A.shape[1]), np.ones(A.shape[1])
    lp.row_lower_ = np.where(np.isfinite(lo), lo, -_core.kHighsInf)
    lp.row_upper_ = np.where(np.isfinite(hi), hi, _core.kHighsInf)
    lp.a_matrix_.format_ = _core.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = A.indptr, A.indices, A.data
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = A.shape[1], A.shape[0]
    lp.integrality_ = [_core.HighsVarType.kInteger] * A.shape[1]
    h.passModel(lp)
    start = _core.HighsSolution()
    start.col_value = list(x0)
    start.value_valid = True
    h.setSolution(start)
    h.run()
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != _core.SolutionStatus.kSolutionStatusFeasible:
        return None, status
    return (np.asarray(h.getSolution().col_value),
            f"{status} (best {info.objective_function_value:.0f}, bound {info.mip_dual_bound:.0f})")


def solve_neighbourhood(c, L, own, dest, micro, ranks, M, cap, goal_load, time_limit, need_all_slots=True,
                        solver="highs", fixed=None):
    """(new dest, new micro, tokens sent by the neighbourhood's items, message) with the items now on `ranks`
    reassigned exactly among those ranks' slots (None for dest / micro when no plan that sends fewer of their
    tokens than now was found within `time_limit`). solver "highs": HiGHS started from the current plan;
    "milp": scipy.optimize.milp with a cutoff row (no start). `fixed` (bool per item, optional): items on `ranks`
    that stay in their slot (their tokens and cost taken off the slots' and ranks' room)."""
    on = np.isin(dest, ranks)
    k = ranks.size
    S = k * M
    held = np.flatnonzero(on & fixed) if fixed is not None else np.zeros(0, dtype=np.int64)
    held_slot = np.searchsorted(ranks, dest[held]) * M + micro[held]
    slot_cap = float(cap) - np.bincount(held_slot, weights=L[held], minlength=S)
    rank_cap = goal_load - np.bincount(held_slot // M, weights=c[held], minlength=k)
    slot_need = np.maximum(1.0 - np.bincount(held_slot, minlength=S), 0.0)
    items = np.flatnonzero(on & ~fixed) if fixed is not None else np.flatnonzero(on)
    n = items.size
    N = n * S
    Li, ci, home = L[items], c[items], own[items]
    i_of = np.repeat(np.arange(n), S)
    r_of = np.tile(np.repeat(np.arange(k), M), n)  # position in `ranks`
    s_of = np.tile(np.arange(S), n)  # slot within the neighbourhood: r * M + m
    cost = np.where(ranks[r_of] == home[i_of], 0.0, Li[i_of])
    now = float(Li[dest[items] != home].sum())
    cols = np.arange(N)
    tok = sparse.csr_matrix((Li[i_of], (s_of, cols)), shape=(S, N))
    blocks = [
        (sparse.csr_matrix((np.ones(N), (i_of, cols)), shape=(n, N)), 1.0, 1.0),  # each item once
        (tok, -np.inf, slot_cap),  # slot tokens
        (sparse.csr_matrix((ci[i_of], (r_of, cols)), shape=(k, N)), -np.inf, rank_cap),  # rank cost
    ]
    if need_all_slots:  # a slot holds an item (plan_step's rule when there are at least R*M items)
        blocks.append((sparse.csr_matrix((np.ones(N), (s_of, cols)), shape=(S, N)), slot_need, np.inf))
    if M > 1 and held.size == 0:  # interchangeable slots: slot m of a rank holds at least the tokens of slot m + 1
        pick = np.array([r * M + m for r in range(k) for m in range(M - 1)])
        blocks.append((tok[pick] - tok[pick + 1], 0.0, np.inf))
    if solver == "milp":  # strictly fewer tokens sent than now
        blocks.append((sparse.csr_matrix(cost[None, :]), -np.inf, now - 0.5))
    A = sparse.vstack([b[0] for b in blocks]).tocsr()
    lo = np.concatenate([np.broadcast_to(b[1], (b[0].shape[0],)) for b in blocks])
    hi = np.concatenate([np.broadcast_to(b[2], (b[0].shape[0],)) for b in blocks])
    if solver == "milp":
        res = milp(cost, constraints=LinearConstraint(A, lo, hi), bounds=Bounds(0, 1), integrality=np.ones(N),
                   options={"time_limit": time_limit, "mip_rel_gap": 0.0})
        x, msg = res.x, res.message
    else:
        # the current plan as the start, its slots of each rank relabelled by tokens (free under sync="step")
        pos = np.searchsorted(ranks, dest[items])
        slot_tok = np.bincount(pos * M + micro[items], weights=Li, minlength=S).reshape(k, M)
        order = np.argsort(-slot_tok, axis=1, kind="stable")
        relabel = np.empty_like(order)
        np.put_along_axis(relabel, order, np.arange(M)[None, :], axis=1)
        if held.size:  # slots keep their labels (the fixed items hold them apart)
            relabel = np.tile(np.arange(M), (k, 1))
        x0 = np.zeros((n, S))
        x0[np.arange(n), pos * M + relabel[pos, micro[items]]] = 1.0
        x, msg = _highs_warm(cost, A, lo, hi, x0.reshape(-1), time_limit)
    if x is None:
        return None, None, now, msg + f", now {now:.0f}"
    where = np.argmax(x.reshape(n, S), axis=1)
    new_dest, new_micro = dest.copy(), micro.copy()
    new_dest[items] = ranks[where // M]
    new_micro[items] = where % M
    return new_dest, new_micro, float(Li[new_dest[items] != home].sum()), msg + f", now {now:.0f}"


def _trade_tokens(L, own, dest, R):
    """R x R dense tokens moved between home and holder (symmetric: both ways added)."""
    away = dest != own
    w = np.zeros((R, R))
    np.add.at(w, (own[away], dest[away]), L[away])
    return w + w.T


def pick_neighbourhood(kind, k, rng, c, L, own, dest, R, goal_load):
    """`k` distinct ranks of the kind described in the module docstring."""
    trade = _trade_tokens(L, own, dest, R)
    active = trade.sum(axis=1)
    if kind == "trade":
        p = active / active.sum()
        chosen = [int(rng.choice(R, p=p))]
        while len(chosen) < k:
            w = trade[chosen].sum(axis=0)
            w[chosen] = 0.0
            if w.sum() <= 0:
                rest = np.setdiff1d(np.arange(R), chosen)
                chosen.append(int(rng.choice(rest)))
                continue
            # the strongest partners first, with some chance (a random partner weighted by its trade)
            chosen.append(int(rng.choice(R, p=w / w.sum())))
        return np.array(sorted(chosen))
    if kind == "mix":
        home_load = np.bincount(own, weights=c, minlength=R)
        over = np.flatnonzero(home_load > goal_load)
        sent = np.bincount(own[dest != own], weights=L[dest != own], minlength=R)
        a = rng.choice(over, size=min(k // 2, over.size), replace=False, p=sent[over] / sent[over].sum()
                       if sent[over].sum() > 0 else None)
        load = np.bincount(dest, weights=c, minlength=R)
        roomy = np.setdiff1d(np.argsort(load)[: 4 * k], a)
        b = rng.choice(roomy, size=k - a.size, replace=False)
        return np.array(sorted(np.concatenate((a, b)).tolist()))
    pool = np.flatnonzero(active > 0)
    return np.array(sorted(rng.choice(pool, size=min(k, pool.size), replace=False).tolist()))


def lns(c, L, own, dest, micro, R, M, cap, goal_load, sizes, kinds, time_limit, budget, seed, log=None,
        max_iters=None, solver="highs", free_short=1.0, long_tokens=4096.0):
    """(dest, micro, history) after LNS from a valid plan: history rows (iteration, CPU s, k, kind,
    tokens sent, accepted). Stops after `budget` CPU seconds or `max_iters` neighbourhoods. Each neighbourhood
    frees its items away from home, those over `long_tokens`, and a `free_short` share of the rest drawn at
    random; the others stay in their slot."""
    rng = np.random.default_rng(seed)
    check_plan(c, L, own, dest, micro, R, M, cap, goal_load)
    sent = float(L[dest != own].sum())
    start = time.process_time()
    history = []
    it = 0
    while time.process_time() - start < budget and (max_iters is None or it < max_iters):
        k = sizes[it % len(sizes)]
        kind = kinds[(it // len(sizes)) % len(kinds)]
        ranks = pick_neighbourhood(kind, k, rng, c, L, own, dest, R, goal_load)
        fixed = None
        if free_short < 1.0:
            fixed = (dest == own) & (L <= long_tokens) & (rng.random(L.size) >= free_short)
        nd, nm, _, msg = solve_neighbourhood(c, L, own, dest, micro, ranks, M, cap, goal_load, time_limit,
                                             need_all_slots=L.size >= R * M, solver=solver, fixed=fixed)
        accepted = False
        if nd is not None:
            new_sent = float(L[nd != own].sum())
            if new_sent < sent:
                check_plan(c, L, own, nd, nm, R, M, cap, goal_load)
                dest, micro, sent, accepted = nd, nm, new_sent, True
        it += 1
        history.append((it, time.process_time() - start, k, kind, sent, accepted))
        if log is not None:
            log(it, time.process_time() - start, k, kind, sent, accepted, msg)
    return dest, micro, history


def describe(L, own, dest, micro, R, M, cap, long_tokens=8192.0):
    """One row of what a plan does: tokens sent (long items / short ones), items moved, ranks that send,
    receive and both, swaps (pairs of ranks that send to each other), slots nearly empty (< 1/8 cap) and the
    median free tokens of a slot."""
    T = float(L.sum())
    away = dest != own
    lg = L > long_tokens
    senders, receivers = np.unique(own[away]), np.unique(dest[away])
    pairs = set(zip(own[away].tolist(), dest[away].tolist()))
    swaps = sum(1 for a, b in pairs if a < b and (b, a) in pairs)
    free = cap - np.bincount(dest * M + micro, weights=L, minlength=R * M)
    return (f"{100 * L[away].sum() / T:.2f}% | {100 * L[away & lg].sum() / T:.2f}% ({int((away & lg).sum())}) | "
            f"{100 * L[away & ~lg].sum() / T:.2f}% ({int((away & ~lg).sum())}) | {senders.size} | {receivers.size} | "
            f"{np.intersect1d(senders, receivers).size} | {swaps} | {int((free > cap * 7 / 8).sum())} | "
            f"{np.median(free):.0f}")


DESCRIBE_HEAD = ("| plan | sent | long items sent (count) | short items sent (count) | ranks sending | receiving | "
                 "both | rank pairs trading both ways | slots < 1/8 full | median free tokens of a slot |\n"
                 "|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_full_cap_arguments(parser)
    parser.add_argument("--goal", type=float, default=1.01, help="every rank <= goal x bound")
    parser.add_argument("--ranks", default="8,12,16", help="neighbourhood sizes, cycled")
    parser.add_argument("--kinds", default="trade,mix,random")
    parser.add_argument("--time-limit", type=float, default=10.0, help="HiGHS seconds per neighbourhood")
    parser.add_argument("--budget", type=float, default=600.0, help="CPU seconds of LNS per instance")
    parser.add_argument("--solver", default="highs", choices=("highs", "milp"),
                        help="highs: HiGHS started from the current plan; milp: scipy.optimize.milp, no start")
    parser.add_argument("--free-short", type=float, default=1.0,
                        help="share of a neighbourhood's short items at home that may move (the rest stay in "
                             "their slot)")
    parser.add_argument("--long", type=float, default=4096.0, help="items over this many tokens always free")
    parser.add_argument("--save", default="", help="write the LNS plan (dest, micro) to this .npz")
    parser.add_argument("--verbose", action="store_true", help="HiGHS's status on each printed row")
    parser.add_argument("--every", type=int, default=10, help="print a row every this many iterations")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.ranks.split(",")]
    kinds = args.kinds.split(",")
    for R, M, L, own, mb, c, lb in bench.full_cap_cases(args):
        T = float(L.sum())
        plan = plan_step(c, own, mb, R, M, tokens=L, max_tokens=bench.PACK, sync="step", min_gain=0.0)
        goal_load = args.goal * lb
        slow0, sent0 = check_plan(c, L, own, plan.dest_rank, plan.dest_micro_batch, R, M, bench.PACK, goal_load)
        print(f"## {args.mix} {R} x {M}, {args.cost}, seed {args.seed}, goal {args.goal}: {L.size} items; "
              f"plan_step sends {100 * sent0 / T:.2f}% at {slow0 * args.goal:.4f} x bound\n")
        print("| iteration | CPU s | k | kind | tokens sent | accepted so far |\n|---|---|---|---|---|---|", flush=True)
        acc = [0]

        def log(it, secs, k, kind, sent, accepted, msg):
            acc[0] += accepted
            if it % args.every == 0 or it == 1:
                print(f"| {it} | {secs:.0f} | {k} | {kind} | {100 * sent / T:.2f}% | {acc[0]} |"
                      + (f" {msg}" if args.verbose else ""), flush=True)

        dest, micro, hist = lns(c, L, own, plan.dest_rank.copy(), plan.dest_micro_batch.copy(), R, M, bench.PACK,
                                goal_load, sizes, kinds, args.time_limit, args.budget, args.seed, log=log,
                                solver=args.solver, free_short=args.free_short, long_tokens=args.long)
        slow, sent = check_plan(c, L, own, dest, micro, R, M, bench.PACK, goal_load)
        by = {}
        for _, _, k, kind, _, ok in hist:
            by.setdefault((kind, k), [0, 0])
            by[(kind, k)][0] += 1
            by[(kind, k)][1] += ok
        print(f"\nLNS: {100 * sent / T:.2f}% sent (plan_step {100 * sent0 / T:.2f}%), slowest / bound "
              f"{slow * args.goal:.4f} (checked), {len(hist)} neighbourhoods, {hist[-1][1]:.0f} CPU s; accepted by "
              "kind and k: " + ", ".join(f"{kd} {k}: {a}/{n}" for (kd, k), (n, a) in sorted(by.items())))
        print("\n" + DESCRIBE_HEAD)
        print(f"| plan_step | {describe(L, own, plan.dest_rank, plan.dest_micro_batch, R, M, bench.PACK)} |")
        print(f"| LNS | {describe(L, own, dest, micro, R, M, bench.PACK)} |", flush=True)
        if args.save:
            np.savez(args.save, dest=dest, micro=micro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
