"""Planner benchmark: no balancing vs the published greedy vs plan_balance / plan_step, side by side.

Instances: R ranks, M micro-batches per step, each micro-batch one 32K-token pack
filled in stream order from a long-tail multimodal length mix (the starting mix
of shared/WORKLOAD_STATS.md: 35% text-only, 55% one image, 10% video or
multi-image, plus a 1% tail of long documents / videos near the pack length in
the "long-tail" regime; nothing above 8K in the "bounded" regime).
Cost per sample: a*L^2 + b*L + c for a 7B decoder, in token-equivalents
(attention equals the linear layers near L = 53K; c = 64 per sample).

For every method: slowest rank / lower bound, items moved, planning time
(median of repeats of this thread's CPU time, same process, same instances). Run:

    python bench/planner.py [--quick] [--write docs/benchmarks/planner.md]

`--full-cap` instead: max_tokens = the pack length (fixed-length packing fills every slot, so
only exchanges help), cost q*L^2 + L with q/l = 1.9e-5 (7B-like) and 1.4e-4 (strongly
quadratic), plan_step(sync="step") against the planner of git revision `--baseline` (run from
a `git archive` of it in a child process, on the same seeded instances) and against the
published greedy per micro-batch. Reported: slowest / bound, % of the step's tokens that change
rank, CPU ms (time.process_time, min of repeats), and the floor: fewer tokens than any plan must send to end
within 1.01x the bound (`sent_floor`, a fractional-knapsack bound per over-full rank, nothing taken back).
A tighter floor, with whole long samples and the receivers' room (a mixed-integer relaxation, minutes of
HiGHS): bench/planner_floor.py.

    python bench/planner.py --full-cap [--baseline 27df345] [--sizes 512x4,2048x4,4096x8]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from hf_dp_balance.core.planner import lower_bound, plan_balance, plan_step
from hf_dp_balance.apps.reference import plan_reference_greedy

PACK = 32768
COST_A = 1.0 / 53000.0
COST_B = 1.0
COST_C = 64.0


def sample_lengths(rng: np.random.Generator, n: int, regime: str) -> np.ndarray:
    """LLM tokens per sample: text + vision tokens, long-tail or bounded regime."""
    text = rng.lognormal(np.log(300), 0.9, n)
    kind = rng.random(n)
    image = np.clip(rng.lognormal(np.log(700), 0.6, n), 64, 16384)
    video = rng.lognormal(np.log(5000), 0.6, n)
    vision = np.where(kind < 0.35, 0.0, np.where(kind < 0.90, image, video))
    length = text + vision
    if regime == "long-tail":
        tail = rng.random(n) < 0.01
        length = np.where(tail, rng.uniform(0.5, 1.0, n) * PACK, length)
        return np.clip(np.round(length), 16, PACK)
    return np.clip(np.round(length), 16, 8192)


def packed_step(rng: np.random.Generator, num_ranks: int, num_mb: int, regime: str):
    """(lengths, owners, micro_batches): R*M packs of <= 32K tokens filled in stream order."""
    slots = num_ranks * num_mb
    lengths = []
    slot_of = []
    s = 0
    fill = 0.0
    while s < slots:
        for L in sample_lengths(rng, 4096, regime).tolist():
            if fill + L > PACK:
                s += 1
                fill = 0.0
                if s == slots:
                    break
            lengths.append(L)
            slot_of.append(s)
            fill += L
    lengths = np.asarray(lengths)
    slot_of = np.asarray(slot_of, dtype=np.int64)
    # slot s -> (rank, micro-batch): consecutive packs go to consecutive ranks, as a sampler deals them
    return lengths, slot_of % num_ranks, slot_of // num_ranks


def sample_cost(lengths: np.ndarray) -> np.ndarray:
    return COST_A * lengths ** 2 + COST_B * lengths + COST_C


def timed(fn, repeats: int):
    """(result, median seconds): this thread's CPU time, so other processes' load does not count."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        times.append(time.thread_time() - t)
    return out, float(np.median(times))


def fixed_count_step(rng, num_ranks: int, per_rank: int, regime: str):
    """(lengths, owners): `per_rank` samples on every rank (the 512 ranks x 16 samples instance)."""
    lengths = sample_lengths(rng, num_ranks * per_rank, regime)
    return lengths, np.repeat(np.arange(num_ranks), per_rank)


