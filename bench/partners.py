"""Plans within fixed partners (core/partners.py) beside the unconstrained plan_step and fixed blocks.

Instances: bench/planner.py's full-cap instances (mix qwen2vl-sft, R x M packs of 32K tokens,
max_tokens = 32K, cost q L^2 + L with the "7B-like" and "strongly quadratic" q), a new seeded step
for every step. Per size and cost shape, on step 0: the slowest rank over the lower bound, the % of
the step's tokens that change rank and the CPU ms (time.process_time, min of `--repeats`) of
  - unconstrained: `plan_step`, any rank to any rank;
  - fixed blocks: consecutive blocks of k ranks, each planned alone by `plan_step` (the crude bound);
  - partners: `plan_step_with_partners` with `partner_sets(R, k)`.
Then over `--steps` steps (seeds 0, 1, ...; a size may set its own, as 4096x8:50): the worst slowest
rank over the bound of any step, and the distinct peers each rank has sent to or received from (max and
median over ranks), for the unconstrained planner and for the partners. Run:

    python bench/partners.py [--sizes 64x4,512x4,4096x8] [--max-partners 64] [--steps 200] [--write PATH]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planner import FULL_CAP_COSTS, PACK, full_cap_costs, full_cap_instance  # noqa: E402

from hf_dp_balance.core.partners import partner_sets, plan_step_with_partners  # noqa: E402
from hf_dp_balance.core.planner import plan_step  # noqa: E402

MIX = "qwen2vl-sft"

HEADER = """# Plans within fixed partners

At DP 512-4,096 the exchange sends samples point to point on connections made on first use, and those
connections stay. The unconstrained planner picks new peers every step, so within a few hundred steps
a rank has met most of the world. With `max_partners` (default 64) each rank trades only with a fixed
set of at most k peers for the whole run (`hf_dp_balance/core/partners.py`): the other ranks of its
*node block* (whole nodes, at most k / 2 + 1 ranks) and of its *cross block* (the same size, one rank
from each of several node blocks). A step's first M / 2 micro-batches are planned inside node blocks,
the rest inside cross blocks, each block by `plan_step` with per-rank goals as speeds: the first stage
moves between node blocks' ranks the load that each cross block lacks, the second gives each rank the
load that completes its share. An item moves at most once, to a partner of its owner; caps stay hard.
Up to k + 1 ranks every rank partners every other and the plan is `plan_step`'s, bit for bit.

Below: mix `qwen2vl-sft`, a full cap (32K packs, `max_tokens` = 32K), the two cost shapes of
`bench/planner.py --full-cap`; step 0 for the quality, tokens sent and CPU; steps 0 to N - 1 (a new
seeded step each time) for the peers each rank has sent to or received from. "Fixed blocks of {k}":
consecutive blocks of {k} ranks, each planned alone (the crude way to bound partners).

