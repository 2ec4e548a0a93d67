"""Tiny models, tokenizers and a realistic synthetic multimodal dataset.

Everything here runs offline on CPU: configs are the smallest sensible
versions of each supported family (random weights, built in well under a
second), the tokenizer is trained with `tokenizers` on generated text in a few
milliseconds, and images are drawn with Pillow and passed through the family's
real `*ImageProcessorPil`.

Families: ``"text"`` (a Qwen2 causal LM), ``"qwen2_vl"``, ``"qwen2_5_vl"``,
``"qwen3_vl"``, ``"internvl"``.
"""

from __future__ import annotations

import functools
import math
import tempfile
from typing import Any, Iterator, Optional

import numpy as np

from hf_dp_balance.testing.mix import (  # noqa: F401  (re-exported: the dataset's mix)
    BOUNDED_MAX, DEFAULT_SCALE, IMAGE_MAX, LONG_TAIL_FRACTION, MIX_FRACTIONS, PACK_TOKENS, REGIMES, pack_and_cap,
    plan_samples,
)

FAMILIES = ("text", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")

# One vocabulary for every family: the special tokens come first, so their ids
# are fixed (the trainer of `tokenizers` assigns special tokens ids 0..k-1 in
# order) and every config below points at the same ids.
SPECIAL_TOKENS = (
    "<pad>",  # 0
    "<eos>",  # 1
    "<bos>",  # 2
    "<|vision_start|>",  # 3  Qwen-VL
    "<|vision_end|>",  # 4
    "<|image_pad|>",  # 5  Qwen-VL image placeholder
    "<|video_pad|>",  # 6  Qwen-VL video placeholder
    "<img>",  # 7  InternVL
    "</img>",  # 8
    "<IMG_CONTEXT>",  # 9  InternVL image placeholder
    "<video>",  # 10 InternVL video marker (unused by the tiny configs)
)
TOKEN_IDS = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
PAD_ID = TOKEN_IDS["<pad>"]
EOS_ID = TOKEN_IDS["<eos>"]
BOS_ID = TOKEN_IDS["<bos>"]
VISION_START_ID = TOKEN_IDS["<|vision_start|>"]
VISION_END_ID = TOKEN_IDS["<|vision_end|>"]
IMAGE_PAD_ID = TOKEN_IDS["<|image_pad|>"]
VIDEO_PAD_ID = TOKEN_IDS["<|video_pad|>"]
IMG_START_ID = TOKEN_IDS["<img>"]
IMG_END_ID = TOKEN_IDS["</img>"]
IMG_CONTEXT_ID = TOKEN_IDS["<IMG_CONTEXT>"]
VOCAB_SIZE = 512

# Tiny InternVL tile: 56x56 pixels, patch 14 -> 4x4 patches -> pixel shuffle
# (downsample 0.5) -> 4 tokens per tile. Real InternVL: 448 px, 256 tokens.
INTERNVL_TILE = 56
INTERNVL_PATCH = 14
INTERNVL_TOKENS_PER_TILE = (INTERNVL_TILE // INTERNVL_PATCH) ** 2 // 4


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {FAMILIES}")


def tiny_config(family: str, **overrides: Any):
    """Smallest sensible `PretrainedConfig` of a family (random-weight tests, demo).

    Decoder: hidden 64, 2 layers, 4 heads (2 KV heads), head_dim 16, vocab 512
    (the vocabulary of `build_tokenizer`). Vision towers: depth 1-2, hidden 32.
    VLMs get ``text_config.use_cache=False`` (otherwise the packing mask is
    silently skipped in training). Special-token ids match `build_tokenizer`.
    ``overrides`` are set on the top-level config; keys ``text_config`` /
    ``vision_config`` (dicts) are merged into the sub-configs.
    """
    _check_family(family)
    from transformers import AutoConfig

    text_over = dict(overrides.pop("text_config", {}) or {})
    vision_over = dict(overrides.pop("vision_config", {}) or {})
    text = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        use_cache=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        tie_word_embeddings=False,
    )
    if family == "text":
        cfg = AutoConfig.for_model("qwen2", **{**text, **text_over})
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        # head_dim 16 -> 8 rotary frequencies split t/h/w as 2/3/3
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        vision = dict(depth=1, hidden_size=64, num_heads=2, patch_size=14, temporal_patch_size=2, spatial_merge_size=2)
        if family == "qwen2_vl":
            vision.update(embed_dim=32, mlp_ratio=2)
        else:
            vision.update(
                depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64,
                window_size=56, fullatt_block_indexes=[1], tokens_per_second=2,
            )
    elif family == "qwen3_vl":
        text.update(head_dim=16)
        text["rope_parameters"] = {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
        }
        vision = dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=256, deepstack_visual_indexes=[0],
        )
    if family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        cfg = AutoConfig.for_model(
            family,
            text_config={**text, **text_over},
            vision_config={**vision, **vision_over},
            image_token_id=IMAGE_PAD_ID,
            video_token_id=VIDEO_PAD_ID,
            vision_start_token_id=VISION_START_ID,
            vision_end_token_id=VISION_END_ID,
        )
    elif family == "internvl":
        text.update(model_type="qwen2")
        vision = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=INTERNVL_TILE, patch_size=INTERNVL_PATCH,
        )
        cfg = AutoConfig.for_model(
            family,
            text_config={**text, **text_over},
            vision_config={**vision, **vision_over},
            image_token_id=IMG_CONTEXT_ID,
            image_seq_length=INTERNVL_TOKENS_PER_TILE,
            downsample_ratio=0.5,
            tie_word_embeddings=False,
        )
    for key, value in overrides.items():
        setattr(cfg, key, value)
    if family != "text":
        cfg.text_config.use_cache = False
    cfg.use_cache = False
    return cfg


