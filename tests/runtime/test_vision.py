"""Vision-encoder balancing: exact equivalence with the unbalanced model on real gloo ranks.

Each rank builds the same tiny model (float64, so 1e-5 relative is far above
round-off), runs its own batch once without balancing (reference) and once
with `balance_vision_encoder`, and returns embeddings, loss and the gradients;
the test compares per-rank outputs and the rank-summed gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

from hf_dp_balance.testing.spawn import run_ranks
from hf_dp_balance.testing.vision_rows import vision_row

# ---------------------------------------------------------------------------- rank functions


def _vision_outputs(out, family):
    """Flat list of the embeddings the model got from its vision path (image, video; + deepstack)."""
    import torch

    flat = []
    for key in ("image_outputs", "video_outputs"):
        enc = getattr(out, key, None)
        if enc is None:
            continue
        pooled = enc.pooler_output
        flat.append(torch.cat(list(pooled)) if isinstance(pooled, (tuple, list)) else pooled.reshape(-1, pooled.shape[-1]))
        for feats in getattr(enc, "deepstack_features", None) or []:
            flat.append(torch.cat(list(feats)))
    return [f.detach().numpy().copy() for f in flat]  # numpy: tensors do not survive the result queue


def _forward_backward(model, batch, family):
    import torch.distributed as dist

    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else p.detach().new_zeros(p.shape)
        dist.all_reduce(g)
        grads[name] = g.numpy()
    return {"loss": out.loss.detach().item(), "embeds": _vision_outputs(out, family), "grads": grads,
            "logits": out.logits.detach().numpy().copy()}


def _equivalence_rank(rank, world, family, scenarios):
    """For each (items_by_rank, config kwargs): reference (own images), then balanced.

    One model per process for all scenarios (process start-up dominates the test time).
    """
    import torch

    from hf_dp_balance.testing import models
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.vision import balance_vision_encoder

    torch.manual_seed(0)
    model = models.make_model(family, seed=0, dtype=torch.float64)
    results = []
    for items_by_rank, config_kwargs in scenarios:
        batch = vision_row(family, items_by_rank[rank], seed=100 + rank)
        reference = _forward_backward(model, batch, family)
        balance_vision_encoder(model, DPBalanceConfig(vision=True, **config_kwargs))
        balanced = _forward_backward(model, batch, family)
        stats = model._dp_balance_vision.pop_stats()
        model._dp_balance_vision.remove()
        results.append({"reference": reference, "balanced": balanced, "stats": stats})
    return results


def _assert_close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    scale = max(float(np.abs(a).max()), 1e-12) if a.size else 1.0
    err = float(np.abs(a - b).max()) / scale if a.size else 0.0
    assert err <= 1e-5, f"{what}: relative difference {err:.2e}"
    return err


def _assert_equivalent(results):
    """results: one scenario's result of every rank."""
    for rank, res in enumerate(results):
        ref, bal = res["reference"], res["balanced"]
        assert len(ref["embeds"]) == len(bal["embeds"]), f"rank {rank}: different vision outputs"
        for k, (a, b) in enumerate(zip(ref["embeds"], bal["embeds"])):
            _assert_close(a, b, f"rank {rank} vision output {k}")
        _assert_close(ref["logits"], bal["logits"], f"rank {rank} logits")
        assert abs(ref["loss"] - bal["loss"]) <= 1e-5 * abs(ref["loss"])
    ref_g, bal_g = results[0]["reference"]["grads"], results[0]["balanced"]["grads"]
    assert ref_g.keys() == bal_g.keys()
    vision_nonzero = 0
    for name in ref_g:
        _assert_close(ref_g[name], bal_g[name], f"summed gradient {name}")
        if ("visual" in name or "vision_tower" in name) and float(np.abs(ref_g[name]).max()) > 0:
            vision_nonzero += 1
    assert vision_nonzero > 0, "the vision tower got no gradient: the test would not see a wrong exchange"


def _scenario(results_by_rank, k):
    return [per_rank[k] for per_rank in results_by_rank]


_BIG_IMAGES = [("image", 1, 8, 8), ("image", 1, 6, 8), ("image", 1, 4, 4), ("image", 1, 8, 6)]
# One rank with many large images (Qwen2-VL / Qwen3-VL: and a video), another with none.
SKEWED = {
    "qwen2_vl": [_BIG_IMAGES + [("video", 2, 4, 6)], []],
    "qwen2_5_vl": [_BIG_IMAGES, []],
    "qwen3_vl": [_BIG_IMAGES[:2] + [("video", 2, 4, 6)] + _BIG_IMAGES[2:], []],
    "internvl": [[3, 2, 1, 2], []],
}
# Even mix: predicted gain 0 < min_gain, skipped identically on every rank.
EVEN = [[("image", 1, 4, 4), ("video", 2, 4, 4)], [("video", 2, 4, 4), ("image", 1, 4, 4)]]


FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")
SCENARIOS = {family: [(SKEWED[family], {})] for family in FAMILIES}
SCENARIOS["qwen3_vl"] += [(EVEN, {}), (SKEWED["qwen3_vl"], {"min_gain": 0.9})]


