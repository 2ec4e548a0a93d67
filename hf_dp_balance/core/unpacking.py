"""The rows the user's collator built -> per-sample dicts, and back into the user's layout.

Layouts (`detect_input`): per-sample lists; packed rows with restarting `position_ids` or `cu_seq_lens`
(transformers' `DataCollatorWithFlattening`, TRL's padding-free and packed rows, `PackedCollator`); padded
rows with an `attention_mask` (`core.padded_rows`: transformers' padding collators, TRL without
padding-free). A width aligned by the collator's `pad_to_multiple_of` (`multiple`) is kept: its pad tokens
are not samples, and balanced rows are aligned again.

Guarantee: for rows whose samples fill them in order (what `PackedCollator`, transformers'
`DataCollatorWithFlattening` and fixed-length packers write), `repack(split_packed(b), layout_of(b))`
is tensor-equal to `b`. A batch that cannot be split raises ValueError naming the row, the sample and
the key. The layouts and the rules: docs/packing.md ("Layouts").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from hf_dp_balance.core.boundaries import boundaries_from_cu_seq_lens, segment_boundaries
from hf_dp_balance.core.dummy_vision import needs_dummy_vision
from hf_dp_balance.core.families import IGNORE_INDEX, QWEN_FAMILIES
from hf_dp_balance.core.packing import REQUIRED_KEYS, SAMPLE_TENSOR_KEYS, family_of
from hf_dp_balance.core.padded_rows import aligned, real_span, repad, split_padded

INPUT_SAMPLES = "per-sample lists"
INPUT_POSITIONS = "packed rows with restarting positions"
INPUT_CU_SEQ_LENS = "packed rows with cu_seq_lens"
INPUT_PADDED = "padded rows with attention_mask"
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# per-token keys of a packed row that are rebuilt from the boundaries, not carried by a sample
LAYOUT_KEYS = ("position_ids", "attention_mask", "seq_idx") + FLASH_KEYS
TOKEN_KEYS = ("input_ids", "labels", "mm_token_type_ids")


@dataclass(frozen=True)
class PackedLayout:
    """How the user's collator laid out a micro-batch: what `repack` gives back.

    kind: INPUT_POSITIONS, INPUT_CU_SEQ_LENS or INPUT_PADDED. rows / width: the batch's [B, T].
    keys: the layout keys present (subset of LAYOUT_KEYS). dtypes: their tensor dtypes
    (`max_length_*`: None when the collator wrote python ints, as `DataCollatorWithFlattening` does).
    multiple: the collator's `pad_to_multiple_of` (None: widths as they come). Padded rows: `side` of
    the pads, and `output`: "padded" (re-padded, one sample per row) or "packed" (one padding-free row
    with restarting positions; see `core.padded_rows.padded_output`).
    """

    kind: str
    rows: int
    width: int
    keys: tuple[str, ...]
    dtypes: tuple[tuple[str, Optional[torch.dtype]], ...] = ()
    multiple: Optional[int] = None
    side: Optional[str] = None
    output: str = "padded"

    def dtype(self, key: str) -> Optional[torch.dtype]:
        return dict(self.dtypes).get(key)


def detect_input(micro_batch: Any) -> str:
    """Which layout a micro-batch is (one of the INPUT_* names); ValueError naming what was seen and the
    setting that works for anything else."""
    if isinstance(micro_batch, (list, tuple)):
        return INPUT_SAMPLES
    if not isinstance(micro_batch, Mapping):
        raise ValueError(f"micro-batch: a {type(micro_batch).__name__}, neither a list of sample dicts nor a dict "
                         f"of rows. {SAMPLES_SETTING}")
    mask = micro_batch.get("attention_mask")
    has_pads = isinstance(mask, torch.Tensor) and not bool(mask.bool().all())
    if micro_batch.get("cu_seq_lens_q") is not None:
        if has_pads:
            raise ValueError("packed batch: key 'attention_mask': has zeros beside cu_seq_lens_q: packed rows "
                             "carry no padding mask (the pads are a segment of their own)")
        return INPUT_CU_SEQ_LENS
    if has_pads or (mask is not None and micro_batch.get("position_ids") is None):
        return INPUT_PADDED
    if micro_batch.get("position_ids") is not None:
        return INPUT_POSITIONS
    ids = micro_batch.get("input_ids")
    raise ValueError(f"micro-batch: a dict of rows (keys {sorted(micro_batch)}, input_ids "
                     f"{list(getattr(ids, 'shape', []))}) with no position_ids, cu_seq_lens_q or attention_mask: "
                     f"where one sample ends and the next begins is unknown. Have the collator write position_ids "
                     f"restarting at 0 per sample or an attention_mask, or: {SAMPLES_SETTING}")


SAMPLES_SETTING = ("input='samples' (DPBalanceConfig.input, --dp_balance_input, HF_DP_BALANCE_INPUT) works when the "
                   "dataset yields per-sample dicts of tensors with input_ids and labels: the library packs them "
                   "with PackedCollator and does not call this collator")


def layout_of(batch: Mapping[str, Any], multiple: Optional[int] = None, padded_output: str = "padded") -> PackedLayout:
    """The `PackedLayout` of a batch of rows (see `detect_input`); `multiple`: the collator's
    `pad_to_multiple_of`; `padded_output`: how padded rows come back (`core.padded_rows.padded_output`)."""
    kind = detect_input(batch)
    ids = batch["input_ids"]
    keys = tuple(k for k in LAYOUT_KEYS if batch.get(k) is not None)
    dtypes = tuple((k, batch[k].dtype if isinstance(batch[k], torch.Tensor) else None) for k in keys)
    side = None
    if kind == INPUT_PADDED:
        sides = {real_span(batch["attention_mask"][r], r)[2] for r in range(int(ids.shape[0]))}
        side = "left" if "left" in sides else "right"
    return PackedLayout(kind, int(ids.shape[0]), int(ids.shape[1]), keys, dtypes, multiple or None, side,
                        padded_output)


def row_boundaries(batch: Mapping[str, Any], family: str) -> list[list[int]]:
    """Per row, `[0, s1, ..., T]`: from `cu_seq_lens_q` (over the flattened rows) when given, else from
    `position_ids` restarts (`segment_boundaries`). ValueError names the row and the key."""
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.numel() == 0:
        raise ValueError(f"packed batch: key 'input_ids': expected [B, T], got {tuple(getattr(ids, 'shape', ()))}")
    rows, width = ids.shape
    pos = batch.get("position_ids")
    if pos is not None:
        want = (4, rows, width) if family in QWEN_FAMILIES else (rows, width)
        if tuple(pos.shape) != want and not (family not in QWEN_FAMILIES and tuple(pos.shape) == (1, width)):
            need = ("Qwen-VL packing needs [4, 1, T] per row (row 0 the plain positions; with a [3, B, T] tensor "
                    "transformers skips the packing mask, so the samples of a row attend to each other and their "
                    "result depends on their neighbours)" if family in QWEN_FAMILIES else "expected [B, T]")
            raise ValueError(f"packed batch: key 'position_ids': {need}: want {list(want)}, got {list(pos.shape)}. "
                             f"Have the collator write them so (PackedCollator does), or: {SAMPLES_SETTING}")
    if batch.get("cu_seq_lens_q") is None:
        plain = pos[0] if family in QWEN_FAMILIES else pos.expand(rows, width)
        for r in range(rows):
            if int(plain[r, 0]) != 0:
                raise ValueError(f"packed batch: row {r}: key 'position_ids': must start at 0")
        bounds = segment_boundaries(plain)
    else:
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if batch.get(key) is not None and not torch.equal(torch.as_tensor(batch[key]).reshape(-1).long(),
                                                              torch.as_tensor(batch["cu_seq_lens_q"]).reshape(-1).long()):
                raise ValueError(f"packed batch: key {key!r}: differs from cu_seq_lens_q (self-attention only)")
        flat = boundaries_from_cu_seq_lens(batch["cu_seq_lens_q"], rows * width)
        bounds = []
        for r in range(rows):
            a, b = r * width, (r + 1) * width
            if a not in flat or b not in flat:
                raise ValueError(f"packed batch: row {r}: key 'cu_seq_lens_q': a sample crosses the row's edge")
            bounds.append([x - a for x in flat if a <= x <= b])
        if pos is not None and bounds != segment_boundaries(pos):
            raise ValueError("packed batch: key 'position_ids': restarts differ from cu_seq_lens_q")
    mask = batch.get("attention_mask")
    if mask is not None:
        for r in range(rows):
            if not bool(torch.as_tensor(mask[r]).bool().all()):
                raise ValueError(f"packed batch: row {r}: key 'attention_mask': has zeros: padded rows cannot be "
                                 f"split (pack without padding, boundaries in position_ids or cu_seq_lens)")
    return bounds


def split_packed(batch: Mapping[str, Any], model_config, *, multiple: Optional[int] = None,
                 pad_token_id: Optional[int] = None) -> list[dict]:
    """The per-sample dicts of a micro-batch of rows ([B, T]), row by row, in order.

    Packed rows: boundaries from `row_boundaries`; padded rows: each row's real tokens
    (`core.padded_rows.split_padded`). Images / videos / tiles go back to the sample whose placeholder
    tokens they fill. Exact inverse of `PackedCollator` (and `repack`); a sample keeps its labels as
    the collator left them, and one whose first label is a target (not -100) after another sample of
    its row raises: that target would depend on which sample precedes it, which balancing changes.
    With `multiple` (the collator's `pad_to_multiple_of`), the segments that end a packed row and hold
    only `pad_token_id` tokens with no target, fewer than `multiple` in all, are its alignment, not samples.
    """
    family = family_of(model_config)
    for key in REQUIRED_KEYS[family]:
        if batch.get(key) is None:
            raise ValueError(f"packed batch: key {key!r}: missing")
    allowed = set(SAMPLE_TENSOR_KEYS[family]) | set(LAYOUT_KEYS)
    for key, value in batch.items():
        if value is not None and key not in allowed:
            raise ValueError(f"packed batch: key {key!r}: not known how to split it by sample "
                             f"(a {family} row has {sorted(allowed)})")
    if detect_input(batch) == INPUT_PADDED:
        samples = split_padded(batch, TOKEN_KEYS)[0]
        where = [f"row {r}" for r in range(len(samples))]
    else:
        samples, where = _split_rows(batch, row_boundaries(batch, family), multiple, pad_token_id)
    if family in QWEN_FAMILIES:
        _assign_qwen_pixels(samples, where, batch, model_config)
    elif family == "internvl":
        _assign_tiles(samples, where, batch, model_config)
    return samples


def _split_rows(batch: Mapping[str, Any], bounds: list, multiple: Optional[int], pad_token_id: Optional[int]):
    samples, where = [], []
    for r, edges in enumerate(bounds):
        row = []
        for s, (a, b) in enumerate(zip(edges, edges[1:])):
            sample = {k: batch[k][r, a:b].clone() for k in TOKEN_KEYS if batch.get(k) is not None}
            if s > 0 and int(sample["labels"][0]) != IGNORE_INDEX:
                raise ValueError(f"packed batch: row {r}, sample {s}: key 'labels': the first label is a target "
                                 f"({int(sample['labels'][0])}), so it learns from the previous sample; mask it "
                                 f"(-100) in the collator")
            row.append(sample)
        keep = len(row) - _alignment_segments(row, multiple, pad_token_id)
        samples.extend(row[:keep])
        where.extend(f"row {r}, sample {s}" for s in range(keep))
    return samples, where


def _alignment_segments(row: list, multiple: Optional[int], pad_token_id: Optional[int]) -> int:
    """How many of a row's last segments are `pad_to_multiple_of` padding (see `split_packed`)."""
    if not multiple or multiple <= 1 or pad_token_id is None:
        return 0
    count, tokens = 0, 0
    for sample in reversed(row[1:]):  # the row's first segment is always data
        n = int(sample["input_ids"].numel())
        if tokens + n >= multiple or not bool((sample["labels"] == IGNORE_INDEX).all()) \
                or not bool((sample["input_ids"] == pad_token_id).all()):
            break
        count, tokens = count + 1, tokens + n
    return count


def _assign_qwen_pixels(samples: list, where: list, batch: Mapping[str, Any], model_config) -> None:
    """Give each sample the grids (and patch rows) its image / video placeholders need, in order."""
    merge2 = model_config.vision_config.spatial_merge_size ** 2
    for tok_id, pix_key, grid_key, extra in (
        (model_config.image_token_id, "pixel_values", "image_grid_thw", None),
        (model_config.video_token_id, "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
    ):
        grids, pixels = batch.get(grid_key), batch.get(pix_key)
        g = p = 0  # next grid, next patch row
        for i, s in enumerate(samples):
            need = int((s["input_ids"] == tok_id).sum())
            if need == 0:
                continue
            for key, value in ((grid_key, grids), (pix_key, pixels)):
                if value is None:
                    raise ValueError(f"packed batch: {where[i]}: key {key!r}: missing, the sample has "
                                     f"{need} placeholder tokens (id {tok_id})")
            g0, p0, got = g, p, 0
            while got < need and g < grids.shape[0]:
                rows = int(grids[g].prod())
                got, p, g = got + rows // merge2, p + rows, g + 1
            if got != need or p > pixels.shape[0]:
                raise ValueError(f"packed batch: {where[i]}: key {grid_key!r}: grids {grids[g0:g].tolist()} do "
                                 f"not match the sample's {need} placeholder tokens (or {pix_key!r} has too few rows)")
            s[pix_key], s[grid_key] = pixels[p0:p].clone(), grids[g0:g].clone()
            if extra and batch.get(extra) is not None:
                s[extra] = batch[extra][g0:g].clone()
        if grids is not None and (g != grids.shape[0] or p != pixels.shape[0]):
            raise ValueError(f"packed batch: key {grid_key!r}: {grids.shape[0] - g} grids / "
                             f"{pixels.shape[0] - p} {pix_key} rows left over after the last placeholder")


def _assign_tiles(samples: list, where: list, batch: Mapping[str, Any], model_config) -> None:
    """InternVL: each sample's tiles (image_seq_length placeholder tokens per tile), in order."""
    per_tile, tok_id = model_config.image_seq_length, model_config.image_token_id
    pixels, t = batch.get("pixel_values"), 0
    for i, s in enumerate(samples):
        need = int((s["input_ids"] == tok_id).sum())
        if need == 0:
            continue
        have = 0 if pixels is None else pixels.shape[0] - t
        if need % per_tile or need // per_tile > have:
            raise ValueError(f"packed batch: {where[i]}: key 'pixel_values': {need} <IMG_CONTEXT> tokens need "
                             f"{need / per_tile:g} tiles (image_seq_length {per_tile}), {have} left")
        s["pixel_values"] = pixels[t:t + need // per_tile].clone()
        t += need // per_tile
    if pixels is not None and t != pixels.shape[0]:
        raise ValueError(f"packed batch: key 'pixel_values': {pixels.shape[0] - t} tiles left over after the "
                         f"last <IMG_CONTEXT> placeholder")


def fill_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Next-fit: sample indices per row, in order, a new row when the next sample would pass `capacity`.

    O(n). Reproduces any packing that filled its rows in order; every row holds at most
    max(capacity, its one sample) tokens. No samples: one empty row.
    """
    rows: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if rows[-1] and used + n > capacity:
            rows.append([])
            used = 0
        rows[-1].append(i)
        used += n
    return rows


def repack(samples: Sequence[Mapping[str, Any]], layout: PackedLayout, collate: Callable[[list], dict],
           pad_token_id: int, capacity: Optional[int] = None) -> dict:
    """The samples in the user's layout. Packed layouts: `collate` (a `PackedCollator`) per row, rows of at
    most `capacity` tokens (default `layout.width`; one row when the layout has one), padded to the widest
    (aligned to `layout.multiple`) with one pad segment (label -100, positions from 0), then the layout keys
    rebuilt from the boundaries. Padded rows: one row per sample, padded on the user's side (`repad`), or,
    with `layout.output == "packed"`, one padding-free row of restarting positions."""
    if layout.kind == INPUT_PADDED and layout.output == "padded":
        return _repad(samples, layout, pad_token_id, getattr(collate, "dummy_vision", None))
    lengths = [int(s["input_ids"].numel()) for s in samples]
    if layout.rows == 1 or layout.kind == INPUT_PADDED:
        groups = [list(range(len(samples)))]
    else:
        groups = fill_rows(lengths, capacity or layout.width)
    parts = [collate([samples[i] for i in g]) for g in groups]
    width = aligned(max(p["input_ids"].shape[1] for p in parts), layout.multiple)
    qwen = parts[0]["position_ids"].ndim == 3
    parts = [_pad_row(p, width, pad_token_id, qwen) for p in parts]
    # rows stack on dim 0 (Qwen positions [4, 1, T]: dim 1); pixels in row-major sample order, the order
    # in which the model fills the placeholders
    batch = {key: torch.cat([p[key] for p in parts if key in p], dim=1 if qwen and key == "position_ids" else 0)
             for key in dict.fromkeys(k for p in parts for k in p)}
    if layout.kind == INPUT_PADDED:
        return batch  # padding-free: input_ids, labels, position_ids (and the pixels), no attention_mask
    return _layout_keys(batch, layout, qwen)


def _repad(samples: Sequence[Mapping[str, Any]], layout: PackedLayout, pad_token_id: int,
           dummy_vision: Optional[Mapping[str, Any]] = None) -> dict:
    """Padded rows; with no image or video among the samples, `dummy_vision` (a VLM's, labels all -100) as one
    more row, so the vision tower runs on this rank too (DDP without find_unused_parameters waits otherwise)."""
    if dummy_vision is not None and needs_dummy_vision(samples):
        samples = list(samples) + [dummy_vision]
    longest = max((int(s["input_ids"].numel()) for s in samples), default=1)
    pos_dtype = layout.dtype("position_ids") if "position_ids" in layout.keys else None
    batch = repad(samples, TOKEN_KEYS, side=layout.side or "right", width=aligned(longest, layout.multiple),
                  pad_token_id=pad_token_id, mask_dtype=layout.dtype("attention_mask") or torch.long,
                  position_dtype=pos_dtype)
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [s[key] for s in samples if s.get(key) is not None]
        if parts:
            batch[key] = torch.cat(parts)
    return batch


def _pad_row(part: dict, width: int, pad_token_id: int, qwen: bool) -> dict:
    """One collated row widened to `width` by a pad segment that trains nothing."""
    pad = width - part["input_ids"].shape[1]
    if pad == 0:
        return part
    out = dict(part)
    out["input_ids"] = torch.cat([part["input_ids"], part["input_ids"].new_full((1, pad), pad_token_id)], dim=1)
    out["labels"] = torch.cat([part["labels"], part["labels"].new_full((1, pad), IGNORE_INDEX)], dim=1)
    if "mm_token_type_ids" in part:
        out["mm_token_type_ids"] = torch.cat([part["mm_token_type_ids"], part["mm_token_type_ids"].new_zeros(1, pad)], 1)
    arange = torch.arange(pad, dtype=part["position_ids"].dtype)
    pos = part["position_ids"]
    out["position_ids"] = torch.cat([pos, arange.expand(pos.shape[0], 1, pad) if qwen else arange[None]], dim=-1)
    return out


def _layout_keys(batch: dict, layout: PackedLayout, qwen: bool) -> dict:
    """Put back the layout keys the user's collator wrote (and only those), in their dtypes."""
    pos = batch["position_ids"]
    plain = pos[0] if qwen else pos
    rows, width = plain.shape
    keys = set(layout.keys)
    if "cu_seq_lens_q" in keys or "seq_idx" in keys:
        bounds = segment_boundaries(plain)
        flat = [0] + [r * width + b for r, edges in enumerate(bounds) for b in edges[1:]]
        lengths = [b - a for a, b in zip(flat, flat[1:])]
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if key in keys:
                batch[key] = torch.tensor(flat, dtype=layout.dtype(key))
        for key in ("max_length_q", "max_length_k"):
            if key in keys:
                dtype = layout.dtype(key)
                batch[key] = max(lengths) if dtype is None else torch.tensor(max(lengths), dtype=dtype)
        if "seq_idx" in keys:
            ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            batch["seq_idx"] = ids.reshape(rows, width).to(layout.dtype("seq_idx"))
    if "attention_mask" in keys:
        batch["attention_mask"] = torch.ones(rows, width, dtype=layout.dtype("attention_mask"))
    if "position_ids" in keys:
        batch["position_ids"] = pos.to(layout.dtype("position_ids"))
    else:
        del batch["position_ids"]
    return batch
