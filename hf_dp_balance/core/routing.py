"""Routing of one balanced vision-tower forward (pure numpy / torch, no process group).

Given every item's owner and planned rank, `route_items` gives one rank the split sizes and row
permutations of the two all_to_alls (pixels out, embeddings back) so that only moved items travel and each
rank gets its own items' embeddings back in local order. Details: docs/vision.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class VisionRoute:
    """Where one rank's rows go and come from, for one balanced forward.

    Items are numbered globally rank-major (all items of rank 0, then rank 1...).
    Items planned to stay on their owner (kept) take no part in either
    all_to_all: their pixel rows are used in place and their embeddings never
    leave the rank. Only moved items are exchanged. A rank computes its kept
    items first (local order), then the received ones in arrival order (by
    source rank, then the source's local order); the tower's result per item
    does not depend on which other items share the call.

    kept_items:      local indices of the items computed where they are, in local order
    send_order:      local indices of the moved items in the order they are sent (stable by destination)
    send_in_rows:    pixel rows sent to each rank            (forward, pixels; moved items only)
    recv_in_rows:    pixel rows received from each rank      (forward, pixels)
    computed_items:  global indices of the items this rank computes, in compute order (kept, then received)
    send_out_rows:   embedding rows sent back to each rank   (= rows of received items per owner)
    recv_out_rows:   embedding rows received from each rank  (= rows of own moved items per computing rank)
    restore_rows:    row index into [kept items' embedding rows; received embedding rows] that
                     gives this rank's embedding rows in local item order
    """

    kept_items: np.ndarray
    send_order: np.ndarray
    send_in_rows: List[int]
    recv_in_rows: List[int]
    computed_items: np.ndarray
    send_out_rows: List[int]
    recv_out_rows: List[int]
    restore_rows: np.ndarray

    @property
    def exchanges(self) -> bool:
        """Whether this rank sends or receives any row (it still joins every collective)."""
        return bool(sum(self.send_in_rows) or sum(self.recv_in_rows))


def route_items(item_rank: np.ndarray, item_dest: np.ndarray, in_rows: np.ndarray, out_rows: np.ndarray,
                rank: int, num_ranks: int) -> VisionRoute:
    """Split sizes and permutations of the two all_to_alls of one balanced forward (pure, O(n log n)).

    `item_rank` (owner of each global item) must be non-decreasing (rank-major
    numbering); `item_dest` the planned rank; `in_rows` / `out_rows` the pixel
    rows and embedding rows of each item. Kept items (dest == owner) are
    left out of the exchanges, so the bytes sent are those of moved items only.
    """
    item_rank = np.asarray(item_rank, dtype=np.int64)
    item_dest = np.asarray(item_dest, dtype=np.int64)
    in_rows = np.asarray(in_rows, dtype=np.int64)
    out_rows = np.asarray(out_rows, dtype=np.int64)
    n = item_rank.shape[0]
    for name, arr in (("item_dest", item_dest), ("in_rows", in_rows), ("out_rows", out_rows)):
        if arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) like item_rank")
    if n and (np.diff(item_rank) < 0).any():
        raise ValueError("item_rank must be non-decreasing (items numbered rank-major)")
    for name, arr in (("item_rank", item_rank), ("item_dest", item_dest)):
        if n and ((arr < 0) | (arr >= num_ranks)).any():
            bad = int(np.nonzero((arr < 0) | (arr >= num_ranks))[0][0])
            raise ValueError(f"item {bad}: {name}={int(arr[bad])} is not a rank in [0, {num_ranks})")

    mine = np.nonzero(item_rank == rank)[0]
    my_dest = item_dest[mine]
    kept = np.nonzero(my_dest == rank)[0]
    moved = np.nonzero(my_dest != rank)[0]
    send_order = moved[np.argsort(my_dest[moved], kind="stable")]
    send_in_rows = np.bincount(my_dest[moved], weights=in_rows[mine[moved]], minlength=num_ranks).astype(np.int64)
    recv_out_rows = np.bincount(my_dest[moved], weights=out_rows[mine[moved]], minlength=num_ranks).astype(np.int64)

    received = np.nonzero((item_dest == rank) & (item_rank != rank))[0]
    src = item_rank[received]
    recv_in_rows = np.bincount(src, weights=in_rows[received], minlength=num_ranks).astype(np.int64)
    send_out_rows = np.bincount(src, weights=out_rows[received], minlength=num_ranks).astype(np.int64)

    # Embedding rows of this rank's items sit in [kept rows (local order); rows
    # back from the computing ranks (grouped by rank, each group in send order)].
    my_out = out_rows[mine]
    start = np.zeros(mine.shape[0], dtype=np.int64)
    kept_total = int(my_out[kept].sum())
    start[kept] = np.cumsum(my_out[kept]) - my_out[kept]
    start[send_order] = kept_total + np.cumsum(my_out[send_order]) - my_out[send_order]
    restore_rows = _ranges(start, my_out)
    return VisionRoute(kept_items=kept.astype(np.int64), send_order=send_order.astype(np.int64),
                       send_in_rows=send_in_rows.tolist(), recv_in_rows=recv_in_rows.tolist(),
                       computed_items=np.concatenate([mine[kept], received]).astype(np.int64),
                       send_out_rows=send_out_rows.tolist(), recv_out_rows=recv_out_rows.tolist(),
                       restore_rows=restore_rows)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + counts[i]) (vectorised)."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # position within the output minus the offset of its range, plus the range's start
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


def rows_in_order(row_counts: Sequence[int], order: np.ndarray) -> np.ndarray:
    """Row index gathering whole items (each `row_counts[i]` consecutive rows) in `order`."""
    counts = np.asarray(row_counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    order = np.asarray(order, dtype=np.int64)
    return _ranges(starts[order], counts[order])


def take_rows(parts: Sequence[torch.Tensor], rows: np.ndarray, empty: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the row-wise concatenation of `parts`, without building that concatenation.

    A run of consecutive rows inside one part is a view (no copy); other runs
    are one index_select each; the pieces are joined by one cat only when there
    are several. `empty` is returned when `rows` is empty.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return empty
    ends = np.cumsum([p.shape[0] for p in parts])
    part_of = np.searchsorted(ends, rows, side="right")
    cuts = np.concatenate([[0], np.nonzero(np.diff(part_of))[0] + 1, [rows.size]])
    pieces = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        k = int(part_of[a])
        part = parts[k]
        local = rows[a:b] - (ends[k] - part.shape[0])
        if local[-1] - local[0] + 1 == local.size and (local.size == 1 or (np.diff(local) == 1).all()):
            pieces.append(part[int(local[0]):int(local[-1]) + 1])
        else:
            pieces.append(part.index_select(0, torch.from_numpy(local).to(part.device)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


__all__ = ["VisionRoute", "route_items", "rows_in_order", "take_rows"]
