"""Long-tail simulator steps: where plan_balance needs its one-for-many exchanges and the partial repack.

Per step, side by side in one process: plan_balance and the reference greedy held to the same cap
(skip rules off); counts the exchange tries and repacks by wrapping the private helpers, and prints
the markdown table of docs/benchmarks/planner.md. Run: python bench/planner_fallback.py
"""
import time
import numpy as np
import scipy.optimize  # noqa: F401  (imported once by the first repack; excluded from the per-plan times)
import hf_dp_balance.core.planner as P
from hf_dp_balance.core.planner import passes, repack
from hf_dp_balance.apps import sim_model, sim_runs
from hf_dp_balance.apps.reference import plan_reference_greedy

calls = {"repack": 0, "eject": 0}
for module, name in ((repack, "repack"), (passes, "eject")):
    def wrap(fn, name=name):
        def inner(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return inner
    setattr(module, "_" + name, wrap(getattr(module, "_" + name)))
cost = sim_model.load_cost("7b")
print("| DP | step | items | before / LB | plan_balance / LB | moved | exchanges | repacks | plan_balance ms | reference capped / LB | reference moved | reference ms |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for dp in (64, 512):
    samples, pack_of = sim_runs.draw_packed("qwen2vl-sft", 8 * dp, 32768, np.random.default_rng([0, dp]))
    c_all, tok_all = cost.costs(samples), samples.tokens
    for step in range(8):
        m = pack_of // dp == step
        c, tok, own = c_all[m], tok_all[m], pack_of[m] % dp
        calls.update(repack=0, eject=0)
        t = time.thread_time()
        p = P.plan_balance(c, own, dp, tokens=tok, max_tokens=32768)
        t = time.thread_time() - t
        got = dict(calls)
        t2 = time.thread_time()
        r = plan_reference_greedy(c, own, dp, tokens=tok, max_token_ratio=32768 * dp / tok.sum(),
                                  skip_imbalance=0.0, skip_single_sample=False)
        t2 = time.thread_time() - t2
        lb = p.lower_bound
        print(f"| {dp} | {step} | {c.size} | {p.makespan_before / lb:.4f} | {p.makespan_after / lb:.4f} | {p.moved} | "
              f"{got['eject']} | {got['repack']} | {1e3 * t:.1f} | {r.makespan_after / lb:.4f} | {r.moved} | {1e3 * t2:.1f} |")
