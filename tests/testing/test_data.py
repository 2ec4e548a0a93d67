"""Tiny configs / tokenizer / models and the synthetic dataset."""

import numpy as np
import pytest
import torch

from hf_dp_balance.testing import data
from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
from hf_dp_balance.testing.mix import BOUNDED_MAX, DEFAULT_SCALE, MIX_FRACTIONS, PACK_TOKENS, plan_samples
from hf_dp_balance.testing.models import FAMILIES, SPECIAL_TOKENS, build_tokenizer, make_model, tiny_config
from hf_dp_balance.core.packing import PackedCollator, sample_features

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def datasets_of():
    cache = {}

    def get(family, n=24, seed=0, **kw):
        key = (family, n, seed, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_synthetic_dataset(family, n, seed=seed, **kw)
        return cache[key]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_places_the_special_tokens_where_the_config_expects_them(family):
    tok = build_tokenizer(family)
    cfg = tiny_config(family)
    assert len(tok) <= cfg.get_text_config().vocab_size
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i
    if family.startswith("qwen"):
        ids = tok(f"{tok.vision_start_token}{tok.image_token}{tok.video_token}{tok.vision_end_token}",
                  add_special_tokens=False)["input_ids"]
        assert ids == [cfg.vision_start_token_id, cfg.image_token_id, cfg.video_token_id, cfg.vision_end_token_id]
    elif family == "internvl":
        ids = tok("<img><IMG_CONTEXT></img>", add_special_tokens=False)["input_ids"]
        assert ids == [tok.start_image_token_id, cfg.image_token_id, tok.end_image_token_id]
    text = "kalo mine rusa"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_are_small_deterministic_and_cache_free(family):
    a, b = make_model(family, seed=3), make_model(family, seed=3)
    assert sum(p.numel() for p in a.parameters()) < 500_000
    assert a.config.get_text_config().use_cache is False
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c = make_model(family, seed=4)
    assert not all(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))


def test_tiny_config_overrides_reach_the_sub_configs():
    cfg = tiny_config("qwen2_vl", text_config={"num_hidden_layers": 3}, vision_config={"depth": 2})
    assert cfg.text_config.num_hidden_layers == 3 and cfg.vision_config.depth == 2
    with pytest.raises(ValueError, match="family='llava'"):
        tiny_config("llava")


def test_mix_proportions_follow_the_spec():
    plans = plan_samples(20000, seed=5)
    kinds = np.array([p["kind"] for p in plans])
    for kind, frac in MIX_FRACTIONS.items():
        assert abs((kinds == kind).mean() - frac) < 0.015, kind
    scale = DEFAULT_SCALE
    text = np.array([p["text_tokens"] for p in plans if not p["long_tail"]])
    assert np.median(text) == pytest.approx(300 * scale, rel=0.1)
    one_image = np.array([p["vision_tokens"][0] for p in plans if p["kind"] == "image" and not p["long_tail"]])
    assert np.median(one_image) == pytest.approx(700 * scale, rel=0.1)
    assert one_image.min() >= int(64 * scale)
    multi = np.array([sum(p["vision_tokens"]) for p in plans if p["kind"] == "multi_image" and not p["long_tail"]])
    assert np.median(multi) == pytest.approx(5000 * scale, rel=0.15)
    assert all(2 <= len(p["vision_tokens"]) <= 6 for p in plans if p["kind"] == "multi_image")

    pack = PACK_TOKENS * scale
    totals = np.array([p["text_tokens"] + sum(p["vision_tokens"]) for p in plans])
    tail = np.array([p["long_tail"] for p in plans])
    assert 0.005 < tail.mean() < 0.015
    assert (totals[tail] >= 0.7 * pack).all() and totals.max() <= pack

    bounded = plan_samples(20000, seed=5, mix="bounded")
    bounded_totals = np.array([p["text_tokens"] + sum(p["vision_tokens"]) for p in bounded])
    assert bounded_totals.max() <= BOUNDED_MAX * scale
    assert not any(p["long_tail"] for p in bounded)
    with pytest.raises(ValueError, match="mix="):
        plan_samples(3, mix="zipf")


