"""Fault matrix on real gloo processes: every fault after balancing switched on, a hard timeout around every run.

Each run: 3 ranks train a tiny Qwen2-VL through `BalancedLoader` (real samples, `PackedCollator`) and
`balance_vision_encoder`, ending every step in a default-group all_reduce of the gradients (DDP's place;
the default group's timeout is 300 s, as a long `ddp_timeout`); the step runs inside
`runtime.watchdog.training_errors`, as Trainer's `training_step` and DPBalancer's `accelerator.backward`
do. At step FAULT_STEP one fault is injected: SIGKILL / SIGSTOP of a rank (0 = the store's host, 2 = a
plain peer) in the forward, in the exchange thread (inside the collator) or inside the vision tower; a
dataset item raising; a sample over the hard cap; the planner raising on the planning rank (rank 0: a step's
plan is made there once and sent, so no rank can follow another plan); with `lookahead_steps=3`, where
every rank plans the window, the look-ahead planner raising or planning another window on one rank
(the window of steps FAULT_STEP..FAULT_STEP+2). For every surviving rank the table gives how it ended,
the seconds from the fault to its end and the first line of its message.

    PYTHONPATH=$PWD python bench/reliability.py [--write docs/reliability.md] [--only NAME]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time

TIMEOUT_S = 5.0
FAULT_STEP = 3
WORLD = 3
RUN_LIMIT_S = 150.0


def _faults():
    kills = [(f"{sig} rank {victim} in the {place}", place, victim, sig)
             for place in ("forward", "exchange thread", "vision tower") for victim in (0, 2)
             for sig in ("SIGKILL", "SIGSTOP")]
    text = [(f"{sig} rank {victim} in the forward, no vision balancing", "forward text", victim, sig)
            for victim, sig in ((0, "SIGSTOP"), (2, "SIGSTOP"), (0, "SIGKILL"), (2, "SIGKILL"))]
    return kills + text + [("dataset __getitem__ raises on rank 1", "getitem", 1, None),
                    ("sample over the cap on rank 1", "cap", 1, None),
                    ("planner raises on rank 0 (the planning rank)", "planner raises", 0, None),
                    ("look-ahead planner raises on rank 1", "look-ahead raises", 1, None),
                    ("look-ahead plan differs on rank 1", "look-ahead differs", 1, None)]


def _mark(outdir):
    with open(os.path.join(outdir, "fault_time"), "w") as f:
        f.write(repr(time.time()))


def _hit(outdir, victim, sig):
    """The fault itself on the victim: note the time, then signal this process."""
    _mark(outdir)
    os.kill(os.getpid(), getattr(signal, sig))


class _Samples:
    """Per-rank micro-batches of real samples; on `bad` (step, rank) a dataset item raises or is over the cap."""

    def __init__(self, rank, steps, ga, place, outdir):
        from hf_dp_balance.testing.data import make_samples

        kinds = ("text",) * 8 if place == "forward text" else ("text", "image", "multi_image", "text") * 2
        self.items = make_samples("qwen2_vl", kinds, seed=rank, vision_tokens=24 + 24 * rank,
                                  text_tokens=24 + 8 * rank)
        self.long = make_samples("qwen2_vl", ("text",), seed=9, text_tokens=2000)[0]  # over the cap on its own
        self.rank, self.steps, self.ga, self.place, self.outdir = rank, steps, ga, place, outdir

    def __iter__(self):
        for i in range(self.steps * self.ga):
            mb = [dict(self.items[(2 * i + k) % len(self.items)]) for k in range(2)]
            if i // self.ga == FAULT_STEP and self.rank == 1 and self.place in ("getitem", "cap"):
                _mark(self.outdir)
                if self.place == "getitem":
                    raise IndexError("dataset item 17 is unreadable")
                mb[1] = dict(self.long)
            yield mb


def _planner(rank, place, outdir):
    from hf_dp_balance.core.planner import plan_step

    calls = [0]

    def plan_fn(costs, owners, micro, world, num_micro, **kw):
        plan = plan_step(costs, owners, micro, world, num_micro, **kw)
        calls[0] += 1
        # the planner runs in the planning rank's exchange thread, one step ahead
        if calls[0] - 1 == FAULT_STEP and place == "planner raises" and rank == 0:
            _mark(outdir)
            raise RuntimeError("planner exploded")
        return plan

    return plan_fn


def _collator(model_config, max_tokens, rank, place, outdir, victim, sig):
    """`PackedCollator`, killing the victim in its exchange thread when it packs step FAULT_STEP."""
    from hf_dp_balance.core.packing import PackedCollator

    collate, calls = PackedCollator(model_config, max_tokens=max_tokens), [0]

    def collator(samples):
        calls[0] += 1
        if place == "exchange thread" and rank == victim and calls[0] - 1 == FAULT_STEP * 2:  # GA 2
            _hit(outdir, victim, sig)
        return collate(samples)

    return collator


def _patch_lookahead(rank, place, outdir):
    """On rank 1, the look-ahead planner's window starting at FAULT_STEP raises or plans another window."""
    import numpy as np

    from hf_dp_balance.core import lookahead

    real, calls = lookahead.plan_lookahead, [0]

    def plan_lookahead(costs, tokens, steps, num_ranks, *, window, **kw):
        new_step = real(costs, tokens, steps, num_ranks, window=window, **kw)
        calls[0] += 1
        if rank == 1 and calls[0] - 1 == FAULT_STEP // window:
            _mark(outdir)
            if place == "look-ahead raises":
                raise RuntimeError("look-ahead planner exploded")
            return (np.asarray(new_step) + 1) % window
        return new_step

    lookahead.plan_lookahead = plan_lookahead  # this rank process only; read by BalancedLoader per window


