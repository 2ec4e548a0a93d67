"""What the side channel costs a process at scale: file descriptors and group creation time, two versions side by side.

For each size P, R local gloo processes (R = P, or P x tp under a dp x tp mesh) each make a `BalanceSession`
(its side groups, the watchdog on), count their open file descriptors (`/proc/self/fd`) before, right after
the session is made, and after N steps of a balanced loader whose cost model is fitted from the step times
after 3 steps (so the fit's gather and publication run too). Each version runs in its own interpreter from
its own checkout (`--baseline`: a checkout of the library to compare, e.g. `git archive <commit>`; ours: this
checkout), with gloo's connections made at group creation (torch's default) and, with `--lazy`, only when
first used (`TORCH_GLOO_LAZY_INIT=1`). Creation is timed from a barrier of every process. Printed: per size the median over processes of the descriptors added by
creation and by the steps, the largest added on any process (rank 0 also serves the rendezvous store), and
the slowest process's creation time, with the ratio baseline / ours.

Run:  python bench/side_channel.py --baseline /tmp/main-checkout [--sizes 4 8 16 32] [--steps 20] [--tp 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GA = 2


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rank(rank, world, tp, steps):
    """One process: fds before / after creation / after the steps, creation seconds."""
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.loader import BalancedLoader, list_collate
    from hf_dp_balance.runtime.parallel import DataParallelGroup
    from hf_dp_balance.runtime.session import BalanceSession

    data_parallel, index = None, rank
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        data_parallel = DataParallelGroup.from_mesh(init_device_mesh("cpu", (world // tp, tp),
                                                                     mesh_dim_names=("dp", "tp")))
        index = data_parallel.index
    rng = np.random.default_rng(index)
    raw = [[{"input_ids": torch.zeros(int(rng.choice([8, 16, 200, 400])), dtype=torch.int32)}
            for _ in range(int(rng.integers(1, 4)))] for _ in range(steps * GA)]
    config = DPBalanceConfig(timeout_s=120, min_gain=0.0, warmup_steps=3, refit_every=0, prior=False)
    torch.distributed.barrier()  # every process arrived: the time below is creation, not start-up skew
    held = _fds()  # after the barrier: its own connections (lazy) are not the session's
    t0 = time.perf_counter()
    session = BalanceSession(config, data_parallel)
    created_s = time.perf_counter() - t0
    after_create = _fds()
    try:
        session.start(timing="thread_cpu", device_type="cpu")
        loader = session.add_loader(BalancedLoader(
            DataLoader(raw, batch_size=None, collate_fn=list_collate), config, gradient_accumulation_steps=GA,
            collator=lambda s: [int(x["input_ids"].numel()) for x in s],
            features_fn=lambda s: (int(s["input_ids"].numel()), 0), side_channel=session.side))
        for step, batches in enumerate(loader.iter_steps(), start=1):
            lengths = [n for b in batches for n in b]
            if session.fitter.end_step(step, lengths, float(sum(1e-6 * n * n for n in lengths))):
                session.publish()
        after_steps = _fds()
    finally:
        session.close()
    return {"held": held, "create": after_create - held, "steps": after_steps - held, "created_s": created_s}


def _worker(args) -> None:
    from hf_dp_balance.testing.spawn import run_ranks

    out = run_ranks(_rank, args.ranks, args.tp, args.steps, timeout=600, pg_timeout_s=300)
    print("RESULT " + json.dumps(out))


def _run(code: str, ranks: int, tp: int, steps: int, lazy: bool):
    env = {**os.environ, "PYTHONPATH": code, "OMP_NUM_THREADS": "1"}
    env.pop("TORCH_GLOO_LAZY_INIT", None)
    if lazy:
        env["TORCH_GLOO_LAZY_INIT"] = "1"
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--ranks", str(ranks), "--tp", str(tp),
           "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": " | ".join(tail)}


def _summary(rows) -> str:
    if isinstance(rows, dict):
        return f"failed ({rows['error'][-80:]})"
    create = sorted(r["create"] for r in rows)
    steps = sorted(r["steps"] for r in rows)
    return (f"{create[len(create) // 2]:>4} / {steps[len(steps) // 2]:>4} (max {max(steps):>4}), "
            f"{max(r['created_s'] for r in rows):6.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a checkout of the library to compare with (its root directory)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tp", type=int, default=1, help="processes per data-parallel index (a dp x tp mesh)")
    parser.add_argument("--lazy", choices=["both", "on", "off"], default="both")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--ranks", type=int)
    args = parser.parse_args()
    if args.worker:
        sys.path.insert(0, os.getcwd())
        _worker(args)
        return
    lazies = {"both": [False, True], "on": [True], "off": [False]}[args.lazy]
    versions = ([("baseline", args.baseline)] if args.baseline else []) + [("ours", HERE)]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.steps} steps; tp {args.tp}; "
          f"fds added: creation / after the steps (median over processes; max), slowest creation")
    for size in args.sizes:
        for lazy in lazies:
            line = [f"P={size:>3} x tp {args.tp} {'lazy ' if lazy else 'eager'}"]
            for name, code in versions:
                line.append(f"{name}: {_summary(_run(code, size * args.tp, args.tp, args.steps, lazy))}")
            print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
