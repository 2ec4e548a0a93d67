"""Under sharded data parallelism a rank whose packed row has no image still runs the vision tower, so every
rank reaches the same collectives.

Hand-written FSDP2 (`fully_shard` on gloo, the vision tower as its own unit, then the whole model) with rank 1
text-only: with PackedCollator's dummy image every VLM family trains a few steps; without it the ranks issue
different collectives (the tower's all-gather on rank 0 only) and fail (a check of torch and DeepSpeed, run
with --upstream). DeepSpeed ZeRO-3 (0.19.8, CPU accelerator, gloo) likewise. Real gloo processes, hard timeouts.
"""

import pytest

from hf_dp_balance.testing.spawn import run_ranks, run_ranks_allow_failures

VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")
STEPS = 3


def _vision_tower(model):
    inner = model.model
    return inner.visual if hasattr(inner, "visual") else inner.vision_tower


def _fsdp_family(rank, world, family, dummy_vision):
    """STEPS optimizer steps of one family under FSDP2; rank 0 trains an image + a text sample, rank 1 two texts.

    Returns the losses, the first step's loss of the same model unsharded (reference) and, per rank, whether
    every vision parameter got a gradient (its local shard)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, batch = _batch_of_rank(rank, family, dummy_vision)
    with torch.no_grad():
        reference = float(model(**batch).loss)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(_vision_tower(model), mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    losses, every_tower_grad = [], True
    for _ in range(STEPS):
        optim.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        every_tower_grad &= all(p.grad is not None for p in _vision_tower(model).parameters())
        optim.step()
        losses.append(float(loss))
    return {"losses": losses, "reference": reference, "every_tower_grad": every_tower_grad}


def _batch_of_rank(rank, family, dummy_vision):
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import make_model

    model = make_model(family, seed=0)
    samples = make_samples(family, ("image", "text", "text", "text"), seed=5)
    return model, PackedCollator(model.config, dummy_vision=dummy_vision)(samples[:2] if rank == 0 else samples[2:])


def _zero3_family(rank, world, family, dummy_vision):
    """STEPS steps of one family under DeepSpeed ZeRO-3 (CPU accelerator, the spawner's gloo group)."""
    import deepspeed
    import deepspeed.ops
    import torch

    # DeepSpeed's CPU backend would JIT-compile its shared-memory all-reduce (a C++ build of minutes, and a
    # lock file under ~/.cache that a killed build leaves behind makes every later run wait on it forever);
    # without it ZeRO-3 runs its collectives on the spawner's gloo group, which is what this test is about.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    model, batch = _batch_of_rank(rank, family, dummy_vision)
    with torch.no_grad():
        reference = float(model(**batch).loss)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": 1e-2}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    losses = []
    for _ in range(STEPS):
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"losses": losses, "reference": reference, "every_tower_grad": True}


def _sharded_rank(rank, world, fsdp_families, zero3_families, dummy_vision):
    out = {("fsdp2", f): _fsdp_family(rank, world, f, dummy_vision) for f in fsdp_families}
    out.update({("zero3", f): _zero3_family(rank, world, f, dummy_vision) for f in zero3_families})
    return out


@pytest.fixture(scope="module")
def with_dummy():
    """FSDP2 on every VLM family and ZeRO-3 on two, rank 1 text-only, in one pair of processes."""
    pytest.importorskip("deepspeed")
    return run_ranks(_sharded_rank, 2, VLM_FAMILIES, ("qwen2_vl", "internvl"), True, timeout=300, pg_timeout_s=60)


@pytest.mark.parametrize("kind, family", [("fsdp2", f) for f in VLM_FAMILIES] + [("zero3", "qwen2_vl"),
                                                                                 ("zero3", "internvl")])