def _rank(rank, world, place, victim, sig, outdir):
    import torch
    import torch.distributed as dist

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.runtime.watchdog import training_errors
    from hf_dp_balance.testing import models

    err = os.open(os.path.join(outdir, f"stderr_{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    model = models.make_model("qwen2_vl", seed=0)
    model.config.text_config.use_cache = False
    dist.barrier()  # model set-up skews the ranks by seconds on a loaded machine: the side groups' rendezvous
    cfg = DPBalanceConfig(timeout_s=TIMEOUT_S, prefetch_steps=2, min_gain=0.0, vision=place != "forward text",
                          max_tokens=1500 if place == "cap" else None,
                          lookahead_steps=3 if place.startswith("look-ahead") else 0)
    if place.startswith("look-ahead"):
        _patch_lookahead(rank, place, outdir)
    balancer = balance_vision_encoder(model, cfg)._dp_balance_vision if cfg.vision else None
    if place == "vision tower" and rank == victim:
        def pre_hook(module, args, kwargs):
            if balancer.forwards > FAULT_STEP * 2:
                _hit(outdir, victim, sig)
        model.model.visual.register_forward_pre_hook(pre_hook, with_kwargs=True)
    loader = BalancedLoader(_Samples(rank, 8, 2, place, outdir), cfg, gradient_accumulation_steps=2,
                            model_config=model.config, cost_model=CostModel(1.0, 1.0),
                            collator=_collator(model.config, cfg.max_tokens, rank, place, outdir, victim, sig),
                            plan_fn=_planner(rank, place, outdir))
    loader.set_step_offset(100)
    if balancer is not None:
        balancer.step_source = lambda: 100 + max(0, loader._active.consumed - 1) if loader._active else 100
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.train()
    steps = 0
    for step, batches in enumerate(loader.iter_steps()):
        if step == FAULT_STEP and place in ("forward", "forward text") and rank == victim:
            _hit(outdir, victim, sig)
        with training_errors(loader):  # a distributed error here: the library's, naming step, rank, phase
            for batch in batches:
                model(**batch).loss.backward()
            for p in model.parameters():  # DDP's gradient all-reduce: the training collective
                if p.grad is not None:
                    dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        steps += 1
    loader.close()
    return steps


def run_one(name, place, victim, sig):
    """{rank: (how it ended, seconds from the fault, message)} for the surviving ranks."""
    from hf_dp_balance.testing.spawn import run_ranks_until

    outdir = tempfile.mkdtemp(prefix="hf_dp_reliability_")
    survivors = [r for r in range(WORLD) if sig is None or r != victim]
    start = time.time()
    got = run_ranks_until(_rank, WORLD, place, victim, sig, outdir, ranks=survivors, timeout=RUN_LIMIT_S,
                          pg_timeout_s=300, env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    path = os.path.join(outdir, "fault_time")
    fault = float(open(path).read()) if os.path.exists(path) else float("nan")
    rows = {}
    for r in survivors:
        if r not in got:
            rows[r] = ("no end within the run limit", RUN_LIMIT_S, "")
            continue
        ok, value, seconds = got[r]
        stderr = open(os.path.join(outdir, f"stderr_{r}")).read() if os.path.exists(os.path.join(outdir, f"stderr_{r}")) else ""
        if ok:
            how, msg = f"finished ({value} steps)", _first(stderr, "failed on rank(s)") or ""
        elif "exited with code" in str(value):
            how, msg = str(value).replace("process ", ""), _first(stderr, "hf_dp_balance")
        else:
            how, msg = "raised", _last_error(str(value))
        rows[r] = (how, start + seconds - fault, msg)
    return rows


def _first(text, needle):
    return next((line for line in text.splitlines() if needle in line), "")


def _last_error(tb):
    lines = [line for line in tb.splitlines() if line and not line.startswith(" ")]
    return lines[-1] if lines else tb[-300:]


def _table(results):
    out = ["| fault | rank | ended | s after fault | message (first 220 characters) |", "|---|---|---|---|---|"]
    for name, rows in results:
        for r, (how, secs, msg) in sorted(rows.items()):
            out.append(f"| {name} | {r} | {how} | {secs:.1f} | {msg[:220].replace('|', '/')} |")
    return "\n".join(out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="markdown file for the table (docs/reliability.md keeps its text above)")
    parser.add_argument("--only", help="run the faults whose name contains this")
    args = parser.parse_args(argv)
    results = []
    for name, place, victim, sig in _faults():
        if args.only and args.only not in name:
            continue
        t0 = time.time()
        rows = run_one(name, place, victim, sig)
        results.append((name, rows))
        print(f"{name}: {time.time() - t0:.0f}s", {r: (h, round(s, 1)) for r, (h, s, _) in rows.items()}, flush=True)
    table = _table(results)
    print(table)
    if args.write:
        _write(args.write, table, " ".join(["python", "bench/reliability.py"] + (argv or sys.argv[1:])),
               [name for name, _ in results] if args.only else None)


def _write(path, table, command, only):
    """The table under the marker of `path`; with `only` (names), those faults' rows replace theirs in the table.
    The text after the old table (its reading) is kept."""
    marker = "<!-- table: bench/reliability.py -->"
    text = open(path).read() if os.path.exists(path) else marker
    head, _, old = text.partition(marker)
    old_lines = old.strip().splitlines()
    last_row = max((i for i, line in enumerate(old_lines) if line.startswith("|")), default=len(old_lines) - 1)
    tail = "\n".join(old_lines[last_row + 1:]).strip()
    runs = f"`{command}`, timeout_s={TIMEOUT_S:g}, {WORLD} gloo ranks, fault at step {FAULT_STEP} (user step " \
           f"{100 + FAULT_STEP}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    if only is not None:
        lines = old.strip().splitlines()
        notes = [line for line in lines if line.startswith("`")]
        kept = [line for line in lines if line.startswith("| ") and line.split(" | ")[0][2:] not in only]
        new = table.splitlines()
        table = "\n".join(new[:2] + [line for line in kept if not line.startswith("| fault |")] + new[2:])
        runs = "\n".join(notes + [runs + " (rows of: " + "; ".join(only) + ")"])
    with open(path, "w") as f:
        f.write(head + marker + "\n\n" + runs + "\n\n" + table + "\n" + ("\n" + tail + "\n" if tail else ""))


if __name__ == "__main__":
    main()
