"""Vision-encoder balancing benchmark: slowest rank's vision compute with and without, side by side.

Four gloo ranks (spawned processes, one thread each) hold the same tiny-but-not-trivial
Qwen-VL vision tower (random weights). Every step draws a skewed image mix: one
rank (rotating) holds several large images and a video, one holds nothing, the
others a few small images. Each step runs twice on the same inputs, interleaved
so both see the same machine load:

  own        each rank encodes its own images (the model's `get_image_features`)
  balanced   `balance_vision_encoder`'s path: gather grids, plan, all_to_all pixels,
             encode, all_to_all embeddings back (differentiable)

followed by the backward of a fixed random projection of the embeddings.
Compute of a rank = thread CPU time (`time.thread_time()`) of forward+backward,
including the balancing's own work (gather, plan, packing, exchange); waiting
for other ranks costs no CPU. A step's time is its slowest rank. Embeddings of
both runs are checked equal. The planner uses the tower's FLOP-shaped prior
(`CostModel.from_flops` with the tower's parameters, width and depth).

    python bench/vision.py [--family qwen2_vl] [--steps 4] [--write docs/benchmarks/vision.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


RANKS = 4
# Vision tower of the benchmark: wider and deeper than the test configs so that a
# large image costs a noticeable fraction of a second on one CPU thread.
TOWER = {
    "qwen2_vl": dict(depth=4, embed_dim=128, num_heads=4, mlp_ratio=4),
    "qwen2_5_vl": dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, fullatt_block_indexes=[1, 3]),
    "qwen3_vl": dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, deepstack_visual_indexes=[1]),
}


def skewed_mix(step: int, ranks: int, seed: int):
    """Items (kind, t, h, w) per rank for one step: the heavy rank rotates, the next rank is empty."""
    rng = np.random.default_rng(seed * 1000 + step)
    heavy, empty = step % ranks, (step + 1) % ranks
    mix = []
    for r in range(ranks):
        if r == heavy:
            items = [("image", 1, int(rng.integers(14, 21)) * 2, int(rng.integers(14, 21)) * 2) for _ in range(3)]
            items.append(("video", 2, 16, 16))
        elif r == empty:
            items = []
        else:
            items = [("image", 1, int(rng.integers(4, 9)) * 2, int(rng.integers(4, 9)) * 2)
                     for _ in range(int(rng.integers(1, 3)))]
        mix.append(items)
    return mix


def _make_batch(family, items, seed):
    import torch

    from hf_dp_balance.testing import models

    cfg = models.tiny_config(family).vision_config
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    gen = torch.Generator().manual_seed(seed)
    batch = {}
    for kind, pkey, gkey in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        grids = [[t, h, w] for k, t, h, w in items if k == kind]
        if grids:
            rows = sum(t * h * w for t, h, w in grids)
            batch[pkey] = torch.randn(rows, width, generator=gen)
            batch[gkey] = torch.tensor(grids)
    return batch


def _own_embeddings(inner, batch):
    """The model's own path: get_image_features / get_video_features on this rank's items."""
    import torch

    outs = []
    if "pixel_values" in batch:
        outs += list(inner.get_image_features(batch["pixel_values"], batch["image_grid_thw"], return_dict=True).pooler_output)
    if "pixel_values_videos" in batch:
        outs += list(inner.get_video_features(batch["pixel_values_videos"], batch["video_grid_thw"], return_dict=True).pooler_output)
    return torch.cat(outs) if outs else None


def _balanced_embeddings(balancer, batch):
    import torch

    out = balancer.balanced_encode(dict(batch))
    if out is None:  # skipped: every rank runs its own images
        return _own_embeddings(balancer.inner, batch), None
    encoder_outputs, _, tie = out
    pooled = []
    for kind in ("image", "video"):
        if kind in encoder_outputs:
            pooled += list(encoder_outputs[kind].pooler_output)
    return (torch.cat(pooled) if pooled else None), tie


def _timed(fn, weights_seed):
    """Thread CPU time and wall time of fn() plus the backward of a fixed projection of its output."""
    import torch

    t_cpu, t_wall = time.thread_time(), time.perf_counter()
    emb, tie = fn()
    loss = None
    if emb is not None:
        w = torch.randn(emb.shape, generator=torch.Generator().manual_seed(weights_seed))
        loss = (emb * w).sum()
    if tie is not None:  # keeps this rank in the backward all_to_all even with no own images
        loss = tie.sum() * 0.0 if loss is None else loss + tie.sum() * 0.0
    if loss is not None:
        loss.backward()
    return time.thread_time() - t_cpu, time.perf_counter() - t_wall, (emb.detach() if emb is not None else None)


def _bench_rank(rank, world, family, steps, seed):
    import torch
    import torch.distributed as dist

    from hf_dp_balance.testing import models
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.vision import balance_vision_encoder

    model = models.make_model(family, seed=0, vision_config=TOWER[family])
    inner = model.model
    vc = inner.config.vision_config
    width = getattr(vc, "embed_dim", None) if family == "qwen2_vl" else vc.hidden_size
    params = sum(p.numel() for p in inner.visual.parameters())
    cost_model = CostModel.from_flops(params, width, vc.depth, causal=False)
    balance_vision_encoder(model, DPBalanceConfig(vision=True), cost_model=cost_model)
    balancer = model._dp_balance_vision

    # warm-up (allocator, first-call overheads) on both paths, untimed
    warm = _make_batch(family, skewed_mix(0, world, seed + 99)[rank], seed=rank)
    _timed(lambda: (_own_embeddings(inner, warm), None), 0)
    _timed(lambda: _balanced_embeddings(balancer, warm), 0)
    balancer.pop_stats()

    rows = []
    for step in range(steps):
        batch = _make_batch(family, skewed_mix(step, world, seed)[rank], seed=1000 * step + rank)
        wseed = 7 * step + rank
        model.zero_grad(set_to_none=True)
        dist.barrier()
        own_cpu, own_wall, own_emb = _timed(lambda: (_own_embeddings(inner, batch), None), wseed)
        model.zero_grad(set_to_none=True)
        dist.barrier()
        bal_cpu, bal_wall, bal_emb = _timed(lambda: _balanced_embeddings(balancer, batch), wseed)
        (stats,) = balancer.pop_stats()
        if own_emb is not None:
            err = float((own_emb - bal_emb).abs().max() / own_emb.abs().max())
            if err > 1e-4:
                raise AssertionError(f"rank {rank} step {step}: balanced embeddings differ by {err:.2e}")
        rows.append({"own_cpu": own_cpu, "bal_cpu": bal_cpu, "own_wall": own_wall, "bal_wall": bal_wall,
                     "stats": stats})
    return rows


def main(argv=None) -> int:
    from hf_dp_balance.testing.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_vl", choices=sorted(TOWER))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", default=None, help="write the markdown result to this file")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    by_rank = run_ranks(_bench_rank, RANKS, args.family, args.steps, args.seed, timeout=1800)
    elapsed = time.perf_counter() - started

    lines = [f"{RANKS} gloo ranks, {args.family} vision tower {TOWER[args.family]}, {args.steps} steps, "
             f"one thread per rank; times are thread CPU seconds of vision forward+backward", "",
             "| step | own: per-rank CPU s | own: slowest | balanced: per-rank CPU s | balanced: slowest | "
             "items moved | pixel MB | embedding MB | predicted imbalance before -> after |",
             "|---|---|---|---|---|---|---|---|---|"]
    own_total = bal_total = own_wall_total = bal_wall_total = 0.0
    for step in range(args.steps):
        per = [by_rank[r][step] for r in range(RANKS)]
        own = [p["own_cpu"] for p in per]
        bal = [p["bal_cpu"] for p in per]
        s = per[0]["stats"]
        own_total += max(own)
        bal_total += max(bal)
        own_wall_total += max(p["own_wall"] for p in per)
        bal_wall_total += max(p["bal_wall"] for p in per)
        lines.append(
            f"| {step} | {' '.join(f'{x:.2f}' for x in own)} | {max(own):.2f} | {' '.join(f'{x:.2f}' for x in bal)} | "
            f"{max(bal):.2f} | {s['items_moved']}/{s['items']} | {s['pixel_bytes_moved'] / 1e6:.2f} | "
            f"{s['embedding_bytes_moved'] / 1e6:.3f} | {s['imbalance_before']:.2f} -> {s['imbalance_after']:.2f} |")
    reduction = 1.0 - bal_total / own_total
    lines += ["",
              f"Slowest-rank vision CPU time summed over steps: own {own_total:.2f} s, balanced {bal_total:.2f} s "
              f"-> ratio {bal_total / own_total:.3f}, **{100 * reduction:.1f}% lower** (target >= 25%).",
              f"Slowest-rank wall time (skewed by the other processes on the machine): own {own_wall_total:.2f} s, "
              f"balanced {bal_wall_total:.2f} s (ratio {bal_wall_total / own_wall_total:.3f}).",
              f"Bytes moved per step are forward (pixels + embeddings); the backward sends the embedding bytes "
              f"again as gradients. Run time {elapsed:.0f} s."]
    text = "\n".join(lines)
    print(text)
    if args.write:
        command = "python bench/vision.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
        with open(args.write, "w") as f:
            f.write("## Vision encoder balancing\n\n")
            f.write(f"Command (from the repository root):\n\n    {command}\n\n")
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
