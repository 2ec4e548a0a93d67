"""A tighter floor on the tokens a full-cap plan sends: rank patterns priced by column generation.

`bench/planner_floor.py`'s MILP counts what a rank receives of the long items (over --big tokens) as an
integer count per length class at the class's fewest tokens and lowest cost. At q/l 1.4e-4 a class of
its 48 spans ~3% of a long item's length, so a received 30K sample is priced up to ~8K of cost below
its own, 3-13 x the whole tolerance of a rank (0.25-1% of the bound, ~600-2400): exact fills of a
rank's room, which is what makes a real plan dear, are nearly free there. This bench keeps every long
item whole and itself (no classes) and solves the relaxation by Dantzig-Wolfe decomposition:

- a pattern of rank r: the set of long items it ends with (its own kept, others received, each whole),
  the share of each of its own short items that leaves, and the tokens it receives of each short
  density class (priced at the class's lowest cost per token, as in the MILP); feasible when its load
  <= goal x bound, its tokens <= M x cap, and its long items could fit M slots by count (at most M
  items over cap / 2, 2M over cap / 3, 3M over cap / 4); its cost is the tokens of its own items that
  leave;
- the master LP: one convex combination of patterns per rank, every long item in >= 1 pattern (weight),
  every short class received >= sent; minimise the tokens sent.

Every real plan is a choice of one pattern per rank satisfying the master (each long item exactly once,
each class received = sent; a received item costs at least its class's lowest density), so the master's
optimum over all patterns is a floor. At every round the Lagrangian bound, the master's objective plus
each rank's most negative reduced cost (HiGHS's dual bound of the pricing MILP, so valid without solving
it exactly), is a floor too: the best one is printed. Columns start from plan_step's own plan (a feasible
point of the master with its tokens sent), so the master's objective is never above plan_step's.

    python bench/planner_dw.py [--sizes 512x4] [--goal 1.01] [--seed 0] [--rounds 40] [--time-limit 600]
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
from planner_floor import _classes  # noqa: E402

from hf_dp_balance.core.planner import plan_step  # noqa: E402


class Instance:
    """The items split into long (whole, by identity) and short (fractional, by density class)."""

    def __init__(self, c, L, own, R, M, cap, goal_load, big, small_classes):
        self.c, self.L, self.own, self.R, self.M, self.cap, self.G = c, L, own, R, M, cap, goal_load
        self.long = np.flatnonzero(L > big)  # master rows 0..nB-1, in this order
        self.nB = self.long.size
        self.row_of = np.full(L.size, -1)
        self.row_of[self.long] = np.arange(self.nB)
        sm = L <= big
        dens = c / L
        self.ks = _classes(dens, dens[sm].min(), dens[sm].max(), small_classes)
        self.Ks = small_classes
        d = np.full(self.Ks, np.inf)
        np.minimum.at(d, self.ks[sm], dens[sm])
        self.ds = np.where(np.isfinite(d), d, np.inf)  # an empty class cannot be received
        self.short_of = [np.flatnonzero(sm & (own == r)) for r in range(R)]
        self.long_of = [self.long[own[self.long] == r] for r in range(R)]
        self.total = float(L.sum())


def plan_columns(inst, dest):
    """One column per rank from a plan: its long items, its short classes' net tokens, its tokens sent."""
    cols = []
    L, ks = inst.L, inst.ks
    for r in range(inst.R):
        longs = inst.row_of[inst.long[dest[inst.long] == r]]
        net = np.zeros(inst.Ks)
        recv = np.flatnonzero((dest == r) & (inst.own != r) & (inst.row_of < 0))
        sent = np.flatnonzero((inst.own == r) & (dest != r) & (inst.row_of < 0))
        np.add.at(net, ks[recv], L[recv])
        np.subtract.at(net, ks[sent], L[sent])
        cost = float(L[(inst.own == r) & (dest != r)].sum())
        cols.append((r, longs, net, cost))
    return cols


