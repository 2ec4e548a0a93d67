"""Hand-built packed rows for the vision tower: placeholder tokens and random float64 pixels, no processor.

`items` per family: Qwen-VL ``(kind, t, h, w)`` with kind "image" or "video" (grid t x h x w patches);
InternVL the number of tiles of each image. Each item follows a little text; the row ends in text.
"""

from hf_dp_balance.testing import models

# torch is imported inside the functions, as in testing.spawn: a spawned rank imports its test module,
# and so this one, before the rank's environment is applied.


def qwen_row(family, items, seed):
    """One packed row: per item some text, <vision_start>, placeholders, <vision_end>; random pixels."""
    import torch

    cfg = models.tiny_config(family).vision_config
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    gen = torch.Generator().manual_seed(seed)
    ids, types = [], []
    pix = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    for kind, t, h, w in items:
        pad = models.IMAGE_PAD_ID if kind == "image" else models.VIDEO_PAD_ID
        # Qwen3-VL separates video frames by timestamp text: one placeholder group per frame.
        groups = [t] if kind == "image" or family != "qwen3_vl" else [1] * t
        for frames in groups:
            text = torch.randint(20, models.VOCAB_SIZE, (3,), generator=gen).tolist()
            n_tok = frames * h * w // cfg.spatial_merge_size ** 2
            ids += text + [models.VISION_START_ID] + [pad] * n_tok + [models.VISION_END_ID]
            types += [0] * 4 + [1 if kind == "image" else 2] * n_tok + [0]
        pix[kind].append(torch.randn(t * h * w, width, generator=gen, dtype=torch.float64))
        grids[kind].append([t, h, w])
    tail = torch.randint(20, models.VOCAB_SIZE, (5,), generator=gen).tolist()
    ids += tail
    types += [0] * len(tail)
    batch = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": torch.tensor([types])}
    batch["labels"] = batch["input_ids"].clone()
    for kind, pkey, gkey in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        if pix[kind]:
            batch[pkey] = torch.cat(pix[kind])
            batch[gkey] = torch.tensor(grids[kind])
    return batch


def internvl_row(items, seed):
    """items: tiles per image; each image is <img> context tokens </img> after some text."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids, tiles = [], 0
    for n_tiles in items:
        ids += torch.randint(20, models.VOCAB_SIZE, (3,), generator=gen).tolist()
        ids += [models.IMG_START_ID] + [models.IMG_CONTEXT_ID] * (n_tiles * models.INTERNVL_TOKENS_PER_TILE) + [models.IMG_END_ID]
        tiles += n_tiles
    ids += torch.randint(20, models.VOCAB_SIZE, (5,), generator=gen).tolist()
    batch = {"input_ids": torch.tensor([ids])}
    batch["labels"] = batch["input_ids"].clone()
    if tiles:
        size = models.INTERNVL_TILE
        batch["pixel_values"] = torch.randn(tiles, 3, size, size, generator=gen, dtype=torch.float64)
    return batch


def vision_row(family, items, seed):
    """One packed row of `family` holding `items`, labels equal to the ids."""
    return internvl_row(items, seed) if family == "internvl" else qwen_row(family, items, seed)