def test_sharded_training_with_a_text_only_rank_runs_with_the_dummy(kind, family, with_dummy):
    for rank, res in enumerate(r[(kind, family)] for r in with_dummy):
        assert len(res["losses"]) == STEPS and all(l == l for l in res["losses"]), rank
        assert res["losses"][0] == pytest.approx(res["reference"], rel=1e-5), rank
        assert res["every_tower_grad"], rank  # FSDP2: the tower's reduce-scatter ran on both ranks
    assert with_dummy[0][(kind, family)]["losses"][-1] < with_dummy[0][(kind, family)]["losses"][0]  # it trains


@pytest.mark.upstream  # how FSDP2 fails without the dummy: torch's behaviour, which the dummy exists for
def test_fsdp2_without_the_dummy_fails_when_one_rank_is_text_only():
    """The failure the dummy prevents: rank 0 waits in the tower's parameter all-gather, rank 1 in
    the next unit's reduce-scatter, until gloo's timeout (here 10 s)."""
    outcome = run_ranks_allow_failures(_sharded_rank, 2, ("qwen2_vl",), (), False, timeout=90, pg_timeout_s=10)
    assert not any(ok for ok, _ in outcome), outcome
    assert any("Timed out" in str(err) for _, err in outcome), outcome


@pytest.mark.upstream  # how ZeRO-3 fails without the dummy: DeepSpeed's behaviour, which the dummy exists for
def test_zero3_without_the_dummy_fails_when_one_rank_is_text_only():
    """ZeRO-3: the ranks all-gather different parameters; gloo aborts one rank, the other sees its peer go."""
    pytest.importorskip("deepspeed")
    outcome = run_ranks_allow_failures(_sharded_rank, 2, (), ("qwen2_vl",), False, timeout=90, pg_timeout_s=10)
    assert not any(ok for ok, _ in outcome), outcome


def _ddp_grads(model, batch, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, find_unused_parameters=False)  # Trainer's choice under checkpointing
    ddp(**batch).loss.backward()
    return {n: (p.grad * world).detach().numpy().copy() for n, p in model.named_parameters() if p.grad is not None}


def _vision_balanced_ddp_family(rank, world, family):
    """Vision balancing moves rank 0's images to rank 1, whose row holds only text and the dummy image."""
    import torch

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import make_model

    samples = make_samples(family, ("image", "multi_image", "image", "text"), seed=7, vision_tokens=96)
    samples = [{k: (v.double() if v.is_floating_point() else v) for k, v in s.items()} for s in samples]
    batch = PackedCollator(make_model(family).config)(samples[:3] if rank == 0 else samples[3:])
    plain = _ddp_grads(make_model(family, seed=0, dtype=torch.float64), batch, world)
    model = balance_vision_encoder(make_model(family, seed=0, dtype=torch.float64), DPBalanceConfig(vision=True))
    balanced = _ddp_grads(model, batch, world)
    (stats,) = model._dp_balance_vision.pop_stats()
    return {"plain": plain, "balanced": balanced, "stats": stats}


def _vision_balanced_ddp_rank(rank, world, families):
    return {family: _vision_balanced_ddp_family(rank, world, family) for family in families}


@pytest.fixture(scope="module")
def vision_balanced():
    return run_ranks(_vision_balanced_ddp_rank, 2, ("qwen2_vl", "internvl"), timeout=180, pg_timeout_s=30)


@pytest.mark.parametrize("family", ["qwen2_vl", "internvl"])
def test_vision_balancing_with_a_dummy_rank_under_ddp_without_unused_parameter_search(family, vision_balanced):
    """The dummy is just a tiny image to the vision wrapper: rank 1 still encodes something (its dummy, plus
    what it receives), so every tower parameter has a gradient on both ranks and the result is the reference."""
    import numpy as np

    results = [r[family] for r in vision_balanced]
    for rank, res in enumerate(results):
        assert res["stats"]["applied"] and res["stats"]["computed_items"] >= 1, (rank, res["stats"])
        assert res["balanced"].keys() == res["plain"].keys()
        for name, grad in res["plain"].items():
            np.testing.assert_allclose(res["balanced"][name], grad, rtol=1e-9, atol=1e-12, err_msg=name)
    assert results[1]["stats"]["local_items"] == 1  # the dummy