def price(inst, r, alpha, beta, u_r, tol=1e-7, whole_short=False):
    """(lower bound on rank r's most negative reduced cost, column of the best pattern found or None)."""
    c, L, G, Tcap, M, cap = inst.c, inst.L, inst.G, inst.M * inst.cap, inst.M, inst.cap
    own_long = inst.long_of[r]
    others = inst.long[(alpha > tol) & (inst.own[inst.long] != r)]
    # a received long item heavier than the whole goal can never fit
    others = others[c[others] <= G]
    J = np.concatenate((own_long, others))
    S = inst.short_of[r]
    K = np.flatnonzero((beta > tol) & np.isfinite(inst.ds))
    nJ, nS, nK = J.size, S.size, K.size
    is_own = np.zeros(nJ, bool)
    is_own[:own_long.size] = True
    obj = np.concatenate((-alpha[inst.row_of[J]] - np.where(is_own, L[J], 0.0),
                          L[S] * (1.0 + beta[inst.ks[S]]), -beta[K]))
    const = float(L[own_long].sum()) - u_r
    base_load, base_tok = float(c[S].sum()), float(L[S].sum())
    A_load = np.concatenate((c[J], -c[S], inst.ds[K]))
    A_tok = np.concatenate((L[J], -L[S], np.ones(nK)))
    rows = [A_load, A_tok]
    ub = [G - base_load, Tcap - base_tok]
    for frac, count in ((0.5, M), (1.0 / 3.0, 2 * M), (0.25, 3 * M)):
        rows.append(np.concatenate(((L[J] > frac * cap).astype(float), np.zeros(nS + nK))))
        ub.append(count)
    A = np.vstack(rows)
    integrality = np.concatenate((np.ones(nJ), np.full(nS, 1.0 if whole_short else 0.0), np.zeros(nK)))
    upper = np.concatenate((np.ones(nJ + nS), np.full(nK, np.inf)))
    res = milp(obj, constraints=LinearConstraint(A, -np.inf, np.array(ub)), bounds=Bounds(0.0, upper),
               integrality=integrality, options={"mip_rel_gap": 1e-6, "time_limit": 20.0})
    if res.x is None:  # no pattern at all within the goal (cannot happen from a feasible start)
        return 0.0, None
    low = res.fun if res.status == 0 else getattr(res, "mip_dual_bound", res.fun)
    low = float(low) + const
    x = res.x
    xJ = x[:nJ] > 0.5
    fS = np.clip(x[nJ:nJ + nS], 0.0, 1.0)
    wK = np.maximum(x[nJ + nS:], 0.0)
    net = np.zeros(inst.Ks)
    np.subtract.at(net, inst.ks[S], L[S] * fS)
    np.add.at(net, K, wK)
    cost = float(L[own_long[~xJ[:own_long.size]]].sum() + (L[S] * fS).sum())
    col = (r, inst.row_of[J[xJ]], net, cost)
    return low, col


def reduced(col, alpha, beta, u):
    """Reduced cost of a column at the master's duals."""
    r, longs, net, cost = col
    return cost - float(alpha[longs].sum()) - float(beta @ net) - float(u[r])


