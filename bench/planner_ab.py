"""plan_step at a full cap, this planner against the planner of a git revision in ONE process, calls alternating.

On a shared machine the load changes from minute to minute, so two runs made one after the other
compare the load as much as the planners. Here both planners sit in one process (the revision's
package is a `git archive` of it, renamed `hf_dp_balance_base`) and every instance is planned by
them in turn (old, new, new, old, ...): the minimum over the calls of each is the figure, the
median and maximum show the spread. Plans are compared too (sha1 of the destination ranks and
micro-batches, the loads after, path, reason and moved count): a speed-only change must give the
same plans. `--phases`: CPU time per phase of the call instead (each planner function's own time,
not its callees'; wrapping costs ~1-2%), minimum over the calls.

    python bench/planner_ab.py --baseline eff4fc4 [--sizes 512x4,2048x4,4096x8] [--repeats 7] [--phases]

Instances, costs and cap as `bench/planner.py --full-cap` (32K packs, max_tokens = 32768, min_gain=0,
cost q*L^2 + L with q/l = 1.9e-5 or 1.4e-4, mixes long-tail and qwen2vl-sft, seed 0).
CPU time: time.process_time.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import planner as bench_planner  # noqa: E402  (the instances of bench/planner.py --full-cap)

BASE = "hf_dp_balance_base"
# phase -> planner functions ("module.function", as this checkout names them) whose own CPU time counts
# toward it; a baseline that keeps one under another module is searched by the function's name
# (`resolve`); a name this checkout lacks stops the run (a renamed function must not read 0 silently),
# one the baseline lacks is named on stderr (its time counts in "plan_step itself" there)
PHASES = {
    "input checks": ["validation._as_item_values", "validation._as_index_array", "validation._check_tokens",
                     "validation._per_rank", "validation._check_count", "validation._check_fraction"],
    "step loads, bound, cap check": ["steps.slot_loads", "steps.step_makespan", "api._step_bound",
                                     "api._step_violation", "bounds._lower_bound"],
    "working state (build, copies)": ["state._State.__init__", "state._copy_state"],
    "pipeline: driver, path choice": ["pipeline._balance", "pipeline._full_cap_trades", "pipeline._full_cap_pass",
                                      "pipeline._trades_first", "pipeline._lumpy", "pipeline._choose"],
    "trades: set-up and round loop": ["trade._trade"],
    "trades: index sorts (by rank and cost)": ["trade_index._by_rank_and_cost"],
    "trades: rounds": ["trade._round", "trade_index._first_best", "trade._apply",
                       "trade_index._PayBack.search", "trade_index._PayBack.paid", "trade_index._ranges"],
    "ladder trades (chain.py)": ["chain._ladder_trades"],
    "long items first (assign.py)": ["assign._assign_long", "assign._long_first"],
    "incremental method, polish": ["passes._balance_incremental", "passes._polish", "passes._extra_passes"],
    "one-for-many exchanges (eject.py)": ["eject._eject"],
    "sending home (home.py)": ["home._send_home"],
    "repack fallback": ["repack._repack"],
}


def load_baseline(rev: str, into: str):
    """Import the planner of git revision `rev` as package `hf_dp_balance_base` (a renamed git archive)."""
    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
    archive = subprocess.check_output(["git", "-C", root, "archive", rev, "hf_dp_balance"])
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    os.rename(os.path.join(into, "hf_dp_balance"), os.path.join(into, BASE))
    for folder, _, files in os.walk(os.path.join(into, BASE)):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace("hf_dp_balance", BASE))
    sys.path.insert(0, into)
    return importlib.import_module(BASE + ".core.planner")


def plan_digest(p) -> str:
    h = hashlib.sha1()
    for a in (p.dest_rank, p.dest_micro_batch):
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(p.loads_after).tobytes())
    h.update(f"{p.path}|{p.reason}|{p.moved}".encode())
    return h.hexdigest()[:12]


def instrument(package: str):
    """Wrap the PHASES functions of `package` (in every planner module that holds them); returns the
    {qualified name: own CPU seconds} dict they add to."""
    own_time = collections.defaultdict(float)
    stack = []

    def wrap(name, fn):
        def timed(*args, **kwargs):
            stack.append(0.0)
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.process_time() - start
                own_time[name] += spent - stack.pop()
                if stack:
                    stack[-1] += spent
        return timed

    planner_pkg = importlib.import_module(package + ".core.planner")
    modules = {m.name: importlib.import_module(f"{package}.core.planner.{m.name}")
               for m in pkgutil.iter_modules(planner_pkg.__path__)}
    modules["steps"] = importlib.import_module(package + ".core.steps")
    wrapped = {}
    for qualified in (q for names in PHASES.values() for q in names):
        try:
            owner, attr = resolve(modules, qualified, strict=package != BASE)
        except KeyError as missing:
            if package != BASE:
                raise
            print(f"{missing.args[0]}: not timed in the baseline", file=sys.stderr)
            continue
        fn = getattr(owner, attr)
        wrapped[id(fn)] = wrap(qualified, fn)
        setattr(owner, attr, wrapped[id(fn)])
    # the names imported into other modules (from x import f) point at the same function objects
    for module in modules.values():
        for key, value in list(vars(module).items()):
            if id(value) in wrapped and callable(value):
                setattr(module, key, wrapped[id(value)])
    return own_time


def resolve(modules: dict, qualified: str, strict: bool):
    """(owner, attribute) of "module.function" or "module.Class.method" among `modules`; unless `strict`
    (a baseline), a function not in that module is looked up by its name in every module (one match).
    Raises KeyError naming the function when it is not found (or found more than once)."""
    module_name, *attr = qualified.split(".")
    module = modules.get(module_name)
    owner = module if module is None or len(attr) == 1 else getattr(module, attr[0], None)
    if owner is not None and callable(getattr(owner, attr[-1], None)):
        return owner, attr[-1]
    if not strict:
        found = []
        for m in modules.values():
            o = m if len(attr) == 1 else getattr(m, attr[0], None)
            fn = getattr(o, attr[-1], None) if o is not None else None
            if callable(fn) and getattr(fn, "__module__", None) == m.__name__:
                found.append((o, attr[-1]))
        if len(found) == 1:
            return found[0]
    raise KeyError(f"--phases: {qualified} is not a planner function of {next(iter(modules.values())).__name__}"
                   " (renamed or moved? update PHASES)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision of the planner to compare against")
    parser.add_argument("--sizes", default="4096x8", help="R x M sizes")
    parser.add_argument("--repeats", type=int, default=7, help="calls per planner and instance")
    parser.add_argument("--shapes", default=",".join(bench_planner.FULL_CAP_COSTS), help="cost shapes")
    parser.add_argument("--phases", action="store_true", help="CPU time per phase instead of per call")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = load_baseline(args.baseline, tmp)
        import hf_dp_balance.core.planner as new
        planners = {"old": old.plan_step, "new": new.plan_step}
        own = {"old": instrument(BASE), "new": instrument("hf_dp_balance")} if args.phases else None
        if not args.phases:
            print(f"| mix | R x M | cost | items | {args.baseline} CPU ms: min (median-max) | this: min (median-max) "
                  f"| {args.baseline} / this | same plan |\n|---|---|---|---|---|---|---|---|")
        for size in args.sizes.split(","):
            R, M = (int(x) for x in size.split("x"))
            for mix in ("long-tail", "qwen2vl-sft"):
                for shape in args.shapes.split(","):
                    L, owners, micro = bench_planner.full_cap_instance(mix, R, M, 0)
                    c = bench_planner.full_cap_costs(L, shape)
                    times = {"old": [], "new": []}
                    digests = {}
                    best_phase = {k: collections.defaultdict(lambda: np.inf) for k in planners}
                    for i in range(args.repeats):
                        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
                            if own:
                                own[name].clear()
                            start = time.process_time()
                            plan = planners[name](c, owners, micro, R, M, tokens=L, max_tokens=bench_planner.PACK,
                                                  sync="step", min_gain=0.0)
                            spent = time.process_time() - start
                            times[name].append(1e3 * spent)
                            digests.setdefault(name, set()).add(plan_digest(plan))
                            if own:
                                phase = {p: sum(own[name].get(q, 0.0) for q in qs) for p, qs in PHASES.items()}
                                phase["plan_step itself (the rest)"] = spent - sum(phase.values())
                                phase["total"] = spent
                                for p, v in phase.items():
                                    best_phase[name][p] = min(best_phase[name][p], v)
                    same = "yes" if digests["old"] == digests["new"] and len(digests["old"]) == 1 else "NO"
                    if own:
                        print(f"\n{mix}, {R} x {M}, {shape}, {L.size} items: own CPU ms per phase, min of "
                              f"{args.repeats} calls (minima: they do not add up to the total's); same plan: {same}")
                        print(f"| phase | {args.baseline} | this |\n|---|---|---|")
                        for p in best_phase["old"]:
                            o, n = 1e3 * best_phase["old"][p], 1e3 * best_phase["new"][p]
                            if max(o, n) >= 0.05:
                                print(f"| {p} | {o:.1f} | {n:.1f} |")
                        continue
                    o, n = np.array(times["old"]), np.array(times["new"])
                    print(f"| {mix} | {R} x {M} | {shape} | {L.size} | {o.min():.0f} ({np.median(o):.0f}-{o.max():.0f}) "
                          f"| {n.min():.0f} ({np.median(n):.0f}-{n.max():.0f}) | {o.min() / n.min():.2f}x | {same} |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
