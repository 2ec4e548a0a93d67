"""split_packed / repack on the packed rows users already have, for every family (configs only, no model run)."""

import pytest
import torch

from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.core.packing import PackedCollator
from hf_dp_balance.core.boundaries import segment_boundaries
from hf_dp_balance.core.padded_rows import padded_output
from hf_dp_balance.core.unpacking import (INPUT_CU_SEQ_LENS, INPUT_PADDED, INPUT_POSITIONS, INPUT_SAMPLES, detect_input,
                                          fill_rows, layout_of, repack, split_packed)
from hf_dp_balance.testing.data import make_samples
from hf_dp_balance.testing.models import FAMILIES, tiny_config
from hf_dp_balance.testing.packed_users import pad_to, with_cu_seq_lens

KINDS = ("text", "image", "multi_image", "video", "text", "image")
PAD = 0


@pytest.fixture(scope="module")
def setup():
    cache = {}

    def get(family):
        if family not in cache:
            config = tiny_config(family)
            getattr(config, "text_config", config).use_cache = False
            cache[family] = (config, PackedCollator(config), make_samples(family, KINDS, seed=3))
        return cache[family]

    return get


def _assert_batches_equal(got, want):
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), key
        else:
            assert type(got[key]) is type(value) and got[key] == value, key


def _assert_samples_equal(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), i
        for key in w:
            assert torch.equal(g[key], w[key]), (i, key)


def _two_rows(collator, samples):
    """Two packed rows of equal width (the second padded), pixels in row-major order."""
    a, b = collator(samples[:3]), collator(samples[3:])
    width = max(a["input_ids"].shape[1], b["input_ids"].shape[1]) + 5
    a, b = pad_to(a, width), pad_to(b, width)
    qwen = a["position_ids"].ndim == 3
    return {k: torch.cat([a[k], b[k]], 1 if qwen and k == "position_ids" else 0) for k in a if k in b} | \
        {k: a[k] for k in a if k not in b} | {k: b[k] for k in b if k not in a}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("flash", [False, True])
def test_one_row_split_then_repack_is_exact(family, flash, setup):
    config, collator, samples = setup(family)
    batch = collator(samples)
    if flash:
        batch = with_cu_seq_lens(batch)
    assert detect_input(batch) == (INPUT_CU_SEQ_LENS if flash else INPUT_POSITIONS)
    back = split_packed(batch, config)
    _assert_samples_equal(back, samples)
    _assert_batches_equal(repack(back, layout_of(batch), collator, PAD), batch)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("flash", [False, True])
def test_several_rows_split_then_repack_is_exact(family, flash, setup):
    config, collator, samples = setup(family)
    batch = _two_rows(collator, samples)
    if flash:
        batch = with_cu_seq_lens(batch)
    back = split_packed(batch, config)
    assert len(back) == len(samples) + 2  # the pad segments are samples that train nothing
    _assert_samples_equal([back[i] for i in (0, 1, 2, 4, 5, 6)], samples)
    assert all(bool((back[i]["labels"] == IGNORE_INDEX).all()) for i in (3, 7))
    layout = layout_of(batch)
    assert (layout.rows, layout.width) == tuple(batch["input_ids"].shape)
    _assert_batches_equal(repack(back, layout, collator, PAD), batch)


def test_rows_from_data_collator_with_flattening_round_trip(setup):
    from transformers import DataCollatorWithFlattening

    config, collator, samples = setup("text")
    for kwargs in ({}, {"return_flash_attn_kwargs": True}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}):
        batch = DataCollatorWithFlattening(**kwargs)(samples)
        back = split_packed(batch, config)
        _assert_samples_equal(back, samples)  # the user's first labels are -100 already
        _assert_batches_equal(repack(back, layout_of(batch), collator, PAD), batch)
    # a rank's new mix in the user's layout: cu_seq_lens follow the new samples
    flash = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    mixed = [samples[4], samples[0]]
    _assert_batches_equal(repack(mixed, layout_of(flash(samples)), collator, PAD), flash(mixed))


def test_fill_rows_is_next_fit_in_order():
    assert fill_rows([3, 3, 2, 5, 1], 6) == [[0, 1], [2], [3, 4]]
    assert fill_rows([7, 1], 6) == [[0], [1]]  # a sample longer than the capacity gets a row of its own
    assert fill_rows([], 6) == [[]]


def test_detection_names_the_layout_and_refuses_rows_without_boundaries():
    assert detect_input([{"input_ids": torch.ones(3)}]) == INPUT_SAMPLES
    padded = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    assert detect_input(padded) == INPUT_PADDED
    with pytest.raises(ValueError, match=r"keys \['input_ids', 'labels'\].*\[2, 4\].*input='samples'.*per-sample"):
        detect_input({k: padded[k] for k in ("input_ids", "labels")})
    with pytest.raises(ValueError, match="a str.*input='samples'"):
        detect_input("rows")
    # positions that restart inside a padded row: not one sample per row
    restart = dict(padded, position_ids=torch.tensor([[0, 1, 0, 1], [0, 1, 0, 0]]))
    with pytest.raises(ValueError, match="row 0: key 'position_ids'"):
        split_packed(restart, tiny_config("text"))
    holes = dict(padded, attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]]))
    with pytest.raises(ValueError, match="row 0: key 'attention_mask': its ones are not one run"):
        split_packed(holes, tiny_config("text"))


