"""Trainer integration on real gloo ranks: install / uninstall leave the Trainer as it was, train() twice stays balanced."""

import numpy as np
import torch

from hf_dp_balance.testing.spawn import run_ranks


class _TextSamples(torch.utils.data.Dataset):
    """Text samples with long-tail lengths; token 1 encodes the index, so every sample is identifiable."""

    def __init__(self, n: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(np.log(40), 1.0, size=n), 6, 240).astype(int)
        self.items = []
        for i, length in enumerate(lengths):
            ids = torch.tensor([2, 11 + i] + rng.integers(11 + n, 512, size=int(length) - 2).tolist())
            self.items.append({"input_ids": ids, "labels": ids.clone()})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _trainer(out_dir, callbacks):
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.core.packing import PackedCollator

    transformers.logging.set_verbosity_error()
    model = make_model("text", seed=0)
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, max_steps=3, optim="sgd", learning_rate=0.1,
                             report_to=[], logging_steps=1, save_strategy="no", remove_unused_columns=False,
                             disable_tqdm=True, seed=0, data_seed=0, dataloader_drop_last=True)
    return Trainer(model=model, args=args, train_dataset=_TextSamples(48), data_collator=PackedCollator(model.config),
                   callbacks=callbacks)


def _watch(trainer, seen):
    """Forward pre-hook: per forward, (train run, rank-local step, indices of the packed samples)."""

    def hook(module, args, kwargs):
        ids, pos = kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist()
        seen.append((trainer._run_no, trainer.state.global_step,
                     tuple(ids[i + 1] - 11 for i, p in enumerate(pos) if p == 0 and i + 1 < len(ids))))

    trainer.model.register_forward_pre_hook(hook, with_kwargs=True)


def _snapshot(trainer, dataloader):
    """What install may touch, by identity: the trainer's instance attributes, the loader's collate and device."""
    return ({k: id(v) for k, v in vars(trainer).items()}, id(dataloader.base_dataloader),
            id(dataloader.base_dataloader.collate_fn), dataloader.device)


def _install_uninstall(rank, trainer, cfg):
    """install / uninstall by hand on a Trainer whose train dataloader exists: exact restore, idempotence."""
    from hf_dp_balance.integrations.install import install_balanced_loader, installed_loader, uninstall_balanced_loader

    dataloader = trainer.get_train_dataloader()
    trainer.callback_handler.train_dataloader = dataloader
    before = _snapshot(trainer, dataloader)
    first = install_balanced_loader(trainer, cfg)
    patched = "get_batch_samples" in vars(trainer) and dataloader.device is None
    again = install_balanced_loader(trainer, cfg)  # live and on the current loader: reused
    uninstall_balanced_loader(trainer)
    restored = _snapshot(trainer, dataloader) == before and installed_loader(trainer) is None
    uninstall_balanced_loader(trainer)  # idempotent: nothing left to undo, nothing raised
    restored_twice = _snapshot(trainer, dataloader) == before
    fresh = install_balanced_loader(trainer, cfg)  # after uninstall: a new loader, never the closed one
    fresh_ok = fresh is not first and installed_loader(trainer) is fresh and "get_batch_samples" in vars(trainer)
    uninstall_balanced_loader(trainer)
    return {"patched": patched, "reused": again is first, "restored": restored, "restored_twice": restored_twice,
            "fresh": fresh_ok, "restored_after_fresh": _snapshot(trainer, dataloader) == before}


class _Interrupted(RuntimeError):
    pass


def _rank_main(rank, world, out_dir):
    from transformers import TrainerCallback

    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.install import install_balanced_loader, installed_loader

    torch.set_num_threads(1)
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=60, warmup_steps=100)
    cost = CostModel(quadratic=1.0, linear=20.0)
    out = {"by_hand": _install_uninstall(rank, _trainer(f"{out_dir}/hand", []), cfg)}

    # 1. A run that raises mid-way (no on_train_end, nothing uninstalled), then train() again on the same Trainer.
    class Install(TrainerCallback):
        loaders, interrupt_at = [], None

        def on_train_begin(self, args, state, control, **kwargs):
            self.loaders.append(install_balanced_loader(trainer, cfg, cost_model=cost))

        def on_step_begin(self, args, state, control, **kwargs):  # balanced at every step of every run?
            steps.append((trainer._run_no, "get_batch_samples" in vars(trainer),
                          installed_loader(trainer) is self.loaders[-1]))

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.interrupt_at:
                raise _Interrupted(f"stopped at step {state.global_step}")

    steps, seen = [], []
    install = Install()
    trainer = _trainer(f"{out_dir}/rerun", [install])
    _watch(trainer, seen)
    trainer._run_no, install.interrupt_at = 1, 2
    try:
        trainer.train()
    except _Interrupted:
        pass
    trainer._run_no, install.interrupt_at = 2, None
    trainer.train()
    stats = install.loaders[-1].pop_stats()
    out["rerun"] = {"steps": steps, "seen": [s for s in seen if s[0] == 2],
                    "distinct_loaders": len({id(x) for x in install.loaders}),
                    "applied": sum(s.applied for s in stats), "moved": sum(s.moved_samples for s in stats),
                    "plan_hashes": [s.plan_hash for s in stats]}

    # 2. DPBalanceCallback (installs at train begin, uninstalls at train end): train() twice.
    balance = DPBalanceCallback(cfg, cost_model=cost)
    trainer = _trainer(f"{out_dir}/callback", [balance])
    runs = []
    for _ in (1, 2):
        trainer.train()
        logs = [h for h in trainer.state.log_history if "dp_balance/applied" in h]
        runs.append({"applied": sum(h["dp_balance/applied"] for h in logs),
                     "moved": sum(h["dp_balance/moved_samples"] for h in logs),
                     "clean_after": installed_loader(trainer) is None and "get_batch_samples" not in vars(trainer)})
    out["callback"] = runs
    return out


def test_install_uninstall_restore_the_trainer_and_a_second_train_is_balanced(tmp_path):
    results = run_ranks(_rank_main, 2, str(tmp_path), timeout=120)
    for r in results:
        assert r["by_hand"] == {k: True for k in r["by_hand"]}, r["by_hand"]

        rerun = r["rerun"]
        assert rerun["distinct_loaders"] == 2  # the interrupted run's loader was replaced, not handed back
        # every step of both runs went through the patched get_batch_samples of the run's own loader
        assert rerun["steps"] == [(1, True, True)] * 2 + [(2, True, True)] * 3
        assert rerun["applied"] == 3 and rerun["moved"] > 0  # the second run was planned and samples moved

        for run in r["callback"]:
            assert run["clean_after"]
            assert run["applied"] == 3 and run["moved"] > 0
    # same plans on both ranks, and the second run trained every sample of its 3 steps exactly once
    assert results[0]["rerun"]["plan_hashes"] == results[1]["rerun"]["plan_hashes"]
    trained = [i for r in results for _, _, rows in r["rerun"]["seen"] for i in rows]
    assert len(trained) == len(set(trained)) == 3 * 2 * 3 * 2  # steps x GA x batch size x ranks