def _same_rows(a, b):
    """Equal columns and values (numpy format: pixel arrays compared as arrays, not Python lists)."""
    if a.column_names != b.column_names or len(a) != len(b):
        return False
    a, b = a.with_format("numpy"), b.with_format("numpy")
    for ra, rb in zip(a, b):
        for key in a.column_names:
            if (ra[key] is None) != (rb[key] is None):
                return False
            if ra[key] is not None and not np.array_equal(ra[key], rb[key]):
                return False
    return True


@pytest.mark.parametrize("family,mix", [("qwen2_vl", "long_tail"), ("internvl", "bounded")])
def test_dataset_is_deterministic_by_seed(family, mix, datasets_of):
    a, b = datasets_of(family, n=16, seed=7, mix=mix), build_synthetic_dataset(family, 16, seed=7, mix=mix)
    assert _same_rows(a, b)
    # row i does not depend on how many rows are built
    assert _same_rows(build_synthetic_dataset(family, 5, seed=7, mix=mix), a.select(range(5)))
    c = datasets_of(family, n=16, seed=8, mix=mix)
    assert a["input_ids"] != c["input_ids"] and not _same_rows(a, c)
    if mix == "bounded":
        assert max(len(x) for x in list(a["input_ids"]) + list(c["input_ids"])) <= BOUNDED_MAX * DEFAULT_SCALE


@pytest.mark.parametrize("family", FAMILIES)
def test_dataset_rows_are_valid_samples_whose_features_match_the_tensors(family, datasets_of):
    ds = datasets_of(family, n=40, seed=2, mix="long_tail", max_tokens=1024)
    cfg = tiny_config(family)
    collator = PackedCollator(cfg, max_tokens=1024)
    assert sorted(ds["sample_id"]) == list(range(40))
    seen_video = False
    for row in ds:
        s = to_sample(row)
        f = sample_features(s, cfg, index=row["sample_id"])  # validates placeholders against pixels
        assert f.tokens == len(row["input_ids"]) <= 1024
        assert s["labels"][0] == -100 and f.label_tokens > 0
        if family.startswith("qwen"):
            rows = sum(s[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in s)
            assert sum(f.vision_items) == rows
            placeholders = int((s["mm_token_type_ids"] > 0).sum())
            assert placeholders * cfg.vision_config.spatial_merge_size ** 2 == rows
            seen_video |= "pixel_values_videos" in s
            for key in ("pixel_values", "pixel_values_videos"):
                if key in s:
                    assert s[key].dtype == torch.float32
                    assert s[key].shape[1] == 3 * 2 * cfg.vision_config.patch_size ** 2
        elif family == "internvl":
            tiles = s["pixel_values"].shape[0] if "pixel_values" in s else 0
            assert int((s["input_ids"] == cfg.image_token_id).sum()) == tiles * cfg.image_seq_length
    packed = collator([to_sample(ds[i]) for i in range(6)])
    assert packed["input_ids"].shape[1] == sum(len(ds[i]["input_ids"]) for i in range(6))
    if family.startswith("qwen"):
        assert seen_video  # 40 long-tail rows at seed 2 include a video


def test_dataset_torch_format_feeds_the_collator(datasets_of):
    ds = datasets_of("qwen3_vl", n=24, seed=0).with_format("torch")
    cfg = tiny_config("qwen3_vl")
    batch = PackedCollator(cfg)([to_sample(ds[i]) for i in range(4)])
    model = make_model("qwen3_vl")
    with torch.no_grad():
        assert torch.isfinite(model(**batch).loss)


def test_qwen_video_pixels_fuse_two_different_frames_per_temporal_patch():
    (video,) = data.make_samples("qwen2_vl", ("video",), seed=0, vision_tokens=32)
    t, h, w = video["video_grid_thw"][0].tolist()
    assert t >= 2
    rows = video["pixel_values_videos"].reshape(t * h * w, 3, 2, 14, 14)
    # the two temporal slots hold different frames (the scene moves), unlike a still image's copies
    assert not torch.equal(rows[:, :, 0], rows[:, :, 1])
    (image,) = data.make_samples("qwen2_vl", ("image",), seed=0)
    still = image["pixel_values"].reshape(-1, 3, 2, 14, 14)
    assert torch.equal(still[:, :, 0], still[:, :, 1])