def _ddp_rank(rank, world, family, items_by_rank):
    """Balanced model inside DistributedDataParallel: its gradients (averaged) times world size."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from hf_dp_balance.testing import models
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.vision import balance_vision_encoder

    model = balance_vision_encoder(models.make_model(family, seed=0, dtype=torch.float64), DPBalanceConfig(vision=True))
    # find_unused_parameters: a rank without images leaves the tower unused, with or without balancing
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    batch = vision_row(family, items_by_rank[rank], seed=100 + rank)
    ddp(**batch).loss.backward()
    (stats,) = model._dp_balance_vision.pop_stats()
    return {"grads": {n: (p.grad * world).detach().numpy().copy() for n, p in model.named_parameters()
                      if p.grad is not None}, "stats": stats}


def _all_families_rank(rank, world, scenarios_by_family):
    out = {family: _equivalence_rank(rank, world, family, scenarios) for family, scenarios in scenarios_by_family.items()}
    out["ddp"] = _ddp_rank(rank, world, "qwen2_vl", SKEWED["qwen2_vl"])
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    """Every family on the same two gloo ranks (process start-up is most of the cost: pay it once)."""
    by_rank = run_ranks(_all_families_rank, 2, SCENARIOS, timeout=300)
    return {key: [per_rank[key] for per_rank in by_rank] for key in FAMILIES + ("ddp",)}


@pytest.mark.parametrize("family", FAMILIES)
def test_balanced_vision_equals_unbalanced_two_ranks(family, two_rank_results):
    results = two_rank_results[family]
    skewed = _scenario(results, 0)
    _assert_equivalent(skewed)
    for res in skewed:
        (stats,) = res["stats"]
        assert stats["applied"] and stats["items_moved"] >= 1 and stats["pixel_bytes_moved"] > 0
        assert stats["imbalance_after"] < stats["imbalance_before"]
    assert skewed[1]["stats"][0]["local_items"] == 0 and skewed[1]["stats"][0]["computed_items"] >= 1


def test_balanced_inside_ddp_gives_the_reference_gradient(two_rank_results):
    """DDP's gradient all-reduce and the backward all_to_all (own process group) do not interfere."""
    ddp = two_rank_results["ddp"]
    reference = _scenario(two_rank_results["qwen2_vl"], 0)[0]["reference"]["grads"]
    assert ddp[0]["stats"]["applied"]
    for rank, res in enumerate(ddp):
        assert res["grads"].keys() == reference.keys()
        for name, g in res["grads"].items():
            _assert_close(reference[name], g, f"rank {rank} DDP gradient {name}")


@pytest.mark.parametrize("k, why", [(1, "already at the lower bound"), (2, "< min_gain 90.0%")])
def test_skip_path_runs_own_images_and_moves_nothing(two_rank_results, k, why):
    """Even mix (nothing to gain) and skewed mix under min_gain=0.9: skipped on every rank alike."""
    scenario = _scenario(two_rank_results["qwen3_vl"], k)
    _assert_equivalent(scenario)
    for res in scenario:
        (stats,) = res["stats"]
        assert not stats["applied"] and stats["pixel_bytes_moved"] == 0 and stats["items_moved"] == 0
        assert why in stats["reason"]
        assert stats["imbalance_after"] == stats["imbalance_before"]


def test_images_and_videos_four_ranks_with_an_idle_rank():
    """Two equal large items on rank 0 and a tiny one on rank 3: one of ranks 1, 2 gets a large
    item, the other owns nothing and computes nothing, yet joins every collective and the backward."""
    items = [[("image", 1, 8, 8), ("video", 1, 8, 8)], [], [], [("image", 1, 2, 2)]]
    results = run_ranks(_equivalence_rank, 4, "qwen2_5_vl", [(items, {})], timeout=240)
    scenario = _scenario(results, 0)
    _assert_equivalent(scenario)
    stats = [res["stats"][0] for res in scenario]
    assert all(s["applied"] for s in stats)
    idle = [r for r, s in enumerate(stats) if s["local_items"] == 0 and s["computed_items"] == 0]
    assert idle and set(idle) <= {1, 2}, f"expected an idle rank among 1, 2: {stats}"


# ---------------------------------------------------------------------------- single process


def test_without_process_group_the_wrapper_changes_nothing():
    """No initialised group (or eval mode): the model runs exactly as before, no collective is attempted."""
    import torch

    from hf_dp_balance.testing import models
    from hf_dp_balance.runtime.vision import balance_vision_encoder

    model = models.make_model("qwen2_vl", seed=0, dtype=torch.float64)
    batch = vision_row("qwen2_vl", SKEWED["qwen2_vl"][0][:2], seed=1)
    before = model(**batch).loss.item()
    assert balance_vision_encoder(model) is model
    assert model(**batch).loss.item() == before
    assert model._dp_balance_vision.pop_stats() == []
    model._dp_balance_vision.remove()


def test_bad_inputs_name_what_is_wrong():
    import torch

    from hf_dp_balance.testing import models
    from hf_dp_balance.runtime.vision import balance_vision_encoder

    with pytest.raises(ValueError, match="no supported vision-language base model"):
        balance_vision_encoder(models.make_model("text", seed=0))
    model = balance_vision_encoder(models.make_model("qwen2_vl", seed=0))
    tower = model._dp_balance_vision.tower
    rows = torch.zeros(16, tower.row_width)
    with pytest.raises(ValueError, match="rank 3: pixel_values has shape"):
        tower.local_items({"pixel_values": rows, "image_grid_thw": torch.tensor([[1, 4, 2]])}, rank=3)
    with pytest.raises(ValueError, match=r"rank 1: image_grid_thw\[0\]=\[1, 4, 3\] is not divisible"):
        tower.local_items({"pixel_values": rows[:12], "image_grid_thw": torch.tensor([[1, 4, 3]])}, rank=1)
    with pytest.raises(ValueError, match="rank 0: pixel_values_videos given without video_grid_thw"):
        tower.local_items({"pixel_values_videos": rows}, rank=0)
    items, used = tower.local_items({"pixel_values": rows, "image_grid_thw": torch.tensor([[1, 4, 4]])}, rank=0)
    assert used == ["pixel_values"] and items.grids.tolist() == [[1, 4, 4]] and items.out_rows.tolist() == [4]
