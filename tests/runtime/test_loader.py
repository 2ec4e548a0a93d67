"""BalancedLoader on real gloo processes: exactly-once, identical plans, uneven ends, faults, Trainer equivalence."""

import numpy as np
import pytest
import torch

from hf_dp_balance.testing.spawn import run_ranks
from hf_dp_balance.runtime.loader import slot_loads, step_imbalance, token_cap, validate_plan
from hf_dp_balance.config import DPBalanceConfig


# ------------------------------------------------------------------ pure helpers

def test_step_imbalance_follows_the_sync_mode():
    loads = np.array([[3.0, 1.0], [1.0, 3.0]])  # each rank 4 in total, but the slots differ
    assert step_imbalance(loads, "step") == pytest.approx(0.0)
    assert step_imbalance(loads, "micro_batch") == pytest.approx(6.0 / 4.0 - 1.0)
    assert step_imbalance(slot_loads(np.array([1.0, 2.0, 3.0]), np.array([0, 0, 1]), np.array([0, 1, 0]), 2, 2),
                          "step") == pytest.approx(0.0)


def test_token_cap_and_plan_validation():
    cfg = DPBalanceConfig(max_token_ratio=1.2)
    assert token_cap(np.array([10, 10, 10, 10]), 4, cfg) == 12
    assert token_cap(np.array([100, 1, 1, 2]), 4, cfg) == 100  # never below the longest sample
    assert token_cap(np.array([10]), 4, cfg.replace(max_tokens=64)) == 64
    assert token_cap(np.array([10, 10, 10, 10]), 4, cfg, largest_slot=20) == 20  # "no move" stays feasible
    with pytest.raises(ValueError, match="destinations for 3 samples"):
        validate_plan([0, 1], [0, 0], 3, 2, 1)
    with pytest.raises(ValueError, match="outside"):
        validate_plan([0, 2], [0, 0], 2, 2, 1)


# ------------------------------------------------------------------ text samples with ids, real planner

GA = 3


def _lengths(num_samples, seed):
    from hf_dp_balance.testing.mix import plan_samples

    return [p["text_tokens"] + sum(p["vision_tokens"]) for p in plan_samples(num_samples, seed=seed, mix="long_tail")]


def _rank_micro_batches(rank, world, steps, seed):
    """Micro-batches of 1-3 samples; the last rank runs out of data 7 micro-batches early."""
    rng = np.random.default_rng([seed, rank])
    n_micro = steps * GA - 2 - (7 if rank == world - 1 else 0)  # the last step is uneven (GA - 2 micro-batches)
    sizes = rng.integers(1, 4, n_micro)
    lengths = _lengths(int(sizes.sum()), seed * 100 + rank)
    out, k = [], 0
    for s in sizes:
        mb = []
        for _ in range(s):
            mb.append({"input_ids": torch.full((lengths[k],), rank, dtype=torch.int32), "sample_id": rank * 100000 + k})
            k += 1
        out.append(mb)
    return out


def _text_features(sample):
    return int(sample["input_ids"].numel()), 0


def _ids_collator(samples):
    return {"ids": [s["sample_id"] for s in samples], "tokens": sum(int(s["input_ids"].numel()) for s in samples)}


def _exactly_once(rank, world, steps):
    from torch.utils.data import DataLoader

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader, list_collate

    raw = _rank_micro_batches(rank, world, steps, seed=3)
    dl = DataLoader(raw, batch_size=None, collate_fn=list_collate)  # items already are lists of samples
    cfg = DPBalanceConfig(timeout_s=60, prefetch_steps=2, min_gain=0.0)
    loader = BalancedLoader(dl, cfg, gradient_accumulation_steps=GA, collator=_ids_collator,
                            features_fn=_text_features, id_key="sample_id")
    assert len(loader) == len(raw)
    model = CostModel(quadratic=1.0, linear=200.0)
    out = []
    for step, batches in enumerate(loader.iter_steps()):
        if step == 5 + rank:  # ranks switch the model on at different steps: plans must still agree
            loader.set_cost_model(model)
        (st,) = loader.pop_stats()
        assert st.local_ids == [b["ids"] for b in batches]
        out.append({"hash": st.plan_hash, "ids": [b["ids"] for b in batches], "tokens": [b["tokens"] for b in batches],
                    "applied": st.applied, "before": st.imbalance_before, "after": st.imbalance_after,
                    "moved": st.moved_samples, "bytes": st.moved_bytes, "sent": st.bytes_sent})
    pulled = [[s["sample_id"] for s in raw[i]] for i in range(len(raw))]
    lengths = [[int(s["input_ids"].numel()) for s in raw[i]] for i in range(len(raw))]

    # The same data with a look-ahead window of 3 steps (cost model on from the start).
    ahead = BalancedLoader(DataLoader(raw, batch_size=None, collate_fn=list_collate), cfg.replace(lookahead_steps=3),
                           gradient_accumulation_steps=GA, collator=_ids_collator, features_fn=_text_features,
                           id_key="sample_id", cost_model=model, exchange=loader.exchange)
    windowed = []
    for batches in ahead.iter_steps():
        (st,) = ahead.pop_stats()
        windowed.append({"hash": st.plan_hash, "ids": [b["ids"] for b in batches], "after": st.imbalance_after})
    return out, pulled, lengths, windowed


