"""Per-sample costing: one per-frame unit for the loader, the vision balancer, the fit and the simulator."""

import numpy as np
import pytest
import torch

from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.costing import (frame_patches, item_costs, item_grids, planning_costs, sample_costs,
                                        sample_grids)


def test_frame_patches_gives_t_frames_of_h_times_w_per_item():
    patches, item = frame_patches(np.array([[1, 4, 4], [3, 2, 2], [2, 1, 6]]))
    assert patches.tolist() == [16, 4, 4, 4, 6, 6]
    assert item.tolist() == [0, 1, 1, 1, 2, 2]
    empty_patches, empty_item = frame_patches(np.zeros((0, 3), dtype=np.int64))
    assert empty_patches.size == 0 and empty_item.size == 0


def test_item_grids_reads_patch_counts_as_one_frame_items():
    assert item_grids([64, (2, 4, 4)]).tolist() == [[1, 1, 64], [2, 4, 4]]
    assert item_grids(()).shape == (0, 3)
    with pytest.raises(ValueError, match="item 1"):
        item_grids([3, (1, -2, 2)])
    with pytest.raises(ValueError, match="patch counts or"):
        item_grids([(1, 2)])


def test_item_costs_counts_video_frames_separately():
    cm = CostModel(quadratic=1.0, linear=10.0, per_sample=100.0)
    costs = item_costs(np.array([[1, 4, 4], [3, 4, 4], [1, 8, 8]]), cm)
    one = 16 * 16 + 10 * 16 + 100
    assert costs.tolist() == [one, 3 * one, 64 * 64 + 10 * 64 + 100]
    with pytest.raises(ValueError, match="item 1"):
        item_costs(np.array([[1, 4, 4], [0, 4, 4]]), cm)


def test_planning_costs_add_the_vision_cost_of_each_samples_images():
    decoder = CostModel(quadratic=1e-6, linear=1e-3, per_sample=0.01)
    vision = CostModel(quadratic=2e-6, linear=5e-3, per_sample=0.1)
    tokens = np.array([100, 40, 300])
    patches = [(64,), (), (16, 256)]  # one image, text only, two items
    expect = decoder.sample_costs(tokens) + np.array(
        [vision.sample_costs(np.array([64])).sum(), 0.0, vision.sample_costs(np.array([16, 256])).sum()])
    np.testing.assert_allclose(planning_costs(tokens, patches, decoder, vision), expect)
    # Vision tower balanced on its own: decoder cost only, whatever the images.
    np.testing.assert_allclose(planning_costs(tokens, patches, decoder, None), decoder.sample_costs(tokens))
    with pytest.raises(ValueError, match="2 vision patch lists for 3 samples"):
        planning_costs(tokens, patches[:2], decoder, vision)


def test_a_video_costs_the_same_in_the_loader_the_balancer_and_the_fit():
    """A t=4 video was once priced cost(t*h*w) by the loader and the fit, t*cost(h*w) by the balancer."""
    from hf_dp_balance.runtime.recorder import image_patches

    vision = CostModel(quadratic=2e-6, linear=5e-3, per_sample=0.1, constant=0.7)
    decoder = CostModel(quadratic=0.0, linear=0.0, per_sample=0.0)
    grid = np.array([[4, 8, 6]])
    frame = float(vision.sample_costs(np.array([48]))[0])
    balancer = item_costs(grid, vision)
    loader = planning_costs(np.array([10]), [grid], decoder, vision)
    fitted = vision.predict(features_of(image_patches({"video_grid_thw": torch.as_tensor(grid)}))) - vision.constant
    np.testing.assert_allclose([balancer[0], loader[0], fitted], [4 * frame] * 3)
    assert abs(float(vision.sample_costs(np.array([4 * 48]))[0]) - 4 * frame) > 0.01  # the old unit differs


def test_sample_costs_adds_each_frames_vision_cost_to_its_sample():
    decoder = CostModel(quadratic=1e-6, linear=1e-3, per_sample=0.01)
    vision = CostModel(quadratic=2e-6, linear=5e-3, per_sample=0.1)
    tokens = np.array([100, 40, 300])
    patches, frame_sample = np.array([64, 16, 16, 256]), np.array([0, 2, 2, 2])
    expect = decoder.sample_costs(tokens) + np.array([vision.sample_costs(np.array([64]))[0], 0.0,
                                                      vision.sample_costs(np.array([16, 16, 256])).sum()])
    np.testing.assert_allclose(sample_costs(decoder, tokens, vision, patches, frame_sample), expect)
    np.testing.assert_allclose(sample_costs(decoder, tokens), decoder.sample_costs(tokens))
    np.testing.assert_allclose(sample_costs(decoder, tokens, None, patches, frame_sample), decoder.sample_costs(tokens))
    with pytest.raises(ValueError, match="3 frame owners for 4 frames"):
        sample_costs(decoder, tokens, vision, patches, frame_sample[:3])


def test_sample_grids_of_a_qwen_video_sample_and_of_tiles():
    from hf_dp_balance.core.packing import sample_features
    from hf_dp_balance.testing.data import make_samples
    from hf_dp_balance.testing.models import tiny_config

    cfg = tiny_config("qwen2_vl")
    (video,) = make_samples("qwen2_vl", ("video",), seed=0)
    f = sample_features(video, cfg)
    grids = sample_grids(video, f.vision_items)
    assert grids.tolist() == video["video_grid_thw"].tolist()
    assert frame_patches(grids)[0].tolist() == list(f.vision_seqlens)  # the encoder's attention sequences
    with pytest.raises(ValueError, match="do not match"):
        sample_grids(video, [f.vision_items[0] + 1])
    assert sample_grids({"pixel_values": torch.zeros(2, 3, 56, 56)}, (16, 16)).tolist() == [[1, 1, 16], [1, 1, 16]]
