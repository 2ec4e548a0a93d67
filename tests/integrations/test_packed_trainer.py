"""A stock Trainer whose data collator already packs, balanced by DPBalanceCallback (input="auto" splits its rows)."""

import torch

from hf_dp_balance.testing.spawn import run_ranks


def _train(rank, world, outdir, family, layout):
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.runtime.packed_input import PackedInput
    from hf_dp_balance.testing.data import build_synthetic_dataset, make_model, to_sample
    from hf_dp_balance.testing.packed_users import UserCollator

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    data = [to_sample(r) for r in build_synthetic_dataset(family, 24, seed=1, scale=1 / 32)]  # 2 steps

    class PackedInputCallback(DPBalanceCallback):
        """The stock callback (input="auto" finds the user's packing collator); keeps the stats for the test."""

        def _install_loader(self, train_dataloader, model, args):
            loader = super()._install_loader(train_dataloader, model, args)
            assert isinstance(loader.packed_input, PackedInput)  # the user's own collator: its rows are split
            self.packed_input, self.stats, take = loader.packed_input, [], loader.pop_stats

            def pop_stats():  # the callback pops the stats for its logs; keep a copy for the test
                out = take()
                self.stats.extend(out)
                return out

            loader.pop_stats = pop_stats
            self.kept = loader
            return loader

    def train(balanced):
        model = make_model(family, seed=0, dtype=torch.float64)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = TrainingArguments(output_dir=f"{outdir}/{int(balanced)}", use_cpu=True, per_device_train_batch_size=3,
                                 gradient_accumulation_steps=2, max_steps=2, optim="sgd", learning_rate=1.0,
                                 max_grad_norm=0.0, report_to=[], logging_strategy="no", save_strategy="no",
                                 remove_unused_columns=False, train_sampling_strategy="sequential",
                                 disable_tqdm=True, seed=0)
        cb = PackedInputCallback(DPBalanceConfig(timeout_s=60, min_gain=0.0, warmup_steps=0, vision=False),
                                 cost_model=CostModel(quadratic=1.0, linear=20.0))
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=UserCollator(model.config, family, layout),
                          callbacks=[cb] if balanced else [])
        trainer.train()
        if balanced:
            cb.kept.pop_stats()  # the steps the callback did not log
        return {n: p.detach() - start[n] for n, p in model.named_parameters()}, cb

    ref, _ = train(False)
    bal, cb = train(True)
    num = sum(float((bal[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
    den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    return num / den, den, [(s.moved_samples, s.plan_hash) for s in cb.stats], cb.packed_input.kind


def test_trainer_with_a_packing_collator_trains_as_unbalanced(tmp_path):
    from hf_dp_balance.core.unpacking import INPUT_CU_SEQ_LENS

    for family in ("text", "qwen2_vl"):
        results = run_ranks(_train, 2, str(tmp_path / family), family, "flash", timeout=400)
        for update_rel, update_norm, stats, kind in results:
            assert kind == INPUT_CU_SEQ_LENS
            assert update_norm > 0
            assert update_rel < 1e-5, (family, update_rel)
            assert len(stats) == 2
        assert results[0][2] == results[1][2]  # identical plans
        assert sum(moved for moved, _ in results[0][2]) > 0, family
