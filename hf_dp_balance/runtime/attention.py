"""Varlen attention for devices without flash-attn: causal SDPA per packed segment, so a packed row costs
sum(L_i^2) on CPU too (a block-diagonal mask would still compute T^2).

Boundaries from `cu_seq_lens_q` or `position_ids` restarts, read by `hf_dp_balance.core.packing` (the one
place that finds them). Registered with transformers' `AttentionInterface` and `AttentionMaskInterface`
(only a 2-D padding mask is forwarded). Usage, details and what is verified: docs/cost_model.md,
"Varlen attention".
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from hf_dp_balance.core.boundaries import boundaries_from_cu_seq_lens, segment_boundaries

DEFAULT_NAME = "hf_dp_balance_varlen"


def _attend(q, k, v, *, causal: bool, scale: Optional[float], dropout: float, window: Optional[int], offset: int = 0):
    """SDPA of one segment; q [b, h, lq, d], k/v [b, h, lk, d]; queries are the last lq of the lk keys.

    The plain causal case uses `is_causal=True` (no mask tensor); an explicit
    boolean mask is built only for a sliding window or a query offset (decode).
    """
    lq, lk = q.shape[2], k.shape[2]
    needs_mask = (causal and offset != 0) or (window is not None and lk > window)
    if not needs_mask:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal and lq > 1, scale=scale)
    q_pos = torch.arange(lq, device=q.device)[:, None] + offset
    k_pos = torch.arange(lk, device=q.device)[None, :]
    allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale)


def _packed_boundaries(position_ids, cu_seq_lens_q, batch: int, q_len: int) -> List[List[int]]:
    """Per row, the segment boundaries `[0, ..., q_len]`: from `cu_seq_lens_q`, else from the position
    restarts (`core.boundaries.segment_boundaries`), else one sequence per row."""
    if cu_seq_lens_q is not None:
        if batch != 1:
            raise ValueError(f"{DEFAULT_NAME}: cu_seq_lens_q needs a single packed row, got batch size {batch}")
        return [boundaries_from_cu_seq_lens(cu_seq_lens_q, q_len)]
    if position_ids is None or (position_ids.ndim == 3 and position_ids.shape[0] != 4):
        return [[0, q_len]] * batch  # no positions, or mrope rows without the text row: as transformers does
    positions = position_ids[0] if position_ids.ndim == 3 else position_ids  # [4, b, T]: row 0 is the plain one
    if positions.ndim > 2:
        raise ValueError(f"position_ids must be [batch, seq] for packed attention, got shape {tuple(positions.shape)}")
    if positions.shape[-1] != q_len:
        raise ValueError(f"{DEFAULT_NAME}: position_ids length {positions.shape[-1]} != query length {q_len}")
    if positions.ndim == 2 and positions.shape[0] == 1:
        positions = positions.expand(batch, -1)
    bounds_per_row = segment_boundaries(positions)
    if len(bounds_per_row) != batch:
        raise ValueError(f"{DEFAULT_NAME}: position_ids have {len(bounds_per_row)} rows for a batch of {batch}")
    return bounds_per_row


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    position_ids: Optional[torch.Tensor] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Attention with transformers' calling convention; returns ([b, q_len, heads, d], None).

    query [b, heads, q_len, d]; key / value [b, kv_heads, kv_len, d].
    Cost: sum over segments of L^2 (causal halves it), never (sum L)^2.
    attention_mask: None or a 2-D [b, kv_len] padding mask (True = real
    token); padded tokens are dropped from their segment and get zero output.
    """
    if softcap is not None:
        raise ValueError(f"{DEFAULT_NAME}: attention logit softcap={softcap} is not supported; use eager or flex_attention")
    if attention_mask is not None and attention_mask.ndim != 2:
        raise ValueError(
            f"{DEFAULT_NAME}: expected no mask or a 2-D padding mask, got shape {tuple(attention_mask.shape)}; "
            "was the attention registered with register_varlen_attention()?"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    batch, heads, q_len, _ = query.shape
    kv_len = key.shape[2]
    groups = heads // key.shape[1]
    if groups > 1:  # grouped-query attention: share each kv head among its query heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)

    if q_len != kv_len:
        # Decoding against a cache: one causal segment per row, queries at the end.
        rows = []
        for b in range(batch):
            k, v = key[b : b + 1], value[b : b + 1]
            if attention_mask is not None and not bool(attention_mask[b].all()):
                keep = torch.nonzero(attention_mask[b]).flatten()
                k, v = k[:, :, keep], v[:, :, keep]
            rows.append(_attend(query[b : b + 1], k, v, causal=causal, scale=scaling, dropout=dropout,
                                window=sliding_window, offset=k.shape[2] - q_len))
        return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None

    bounds_per_row = _packed_boundaries(position_ids, cu_seq_lens_q, batch, q_len)
    rows = []
    for b, bounds in enumerate(bounds_per_row):
        valid = None
        if attention_mask is not None and not bool(attention_mask[b].all()):
            valid = attention_mask[b].to(torch.bool)
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[b : b + 1, :, start:end] for t in (query, key, value))
            if valid is None:
                pieces.append(_attend(q, k, v, causal=causal, scale=scaling, dropout=dropout, window=sliding_window))
                continue
            keep = torch.nonzero(valid[start:end]).flatten()
            out = q.new_zeros(q.shape)
            if keep.numel():
                attended = _attend(q[:, :, keep], k[:, :, keep], v[:, :, keep], causal=causal, scale=scaling,
                                   dropout=dropout, window=sliding_window)
                out = out.index_copy(2, keep, attended)
            pieces.append(out)
        rows.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    output = torch.cat(rows, dim=0) if batch > 1 else rows[0]
    return output.transpose(1, 2).contiguous(), None


def padding_only_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[torch.Tensor] = None,
    **kwargs,
) -> Optional[torch.Tensor]:
    """Mask function for `AttentionMaskInterface`: the 2-D padding mask if any token is padding, else None.

    Causality and packing are applied inside `varlen_attention_forward`, so no
    [b, 1, T, T] mask is built (it would cost T^2 memory for nothing).
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register_varlen_attention(name: str = DEFAULT_NAME) -> str:
    """Register the varlen attention (and its padding-only mask) under `name`; returns `name`.

    Idempotent: registering again is a no-op. Raises ValueError if `name` is
    already taken by a different attention function (e.g. "sdpa").
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(name, str) or not name or "flash" in name or "/" in name:
        # transformers treats names containing "flash" (FA-style kwargs) or "/" (hub kernels) specially.
        raise ValueError(f"register_varlen_attention: invalid name {name!r} (non-empty, without 'flash' or '/')")
    current = AttentionInterface._global_mapping.get(name)
    if current is not None and current is not varlen_attention_forward:
        raise ValueError(f"register_varlen_attention: {name!r} is already registered to {current!r}")
    current_mask = AttentionMaskInterface._global_mapping.get(name)
    if current_mask is not None and current_mask is not padding_only_mask:
        raise ValueError(f"register_varlen_attention: mask function {name!r} is already registered to {current_mask!r}")
    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, padding_only_mask)
    return name


__all__ = ["DEFAULT_NAME", "register_varlen_attention", "varlen_attention_forward", "padding_only_mask"]