def master(inst, cols, cap_long, cap_short):
    """Solve the master LP; (objective, alpha, beta, u)."""
    nB, Ks, R = inst.nB, inst.Ks, inst.R
    n = len(cols)
    ri, ci, vi = [], [], []
    for j, (r, longs, net, _) in enumerate(cols):
        ri.extend(longs.tolist())
        ci.extend([j] * longs.size)
        vi.extend([-1.0] * longs.size)
        nz = np.flatnonzero(net)
        ri.extend((nB + nz).tolist())
        ci.extend([j] * nz.size)
        vi.extend((-net[nz]).tolist())
    # artificial columns that cover a long item (a short class's token) at a price: they cap the duals
    # (alpha_i <= cap_long x L_i, beta_k <= cap_short), which a degenerate master otherwise sends to
    # thousands; the floor below is valid at any alpha, beta >= 0, so the caps only steer the search
    art = nB + Ks
    ri.extend(range(art))
    ci.extend(range(n, n + art))
    vi.extend([-1.0] * art)
    A_ub = sparse.csr_matrix((vi, (ri, ci)), shape=(nB + Ks, n + art))
    b_ub = np.concatenate((-np.ones(nB), np.zeros(Ks)))
    A_eq = sparse.csr_matrix((np.ones(n), ([col[0] for col in cols], np.arange(n))), shape=(R, n + art))
    cost = np.concatenate(([col[3] for col in cols], cap_long * inst.L[inst.long], np.full(Ks, cap_short)))
    res = linprog(cost, A_ub=A_ub, b_ub=b_ub, A_eq=A_eq, b_eq=np.ones(R), bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(res.message)
    m = -res.ineqlin.marginals
    master.theta = res.x[:n]  # the last solve's weights of the columns, and the artificials' share (read by main)
    master.artificial = float(cost[n:] @ res.x[n:])
    return float(res.fun), np.maximum(m[:nB], 0.0), np.maximum(m[nB:], 0.0), res.eqlin.marginals


def column_generation(inst, cols, rounds, time_limit, smoothing=0.7, cap_long=1.0, cap_short=1.0, whole_short=False,
                      log=None):
    """Column generation from `cols` (extended in place): (best Lagrangian floor, the last master's objective,
    its column weights). Wentges smoothing: the pricing duals lie between those of the best floor so far (the
    centre) and the master's, which a degenerate master makes swing wildly; the floor is valid at any
    alpha, beta >= 0. Stops when no column prices out, after `rounds`, or past `time_limit` CPU seconds."""
    centre_a, centre_b = np.zeros(inst.nB), np.zeros(inst.Ks)
    best = -np.inf
    t0 = time.process_time()
    for rnd in range(rounds):
        obj, alpha, beta, u = master(inst, cols, cap_long, cap_short)
        g = smoothing
        while True:
            a_s, b_s = g * centre_a + (1 - g) * alpha, g * centre_b + (1 - g) * beta
            lag = float(a_s.sum())
            new = []
            for r in range(inst.R):
                low, col = price(inst, r, a_s, b_s, 0.0, whole_short=whole_short)
                lag += low
                if col is not None and reduced(col, alpha, beta, u) < -1e-6:
                    new.append(col)
            if lag > best:
                best, centre_a, centre_b = lag, a_s, b_s
            if new or g == 0.0:
                break
            g = 0.0 if g < 0.05 else g / 2  # mispriced: toward the master's duals
        cols.extend(new)
        if log is not None:
            log(rnd, obj, lag, g, best, len(cols), time.process_time() - t0)
        if not new or time.process_time() - t0 > time_limit:
            break
    return best, obj, master.theta


def lagrangian(inst, alpha, beta):
    """(floor, supergradient in alpha, in beta, columns): the Lagrangian bound at (alpha, beta) >= 0,
    sum(alpha) + sum over ranks of the least reduced cost of a pattern (a lower bound of each pricing MILP)."""
    value = float(alpha.sum())
    cover = np.zeros(inst.nB)
    net = np.zeros(inst.Ks)
    cols = []
    for r in range(inst.R):
        low, col = price(inst, r, alpha, beta, 0.0)
        value += low
        if col is not None:
            cover[col[1]] += 1.0
            net += col[2]
            cols.append(col)
    return value, 1.0 - cover, -net, cols


def hats(x, knots):
    """Piecewise-linear hat functions of x on `knots` (n x len(knots)), summing to 1 inside."""
    x = np.clip(x, knots[0], knots[-1])
    out = np.zeros((x.size, len(knots)))
    j = np.clip(np.searchsorted(knots, x, side="right") - 1, 0, len(knots) - 2)
    w = (x - knots[j]) / (knots[j + 1] - knots[j])
    out[np.arange(x.size), j] = 1.0 - w
    out[np.arange(x.size), j + 1] += w
    return out


def param_search(inst, evals, time_limit, long_knots, short_knots, step, log):
    """Maximise the Lagrangian bound over alpha_i = sum theta_k hat_k(L_i) and beta = sum theta'_m hat_m(density
    of class) (theta >= 0), by Kelley's cutting planes in a box around the best point; every point's bound is
    a floor, the best is returned."""
    PhiA = hats(inst.L[inst.long], np.asarray(long_knots, float))
    dens = np.where(np.isfinite(inst.ds), inst.ds, 0.0)
    PhiB = hats(dens, np.asarray(short_knots, float))
    nA, nb = PhiA.shape[1], PhiB.shape[1]
    scale = np.concatenate((np.asarray(long_knots, float), np.ones(nb)))  # theta in units of tokens / per token
    theta = np.zeros(nA + nb)
    pts, vals, grads = [], [], []
    best, best_theta, box = -np.inf, theta, step
    t0 = time.process_time()
    for k in range(evals):
        alpha, beta = PhiA @ theta[:nA], PhiB @ theta[nA:]
        v, ga, gb, _ = lagrangian(inst, alpha, beta)
        g = np.concatenate((PhiA.T @ ga, PhiB.T @ gb))
        pts.append(theta.copy()); vals.append(v); grads.append(g)
        if v > best:
            best, best_theta = v, theta.copy()
        else:
            box *= 0.5
        log(k, v, best, theta, time.process_time() - t0)
        if time.process_time() - t0 > time_limit:
            break
        # cutting-plane model: max t, t <= v_j + g_j (theta - theta_j), theta in the box around the best
        n = theta.size
        A = np.hstack((-np.array(grads), np.ones((len(vals), 1))))
        b = np.array([vals[j] - grads[j] @ pts[j] for j in range(len(vals))])
        lo = np.maximum(best_theta - box * scale, 0.0)
        hi = best_theta + box * scale
        res = linprog(np.concatenate((np.zeros(n), [-1.0])), A_ub=A, b_ub=b,
                      bounds=list(zip(lo, hi)) + [(None, None)], method="highs")
        theta = res.x[:n] if res.status == 0 else best_theta
    return best, best_theta


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_full_cap_arguments(parser)
    parser.add_argument("--goal", type=float, default=1.01)
    parser.add_argument("--big", type=float, default=8192.0)
    parser.add_argument("--small-classes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--cap-long", type=float, default=1.0, help="alpha_i <= this x the item's tokens")
    parser.add_argument("--cap-short", type=float, default=1.0, help="beta_k <= this (per token)")
    parser.add_argument("--method", default="param", choices=("param", "cg"))
    parser.add_argument("--long-knots", type=int, default=7)
    parser.add_argument("--short-knots", type=int, default=4)
    parser.add_argument("--step", type=float, default=0.5, help="param: the first box, x each knot's scale")
    parser.add_argument("--save", default="", help="cg: .npy of that MILP's rank of every long item")
    parser.add_argument("--whole-short", action="store_true",
                        help="cg: a rank's own short items leave whole too (what it receives stays per class)")
    parser.add_argument("--smoothing", type=float, default=0.7, help="Wentges smoothing of the pricing duals")
    parser.add_argument("--time-limit", type=float, default=600.0, help="CPU seconds of rounds")
    args = parser.parse_args(argv)
    for R, M, L, own, mb, c, lb in bench.full_cap_cases(args):
        plan = plan_step(c, own, mb, R, M, tokens=L, max_tokens=bench.PACK, sync="step", min_gain=0.0)
        inst = Instance(c, L, own, R, M, bench.PACK, args.goal * lb, args.big, args.small_classes)
        T = inst.total
        sent = 100.0 * L[plan.dest_rank != own].sum() / T
        print(f"## {args.mix} {R} x {M}, {args.cost}, seed {args.seed}, goal {args.goal} x bound: {L.size} items, "
              f"{inst.nB} over {args.big:.0f} tokens; plan_step {sent:.2f}% at {plan.makespan_after / lb:.4f}\n")
        if args.method == "param":
            print("| evaluation | Lagrangian floor | best floor | theta (long: tokens; short: per token) | CPU s |\n"
                  "|---|---|---|---|---|")

            def log(k, v, b, theta, secs):
                print(f"| {k} | {100 * v / T:.2f}% | {100 * b / T:.2f}% | {np.round(theta, 3).tolist()} | {secs:.0f} |",
                      flush=True)

            dens = inst.ds[np.isfinite(inst.ds)]
            param_search(inst, args.rounds, args.time_limit, np.linspace(args.big, L.max(), args.long_knots),
                         np.geomspace(dens.min(), dens.max(), args.short_knots), args.step, log)
            continue
        cols = plan_columns(inst, plan.dest_rank)

        def log(rnd, obj, lag, g, best, ncols, secs):
            print(f"| {rnd} | {100 * obj / T:.2f}% | {100 * lag / T:.2f}% (smoothing {g:.2f}) | {100 * best / T:.2f}% | "
                  f"{ncols} | {secs:.0f} |", flush=True)

        print("| round | master LP (tokens sent) | Lagrangian floor | best floor | columns | CPU s |\n|---|---|---|---|---|---|")
        best, obj, theta = column_generation(inst, cols, args.rounds, args.time_limit, args.smoothing, args.cap_long,
                                             args.cap_short, args.whole_short, log)
        # the master's long items: the weight of each (item, rank), what they send, and each item's heaviest rank
        share = np.zeros((inst.nB, R))
        for w, (r, longs, _, _) in zip(theta, cols):
            if w > 1e-9:
                share[longs, r] += w
        home = own[inst.long]
        frac_sent = float((L[inst.long] * (1.0 - np.minimum(share[np.arange(inst.nB), home], 1.0))).sum())
        heaviest = np.argmax(share, axis=1)
        print(f"\nmaster LP: long items sent {100 * frac_sent / T:.2f}% (weighted); items whose heaviest rank is "
              f"not home {int((heaviest != home).sum())}, their tokens {100 * L[inst.long][heaviest != home].sum() / T:.2f}%; "
              f"items split over ranks {int(((share > 1e-6).sum(axis=1) > 1).sum())}")
        if args.save:
            np.save(args.save, heaviest)
        print(f"artificial columns (a long item or short token covered at its dual's cap) carry "
              f"{100 * master.artificial / T:.2f}% of the master's {100 * obj / T:.2f}%\n")
        start_load = np.bincount(own, weights=c, minlength=R)
        print("| long assignment | long items moved | their tokens | ranks sending long items (over the goal at the "
              "start) | receiving (over at the start) | both |\n|---|---|---|---|---|---|")
        for name, d in (("plan_step", plan.dest_rank[inst.long]), ("master LP, each item at its heaviest rank", heaviest)):
            mv = d != home
            send, recv = np.unique(home[mv]), np.unique(d[mv])
            over = start_load > inst.G
            print(f"| {name} | {int(mv.sum())} | {100 * L[inst.long][mv].sum() / T:.2f}% | {send.size} ({int(over[send].sum())} "
                  f"of {int(over.sum())}) | {recv.size} ({int(over[recv].sum())}) | {np.intersect1d(send, recv).size} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
