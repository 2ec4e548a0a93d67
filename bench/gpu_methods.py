"""The virtual data-parallel steps of bench/gpu_check.py and each method's micro-batches (pure numpy, no device).

A step is the samples of `ranks * ga` consecutive fixed-length packs of a long-tail multimodal mix (the
simulator's `testing.mix`, drawn at its published sizes and scaled to the pack). Every method gives each rank
its `ga` micro-batches of those samples, as lists of sample ids:

  none             the fixed-length packs themselves (pack j: rank j % ranks, micro-batch j // ranks)
  batch_rebalance  transformers' `BatchRebalanceSampler` over the step's samples (their LLM lengths; packed
                   padding-free here, as the demo packs them: its own padding would only add to its cost)
  hf_dp_balance    `plan_step` on the costs of the fitted cost models, from none's placement, under the
                   library's token cap (`DPBalanceConfig` defaults, DDP: ranks meet once per step)
  measured         the same planner on the costs of models fitted to every micro-batch timed in this run:
                   what a plan on the measured costs gives (the cut the fitted model could reach)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

import numpy as np

from hf_dp_balance.testing.mix import SampleShapes, draw_mix, pack_fixed_length, truncate
from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.costing import planning_costs
from hf_dp_balance.core.planner import plan_step
from hf_dp_balance.core.steps import slot_loads, token_cap

PUBLISHED_PACK = 32768  # the mixes' pack length (InternVL's packed default): what `pack` scales down
METHODS = ("none", "batch_rebalance", "hf_dp_balance", "measured")

Batches = List[List[np.ndarray]]  # [rank][micro-batch] -> sample ids


@dataclass(frozen=True)
class VirtualStep:
    """One step: its sample ids and none's placement of them (fixed-length packs)."""

    ids: np.ndarray
    rank: np.ndarray
    micro: np.ndarray


def scaled_mix(mix: str, n: int, pack: int, rng, realize: Callable[[Sequence[int]], List[int]]) -> SampleShapes:
    """`n` samples of `mix` at the published sizes (truncated to 32K), every text and patch count scaled by
    pack / 32768; `realize` maps a sample's frame patches to the frames the vision tower builds."""
    shapes = truncate(draw_mix(mix, n, rng), PUBLISHED_PACK)
    scale = pack / PUBLISHED_PACK
    text = np.maximum(1, np.rint(shapes.text_tokens * scale)).astype(np.int64)
    patches = np.maximum(shapes.merge, np.rint(shapes.item_patches * scale / shapes.merge) * shapes.merge)
    patches = np.asarray(realize(patches.astype(np.int64).tolist()), dtype=np.int64)
    shapes = SampleShapes(text, patches, shapes.item_offsets, shapes.merge)
    return truncate(shapes, pack)


def draw_steps(mix: str, ranks: int, ga: int, steps: int, pack: int, rng,
               realize: Callable[[Sequence[int]], List[int]]):
    """(samples, [VirtualStep] * steps): the samples of steps * ranks * ga fixed-length packs in arrival order."""
    need = steps * ranks * ga
    n = max(64, need * PUBLISHED_PACK // 1200)  # the mixes' samples average ~1.5K of 32K tokens: ~22 per pack
    while True:
        samples = scaled_mix(mix, n, pack, rng, realize)
        pack_of = pack_fixed_length(samples.tokens, pack)
        if pack_of.size and pack_of[-1] >= need:  # the last pack is whole only if one after it was opened
            break
        n *= 2
    keep = np.flatnonzero(pack_of < need)
    samples, pack_of = samples.take(keep), pack_of[keep]
    step_of = pack_of // (ranks * ga)
    out = []
    for s in range(steps):
        ids = np.flatnonzero(step_of == s)
        out.append(VirtualStep(ids, pack_of[ids] % ranks, (pack_of[ids] // ranks) % ga))
    return samples, out


def frames_per_sample(samples: SampleShapes) -> List[List[int]]:
    """Each sample's vision frames (patches), in item order (an item of the mixes is one frame)."""
    o, p = samples.item_offsets, samples.item_patches
    return [p[o[i]:o[i + 1]].tolist() for i in range(len(samples))]


def sample_costs(samples: SampleShapes, decoder, vision) -> np.ndarray:
    """Cost of each sample where it is trained: decoder over its tokens + vision tower over its frames."""
    return planning_costs(samples.tokens, frames_per_sample(samples), decoder, vision)


def _to_batches(ids: np.ndarray, rank: np.ndarray, micro: np.ndarray, ranks: int, ga: int) -> Batches:
    return [[np.sort(ids[(rank == r) & (micro == m)]) for m in range(ga)] for r in range(ranks)]


def none_batches(step: VirtualStep, ranks: int, ga: int) -> Batches:
    return _to_batches(step.ids, step.rank, step.micro, ranks, ga)


def rebalance_batches(step: VirtualStep, tokens: np.ndarray, ranks: int, ga: int) -> Batches:
    """What transformers' `BatchRebalanceSampler` gives each rank for this step (its own algorithm, run per
    rank as every rank does; no shuffle: the step's samples are already the step's)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    lengths = [int(t) for t in tokens[step.ids]]
    out = []
    for r in range(ranks):
        sampler = BatchRebalanceSampler(lengths, effective_batch_size=len(lengths), dp_size=ranks, grad_accum=ga,
                                        shuffle=False, rank=r)
        out.append([np.sort(step.ids[np.asarray(mb, dtype=np.int64)]) for mb in sampler])
    return out


def step_cap(step: VirtualStep, tokens: np.ndarray, ranks: int, ga: int, config: DPBalanceConfig) -> int:
    """The library's hard tokens per (rank, micro-batch) slot for this step (`runtime.step_plan.token_cap`)."""
    tok = tokens[step.ids]
    largest = int(slot_loads(tok, step.rank, step.micro, ranks, ga).max())
    return token_cap(tok, ranks * ga, config.max_tokens, config.max_token_ratio, largest)


def plan_inputs(step: VirtualStep, costs: np.ndarray, tokens: np.ndarray, ranks: int, ga: int,
                config: DPBalanceConfig) -> tuple:
    """(args, kwargs) of the `plan_step` call the library makes for this step (DDP: sync once per step)."""
    args = (costs[step.ids], step.rank, step.micro, ranks, ga)
    kwargs = dict(tokens=tokens[step.ids], max_tokens=step_cap(step, tokens, ranks, ga, config), sync="step",
                  min_gain=config.min_gain, tolerance=config.move_tolerance)
    return args, kwargs


def planned_batches(step: VirtualStep, costs: np.ndarray, tokens: np.ndarray, ranks: int, ga: int,
                    config: DPBalanceConfig):
    """(batches, moved samples) of `plan_step` on these per-sample costs."""
    args, kwargs = plan_inputs(step, costs, tokens, ranks, ga, config)
    plan = plan_step(*args, **kwargs)
    rank, micro = np.asarray(plan.dest_rank), np.asarray(plan.dest_micro_batch)
    return _to_batches(step.ids, rank, micro, ranks, ga), int(np.count_nonzero(rank != step.rank))


def batch_owner(batches: Batches, n: int) -> np.ndarray:
    """Rank of each sample id in `batches` (-1 for ids not in them)."""
    owner = np.full(n, -1, dtype=np.int64)
    for r, per_rank in enumerate(batches):
        for mb in per_rank:
            owner[mb] = r
    return owner