def _planned_steps(rank, world, steps, seed, step_s, calls):
    """(plan hash, planned at all) per step; `calls[rank][step]` = (quadratic, linear): set_cost_model
    after taking that step, as the callback does at on_step_end of a fit step."""
    import time

    from torch.utils.data import DataLoader

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader, list_collate

    torch.set_num_threads(1)
    raw = _rank_micro_batches(rank, world, steps + 2, seed=seed)[: steps * GA]
    loader = BalancedLoader(DataLoader(raw, batch_size=None, collate_fn=list_collate),
                            DPBalanceConfig(timeout_s=60, prefetch_steps=2, min_gain=0.0),
                            gradient_accumulation_steps=GA, collator=_ids_collator, features_fn=_text_features)
    out = []
    for step, _ in enumerate(loader.iter_steps()):
        time.sleep(step_s)  # "training": time for the thread to fill its queue if it runs ahead
        (st,) = loader.pop_stats()
        out.append((st.plan_hash, not st.reason.startswith("balancing off")))
        if step in calls[rank]:
            quadratic, linear = calls[rank][step]
            loader.set_cost_model(CostModel(quadratic=quadratic, linear=linear))
    return out


def test_planning_starts_two_steps_after_the_model_whatever_the_prefetch():
    # Before the model nothing is planned, so the thread stays one step ahead: the step prepared during
    # the fit step is the only one without the model (with prefetch_steps=2 ahead it would be three).
    calls = {r: {3: (1.0, 200.0)} for r in range(2)}
    for out in run_ranks(_planned_steps, 2, 12, 5, 0.05, calls, timeout=120):
        planned = [b for _, b in out]
        assert planned.index(True) == 3 + 2 and all(planned[5:]), planned


def test_a_step_costed_with_different_models_on_different_ranks_is_not_balanced():
    first, refit = (1.0, 200.0), (2.0, 100.0)
    calls = {0: {2: first, 3: refit}, 1: {2: first, 12: refit}}  # the refit reaches rank 1 nine steps late
    r0, r1 = run_ranks(_planned_steps, 2, 22, 7, 0.03, calls, timeout=120)
    assert [h for h, _ in r0] == [h for h, _ in r1]  # same plans on both ranks, every step
    balanced = [b for _, b in r0]
    assert not any(balanced[7:13]), balanced  # rank 0 costs with the refit, rank 1 with the first model
    assert all(balanced[16:]), balanced  # both on the refit: balanced again


