"""Tiny configs, random-weight models and a tiny tokenizer of every supported family (offline, CPU).

Configs are the smallest sensible versions of each family (built in well under a second); the tokenizer is
trained with `tokenizers` on generated text in a few milliseconds, its special tokens at fixed ids that every
config points at. Families: ``"text"`` (a Qwen2 causal LM), ``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"qwen3_vl"``,
``"internvl"``. Details: docs/data.md.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

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


def check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: expected one of {FAMILIES}")


def _qwen_vision(family: str, text: dict) -> dict:
    """The tiny vision config of a Qwen-VL family; sets its rotary sections on `text`."""
    if family == "qwen3_vl":
        text.update(head_dim=16)
        text["rope_parameters"] = {
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2], "mrope_interleaved": True,
        }
        return dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=256, deepstack_visual_indexes=[0],
        )
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
    return vision


def tiny_config(family: str, **overrides: Any):
    """Smallest sensible `PretrainedConfig` of a family (random-weight tests, demo).

    Decoder: hidden 64, 2 layers, 4 heads (2 KV heads), head_dim 16, vocab 512
    (the vocabulary of `build_tokenizer`). Vision towers: depth 1-2, hidden 32.
    VLMs get ``text_config.use_cache=False`` (otherwise the packing mask is
    silently skipped in training). Special-token ids match `build_tokenizer`.
    ``overrides`` are set on the top-level config; keys ``text_config`` /
    ``vision_config`` (dicts) are merged into the sub-configs.
    """
    check_family(family)
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
    elif family.startswith("qwen"):
        vision = _qwen_vision(family, text)
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
    check_family(family)
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
    check_family(family)
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
