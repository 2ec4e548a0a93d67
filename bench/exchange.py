"""Exchange benchmark: steady state of BalancedLoader on real gloo ranks.

Each of R ranks (default 4) trains S steps of GA micro-batches. A micro-batch
is one fixed-length pack (2048 tokens: the 32K packs of the starting mix of
shared/WORKLOAD_STATS.md at scale 1/16, long-tail regime) of samples with real
payloads: `input_ids`, `labels` and, for image / video samples, Qwen2-VL
`pixel_values` rows (4 patch rows of 1176 float32 per LLM token, as the 2x2
merge makes them). The main thread simulates accelerator compute: it sleeps
for the predicted cost of each packed micro-batch (an accelerator leaves the
CPU free while it computes), then all-reduces a gradient-sized tensor on the
default gloo group (the DDP meeting point) while the exchange thread runs its
own collectives on the side group. Cost model: the 7B decoder shape
a*L^2 + b*L + c (attention = linear layers near 53K tokens), rescaled to the
1/16 lengths (a x 16, c / 16).

Reported, all measured in the same run:
* main-thread wait for the next step, as % of step wall time (target <= 1%),
  next to the thread's per-step work (gather + plan + exchange + pack) as % of
  step time: what the main thread would wait without the overlap;
* bytes moved per step by our plan vs the reference greedy's plan of the same
  steps (`plan_reference_greedy`, skip rules off), recomputed offline from the
  same deterministic data; target: at most a quarter;
* per-step thread times: gather, plan, payload exchange, packing.

Run:  python bench/exchange.py [--ranks 4] [--steps 40] [--compute sleep,busy] [--write docs/benchmarks/exchange.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


PACK = 2048
GA = 2
PATCH_DIM = 1176  # 3 channels x temporal 2 x 14 x 14
WARMUP = 3
COST = dict(quadratic=16.0 / 53000.0, linear=1.0, per_sample=4.0)
SECONDS_PER_COST = 0.25 / (PACK * 1.05)  # a pack of 2048 tokens computes in about 0.25 s


def rank_packs(rank: int, steps: int, seed: int):
    """Deterministic packs of one rank: list of micro-batches, each a list of (text_tokens, vision_tokens)."""
    from hf_dp_balance.testing.mix import plan_samples

    plans = plan_samples(steps * GA * 40, seed=seed * 1000 + rank, mix="long_tail", scale=1 / 16)
    packs, cur, used, k = [], [], 0, 0
    while len(packs) < steps * GA:
        p = plans[k]
        k += 1
        length = p["text_tokens"] + sum(p["vision_tokens"])
        if used + length > PACK and cur:
            packs.append(cur)
            cur, used = [], 0
        cur.append((p["text_tokens"], sum(p["vision_tokens"])))
        used += length
    return packs


def make_sample(text: int, vision: int, ident: int):
    import torch

    n = text + vision
    s = {"input_ids": torch.zeros(n, dtype=torch.int64), "labels": torch.zeros(n, dtype=torch.int64),
         "sample_id": ident}
    if vision:
        s["pixel_values"] = torch.empty(4 * vision, PATCH_DIM, dtype=torch.float32)
    return s


def _features(sample):
    return int(sample["input_ids"].numel()), int("pixel_values" in sample)


def _pack_lengths(samples):
    """Stand-in for PackedCollator: concatenates the token ids (the real packing work) and keeps the lengths."""
    import torch

    ids = torch.cat([s["input_ids"] for s in samples]) if samples else torch.zeros(1, dtype=torch.int64)
    return {"input_ids": ids[None], "lengths": [int(s["input_ids"].numel()) for s in samples]}


def _compute(seconds: float, mode: str, work) -> None:
    """Simulated compute of known length: `sleep` (an accelerator: the CPU stays free) or `busy` (CPU
    training: 128x128 matmuls until this thread has used `seconds` of CPU time)."""
    if mode == "sleep":
        time.sleep(seconds)
        return
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        work[0] = work[0] @ work[1]


def _rank_main(rank, world, steps, seed, prefetch, mode):
    import torch
    import torch.distributed as dist

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader

    packs = rank_packs(rank, steps, seed)

    def micro_batches():
        for m, pack in enumerate(packs):
            yield [make_sample(t, v, rank * 10**6 + m * 100 + i) for i, (t, v) in enumerate(pack)]

    model = CostModel(**COST)
    cfg = DPBalanceConfig(timeout_s=120, prefetch_steps=prefetch)
    loader = BalancedLoader(micro_batches(), cfg, gradient_accumulation_steps=GA, collator=_pack_lengths,
                            features_fn=_features, cost_model=model)
    grad = torch.zeros(2_000_000)  # 8 MB "gradient" all-reduced per step on the training group
    rows = []
    work = [torch.randn(128, 128) / 12.0, torch.randn(128, 128) / 12.0]
    t_prev = time.perf_counter()
    for step, batches in enumerate(loader.iter_steps()):
        for b in batches:  # the "accelerator": busy for the predicted cost of this packed micro-batch
            _compute(SECONDS_PER_COST * float(model.sample_costs(np.array(b["lengths"] or [0])).sum()), mode, work)
        dist.all_reduce(grad)
        (st,) = loader.pop_stats()
        now = time.perf_counter()
        rows.append(dict(step=step, wall=now - t_prev, wait=st.wait_s, gather=st.gather_s, plan=st.plan_s,
                         exchange=st.exchange_s, collate=st.collate_s, moved_bytes=st.moved_bytes,
                         moved=st.moved_samples, applied=st.applied, hash=st.plan_hash,
                         before=st.imbalance_before, after=st.imbalance_after))
        t_prev = now
    return rows


def offline_bytes(world: int, steps: int, seed: int):
    """Per step: (our plan's hash and moved bytes, the reference greedy's moved bytes), from the same data."""
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.core.codec import encoded_nbytes, sample_entries
    from hf_dp_balance.core.steps import plan_hash, slot_loads
    from hf_dp_balance.runtime.step_plan import token_cap
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.planner import plan_step
    from hf_dp_balance.apps.reference import plan_reference_greedy

    model = CostModel(**COST)
    cfg = DPBalanceConfig()
    packs = [rank_packs(r, steps, seed) for r in range(world)]
    size_cache = {}

    def nbytes(t, v):
        if (t, v) not in size_cache:
            size_cache[(t, v)] = encoded_nbytes(sample_entries(make_sample(t, v, 0)))
        return size_cache[(t, v)]

    out = []
    for s in range(steps):
        owners, micro, tokens, sizes = [], [], [], []
        for r in range(world):
            for m in range(GA):
                for t, v in packs[r][s * GA + m]:
                    owners.append(r), micro.append(m), tokens.append(t + v), sizes.append(nbytes(t, v))
        owners, micro, tokens, sizes = map(np.array, (owners, micro, tokens, sizes))
        costs = model.sample_costs(tokens)
        largest = int(slot_loads(tokens, owners, micro, world, GA).max())
        ours = plan_step(costs, owners, micro, world, GA, tokens=tokens,
                         max_tokens=token_cap(tokens, world * GA, cfg, largest), sync="step",
                         min_gain=cfg.min_gain, tolerance=cfg.move_tolerance)
        ref = plan_reference_greedy(costs, owners, world, tokens=tokens, max_token_ratio=1.2, skip_imbalance=0,
                                    skip_single_sample=False)
        ours_dest = ours.dest_rank if ours.applied else owners
        out.append(dict(hash=plan_hash(ours_dest, ours.dest_micro_batch if ours.applied else micro),
                        ours_bytes=int(sizes[owners != ours_dest].sum()),
                        ref_bytes=int(sizes[owners != ref.dest].sum()), total_bytes=int(sizes.sum()),
                        ref_moved=int((owners != ref.dest).sum())))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--compute", default="sleep,busy",
                    help="comma-separated simulated compute modes: sleep (accelerator), busy (CPU matmuls)")
    ap.add_argument("--write", default=None, help="also write the markdown report to this file")
    args = ap.parse_args(argv)

    from hf_dp_balance.testing.spawn import run_ranks

    offline = offline_bytes(args.ranks, args.steps, args.seed)
    modes = args.compute.split(",")
    version = _code_version()
    lines = [
        "# Exchange benchmark (bench/exchange.py)",
        "",
        f"Command: `python bench/exchange.py --ranks {args.ranks} --steps {args.steps} "
        f"--seed {args.seed} --prefetch {args.prefetch} --compute {args.compute}`",
        "",
        f"{args.ranks} gloo ranks on a shared 2-core CPU, GA={GA}, packs of {PACK} tokens (32K at scale 1/16, long-tail "
        f"mix), Qwen2-VL-shaped pixel payloads, an 8 MB all_reduce per step on the training group. Simulated compute "
        f"per packed micro-batch = its predicted cost: `sleep` models an accelerator (the CPU stays free for the "
        f"exchange thread), `busy` is CPU training (matmuls for that much thread CPU time: {args.ranks} ranks' main "
        f"threads and exchange threads share 2 cores). Steady state = steps {WARMUP}..{args.steps - 1}. "
        f"Code: {version}.",
        "",
    ]
    for mode in modes:
        t0 = time.perf_counter()
        results = run_ranks(_rank_main, args.ranks, args.steps, args.seed, args.prefetch, mode, timeout=900)
        lines += report(mode, results, offline, args, time.perf_counter() - t0)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    return 0


def _code_version() -> str:
    """HEAD commit, and whether the planner / loader / exchange differ from it (the numbers depend on them)."""
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_dp_balance/core/planner",
                                "hf_dp_balance/runtime/loader.py", "hf_dp_balance/runtime/step_rows.py",
                                "hf_dp_balance/runtime/step_stream.py", "hf_dp_balance/runtime/exchange.py",
                                "hf_dp_balance/core/codec.py", "hf_dp_balance/core/costing.py"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    changed = [d for d in dirty if d.endswith(".py")]
    return f"commit {head}" + (f" with uncommitted changes in {', '.join(changed)}" if changed else "")


def report(mode, results, offline, args, run_s):
    """Markdown lines for one compute mode."""
    steady = slice(WARMUP, args.steps)
    for s in range(args.steps):
        hashes = {results[r][s]["hash"] for r in range(args.ranks)}
        assert len(hashes) == 1, f"step {s}: ranks disagree on the plan"
        assert results[0][s]["hash"] == offline[s]["hash"], f"step {s}: offline plan differs from the run's"
    per_rank_wait, per_rank_work = [], []
    for r in range(args.ranks):
        rows = results[r][steady]
        wall = sum(x["wall"] for x in rows)
        per_rank_wait.append(100.0 * sum(x["wait"] for x in rows) / wall)
        per_rank_work.append(100.0 * sum(x["gather"] + x["plan"] + x["exchange"] + x["collate"] for x in rows) / wall)
    r0 = results[0][steady]
    med = lambda key: 1000.0 * float(np.median([x[key] for x in r0]))  # noqa: E731
    ours_b = np.array([o["ours_bytes"] for o in offline[steady]], dtype=float)
    ref_b = np.array([o["ref_bytes"] for o in offline[steady]], dtype=float)
    tot_b = np.array([o["total_bytes"] for o in offline[steady]], dtype=float)
    run_b = np.array([x["moved_bytes"] for x in r0], dtype=float)
    step_ms = 1000.0 * float(np.median([x["wall"] for x in r0]))
    return [
        f"## compute = {mode} (whole run {run_s:.0f} s including process start)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| median step wall time | {step_ms:.0f} ms |",
        f"| main-thread wait for the next step, % of step time (max over ranks) | {max(per_rank_wait):.2f}% "
        f"(per rank: {', '.join(f'{w:.2f}' for w in per_rank_wait)}) |",
        f"| thread work per step (gather+plan+exchange+pack), % of step time: the wait without overlap | "
        f"{max(per_rank_work):.1f}% (per rank: {', '.join(f'{w:.1f}' for w in per_rank_work)}) |",
        f"| per step, rank 0, median: gather / plan / exchange / pack | {med('gather'):.1f} / {med('plan'):.1f} / "
        f"{med('exchange'):.1f} / {med('collate'):.1f} ms |",
        f"| steps where the plan was applied | {sum(x['applied'] for x in r0)} / {len(r0)} |",
        f"| imbalance (predicted makespan / mean - 1), mean before -> after | "
        f"{np.mean([x['before'] for x in r0]):.3f} -> {np.mean([x['after'] for x in r0]):.3f} |",
        f"| payload per step (all samples) | {tot_b.mean() / 2**20:.1f} MiB |",
        f"| bytes moved per step: ours (measured in the run) | {run_b.mean() / 2**20:.2f} MiB |",
        f"| bytes moved per step: ours (offline, same plan) vs reference greedy | {ours_b.mean() / 2**20:.2f} MiB vs "
        f"{ref_b.mean() / 2**20:.2f} MiB: ratio {ours_b.sum() / max(ref_b.sum(), 1):.3f} |",
        f"| samples moved per step: ours vs reference greedy | "
        f"{np.mean([x['moved'] for x in r0]):.1f} vs {np.mean([o['ref_moved'] for o in offline[steady]]):.1f} |",
        "",
        "Plans identical on every rank at every step (hash compared) and equal to the offline plan_step of the same data.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main())
