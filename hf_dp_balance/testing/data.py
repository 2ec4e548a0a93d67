"""A realistic synthetic multimodal dataset of real processed samples (offline, CPU, deterministic by seed).

Sample shapes come from the starting mix (`hf_dp_balance.testing.mix`); images are drawn with Pillow and
passed through the family's real `*ImageProcessorPil`, videos are frame stacks in the video processor's
layout. The tiny models and tokenizer are in `hf_dp_balance.testing.models`. Details: docs/data.md.
"""

from __future__ import annotations

import math
import tempfile
from typing import Any, Iterator, Optional

import numpy as np

from hf_dp_balance.testing.mix import DEFAULT_SCALE, IMAGE_MAX, MIX_FRACTIONS, pack_and_cap, plan_samples
from hf_dp_balance.testing.models import (BOS_ID, EOS_ID, IMAGE_PAD_ID, IMG_CONTEXT_ID, IMG_END_ID, IMG_START_ID,
                                          INTERNVL_TILE, INTERNVL_TOKENS_PER_TILE, VIDEO_PAD_ID, VISION_END_ID,
                                          VISION_START_ID, build_tokenizer, check_family, random_text, tiny_config)

# ---------------------------------------------------------------- synthetic dataset
# The mix's figures and each sample's shape: `hf_dp_balance.testing.mix`.


def _draw_image(rng: np.random.Generator, width: int, height: int, base=None, shift: int = 0):
    """A Pillow image: background colour and a few shapes (optionally moved by `shift`, for video frames)."""
    from PIL import Image, ImageDraw

    if base is None:
        base = {
            "bg": tuple(int(c) for c in rng.integers(0, 256, 3)),
            "shapes": [
                (int(rng.integers(0, 2)), tuple(int(c) for c in rng.integers(0, 256, 3)),
                 float(rng.random()), float(rng.random()), float(rng.uniform(0.1, 0.5)), float(rng.uniform(0.1, 0.5)))
                for _ in range(int(rng.integers(2, 6)))
            ],
        }
    img = Image.new("RGB", (width, height), base["bg"])
    draw = ImageDraw.Draw(img)
    for kind, colour, x, y, w, h in base["shapes"]:
        x0, y0 = int(x * width) + shift, int(y * height)
        box = (x0, y0, x0 + max(1, int(w * width)), y0 + max(1, int(h * height)))
        (draw.rectangle if kind == 0 else draw.ellipse)(box, fill=colour)
    return img, base


def _aspect(rng: np.random.Generator) -> float:
    """Width / height of a photo or document: common ratios, either orientation."""
    ratio = float(rng.choice([1.0, 4 / 3, 3 / 2, 16 / 9, 2.0]))
    return ratio if rng.random() < 0.7 else 1.0 / ratio


def _grid_for_tokens(tokens: int, aspect: float) -> tuple[int, int]:
    """(rows, cols) of merged tokens with rows*cols ~ tokens and cols/rows ~ aspect (each >= 1)."""
    rows = max(1, int(round(math.sqrt(tokens / aspect))))
    cols = max(1, int(round(tokens / rows)))
    return rows, cols


