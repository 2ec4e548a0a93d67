"""bench/gpu_methods.py, the GPU check's placements (pure): every method gives each rank its micro-batches of
exactly the step's samples, none is the fixed-length packs, hf_dp_balance keeps the library's token cap."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gpu_methods  # noqa: E402
from hf_dp_balance.config import DPBalanceConfig  # noqa: E402
from hf_dp_balance.core.cost import CostModel  # noqa: E402

DECODER = CostModel(quadratic=1e-8, linear=1e-4, per_sample=1e-4)
VISION = CostModel(quadratic=2e-8, linear=2e-5)


def _even_frames(patches):
    return [max(4, int(p) // 4 * 4) for p in patches]


@pytest.mark.parametrize("ranks, ga", [(8, 1), (8, 2), (32, 1)])
def test_every_method_places_each_sample_of_the_step_once(ranks, ga):
    pack = 2048
    samples, steps = gpu_methods.draw_steps("qwen2vl-sft", ranks, ga, 2, pack, np.random.default_rng(0),
                                            _even_frames)
    assert len(steps) == 2 and int(samples.tokens.max()) <= pack
    costs = gpu_methods.sample_costs(samples, DECODER, VISION)
    config = DPBalanceConfig()
    for step in steps:
        none = gpu_methods.none_batches(step, ranks, ga)
        # none: every (rank, micro-batch) slot is one fixed-length pack, within the pack length
        assert all(0 < samples.tokens[mb].sum() <= pack for per_rank in none for mb in per_rank)
        planned, moved = gpu_methods.planned_batches(step, costs, samples.tokens, ranks, ga, config)
        ways = {"none": none, "batch_rebalance": gpu_methods.rebalance_batches(step, samples.tokens, ranks, ga),
                "hf_dp_balance": planned}
        for name, batches in ways.items():
            assert len(batches) == ranks and all(len(per_rank) == ga for per_rank in batches), name
            ids = np.concatenate([mb for per_rank in batches for mb in per_rank])
            assert sorted(ids.tolist()) == sorted(step.ids.tolist()), name
        cap = gpu_methods.step_cap(step, samples.tokens, ranks, ga, config)
        assert max(samples.tokens[mb].sum() for per_rank in planned for mb in per_rank) <= cap
        owner = gpu_methods.batch_owner(planned, len(samples))
        assert moved == int(np.count_nonzero(owner[step.ids] != step.rank))
        loads = [sum(costs[mb].sum() for mb in per_rank) for per_rank in ways["hf_dp_balance"]]
        none_loads = [sum(costs[mb].sum() for mb in per_rank) for per_rank in none]
        assert max(loads) <= max(none_loads) + 1e-12


def test_scaled_mix_keeps_the_mix_shape_at_the_pack():
    rng = np.random.default_rng(1)
    full = gpu_methods.scaled_mix("qwen2vl-sft", 2000, gpu_methods.PUBLISHED_PACK, rng, list)
    small = gpu_methods.scaled_mix("qwen2vl-sft", 2000, 1024, np.random.default_rng(1), _even_frames)
    assert int(small.tokens.max()) <= 1024
    ratio = small.tokens.mean() / full.tokens.mean()
    assert ratio == pytest.approx(1024 / gpu_methods.PUBLISHED_PACK, rel=0.15)
    assert np.all(small.item_patches % 4 == 0) and np.all(small.item_patches > 0)