def _short_text_samples(setup, lengths=(5, 9, 3, 7)):
    config, collator, _ = setup("text")
    samples = make_samples("text", ("text",) * len(lengths), seed=1)
    return config, collator, [{k: v[:n] for k, v in s.items()} for s, n in zip(samples, lengths)]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("make", ["language_modeling", "seq2seq"])
def test_transformers_padded_rows_split_into_samples_and_come_back_padded(side, make, setup):
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    from hf_dp_balance.testing.models import build_tokenizer

    config, collator, samples = _short_text_samples(setup)
    tok = build_tokenizer("text")
    tok.padding_side = side
    if make == "language_modeling":
        user = DataCollatorForLanguageModeling(tok, mlm=False, pad_to_multiple_of=8)
        rows = [{"input_ids": s["input_ids"].tolist()} for s in samples]
    else:
        user = DataCollatorForSeq2Seq(tok, pad_to_multiple_of=8)
        rows = [{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in samples]
    if make == "language_modeling" and side == "left":  # labels = input_ids: the first real token is a target
        with pytest.raises(ValueError, match="row 0: key 'labels': left padding.*learned from a pad token"):
            split_packed(user(rows), config)
        return
    batch = user(rows)
    assert detect_input(batch) == INPUT_PADDED
    layout = layout_of(batch, multiple=8)
    assert (layout.side, layout.multiple, layout.output) == (side, 8, "padded")
    back = split_packed(batch, config)
    assert [s["input_ids"].tolist() for s in back] == [s["input_ids"].tolist() for s in samples]
    assert all(int(s["labels"][0]) == IGNORE_INDEX for s in back)
    again = repack(back, layout, collator, tok.pad_token_id)
    # the first label of a row is never a target (causal shift): the rest is the user's batch exactly
    assert set(again) == set(batch)
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(again[key], batch[key]), key
    real = batch["attention_mask"].bool()
    first = real & ~torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], 1)
    assert torch.equal(again["labels"][~first], batch["labels"][~first])
    # a new mix: the rows are the new samples', aligned to the multiple
    mixed = repack([back[1], back[2]], layout, collator, tok.pad_token_id)
    assert mixed["input_ids"].shape == (2, 16)
    packed_layout = layout_of(batch, multiple=8, padded_output="packed")
    flat = repack(back, packed_layout, collator, tok.pad_token_id)
    assert set(flat) == {"input_ids", "labels", "position_ids"} and flat["input_ids"].shape == (1, 24)
    assert segment_boundaries(flat["position_ids"]) == [[0, 5, 14, 17, 24]]


def test_padded_output_is_packed_only_for_varlen_attention():
    config = tiny_config("text")
    for impl, want in (("sdpa", "padded"), ("eager", "padded"), ("flash_attention_2", "packed"),
                       ("hf_dp_balance_varlen", "packed")):
        config._attn_implementation = impl
        assert padded_output(config) == want, impl


def test_trl_padding_free_rows_aligned_to_a_multiple_keep_their_pads_out_of_the_samples(setup):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    config, collator, samples = _short_text_samples(setup)
    user = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True, pad_to_multiple_of=16)
    batch = user([{"input_ids": s["input_ids"].tolist(), "labels": s["labels"].tolist()} for s in samples])
    assert batch["input_ids"].shape == (1, 32) and detect_input(batch) == INPUT_CU_SEQ_LENS
    assert len(split_packed(batch, config)) == 12  # without the multiple: every pad token a 1-token sample
    back = split_packed(batch, config, multiple=16, pad_token_id=PAD)
    assert [s["input_ids"].tolist() for s in back] == [s["input_ids"].tolist() for s in samples]
    layout = layout_of(batch, multiple=16)
    again = repack(back, layout, collator, PAD)
    for key in ("input_ids", "labels"):
        assert torch.equal(again[key], batch[key]), key
    assert again["cu_seq_lens_q"].tolist() == [0, 5, 14, 17, 24, 32]  # the pads: one segment
    assert repack(back[:3], layout, collator, PAD)["input_ids"].shape == (1, 32)  # 17 tokens -> 32
    assert repack(back[:1], layout, collator, PAD)["input_ids"].shape == (1, 16)


