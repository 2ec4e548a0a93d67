"""A full-cap plan built from a relaxation, rounded to whole items and repaired by the planner's trades.

At max_tokens = the pack length (bench/planner.py --full-cap), a strongly quadratic cost and the
long-tail mix, plan_step sends ~21% of the step's tokens at 1.0025x the bound while a mixed-integer
floor (bench/planner_floor.py) says 9.0%. This bench tries the obvious next step:

1. an LP (scipy.optimize.linprog, HiGHS) that decides per rank which long items leave (a fraction
   y_i per item over --big tokens), how many long items of each length class (24 geometric) every
   rank receives, and how many short tokens of each density class (8) every rank sends and takes,
   minimising the tokens sent, with every rank at or under goal x bound and M x cap tokens (slot caps
   relaxed to the rank's; a class priced at its mean cost / tokens, so the LP conserves load);
   `relaxation(..., integer_s=S)` makes the long items whole (HiGHS milp, S seconds at most);
2. rounding: a long item leaves when y_i >= --threshold; dearest first, each goes to the first of
   the _TRIES ranks with the most of its class still to receive whose slot (most room first) can
   make room by paying back its densest short items (never moved before) into the slot the item
   left; then the LP's short flows, per class: a sender's items up to its amount into the takers'
   roomiest slots in turn;
3. repair: the full-cap pieces of core/planner (ladder trades, the incremental method, small-change
   trades, polish, sending home toward the original owners) on what rounding left above the goal.

Beside it, today's plan_step on the same instance: tokens sent, slowest / bound, CPU.

    python bench/planner_relax.py [--sizes 512x4] [--goals 1.0025,1.0] [--big 8192] [--threshold 0.5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planner as bench  # noqa: E402  (the full-cap instances of bench/planner.py)

from hf_dp_balance.core.planner import lower_bound, plan_step  # noqa: E402
from hf_dp_balance.core.planner.chain import _ladder_trades  # noqa: E402
from hf_dp_balance.core.planner.home import _send_home  # noqa: E402
from hf_dp_balance.core.planner.passes import _balance_incremental, _polish  # noqa: E402
from hf_dp_balance.core.planner.state import _Infeasible, _State, _fullest  # noqa: E402
from hf_dp_balance.core.planner.trade import _apply, _trade  # noqa: E402


_TRIES = 16  # receiving ranks tried per leaving long item


def _classes(values, lo, hi, count):
    edges = np.geomspace(lo, hi * (1.0 + 1e-12), count + 1)
    return np.clip(np.searchsorted(edges, values, side="right") - 1, 0, count - 1)


def relaxation(c, L, own, R, M, cap, goal_load, big, big_classes=24, short_classes=8, integer_s=0.0):
    """LP of the module docstring: (y per item (0 for short ones), received long items [R, Kb],
    long-class of each item, CPU s, HiGHS status)."""
    n = c.size
    isbig = L > big
    B = np.flatnonzero(isbig)
    S = np.flatnonzero(~isbig)
    nB = B.size
    kb = _classes(L[B], big, L.max(), big_classes)
    Kb = big_classes
    count_b = np.maximum(np.bincount(kb, minlength=Kb), 1)
    cb = np.bincount(kb, weights=c[B], minlength=Kb) / count_b  # a class's mean cost and tokens
    Lb = np.bincount(kb, weights=L[B], minlength=Kb) / count_b
    dens = c[S] / L[S]
    ks = _classes(dens, dens.min(), dens.max(), short_classes)
    Ks = short_classes
    # a class's density: its tokens' mean (sent and received alike, so the LP conserves load)
    d_lo = np.bincount(ks, weights=c[S], minlength=Ks) / np.maximum(np.bincount(ks, weights=L[S], minlength=Ks), 1.0)
    d_hi = d_lo
    avail = np.bincount(own[S] * Ks + ks, weights=L[S], minlength=R * Ks)  # short tokens per (rank, class)
    load0 = np.bincount(own, weights=c, minlength=R)
    tok0 = np.bincount(own, weights=L, minlength=R)
    # variables: y (nB) | received long [R, Kb] | short out [R, Ks] | short in [R, Ks]
    o_in, o_so = nB, nB + R * Kb
    o_si = o_so + R * Ks
    N = o_si + R * Ks
    r_b, k_b = np.repeat(np.arange(R), Kb), np.tile(np.arange(Kb), R)
    r_s, k_s = np.repeat(np.arange(R), Ks), np.tile(np.arange(Ks), R)
    rows = np.concatenate((own[B], r_b, r_s, r_s))
    cols = np.concatenate((np.arange(nB), o_in + np.arange(R * Kb), o_so + np.arange(R * Ks), o_si + np.arange(R * Ks)))
    load_v = np.concatenate((-c[B], cb[k_b], -d_lo[k_s], d_hi[k_s]))
    tok_v = np.concatenate((-L[B], Lb[k_b], -np.ones(R * Ks), np.ones(R * Ks)))
    A_ub = sparse.vstack([sparse.csr_matrix((load_v, (rows, cols)), shape=(R, N)),
                          sparse.csr_matrix((tok_v, (rows, cols)), shape=(R, N))]).tocsr()
    b_ub = np.concatenate((goal_load - load0, M * cap - tok0))
    # conservation: long items per class leave = received; short tokens per class out = in
    eq_rows = np.concatenate((kb, k_b, Kb + k_s, Kb + k_s))
    eq_vals = np.concatenate((np.ones(nB), -np.ones(R * Kb), np.ones(R * Ks), -np.ones(R * Ks)))
    A_eq = sparse.csr_matrix((eq_vals, (eq_rows, cols)), shape=(Kb + Ks, N))
    obj = np.concatenate((L[B], np.zeros(R * Kb), np.ones(R * Ks), np.zeros(R * Ks)))
    upper = np.concatenate((np.ones(nB), np.full(R * Kb, np.inf), avail, np.full(R * Ks, np.inf)))
    t = time.process_time()
    if integer_s > 0:  # long items whole (y binary, received counts integer): a MILP, `integer_s` s at most
        integrality = np.zeros(N)
        integrality[:o_so] = 1
        res = milp(obj, constraints=[LinearConstraint(A_ub, -np.inf, b_ub), LinearConstraint(A_eq, 0.0, 0.0)],
                   bounds=Bounds(np.zeros(N), upper), integrality=integrality,
                   options={"time_limit": integer_s, "mip_rel_gap": 1e-2})
        res.status = 0 if res.x is not None else 2
    else:
        res = linprog(obj, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=np.zeros(Kb + Ks),
                      bounds=np.stack((np.zeros(N), upper), axis=1), method="highs")
    t = time.process_time() - t
    y = np.zeros(n)
    recv = np.zeros((R, Kb))
    s_out = np.zeros((R, Ks))
    s_in = np.zeros((R, Ks))
    if res.status == 0:
        y[B] = res.x[:nB]
        recv = res.x[o_in:o_so].reshape(R, Kb)
        s_out = res.x[o_so:o_si].reshape(R, Ks)
        s_in = res.x[o_si:].reshape(R, Ks)
    klass = np.full(n, -1)
    klass[B] = kb
    short_class = np.full(n, -1)
    short_class[S] = ks
    flows = (s_out, s_in, short_class)
    return y, recv, klass, flows, t, res.status, (None if res.status else res.fun)


def round_shorts(state: _State, flows, moved):
    """The LP's short-token flows, per density class: each sending rank's items of the class (index
    order, never moved) up to its LP amount go to the receiving ranks in turn (most to take first),
    each into the receiver's roomiest slot when it fits there."""
    s_out, s_in, short_class = flows
    R, Ks = s_out.shape
    for k in range(Ks):
        senders = np.flatnonzero(s_out[:, k] > 1.0)
        takers = np.flatnonzero(s_in[:, k] > 1.0)
        if senders.size == 0 or takers.size == 0:
            continue
        take = s_in[takers, k].copy()
        items = np.flatnonzero((short_class == k) & ~moved)
        by_rank = items[np.argsort(state.dest[items], kind="stable")]
        starts = np.searchsorted(state.dest[by_rank], np.arange(R + 1))
        t = 0
        for r in senders.tolist():
            quota = s_out[r, k]
            for i in by_rank[starts[r]:starts[r + 1]].tolist():
                if quota <= 0 or t >= takers.size:
                    break
                tok = state.tokens[i]
                if tok > quota + 0.5 * tok:
                    continue
                l = int(takers[t])
                m = int(np.argmin(state.slot_tok[l]))
                if state.slot_tok[l, m] + tok > state.cap:
                    t += 1
                    continue
                _apply(state, np.asarray([i]), np.asarray([l]), np.asarray([m]))
                moved[i] = True
                quota -= tok
                take[t] -= tok
                if take[t] <= 0:
                    t += 1


