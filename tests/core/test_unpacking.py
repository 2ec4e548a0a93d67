"""split_packed / repack on the packed rows users already have, for every family (configs only, no model run)."""

import pytest
import torch

from hf_dp_balance.core.packing import IGNORE_INDEX, PackedCollator
from hf_dp_balance.core.unpacking import (INPUT_CU_SEQ_LENS, INPUT_POSITIONS, INPUT_SAMPLES, detect_input, fill_rows,
                                          layout_of, repack, split_packed)
from hf_dp_balance.testing.data import FAMILIES, make_samples, tiny_config
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


def test_detection_names_the_input_and_refuses_padded_rows():
    assert detect_input([{"input_ids": torch.ones(3)}]) == INPUT_SAMPLES
    padded = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])}
    with pytest.raises(ValueError, match="row 0: key 'position_ids'.*padded rows"):
        detect_input(padded)
    with pytest.raises(ValueError, match="row 1: key 'attention_mask': has zeros"):
        split_packed(dict(padded, position_ids=torch.arange(4).expand(2, 4)), tiny_config("text"))


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
