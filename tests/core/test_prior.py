"""The FLOP prior from a model's config: equal to the FLOPs torch counts in the real tiny models, sane for
published sizes, and the shape `CostModel.from_config` plans with."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.core.prior import ATTENTION_FWD_BWD, DENSE_FWD_BWD, decoder_flops, vision_flops
from hf_dp_balance.testing.cost_steps import fixed_length_steps, published_configs
from hf_dp_balance.testing.models import FAMILIES, make_model


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_forward_flops_equal_what_torch_counts(family):
    # Eager attention: torch counts QK^T and AV over all L^2 pairs; the causal prior counts L(L+1)/2.
    model = make_model(family, seed=0, attn_implementation="eager")
    decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
    dense, attn = decoder_flops(model.config)
    for length in (24, 64):
        ids = torch.randint(5, 100, (1, length))
        counted = _counted(lambda: model.lm_head(decoder(input_ids=ids).last_hidden_state))
        assert counted == pytest.approx(dense * length + 2 * attn * length * length, rel=1e-9)
    prior = CostModel.from_config(model.config)
    assert prior.quadratic * 1e12 == pytest.approx(ATTENTION_FWD_BWD * attn)
    assert prior.linear * 1e12 == pytest.approx(DENSE_FWD_BWD * dense + ATTENTION_FWD_BWD * attn)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "text"])
def test_vision_forward_flops_per_frame_equal_what_torch_counts(family):
    model = make_model(family, seed=0, attn_implementation="eager")
    vc = model.config.vision_config
    dense, full, window, per_frame = vision_flops(model.config)
    if family == "internvl":  # one 56x56 tile of 4x4 patches (+ the class token)
        patches = 16
        pixels = torch.randn(1, 3, 56, 56)
        counted = _counted(lambda: model.model.get_image_features(
            pixel_values=pixels, vision_feature_layer=-1, vision_feature_select_strategy="default"))
    else:  # one frame of 8x8 patches (Qwen2.5-VL: whole windows of 4x4)
        patches = 64
        pixels = torch.randn(patches, 3 * vc.temporal_patch_size * vc.patch_size ** 2)
        counted = _counted(lambda: model.model.visual(pixels, grid_thw=torch.tensor([[1, 8, 8]])))
    assert counted == pytest.approx(dense * patches + full * patches ** 2 + window * patches + per_frame, rel=1e-9)
    two_frames = CostModel.from_config(model.config, module="vision").sample_costs([patches, patches]).sum()
    assert two_frames == pytest.approx(2 * CostModel.from_config(model.config, module="vision").sample_costs(patches))


def test_published_sizes_give_the_published_flops_per_token():
    qwen2_7b, qwen2_vl_2b, qwen3_vl_8b, internvl3_8b = published_configs()
    # Qwen2-7B: 7.07e9 matmul parameters (6.53e9 in the blocks + the 0.545e9 LM head): 6 FLOPs each per token.
    dense, _ = decoder_flops(qwen2_7b)
    assert dense * DENSE_FWD_BWD == pytest.approx(6 * 7.07e9, rel=0.01)
    # Qwen2-VL-2B's ViT: 675M parameters, of which the merger's 34.4M run once per 4 patches.
    assert vision_flops(qwen2_vl_2b)[0] * DENSE_FWD_BWD == pytest.approx(6 * (675e6 - 0.75 * 34.4e6), rel=0.02)
    for cfg in (qwen2_vl_2b, qwen3_vl_8b, internvl3_8b):
        decoder, vision = CostModel.from_config(cfg), CostModel.from_config(cfg, module="vision")
        assert decoder.quadratic > 0 and decoder.linear > 0 and vision.quadratic > 0 and vision.linear > 0
        # attention equals the dense layers at L = linear / quadratic tokens: tens of thousands for these sizes
        assert 1e4 < decoder.linear / decoder.quadratic < 1e5
    # A 448px InternViT tile: 1024 patches, ~0.3B parameters: ~6 * 0.3e9 * 1025 FLOPs plus attention.
    tile = CostModel.from_config(internvl3_8b, module="vision").sample_costs(1024)
    assert 1.8e12 < tile * 1e12 < 2.6e12


def test_from_config_names_what_is_missing():
    with pytest.raises(ValueError, match="hidden_size"):
        CostModel.from_config(object())
    with pytest.raises(ValueError, match="vision_config"):
        CostModel.from_config(published_configs()[0], module="vision")
    with pytest.raises(ValueError, match="module"):
        CostModel.from_config(published_configs()[0], module="audio")


@pytest.mark.parametrize("mode", ["step_max", "per_rank"])
def test_the_prior_makes_fixed_length_packs_tell_a_sample_s_cost(mode):
    # sum(L) is the same on every rank: without a prior the linear term and the constant trade freely.
    import numpy as np

    from hf_dp_balance.core.fitting import fit_cost_model

    lengths = np.arange(16, 4096, 16)
    errors = {True: [], False: []}
    for seed in range(3):
        prior, truth, feats, times = fixed_length_steps(seed)
        y = times if mode == "per_rank" else times.max(axis=1)
        for with_prior in (True, False):
            fit = fit_cost_model(feats, y, mode=mode, holdout=0, prior=prior if with_prior else None)
            assert np.all(fit.model.coefficients >= 0)
            err = np.abs(fit.model.sample_costs(lengths) / truth.sample_costs(lengths) - 1).mean()
            errors[with_prior].append(err)
            if with_prior:
                assert len(fit.report.prior_scales) == 4 and fit.report.prior_scales[0] > 0
    assert np.median(errors[True]) < 0.12, errors
    if mode == "step_max":
        assert np.median(errors[True]) < np.median(errors[False]), errors
