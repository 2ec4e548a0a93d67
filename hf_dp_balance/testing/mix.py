"""Every sample mix of this project, defined once (pure numpy, deterministic by seed).

The starting mix of multimodal SFT (shared/WORKLOAD_STATS.md): its published figures, the per-sample shapes
of the synthetic dataset (`plan_samples`), and the simulator's named mixes drawn column-wise for a million
samples (`MIXES`, `draw_mix`, as `SampleShapes`), with truncation and fixed-length packing. Where the
dataset's and the simulator's Qwen2-VL generators differ (several images per sample, the long tail) and why:
docs/data.md. Sources and statistics of the named mixes: docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import numpy as np

# The figures (a construction from published figures, not a published mix itself):
#   text per sample ~ lognormal(median 300 tokens, sigma 0.9)
#     [ShareGPT4V captions ~200 tokens; Zipf-like SFT lengths, NeMo-RL docs]
#   35% text-only                       [llava_v1_5_mix665k has ~6% text-only;
#                                         we keep more to exercise mixed packs]
#   55% one image of clip(lognormal(median 700, sigma 0.6), 64, 16384) tokens
#     [Qwen2-VL model card: 256..1280 practical range, 4..16384 allowed]
#   10% video or several images, lognormal(median 5000, sigma 0.6) vision tokens
#     [LLaVA-OneVision video 1.6K..6.3K tokens; MMDU-45k multi-image 5K mean]
#   packs of 32768 tokens [InternVL packed-dataset default max_packed_tokens]
MIX_FRACTIONS = {"text": 0.35, "image": 0.55, "multi_image": 0.05, "video": 0.05}
TEXT_MEDIAN, TEXT_SIGMA = 300.0, 0.9
IMAGE_MEDIAN, IMAGE_SIGMA, IMAGE_MIN, IMAGE_MAX = 700.0, 0.6, 64, 16384
MULTI_MEDIAN, MULTI_SIGMA = 5000.0, 0.6
PACK_TOKENS = 32768
BOUNDED_MAX = 8192
LONG_TAIL_FRACTION = 0.01
DEFAULT_SCALE = 1.0 / 16.0
# The dataset's two regimes: "bounded" (no sample above 8192 tokens: InternVL 2.5 trains at max
# length 8192) and "long_tail" (additionally ~1% of samples at 75-95% of the pack length
# [ChunkFlow: a thin tail up to the context length]). Every token count is multiplied by `scale`
# so tiny models train on CPU. (The simulator's named mixes are `MIXES` below.)
REGIMES = ("long_tail", "bounded")


def pack_and_cap(mix: str, scale: float, max_tokens: Optional[int]) -> tuple[int, int]:
    """(pack length, longest allowed sample) in tokens."""
    pack = int(max_tokens) if max_tokens is not None else int(round(PACK_TOKENS * scale))
    cap = min(pack, int(round(BOUNDED_MAX * scale))) if mix == "bounded" else pack
    return pack, cap


def plan_samples(num_samples: int, *, seed: int = 0, mix: str = "long_tail", scale: float = DEFAULT_SCALE,
                 max_tokens: Optional[int] = None) -> list[dict]:
    """The shape of each synthetic sample, before rendering (pure numpy, deterministic by seed).

    Returns dicts with ``kind`` ("text" | "image" | "multi_image" | "video"),
    ``text_tokens`` and ``vision_tokens`` (a list, LLM tokens per image, or per
    video; already scaled). The budget of a sample (text + vision) never
    exceeds ``max_tokens`` (default: the pack length 32768 * scale); with
    ``mix="bounded"`` it never exceeds 8192 * scale either.
    """
    if mix not in REGIMES:
        raise ValueError(f"mix={mix!r}: expected one of {REGIMES}")
    if not (0 < scale <= 1):
        raise ValueError(f"scale={scale!r}: expected 0 < scale <= 1")
    pack, cap = pack_and_cap(mix, scale, max_tokens)
    rng = np.random.default_rng(seed)
    kinds = list(MIX_FRACTIONS)
    probs = np.array([MIX_FRACTIONS[k] for k in kinds])
    out = []
    for _ in range(num_samples):
        kind = kinds[rng.choice(len(kinds), p=probs)]
        text = max(4, int(round(rng.lognormal(np.log(TEXT_MEDIAN), TEXT_SIGMA) * scale)))
        vision: list[int] = []
        if kind == "image":
            vision = [int(np.clip(rng.lognormal(np.log(IMAGE_MEDIAN), IMAGE_SIGMA), IMAGE_MIN, IMAGE_MAX) * scale)]
        elif kind in ("multi_image", "video"):
            total = rng.lognormal(np.log(MULTI_MEDIAN), MULTI_SIGMA) * scale
            if kind == "multi_image":
                k = int(rng.integers(2, 7))
                vision = [int(v) for v in total * rng.dirichlet(np.full(k, 4.0))]
            else:
                vision = [int(total)]
        long_tail = mix == "long_tail" and rng.random() < LONG_TAIL_FRACTION
        if long_tail:  # a long document or a long video, near the pack length
            target = int(rng.uniform(0.75, 0.95) * pack)
            if kind in ("text", "image"):
                text = max(text, target - sum(vision))
            else:  # stretch text and vision together
                f = target / max(1, text + sum(vision))
                text = max(4, int(text * f))
                vision = [max(1, int(v * f)) for v in vision]
        budget = text + sum(vision)
        if budget > cap:  # shrink proportionally into the cap
            f = cap / budget
            vision = [max(1, int(v * f)) for v in vision]
            text = max(1, min(int(text * f), cap - sum(vision)))
        out.append({"kind": kind, "text_tokens": text, "vision_tokens": [max(1, v) for v in vision],
                    "long_tail": bool(long_tail)})
    return out


# --------------------------------------------------------------------------- the simulator's mixes

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
    """The starting mix of WORKLOAD_STATS.md (its figures above), with or without a long tail.

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


def fixed_length_step(rng: np.random.Generator, mix: str, ranks: int, pack: int) -> tuple[np.ndarray, np.ndarray]:
    """(token lengths, start rank) of one step: `mix` drawn, truncated to `pack` and packed to fixed length, the
    first `ranks` packs one per rank (draws of 64 samples a rank, doubled until they fill `ranks` packs)."""
    n = ranks * 64
    while True:
        lengths = truncate(draw_mix(mix, n, rng), pack).tokens
        lengths = lengths[lengths > 0]
        pack_of = pack_fixed_length(lengths, pack)
        if pack_of.max() >= ranks:
            keep = pack_of < ranks
            return lengths[keep].astype(np.int64), pack_of[keep]
        n *= 2
