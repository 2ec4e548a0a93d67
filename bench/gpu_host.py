"""The host-side work of balancing beside the device work of bench/gpu_check.py: what the loader's hidden
thread must fit into one step. Thread CPU time (this thread only), median of repeats.

  plan      `plan_step` on the very inputs of the check's steps (P = 8, 32), and on a step of the same mix at
            DP 4096 at the published 32K packs (the planning sizes of a large run)
  sampler   transformers' `BatchRebalanceSampler` for one rank of the same step (each rank runs it)
  codec     the exchange's host side (`core.codec`): every rank encodes the samples it sends and decodes the
            ones it receives (input_ids, labels, pixel_values rows, image_grid_thw); the slowest rank's sum
"""

from __future__ import annotations

import time
from typing import Dict, List

import numpy as np
import torch

import gpu_methods
from hf_dp_balance.testing.mix import SampleShapes
from hf_dp_balance.apps.sim_runs import draw_packed
from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.codec import decode_sample, encode_sample
from hf_dp_balance.core.planner import plan_step


def cpu_seconds(fn, repeats: int = 3) -> float:
    """Median thread CPU seconds of fn() over `repeats` calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return float(np.median(times))


def plan_seconds(step, costs, tokens, ranks: int, ga: int, config: DPBalanceConfig) -> float:
    args, kwargs = gpu_methods.plan_inputs(step, costs, tokens, ranks, ga, config)
    return cpu_seconds(lambda: plan_step(*args, **kwargs))


def sampler_seconds(step, tokens, ranks: int, ga: int) -> float:
    """One rank's `BatchRebalanceSampler` pass over the step (the algorithm runs whole on every rank)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    lengths = [int(t) for t in tokens[step.ids]]
    return cpu_seconds(lambda: list(BatchRebalanceSampler(lengths, len(lengths), ranks, ga, shuffle=False)), 1)


def large_plan(mix: str, dp: int, ga: int, decoder, vision, config: DPBalanceConfig, seed: int) -> dict:
    """`plan_step` time on one step of `dp` ranks x `ga` fixed-length packs of 32K tokens of the mix, priced
    by the fitted models (planning time depends on the number of samples, not on the pack's scale)."""
    samples, pack_of = draw_packed(mix, dp * ga, gpu_methods.PUBLISHED_PACK, np.random.default_rng([seed, dp]))
    step = gpu_methods.VirtualStep(np.arange(len(samples)), pack_of % dp, (pack_of // dp) % ga)
    costs = gpu_methods.sample_costs(samples, decoder, vision)
    return {"ranks": dp, "samples": len(samples),
            "plan_s": plan_seconds(step, costs, samples.tokens, dp, ga, config)}


def sample_dict(samples: SampleShapes, i: int, pixel_dtype: torch.dtype, patch_dim: int) -> dict:
    """A Qwen2-VL training sample of sample i's shape (what the loader exchanges), random content."""
    n = int(samples.tokens[i])
    frames = samples.item_patches[samples.item_offsets[i]:samples.item_offsets[i + 1]]
    out = {"input_ids": torch.randint(0, 1000, (n,)), "labels": torch.randint(0, 1000, (n,))}
    if frames.size:
        out["pixel_values"] = torch.randn(int(frames.sum()), patch_dim).to(pixel_dtype)
        out["image_grid_thw"] = torch.tensor([[1, 2, int(p) // 2] for p in frames.tolist()], dtype=torch.int64)
    return out


def codec_seconds(samples: SampleShapes, step, batches, ranks: int, pixel_dtype, patch_dim: int) -> dict:
    """The exchange's host work of one planned step: per rank, encode what it sends + decode what it
    receives; the slowest rank's seconds, the samples and bytes moved."""
    owner = gpu_methods.batch_owner(batches, len(samples))
    moves = owner[step.ids] != step.rank
    moved = step.ids[moves]
    per_rank = np.zeros(ranks)
    nbytes = 0
    for i, src in zip(moved.tolist(), step.rank[moves].tolist()):
        sample = sample_dict(samples, i, pixel_dtype, patch_dim)
        t0 = time.thread_time()
        buf = encode_sample(sample, where=f"sample {i}")
        per_rank[src] += time.thread_time() - t0
        nbytes += buf.numel()
        t0 = time.thread_time()
        decode_sample(buf, where=f"sample {i}")
        per_rank[owner[i]] += time.thread_time() - t0
    return {"slowest_rank_s": float(per_rank.max()) if ranks else 0.0, "moved": int(moved.size),
            "bytes": int(nbytes)}


def host_costs(runs: Dict[int, dict], mix: str, ga: int, decoder, vision, config: DPBalanceConfig, seed: int,
               large_dp: int, pixel_dtype, patch_dim: int) -> dict:
    """Host seconds per step beside each run's device time: planning, the sampler, the codec; and planning at
    `large_dp` ranks. `runs[P]` holds the check's samples, steps, fitted costs and hf_dp_balance's batches."""
    out: Dict[str, object] = {}
    for ranks, run in runs.items():
        plans: List[float] = [plan_seconds(s, run["costs"], run["samples"].tokens, ranks, ga, config)
                              for s in run["steps"]]
        codec = [codec_seconds(run["samples"], s, b, ranks, pixel_dtype, patch_dim)
                 for s, b in zip(run["steps"], run["batches"])]
        out[str(ranks)] = {
            "plan_s": float(np.mean(plans)),
            "batch_rebalance_sampler_s": float(np.mean([sampler_seconds(s, run["samples"].tokens, ranks, ga)
                                                         for s in run["steps"][:1]])),
            "codec_slowest_rank_s": float(np.mean([c["slowest_rank_s"] for c in codec])),
            "moved_per_step": float(np.mean([c["moved"] for c in codec])),
            "moved_mib_per_step": float(np.mean([c["bytes"] for c in codec]) / 2 ** 20),
        }
    out["large"] = large_plan(mix, large_dp, ga, decoder, vision, config, seed)
    return out
