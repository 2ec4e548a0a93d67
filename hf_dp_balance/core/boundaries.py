"""Sample boundaries of a packed row: where each packed sample starts, by transformers' own rule.

One definition for every reader (the recorder's sample lengths, `core.unpacking.split_packed`, the varlen
attention): from `position_ids` restarting at 0, or from flash-attention's `cu_seq_lens`.
"""

from __future__ import annotations

import torch


def segment_boundaries(position_ids) -> list[list[int]]:
    """Per batch row, the start offset of every packed sample plus the row length: `[[0, s1, ..., T], ...]`.

    A sample starts at token 0 and wherever position[i] != position[i-1] + 1: transformers' own rule
    (`masking_utils.find_packed_sequence_indices`), so these are the segments the model's attention
    really computes. `position_ids`: [T], [B, T], or Qwen-VL's [4, B, T] (row 0 holds the plain
    per-sample positions). Example: [[0, 1, 2, 0, 1, 0]] -> [[0, 3, 5, 6]]; [[3, 4, 5]] -> [[0, 3]].
    """
    pos = torch.as_tensor(position_ids)
    if pos.ndim == 3 and pos.shape[0] == 4:
        pos = pos[0]
    if pos.ndim == 1:
        pos = pos[None]
    if pos.ndim != 2:
        raise ValueError(f"position_ids must be [T], [B, T] or [4, B, T], got shape {tuple(pos.shape)}")
    length = int(pos.shape[1])
    restarts = torch.diff(pos.detach().cpu(), dim=1) != 1
    return [[0] + (torch.nonzero(row).flatten() + 1).tolist() + [length] for row in restarts]


def segment_lengths(position_ids) -> list[int]:
    """Token count of every packed sample, all rows in order (see `segment_boundaries`)."""
    return [b - a for bounds in segment_boundaries(position_ids) for a, b in zip(bounds, bounds[1:]) if b > a]


def boundaries_from_cu_seq_lens(cu_seq_lens, length: int) -> list[int]:
    """The boundaries `[0, s1, ..., T]` of one packed row given as cumulative sample lengths
    (`cu_seq_lens_q` of `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`), checked to rise
    from 0 to the row length `length`."""
    bounds = [int(x) for x in torch.as_tensor(cu_seq_lens).reshape(-1).tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seq_lens_q={bounds} must rise from 0 to the sequence length {length}")
    return bounds
