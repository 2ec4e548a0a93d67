"""The Trainer callback and DPBalancer are adapters over one BalanceSession: the same data-parallel group, the
same start models on every rank, the same lifetimes, however the callback was added. Real gloo ranks."""

import json
import os

import pytest
import torch

from hf_dp_balance.testing.spawn import run_ranks

GA = 2


def _cost_model():
    from hf_dp_balance.core.cost import CostModel

    return CostModel(quadratic=1.0, linear=5.0)


def _config(**kw):
    from hf_dp_balance.config import DPBalanceConfig

    return DPBalanceConfig(**{"min_gain": 0.0, "timeout_s": 60, "max_token_ratio": 3.0, "warmup_steps": 100, **kw})


def _per_step(seen):
    """{step: [digest of each micro-batch]} and {step: [sample indices]} of one rank's forwards."""
    digests, samples = {}, {}
    for step, ids, dig in seen:
        digests.setdefault(step, []).append(dig)
        samples.setdefault(step, []).extend(ids)
    return digests, samples


# --------------------------------------------------------------------------- 2 (dp) x 2 (tp): tp peers identical


def _trainer_tp(rank, world, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.runs import text_trainer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cb = DPBalanceCallback(_config(), cost_model=_cost_model(), data_parallel_group=mesh["dp"])
    # 64 samples, 4 per micro-batch, 2 data-parallel ranks, GA 2: one pass is 4 steps
    trainer, seen = text_trainer(os.path.join(out_dir, "tp"), max_steps=4, n=64, callback=cb,
                                 gradient_accumulation_steps=GA)
    trainer.train()
    moved = sum(h.get("dp_balance/moved_samples", 0) for h in trainer.state.log_history)
    return {"seen": seen, "moved": moved}


def test_trainer_tp_peers_train_identical_micro_batches_and_each_dp_group_every_sample_once(tmp_path):
    out = run_ranks(_trainer_tp, 4, str(tmp_path), timeout=300, pg_timeout_s=90)
    steps = [_per_step(o["seen"]) for o in out]
    # mesh [[0, 1], [2, 3]] as (dp, tp): tp peers are 0/1 and 2/3, the data-parallel groups 0/2 and 1/3
    for a, b in ((0, 1), (2, 3)):
        assert steps[a][0] == steps[b][0] and len(steps[a][0]) == 4  # byte-identical micro-batches, every step
    assert steps[0][0] != steps[2][0]  # the data-parallel ranks differ (the comparison above could fail)
    for group in ((0, 2), (1, 3)):
        trained = sorted(i for r in group for ids in steps[r][1].values() for i in ids)
        assert trained == list(range(64))  # every sample exactly once per data-parallel group
    assert out[0]["moved"] > 0  # balancing applied


def _balancer_tp(rank, world):
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config
    from hf_dp_balance.testing.runs import TextSamples, digest

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)  # a plain accelerator: no device mesh
    plain = torch.utils.data.DataLoader(TextSamples(32, with_ids=True), batch_size=2)
    digests = []
    with DPBalancer(acc, model_config=tiny_config("text"), config=_config(), cost_model=_cost_model(),
                    data_parallel_group=mesh["dp"], id_key="sample_id") as balancer:
        for batch in balancer.prepare(plain):
            digests.append(digest(batch))
        ids = [i for s in balancer.step_stats for mb in s.local_ids for i in mb]
        moved = sum(s.moved_samples for s in balancer.step_stats)
    return {"digests": digests, "ids": ids, "moved": moved}


def test_dpbalancer_with_an_explicit_group_and_a_plain_dataloader_shards_by_dp_index():
    out = run_ranks(_balancer_tp, 4, timeout=200, pg_timeout_s=60)
    for a, b in ((0, 1), (2, 3)):
        assert out[a]["digests"] == out[b]["digests"] and len(out[a]["digests"]) == 8
    assert out[0]["digests"] != out[2]["digests"]
    for group in ((0, 2), (1, 3)):
        assert sorted(i for r in group for i in out[r]["ids"]) == list(range(32))
    assert out[0]["moved"] > 0