def test_every_sample_trained_exactly_once_and_plans_identical_4_ranks():
    world, steps = 4, 110
    results = run_ranks(_exactly_once, world, steps, timeout=200)
    per_rank = [r[0] for r in results]
    step_lengths = [[n for r in results for mb in r[2][s * GA:(s + 1) * GA] for n in mb] for s in range(steps)]
    slot_max = [[max([sum(mb) for mb in r[2][s * GA:(s + 1) * GA]] or [0]) for s in range(steps)] for r in results]
    windowed = [r[3] for r in results]
    results = [(a, b, step_lengths, slot_max) for a, b, _, _ in results]
    assert all(len(p) == steps for p in per_rank)  # same number of steps on every rank, incl. the one that ran dry
    applied = 0
    for s in range(steps):
        assert len({p[s]["hash"] for p in per_rank}) == 1, f"step {s}: plans differ across ranks"
        num_micro = {len(p[s]["ids"]) for p in per_rank}
        assert len(num_micro) == 1  # every rank yields the same number of micro-batches
        expected = {i for r in range(world) for mb in results[r][1][s * GA:(s + 1) * GA] for i in mb}
        got = [i for p in per_rank for mb in p[s]["ids"] for i in mb]
        assert len(got) == len(set(got)) and set(got) == expected, f"step {s}: samples lost or duplicated"
        st = per_rank[0][s]
        applied += st["applied"]
        if st["applied"]:
            assert st["after"] < st["before"] and st["moved"] > 0
            step_tokens = np.array([t for p in per_rank for t in p[s]["tokens"]])
            cap = token_cap(np.array(results[0][2][s]), world * len(per_rank[0][s]["ids"]), DPBalanceConfig(),
                            max(slot_max[r][s] for r in range(world)))
            assert step_tokens.max() <= cap  # the hard token cap per slot
            assert sum(p[s]["sent"] for p in per_rank) == st["bytes"]
        else:
            assert st["moved"] == 0 and st["bytes"] == 0
    assert len(per_rank[0][-1]["ids"]) == GA - 2  # the uneven last step
    assert not any(per_rank[0][s]["applied"] for s in range(5))  # warm-up: no cost model on every rank yet
    assert applied >= steps // 2

    # look-ahead: every sample exactly once within its window of 3 steps; some samples change step
    assert all(len(w) == steps for w in windowed)
    changed = 0
    for w0 in range(0, steps, 3):
        span = range(w0, min(w0 + 3, steps))
        assert all(len({w[s]["hash"] for w in windowed}) == 1 for s in span)
        got = [i for w in windowed for s in span for mb in w[s]["ids"] for i in mb]
        expected = {i for r in range(world) for s in span for mb in results[r][1][s * GA:(s + 1) * GA] for i in mb}
        assert len(got) == len(set(got)) and set(got) == expected, f"window at step {w0}: samples lost or duplicated"
        for s in span:
            pulled_here = {i for r in range(world) for mb in results[r][1][s * GA:(s + 1) * GA] for i in mb}
            changed += len({i for w in windowed for mb in w[s]["ids"] for i in mb} - pulled_here)
    print("look-ahead: samples trained in another step than pulled:", changed, "mean imbalance after:",
          np.mean([w["after"] for w in windowed[0][5:]]))
    assert changed > 0
    print("applied", applied, "mean imbalance before/after",
          np.mean([p["before"] for p in per_rank[0][5:]]), np.mean([p["after"] for p in per_rank[0][5:]]))


# ------------------------------------------------------------------ faults through the loader

def _faulty_rank(rank, world):
    from hf_dp_balance.runtime.loader import BalancedLoader

    def micro_batches(bad_at):
        for i in range(12):
            mb = [{"input_ids": torch.ones(5 + i + k, dtype=torch.int32), "sample_id": 1000 * rank + 10 * i + k}
                  for k in range(2)]
            if rank == 1 and i == bad_at:
                mb[1]["meta"] = {"not": "sendable"}
            yield mb

    out = {}
    cfg = DPBalanceConfig(timeout_s=20, prefetch_steps=1)
    # Stopping early on every rank (max_steps reached mid-epoch) leaves no collective in flight:
    # the loaders below reuse the same side group.
    first = BalancedLoader(micro_batches(-1), cfg, gradient_accumulation_steps=2, collator=_ids_collator,
                           features_fn=_text_features, id_key="sample_id")
    steps = first.iter_steps()
    out["early"] = [next(steps)[0]["ids"] for _ in range(2)]
    steps.close()
    loader = BalancedLoader(micro_batches(4), cfg, gradient_accumulation_steps=2, collator=_ids_collator,
                            features_fn=_text_features, id_key="sample_id", exchange=first.exchange)
    try:
        for _ in loader.iter_steps():
            pass
    except RuntimeError as exc:
        out["bad_sample"] = str(exc)

    def failing_collator(samples):  # rank 0 fails to pack its second step
        if rank == 0 and any(s["sample_id"] % 1000 >= 20 for s in samples):
            raise ValueError("packing exploded")
        return _ids_collator(samples)

    loader = BalancedLoader(micro_batches(-1), cfg, gradient_accumulation_steps=2, collator=failing_collator,
                            features_fn=_text_features, id_key="sample_id", exchange=loader.exchange)
    try:
        for _ in loader.iter_steps():
            pass
    except RuntimeError as exc:
        out["collate"] = str(exc)
    return out


