"""PackedCollator / sample_features / split_packed on real tiny models of every family."""

import warnings

import pytest
import torch

from hf_dp_balance.testing.data import make_samples
from hf_dp_balance.testing.models import FAMILIES, IMAGE_PAD_ID, make_model
from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.core.packing import (
    PackedCollator,
    SampleFeatures,
    ensure_packing_support,
    sample_features,
    sample_tensor_keys,
)
from hf_dp_balance.core.unpacking import split_packed

torch.set_num_threads(1)

# text-only samples mixed with one image, several images and a video in one pack
KINDS = ("text", "image", "multi_image", "video", "text")
UNBATCHED_KEYS = ("input_ids", "labels", "mm_token_type_ids")


def _to_double(samples):
    return [{k: (v.double() if v.is_floating_point() else v) for k, v in s.items()} for s in samples]


@pytest.fixture(scope="module")
def models():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_model(family, seed=0, dtype=torch.float64)
        return cache[family]

    return get


@pytest.fixture(scope="module")
def samples_of():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_samples(family, KINDS, seed=1)
        return [dict(s) for s in cache[family]]

    return get


def _targets(labels):
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def _summed_loss(model, batch):
    """loss x number of targets: the sum of per-token losses (comparable across packings)."""
    return model(**batch).loss * _targets(batch["labels"])


def _unpacked(sample):
    return {k: (v[None] if k in UNBATCHED_KEYS else v) for k, v in sample.items()}


def _relative_gap(model, samples, batch):
    with torch.no_grad():
        packed = _summed_loss(model, batch)
        separate = sum(_summed_loss(model, _unpacked(s)) for s in samples)
    return (abs(packed - separate) / abs(separate)).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_loss_and_gradient_equal_the_sum_over_samples(family, models, samples_of):
    model = models(family)
    samples = _to_double(samples_of(family))
    # a sample trained on all its tokens: its first label must not become a target of its neighbour
    samples[4]["labels"] = samples[4]["input_ids"].clone()
    batch = PackedCollator(model.config)(samples)
    assert "attention_mask" not in batch
    if family.startswith("qwen"):
        assert batch["position_ids"].shape == (4, 1, batch["input_ids"].shape[1])
        assert "pixel_values_videos" in batch and batch["image_grid_thw"].shape[0] == 4  # 1 + 3 images
    model.zero_grad()
    packed = _summed_loss(model, batch)
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    separate = 0.0
    for s in samples:
        loss = _summed_loss(model, _unpacked(s))
        loss.backward()
        separate = separate + loss.detach()
    assert packed.item() == pytest.approx(separate.item(), rel=1e-5)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(packed_grads)
    if family != "text":
        assert any("visual" in n or "vision" in n for n in grads)  # the vision tower trained too
    for name, g in grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-5, atol=1e-9, msg=name)
    model.zero_grad()


@pytest.mark.parametrize("family", ["text", "qwen2_vl", "internvl"])
def test_use_cache_left_true_silently_breaks_packing_and_the_guard_fixes_it(family, models, samples_of):
    model = models(family)
    samples = _to_double(samples_of(family))
    batch = PackedCollator(model.config)(samples)
    text_config = model.config.get_text_config()
    text_config.use_cache = True
    try:
        assert _relative_gap(model, samples, batch) > 1e-4  # samples attend to each other: the failure is real
        with pytest.raises(ValueError, match="use_cache"):
            PackedCollator(model.config, fix_config=False)
        with pytest.warns(UserWarning, match="use_cache=False"):
            PackedCollator(model.config)
        assert text_config.use_cache is False
        assert _relative_gap(model, samples, batch) < 1e-6
    finally:
        text_config.use_cache = False


def test_three_row_mrope_positions_silently_disable_packing(models, samples_of):
    model = models("qwen2_vl")
    samples = _to_double(samples_of("qwen2_vl"))
    batch = PackedCollator(model.config)(samples)
    three_rows = dict(batch, position_ids=batch["position_ids"][1:])
    assert _relative_gap(model, samples, batch) < 1e-6
    assert _relative_gap(model, samples, three_rows) > 1e-4
    with pytest.raises(ValueError, match=r"position_ids.*\[4, 1, T\]"):
        split_packed(three_rows, model.config)


def test_guard_refuses_attention_that_ignores_sample_boundaries(models, samples_of):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        # a dense causal attention that never looks at the packed mask
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    AttentionInterface.register("test_causal_only", causal_only)
    model = make_model("text", seed=0, dtype=torch.float64, attn_implementation="test_causal_only")
    samples = _to_double(samples_of("text"))
    batch = PackedCollator(model.config)(samples)
    assert _relative_gap(model, samples, batch) > 1e-4
    with pytest.raises(ValueError, match="test_causal_only"):
        ensure_packing_support(model)
    ensure_packing_support(model, extra_attention=("test_causal_only",))
    ensure_packing_support(models("qwen2_vl"))


