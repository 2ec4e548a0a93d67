"""DPBalanceCallback in a stock Trainer on 2 real gloo ranks: warm-up fit, logs, checkpoint and resume."""

import json
import os

import numpy as np
import pytest
import torch

from hf_dp_balance.testing.runs import TextSamples, pack_text
from hf_dp_balance.testing.spawn import run_ranks
from hf_dp_balance.integrations.callback import CHECKPOINT_FILE, DPBalanceCallback, resolve_config, summarize_step_stats
from hf_dp_balance.runtime.loader import StepStats
from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel


# --------------------------------------------------------------------------- pure parts


def test_loader_stats_summary():
    def st(step, applied, before, after, moved):
        return StepStats(step=step, num_micro_batches=1, num_samples=8, applied=applied, reason="", plan_hash="",
                         imbalance_before=before, imbalance_after=after, moved_samples=moved, moved_bytes=10 * moved,
                         bytes_sent=0, bytes_received=0)

    out = summarize_step_stats([st(1, False, 0.1, 0.1, 0), st(2, True, 0.5, 0.1, 3)])
    assert out["applied"] == 1 and out["skipped"] == 1 and out["moved_samples"] == 3 and out["moved_bytes"] == 30
    assert out["imbalance_before"] == pytest.approx(0.3) and out["imbalance_after"] == pytest.approx(0.1)
    assert summarize_step_stats([]) == {}


def test_config_precedence(monkeypatch):
    # The one test of where a setting comes from: the callback's own config, else the dp_balance_* fields
    # of the TrainingArguments, else the defaults; HF_DP_BALANCE_* environment variables over all of them.
    class Args:
        dp_balance = False
        dp_balance_warmup_steps = 7
        dp_balance_min_gain = 0.05

    assert resolve_config(None, Args(), environ={}) == DPBalanceConfig(enabled=False, warmup_steps=7, min_gain=0.05)
    assert resolve_config(DPBalanceConfig(warmup_steps=2), Args(), environ={}) == DPBalanceConfig(warmup_steps=2)
    env = {"HF_DP_BALANCE_WARMUP_STEPS": "4"}
    assert resolve_config(DPBalanceConfig(warmup_steps=2), Args(), environ=env).warmup_steps == 4
    assert resolve_config(None, object(), environ={}) == DPBalanceConfig()
    assert resolve_config(None, object(), environ=env) == DPBalanceConfig(warmup_steps=4)
    # over TrainingArguments fields too, by the field's type; a field the environment does not name keeps its value
    monkeypatch.setenv("HF_DP_BALANCE_ENABLED", "1")
    monkeypatch.setenv("HF_DP_BALANCE_WARMUP_STEPS", "3")
    monkeypatch.setenv("HF_DP_BALANCE_MAX_TOKENS", "none")
    cfg = resolve_config(None, Args())
    assert cfg.enabled is True and cfg.warmup_steps == 3 and cfg.max_tokens is None
    assert cfg.min_gain == 0.05  # not overridden: the argument stays


# --------------------------------------------------------------------------- Trainer on 2 gloo ranks


def _record_segments(model, trainer_ref):
    """Forward pre-hook: (step being computed, first 3 tokens of every packed sample)."""
    seen = []

    def hook(module, args, kwargs):
        ids, pos = kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0]
        step = trainer_ref[0].state.global_step + 1
        seen.extend((step, tuple(ids[s:s + 3])) for s in starts)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _trainer(out_dir, max_steps, save_steps, cost_model=None, **dp_fields):
    from transformers import Trainer

    from hf_dp_balance.integrations.arguments import DPBalanceTrainingArguments
    from hf_dp_balance.testing.models import make_model

    args = DPBalanceTrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=4, max_steps=max_steps, logging_steps=1,
        save_strategy="steps", save_steps=save_steps, report_to=[], disable_tqdm=True, seed=0, data_seed=0,
        dataloader_drop_last=True, learning_rate=1e-3, dp_balance=True, dp_balance_warmup_steps=3, **dp_fields)
    model = make_model("text", seed=0)
    callback = DPBalanceCallback(cost_model=cost_model)
    ref = [None]
    seen = _record_segments(model, ref)
    trainer = Trainer(model=model, args=args, train_dataset=TextSamples(96), data_collator=pack_text,
                      callbacks=[callback])
    ref[0] = trainer
    return trainer, callback, seen


