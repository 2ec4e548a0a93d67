"""Digest of a broad set of plans: sha1 over plan_balance / plan_step / the reference greedy / plan_lookahead
outputs across seeds, rank counts, caps, speeds, prior loads, micro-batch counts and sync modes.

Run before and after a change that should not change plans: python bench/planner_digest.py
(620951a and the planner split: 6720 da4468e1...; the cap-repair change alters only plans whose start breaks the cap;
27df345: 6720 e229d4dd..., with lookahead e8ca8d85...; the full-cap trades, the moves budget and the repack's
renaming by tokens change it deliberately to 6720 f745e5d1..., with lookahead 75e41161...; trades that try
the large items nearest the cost a rank should shed first: 6720 61cebecb..., with lookahead 95bb1dd4...;
the cap repair's retry that swaps long items for smaller ones: 6720 b61fbf70..., with lookahead ce347000...;
without the second order of long items first, 3 plans differ: 6720 685c9de7..., with lookahead 1733c995...).
"""
import hashlib, sys
import numpy as np
from hf_dp_balance.core.planner import plan_balance, plan_step
from hf_dp_balance.apps.reference import plan_reference_greedy
from hf_dp_balance.core.lookahead import plan_lookahead, assign_slots

h = hashlib.sha1()
def feed(*arrs):
    for a in arrs:
        if isinstance(a, str):
            h.update(a.encode())
        else:
            a = np.asarray(a)
            h.update(str(a.dtype).encode()); h.update(np.ascontiguousarray(a).tobytes())

def mix(rng, n, kind):
    if kind == 0:
        return rng.integers(16, 2000, n).astype(float)
    if kind == 1:
        L = rng.lognormal(np.log(300), 0.9, n)
        v = rng.random(n) < 0.1
        return np.round(np.where(v, rng.uniform(3000, 8000, n), L)).clip(16, 8000)
    L = rng.lognormal(np.log(500), 1.2, n)
    return np.round(L).clip(16, 30000)

cnt = 0
for seed in range(40):
    rng = np.random.default_rng(seed)
    for R in (1, 2, 3, 8, 32, 97):
        kind = seed % 3
        n = int(rng.integers(0, 12 * R + 2))
        L = mix(rng, n, kind)
        c = L**2 / 53000 + L + 64
        own = rng.integers(0, R, n)
        spd = None if seed % 4 else rng.uniform(0.5, 1.5, R)
        prior = None if seed % 5 else rng.uniform(0, 2000, R)
        for capf in (None, 1.05, 1.3, 2.0):
            cap = None
            if capf is not None and n:
                cap = max(capf * L.sum() / R, L.max())
            try:
                p = plan_balance(c, own, R, tokens=L, max_tokens=cap, speeds=spd, prior_loads=prior,
                                 min_gain=[0.0, 0.02][seed % 2])
                feed(p.dest, p.reason, p.loads_after, np.float64(p.makespan_after), np.int64(p.moved))
            except ValueError as e:
                feed("E" + str(e))
            cnt += 1
            for M in (1, 2, 4):
                mb = rng.integers(0, M, n)
                capm = None if cap is None else max(cap / M, L.max() if n else 1)
                for sync in ("step", "micro_batch"):
                    try:
                        q = plan_step(c, own, mb, R, M, tokens=L, max_tokens=capm, speeds=spd, sync=sync,
                                      min_gain=[0.0, 0.02][seed % 2])
                        feed(q.dest_rank, q.dest_micro_batch, q.reason, q.loads_after, np.int64(q.moved))
                    except ValueError as e:
                        feed("E" + str(e))
                    cnt += 1
        if n and R > 1:
            r = plan_reference_greedy(c, own, R, tokens=L, max_token_ratio=1.2, skip_imbalance=0.0,
                                      skip_single_sample=False)
            feed(r.dest, r.reason, np.int64(r.moved))
            r = plan_reference_greedy(c, own, R)
            feed(r.dest, r.reason)
print(cnt, h.hexdigest())
for seed in range(10):
    rng = np.random.default_rng(100 + seed)
    n = 400
    L = np.round(rng.lognormal(np.log(500), 1.2, n)).clip(16, 8000).astype(np.int64)
    c = L**2 / 53000 + L + 64
    steps = np.sort(rng.integers(0, 12, n))
    ns = plan_lookahead(c, L, steps, 8, window=4, max_tokens=16000, threshold=[1.0, 0.5][seed % 2])
    feed(ns)
print("with lookahead", h.hexdigest())
