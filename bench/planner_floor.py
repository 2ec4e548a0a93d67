"""How few tokens can a full-cap plan send? A mixed-integer floor beside plan_step's tokens and trajectory.

At max_tokens = the pack length only exchanges help, and every token that changes rank is bytes on the
side network. `bench/planner.py --full-cap` prints `sent_floor` (each over-full rank's excess carried
by its densest items, nothing paid back): valid but loose. This bench solves a relaxation of "fewest
tokens sent such that every rank ends at or under goal x the bound" with HiGHS (scipy.optimize.milp):

- y_i: item i stays on its rank (binary for items over --big tokens, fractional below); the
  objective, sum of tokens_i (1 - y_i), is exactly the tokens a plan sends (a new micro-batch on
  the same rank sends nothing);
- what a rank receives: items of at most --big tokens as tokens of a density class (cost / token),
  each priced at its class's lowest density; longer items as an integer count per length class,
  each counted at its class's fewest tokens and lowest cost;
- every moved item is received by some rank; every rank ends with load <= goal x bound and
  tokens <= M x cap (the slot caps relaxed to the rank's).

Every real plan is a feasible point of it with the same objective, so its optimum is a floor on the
tokens any plan sends, and so is HiGHS's dual bound when the time limit stops it first (printed:
the floor is that bound; the best point of the relaxation found, when one is, is not a plan: it
moves short items fractionally and ignores slot caps). Then plan_step on the same
instance, with the share of tokens sent and slowest / bound after each of its full-cap stages.

    python bench/planner_floor.py [--sizes 512x4] [--goals 1.01,1.0025] [--time-limit 300]

`--given-long`: instead, plan_step's long items (over --big tokens) fixed where it put them and the short
items fractional as above (an LP, seconds): the floor on what the short items must send for that long
assignment, beside what plan_step's short items send, so that a plan's excess over the floor is split
between its long assignment and its short flow.
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
import planner as bench  # noqa: E402  (the full-cap instances and sent_floor of bench/planner.py)

from hf_dp_balance.core.planner import lower_bound, plan_step  # noqa: E402
from hf_dp_balance.core.planner import repack as _repack  # noqa: E402
from hf_dp_balance.core.planner.state import _State, _fullest  # noqa: E402


def _classes(values, lo, hi, count):
    """Class of each value on `count` geometric classes over [lo, hi]."""
    edges = np.geomspace(lo, hi * (1.0 + 1e-12), count + 1)
    return np.clip(np.searchsorted(edges, values, side="right") - 1, 0, count - 1)


def milp_floor(c, L, own, R, M, cap, goal_load, big, time_limit, big_classes=48, small_classes=100, whole_short=False):
    """(floor on tokens sent, HiGHS's incumbent or None, CPU s, message) of the relaxation above."""
    n = c.size
    dens = c / L
    isbig = L > big
    sm = ~isbig
    ks = _classes(dens, dens[sm].min(), dens[sm].max(), small_classes) if sm.any() else np.zeros(n, dtype=np.int64)
    kb = _classes(L, big, L.max(), big_classes) if isbig.any() else np.zeros(n, dtype=np.int64)
    Ks, Kb = small_classes, big_classes
    ds = np.zeros(Ks)  # lowest density of each small class (an empty class has no items to receive)
    d = np.full(Ks, np.inf)
    np.minimum.at(d, ks[sm], dens[sm])
    ds[np.isfinite(d)] = d[np.isfinite(d)]
    Lb, cb = np.full(Kb, np.inf), np.full(Kb, np.inf)  # fewest tokens and lowest cost of each long class
    np.minimum.at(Lb, kb[isbig], L[isbig])
    np.minimum.at(cb, kb[isbig], c[isbig])
    Lb[~np.isfinite(Lb)], cb[~np.isfinite(cb)] = 0.0, 0.0
    nzs, nzb = R * Ks, R * Kb
    N = n + nzs + nzb
    items = np.arange(n)
    zs, zb = n + np.arange(nzs), n + nzs + np.arange(nzb)
    r_s, k_s = np.repeat(np.arange(R), Ks), np.tile(np.arange(Ks), R)
    r_b, k_b = np.repeat(np.arange(R), Kb), np.tile(np.arange(Kb), R)
    rows = np.concatenate((own, r_s, r_b))
    cols = np.concatenate((items, zs, zb))
    load = sparse.csr_matrix((np.concatenate((c, ds[k_s], cb[k_b])), (rows, cols)), shape=(R, N))
    toks = sparse.csr_matrix((np.concatenate((L, np.ones(nzs), Lb[k_b])), (rows, cols)), shape=(R, N))
    # received = moved: small classes in tokens, long classes in items
    eq_s = sparse.csr_matrix((np.concatenate((L[sm], np.ones(nzs))),
                              (np.concatenate((ks[sm], k_s)), np.concatenate((items[sm], zs)))), shape=(Ks, N))
    eq_b = sparse.csr_matrix((np.ones(int(isbig.sum()) + nzb),
                              (np.concatenate((kb[isbig], k_b)), np.concatenate((items[isbig], zb)))), shape=(Kb, N))
    moved_s = np.bincount(ks[sm], weights=L[sm], minlength=Ks)
    moved_b = np.bincount(kb[isbig], minlength=Kb).astype(np.float64)
    constraints = [LinearConstraint(load, -np.inf, goal_load), LinearConstraint(toks, -np.inf, M * cap),
                   LinearConstraint(eq_s, moved_s, moved_s), LinearConstraint(eq_b, moved_b, moved_b)]
    integrality = np.zeros(N)
    integrality[items[isbig]] = 1
    if whole_short:  # every item stays or leaves whole (what a rank receives of short items stays per class)
        integrality[items] = 1
    integrality[zb] = 1
    upper = np.concatenate((np.ones(n), np.full(nzs + nzb, np.inf)))
    t = time.process_time()
    res = milp(np.concatenate((-L, np.zeros(nzs + nzb))), constraints=constraints, bounds=Bounds(np.zeros(N), upper),
               integrality=integrality, options={"time_limit": time_limit, "mip_rel_gap": 1e-3})
    t = time.process_time() - t
    # minimised: -(tokens kept home); a lower bound on it is the dual bound (the optimum when solved)
    low = res.fun if res.status == 0 else getattr(res, "mip_dual_bound", None)
    floor = None if low is None else float(L.sum() + low)
    incumbent = None if res.fun is None else float(L.sum() + res.fun)
    return floor, incumbent, t, res.message


def exact_floor(c, L, own, R, M, cap, goal_load, time_limit, ranks_out=None):
    """(floor, best plan's tokens sent or None, CPU s, message): every item on one rank (x_ir binary), every rank's
    load <= goal_load and tokens <= M x cap, at most M items over cap / 2, 2M over cap / 3, 3M over cap / 4 (what
    M slots of `cap` admit); only the slot caps themselves are relaxed. For small R (n x R binaries)."""
    n = c.size
    N = n * R
    i, r = np.repeat(np.arange(n), R), np.tile(np.arange(R), n)
    rows = [sparse.csr_matrix((np.ones(N), (i, np.arange(N))), shape=(n, N))]
    lo, hi = [np.ones(n)], [np.ones(n)]
    for w, top in ((c, goal_load), (L, M * cap)):
        rows.append(sparse.csr_matrix((w[i], (r, np.arange(N))), shape=(R, N)))
        lo.append(np.full(R, -np.inf)); hi.append(np.full(R, top))
    for frac, count in ((0.5, M), (1.0 / 3.0, 2 * M), (0.25, 3 * M)):
        sel = L[i] > frac * cap
        rows.append(sparse.csr_matrix((np.ones(int(sel.sum())), (r[sel], np.flatnonzero(sel))), shape=(R, N)))
        lo.append(np.full(R, -np.inf)); hi.append(np.full(R, float(count)))
    A = sparse.vstack(rows).tocsr()
    obj = np.where(r == own[i], 0.0, L[i])
    t = time.process_time()
    res = milp(obj, constraints=LinearConstraint(A, np.concatenate(lo), np.concatenate(hi)), bounds=Bounds(0, 1),
               integrality=np.ones(N), options={"time_limit": time_limit, "mip_rel_gap": 1e-3})
    t = time.process_time() - t
    low = res.fun if res.status == 0 else getattr(res, "mip_dual_bound", None)
    if ranks_out is not None and res.x is not None:  # the best point's rank of every item
        ranks_out[:] = np.argmax(res.x.reshape(n, R), axis=1)
    return (None if low is None else float(low)), (None if res.fun is None else float(res.fun)), t, res.message


def short_floor_given_long(c, L, own, dest, R, M, cap, goal_load, big, small_classes=100):
    """(tokens the long items send at `dest`, floor on what the short items must send then): the items over
    `big` tokens fixed at their rank in a plan (`dest`), every shorter item fractional as in `milp_floor`
    (received per density class at the class's lowest density, slot caps relaxed to M x cap): an LP. What the
    plan's short items send above it is what its short flow and trades lose for that long assignment."""
    n = c.size
    long_ = L > big
    at = np.where(long_, dest, own)  # the long items where the plan put them, the short ones at home
    dens = c / L
    ks = _classes(dens, dens[~long_].min(), dens[~long_].max(), small_classes)
    Ks = small_classes
    d = np.full(Ks, np.inf)
    np.minimum.at(d, ks[~long_], dens[~long_])
    ds = np.where(np.isfinite(d), d, 0.0)
    nzs = R * Ks
    N = n + nzs
    items, zs = np.arange(n), n + np.arange(nzs)
    r_s, k_s = np.repeat(np.arange(R), Ks), np.tile(np.arange(Ks), R)
    rows, cols = np.concatenate((at, r_s)), np.concatenate((items, zs))
    load = sparse.csr_matrix((np.concatenate((c, ds[k_s])), (rows, cols)), shape=(R, N))
    toks = sparse.csr_matrix((np.concatenate((L, np.ones(nzs))), (rows, cols)), shape=(R, N))
    sm = ~long_
    eq = sparse.csr_matrix((np.concatenate((L[sm], np.ones(nzs))), (np.concatenate((ks[sm], k_s)),
                                                                      np.concatenate((items[sm], zs)))), shape=(Ks, N))
    moved = np.bincount(ks[sm], weights=L[sm], minlength=Ks)
    lower = np.concatenate((long_.astype(np.float64), np.zeros(nzs)))  # long items stay where the plan put them
    upper = np.concatenate((np.ones(n), np.full(nzs, np.inf)))
    res = milp(np.concatenate((-L, np.zeros(nzs))), bounds=Bounds(lower, upper),
               constraints=[LinearConstraint(load, -np.inf, goal_load), LinearConstraint(toks, -np.inf, M * cap),
                            LinearConstraint(eq, moved, moved)])
    if res.x is None:
        return float(L[long_ & (dest != own)].sum()), None
    return float(L[long_ & (dest != own)].sum()), float((L * (1.0 - res.x[:n]))[sm].sum())


def trajectory(c, L, own, mb, R, M):
    """plan_step at a full cap, with (stage, slowest / bound, % tokens sent) after each full-cap stage
    (the stage functions of core/planner/repack.py wrapped to record, their results unchanged)."""
    lb = lower_bound(c, R)
    stages = []
    wrapped = {}
    for name in ("_long_first", "_ladder_trades", "_balance_incremental", "_trade", "_polish", "_send_home"):
        fn = getattr(_repack, name)
        wrapped[name] = fn

        def record(state, *args, _fn=fn, _name=name, **kw):
            out = _fn(state, *args, **kw)
            st = out if isinstance(out, _State) else state
            stages.append((_name + (" (near)" if kw.get("near") else ""), _fullest(st, np.full(R, lb)),
                           100.0 * L[st.dest != own].sum() / L.sum()))
            return out

        setattr(_repack, name, record)
    try:
        plan = plan_step(c, own, mb, R, M, tokens=L, max_tokens=bench.PACK, sync="step", min_gain=0.0)
    finally:
        for name, fn in wrapped.items():
            setattr(_repack, name, fn)
    return plan, stages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_full_cap_arguments(parser)
    parser.add_argument("--goals", default="1.01,1.0025")
    parser.add_argument("--big", type=float, default=8192.0, help="items over this many tokens are whole (integer)")
    parser.add_argument("--time-limit", type=float, default=300.0, help="HiGHS seconds per goal")
    parser.add_argument("--big-classes", type=int, default=48,
                        help="geometric length classes of the long items (each received at its fewest tokens and lowest cost)")
    parser.add_argument("--whole-short", action="store_true",
                        help="the short items too stay or leave whole (received still per density class)")
    parser.add_argument("--exact", action="store_true",
                        help="every item a binary per rank (small R): only the slot caps relaxed")
    parser.add_argument("--given-long", action="store_true",
                        help="instead of the MILP: the LP floor of the short items with plan_step's long items fixed")
    args = parser.parse_args(argv)
    for R, M, L, own, mb, c, lb in bench.full_cap_cases(args):
        T = float(L.sum())
        plan, stages = trajectory(c, L, own, mb, R, M)
        print(f"## {args.mix} {R} x {M}, {args.cost}: {L.size} items, {int((L > args.big).sum())} over {args.big:.0f} "
              f"tokens; before / bound {plan.makespan_before / lb:.4f}\n")
        sent = 100.0 * L[plan.dest_rank != own].sum() / T
        if args.given_long:
            short = 100.0 * L[(L <= args.big) & (plan.dest_rank != own)].sum() / T
            print("| goal (x bound) | long items sent (plan_step) | short items: LP floor given them | "
                  "short items sent (plan_step) | plan_step |\n|---|---|---|---|---|")
            for goal in (float(g) for g in args.goals.split(",")):
                long_sent, floor = short_floor_given_long(c, L, own, plan.dest_rank, R, M, bench.PACK, goal * lb,
                                                          args.big)
                shown = "infeasible" if floor is None else f"{100.0 * floor / T:.2f}%"
                print(f"| {goal} | {100.0 * long_sent / T:.2f}% | {shown} | {short:.2f}% | "
                      f"{sent:.2f}% at {plan.makespan_after / lb:.4f} |", flush=True)
            continue
        print("| goal (x bound) | sent_floor | MILP floor | best point of the relaxation found | HiGHS | plan_step |\n"
              "|---|---|---|---|---|---|")
        for goal in (float(g) for g in args.goals.split(",")):
            if args.exact:
                floor, best, secs, msg = exact_floor(c, L, own, R, M, bench.PACK, goal * lb, args.time_limit)
            else:
                floor, best, secs, msg = milp_floor(c, L, own, R, M, bench.PACK, goal * lb, args.big, args.time_limit,
                                                    big_classes=args.big_classes, whole_short=args.whole_short)
            loose = 100.0 * bench.sent_floor(c, L, own, R, goal * lb) / T
            shown = "none found" if floor is None else f"{100.0 * floor / T:.2f}%"
            point = "none" if best is None else f"{100.0 * best / T:.2f}%"
            print(f"| {goal} | {loose:.2f}% | {shown} | {point} | {secs:.0f} s CPU, {msg.split('(')[0].strip()} | "
                  f"{sent:.2f}% at {plan.makespan_after / lb:.4f} |", flush=True)
        print("\n| plan_step stage | slowest / bound | tokens sent |\n|---|---|---|")
        for name, full, share in stages:
            print(f"| {name} | {full:.4f} | {share:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
