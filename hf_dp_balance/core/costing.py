"""Per-sample costing: the one unit in which the loader, the vision balancer and the simulator price work.

A sample costs `decoder.sample_costs(tokens)` plus, when its images are encoded where the sample goes, the
vision model over every FRAME of each of its vision items. Qwen-VL vision attention is per frame (its
cu_seqlens repeat h*w t times), so an item of grid (t, h, w) is t frames of h*w patches and costs
t * vision.sample_costs(h*w); an image is one frame (t = 1); an InternVL tile is one frame of (S/p)^2
patches. The vision model is fitted on the same per-frame items (`integrations.callback.image_patches`),
so fit, loader and balancer agree. All functions are pure numpy.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

# The grid keys of a Qwen-VL sample, in the model's item order (images, then videos).
GRID_KEYS = ("image_grid_thw", "video_grid_thw")


def item_grids(items: Any) -> np.ndarray:
    """[n, 3] int64 grid (t, h, w) of each vision item.

    `items` is an [n, 3] array of grids, or a sequence whose entries are either a (t, h, w) triple or a
    patch count p: an item of one frame (an image, an InternVL tile), read as (1, 1, p). ValueError on a
    negative entry. O(n).
    """
    if isinstance(items, np.ndarray) and items.ndim == 2:
        grids = items.astype(np.int64).reshape(-1, 3)
    else:
        rows = [(1, 1, int(v)) if np.ndim(v) == 0 else tuple(int(x) for x in v) for v in items]
        if any(len(r) != 3 for r in rows):
            raise ValueError(f"vision items must be patch counts or (t, h, w) grids, got {list(items)!r}")
        grids = np.array(rows, dtype=np.int64).reshape(-1, 3)
    if grids.size and (grids < 0).any():
        bad = int(np.nonzero((grids < 0).any(axis=1))[0][0])
        raise ValueError(f"item {bad}: grid {grids[bad].tolist()} has a negative entry")
    return grids


def frame_patches(grids: Any) -> Tuple[np.ndarray, np.ndarray]:
    """(patches of each frame [F], item index of each frame [F]) of items with these grids.

    Item i of grid (t, h, w) gives t frames of h*w patches, in item order: the unit of the vision cost
    model. O(F).
    """
    grids = item_grids(grids)
    frames = grids[:, 0]
    return np.repeat(grids[:, 1] * grids[:, 2], frames), np.repeat(np.arange(grids.shape[0], dtype=np.int64), frames)


def item_costs(grids: np.ndarray, vision: Any) -> np.ndarray:
    """Vision cost of each item from its grid rows (t, h, w): t * vision.sample_costs(h*w).

    ValueError naming the item when a grid has a non-positive entry (a real item has at least one patch).
    """
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if grids.size and (grids <= 0).any():
        bad = int(np.nonzero((grids <= 0).any(axis=1))[0][0])
        raise ValueError(f"item {bad}: grid {grids[bad].tolist()} has a non-positive entry")
    patches, item = frame_patches(grids)
    return np.bincount(item, weights=_vision_costs(vision, patches), minlength=grids.shape[0])


def sample_costs(decoder: Any, tokens: Any, vision: Any = None, frame_patch_counts: Optional[Any] = None,
                 frame_sample: Optional[Any] = None) -> np.ndarray:
    """Cost of each sample (float64 [n]): decoder cost of its tokens + vision cost of its frames.

    `frame_patch_counts[f]` are the patches of frame f and `frame_sample[f]` the sample it belongs to (see
    `frame_patches`; an image is one frame). Without `vision` (the tower balanced on its own, or no tower),
    the decoder cost only. O(samples + frames).
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    costs = np.asarray(decoder.sample_costs(tokens), dtype=np.float64).reshape(-1).copy()
    if vision is None or frame_patch_counts is None:
        return costs
    patches = np.asarray(frame_patch_counts, dtype=np.int64).reshape(-1)
    owner = np.asarray(frame_sample, dtype=np.int64).reshape(-1)
    if owner.shape != patches.shape:
        raise ValueError(f"sample_costs: {owner.size} frame owners for {patches.size} frames")
    if patches.size:
        costs += np.bincount(owner, weights=_vision_costs(vision, patches), minlength=tokens.size)
    return costs


def planning_costs(tokens: Any, vision_items: Sequence[Any], decoder: Any, vision: Any = None) -> np.ndarray:
    """Each sample's cost on the rank that trains it, from per-sample lists of vision items.

    `vision_items[i]` lists sample i's items as `item_grids` reads them: (t, h, w) grids, or patch counts
    of one-frame items. Pass `vision` when the vision tower is NOT balanced on its own (the sample's
    images are then encoded where the sample goes); None: decoder cost only. O(samples + frames).
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if vision is None:
        return sample_costs(decoder, tokens)
    if len(vision_items) != tokens.size:
        raise ValueError(f"planning_costs: {len(vision_items)} vision patch lists for {tokens.size} samples")
    grids = [item_grids(v) for v in vision_items]
    counts = np.array([g.shape[0] for g in grids], dtype=np.int64)
    if not counts.sum():
        return sample_costs(decoder, tokens)
    patches, item = frame_patches(np.concatenate(grids))
    item_sample = np.repeat(np.arange(tokens.size, dtype=np.int64), counts)
    return sample_costs(decoder, tokens, vision, patches, item_sample[item])


def sample_grids(sample: Mapping[str, Any], vision_items: Sequence[int]) -> np.ndarray:
    """[n, 3] grids of one sample dict's vision items, in `sample_features` order.

    Qwen-VL: its `image_grid_thw` rows, then its `video_grid_thw` rows (their t*h*w must equal
    `vision_items`, the patch rows `sample_features` gave); items without grids (InternVL tiles): one
    frame each, (1, 1, patches).
    """
    parts = [np.asarray(sample[k]).reshape(-1, 3) for k in GRID_KEYS if sample.get(k) is not None]
    if not parts:
        return item_grids(vision_items)
    grids = np.concatenate(parts).astype(np.int64)
    if grids.prod(axis=1).tolist() != [int(v) for v in vision_items]:
        raise ValueError(f"grids {grids.tolist()} do not match the vision items {list(vision_items)}")
    return grids


def _vision_costs(vision: Any, patches: np.ndarray) -> np.ndarray:
    return np.asarray(vision.sample_costs(patches), dtype=np.float64).reshape(-1)


__all__ = ["GRID_KEYS", "item_grids", "frame_patches", "item_costs", "sample_costs", "planning_costs", "sample_grids"]