def _train_save_resume(rank, world, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # Without the FLOP prior (the no-prior path): nothing is planned before the fit. No refits (the early refit at
    # 2x the warm-up would replace the model the checkpoint at step 4 holds): this test is about saving and resuming.
    first, cb1, seen1 = _trainer(out_dir, max_steps=8, save_steps=4, dp_balance_prior=False, dp_balance_refit_every=0)
    first.train()
    saved_path = os.path.join(out_dir, "checkpoint-4", CHECKPOINT_FILE)
    dist.barrier()
    second, cb2, seen2 = _trainer(out_dir, max_steps=8, save_steps=100)
    second.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-4"))
    return {
        "log_history": first.state.log_history,
        "callback_position": first.callback_handler.callbacks.index(cb1),
        "fitted_step": cb1.fitted_step,
        "model_after_first": cb1.decoder_model.to_dict() if cb1.decoder_model else None,
        "saved": json.load(open(saved_path)) if rank == 0 else None,
        "restored_from": getattr(cb2, "restored_from", None),
        "model_after_resume": cb2.decoder_model.to_dict() if cb2.decoder_model else None,
        "resume_fitted_step": cb2.fitted_step,
        "seen1": seen1,
        "seen2": seen2,
    }


def test_trainer_with_callback_fits_logs_checkpoints_and_resumes(tmp_path):
    results = run_ranks(_train_save_resume, 2, str(tmp_path), timeout=240)
    r0, r1 = results
    # Warm-up of 3 steps, then one fit whose coefficients every rank shares.
    assert r0["fitted_step"] == r1["fitted_step"] == 3
    assert r0["model_after_first"] is not None and r0["model_after_first"] == r1["model_after_first"]
    assert r0["callback_position"] == 1  # right after DefaultFlowCallback, before the reporters

    # Metrics in Trainer's own log stream.
    train_logs = [h for h in r0["log_history"] if "loss" in h]
    assert [h["step"] for h in train_logs] == list(range(1, 9))
    for h in train_logs:
        assert h["dp_balance/fitted"] == (1.0 if h["step"] >= 3 else 0.0)
        assert h["dp_balance/compute_imbalance"] >= 0.0
        assert h["dp_balance/slowest_rank_compute_s"] > 0.0
    assert all("dp_balance/cost_quadratic" in h for h in train_logs if h["step"] >= 3)
    # The balanced loader plans only once the model is fitted: nothing moves in warm-up, then it balances.
    applied = {h["step"]: h.get("dp_balance/applied", 0.0) + 0 for h in train_logs}
    assert sum(applied[s] for s in (1, 2, 3)) == 0
    assert sum(applied[s] for s in range(4, 9)) >= 1, applied
    moved = sum(h.get("dp_balance/moved_samples", 0) for h in train_logs)
    # A plan never predicts a worse step under the model it planned with; while the fit is uncertain
    # (`planning_hedged`) the plan is the one whose worst case over the fit and the token count is lowest, which
    # may be worse under the fit alone than the step as it came (a hedge, docs/cost_model.md).
    assert moved >= 1 and all(h["dp_balance/imbalance_after"] <= h["dp_balance/imbalance_before"] + 1e-9
                              for h in train_logs
                              if "dp_balance/imbalance_after" in h and not h.get("dp_balance/planning_hedged"))

    # The checkpoint holds the model; the resumed run starts from it without a new warm-up.
    assert r0["saved"]["decoder"] == r0["model_after_first"]
    for r in results:
        assert r["restored_from"].endswith(os.path.join("checkpoint-4", CHECKPOINT_FILE))
        assert r["model_after_resume"] == r0["model_after_first"]
        assert r["resume_fitted_step"] == 4

    # Resume continues exactly where the first run stopped: no sample trained twice, none skipped.
    def by_step(seen_lists, steps):
        return sorted(s for seen in seen_lists for (step, s) in seen if step in steps)

    first_part = by_step([r0["seen1"], r1["seen1"]], range(1, 5))
    second_part_original = by_step([r0["seen1"], r1["seen1"]], range(5, 9))
    resumed = by_step([r0["seen2"], r1["seen2"]], range(5, 9))
    assert resumed == second_part_original
    assert not set(resumed) & set(first_part)
    assert len(set(first_part)) == len(first_part)


def _prior_warmup(rank, world, out_dir):
    torch.set_num_threads(1)
    trainer, cb, _ = _trainer(out_dir, max_steps=5, save_steps=100)
    trainer.train()
    return {"log_history": trainer.state.log_history, "fitted_step": cb.fitted_step,
            "prior": cb.fitter.prior.to_dict() if cb.fitter.prior else None}


def test_warm_up_steps_are_planned_with_the_flop_prior(tmp_path):
    from hf_dp_balance.testing.models import tiny_config

    r0, r1 = run_ranks(_prior_warmup, 2, str(tmp_path), timeout=240)
    assert r0["prior"] == CostModel.from_config(tiny_config("text")).to_dict() == r1["prior"]
    assert r0["fitted_step"] == r1["fitted_step"] == 3  # the prior does not postpone the fit
    logs = {h["step"]: h for h in r0["log_history"] if "loss" in h}
    # Planned from the first step: warm-up steps move samples, under the same hard cap.
    assert sum(logs[s].get("dp_balance/applied", 0.0) for s in (1, 2, 3)) >= 1, logs
    assert all(logs[s]["dp_balance/planning_with_prior"] == (1.0 if s < 3 else 0.0) for s in logs)
    assert all(h["dp_balance/imbalance_after"] <= h["dp_balance/imbalance_before"] + 1e-9
               for h in logs.values() if "dp_balance/imbalance_after" in h)


def _refits(rank, world, out_dir):
    torch.set_num_threads(1)
    trainer, cb, _ = _trainer(out_dir, max_steps=7, save_steps=100, dp_balance_refit_every=2)
    trainer.train()
    return {"fit_steps": [r["step"] for r in cb.fit_reports],
            "observations": [r["n_observations"] for r in cb.fit_reports],
            "model": cb.decoder_model.to_dict(), "fitted_step": cb.fitted_step,
            "logged_quadratic": [h.get("dp_balance/cost_quadratic") for h in trainer.state.log_history if "loss" in h]}


def test_the_cost_model_is_refitted_as_training_goes_on(tmp_path):
    r0, r1 = run_ranks(_refits, 2, str(tmp_path), timeout=240)
    # warm-up fit after step 3, then every 2 steps on all records so far (2 ranks per step, the first dropped)
    assert r0["fit_steps"] == r1["fit_steps"] == [3, 5, 7]
    assert r0["observations"][0] < r0["observations"][1] < r0["observations"][2]
    assert r0["model"] == r1["model"] and r0["fitted_step"] == 7  # every rank plans with the same coefficients
    assert r0["logged_quadratic"][-1] == pytest.approx(r0["model"]["quadratic"], rel=1e-3)


def _lookahead_save_resume(rank, world, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A given, attention-heavy cost model: windows are re-planned from step 1 and the long samples of
    # the long-tail lengths are outliers that gather in a few steps. No refit: both runs plan alike.
    kw = dict(cost_model=CostModel(quadratic=1e-6, linear=1e-5, per_sample=0.0, constant=0.0),
              dp_balance_lookahead_steps=3, dp_balance_refit_every=0)
    first, _, seen1 = _trainer(out_dir, max_steps=8, save_steps=4, **kw)
    first.train()
    dist.barrier()
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(out_dir) if d.startswith("checkpoint-"))
    second, _, seen2 = _trainer(out_dir, max_steps=8, save_steps=100, **kw)
    second.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{saved[0]}"))
    return {"saved": saved, "seen1": seen1, "seen2": seen2,
            "log_history": [h for h in first.state.log_history if "loss" in h]}


def test_a_checkpoint_inside_a_lookahead_window_resumes_training_every_sample_once(tmp_path):
    r0, r1 = run_ranks(_lookahead_save_resume, 2, str(tmp_path), timeout=240)
    # save_steps=4 with windows of 3 steps (1-3, 4-6, 7-9): step 4's checkpoint falls inside a window, where it
    # is written (no checkpoint is moved), and the resume re-plans that window from the state it carries
    assert r0["saved"] == r1["saved"] == [4, 8]

    def per_step(seen_lists):
        out = {}
        for seen in seen_lists:
            for step, s in seen:
                out.setdefault(step, []).append(s)
        return {k: sorted(v) for k, v in out.items()}

    first, resumed = per_step([r0["seen1"], r1["seen1"]]), per_step([r0["seen2"], r1["seen2"]])
    assert sorted(first) == list(range(1, 9)) and sorted(resumed) == [5, 6, 7, 8]
    # look-ahead did move samples between steps (8 per step without it)
    assert sorted({len(v) for v in first.values()}) != [8], {k: len(v) for k, v in first.items()}
    trained_before = [s for k in range(1, 5) for s in first[k]]
    assert len(set(trained_before)) == len(trained_before)
    again = [s for k in range(5, 9) for s in resumed[k]]
    assert not set(again) & set(trained_before)  # nothing of steps 1..4 trained twice
    assert sorted(again) == sorted(s for k in range(5, 9) for s in first[k])  # the rest, as the first run did


# --------------------------------------------------------------------------- hooks and clocks on a real model


def _vision_batch():
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import make_model

    model = make_model("qwen2_vl")
    batch = PackedCollator(model.config)(make_samples("qwen2_vl", ("text", "image", "text")))
    return model, batch


def _begin(cb, model, tmp_path):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    state, control = TrainerState(), TrainerControl()
    cb.on_train_begin(args, state, control, model=model)
    return args, state, control


def _one_step(cb, model, batch, state, control):
    """One optimizer step of a single rank; returns the record the callback made of it."""
    cb.on_step_begin(None, state, control)
    with torch.no_grad():
        model(**batch)
    cb.on_step_end(None, state, control)
    return cb.fitter.records[-1]


def test_hooks_are_not_doubled_when_a_run_raised_before_train_end(tmp_path):
    # A train() that raises never reaches on_train_end; the next on_train_begin installs the hooks again.
    model, batch = _vision_batch()
    cb = DPBalanceCallback(DPBalanceConfig(warmup_steps=100))
    args, state, control = _begin(cb, model, tmp_path)
    once = _one_step(cb, model, batch, state, control)
    assert once.features[2] == 3 and once.vision_features[2] == 1  # 3 samples, 1 image, each seen once
    _begin(cb, model, tmp_path)  # the second train(), without the first one's on_train_end
    again = _one_step(cb, model, batch, state, control)
    np.testing.assert_array_equal(again.features, once.features)
    np.testing.assert_array_equal(again.vision_features, once.vision_features)
    # After train end nothing is recorded any more: a forward leaves the recorder empty.
    cb.on_train_end(args, state, control)
    recorder = cb.recorder
    recorder.begin()
    with torch.no_grad():
        model(**batch)
    assert recorder.lengths == [] and recorder.patches == [] and recorder.vision_s == 0.0


@pytest.mark.parametrize("timing", ["wall", "thread_cpu"])
def test_the_vision_tower_is_timed_on_the_step_clock(tmp_path, timing):
    # On accelerators the step is timed by synchronised wall clock; the tower's kernels run asynchronously,
    # so the thread's CPU time inside the tower measures their launches only. Stand-in for a GPU tower
    # on CPU: the tower waits 0.2 s without burning CPU. The wall clock sees it, the thread clock does not.
    import time

    model, batch = _vision_batch()
    cb = DPBalanceCallback(DPBalanceConfig(timing=timing, warmup_steps=100))
    _, state, control = _begin(cb, model, tmp_path)
    assert cb.fitter.timing == timing and cb.fitter.fit_mode == ("step_max" if timing == "wall" else "per_rank")
    model.model.visual.register_forward_pre_hook(lambda module, args: time.sleep(0.2))  # runs after ours
    record = _one_step(cb, model, batch, state, control)
    if timing == "wall":
        assert record.vision_s >= 3 * 0.2  # forward + backward share of the wait the tower really took
    else:
        assert record.vision_s < 3 * 0.2 / 2


@pytest.mark.parametrize("sync, per_micro_batch", [("auto", False), ("micro_batch", True)])
def test_a_step_time_fit_reads_micro_batches_only_where_they_meet_across_ranks(tmp_path, sync, per_micro_batch):
    # The wall clock under DDP (auto sync without FSDP / ZeRO-3 resolves to `step`): ranks meet once a step, so
    # the step's sums are the model; each micro-batch is an observation of its own only where every one meets.
    model, _ = _vision_batch()
    cb = DPBalanceCallback(DPBalanceConfig(timing="wall", sync=sync, warmup_steps=100))
    _begin(cb, model, tmp_path)
    assert cb.fitter.fit_mode == "step_max" and cb.fitter.fits_micro_batches is per_micro_batch
    assert cb.recorder.times_micro_batches is per_micro_batch  # no device sync per micro-batch it would not read


def test_the_wall_clock_gives_each_micro_batch_its_own_tower_seconds():
    # Two micro-batches of one step; the tower waits 0.1 s in the second one only. Each micro-batch's tower
    # share is its own (the decoder's time of a micro-batch is its interval less that share).
    import time

    from hf_dp_balance.runtime.recorder import StepClock, StepRecorder

    model, batch = _vision_batch()
    recorder = StepRecorder(StepClock("wall"))
    recorder.install(model)
    calls = []
    model.model.visual.register_forward_pre_hook(lambda module, args: calls.append(1) or (
        time.sleep(0.1) if len(calls) == 2 else None))
    recorder.begin()
    with torch.no_grad():
        model(**batch)
        model(**batch)
    recorder.end()
    recorder.remove()
    lengths, seconds, vision = recorder.micro_batches()
    assert len(lengths) == len(seconds) == len(vision) == 2
    assert vision[1] >= 3 * 0.1 > vision[0] and abs(sum(vision) - recorder.vision_s) < 1e-9
