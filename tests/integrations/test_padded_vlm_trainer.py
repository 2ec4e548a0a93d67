"""A user's right-padding collator on a tiny Qwen2-VL (flat `pixel_values`, one `image_grid_thw` row per image,
mrope positions computed by the model), balanced by DPBalanceCallback: same losses and update as unbalanced."""

import torch

from hf_dp_balance.testing.spawn import run_ranks

MULTIPLE = 16
DUMMY = "dummy"


class PaddingVLMCollator:
    """What a VLM user pads with: one sample per row, padded on `side` to a multiple of 16, attention_mask,
    the batch's images' patch rows concatenated in row order, their grids likewise; no position_ids."""

    pad_to_multiple_of = MULTIPLE

    def __init__(self, pad_token_id, side):
        self.pad_token_id, self.side = pad_token_id, side
        self.batches = []  # what the collator gave (the layout the balanced batches must keep)

    def __call__(self, samples):
        longest = max(int(s["input_ids"].numel()) for s in samples)
        width = -(-longest // MULTIPLE) * MULTIPLE
        fills = {"input_ids": self.pad_token_id, "labels": -100, "mm_token_type_ids": 0}
        def pad(values, fill):
            pads = values.new_full((width - values.numel(),), fill)
            return torch.cat([values, pads] if self.side == "right" else [pads, values])

        out = {k: torch.stack([pad(s[k], fill) for s in samples]) for k, fill in fills.items()}
        out["attention_mask"] = torch.stack([pad(torch.ones_like(s["input_ids"]), 0) for s in samples])
        with_images = [s for s in samples if "pixel_values" in s]
        if with_images:
            out["pixel_values"] = torch.cat([s["pixel_values"].double() for s in with_images])
            out["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in with_images])
        self.batches.append(out)
        return out


def _samples():
    """24 samples (2 steps of 2 ranks x 3 x GA 2) with 0, 1 or 3 images; under the sequential sampler rank 1's
    micro-batches of step 1 (samples 3-5, 9-11) are text only, so unbalanced it has no image at that step."""
    from hf_dp_balance.testing.data import make_samples

    kinds = ["image", "multi_image", "text", "text", "text", "text",
             "text", "image", "image", "text", "text", "text",
             "multi_image", "text", "image", "image", "text", "multi_image",
             "text", "image", "text", "multi_image", "image", "text"]
    out = []
    for i, kind in enumerate(kinds):
        sample = make_samples("qwen2_vl", (kind,), seed=i, text_tokens=8 + (37 * i) % 90, vision_tokens=12 + (5 * i) % 24)[0]
        out.append({k: v for k, v in sample.items() if k in ("input_ids", "labels", "mm_token_type_ids",
                                                             "pixel_values", "image_grid_thw")})
    return out


def _convert(obj, to):
    """Tensors as numpy arrays across the process boundary (a returned tensor travels as shared memory)."""
    if isinstance(obj, dict):
        return {k: _convert(v, to) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_convert(v, to) for v in obj]
    if to == "numpy" and isinstance(obj, torch.Tensor):
        return obj.numpy()
    if to == "torch" and type(obj).__module__ == "numpy" and hasattr(obj, "shape"):
        return torch.from_numpy(obj)
    return obj


def _train(rank, world, outdir, side):
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.testing.callbacks import StatsKeepingCallback
    from hf_dp_balance.testing.models import make_model

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    data = _samples()
    tagged = [dict(s) for s in data]  # the originals, to identify the trained rows and their images

    def train(balanced):
        model = make_model("qwen2_vl", seed=0, dtype=torch.float64)
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        seen = []  # per forward: (input_ids, attention_mask, pixel rows, grids)
        model.register_forward_pre_hook(lambda m, a, kw: seen.append(
            {k: kw[k].detach().clone() for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw")
             if kw.get(k) is not None} | {"keys": tuple(sorted(k for k, v in kw.items() if v is not None))}),
            with_kwargs=True)
        pad = getattr(model.config, "pad_token_id", None)
        pad = pad if pad is not None else getattr(model.config.text_config, "pad_token_id", None) or 0
        collator = PaddingVLMCollator(pad, side)
        args = TrainingArguments(output_dir=f"{outdir}/{side}{int(balanced)}", use_cpu=True, per_device_train_batch_size=3,
                                 gradient_accumulation_steps=2, max_steps=2, optim="sgd", learning_rate=1.0,
                                 max_grad_norm=0.0, report_to=[], logging_steps=1, save_strategy="no",
                                 remove_unused_columns=False, train_sampling_strategy="sequential",
                                 disable_tqdm=True, seed=0)
        cb = StatsKeepingCallback(DPBalanceConfig(timeout_s=60, min_gain=0.0, warmup_steps=0, vision=False),
                                  cost_model=CostModel(quadratic=1.0, linear=20.0))
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                          callbacks=[cb] if balanced else [])
        trainer.train()
        if balanced:
            cb.kept.pop_stats()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        update = {n: p.detach() - start[n] for n, p in model.named_parameters()}
        return update, cb, losses, seen, pad, model.config.image_token_id

    ref, _, ref_losses, ref_seen, _, _ = train(False)
    bal, cb, losses, seen, pad, model_config_image_token = train(True)
    num = sum(float((bal[n] - ref[n]).norm() ** 2) for n in ref) ** 0.5
    den = sum(float(ref[n].norm() ** 2) for n in ref) ** 0.5
    # which samples each forward trained: a row's real tokens identify the sample (all distinct)
    index = {tuple(s["input_ids"].tolist()): i for i, s in enumerate(tagged)}
    index[(int(model_config_image_token),)] = DUMMY  # the library's dummy image row (labels -100)
    trained = []
    for batch in seen:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        rows = [tuple(ids[r][mask[r].bool()].tolist()) for r in range(ids.shape[0])]
        trained.append([index.get(row, -1) for row in rows])
    return _convert({"update_rel": num / den, "update_norm": den, "loss_gap": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "n_losses": (len(losses), len(ref_losses)), "stats": [(s.moved_samples, s.plan_hash) for s in cb.stats],
            "kind": cb.packed_input.kind, "trained": trained, "ref_trained": [
                [index.get(tuple(b["input_ids"][r][b["attention_mask"][r].bool()].tolist()), -1)
                 for r in range(b["input_ids"].shape[0])] for b in ref_seen],
            "seen": seen, "ref_images": [int(b.get("image_grid_thw", torch.zeros(0, 3)).shape[0]) for b in ref_seen],
            "pad": pad, "grids": {i: s.get("image_grid_thw") for i, s in enumerate(tagged)},
            "pixels": {i: s.get("pixel_values") for i, s in enumerate(tagged)}}, "numpy")


def _train_sides(rank, world, outdir):
    return {side: _train(rank, world, outdir, side) for side in ("right", "left")}


def test_a_padding_vlm_collator_balanced_trains_as_unbalanced_with_its_images_and_layout(tmp_path):
    """Right and left padding (the samples' first label is -100, as left padding needs)."""
    per_rank = run_ranks(_train_sides, 2, str(tmp_path), timeout=300)
    for side in ("right", "left"):
        _check([_convert(r[side], "torch") for r in per_rank], side)


def _check(results, side):
    from hf_dp_balance.core.unpacking import INPUT_PADDED

    for rank, res in enumerate(results):
        assert res["kind"] == INPUT_PADDED
        # left padding: Qwen2-VL itself (no balancing) gives the same 6 samples' gradient 1.2e-8 apart (relative)
        # as one batch of 6 rows vs 6 batches of 1 row (right padding: 3e-16), so a regrouping costs as much
        tolerance = 1e-9 if side == "right" else 1e-6
        assert res["update_norm"] > 0 and res["update_rel"] < tolerance, (side, rank, res["update_rel"])
        # Trainer logs the loss through a float32 round: 1e-5 is a few ulps of a loss near 6
        assert res["n_losses"] == (2, 2) and res["loss_gap"] < 1e-5, (rank, res["loss_gap"])
        assert len(res["stats"]) == 2
        for batch in res["seen"]:  # the user's layout: padded rows on the user's side, width a multiple of 16
            ids, mask = batch["input_ids"], batch["attention_mask"]
            assert "position_ids" not in batch["keys"], batch["keys"]
            assert ids.shape[1] % MULTIPLE == 0 and ids.shape == mask.shape
            lengths = mask.sum(1)
            at = torch.arange(ids.shape[1])[None]
            want = at < lengths[:, None] if side == "right" else at >= ids.shape[1] - lengths[:, None]
            assert torch.equal(mask, want.to(mask.dtype)), (side, mask)
            assert bool((ids[~mask.bool()] == res["pad"]).all())
        for batch, rows in zip(res["seen"], res["trained"]):  # each row's patches and grids travel with it
            assert -1 not in rows, rows
            samples = [i for i in rows if i != DUMMY]
            grids = [res["grids"][i] for i in samples if res["grids"][i] is not None]
            pixels = [res["pixels"][i] for i in samples if res["pixels"][i] is not None]
            if grids:
                assert DUMMY not in rows
                assert torch.equal(batch["image_grid_thw"], torch.cat(grids))
                assert torch.equal(batch["pixel_values"], torch.cat(pixels).double())
            else:  # no image among its samples: the dummy image's row, so the vision tower runs on this rank too
                assert rows.count(DUMMY) == 1 and batch["image_grid_thw"].shape == (1, 3), rows
    assert results[0]["stats"] == results[1]["stats"]  # one plan on every rank
    assert sum(moved for moved, _ in results[0]["stats"]) > 0
    # every sample trained exactly once per step, on some rank; unbalanced, rank 1 has no image at step 1
    for res_list in (("trained",), ("ref_trained",)):
        key = res_list[0]
        per_step = [sorted(i for res in results for b in res[key][2 * s:2 * s + 2] for i in b if i != DUMMY)
                    for s in range(2)]
        assert per_step == [list(range(12)), list(range(12, 24))], (key, per_step)
    assert results[1]["ref_images"][:2] == [0, 0], results[1]["ref_images"]
    # balanced, some micro-batch's samples have no image (it gets the dummy row) and the unbalanced one's has none
    assert any(DUMMY in rows for res in results for rows in res["trained"])
    assert all("pixel_values" in b["keys"] for res in results for b in res["seen"])
    print(side, "update_rel", [r["update_rel"] for r in results], "loss_gap", [r["loss_gap"] for r in results],
          "moved", [m for m, _ in results[0]["stats"]], "trained", [r["trained"] for r in results])
    assert results[0]["trained"] != results[0]["ref_trained"] or results[1]["trained"] != results[1]["ref_trained"]


def _train_without_unused_parameters(rank, world, outdir):
    """ddp_find_unused_parameters=False (Trainer's choice under gradient checkpointing), every micro-batch with
    one image unbalanced: a balanced micro-batch left with text only must still run the vision tower."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import make_model

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    keep = ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw")
    data = [{k: v for k, v in make_samples("qwen2_vl", (kind,), seed=i, text_tokens=(8, 120, 100, 8, 8, 8)[i % 6],
                                           vision_tokens=4)[0].items() if k in keep}
            for i, kind in enumerate(["image", "text", "text"] * 4)]
    model = make_model("qwen2_vl", seed=0, dtype=torch.float64)
    images = []
    model.register_forward_pre_hook(lambda m, a, kw: images.append(kw.get("pixel_values") is not None), with_kwargs=True)
    args = TrainingArguments(output_dir=outdir, use_cpu=True, per_device_train_batch_size=3, max_steps=2, optim="sgd",
                             report_to=[], save_strategy="no", remove_unused_columns=False, disable_tqdm=True,
                             train_sampling_strategy="sequential", ddp_find_unused_parameters=False)
    cb = DPBalanceCallback(DPBalanceConfig(timeout_s=30, min_gain=0.0, warmup_steps=0),
                           cost_model=CostModel(quadratic=1.0, linear=20.0))
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=PaddingVLMCollator(0, "right"),
                      callbacks=[cb])
    trainer.train()
    return trainer.state.global_step, images


def test_a_balanced_padded_vlm_batch_without_images_runs_the_tower_under_ddp_without_unused_parameter_search(tmp_path):
    """Without the dummy image row, both ranks waited past the timeout (rank 0's tower had no gradients)."""
    for steps, images in run_ranks(_train_without_unused_parameters, 2, str(tmp_path), timeout=120):
        assert steps == 2 and images == [True, True], (steps, images)