def round_plan(state: _State, y, recv, klass, flows=None, threshold=0.5):
    """Step 2 of the module docstring, applied to `state` (whose slots are within the cap)."""
    R, M, cap = state.load.shape[0], state.M, state.cap
    leave = np.flatnonzero(y >= threshold)
    moved = np.zeros(state.costs.size, dtype=bool)
    # the short items of every slot, densest first (the pay-back order)
    slot = state.dest * state.M + state.micro
    short = np.flatnonzero(klass < 0)
    dens = state.costs[short] / state.tokens[short]
    o = np.lexsort((-dens, slot[short]))
    by_slot = short[o]
    starts = np.searchsorted(slot[by_slot], np.arange(R * M + 1))
    left = recv.copy()
    # dearest items first: they need the most room and the largest deficit
    for a in leave[np.argsort(-state.costs[leave], kind="stable")].tolist():
        k = klass[a]
        h, ma = int(state.dest[a]), int(state.micro[a])
        cand = np.flatnonzero(left[:, k] > 1e-9)
        cand = cand[cand != h]
        done = False
        # the ranks with the most of the class still to receive first, each slot with the most room first
        for l in cand[np.argsort(-left[cand, k], kind="stable")][:_TRIES].tolist():
            for m in np.argsort(state.slot_tok[l], kind="stable").tolist():
                need = state.slot_tok[l, m] + state.tokens[a] - cap
                s = l * M + m
                pool = by_slot[starts[s]:starts[s + 1]]
                pool = pool[~moved[pool] & (state.dest[pool] == l) & (state.micro[pool] == m)]
                take = np.searchsorted(np.cumsum(state.tokens[pool]), need) + 1 if need > 0 else 0
                if need > 0 and (take > pool.size):
                    continue
                back = pool[:take]
                if state.slot_tok[h, ma] - state.tokens[a] + state.tokens[back].sum() > cap:
                    continue
                _apply(state, np.asarray([a]), np.asarray([l]), np.asarray([m]))
                if back.size:
                    _apply(state, back, np.full(back.size, h), np.full(back.size, ma))
                    moved[back] = True
                moved[a] = True
                left[l, k] -= 1.0
                done = True
                break
            if done:
                break
    if flows is not None:
        round_shorts(state, flows, moved)
    return state


