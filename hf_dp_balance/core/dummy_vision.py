"""The smallest valid visual input of a VLM family, as a per-sample dict whose loss contribution is exactly zero.

`PackedCollator` appends it as an extra segment to a packed row that has no image or video, so the vision
tower runs forward and backward on every rank in every micro-batch (DDP without find_unused_parameters,
FSDP2 with the tower as its own unit and ZeRO-3 then see the same collectives on every rank).
Guarantee: all labels are -100 and the segment restarts its positions at 0 and comes last in the row, so the
real tokens' logits, the loss, the gradients and `num_items_in_batch` are unchanged; the tower's parameters
get real gradient tensors, all zeros. Why this design and what was measured: docs/packing.md.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from hf_dp_balance.core.families import IGNORE_INDEX, QWEN_FAMILIES

# Keys whose presence in a packed row means the vision tower already runs on it.
VISION_INPUT_KEYS = ("pixel_values", "pixel_values_videos")


def _first(value) -> int:
    return int(value[0] if isinstance(value, (list, tuple)) else value)


def dummy_vision_sample(model_config, family: str) -> Optional[dict]:
    """The minimal image sample of `family` (None for text models).

    Qwen-VL: one image of grid (1, m, m) (m = spatial_merge_size: m*m patch rows, one placeholder token
    after the merge). InternVL: one tile of zeros, image_seq_length placeholder tokens. Pixels are zeros
    (the model casts them to the tower's dtype).
    """
    if family in QWEN_FAMILIES:
        vc = model_config.vision_config
        merge = int(vc.spatial_merge_size)
        width = int(getattr(vc, "in_channels", 3)) * int(vc.temporal_patch_size) * _first(vc.patch_size) ** 2
        ids = torch.tensor([int(model_config.image_token_id)])
        return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX),
                "mm_token_type_ids": torch.ones_like(ids),
                "pixel_values": torch.zeros(merge * merge, width),
                "image_grid_thw": torch.tensor([[1, merge, merge]])}
    if family == "internvl":
        vc = model_config.vision_config
        size = _first(vc.image_size)
        channels = int(getattr(vc, "num_channels", 3))
        ids = torch.full((int(model_config.image_seq_length),), int(model_config.image_token_id))
        return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX),
                "pixel_values": torch.zeros(1, channels, size, size)}
    return None


def needs_dummy_vision(samples: Sequence[Mapping[str, Any]]) -> bool:
    """True when no sample of the pack carries an image or a video (the tower would not run)."""
    return not any(s.get(key) is not None for s in samples for key in VISION_INPUT_KEYS)