def _trainer_tp_added_late(rank, world, out_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.runs import text_trainer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cb = DPBalanceCallback(_config(), cost_model=_cost_model(), data_parallel_group=mesh["dp"])
    trainer, seen = text_trainer(os.path.join(out_dir, "late"), max_steps=4, n=64, callback=cb, add="add_callback")
    try:
        trainer.train()
    except ValueError as exc:
        return {"error": str(exc), "forwards": len(seen)}
    return {"error": None, "forwards": len(seen)}


def test_an_explicit_group_with_a_callback_added_after_init_is_refused_before_any_step(tmp_path):
    # Trainer shards its loader by process before any event reaches a late callback: tp peers would train
    # different samples, so every rank refuses at train begin, naming the way out
    out = run_ranks(_trainer_tp_added_late, 4, str(tmp_path), timeout=300, pg_timeout_s=90)
    for o in out:
        assert o["error"] is not None and "add_callback" in o["error"] and "callbacks=" in o["error"], o
        assert "sharded over 4 processes" in o["error"] and "has 2" in o["error"], o["error"]
        assert o["forwards"] == 0


# --------------------------------------------------------------------------- add_callback == callbacks=


def _two_ways(rank, world, out_dir):
    import torch.distributed as dist

    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.runs import text_trainer

    torch.set_num_threads(1)
    out = {}
    for way in ("callbacks", "add_callback"):
        folder = os.path.join(out_dir, way)
        cb = DPBalanceCallback(_config(), cost_model=_cost_model())
        first, seen1 = text_trainer(folder, max_steps=6, save_steps=3, n=48, callback=cb, add=way)
        first.train()
        dist.barrier()
        cb2 = DPBalanceCallback(_config(), cost_model=_cost_model())
        second, seen2 = text_trainer(folder, max_steps=6, save_steps=100, n=48, callback=cb2, add=way)
        second.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-3"))
        logs = [h for h in first.state.log_history if "loss" in h]
        out[way] = {"losses": [h["loss"] for h in logs], "keys": all("dp_balance/fitted" in h for h in logs),
                    "moved": sum(h.get("dp_balance/moved_samples", 0) for h in logs),
                    "first": [ids for step, ids, _ in seen1 if step <= 3],
                    "resumed": [ids for step, ids, _ in seen2 if step > 3]}
    return out


def test_add_callback_behaves_as_callbacks_argument(tmp_path):
    out = run_ranks(_two_ways, 2, str(tmp_path), timeout=400, pg_timeout_s=120)
    for way in ("callbacks", "add_callback"):
        for o in out:
            assert o[way]["keys"] and o[way]["moved"] > 0, way  # dp_balance/* in the logs; balancing applied
        trained = sorted(i for o in out for part in ("first", "resumed") for ids in o[way][part] for i in ids)
        assert trained == list(range(48)), way  # mid-epoch resume: every sample exactly once
    assert out[0]["add_callback"]["losses"] == out[0]["callbacks"]["losses"]


# --------------------------------------------------------------------------- start models agreed


def _write_model(path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_cost_model().to_dict(), f)


def _model_on_one_rank(rank, world, out_dir, holder, front):
    """`cost_model_path` names a file only `holder` has (node-local disks: each rank its own path)."""
    import time

    from hf_dp_balance.config import DPBalanceConfig

    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"node{rank}", "cost.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if rank == holder:
        _write_model(path)
    cfg = _config(cost_model_path=path, warmup_steps=2, timeout_s=600)
    t0 = time.monotonic()
    try:
        if front == "trainer":
            from hf_dp_balance.integrations.callback import DPBalanceCallback
            from hf_dp_balance.testing.runs import text_trainer

            cb = DPBalanceCallback(cfg)
            trainer, _ = text_trainer(os.path.join(out_dir, "run"), max_steps=2, n=32, callback=cb)
            trainer.train()
            model = cb.decoder_model
        else:
            from accelerate import Accelerator

            from hf_dp_balance.integrations.accelerate import DPBalancer
            from hf_dp_balance.testing.models import tiny_config
            from hf_dp_balance.testing.runs import TextSamples

            with DPBalancer(Accelerator(cpu=True), model_config=tiny_config("text"), config=cfg) as balancer:
                for _ in balancer.prepare(torch.utils.data.DataLoader(TextSamples(16), batch_size=2)):
                    pass
                model = balancer.cost_model
        return {"model": model.to_dict() if model is not None else None, "error": None}
    except Exception as exc:  # noqa: BLE001 - what each rank was told, and when
        return {"error": str(exc), "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("front", ["trainer", "dpbalancer"])
def test_a_cost_model_on_one_rank_only_is_agreed_or_named_on_every_rank(tmp_path, front):
    # On rank 0 (the one that reads it): every rank plans with it.
    out = run_ranks(_model_on_one_rank, 2, str(tmp_path / "r0"), 0, front, timeout=200, pg_timeout_s=120)
    assert out[0]["error"] is None and out[1]["error"] is None, out
    assert out[0]["model"] == out[1]["model"] == _cost_model().to_dict()
    # On rank 1 only: every rank raises at once, naming the file and the rank that lacks it.
    out = run_ranks(_model_on_one_rank, 2, str(tmp_path / "r1"), 1, front, timeout=200, pg_timeout_s=120)
    for rank, o in enumerate(out):
        assert o["error"] is not None and "cost.json" in o["error"] and "rank 0" in o["error"], o
        assert o["seconds"] < 60, o


# --------------------------------------------------------------------------- resume inside a look-ahead window


def _resume_in_window(rank, world):
    from accelerate import Accelerator

    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config
    from hf_dp_balance.testing.runs import TextSamples

    torch.set_num_threads(1)
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    cfg = _config(lookahead_steps=3)
    runs, state = [], None
    for part in range(2):  # 6 steps in 2 windows of 3: stop after step 4 (inside the second window), resume
        with DPBalancer(acc, model_config=tiny_config("text"), config=cfg, cost_model=_cost_model(),
                        id_key="sample_id") as balancer:
            loader = balancer.prepare(torch.utils.data.DataLoader(TextSamples(48, with_ids=True), batch_size=2))
            if state is not None:
                loader.load_state_dict(state)
            for i, _ in enumerate(loader):
                if part == 0 and i == 4 * GA - 1:  # the last micro-batch of step 4
                    state = loader.state_dict()
                    break
            runs.append([i for s in balancer.step_stats for mb in s.local_ids for i in mb])
    return {"runs": runs, "window": state["loaders"][0]["position"]["window"] is not None}


def test_dpbalancer_resumed_inside_a_lookahead_window_trains_every_sample_once():
    out = run_ranks(_resume_in_window, 2, timeout=200, pg_timeout_s=60)
    assert out[0]["window"]  # the state was taken inside a window (the test could fail)
    trained = sorted(i for o in out for run in o["runs"] for i in run)
    assert trained == list(range(48))


# --------------------------------------------------------------------------- lifetimes


def _three_runs(rank, world, out_dir):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.runs import process_counts, text_trainer

    torch.set_num_threads(1)
    cb = DPBalanceCallback(DPBalanceConfig(min_gain=0.0, timeout_s=60, warmup_steps=100), cost_model=_cost_model())
    counts = []
    for i in range(3):
        trainer, _ = text_trainer(os.path.join(out_dir, f"run{i}"), max_steps=2, n=32, callback=cb)
        trainer.train()
        del trainer
        counts.append(process_counts())
    return counts


def test_three_train_calls_leak_no_threads_fds_or_process_groups(tmp_path):
    out = run_ranks(_three_runs, 2, str(tmp_path), timeout=300, pg_timeout_s=90)
    for counts in out:
        assert counts[2]["groups"] == counts[0]["groups"], counts
        assert counts[2]["threads"] <= counts[0]["threads"], counts
        assert counts[2]["fds"] <= counts[0]["fds"], counts


def test_both_front_ends_are_adapters_over_one_session_and_one_module_makes_groups():
    import pathlib

    import hf_dp_balance
    from hf_dp_balance.integrations import accelerate, callback

    root = pathlib.Path(hf_dp_balance.__file__).parent
    makers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if ".new_group(" in p.read_text())
    assert makers == ["runtime/side_channel.py"]
    for module in (accelerate, callback):
        source = pathlib.Path(module.__file__).read_text()
        assert "CostModelFitter(" not in source and "SideChannel(" not in source
        # opened all or nothing by the session (`BalanceSession.open`), with no try / close of the adapter's own
        assert "BalanceSession.open(" in source and "BalanceSession(" not in source and "except" not in source


# --------------------------------------------------------------------------- vision through the session


def _balancer_vision(rank, world):
    from accelerate import Accelerator

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import make_model

    torch.set_num_threads(1)
    model = make_model("qwen2_vl", seed=0)
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    vision = CostModel(quadratic=1.0, linear=1.0)
    with DPBalancer(acc, model=model, config=_config(vision=True), cost_model=_cost_model(),
                    vision_cost_model=vision) as balancer:
        session = balancer.session
        installed = session.vision is not None and getattr(model, "_dp_balance_vision", None) is session.vision
        tower_model = session.vision.cost_model is not None
    return {"installed": installed, "tower_model": tower_model, "left": hasattr(model, "_dp_balance_vision")}


def test_dpbalancer_balances_the_vision_tower_through_its_session():
    for o in run_ranks(_balancer_vision, 2, timeout=200, pg_timeout_s=60):
        assert o["installed"] and o["tower_model"]  # DPBalancer(config.vision) balances the tower itself
        assert not o["left"]  # and closing the balancer removes it