class _Renderer:
    """Turns planned samples into processed rows for one family (holds the processors)."""

    def __init__(self, family: str):
        self.family = family
        self.tok = build_tokenizer(family)
        self.cfg = tiny_config(family)
        if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

            v = self.cfg.vision_config
            self.patch, self.merge, self.tpatch = v.patch_size, v.spatial_merge_size, v.temporal_patch_size
            self.factor = self.patch * self.merge
            self.proc = Qwen2VLImageProcessorPil(
                patch_size=self.patch, merge_size=self.merge, temporal_patch_size=self.tpatch,
                size={"shortest_edge": 4 * self.factor**2, "longest_edge": IMAGE_MAX * self.factor**2},
            )
        elif family == "internvl":
            from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

            self.proc = GotOcr2ImageProcessorPil(
                size={"height": INTERNVL_TILE, "width": INTERNVL_TILE}, crop_to_patches=True,
                min_patches=1, max_patches=12,
            )

    def text_ids(self, rng: np.random.Generator, n: int) -> list[int]:
        """Exactly `n` token ids of tokenized pseudo-text (n >= 0)."""
        ids: list[int] = []
        while len(ids) < n:
            ids += self.tok(random_text(rng, max(4, n)), add_special_tokens=False)["input_ids"]
        return ids[:n]

    # -- vision blocks: each returns (ids, mm_types, arrays...) for one image / video
    def qwen_image(self, rng, tokens):
        rows, cols = _grid_for_tokens(tokens, _aspect(rng))
        img, _ = _draw_image(rng, cols * self.factor, rows * self.factor)
        out = self.proc(images=[img], return_tensors="np")
        pix, grid = out["pixel_values"].astype(np.float32), out["image_grid_thw"].astype(np.int64)
        n = int(grid.prod() // self.merge**2)
        return [VISION_START_ID] + [IMAGE_PAD_ID] * n + [VISION_END_ID], [0] + [1] * n + [0], pix, grid

    def qwen_video(self, rng, tokens):
        """A video as a frame stack: frames drawn with a moving scene, each frame through the image processor,
        frame pairs fused into temporal patches exactly as Qwen2VLVideoProcessor lays them out
        (channel, temporal, patch_h, patch_w): torchvision-based video processors do not run here."""
        grid_t = int(np.clip(round(tokens / 64), 2, 16))
        rows, cols = _grid_for_tokens(max(1, tokens // grid_t), _aspect(rng))
        w, h = cols * self.factor, rows * self.factor
        base = None
        frames = []
        for f in range(grid_t * self.tpatch):
            img, base = _draw_image(rng, w, h, base=base, shift=f * max(1, w // 32))
            frames.append(self.proc(images=[img], return_tensors="np")["pixel_values"])
        _, gh, gw = (int(x) for x in self.proc(images=[img], return_tensors="np")["image_grid_thw"][0])
        c, p, tp = 3, self.patch, self.tpatch
        pairs = []
        for t in range(grid_t):
            # each frame's rows hold `tp` identical temporal copies; take copy 0 of frame t*tp + k
            stack = [frames[t * tp + k].reshape(-1, c, tp, p, p)[:, :, 0] for k in range(tp)]
            pairs.append(np.stack(stack, axis=2).reshape(-1, c * tp * p * p))
        pix = np.concatenate(pairs).astype(np.float32)
        grid = np.array([[grid_t, gh, gw]], dtype=np.int64)
        per_t = gh * gw // self.merge**2
        ids, types = [], []
        if self.family == "qwen3_vl":  # Qwen3-VL: one block per temporal patch, preceded by its timestamp
            for t in range(grid_t):
                stamp = self.tok(f"<{t * 1.0:.1f} seconds>", add_special_tokens=False)["input_ids"]
                ids += stamp + [VISION_START_ID] + [VIDEO_PAD_ID] * per_t + [VISION_END_ID]
                types += [0] * len(stamp) + [0] + [2] * per_t + [0]
        else:
            n = grid_t * per_t
            ids, types = [VISION_START_ID] + [VIDEO_PAD_ID] * n + [VISION_END_ID], [0] + [2] * n + [0]
        return ids, types, pix, grid

    def internvl_image(self, rng, tokens, max_tiles=12):
        """One image as InternVL tiles. Tokens are scaled like every family's: the image is drawn with about
        tokens / INTERNVL_TOKENS_PER_TILE tiles of area (realistic aspect ratio), and the real processor
        picks its tile grid (1..max_tiles, plus a thumbnail when it crops)."""
        tiles = int(np.clip(round(tokens / INTERNVL_TOKENS_PER_TILE), 1, max_tiles))
        rows, cols = _grid_for_tokens(tiles, _aspect(rng))
        img, _ = _draw_image(rng, cols * INTERNVL_TILE, rows * INTERNVL_TILE)
        out = self.proc(images=[img], return_tensors="np", max_patches=max_tiles)
        pix = out["pixel_values"].astype(np.float32)
        n = pix.shape[0] * INTERNVL_TOKENS_PER_TILE
        return [IMG_START_ID] + [IMG_CONTEXT_ID] * n + [IMG_END_ID], pix

    def vision_block(self, plan: dict, rng: np.random.Generator) -> tuple[list[int], list[int], dict]:
        """Token ids, mm token types and pixel arrays of a sample's images / video."""
        kind, arrays = plan["kind"], {}
        ids: list[int] = []
        types: list[int] = []
        if self.family == "text" or kind == "text":
            return ids, types, arrays
        if self.family == "internvl":
            tiles = []
            if kind == "video":  # InternVL video: frames as single tiles, "Frame{i}: <img>...</img>"
                for _ in range(max(2, round(plan["vision_tokens"][0] / INTERNVL_TOKENS_PER_TILE))):
                    block, pix = self.internvl_image(rng, 1, max_tiles=1)
                    ids += self.text_ids(rng, 2) + block
                    tiles.append(pix)
            else:
                for v in plan["vision_tokens"]:
                    block, pix = self.internvl_image(rng, v)
                    ids += block
                    tiles.append(pix)
            arrays["pixel_values"] = np.concatenate(tiles)
            return ids, [0] * len(ids), arrays
        pix_i, grid_i, pix_v, grid_v = [], [], [], []
        for v in plan["vision_tokens"]:
            if kind == "video":
                block, btypes, pix, grid = self.qwen_video(rng, v)
                pix_v.append(pix), grid_v.append(grid)
            else:
                block, btypes, pix, grid = self.qwen_image(rng, v)
                pix_i.append(pix), grid_i.append(grid)
            between = self.text_ids(rng, 1) if ids else []  # text between blocks, as a chat template has
            ids += between + block
            types += [0] * len(between) + btypes
        if pix_i:
            arrays["pixel_values"], arrays["image_grid_thw"] = np.concatenate(pix_i), np.concatenate(grid_i)
        if pix_v:
            arrays["pixel_values_videos"], arrays["video_grid_thw"] = np.concatenate(pix_v), np.concatenate(grid_v)
        return ids, types, arrays

    def render(self, plan: dict, rng: np.random.Generator, sample_id: int, cap: int) -> dict:
        """One processed sample: <bos> vision prompt answer <eos>; labels mask everything before the answer."""
        n_text = plan["text_tokens"]
        if self.family == "text":  # a text-only family: the vision budget becomes text (long documents)
            n_text += sum(plan["vision_tokens"])
        vis_ids, vis_types, arrays = self.vision_block(plan, rng)
        for _ in range(4):  # vision rounds up to whole patches / tiles / frames (and markers): redo it smaller
            if len(vis_ids) + 4 <= cap:
                break
            shrink = 0.9 * (cap - 4) / len(vis_ids)
            plan = dict(plan, vision_tokens=[max(1, int(v * shrink)) for v in plan["vision_tokens"]])
            vis_ids, vis_types, arrays = self.vision_block(plan, rng)
        else:
            raise ValueError(f"sample {sample_id}: vision part of {len(vis_ids)} tokens does not fit "
                             f"max_tokens={cap}; raise max_tokens")
        # the vision part rounds to whole patches / tiles: keep the sample inside the cap by trimming text
        n_text = max(2, min(n_text, cap - len(vis_ids) - 2))
        prompt_n = max(1, n_text // 3)
        prompt, answer = self.text_ids(rng, prompt_n), self.text_ids(rng, n_text - prompt_n)
        ids = [BOS_ID] + vis_ids + prompt + answer + [EOS_ID]
        n_prompt = 1 + len(vis_ids) + len(prompt)
        row: dict[str, Any] = {"sample_id": sample_id, "input_ids": np.array(ids, dtype=np.int64),
                               "labels": np.array([-100] * n_prompt + ids[n_prompt:], dtype=np.int64)}
        if self.family.startswith("qwen"):
            row["mm_token_type_ids"] = np.array([0] + vis_types + [0] * (len(ids) - 1 - len(vis_ids)), dtype=np.int64)
        row.update(arrays)
        return row


def dataset_features(family: str):
    """The `datasets.Features` of `build_synthetic_dataset(family, ...)` (absent pixels are None)."""
    check_family(family)
    import datasets as hfds

    def nested(value, depth):
        # nested lists (not ArrayXD): a missing value reads back as None, not as NaN
        for _ in range(depth):
            value = hfds.List(value)
        return value

    feats = {
        "sample_id": hfds.Value("int64"),
        "input_ids": hfds.List(hfds.Value("int64")),
        "labels": hfds.List(hfds.Value("int64")),
    }
    if family.startswith("qwen"):
        v = tiny_config(family).vision_config
        dim = 3 * v.temporal_patch_size * v.patch_size**2
        feats["mm_token_type_ids"] = hfds.Sequence(hfds.Value("int64"))
        feats["pixel_values"] = nested(hfds.Value("float32"), 2)  # [patch rows, 3 * 2 * patch^2]
        feats["image_grid_thw"] = nested(hfds.Value("int64"), 2)  # [images, 3]
        feats["pixel_values_videos"] = nested(hfds.Value("float32"), 2)
        feats["video_grid_thw"] = nested(hfds.Value("int64"), 2)
    elif family == "internvl":
        feats["pixel_values"] = nested(hfds.Value("float32"), 4)  # [tiles, 3, S, S]
    return hfds.Features(feats)


def _generate_rows(family: str, plans: list, seed: int, cap: int) -> Iterator[dict]:
    renderer = _Renderer(family)
    names = list(dataset_features(family))
    for i, plan in plans:  # (index, plan): datasets may shard list-valued gen_kwargs
        # one generator per sample: row i does not depend on how many rows came before (stable subsets)
        rng = np.random.default_rng([seed, i])
        row = renderer.render(plan, rng, i, cap)
        yield {k: row.get(k) for k in names}


def build_synthetic_dataset(family: str, num_samples: int, *, seed: int = 0, mix: str = "long_tail",
                            max_tokens: Optional[int] = None, scale: float = DEFAULT_SCALE):
    """A `datasets.Dataset` of real processed multimodal samples, deterministic by `seed`.

    Sample shapes follow the starting mix of WORKLOAD_STATS.md (see the
    figures in `hf_dp_balance.testing.mix`):
    35% text-only, 55% one image, 5% several images (2-6), 5% video; text
    ~ lognormal(median 300 tokens, sigma 0.9); one image
    ~ clip(lognormal(700, 0.6), 64, 16384) tokens; several images / video
    ~ lognormal(5000, 0.6) tokens in all; packs of 32768 tokens.
    ``mix="bounded"``: no sample above 8192 tokens. ``mix="long_tail"``: also
    ~1% of samples at 75-95% of the pack length.

    ``scale`` (default 1/16) multiplies every token count, so the defaults give
    packs of 2048 tokens, images of ~44 tokens (median), videos of ~300 tokens:
    tiny models train on them on CPU and hundreds of samples build in seconds.
    Images are drawn with Pillow at the resolution that makes the scaled token
    count (Qwen-VL: 28x28 px per token, 32x32 for Qwen3-VL; InternVL: 56 px
    tiles of 4 tokens) with realistic aspect ratios, and go through the family's
    real `*ImageProcessorPil`. Videos (Qwen-VL) are frame stacks, each frame
    through the image processor and frame pairs fused into temporal patches in
    the layout of the video processor (which needs torchvision, unavailable
    here); Qwen3-VL videos carry a timestamp text before each temporal patch
    as its processor writes. InternVL videos are frames of one tile each.
    ``max_tokens`` (default 32768 * scale): no sample is longer.

    Columns: ``sample_id``, ``input_ids``, ``labels`` (everything before the
    answer is -100), and per family ``mm_token_type_ids`` (Qwen-VL),
    ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
    ``video_grid_thw`` (None where a sample has none). Use `to_sample(row)`
    to get the per-sample dict of tensors the collator takes.
    """
    check_family(family)
    import datasets as hfds

    plans = plan_samples(num_samples, seed=seed, mix=mix, scale=scale, max_tokens=max_tokens)
    _, cap = pack_and_cap(mix, scale, max_tokens)
    # A private, throw-away cache dir: the rows live in memory, and a shared cache could hand back rows
    # generated by an older version of this code under the same arguments.
    with tempfile.TemporaryDirectory(prefix="hf_dp_balance_ds_") as cache_dir:
        return hfds.Dataset.from_generator(
            _generate_rows,
            # a tuple, not a list: datasets shards list-valued gen_kwargs into one generator call per item
            gen_kwargs={"family": family, "plans": tuple(enumerate(plans)), "seed": seed, "cap": cap},
            features=dataset_features(family),
            cache_dir=cache_dir,
            keep_in_memory=True,
        )


def make_samples(family: str, kinds: tuple = ("text", "image", "multi_image", "video"), *, seed: int = 0,
                 text_tokens: int = 24, vision_tokens: int = 48, max_tokens: int = 1 << 20) -> list[dict]:
    """Per-sample dicts of tensors of chosen kinds (tests, examples): the same rendering as the dataset.

    ``kinds``: "text", "image", "multi_image" (3 images), "video" (InternVL: frames as tiles).
    ``vision_tokens``: LLM tokens per sample's vision part (split over the images of multi_image).
    """
    check_family(family)
    renderer = _Renderer(family)
    out = []
    for i, kind in enumerate(kinds):
        if kind not in MIX_FRACTIONS:
            raise ValueError(f"kinds[{i}]={kind!r}: expected one of {tuple(MIX_FRACTIONS)}")
        vision = {"text": [], "image": [vision_tokens], "video": [vision_tokens],
                  "multi_image": [max(1, vision_tokens // 3)] * 3}[kind]
        plan = {"kind": kind, "text_tokens": text_tokens, "vision_tokens": vision, "long_tail": False}
        row = renderer.render(plan, np.random.default_rng([seed, i]), i, max_tokens)
        out.append(to_sample({k: v for k, v in row.items()}))
    return out


def to_sample(row: dict, *, keep_sample_id: bool = False) -> dict:
    """A dataset row (python, numpy or torch format) -> the per-sample dict of tensors `PackedCollator` takes.

    Drops columns that are None (a sample without images / videos) and, unless
    ``keep_sample_id``, the ``sample_id``.
    """
    import torch

    out = {}
    for key, value in row.items():
        if value is None or (key == "sample_id" and not keep_sample_id):
            continue
        if not isinstance(value, torch.Tensor):
            arr = np.asarray(value)
            if arr.dtype == np.float64:  # python-format rows come back as float64 lists; stored as float32
                arr = arr.astype(np.float32)
            value = torch.from_numpy(arr) if arr.ndim else torch.as_tensor(arr)
        out[key] = value
    return out
