"""`hf-dp-balance demo`: train a tiny Qwen2-VL three ways on gloo ranks and compare the slowest rank.

This module runs the ways: ``none`` (fixed-length packs), ``batch_rebalance`` (transformers' sampler) and
``hf_dp_balance`` (the stock Trainer with `DPBalanceCallback`), on the same samples in the same steps from the
same weights, all at once and in lockstep (`testing.spawn.run_groups`); `demo_ways` is how each way trains on
one rank, `demo_analysis` turns their records into demo.json. What it measures and why: docs/usage.md ("The demo").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from hf_dp_balance.apps.demo_analysis import WAYS, assemble, format_table, plot, report_lines
from hf_dp_balance.apps.demo_ways import DEMO_HIDDEN, DEMO_TEXT_CONFIG, train_way
from hf_dp_balance.testing.mix import REGIMES


# --------------------------------------------------------------------------- one rank


def _rank_main(rank: int, world: int, lockstep, ds_path: str, opts: dict) -> dict:
    """One rank of one way (`lockstep.group`), in its own gloo group; `lockstep` is shared by every rank of
    every way: they meet after every step, outside the timed window."""
    import datasets
    import transformers

    way = lockstep.group

    def step_done(step: int) -> None:
        if rank == 0:
            lockstep.report(step)
        lockstep.wait(timeout=opts["step_timeout_s"])  # thread CPU time is not spent while waiting

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(ds_path)
    key_to_id = {}
    for i, ids in enumerate(ds["input_ids"]):  # a few tiny samples repeat their tokens: they share the first id
        key_to_id.setdefault(tuple(int(t) for t in ids), i)
    tokens = np.array([len(ids) for ids in ds["input_ids"]])
    lockstep.wait(timeout=opts["step_timeout_s"])  # every way starts step 1 together
    return train_way(way, rank, world, ds, key_to_id, tokens, opts, step_done)


# Environment of every rank: one thread, offline, quiet.
_RANK_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
             # DDP's C++ "find_unused_parameters ... did not find any unused parameters" warning, once per rank:
             # the flag is needed (text-only packs leave the vision tower unused), the warning is noise in the
             # demo's output. Read when torch loads, after the spawner applied this environment.
             "TORCH_CPP_LOG_LEVEL": "ERROR"}


# --------------------------------------------------------------------------- the command


def settings_problem(steps: int, ranks: int, warmup: int, samples_per_rank: int, lookahead: int,
                     max_token_ratio: float = 1.5) -> Optional[str]:
    """What is wrong with these demo settings, or None (checked before any process starts)."""
    if steps < 1 or ranks < 2 or warmup < 1 or samples_per_rank < 1 or lookahead < 0:
        return (f"need steps >= 1, ranks >= 2, warmup >= 1, samples_per_rank >= 1, lookahead >= 0; got steps={steps}, "
                f"ranks={ranks}, warmup={warmup}, samples_per_rank={samples_per_rank}, lookahead={lookahead}")
    if not max_token_ratio >= 1.0:
        return f"--max-token-ratio {max_token_ratio}: must be >= 1.0 (a cap below the mean cannot hold every sample)"
    if lookahead > 1 and warmup % lookahead:
        return (f"--warmup {warmup} must be a multiple of --lookahead {lookahead} (the loader's windows start at "
                f"step 1, and the compared steps must start a window)")
    return None


def _build_dataset(path: str, total: int, seed: int, mix: str, progress: bool):
    """The synthetic samples saved at `path`: (LLM tokens per sample, the (t, h, w) grid of each vision item of each sample)."""
    import datasets

    from hf_dp_balance.testing.data import build_synthetic_dataset

    if progress:
        print(f"building {total} synthetic samples (tiny Qwen2-VL, {mix} mix) ...", file=sys.stderr)
    datasets.disable_progress_bars()
    ds = build_synthetic_dataset("qwen2_vl", total, seed=seed, mix=mix)
    ds.save_to_disk(path)
    tokens = [len(ids) for ids in ds["input_ids"]]
    # grids (t, h, w) of each sample's images / videos: priced per frame, the fitted vision model's unit
    patches = [[[int(x) for x in g] for g in (img or [])] + [[int(x) for x in g] for g in (vid or [])]
               for img, vid in zip(ds["image_grid_thw"], ds["video_grid_thw"])]
    return tokens, patches


def run_demo(steps: int = 15, ranks: int = 4, *, warmup: int = 6, samples_per_rank: int = 16, seed: int = 0,
             mix: str = "long_tail", max_token_ratio: float = 1.5, vision: bool = False, lookahead: int = 0,
             progress: bool = True, timeout_s: float = 900.0, packed_input: bool = False) -> dict:
    """Run the three ways at once, each on `ranks` spawned gloo processes, in lockstep; returns demo.json's content.

    `packed_input`: hf_dp_balance receives none's fixed-length packs (the user's own packing) instead of samples."""
    from hf_dp_balance.testing.spawn import run_groups

    problem = settings_problem(steps, ranks, warmup, samples_per_rank, lookahead, max_token_ratio)
    if problem:
        raise ValueError(f"demo: {problem}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_dp_balance_demo_") as tmp:
        ds_path = os.path.join(tmp, "ds")
        tokens, patches = _build_dataset(ds_path, (steps + warmup) * ranks * samples_per_rank, seed, mix, progress)
        opts = {"steps": steps, "warmup": warmup, "samples_per_rank": samples_per_rank, "seed": seed, "vision": vision,
                "max_token_ratio": max_token_ratio, "lookahead": lookahead, "workdir": os.path.join(tmp, "out"),
                "step_timeout_s": timeout_s, "input": "packed" if packed_input else "samples"}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps + warmup, desc=f"demo: {', '.join(WAYS)} in lockstep", unit="step", file=sys.stderr)

        def on_progress(way: str, rank: int, step: int) -> None:
            if bar is not None and way == WAYS[0]:
                bar.update(step - bar.n)

        # The three ways run at the same time, each on its own `ranks` processes and gloo group, and meet
        # after every step (a barrier outside the timed window): step k of every way runs while the
        # machine is in the same state, so a slower minute of the shared cores slows all three alike.
        try:
            got = run_groups(_rank_main, WAYS, ranks, ds_path, opts, timeout=timeout_s, pg_timeout_s=600.0,
                             env=_RANK_ENV, on_progress=on_progress)
        finally:
            if bar is not None:
                bar.close()
    by_rank = {r: {way: got[way][r] for way in WAYS} for r in range(ranks)}
    by_rank[0].update(tokens=tokens, patches=patches)
    model = (f"tiny Qwen2-VL (random weights; decoder hidden {DEMO_HIDDEN}, "
             f"{DEMO_TEXT_CONFIG['num_hidden_layers']} layers), varlen attention, gloo, 1 thread per rank")
    result = assemble(by_rank, ranks, steps, warmup, samples_per_rank, seed, mix, time.perf_counter() - started,
                      lookahead=lookahead, model=model)
    result["settings"]["input"] = "packed" if packed_input else "samples"
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=15, help="compared optimizer steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="steps trained by every way but not compared (hf_dp_balance times, fits, prefetches)")
    parser.add_argument("--vision-tower", action="store_true",
                        help="hf_dp_balance also balances the vision tower per image (default: the loader plans "
                             "each sample at decoder + vision cost, its images encoded where it goes)")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks (processes, one thread each)")
    parser.add_argument("--samples-per-rank", type=int, default=16, help="samples per rank per step before balancing")
    parser.add_argument("--mix", choices=REGIMES, default="long_tail")
    parser.add_argument("--max-token-ratio", type=float, default=1.5,
                        help="hf_dp_balance's hard per-rank token cap, as a multiple of the mean")
    parser.add_argument("--lookahead", type=int, default=0, metavar="K",
                        help="hf_dp_balance also moves samples between the steps of windows of K steps (the "
                             "library's lookahead_steps): then its samples match none's per window, not per step, "
                             "and its losses after the warm-up are not compared; --warmup must be a multiple of K")
    parser.add_argument("--input", choices=("samples", "packed"), default="samples",
                        help="what hf_dp_balance receives: per-sample lists, or none's fixed-length packs (a user "
                             "who packs already; the packs are split, balanced and packed again, at most as long)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="demo.json", help="where to write the results")
    parser.add_argument("--plot", default="demo.png", help="where to write the plot (PNG); '' for none")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    problem = settings_problem(args.steps, args.ranks, args.warmup, args.samples_per_rank, args.lookahead,
                               args.max_token_ratio)
    if problem:
        print(f"hf-dp-balance demo: error: {problem}", file=sys.stderr)
        return 2
    result = run_demo(args.steps, args.ranks, warmup=args.warmup, samples_per_rank=args.samples_per_rank,
                      seed=args.seed, mix=args.mix, max_token_ratio=args.max_token_ratio,
                      vision=args.vision_tower, lookahead=args.lookahead, progress=not args.no_progress,
                      packed_input=args.input == "packed")
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(format_table(result["runs"]))
    for line in report_lines(result):
        print(line)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else "") + f" in {result['wall_s']:.0f}s")
    inv = result["invariants"]
    return 0 if inv["same_samples"] and inv["losses_equal"] else 1


__all__ = ["add_arguments", "run", "run_demo", "settings_problem"]
