"""Long items first (core/planner/assign.py) alone: this revision's against a git revision's, in ONE process.

The state that `repack._full_cap_trades` hands to `_assign_long` (long-tail mix, strongly quadratic cost,
a full cap, as `bench/planner.py --full-cap`) is captured once; then both revisions' `_assign_long` (the
search) and `_long_first` (placing the long items and the short flow) run on copies of it in turn,
and the minima of CPU time are printed with digests of what they made (they must be equal for a
speed-only change).

    python bench/planner_assign_ab.py --baseline main --size 2048x4 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planner as bench_planner  # noqa: E402
import planner_ab  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--size", default="2048x4")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import hf_dp_balance.core.planner as planner
    import hf_dp_balance.core.planner.assign as assign
    import hf_dp_balance.core.planner.repack as repack
    from hf_dp_balance.core.planner.state import _copy_state
    with tempfile.TemporaryDirectory() as tmp:
        planner_ab.load_baseline(args.baseline, tmp)
        old = importlib.import_module(planner_ab.BASE + ".core.planner.assign")
        R, M = (int(x) for x in args.size.split("x"))
        L, owners, micro = bench_planner.full_cap_instance("long-tail", R, M, 0)
        c = bench_planner.full_cap_costs(L, "strongly quadratic")
        captured = []
        search = assign._assign_long

        def capture(state, budget, tolerance, **kw):
            captured.append((_copy_state(state), budget.copy(), tolerance, kw))
            return search(state, budget, tolerance, **kw)

        repack._assign_long = capture
        planner.plan_step(c, owners, micro, R, M, tokens=L, max_tokens=bench_planner.PACK, sync="step", min_gain=0.0)
        repack._assign_long = search
        state, budget, tolerance, kw = captured[0]
        times = {"old": ([], []), "new": ([], [])}
        made = {"old": set(), "new": set()}
        for i in range(args.repeats):
            for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                module = old if name == "old" else assign
                start = time.process_time()
                assigned = module._assign_long(state, budget, tolerance, **kw)
                mid = time.process_time()
                twin = _copy_state(state)
                start_flow = time.process_time()
                module._long_first(twin, budget, tolerance, assigned)
                end = time.process_time()
                times[name][0].append(1e3 * (mid - start))
                times[name][1].append(1e3 * (end - start_flow))
                digest = hashlib.sha1(twin.dest.tobytes() + twin.micro.tobytes() + twin.load.tobytes()
                                      + assigned[1].tobytes()).hexdigest()[:12]
                made[name].add((digest, assigned[2]))
        print(f"long-tail {R} x {M}, strongly quadratic, {L.size} items: CPU ms, min of {args.repeats}")
        print(f"| | {args.baseline} | this |\n|---|---|---|")
        print(f"| search (`_assign_long`) | {min(times['old'][0]):.0f} | {min(times['new'][0]):.0f} |")
        print(f"| placing + short flow (`_long_first`) | {min(times['old'][1]):.0f} | {min(times['new'][1]):.0f} |")
        print("same:", "yes" if made["old"] == made["new"] and len(made["new"]) == 1 else "NO", sorted(made["new"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
