"""The starting mix of multimodal SFT (shared/WORKLOAD_STATS.md), defined once: its published figures and the
per-sample shapes of the synthetic dataset (`plan_samples`). Pure numpy, deterministic by seed.

The simulator's mixes (`hf_dp_balance.apps.mixes`) draw the same figures column-wise; where the two
generators differ (several images per sample, the long tail) and why: docs/data.md.
"""

from __future__ import annotations

from typing import Optional

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
# so tiny models train on CPU. (The simulator's named mixes are `apps.mixes.MIXES`.)
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