def bench_balance(rng, num_ranks, regime, repeats, per_rank=None):
    """One micro-batch per step: plan_balance vs the reference on the same instance."""
    if per_rank is None:
        lengths, owners, _ = packed_step(rng, num_ranks, 1, regime)
    else:
        lengths, owners = fixed_count_step(rng, num_ranks, per_rank, regime)
    costs = sample_cost(lengths)
    cap = 1.2 * lengths.sum() / num_ranks
    if per_rank is not None:
        # unpacked ranks may already hold more than 1.2x the mean: the memory cap must admit the start
        cap = max(cap, float(np.bincount(owners, weights=lengths).max()))
    ours, t_ours = timed(lambda: plan_balance(costs, owners, num_ranks, tokens=lengths, max_tokens=cap,
                                              min_gain=0.0), repeats)
    ref_repeats = max(1, min(repeats, 3))
    ref, t_ref = timed(lambda: plan_reference_greedy(costs, owners, num_ranks, tokens=lengths, max_token_ratio=1.2,
                                                     skip_imbalance=0.0, skip_single_sample=False), ref_repeats)
    lb = ours.lower_bound
    return {
        "n": lengths.size, "lb": lb,
        "none": (ours.makespan_before / lb, 0, 0.0),
        "reference": (ref.makespan_after / lb, ref.moved, t_ref),
        "plan_balance": (ours.makespan_after / lb, ours.moved, t_ours),
    }


def bench_step(rng, num_ranks, num_mb, regime, repeats, sync):
    """M micro-batches per step: plan_step vs the reference applied per micro-batch."""
    lengths, owners, mbs = packed_step(rng, num_ranks, num_mb, regime)
    costs = sample_cost(lengths)
    cap = 1.2 * lengths.sum() / (num_ranks * num_mb)
    ours, t_ours = timed(lambda: plan_step(costs, owners, mbs, num_ranks, num_mb, tokens=lengths, max_tokens=cap,
                                           sync=sync, min_gain=0.0), repeats)

    def reference_per_micro_batch():
        rank = owners.copy()
        for m in range(num_mb):
            sel = np.flatnonzero(mbs == m)
            p = plan_reference_greedy(costs[sel], owners[sel], num_ranks, tokens=lengths[sel], max_token_ratio=1.2,
                                      skip_imbalance=0.0, skip_single_sample=False)
            rank[sel] = p.dest
        return rank

    ref_rank, t_ref = timed(reference_per_micro_batch, max(1, min(repeats, 2)))
    slot = np.bincount(ref_rank * num_mb + mbs, weights=costs, minlength=num_ranks * num_mb).reshape(num_ranks, num_mb)
    ref_obj = float(slot.sum(axis=1).max()) if sync == "step" else float(slot.max(axis=0).sum())
    lb = ours.lower_bound
    return {
        "n": lengths.size, "lb": lb,
        "none": (ours.makespan_before / lb, 0, 0.0),
        "reference": (ref_obj / lb, int(np.count_nonzero(ref_rank != owners)), t_ref),
        "plan_step": (ours.makespan_after / lb, ours.moved, t_ours),
    }


FULL_CAP_COSTS = {"7B-like": 1.9e-5, "strongly quadratic": 1.4e-4}


def full_cap_costs(lengths: np.ndarray, shape: str) -> np.ndarray:
    """Each item's cost q L^2 + L, q/l = FULL_CAP_COSTS[shape]: the cost of every full-cap bench."""
    return FULL_CAP_COSTS[shape] * lengths ** 2 + lengths


def add_full_cap_arguments(parser: argparse.ArgumentParser) -> None:
    """The instance options of the full-cap floor / relaxation / search benches (`full_cap_cases`)."""
    parser.add_argument("--sizes", default="512x4")
    parser.add_argument("--mix", default="long-tail")
    parser.add_argument("--cost", default="strongly quadratic", choices=sorted(FULL_CAP_COSTS))
    parser.add_argument("--seed", type=int, default=0)


def full_cap_cases(args):
    """(R, M, lengths, owners, micro_batches, costs, lower bound) for each R x M of `args.sizes`, from the
    options of `add_full_cap_arguments`."""
    for size in args.sizes.split(","):
        R, M = (int(x) for x in size.split("x"))
        L, own, mb = full_cap_instance(args.mix, R, M, args.seed)
        c = full_cap_costs(L, args.cost)
        yield R, M, L, own, mb, c, lower_bound(c, R)


def full_cap_instance(mix: str, num_ranks: int, num_mb: int, seed: int):
    """(lengths, owners, micro_batches) of R*M fixed-length 32K packs: the bench's long-tail regime
    (1% of samples 16K-32K) or the simulator's qwen2vl-sft mix (tails up to 16K)."""
    if mix == "long-tail":
        return packed_step(np.random.default_rng([seed, num_ranks, num_mb]), num_ranks, num_mb, "long-tail")
    from hf_dp_balance.apps import sim_runs

    samples, pack_of = sim_runs.draw_packed(mix, num_ranks * num_mb, PACK, np.random.default_rng([seed, num_ranks, num_mb]))
    return samples.tokens.astype(np.float64), pack_of % num_ranks, pack_of // num_ranks


