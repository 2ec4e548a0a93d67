"""A stock Trainer whose data collator already packs, balanced by DPBalanceCallback (input="auto" splits its rows)."""

import torch

from hf_dp_balance.testing.spawn import run_ranks


def _train(rank, world, outdir, family, layout, extra=None):
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.packed_input import PackedInput
    from hf_dp_balance.testing.callbacks import StatsKeepingCallback
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.packed_users import UserCollator

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    data = [to_sample(r) for r in build_synthetic_dataset(family, 24, seed=1, scale=1 / 32)]  # 2 steps

    def train(balanced):
        model = make_model(family, seed=0, dtype=torch.float64)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        widths = []  # the rows the model receives
        model.register_forward_pre_hook(lambda m, a, kw: widths.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        args = TrainingArguments(output_dir=f"{outdir}/{layout}{int(balanced)}", use_cpu=True,
                                 per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=2,
                                 optim="sgd", learning_rate=1.0, max_grad_norm=0.0, report_to=[], logging_steps=1,
                                 save_strategy="no", remove_unused_columns=False, train_sampling_strategy="sequential",
                                 disable_tqdm=True, seed=0, **(extra or {}))
        cb = StatsKeepingCallback(DPBalanceConfig(timeout_s=60, min_gain=0.0, warmup_steps=0, vision=False),
                                  cost_model=CostModel(quadratic=1.0, linear=20.0))
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=UserCollator(model.config, family, layout),
                          callbacks=[cb] if balanced else [])
        trainer.train()
        if balanced:
            assert isinstance(cb.packed_input, PackedInput)  # input="auto" found the user's collator: rows split
            cb.kept.pop_stats()  # the steps the callback did not log
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return {n: p.detach() - start[n] for n, p in model.named_parameters()}, cb, losses, widths

    ref, _, ref_losses, _ = train(False)
    bal, cb, losses, widths = train(True)
    num = sum(float((bal[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
    den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    loss_gap = max(abs(a - b) for a, b in zip(losses, ref_losses)) if losses else float("nan")
    return (num / den, den, [(s.moved_samples, s.plan_hash) for s in cb.stats], cb.packed_input.kind, loss_gap,
            widths)


def _train_layouts(rank, world, outdir, family, layouts):
    return {layout: _train(rank, world, outdir, family, layout) for layout in layouts}


def test_trainer_with_a_packing_collator_trains_as_unbalanced(tmp_path):
    from hf_dp_balance.core.unpacking import INPUT_CU_SEQ_LENS

    for family in ("text", "qwen2_vl"):
        results = run_ranks(_train, 2, str(tmp_path / family), family, "flash", timeout=400)
        for update_rel, update_norm, stats, kind, _, _ in results:
            assert kind == INPUT_CU_SEQ_LENS
            assert update_norm > 0
            assert update_rel < 1e-5, (family, update_rel)
            assert len(stats) == 2
        assert results[0][2] == results[1][2]  # identical plans
        assert sum(moved for moved, _ in results[0][2]) > 0, family


def test_trainer_with_transformers_and_trl_padding_collators_trains_as_unbalanced(tmp_path):
    """DataCollatorForLanguageModeling(mlm=False), DataCollatorForSeq2Seq (left padding), TRL padding-free, each
    with pad_to_multiple_of=64, under the default input="auto": same loss per step and update, rows aligned."""
    from hf_dp_balance.core.unpacking import INPUT_CU_SEQ_LENS, INPUT_PADDED
    from hf_dp_balance.testing.packed_users import PADDING_LAYOUTS

    results = run_ranks(_train_layouts, 2, str(tmp_path), "text", PADDING_LAYOUTS, timeout=400)
    for layout in PADDING_LAYOUTS:
        plans = []
        for rank_results in results:
            update_rel, update_norm, stats, kind, loss_gap, widths = rank_results[layout]
            assert kind == (INPUT_CU_SEQ_LENS if layout == "trl_aligned" else INPUT_PADDED), layout
            assert update_norm > 0 and update_rel < 1e-5, (layout, update_rel)
            assert loss_gap < 1e-5, (layout, loss_gap)
            assert widths and all(width % 64 == 0 for _, width in widths), (layout, widths)
            if layout != "trl_aligned":  # padded in, padded out: one sample per row
                assert any(rows > 1 for rows, _ in widths), (layout, widths)
            plans.append(stats)
        assert plans[0] == plans[1]
        assert sum(moved for moved, _ in plans[0]) > 0, layout


def _per_rank_mean(rank, world, outdir):
    """average_tokens_across_devices=False: refused at train begin; with the opt-in, trains and says so."""
    import logging

    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.packed_users import UserCollator

    from hf_dp_balance.integrations import loss_contract

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_warning()  # the opt-in's line is a warning
    data = [to_sample(r) for r in build_synthetic_dataset("text", 12, seed=1, scale=1 / 32)]
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    loss_contract.logger.addHandler(Keep())
    out = []
    for allow in (False, True):
        model = make_model("text", seed=0, dtype=torch.float64)
        args = TrainingArguments(output_dir=f"{outdir}/{allow}", use_cpu=True, per_device_train_batch_size=3,
                                 max_steps=1, report_to=[], save_strategy="no", remove_unused_columns=False,
                                 disable_tqdm=True, average_tokens_across_devices=False)
        cb = DPBalanceCallback(DPBalanceConfig(timeout_s=60, warmup_steps=0, allow_per_rank_loss_mean=allow))
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb],
                          data_collator=UserCollator(model.config, "text", "lm_padded"))
        try:
            trainer.train()
            out.append(("trained", trainer.state.global_step))
        except ValueError as exc:
            out.append(("refused", str(exc)))
    return out, seen


def test_a_per_rank_loss_mean_is_refused_by_name_or_trained_with_the_opt_in_said_once(tmp_path):
    for (refused, message), trained, seen in ((r[0][0], r[0][1], r[1]) for r in run_ranks(_per_rank_mean, 2, str(tmp_path), timeout=300)):
        assert refused == "refused" and "average_tokens_across_devices=False" in message, message
        assert "allow_per_rank_loss_mean" in message
        assert trained == ("trained", 1)
        assert sum("differs from the unbalanced run" in line for line in seen) == 1, seen


def _cap_below_rows(rank, world, outdir):
    import time

    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.packed_users import UserCollator

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    data = [to_sample(r) for r in build_synthetic_dataset("text", 24, seed=1, scale=1 / 32)]  # samples <= 76 tokens
    model = make_model("text", seed=0, dtype=torch.float64)
    args = TrainingArguments(output_dir=outdir, use_cpu=True, per_device_train_batch_size=3, max_steps=2,
                             report_to=[], save_strategy="no", remove_unused_columns=False, disable_tqdm=True)
    cb = DPBalanceCallback(DPBalanceConfig(timeout_s=60, warmup_steps=0, max_tokens=80))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb],
                      data_collator=UserCollator(model.config, "text", "positions"))
    start = time.monotonic()
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the test reads every rank's message
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return None, time.monotonic() - start


def test_a_cap_below_the_user_s_row_width_is_an_error_naming_both_on_every_rank(tmp_path):
    for message, seconds in run_ranks(_cap_below_rows, 2, str(tmp_path), timeout=200):
        assert message is not None and "max_tokens=80" in message, message
        assert "tokens wide" in message and "step 1" in message, message
        assert seconds < 60