@pytest.mark.parametrize("family", FAMILIES)
def test_split_packed_round_trip_is_exact(family, models, samples_of):
    config = models(family).config
    samples = samples_of(family)
    assert all(s["labels"][0] == IGNORE_INDEX for s in samples)  # prompts are masked
    back = split_packed(PackedCollator(config)(samples), config)
    assert len(back) == len(samples)
    for i, (got, want) in enumerate(zip(back, samples)):
        assert set(got) == set(want), i
        for key in want:
            assert got[key].dtype == want[key].dtype, (i, key)
            assert torch.equal(got[key], want[key]), (i, key)


def test_split_packed_masks_only_the_first_label(models, samples_of):
    config = models("qwen2_5_vl").config
    samples = samples_of("qwen2_5_vl")
    samples[2] = dict(samples[2], labels=samples[2]["input_ids"].clone())  # a sample trained on every token
    back = split_packed(PackedCollator(config)(samples), config)
    assert back[2]["labels"][0] == IGNORE_INDEX
    assert torch.equal(back[2]["labels"][1:], samples[2]["input_ids"][1:])


@pytest.mark.parametrize("dummy_vision", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_empty_pack_is_a_valid_no_op_row(family, dummy_vision, models):
    model = models(family)
    batch = PackedCollator(model.config, dummy_vision=dummy_vision)([])
    assert (batch["labels"] == IGNORE_INDEX).all()
    if dummy_vision and family != "text":  # the tower runs on an empty row too (same collectives)
        assert "pixel_values" in batch
    else:
        assert batch["input_ids"].shape == (1, 1) and batch["labels"].tolist() == [[IGNORE_INDEX]]
        assert not any(k.startswith("pixel") for k in batch)
    model.zero_grad()
    loss = model(**batch, num_items_in_batch=torch.tensor(7)).loss
    loss.backward()
    assert loss.item() == 0.0
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads.values())
    if dummy_vision:  # every parameter, vision tower included, got a (zero) gradient tensor
        assert set(grads) == {n for n, _ in model.named_parameters()}
    model.zero_grad()


def test_bad_input_names_the_sample_and_the_key(models, samples_of):
    config = models("qwen2_vl").config
    collator = PackedCollator(config)
    good = samples_of("qwen2_vl")

    wrong_grid = dict(good[1], image_grid_thw=good[1]["image_grid_thw"] + torch.tensor([[0, 0, 2]]))
    with pytest.raises(ValueError, match=r"sample 1: key 'image_grid_thw'.*placeholder"):
        collator([good[0], wrong_grid])

    ids = good[1]["input_ids"].clone()
    ids[ids == IMAGE_PAD_ID] = 100  # placeholders gone, pixels still there
    no_tokens = dict(good[1], input_ids=ids, mm_token_type_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match=r"sample 0: key 'pixel_values'"):
        collator([no_tokens])

    missing = {k: v for k, v in good[2].items() if k != "image_grid_thw"}
    with pytest.raises(ValueError, match=r"sample 2: key 'image_grid_thw': missing"):
        collator(good[:2] + [missing])
    no_types = {k: v for k, v in good[0].items() if k != "mm_token_type_ids"}
    with pytest.raises(ValueError, match=r"sample 0: key 'mm_token_type_ids': missing"):
        collator([no_types])

    as_list = dict(good[1], pixel_values=good[1]["pixel_values"].tolist())
    with pytest.raises(ValueError, match=r"sample 0: key 'pixel_values': expected a torch.Tensor"):
        collator([as_list])

    longest = max(s["input_ids"].numel() for s in good)
    capped = PackedCollator(config, max_tokens=longest - 1)
    index = [s["input_ids"].numel() for s in good].index(longest)
    with pytest.raises(ValueError, match=rf"sample {index}: key 'input_ids'.*max_tokens"):
        capped(good)
    with pytest.raises(ValueError, match=r"key 'input_ids'.*exceed max_tokens"):
        PackedCollator(config, max_tokens=longest)(good)

    internvl = models("internvl").config
    tiles = samples_of("internvl")[1]
    with pytest.raises(ValueError, match=r"sample 0: key 'pixel_values'.*IMG_CONTEXT"):
        PackedCollator(internvl)([dict(tiles, pixel_values=tiles["pixel_values"][:-1])])