def repair(state: _State, start, budget, tolerance):
    """Step 3: the full-cap pieces of core/planner/repack.py's `_full_cap_trades`, sending home to `start`."""
    try:
        if _fullest(state, budget) > 1.0 + tolerance / 2.0:
            _ladder_trades(state, budget, tolerance)
            state = _balance_incremental(state, budget, tolerance, True)
            for _ in range(2):
                if _fullest(state, budget) <= 1.0 + tolerance:
                    break
                _ladder_trades(state, budget, tolerance, min_rate=0.0, near=True)
                state = _balance_incremental(state, budget, tolerance, True)
            _trade(state, budget, tolerance)
            state = _polish(state, budget, budget * (tolerance / 2.0), tolerance)
    except _Infeasible:
        pass
    _send_home(state, start, budget * min(1.0 + tolerance / 2.0, _fullest(state, budget)))
    return state


def relax_case(c, L, own, mb, R, M, goal, big, tolerance=0.005, threshold=0.5, integer_s=0.0):
    lb = lower_bound(c, R)
    budget = np.full(R, lb)
    T = float(L.sum())
    t0 = time.process_time()
    y, recv, klass, flows, t_lp, status, fun = relaxation(c, L, own, R, M, bench.PACK, goal * lb, big, integer_s=integer_s)
    load0 = np.bincount(own, weights=c, minlength=R)
    state = _State(c, L, float(bench.PACK), np.ones(R), own, mb, M, load0, 0)
    state = round_plan(state, y, recv, klass, flows, threshold)
    rounded = (_fullest(state, budget), 100.0 * L[state.dest != own].sum() / T)
    state = repair(state, own, budget, tolerance)
    t_all = time.process_time() - t0
    slot_tok = np.bincount(state.dest * M + state.micro, weights=L, minlength=R * M)
    assert slot_tok.max() <= bench.PACK + 1e-6, "a slot over the cap"
    done = (_fullest(state, budget), 100.0 * L[state.dest != own].sum() / T)
    lp = None if fun is None else 100.0 * fun / T
    return {"lp": lp, "lp_s": t_lp, "rounded": rounded, "done": done, "total_s": t_all, "status": status}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_full_cap_arguments(parser)
    parser.add_argument("--goals", default="1.0025,1.0")
    parser.add_argument("--big", type=float, default=8192.0)
    parser.add_argument("--integer-s", type=float, default=0.0, help="long items whole: a MILP of at most this many s")
    parser.add_argument("--threshold", type=float, default=0.5, help="a long item leaves when its LP share is at least this")
    args = parser.parse_args(argv)
    print("| size | LP goal (x bound) | LP tokens sent | LP CPU | rounded: slowest / bound, sent | after repair | "
          "all CPU | plan_step today |\n|---|---|---|---|---|---|---|---|")
    for R, M, L, own, mb, c, lb in bench.full_cap_cases(args):
        t = time.process_time()
        plan = plan_step(c, own, mb, R, M, tokens=L, max_tokens=bench.PACK, sync="step", min_gain=0.0)
        t = time.process_time() - t
        today = f"{plan.makespan_after / lb:.4f}, {100.0 * L[plan.dest_rank != own].sum() / L.sum():.1f}%, {1e3 * t:.0f} ms"
        for goal in (float(g) for g in args.goals.split(",")):
            out = relax_case(c, L, own, mb, R, M, goal, args.big, threshold=args.threshold,
                             integer_s=args.integer_s)
            lp = "infeasible" if out["lp"] is None else f"{out['lp']:.1f}%"
            print(f"| {R}x{M} | {goal} | {lp} | {1e3 * out['lp_s']:.0f} ms | {out['rounded'][0]:.4f}, "
                  f"{out['rounded'][1]:.1f}% | {out['done'][0]:.4f}, {out['done'][1]:.1f}% | "
                  f"{1e3 * out['total_s']:.0f} ms | {today} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
