"""Per-sample features and packing of multimodal samples into one row (the way back: core/unpacking.py).

Families (from ``model_config.model_type``): ``qwen2_vl``, ``qwen2_5_vl``,
``qwen3_vl``, ``internvl``, and any plain causal LM (``text``).

A packed row is what ``model(**batch)`` trains on in transformers 5.x with
batch size 1 and no ``attention_mask``: transformers detects the sample
boundaries from ``position_ids`` restarting at 0
(`masking_utils.find_packed_sequence_indices`) and builds a block-diagonal
causal mask (sdpa / eager / flex) or varlen lengths (flash attention).

- text / InternVL: ``position_ids`` [1, T], restarting at 0 per sample.
- Qwen-VL: ``position_ids`` [4, 1, T]: row 0 the plain per-sample positions
  (the packing signal), rows 1-3 the mrope positions of each sample computed
  by the model class's own ``get_rope_index`` on that sample alone. A
  [3, 1, T] tensor would silently disable the packing mask.
- The first label of every sample is -100, so that the last token of one
  sample never learns to predict the first token of the next (unpacked, that
  label is never a target either: causal LM losses shift labels by one).
- Pixels are concatenated in sample order (``pixel_values``,
  ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
  ``second_per_grid_ts`` for Qwen2.5-VL videos when given).
- A VLM row with no image or video ends with a dummy image segment (labels
  -100; `core.dummy_vision`) so the vision tower runs on every rank.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from hf_dp_balance.core.dummy_vision import dummy_vision_sample, needs_dummy_vision
from hf_dp_balance.core.families import IGNORE_INDEX, QWEN_FAMILIES

FAMILIES = ("text",) + QWEN_FAMILIES + ("internvl",)

# Per-sample tensors by family: what a sample carries and what has to travel
# when a sample moves to another rank. Anything else in a sample dict (an
# all-ones attention_mask, a sample_id, ...) is not part of the packed row.
SAMPLE_TENSOR_KEYS: dict[str, tuple[str, ...]] = {
    "text": ("input_ids", "labels"),
    "qwen2_vl": ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                 "pixel_values_videos", "video_grid_thw"),
    "qwen2_5_vl": ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                   "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
    "qwen3_vl": ("input_ids", "labels", "mm_token_type_ids", "pixel_values", "image_grid_thw",
                 "pixel_values_videos", "video_grid_thw"),
    "internvl": ("input_ids", "labels", "pixel_values"),
}
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "text": ("input_ids", "labels"),
    "qwen2_vl": ("input_ids", "labels", "mm_token_type_ids"),
    "qwen2_5_vl": ("input_ids", "labels", "mm_token_type_ids"),
    "qwen3_vl": ("input_ids", "labels", "mm_token_type_ids"),
    "internvl": ("input_ids", "labels"),
}
# Attention implementations that see sample boundaries in a packed row with no
# attention_mask (mask built from position_ids, or varlen from position_ids).
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def family_of(model_config) -> str:
    """The packing family of a model config: a Qwen-VL type, ``internvl``, or ``text`` for causal LMs."""
    model_type = getattr(model_config, "model_type", None)
    if model_type in QWEN_FAMILIES or model_type == "internvl":
        return model_type
    if hasattr(model_config, "vision_config"):
        raise ValueError(
            f"model_type={model_type!r} is a multimodal model this library does not pack; "
            f"supported: {FAMILIES[1:]} and plain causal LMs"
        )
    return "text"


def sample_tensor_keys(model_config) -> tuple[str, ...]:
    """Keys of a per-sample dict that are tensors belonging to the sample (to ship between ranks)."""
    return SAMPLE_TENSOR_KEYS[family_of(model_config)]


@dataclass(frozen=True)
class SampleFeatures:
    """What the planner and the cost models need of one sample, known without running the model.

    tokens: decoder tokens (length of ``input_ids``).
    vision_items: one entry per vision-encoder input item, in sample order
        (images first, then videos). Qwen-VL: patch rows t*h*w of each image /
        video (``pixel_values`` rows). InternVL: one entry per tile (the ViT
        encodes every tile on its own), each (tile_size / patch_size)^2 patches.
    vision_seqlens: the attention sequences of the vision encoder: Qwen-VL
        attends within one temporal patch, so an image/video contributes t
        sequences of h*w; InternVL one sequence of patches + 1 (CLS) per tile.
        The encoder's attention cost is sum(seqlen^2).
    label_tokens: tokens that are loss targets (labels[1:] != -100; the
        first label is never a target).
    """

    tokens: int
    vision_items: tuple[int, ...] = ()
    vision_seqlens: tuple[int, ...] = ()
    label_tokens: int = 0


def _present(sample: Mapping[str, Any], key: str) -> bool:
    return sample.get(key) is not None


def _internvl_tile_patches(model_config) -> int:
    vc = model_config.vision_config
    size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
    patch = vc.patch_size[0] if isinstance(vc.patch_size, (list, tuple)) else vc.patch_size
    return (size // patch) ** 2


def _validate(sample: Mapping[str, Any], family: str, model_config, index: int) -> None:
    """Raise ValueError naming the sample index and the key when a sample cannot be packed correctly."""

    def bad(key: str, why: str):
        raise ValueError(f"sample {index}: key {key!r}: {why}")

    if not isinstance(sample, Mapping):
        raise ValueError(f"sample {index}: expected a dict of tensors, got {type(sample).__name__}")
    for key in REQUIRED_KEYS[family]:
        if not _present(sample, key):
            bad(key, f"missing (a {family} sample needs {REQUIRED_KEYS[family]})")
    for key in SAMPLE_TENSOR_KEYS[family]:
        if _present(sample, key) and not isinstance(sample[key], torch.Tensor):
            bad(key, f"expected a torch.Tensor, got {type(sample[key]).__name__} (see data.to_sample)")
    ids = sample["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.numel() == 0:
        bad("input_ids", f"expected a non-empty 1-D tensor, got {getattr(ids, 'shape', type(ids))}")
    n = ids.numel()
    for key in ("labels", "mm_token_type_ids"):
        if _present(sample, key):
            t = sample[key]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
                bad(key, f"expected a 1-D tensor of {n} entries like input_ids, got {getattr(t, 'shape', type(t))}")
    mask = sample.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        bad("attention_mask", "has zeros: packed samples must be unpadded")

    if family in QWEN_FAMILIES:
        merge2 = model_config.vision_config.spatial_merge_size ** 2
        types = sample["mm_token_type_ids"]
        for kind, tok_id, type_id, pix_key, grid_key in (
            ("image", model_config.image_token_id, 1, "pixel_values", "image_grid_thw"),
            ("video", model_config.video_token_id, 2, "pixel_values_videos", "video_grid_thw"),
        ):
            is_tok = ids == tok_id
            placeholders = int(is_tok.sum())
            if not torch.equal(is_tok, types == type_id):
                bad("mm_token_type_ids", f"must be {type_id} exactly at the {kind} placeholder tokens (id {tok_id})")
            if placeholders == 0:
                if _present(sample, pix_key) or _present(sample, grid_key):
                    bad(pix_key, f"{kind} pixels given but input_ids has no {kind} placeholder (id {tok_id})")
                continue
            for key in (pix_key, grid_key):
                if not _present(sample, key):
                    bad(key, f"missing: input_ids has {placeholders} {kind} placeholder tokens")
            grid = sample[grid_key]
            if grid.ndim != 2 or grid.shape[1] != 3:
                bad(grid_key, f"expected shape [n, 3], got {tuple(grid.shape)}")
            rows = int(grid.prod(dim=1).sum())
            if rows // merge2 != placeholders or rows % merge2:
                bad(grid_key, f"{kind} grids need {rows // merge2} placeholder tokens, input_ids has {placeholders}")
            if sample[pix_key].ndim != 2 or sample[pix_key].shape[0] != rows:
                bad(pix_key, f"expected {rows} patch rows (sum of t*h*w of {grid_key}), got {tuple(sample[pix_key].shape)}")
        if _present(sample, "second_per_grid_ts"):
            if not _present(sample, "video_grid_thw") or sample["second_per_grid_ts"].numel() != sample["video_grid_thw"].shape[0]:
                bad("second_per_grid_ts", "needs one entry per video of video_grid_thw")
    elif family == "internvl":
        placeholders = int((ids == model_config.image_token_id).sum())
        per_tile = model_config.image_seq_length
        pix = sample.get("pixel_values")
        tiles = 0 if pix is None else pix.shape[0]
        if pix is not None and pix.ndim != 4:
            bad("pixel_values", f"expected tiles [n, 3, S, S], got {tuple(pix.shape)}")
        if placeholders != tiles * per_tile:
            key = "pixel_values" if placeholders else "input_ids"
            bad(key, f"{tiles} tiles need {tiles * per_tile} <IMG_CONTEXT> tokens "
                     f"(image_seq_length {per_tile}), input_ids has {placeholders}")


def sample_features(sample: Mapping[str, Any], model_config, *, index: int = 0) -> SampleFeatures:
    """Tokens, vision items and label count of one sample, from shapes only (no model run).

    Validates the sample like the collator does (``index`` names it in errors).
    """
    family = family_of(model_config)
    _validate(sample, family, model_config, index)
    ids = sample["input_ids"]
    labels = sample["labels"]
    label_tokens = int((labels[1:] != IGNORE_INDEX).sum())
    items: list[int] = []
    seqlens: list[int] = []
    if family in QWEN_FAMILIES:
        for key in ("image_grid_thw", "video_grid_thw"):
            if _present(sample, key):
                for t, h, w in sample[key].tolist():
                    items.append(t * h * w)
                    seqlens.extend([h * w] * t)
    elif family == "internvl" and _present(sample, "pixel_values"):
        per_tile = _internvl_tile_patches(model_config)
        tiles = sample["pixel_values"].shape[0]
        items = [per_tile] * tiles
        seqlens = [per_tile + 1] * tiles
    return SampleFeatures(tokens=int(ids.numel()), vision_items=tuple(items),
                          vision_seqlens=tuple(seqlens), label_tokens=label_tokens)


class _RopeIndex:
    """The model class's own `get_rope_index`, called without building a model.

    It reads only ``self.config`` and ``self.get_vision_position_ids``; calling the
    real method keeps the collator's mrope positions identical to what the
    model computes for the same sample on its own.
    """

    def __init__(self, family: str, model_config):
        import transformers

        self.cls = {
            "qwen2_vl": transformers.Qwen2VLModel,
            "qwen2_5_vl": transformers.Qwen2_5_VLModel,
            "qwen3_vl": transformers.Qwen3VLModel,
        }[family]
        self.config = model_config

    def get_vision_position_ids(self, *args, **kwargs):
        return self.cls.get_vision_position_ids(self, *args, **kwargs)

    def __call__(self, sample: Mapping[str, Any]) -> torch.Tensor:
        """[3, L] mrope positions of one sample."""
        kwargs = {}
        for key in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts"):
            if _present(sample, key):
                kwargs[key] = sample[key]
        if "second_per_grid_ts" in kwargs and self.cls.__name__ != "Qwen2_5_VLModel":
            kwargs.pop("second_per_grid_ts")
        pos, _ = self.cls.get_rope_index(
            self, sample["input_ids"][None], mm_token_type_ids=sample["mm_token_type_ids"][None], **kwargs
        )
        return pos[:, 0]


class PackedCollator:
    """Packs a list of per-sample dicts into one row (batch size 1) that ``model(**batch)`` trains on.

    ``model_config``: the model's config (family from ``model_type``). For a
    VLM whose ``text_config.use_cache`` is True the packing mask would be
    silently skipped; with ``fix_config=True`` (default) the collator sets it
    to False (with a warning), else it raises. ``max_tokens``: hard cap of the
    packed row; a longer sample or pack raises ValueError.

    Output keys: ``input_ids`` [1, T], ``labels`` [1, T], ``position_ids``
    ([1, T], Qwen-VL [4, 1, T]), Qwen-VL ``mm_token_type_ids`` [1, T], and the
    pixel keys of the family when any sample has them. Never
    ``attention_mask``: its presence disables packing detection.

    ``dummy_vision`` (default True; only VLM families): a row with no image and
    no video gets a last segment holding the family's smallest image, all labels
    -100 (`core.dummy_vision`), so the vision tower runs forward and backward on
    every rank (all ranks then reach the same collectives) while loss, gradients and ``num_items_in_batch``
    stay exactly the same. Its few tokens are not counted against ``max_tokens``.

    ``collator([])`` returns a valid no-op row: one pad token (VLMs with
    ``dummy_vision``: the dummy segment instead), labels -100. With the
    Trainer's ``num_items_in_batch`` its loss is exactly 0 (a plain mean over
    zero targets would be NaN).
    """

    def __init__(self, model_config, *, max_tokens: Optional[int] = None, fix_config: bool = True,
                 pad_token_id: Optional[int] = None, dummy_vision: bool = True):
        self.config = model_config
        self.family = family_of(model_config)
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: must be >= 1")
        self.max_tokens = max_tokens
        ensure_packing_config(model_config, fix=fix_config)
        text_cfg = getattr(model_config, "text_config", model_config)
        if pad_token_id is None:
            pad_token_id = getattr(text_cfg, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(model_config, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else 0
        self._rope = _RopeIndex(self.family, model_config) if self.family in QWEN_FAMILIES else None
        self.dummy_vision = dummy_vision_sample(model_config, self.family) if dummy_vision else None

    def features(self, sample: Mapping[str, Any], index: int = 0) -> SampleFeatures:
        return sample_features(sample, self.config, index=index)

    def _empty(self) -> dict:
        ids = torch.tensor([[self.pad_token_id]], dtype=torch.long)
        batch = {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}
        if self.family in QWEN_FAMILIES:
            batch["position_ids"] = torch.zeros(4, 1, 1, dtype=torch.long)
            batch["mm_token_type_ids"] = torch.zeros_like(ids)
        else:
            batch["position_ids"] = torch.zeros_like(ids)
        return batch

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict:
        samples = list(samples)
        self._check_samples(samples)
        if self.dummy_vision is not None and needs_dummy_vision(samples):
            samples.append(self.dummy_vision)  # after the cap check: the dummy is not the user's data
        if not samples:
            return self._empty()
        return self._pack(samples)

    def _check_samples(self, samples: list) -> None:
        """Validate each sample and the hard token cap (ValueError naming the sample and the key)."""
        total = 0
        for i, s in enumerate(samples):
            _validate(s, self.family, self.config, i)
            n = s["input_ids"].numel()
            if self.max_tokens is not None and n > self.max_tokens:
                raise ValueError(f"sample {i}: key 'input_ids': {n} tokens exceed max_tokens={self.max_tokens}")
            total += n
        if self.max_tokens is not None and total > self.max_tokens:
            raise ValueError(f"pack of {len(samples)} samples: key 'input_ids': {total} tokens "
                             f"exceed max_tokens={self.max_tokens}")

    def _pack(self, samples: list) -> dict:
        """The packed row of validated samples (see the class docstring)."""
        labels = []
        for s in samples:
            lab = s["labels"].clone()
            lab[0] = IGNORE_INDEX  # the previous sample's last token must not learn this sample's first
            labels.append(lab)
        batch = {
            "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
            "labels": torch.cat(labels)[None].to(torch.long),
        }
        plain = torch.cat([torch.arange(s["input_ids"].numel()) for s in samples])
        if self.family in QWEN_FAMILIES:
            mrope = torch.cat([self._rope(s) for s in samples], dim=1)
            batch["position_ids"] = torch.cat([plain[None], mrope.to(plain.dtype)], dim=0)[:, None, :]
            batch["mm_token_type_ids"] = torch.cat([s["mm_token_type_ids"] for s in samples])[None]
        else:
            batch["position_ids"] = plain[None]
        for key in _pixel_keys(self.family):
            parts = [s[key] for s in samples if _present(s, key)]
            if parts:
                batch[key] = torch.cat(parts)
        if "second_per_grid_ts" in batch:
            with_video = [i for i, s in enumerate(samples) if _present(s, "video_grid_thw")]
            missing = [i for i in with_video if not _present(samples[i], "second_per_grid_ts")]
            if missing:
                raise ValueError(f"sample {missing[0]}: key 'second_per_grid_ts': missing while other "
                                 f"video samples of the pack have it (give it for all videos or none)")
        return batch

    def check_model(self, model, *, fix: bool = True) -> None:
        """The guard against silent failure: see `ensure_packing_support`."""
        ensure_packing_support(model, fix=fix)


def _pixel_keys(family: str) -> tuple[str, ...]:
    return tuple(k for k in SAMPLE_TENSOR_KEYS[family] if k not in ("input_ids", "labels", "mm_token_type_ids"))


def ensure_packing_config(model_config, *, fix: bool = True) -> None:
    """The language model's ``use_cache`` (VLMs: ``text_config.use_cache``; Trainer only sets the
    top-level flag) must be False: with it True the model builds a cache in training, and with a cache
    transformers skips the packing mask without a word, so the samples of a pack attend to each other.
    ``fix=True`` sets it to False (with a warning); ``fix=False`` raises ValueError naming the fix."""
    name = "config.text_config" if hasattr(model_config, "text_config") else "config"
    cfg = getattr(model_config, "text_config", model_config)
    if not getattr(cfg, "use_cache", False):
        return
    if not fix:
        raise ValueError(f"model {name}.use_cache=True: the packed attention mask is skipped when a cache "
                         f"exists, so packed samples would attend to each other. Set "
                         f"model.{name}.use_cache = False before training.")
    warnings.warn(f"hf_dp_balance: setting model {name}.use_cache=False (packing needs it; "
                  f"with a cache the packed mask is silently skipped)", stacklevel=3)
    cfg.use_cache = False


def ensure_packing_support(model, *, fix: bool = True, extra_attention: Sequence[str] = ()) -> None:
    """Refuse silent failure of packing on `model`.

    - ``use_cache`` left True on the (text) config: set to False when ``fix``, else raise.
    - an attention implementation that cannot see sample boundaries from
      ``position_ids`` (anything but sdpa / eager / flex / flash-attention, or
      the names in ``extra_attention``, e.g. a registered varlen attention):
      raise ValueError naming the fix.
    """
    config = model.config
    family_of(config)
    ensure_packing_config(config, fix=fix)
    allowed = set(PACKING_ATTENTION) | set(extra_attention)
    text_cfg = getattr(config, "text_config", config)
    impl = getattr(text_cfg, "_attn_implementation", None) or getattr(config, "_attn_implementation", None)
    if impl is not None and impl not in allowed and not impl.startswith("hf_dp_balance"):
        raise ValueError(
            f"attention implementation {impl!r} of the language model cannot see packed sample boundaries; "
            f"load the model with attn_implementation in {sorted(allowed)} (or register hf_dp_balance's varlen "
            f"attention) before training on packed rows"
        )