@pytest.mark.parametrize("family", FAMILIES)
def test_sample_features_agree_with_the_tensors(family, models, samples_of):
    config = models(family).config
    for i, s in enumerate(samples_of(family)):
        f = sample_features(s, config, index=i)
        assert isinstance(f, SampleFeatures)
        assert f.tokens == s["input_ids"].numel()
        assert f.label_tokens == int((s["labels"][1:] != IGNORE_INDEX).sum()) > 0
        if family.startswith("qwen"):
            rows = sum(s[k].shape[0] for k in ("pixel_values", "pixel_values_videos") if k in s)
            assert sum(f.vision_items) == rows
            assert sum(f.vision_seqlens) == rows
            n_items = sum(s[k].shape[0] for k in ("image_grid_thw", "video_grid_thw") if k in s)
            assert len(f.vision_items) == n_items
        elif family == "internvl":
            tiles = s["pixel_values"].shape[0] if "pixel_values" in s else 0
            assert len(f.vision_items) == tiles
            assert set(f.vision_items) <= {(56 // 14) ** 2}
        else:
            assert f.vision_items == ()
        assert set(s) <= set(sample_tensor_keys(config))


def test_sample_features_from_a_hand_built_sample(models):
    config = models("qwen3_vl").config
    merge2 = config.vision_config.spatial_merge_size ** 2
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    n_img = int(grid.prod(1).sum()) // merge2
    ids = torch.tensor([1, 3] + [IMAGE_PAD_ID] * n_img + [4, 20, 21, 22])
    sample = {
        "input_ids": ids,
        "labels": torch.tensor([IGNORE_INDEX] * (n_img + 3) + [21, 22, 1]),
        "mm_token_type_ids": (ids == IMAGE_PAD_ID).long(),
        "pixel_values": torch.zeros(int(grid.prod(1).sum()), 3 * 2 * 16 * 16),
        "image_grid_thw": grid,
    }
    f = sample_features(sample, config)
    assert f == SampleFeatures(tokens=ids.numel(), vision_items=(24, 4), vision_seqlens=(24, 4), label_tokens=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_keys_are_arguments_of_the_model_forward(family, models, samples_of):
    import inspect

    model = models(family)
    batch = PackedCollator(model.config)(samples_of(family))
    params = inspect.signature(type(model).forward).parameters
    assert set(batch) <= set(params), set(batch) - set(params)


def test_qwen2_5_video_seconds_per_grid_shape_the_packed_positions(models, samples_of):
    model = models("qwen2_5_vl")
    samples = _to_double(samples_of("qwen2_5_vl"))
    video = [i for i, s in enumerate(samples) if "video_grid_thw" in s]
    assert video
    timed = [dict(s, second_per_grid_ts=torch.tensor([0.5], dtype=torch.float64)) if i in video else s
             for i, s in enumerate(samples)]
    collator = PackedCollator(model.config)
    batch, plain = collator(timed), collator(samples)
    assert not torch.equal(batch["position_ids"], plain["position_ids"])  # the video's time axis moved
    assert _relative_gap(model, timed, batch) < 1e-6
    back = split_packed(batch, model.config)
    assert torch.equal(back[video[0]]["second_per_grid_ts"], timed[video[0]]["second_per_grid_ts"])


# --------------------------------------------------------------------------- sample boundaries (the one definition)


def test_segment_boundaries_follow_position_restarts():
    from hf_dp_balance.core.boundaries import boundaries_from_cu_seq_lens, segment_boundaries, segment_lengths

    assert segment_boundaries(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [[0, 3, 5, 6]]
    assert segment_boundaries(torch.tensor([[3, 4, 5]])) == [[0, 3]]  # a row starting without 0: one sample
    assert segment_boundaries(torch.tensor([0, 0, 0])) == [[0, 1, 2, 3]]
    # a jump that is not a restart at 0 also starts a sample (transformers' rule: position != previous + 1)
    assert segment_boundaries(torch.tensor([[0, 1, 2, 7, 8]])) == [[0, 3, 5]]
    # two rows, and Qwen-VL's [4, B, T] (row 0 the plain positions; the mrope rows are ignored)
    two = torch.tensor([[0, 1, 0, 1, 2], [5, 6, 7, 0, 1]])
    assert segment_boundaries(two) == [[0, 2, 5], [0, 3, 5]]
    mrope = torch.stack([two, two * 0 + 9, two * 0, two * 0])
    assert segment_boundaries(mrope) == [[0, 2, 5], [0, 3, 5]]
    assert segment_lengths(mrope) == [2, 3, 3, 2]
    assert segment_lengths(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])) == [3, 2, 4]
    with pytest.raises(ValueError, match="position_ids"):
        segment_boundaries(torch.zeros(3, 1, 4, dtype=torch.long))  # [3, B, T]: no plain row
    # cumulative lengths of the flattening collator
    assert boundaries_from_cu_seq_lens(torch.tensor([0, 3, 5, 9], dtype=torch.int32), 9) == [0, 3, 5, 9]
    for bad in ([0, 3, 2, 9], [1, 3, 9], [0, 3, 8]):
        with pytest.raises(ValueError, match="cu_seq_lens_q"):
            boundaries_from_cu_seq_lens(torch.tensor(bad), 9)