def test_trl_packed_dataset_rows_split_into_their_sequences(setup):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    config, collator, samples = _short_text_samples(setup)
    ids = [s["input_ids"].tolist() for s in samples]
    packed = [{"input_ids": ids[0] + ids[1], "seq_lengths": [5, 9]}, {"input_ids": ids[2] + ids[3], "seq_lengths": [3, 7]}]
    batch = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)(packed)
    back = split_packed(batch, config)
    assert [s["input_ids"].tolist() for s in back] == ids
    again = repack(back, layout_of(batch), collator, PAD)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "seq_idx"):
        assert torch.equal(again[key], batch[key]), key


@pytest.mark.parametrize("family", ["qwen2_vl", "internvl"])
def test_a_batch_that_cannot_be_split_names_the_row_the_sample_and_the_key(family, setup):
    config, collator, samples = setup(family)
    batch = _two_rows(collator, samples)
    missing = {k: v for k, v in batch.items() if k != "pixel_values"}
    with pytest.raises(ValueError, match=r"row 0, sample 1: key 'pixel_values'"):
        split_packed(missing, config)
    if family == "internvl":
        short = dict(batch, pixel_values=batch["pixel_values"][:-1])  # the last image lost a tile
        with pytest.raises(ValueError, match=r"row 1, sample 2: key 'pixel_values'"):
            split_packed(short, config)
    else:
        grids = batch["image_grid_thw"].clone()
        grids[-1, 1] += 2  # the last image's grid no longer matches its placeholders
        with pytest.raises(ValueError, match=r"row 1, sample 2: key 'image_grid_thw'"):
            split_packed(dict(batch, image_grid_thw=grids), config)
    with pytest.raises(ValueError, match="key 'extra_feature'"):
        split_packed(dict(batch, extra_feature=torch.zeros(2, 3)), config)


def test_an_unmasked_first_label_after_another_sample_is_refused(setup):
    config, collator, samples = setup("text")
    batch = collator(samples)
    start = int(samples[0]["input_ids"].numel())
    labels = batch["labels"].clone()
    labels[0, start] = 5  # sample 1's first label would learn from sample 0's last token
    with pytest.raises(ValueError, match="row 0, sample 1: key 'labels'"):
        split_packed(dict(batch, labels=labels), config)


def test_padded_rows_packed_padding_free_give_the_padded_loss_and_gradients(setup):
    """The varlen choice for padded input: one packed row of the step's samples, same summed loss and gradient."""
    from transformers import DataCollatorForLanguageModeling

    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.models import build_tokenizer

    config, collator, samples = _short_text_samples(setup, lengths=(12, 30, 7, 21))
    model = make_model("text", seed=0, dtype=torch.float64)
    user = DataCollatorForLanguageModeling(build_tokenizer("text"), mlm=False, pad_to_multiple_of=8)
    padded = user([{"input_ids": s["input_ids"].tolist()} for s in samples])
    flat = repack(split_packed(padded, config), layout_of(padded, 8, padded_output="packed"), collator, PAD)
    assert flat["input_ids"].shape == (1, 72) and "attention_mask" not in flat  # 70 tokens, aligned to 8

    def summed(batch):
        model.zero_grad()
        targets = int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())
        loss = model(**batch).loss * targets
        loss.backward()
        return float(loss), torch.cat([p.grad.reshape(-1) for p in model.parameters()]), targets

    (loss_a, grad_a, n_a), (loss_b, grad_b, n_b) = summed(padded), summed(flat)
    assert n_a == n_b
    assert abs(loss_a - loss_b) <= 1e-6 * abs(loss_a)
    assert float((grad_a - grad_b).norm() / grad_a.norm()) < 1e-6


def test_padded_vlm_rows_with_no_image_come_back_with_the_dummy_image_row_so_the_tower_runs(setup):
    from hf_dp_balance.core.padded_rows import repad

    config, collator, samples = setup("qwen2_vl")
    keys = ("input_ids", "labels", "mm_token_type_ids")
    batch = repad(samples[:2], keys, side="right", width=8, pad_token_id=PAD, mask_dtype=torch.long, position_dtype=None)
    batch.update(pixel_values=samples[1]["pixel_values"], image_grid_thw=samples[1]["image_grid_thw"])  # text, image
    layout = layout_of(batch, multiple=8)
    text, image = split_packed(batch, config)
    assert torch.equal(image["image_grid_thw"], samples[1]["image_grid_thw"])
    alone = repack([text], layout, collator, PAD)
    assert alone["input_ids"].shape[0] == 2  # the text row and the dummy image's row, labels all -100
    assert bool((alone["labels"][1] == IGNORE_INDEX).all()) and int(alone["attention_mask"][1].sum()) == 1
    assert torch.equal(alone["image_grid_thw"], collator.dummy_vision["image_grid_thw"])
    assert int((alone["input_ids"] == config.image_token_id).sum()) == 1
    with_image = repack([text, image], layout, collator, PAD)
    assert with_image["input_ids"].shape[0] == 2 and torch.equal(with_image["image_grid_thw"], samples[1]["image_grid_thw"])