def sent_floor(c, L, own, R, goal_load, room=None):
    """Fewest tokens any plan must send for every rank to end at or under `goal_load`. A rank over it
    by e sends tokens T of cost C(T), which is at most the fractional knapsack's (the rank's items densest
    first), so T is at least where that bound reaches e. Each sent item leaves one rank: the sum over ranks
    is a floor. `room` (tokens free on each rank) assumes more: that a rank takes back at least T - room
    tokens, at no less than the lowest cost per token of any item (as if it ended as full as it started).
    That does not hold in general (a rank may end emptier: the receivers' free tokens take what it sends;
    measured plans send less than that floor, e.g. qwen2vl-sft 2048 x 4, 7B-like), so the bench reports
    the floor without it (room None)."""
    if room is None:
        room = np.full(R, np.inf)
    load = np.bincount(own, weights=c, minlength=R)
    excess = load - goal_load
    sel = np.flatnonzero(excess[own] > 0)
    if sel.size == 0:
        return 0.0
    d = float((c / L).min())
    r, dens = own[sel], c[sel] / L[sel]
    o = np.lexsort((-dens, r))
    r, cs, ts, dens = r[o], c[sel][o], L[sel][o], dens[o]
    start = np.searchsorted(r, r, side="left")
    ct, cc = np.cumsum(ts), np.cumsum(cs)
    t_before = ct - ts - (ct - ts)[start]  # tokens / cost of the denser items of the same rank
    c_before = cc - cs - (cc - cs)[start]
    gain_before = c_before - d * np.maximum(t_before - room[r], 0.0)  # the bound on what T sheds, at T
    # the first item at which the bound reaches the excess; its segment grows at most at its density
    short = excess[r] - gain_before
    reach = short <= cs - d * np.maximum(t_before + ts - room[r], 0.0) + d * np.maximum(t_before - room[r], 0.0)
    for_rank = np.full(R, np.inf)
    cand = np.flatnonzero(reach & (short > 0))
    np.minimum.at(for_rank, r[cand], t_before[cand] + short[cand] / dens[cand])
    got = np.isfinite(for_rank)
    floor = float(for_rank[got].sum())
    # a rank whose items cannot shed its excess at all: all its items at least
    lacking = np.flatnonzero((excess > 0) & ~got)
    floor += float(np.bincount(own, weights=L, minlength=R)[lacking].sum())
    return floor


def full_cap_case(mix, R, M, shape, seed, repeats, with_reference):
    """One planner (whichever `hf_dp_balance` imports) on one full-cap instance:
    (slowest / bound, % tokens sent, min CPU ms, items), and the published greedy's if asked."""
    L, own, mb = full_cap_instance(mix, R, M, seed)
    c = full_cap_costs(L, shape)
    best, plan = np.inf, None
    for _ in range(repeats):
        t = time.process_time()
        plan = plan_step(c, own, mb, R, M, tokens=L, max_tokens=PACK, sync="step", min_gain=0.0)
        best = min(best, time.process_time() - t)
    out = {"items": int(L.size), "before": plan.makespan_before / plan.lower_bound,
           "ours": (plan.makespan_after / plan.lower_bound, 100.0 * L[plan.dest_rank != own].sum() / L.sum(),
                    1e3 * best, plan.path),
           "floor": 100.0 * sent_floor(c, L, own, R, 1.01 * plan.lower_bound) / L.sum()}
    if with_reference:
        t = time.process_time()
        rank = own.copy()
        for m in range(M):
            sel = np.flatnonzero(mb == m)
            p = plan_reference_greedy(c[sel], own[sel], R, tokens=L[sel], max_token_ratio=PACK * R / L[sel].sum(),
                                      skip_imbalance=0.0, skip_single_sample=False)
            rank[sel] = p.dest
        t = time.process_time() - t
        load = np.bincount(rank, weights=c, minlength=R)
        out["reference"] = (float(load.max()) / plan.lower_bound, 100.0 * L[rank != own].sum() / L.sum(), 1e3 * t, "")
    return out


def _baseline_results(rev: str, cases, repeats: int):
    """Run the cases with the planner of git revision `rev` (a `git archive` of its package, in a child
    process with only that on its path, so this process's planner is not the one imported)."""
    import json
    import os
    import subprocess
    import tempfile

    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.check_output(["git", "-C", root, "archive", rev, "hf_dp_balance"])
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        env = dict(os.environ, PYTHONPATH=tmp)
        code = ("import json, sys; sys.path.insert(0, %r); import planner as B; "
                "print(json.dumps([B.full_cap_case(*c, %d, False) for c in json.loads(sys.argv[1])]))"
                % (os.path.join(root, "bench"), repeats))
        got = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], env=env, check=True, cwd=tmp,
                             capture_output=True, text=True)
    return json.loads(got.stdout.strip().splitlines()[-1])