def test_bad_sample_and_thread_failures_reach_every_rank_with_clear_errors():
    results = run_ranks(_faulty_rank, 2, timeout=120)
    assert [r["early"] for r in results] == [[[0, 1], [20, 21]], [[1000, 1001], [1020, 1021]]]
    # the bad sample: step 2 (micro-batch 4 with GA 2), rank 1, micro-batch 0, sample 1, its id and key
    own = results[1]["bad_sample"]
    assert "step 2, rank 1, micro-batch 0, sample 1 (sample_id=1041)" in own and "'meta'" in own
    assert "thread traceback" in own  # the thread's traceback reaches the main thread
    peer = results[0]["bad_sample"]
    assert "rank(s) [1]" in peer and "sample_id=1041" in peer and "step 2" in peer
    # a failure after the exchange (packing) on rank 0 reaches rank 0 with its cause, rank 1 by the next gather
    assert "packing exploded" in results[0]["collate"] and "micro-batch" in results[0]["collate"]
    assert "rank(s) [0]" in results[1]["collate"] and "packing exploded" in results[1]["collate"]


# ------------------------------------------------------------------ Trainer: gradient equivalence

def _train_qwen2_vl(rank, world, outdir):
    import transformers
    from transformers import Qwen2VLForConditionalGeneration, Trainer, TrainerCallback, TrainingArguments

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.integrations.install import install_balanced_loader, uninstall_balanced_loader
    from hf_dp_balance.core.packing import PackedCollator

    transformers.logging.set_verbosity_error()
    data = [to_sample(r) for r in build_synthetic_dataset("qwen2_vl", 36, seed=1, scale=1 / 32)]  # 3 steps

    uninstalled = []

    class Install(TrainerCallback):
        loader = None
        trainer = None  # set: trainer mode; None: dataloader mode (what a callback without the trainer does)

        def on_train_end(self, args, state, control, train_dataloader=None, **kwargs):
            uninstall_balanced_loader(self.trainer if self.trainer is not None else train_dataloader)
            uninstalled.append(type(train_dataloader.base_dataloader).__name__ == "DataLoader"
                               and (self.trainer is None or "get_batch_samples" not in vars(self.trainer)))

        def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
            cfg = DPBalanceConfig(timeout_s=60, min_gain=0.0)
            cost = CostModel(quadratic=1.0, linear=20.0)
            if self.trainer is not None:
                self.loader = install_balanced_loader(self.trainer, cfg, cost_model=cost)
            else:
                self.loader = install_balanced_loader(train_dataloader, cfg, model_config=model.config,
                                                      gradient_accumulation_steps=args.gradient_accumulation_steps,
                                                      cost_model=cost)

    def train(balanced, trainer_mode=False, resume=None):
        if resume is None:
            model = make_model("qwen2_vl", seed=0)
        else:
            # transformers 5.24 writes Qwen2-VL checkpoints under the hub's legacy key names and Trainer's resume
            # does not map them back (it would keep fresh weights; tests/integrations/test_checkpoint_resume.py):
            # from_pretrained maps them; Trainer restores optimizer, scheduler, RNG and data position.
            model = Qwen2VLForConditionalGeneration.from_pretrained(resume, attn_implementation="sdpa")
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        save = dict(save_strategy="steps", save_steps=2) if trainer_mode else dict(save_strategy="no")
        args = TrainingArguments(output_dir=f"{outdir}/{int(balanced)}{int(trainer_mode)}", use_cpu=True,
                                 per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=3,
                                 optim="sgd", learning_rate=1.0, max_grad_norm=0.0, report_to=[], logging_strategy="no",
                                 remove_unused_columns=False, train_sampling_strategy="sequential",
                                 disable_tqdm=True, seed=0, **save)
        cb = Install()
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PackedCollator(model.config),
                          callbacks=[cb] if balanced else [])
        cb.trainer = trainer if trainer_mode else None
        trainer.train(resume_from_checkpoint=resume)
        delta = {n: p.detach() - start[n] for n, p in model.named_parameters()}
        return {n: p.detach().clone() for n, p in model.named_parameters()}, delta, cb.loader

    ref, ref_delta, _ = train(False)
    out = []
    for trainer_mode in (False, True):
        bal, bal_delta, loader = train(True, trainer_mode)
        stats = loader.pop_stats()
        param_rel = max(float((bal[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)) for n in ref)
        num = sum(float((bal_delta[n] - ref_delta[n]).norm() ** 2) for n in ref) ** 0.5
        den = sum(float(ref_delta[n].norm() ** 2) for n in ref) ** 0.5
        out.append((param_rel, num / den, den, [(s.moved_samples, s.plan_hash) for s in stats]))
    # trainer mode resumes mid-epoch (skip_first_batches): same parameters as the uninterrupted run
    resumed, _, loader = train(True, True, resume=f"{outdir}/11/checkpoint-2")
    resume_rel = max(float((resumed[n] - bal[n]).norm() / bal[n].norm().clamp_min(1e-12)) for n in bal)
    assert uninstalled == [True, True, True]  # both modes undo their changes at the end of training
    return out, resume_rel, [(s.moved_samples, s.plan_hash) for s in loader.pop_stats()]


def test_trainer_gradients_equal_with_and_without_balancing(tmp_path):
    results = run_ranks(_train_qwen2_vl, 2, str(tmp_path), timeout=220)
    for mode in (0, 1):  # dataloader mode, trainer mode
        for rank_result, _, _ in results:
            param_rel, update_rel, update_norm, stats = rank_result[mode]
            assert update_norm > 0  # the model did train
            assert param_rel < 1e-5  # the spec's bound on the parameters
            assert update_rel < 1e-5  # and on the update itself, a much stricter test
            assert len(stats) == 3
        assert results[0][0][mode][3] == results[1][0][mode][3]  # identical plans on both ranks
        assert sum(moved for moved, _ in results[0][0][mode][3]) > 0  # balancing really moved samples
    for _, resume_rel, resumed_stats in results:
        assert resume_rel < 1e-6
        assert resumed_stats == results[0][0][1][3][2:]  # the resumed step is the uninterrupted run's third step


# ------------------------------------------------------------------ planning costs: decoder + vision encoder


def _prepared_costs(rank, world):
    """Real Qwen2-VL samples through the loader's default features: the cost column it gathers."""
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import tiny_config
    from hf_dp_balance.runtime.loader import F_COST, F_VISION, BalancedLoader
    from hf_dp_balance.core.costing import item_costs, sample_grids
    from hf_dp_balance.core.packing import sample_features

    torch.set_num_threads(1)
    cfg = tiny_config("qwen2_vl")
    samples = make_samples("qwen2_vl", ("text", "image", "multi_image", "video"), seed=rank)
    loader = BalancedLoader([samples], DPBalanceConfig(), model_config=cfg)
    decoder = CostModel(quadratic=1e-6, linear=1e-3, per_sample=0.01)
    vision = CostModel(quadratic=2e-6, linear=5e-3, per_sample=0.1)
    feats = [sample_features(s, cfg) for s in samples]
    out = {}
    for name, model in (("decoder_only", None), ("with_vision", vision)):
        loader.set_cost_model(decoder, vision=model)
        rows = loader.prepare_step(0, iter([samples]).__next__).rows
        out[name] = rows[:, F_COST].tolist()
    out["vision_items"] = rows[:, F_VISION].tolist()
    out["decoder"] = [float(decoder.sample_costs(np.array([f.tokens]))[0]) for f in feats]
    # per frame (the encoder attends within a frame: `vision_seqlens`), as the vision balancer prices an item
    out["vision"] = [float(vision.sample_costs(np.array(f.vision_seqlens)).sum()) if f.vision_items else 0.0
                     for f in feats]
    out["balancer"] = [float(item_costs(sample_grids(s, f.vision_items), vision).sum()) for s, f in zip(samples, feats)]
    out["frames"] = [len(f.vision_seqlens) for f in feats]
    out["items"] = [len(f.vision_items) for f in feats]
    return out


def test_loader_plans_with_the_vision_cost_when_the_tower_is_not_balanced():
    for out in run_ranks(_prepared_costs, 2, timeout=120):
        np.testing.assert_allclose(out["decoder_only"], out["decoder"])
        np.testing.assert_allclose(out["with_vision"], np.add(out["decoder"], out["vision"]))
        np.testing.assert_allclose(out["vision"], out["balancer"])  # the loader prices a video as the balancer does
        assert out["frames"][3] > out["items"][3]  # the video has several frames: the per-frame unit matters
        assert out["items"] == [0, 1, 3, 1] and out["vision_items"] == out["items"]
        assert out["with_vision"][2] > out["decoder_only"][2] + 0.3  # three images: three per-item costs at least
