"""Padded rows (one sample per row, `attention_mask` zeros at the pads) -> samples, and back.

What transformers' `DataCollatorForLanguageModeling(mlm=False)`, `DataCollatorForSeq2Seq` and TRL's collator
without `padding_free` give: `input_ids` / `labels` [B, T], `attention_mask` [B, T] with one run of ones per
row (right padding: ones then zeros; left padding: zeros then ones), optionally `position_ids` counting the
real tokens from 0. `split_padded` takes each row's real tokens as one sample; `repad` puts samples back one
per row in that layout (same side, mask dtype, width aligned to the collator's `pad_to_multiple_of`).
Whether a balanced slot is re-padded or packed padding-free: `padded_output` (docs/packing.md, "Layouts").
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from hf_dp_balance.core.families import IGNORE_INDEX

# attention implementations that compute sum(L^2) over the samples of a packed row (varlen kernels, flex's
# block mask); sdpa and eager build a dense [T, T] mask from the restarts and compute (sum L)^2
VARLEN_PREFIXES = ("flash", "flex_attention", "hf_dp_balance")


def aligned(width: int, multiple: Optional[int]) -> int:
    """`width` rounded up to a multiple of `multiple` (None: unchanged), as `pad_to_multiple_of` pads."""
    if not multiple or multiple <= 1:
        return int(width)
    return -(-int(width) // int(multiple)) * int(multiple)


def padded_output(model_config: Any) -> str:
    """"packed" when the language model's attention computes only within each sample of a packed row (a
    varlen / flex attention: a padding-free row of the slot's samples is the same loss for fewer FLOPs),
    else "padded" (sdpa / eager: a packed row would compute its full T^2, more than the padded rows)."""
    text = getattr(model_config, "text_config", None) or model_config
    impl = getattr(text, "_attn_implementation", None) or getattr(model_config, "_attn_implementation", None)
    return "packed" if impl is not None and str(impl).startswith(VARLEN_PREFIXES) else "padded"


def real_span(mask_row: torch.Tensor, r: int) -> tuple[int, int, Optional[str]]:
    """(start, end, side) of one row's real tokens: one run of ones, at the left (right padding) or at the
    right (left padding); side None for a row with no pads. ValueError names the row otherwise."""
    ones = torch.nonzero(torch.as_tensor(mask_row).reshape(-1) != 0).flatten()
    width = int(torch.as_tensor(mask_row).numel())
    if ones.numel() == 0:
        raise ValueError(f"padded batch: row {r}: key 'attention_mask': all zeros (a row with no tokens)")
    a, b = int(ones[0]), int(ones[-1]) + 1
    if b - a != ones.numel():
        raise ValueError(f"padded batch: row {r}: key 'attention_mask': its ones are not one run (zeros inside "
                         f"the row): not right or left padding, so the row's samples are unknown")
    side = "left" if a > 0 else ("right" if b < width else None)
    if a > 0 and b < width:
        raise ValueError(f"padded batch: row {r}: key 'attention_mask': pads on both sides")
    return a, b, side


def split_padded(batch: Mapping[str, Any], token_keys: Sequence[str]) -> tuple[list[dict], str]:
    """The samples of padded rows (the real tokens of each row, in order) and the padding side.

    Each sample's first label comes back as -100 (at the start of its own row it is never a target). A
    left-padded row whose first real token's label is a target raises: the pad before it would learn it.
    `position_ids`, when given, must count each row's real tokens from 0."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"padded batch: keys 'input_ids' / 'attention_mask': expected two [B, T] tensors, got "
                         f"{tuple(getattr(ids, 'shape', ()))} and {tuple(getattr(mask, 'shape', ()))}")
    pos = batch.get("position_ids")
    samples, sides = [], set()
    for r in range(ids.shape[0]):
        a, b, side = real_span(mask[r], r)
        if side == "left" and int(batch["labels"][r, a]) != IGNORE_INDEX:
            raise ValueError(f"padded batch: row {r}: key 'labels': left padding, and the first real token's label "
                             f"is a target ({int(batch['labels'][r, a])}) learned from a pad token; mask it (-100) "
                             f"or pad on the right")
        if pos is not None and not torch.equal(pos.reshape(-1, *ids.shape)[0, r, a:b].cpu(),
                                               torch.arange(b - a, dtype=pos.dtype)):
            raise ValueError(f"padded batch: row {r}: key 'position_ids': expected 0..{b - a - 1} over the real "
                             f"tokens (one sample per row)")
        if side is not None:
            sides.add(side)
        sample = {k: batch[k][r, a:b].clone() for k in token_keys if batch.get(k) is not None}
        sample["labels"][0] = IGNORE_INDEX
        samples.append(sample)
    if sides == {"left", "right"}:
        raise ValueError("padded batch: key 'attention_mask': some rows padded on the left, others on the right")
    return samples, (sides.pop() if sides else "right")


def repad(samples: Sequence[Mapping[str, Any]], token_keys: Sequence[str], *, side: str, width: int,
          pad_token_id: int, mask_dtype: torch.dtype, position_dtype: Optional[torch.dtype]) -> dict:
    """One row per sample, padded on `side` to `width` (>= the longest sample): `input_ids` with
    `pad_token_id`, `labels` with -100, `attention_mask` 0 at the pads (in `mask_dtype`); `position_ids`
    0.. over the real tokens (0 at the pads) when `position_dtype` is given. No samples: one pad row."""
    rows = list(samples) or [{"input_ids": torch.tensor([pad_token_id]), "labels": torch.tensor([IGNORE_INDEX])}]
    width = max([width] + [int(s["input_ids"].numel()) for s in rows])
    fills = {"input_ids": pad_token_id, "labels": IGNORE_INDEX}
    out: dict = {}
    for key in token_keys:
        if all(key in s for s in rows):
            out[key] = torch.stack([_pad(s[key], width, fills.get(key, 0), side) for s in rows])
    out["attention_mask"] = torch.stack([_pad(torch.ones(s["input_ids"].numel(), dtype=mask_dtype), width, 0, side)
                                         for s in rows])
    if position_dtype is not None:
        out["position_ids"] = torch.stack([_pad(torch.arange(s["input_ids"].numel(), dtype=position_dtype),
                                                width, 0, side) for s in rows])
    return out


def _pad(values: torch.Tensor, width: int, fill: int, side: str) -> torch.Tensor:
    pad = values.new_full((width - values.numel(),), fill)
    return torch.cat([values, pad] if side == "right" else [pad, values])