"""


def fixed_blocks(c, L, own, mb, R, M, k):
    """Every block of k consecutive ranks planned alone: destinations (rank, micro-batch)."""
    rank, micro = own.copy(), mb.copy()
    block = own // k
    for b in range(-(-R // k)):
        sel = np.flatnonzero(block == b)
        size = min(k, R - b * k)
        p = plan_step(c[sel], own[sel] - b * k, mb[sel], size, M, tokens=L[sel], max_tokens=PACK, min_gain=0.0)
        rank[sel] = p.dest_rank + b * k
        micro[sel] = p.dest_micro_batch
    return rank, micro


def timed(fn, repeats):
    best, out = np.inf, None
    for _ in range(repeats):
        t = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t)
    return out, 1e3 * best


def slowest_over_bound(c, rank, R, bound):
    return float(np.bincount(rank, weights=c, minlength=R).max()) / bound


def run_size(R, M, k, steps, repeats):
    ps = partner_sets(R, k)
    rows = []
    met = {shape: {"free": np.zeros((R, R), dtype=bool), "partners": np.zeros((R, R), dtype=bool)}
           for shape in FULL_CAP_COSTS}
    worst = {shape: {"free": 0.0, "partners": 0.0} for shape in FULL_CAP_COSTS}
    for step in range(steps):
        L, own, mb = full_cap_instance(MIX, R, M, step)
        for shape in FULL_CAP_COSTS:
            c = full_cap_costs(L, shape)
            reps = repeats if step == 0 else 1
            free, t_free = timed(lambda: plan_step(c, own, mb, R, M, tokens=L, max_tokens=PACK, min_gain=0.0), reps)
            ours, t_ours = timed(lambda: plan_step_with_partners(c, own, mb, R, M, partners=ps, tokens=L,
                                                                 max_tokens=PACK, min_gain=0.0), reps)
            assert ps.allows(own, ours.dest_rank).all()
            assert np.bincount(ours.dest_rank * M + ours.dest_micro_batch, weights=L, minlength=R * M).max() <= PACK
            for name, plan in (("free", free), ("partners", ours)):
                moved = plan.dest_rank != own
                met[shape][name][own[moved], plan.dest_rank[moved]] = True
                met[shape][name][plan.dest_rank[moved], own[moved]] = True
                worst[shape][name] = max(worst[shape][name], plan.makespan_after / plan.lower_bound)
            if step == 0:
                (b_rank, _), t_blocks = timed(lambda: fixed_blocks(c, L, own, mb, R, M, k), reps)
                lb = free.lower_bound
                sent = lambda rank: 100.0 * L[rank != own].sum() / L.sum()  # noqa: E731
                rows.append({"R": R, "M": M, "items": int(L.size), "shape": shape, "steps": steps,
                             "before": free.makespan_before / lb,
                             "free": (free.makespan_after / lb, sent(free.dest_rank), t_free),
                             "blocks": (slowest_over_bound(c, b_rank, R, lb), sent(b_rank), t_blocks),
                             "partners": (ours.makespan_after / lb, sent(ours.dest_rank), t_ours)})
    for row in rows:
        for name in ("free", "partners"):
            peers = met[row["shape"]][name].sum(axis=1)
            row[name + "_peers"] = (int(peers.max()), float(np.median(peers)), worst[row["shape"]][name])
    return rows


def table(rows, k):
    out = ["| R x M | items | cost | before / bound | planner | slowest / bound | tokens sent | CPU ms "
           "| steps | worst slowest / bound of any step | distinct peers per rank after the steps (max / median) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        label = f"| {row['R']} x {row['M']} | {row['items']} | {row['shape']} | {row['before']:.4f} |"
        for name, title in (("free", "unconstrained plan_step"), ("blocks", f"fixed blocks of {k}"),
                            ("partners", f"partners, k = {k}")):
            q, sent, ms = row[name]
            peers = row.get(name + "_peers")
            over = f"{peers[2]:.4f}" if peers else ""
            peers = f"{peers[0]} / {peers[1]:.0f}" if peers else f"<= {k - 1} (by construction)"
            out.append(f"{label} {title} | {q:.4f} | {sent:.2f}% | {ms:.0f} | {row['steps']} | {over} | {peers} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64x4,512x4,4096x8", help="R x M[:steps], comma-separated")
    parser.add_argument("--max-partners", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200, help="steps (new seeded instances) for the peer counts")
    parser.add_argument("--repeats", type=int, default=3, help="CPU time of step 0 = min of this many calls")
    parser.add_argument("--write", metavar="PATH", help="also write the markdown table to PATH")
    args = parser.parse_args(argv)
    rows = []
    for size in args.sizes.split(","):
        size, _, steps = size.partition(":")
        R, M = (int(x) for x in size.split("x"))
        got = run_size(R, M, args.max_partners, int(steps or args.steps), args.repeats)
        print(table(got, args.max_partners), flush=True)
        rows += got
    text = table(rows, args.max_partners)
    print(text)
    if args.write:
        cmd = " ".join(["python bench/partners.py"] + (argv if argv is not None else sys.argv[1:]))
        with open(args.write, "w") as f:
            f.write(HEADER.format(k=args.max_partners))
            f.write(f"Command: `{cmd}` ({datetime.date.today().isoformat()}; CPU ms = time.process_time, min of "
                    f"{args.repeats} calls on step 0, one thread, a 2-core machine shared with other jobs).\n\n")
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