def model_class(family: str):
    """The transformers class that trains a family (causal LM head)."""
    _check_family(family)
    import transformers

    return {
        "text": transformers.Qwen2ForCausalLM,
        "qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "internvl": transformers.InternVLForConditionalGeneration,
    }[family]


def make_model(family: str, seed: int = 0, *, dtype=None, attn_implementation: str = "sdpa", **overrides: Any):
    """A tiny random-weight model of `family` (deterministic by `seed`), in train mode.

    ``dtype``: e.g. ``torch.float64`` for exact-equivalence tests (default float32).
    ``overrides`` go to `tiny_config`.
    """
    import torch

    cfg = tiny_config(family, **overrides)
    cfg._attn_implementation = attn_implementation
    for sub in ("text_config", "vision_config"):
        if hasattr(cfg, sub):
            getattr(cfg, sub)._attn_implementation = attn_implementation
    gen = torch.random.fork_rng(devices=[])
    with gen:
        torch.manual_seed(seed)
        model = model_class(family)(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.train()
    return model


# ---------------------------------------------------------------- tokenizer

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "de", "fi", "go", "ha", "ju",
    "an", "el", "in", "or", "us", "th", "st", "ch", "re", "co", "la", "be", "ta", "mo", "ni", "se",
)


def _word_list(rng: np.random.Generator, n: int) -> list[str]:
    """Pseudo-words of 1-4 syllables (Zipf-like reuse makes BPE merges meaningful)."""
    sylls = np.array(_SYLLABLES)
    lengths = rng.integers(1, 5, size=n)
    return ["".join(rng.choice(sylls, size=k)) for k in lengths]


@functools.lru_cache(maxsize=1)
def _words() -> tuple[str, ...]:
    return tuple(_word_list(np.random.default_rng(1234), 600))


def random_text(rng: np.random.Generator, n_words: int) -> str:
    """`n_words` pseudo-words drawn Zipf-like from a fixed 600-word list."""
    words = _words()
    ranks = np.minimum(rng.zipf(1.3, size=n_words), len(words)) - 1
    return " ".join(words[r] for r in ranks)


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    # Cached as JSON (immutable) so every call returns a fresh tokenizer object.
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False, min_frequency=2,
    )
    rng = np.random.default_rng(0)
    corpus = [random_text(rng, 50) for _ in range(400)] + [" ".join(_words())]
    tok.train_from_iterator(corpus, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:  # the fixed-id contract every tiny config relies on
            raise RuntimeError(f"tokenizer trainer put {t!r} at id {tok.token_to_id(t)}, expected {i}")
    return tok.to_str()


def build_tokenizer(family: str = "text"):
    """A tiny fast tokenizer (BPE, vocab <= 512) with the family's special tokens at the ids `tiny_config` uses.

    The vocabulary is shared by all families: ids 0..10 are `SPECIAL_TOKENS`
    (pad, eos, bos, Qwen-VL vision_start/end, image_pad, video_pad, InternVL
    <img>, </img>, <IMG_CONTEXT>, <video>). For InternVL the tokenizer carries
    the ``start_image_token`` / ``end_image_token`` / ``context_image_token``
    attributes its processor reads; for Qwen-VL ``image_token`` /
    ``video_token`` / ``vision_start_token`` / ``vision_end_token``.
    """
    _check_family(family)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
    )
    if family.startswith("qwen"):
        tok.image_token, tok.video_token = "<|image_pad|>", "<|video_pad|>"
        tok.vision_start_token, tok.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        tok.image_token_id, tok.video_token_id = IMAGE_PAD_ID, VIDEO_PAD_ID
    elif family == "internvl":
        tok.start_image_token, tok.end_image_token = "<img>", "</img>"
        tok.context_image_token, tok.video_token = "<IMG_CONTEXT>", "<video>"
        tok.start_image_token_id, tok.end_image_token_id = IMG_START_ID, IMG_END_ID
        tok.context_image_token_id = IMG_CONTEXT_ID
    return tok


# ---------------------------------------------------------------- synthetic dataset
# The mix's figures and each sample's shape: `hf_dp_balance.testing.mix` (re-exported here).


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
    _check_family(family)
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
    _check_family(family)
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
    _check_family(family)
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