def full_cap_main(args) -> int:
    sizes = [tuple(int(x) for x in sz.split("x")) for sz in args.sizes.split(",")]
    cases = [[mix, R, M, shape, args.seed] for mix in ("long-tail", "qwen2vl-sft") for R, M in sizes
             for shape in FULL_CAP_COSTS]
    base = _baseline_results(args.baseline, cases, args.repeats)
    header = ("| mix | R x M | items | cost | before / bound | floor at 1.01x | planner | slowest / bound | tokens sent "
              "| CPU ms | path |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for case, old in zip(cases, base):
        mix, R, M, shape, _ = case
        new = full_cap_case(*case, args.repeats, (R, M) == sizes[0])
        first = len(rows)
        label = f"| {mix} | {R} x {M} | {new['items']} | {shape} | {new['before']:.4f} | {new['floor']:.1f}% |"
        for name, res in [("this", new["ours"]), (f"{args.baseline}", old["ours"])] + (
                [("published greedy", new["reference"])] if "reference" in new else []):
            rows.append(f"{label} {name} | {res[0]:.4f} | {res[1]:.1f}% | {res[2]:.0f} | {res[3]} |")
        speed = old["ours"][2] / max(new["ours"][2], 1e-9)
        sent = old["ours"][1] / max(new["ours"][1], 1e-9)
        rows.append(f"{label} ratio {args.baseline} / this | | {sent:.1f}x | {speed:.1f}x | |")
        print("\n".join(rows[first:]), flush=True)
    print(header + "\n" + "\n".join(rows))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--full-cap", action="store_true", help="max_tokens = pack length, two cost shapes, "
                        "against --baseline")
    parser.add_argument("--baseline", default="27df345", help="git revision of the planner to compare against")
    parser.add_argument("--sizes", default="512x4,2048x4,4096x8", help="R x M sizes for --full-cap")
    parser.add_argument("--repeats", type=int, default=3, help="--full-cap: CPU time = min of this many calls")
    parser.add_argument("--write", metavar="PATH", help="also write the markdown table to PATH")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.full_cap:
        return full_cap_main(args)
    rng = np.random.default_rng(args.seed)
    repeats = 3 if args.quick else 7
    sizes = [32, 512] if args.quick else [32, 128, 512]
    rows = []
    header = ("| regime | ranks | M | sync | items | method | slowest / lower bound | moved | plan time (ms) | speed-up vs reference |\n"
              "|---|---|---|---|---|---|---|---|---|---|")
    for regime in ("bounded", "long-tail"):
        for R in sizes:
            res = bench_balance(rng, R, regime, repeats)
            rows += _rows(regime, R, 1, "-", res)
            for sync in ("step", "micro_batch"):
                res = bench_step(rng, R, 4, regime, repeats, sync)
                rows += _rows(regime, R, 4, sync, res)
            print("\n".join(rows[-9:]), flush=True)
    for regime in ("bounded", "long-tail"):
        res = bench_balance(rng, 512, regime, repeats, per_rank=16)
        rows += _rows(regime + ", 16 samples/rank", 512, 1, "-", res)
        print("\n".join(rows[-3:]), flush=True)
    table = header + "\n" + "\n".join(rows)
    print(table)
    if args.write:
        cmd = "python bench/planner.py" + (" --quick" if args.quick else "") + f" --write {args.write}"
        with open(args.write, "w") as f:
            f.write("# Planner benchmark\n\n")
            f.write(f"Command: `{cmd}` (seed {args.seed}; plan time = median thread CPU time of {repeats} repeats "
                    "for plan_balance / plan_step, up to 3 for the reference; one process, same instances side by "
                    "side, `torch`-free numpy; a 2-core machine shared with other jobs).\n\n")
            f.write("Instances: 32K-token packs of the long-tail multimodal mix (bench/planner.py docstring); "
                    "token cap 1.2x the mean tokens per rank (per slot with M=4) for every method. "
                    "With M=4 the reference is run per micro-batch. Rows '16 samples/rank': 16 samples per rank "
                    "drawn from the mix without packing (up to 512 ranks x 16 samples); there plan_balance's cap is "
                    "max(1.2x mean, the fullest rank at the start), the reference keeps its 1.2x rule.\n\n")
            f.write(table + "\n")
    return 0


def _rows(regime, R, M, sync, res):
    ref_time = res["reference"][2]
    out = []
    for method in [k for k in res if k not in ("n", "lb")]:
        quality, moved, t = res[method]
        speedup = "" if method in ("none", "reference") or t <= 0 else f"{ref_time / t:.0f}x"
        out.append(f"| {regime} | {R} | {M} | {sync} | {res['n']} | {method} | {quality:.4f} | {moved} | "
                   f"{1e3 * t:.2f} | {speedup} |")
    return out


if __name__ == "__main__":
    sys.exit(main())
