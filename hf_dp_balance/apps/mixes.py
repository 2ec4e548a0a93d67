"""Realistic sample mixes of multimodal SFT (`MIXES`, drawn as `SampleShapes`), user lengths, fixed-length packing.

A sample is (text tokens, vision items with patch counts); its LLM length is text + patches / merge. Every
mix is a construction from published figures (shared/WORKLOAD_STATS.md), not a dump of any dataset; the
Qwen2-VL mixes draw the starting mix of `hf_dp_balance.testing.mix`. Sources and statistics: docs/simulator.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import numpy as np

from hf_dp_balance.testing.mix import (IMAGE_MAX, IMAGE_MEDIAN, IMAGE_MIN, IMAGE_SIGMA, MIX_FRACTIONS, MULTI_MEDIAN,
                                      MULTI_SIGMA, TEXT_MEDIAN, TEXT_SIGMA)

# Patches per LLM token: Qwen-VL's 2x2 spatial merge, InternVL's 0.5 pixel shuffle.
MERGE = 4


@dataclass(frozen=True)
class SampleShapes:
    """Column-wise samples: text tokens per sample plus vision items in CSR layout.

    ``item_patches[item_offsets[i]:item_offsets[i+1]]`` are the vision items
    (patch counts, one per vision-encoder attention block) of sample ``i``.
    """

    text_tokens: np.ndarray  # int64 [n]
    item_patches: np.ndarray  # int64 [items]
    item_offsets: np.ndarray  # int64 [n + 1]
    merge: int = MERGE

    def __post_init__(self) -> None:
        text = np.asarray(self.text_tokens, dtype=np.int64)
        patches = np.asarray(self.item_patches, dtype=np.int64)
        offsets = np.asarray(self.item_offsets, dtype=np.int64)
        if text.ndim != 1 or patches.ndim != 1 or offsets.shape != (text.size + 1,):
            raise ValueError(
                f"SampleShapes: text_tokens [n], item_patches [items], item_offsets [n+1] expected, "
                f"got {text.shape}, {patches.shape}, {offsets.shape}"
            )
        if offsets[0] != 0 or offsets[-1] != patches.size or np.any(np.diff(offsets) < 0):
            raise ValueError("SampleShapes.item_offsets must rise from 0 to the number of vision items")
        if text.size and text.min() < 0:
            i = int(np.argmin(text))
            raise ValueError(f"SampleShapes: sample {i} has text_tokens={text[i]} < 0")
        if patches.size and patches.min() <= 0:
            j = int(np.argmin(patches))
            i = int(np.searchsorted(offsets, j, side="right") - 1)
            raise ValueError(f"SampleShapes: sample {i} has a vision item of {patches[j]} patches (must be > 0)")
        if self.merge <= 0:
            raise ValueError(f"SampleShapes.merge={self.merge}: must be > 0")
        object.__setattr__(self, "text_tokens", text)
        object.__setattr__(self, "item_patches", patches)
        object.__setattr__(self, "item_offsets", offsets)

    def __len__(self) -> int:
        return int(self.text_tokens.size)

    @property
    def item_sample(self) -> np.ndarray:
        """Index of the sample owning each vision item (int64 [items])."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.item_offsets))

    @property
    def vision_tokens(self) -> np.ndarray:
        """LLM tokens of each sample's vision items (patches // merge, summed per sample)."""
        out = np.zeros(len(self), dtype=np.int64)
        np.add.at(out, self.item_sample, self.item_patches // self.merge)
        return out

    @property
    def tokens(self) -> np.ndarray:
        """LLM sequence length of each sample: text + vision tokens (int64 [n])."""
        return self.text_tokens + self.vision_tokens

    def take(self, index) -> "SampleShapes":
        """The samples at `index` (in that order), items carried along."""
        index = np.asarray(index, dtype=np.int64)
        counts = np.diff(self.item_offsets)[index]
        offsets = np.zeros(index.size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        starts = self.item_offsets[index]
        # Gather every item of every chosen sample: start of its sample + rank within it.
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
        items = self.item_patches[np.repeat(starts, counts) + within]
        return SampleShapes(self.text_tokens[index], items, offsets, self.merge)

    @classmethod
    def text_only(cls, lengths) -> "SampleShapes":
        """Text samples of these token lengths (no vision items)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return cls(lengths, np.zeros(0, dtype=np.int64), np.zeros(lengths.size + 1, dtype=np.int64))

    @classmethod
    def concat(cls, parts) -> "SampleShapes":
        """The samples of `parts` one after the other."""
        parts = list(parts)
        if not parts:
            return cls.text_only([])
        merge = parts[0].merge
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for p in parts:
            if p.merge != merge:
                raise ValueError(f"SampleShapes.concat: merge {p.merge} != {merge}")
            offsets.append(p.item_offsets[1:] + base)
            base += p.item_patches.size
        return cls(
            np.concatenate([p.text_tokens for p in parts]),
            np.concatenate([p.item_patches for p in parts]),
            np.concatenate(offsets),
            merge,
        )


# --------------------------------------------------------------------------- building blocks


def _lognormal(rng: np.random.Generator, median: float, sigma: float, size: int, lo: float, hi: float) -> np.ndarray:
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(size))), lo, hi).astype(np.int64)


def _assemble(text: np.ndarray, items_per_sample: np.ndarray, item_patches: np.ndarray) -> SampleShapes:
    offsets = np.zeros(text.size + 1, dtype=np.int64)
    np.cumsum(items_per_sample, out=offsets[1:])
    return SampleShapes(text, item_patches, offsets)


def _images_to_patches(tokens: np.ndarray) -> np.ndarray:
    """Qwen2-VL image of `tokens` LLM tokens -> patch count (MERGE patches per token)."""
    return np.maximum(tokens, 1) * MERGE


def _qwen2vl_mix(rng: np.random.Generator, n: int, *, tail_share: float, max_tokens: int) -> SampleShapes:
    """The starting mix of WORKLOAD_STATS.md (its figures: `hf_dp_balance.testing.mix`), with or without a long tail.

    Per sample (kinds drawn independently):
      text: lognormal(median 300, sigma 0.9) tokens (prompt + answer; captions ~200) in [8, 4096];
      35% text-only, 55% one image of clip(lognormal(median 700, sigma 0.6), 64, 16384) tokens
      (Qwen2-VL practical range 256..1280), 5% multi-image of 2..8 such images (MMDU-like:
      ~5K tokens on average), 5% video of 8..32 frames paired into 4..16 temporal slices of
      lognormal(median 5000, sigma 0.6) tokens in all (LLaVA-OV: 1.6K..6.3K per video).
      Long tail (`tail_share` of samples, long-SFT "thin tail up to the context length"): half
      long documents, half long videos, of uniform(16K, 32K) tokens in all.
    Samples are then truncated to `max_tokens` by dropping vision slices from the end (videos)
    and clipping text, as a max-length SFT pipeline does.
    """
    kind = rng.choice(4, size=n, p=list(MIX_FRACTIONS.values()))  # text, image, multi-image, video
    text = _lognormal(rng, TEXT_MEDIAN, TEXT_SIGMA, n, 8, 4096)
    n_items = np.where(kind == 1, 1, 0)
    n_items = np.where(kind == 2, rng.integers(2, 9, size=n), n_items)
    n_items = np.where(kind == 3, rng.integers(4, 17, size=n), n_items)
    video_total = _lognormal(rng, MULTI_MEDIAN, MULTI_SIGMA, n, 512, 16384)

    is_tail = rng.random(n) < tail_share
    tail_total = rng.integers(16384, 32769, size=n)
    tail_video = rng.random(n) < 0.5
    # Long document: all text. Long video: 16..64 slices, ~256 text tokens of question / timestamps.
    text = np.where(is_tail & ~tail_video, tail_total, np.where(is_tail & tail_video, 256, text))
    n_items = np.where(is_tail & tail_video, rng.integers(16, 65, size=n), np.where(is_tail, 0, n_items))
    kind = np.where(is_tail & tail_video, 3, np.where(is_tail, 0, kind))
    video_total = np.where(is_tail & tail_video, tail_total - 256, video_total)

    owner = np.repeat(np.arange(n), n_items)
    image_tokens = _lognormal(rng, IMAGE_MEDIAN, IMAGE_SIGMA, owner.size, IMAGE_MIN, IMAGE_MAX)
    slice_tokens = np.maximum(video_total[owner] // np.maximum(n_items[owner], 1), 16)
    item_tokens = np.where(kind[owner] == 3, slice_tokens, image_tokens)
    samples = _assemble(text, n_items, _images_to_patches(item_tokens))
    return truncate(samples, max_tokens)


def _internvl_mix(rng: np.random.Generator, n: int) -> SampleShapes:
    """InternVL 2.5-like SFT: tiles of 1024 patches (256 tokens), max sequence 8192.

    10% text-only; 70% one image of 1..12 tiles (dynamic resolution; skewed to few tiles:
    1 + binomial(11, 0.35)) plus a thumbnail tile when tiles > 1; 15% multi-image of 2..6
    images of 1..4 tiles each (InternVL's packed defaults expect ~6 images per 32K pack);
    5% video of 8..32 frames, one 448px tile (256 tokens) per frame. Text lognormal(median
    250, sigma 1.0). Truncated to 8192 tokens (its training max length).
    """
    kind = rng.choice(4, size=n, p=[0.10, 0.70, 0.15, 0.05])
    text = _lognormal(rng, 250, 1.0, n, 8, 6144)
    tiles_single = 1 + rng.binomial(11, 0.35, size=n)
    tiles_single = tiles_single + (tiles_single > 1)  # thumbnail
    n_images = rng.integers(2, 7, size=n)
    frames = rng.integers(8, 33, size=n)
    n_items = np.select([kind == 1, kind == 2, kind == 3], [tiles_single, 0, frames], 0)
    # Multi-image: each image 1..4 tiles; tiles are the vision items.
    multi_tiles = np.zeros(n, dtype=np.int64)
    m = np.flatnonzero(kind == 2)
    per_image = rng.integers(1, 5, size=int(n_images[m].sum()))
    multi_tiles[m] = np.add.reduceat(per_image, np.concatenate([[0], np.cumsum(n_images[m])[:-1]])) if m.size else 0
    n_items = np.where(kind == 2, multi_tiles, n_items)
    patches = np.full(int(n_items.sum()), 1024, dtype=np.int64)
    return truncate(_assemble(text, n_items, patches), 8192)


def _text_sft_mix(rng: np.random.Generator, n: int) -> SampleShapes:
    """Text-only SFT: Zipf-like lengths, lognormal(median 400, sigma 1.1) in [16, 32768]
    (NeMo-RL: Zipf-like; ChunkFlow: dominated by short sequences, thin tail to the context)."""
    return SampleShapes.text_only(_lognormal(rng, 400, 1.1, n, 16, 32768))


def truncate(samples: SampleShapes, max_tokens: int) -> SampleShapes:
    """Cut every sample to at most `max_tokens` LLM tokens.

    Vision items are dropped from the end of a sample until its vision tokens fit
    (a video keeps its first frames), then the text is clipped to the room left.
    """
    if max_tokens <= 0:
        raise ValueError(f"truncate: max_tokens={max_tokens} must be > 0")
    item_tokens = samples.item_patches // samples.merge
    owner = samples.item_sample
    # Cumulative vision tokens within each sample, item by item.
    csum = np.cumsum(item_tokens)
    start = np.concatenate([[0], csum])[samples.item_offsets[:-1]]
    within = csum - start[owner] if owner.size else csum
    keep = within <= max_tokens
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner[keep], minlength=len(samples)), out=offsets[1:])
    kept = SampleShapes(samples.text_tokens, samples.item_patches[keep], offsets, samples.merge)
    text = np.minimum(kept.text_tokens, max_tokens - kept.vision_tokens)
    return SampleShapes(text, kept.item_patches, kept.item_offsets, samples.merge)


# --------------------------------------------------------------------------- registry

MixFn = Callable[[np.random.Generator, int], SampleShapes]

MIXES: Dict[str, Tuple[MixFn, str]] = {
    "qwen2vl-sft": (
        lambda rng, n: _qwen2vl_mix(rng, n, tail_share=0.0, max_tokens=32768),
        "Qwen2-VL SFT, long tail: 35% text, 55% image, 5% multi-image, 5% video; lognormal tails up to 16K",
    ),
    "qwen2vl-sft-outliers": (
        lambda rng, n: _qwen2vl_mix(rng, n, tail_share=0.01, max_tokens=32768),
        "the same plus 1% long documents / videos of 16K..32K tokens (single samples bound the step)",
    ),
    "qwen2vl-sft-bounded": (
        lambda rng, n: _qwen2vl_mix(rng, n, tail_share=0.0, max_tokens=8192),
        "the same mix without the tail, nothing above 8K tokens",
    ),
    "internvl-sft": (_internvl_mix, "InternVL 2.5-like: 448px tiles of 256 tokens, 1..12 tiles + thumbnail, max 8K"),
    "text-sft": (_text_sft_mix, "text-only SFT, Zipf-like lengths up to 32K"),
}


def mix_names() -> Tuple[str, ...]:
    return tuple(MIXES)


def draw_mix(name: str, n: int, rng: np.random.Generator) -> SampleShapes:
    """`n` samples of the named mix, drawn with `rng` (deterministic for a seeded generator)."""
    if name not in MIXES:
        raise ValueError(f"--mix {name!r}: unknown; choose one of {', '.join(MIXES)} or lengths-from")
    if n < 0:
        raise ValueError(f"draw_mix: n={n} must be >= 0")
    return MIXES[name][0](rng, int(n))


# --------------------------------------------------------------------------- user lengths


def load_lengths(spec: str) -> np.ndarray:
    """A user's own sample lengths (tokens), as int64.

    ``spec`` is ``dataset:PATH:COLUMN`` (a `datasets` dataset saved with
    ``save_to_disk`` at PATH, or a local data file / folder that ``load_dataset``
    reads, with COLUMN holding lengths, or token lists whose lengths are taken)
    or the path of a text file with one length per line. Loads from disk only.
    """
    if spec.startswith("dataset:"):
        rest = spec[len("dataset:"):]
        path, sep, column = rest.rpartition(":")
        if not sep or not path or not column:
            raise ValueError(f"--lengths-from {spec!r}: expected dataset:PATH_OR_NAME:COLUMN")
        values = _dataset_column(path, column)
        source = f"column {column!r} of {path}"
    else:
        if not os.path.isfile(spec):
            raise ValueError(f"--lengths-from {spec!r}: no such file (or use dataset:PATH:COLUMN)")
        values = []
        with open(spec, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    values.append(float(line))
                except ValueError:
                    raise ValueError(f"--lengths-from {spec}: line {lineno} is not a number: {line!r}") from None
        source = spec
    lengths = np.asarray(values, dtype=np.float64)
    if lengths.size == 0:
        raise ValueError(f"--lengths-from: {source} holds no lengths")
    bad = np.flatnonzero(~np.isfinite(lengths) | (lengths < 1) | (lengths != np.round(lengths)))
    if bad.size:
        raise ValueError(f"--lengths-from: {source}, sample {int(bad[0])} has length {lengths[bad[0]]:g} (need an integer >= 1)")
    return lengths.astype(np.int64)


def _dataset_column(path: str, column: str):
    import datasets  # imported here: the simulator's other paths need no `datasets`

    if os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "state.json"))
        or os.path.exists(os.path.join(path, "dataset_dict.json"))
    ):
        ds = datasets.load_from_disk(path)
    elif os.path.exists(path):
        ds = datasets.load_dataset(path) if os.path.isdir(path) else datasets.load_dataset(
            _builder_for(path), data_files=path
        )
    else:
        raise ValueError(f"--lengths-from dataset:{path}:{column}: no such path (datasets are loaded from disk only)")
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if column not in ds.column_names:
        raise ValueError(f"--lengths-from dataset:{path}:{column}: no column {column!r}; columns are {ds.column_names}")
    values = ds[column]
    values = list(values) if not isinstance(values, list) else values
    if values and isinstance(values[0], (list, tuple, np.ndarray)):
        return [len(v) for v in values]  # token lists: their lengths
    return values


def _builder_for(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "txt": "text", "arrow": "arrow"}.get(ext, ext)


# --------------------------------------------------------------------------- packing


def pack_fixed_length(tokens: np.ndarray, pack: int) -> np.ndarray:
    """Greedy fixed-length packing in arrival order: pack index of every sample (int64).

    Samples are appended to the current pack while they fit into `pack`
    tokens; the first that does not fit opens the next pack (the rest of the
    current one is padding). This is what fixed-length packing does, and why
    packs hold equal tokens but unequal compute. A sample longer than `pack`
    is an error: truncate first (`truncate`).
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if pack <= 0:
        raise ValueError(f"--pack {pack}: must be > 0")
    over = np.flatnonzero(tokens > pack)
    if over.size:
        raise ValueError(f"pack_fixed_length: sample {int(over[0])} has {tokens[over[0]]} tokens > pack {pack}")
    # Sequential by nature; a plain loop over ints is ~0.2 us per sample.
    pack_of = np.empty(tokens.size, dtype=np.int64)
    current, used = 0, 0
    for i, t in enumerate(tokens.tolist()):
        if used + t > pack:
            current, used = current + 1, 0
        used += t
        pack_of[i] = current
    return pack_of
