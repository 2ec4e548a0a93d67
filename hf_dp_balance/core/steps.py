"""Step maths: one layout, ``[ranks, micro_batches]``, and one definition of each step quantity.

A step's samples sit in (rank, micro-batch) slots. Loads are per slot, in cost
units; speeds (optional, per rank) turn them into times. The two sync modes:
``"step"`` (DDP: ranks meet once per step) and ``"micro_batch"`` (FSDP / ZeRO-3:
ranks meet in every micro-batch). Pure numpy, no configuration object.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import numpy as np

__all__ = ["SYNC_MODES", "slot_loads", "slot_sums", "step_makespan", "step_imbalance", "token_cap", "plan_hash"]

SYNC_MODES = ("step", "micro_batch")


def slot_loads(values, ranks, micro, num_ranks: int, num_micro: int) -> np.ndarray:
    """float64 [num_ranks, num_micro]: the sum of `values` (costs or tokens) of the samples in each slot."""
    ranks = np.asarray(ranks, dtype=np.int64)
    micro = np.asarray(micro, dtype=np.int64)
    return slot_sums(values, ranks * num_micro + micro, num_ranks, num_micro)


def slot_sums(values, slot: np.ndarray, num_ranks: int, num_micro: int) -> np.ndarray:
    """`slot_loads` from the flat slot index rank x num_micro + micro of every sample (where the caller
    has it already)."""
    return np.bincount(slot, weights=np.asarray(values, dtype=np.float64),
                       minlength=num_ranks * num_micro).reshape(num_ranks, num_micro)


def _times(loads: np.ndarray, speeds: Optional[np.ndarray]) -> np.ndarray:
    return loads if speeds is None else loads / np.asarray(speeds, dtype=np.float64)[:, None]


def step_makespan(loads: np.ndarray, sync: str, speeds: Optional[np.ndarray] = None) -> float:
    """Time of one step from slot loads [R, M]: ``"step"``, the slowest rank's row sum;
    ``"micro_batch"``, the sum over micro-batches of the slowest slot (column max). 0 for no slots."""
    times = _times(loads, speeds)
    if times.size == 0:
        return 0.0
    if sync == "step":
        return float(times.sum(axis=1).max())
    if sync == "micro_batch":
        return float(times.max(axis=0).sum())
    raise ValueError(f"sync={sync!r}: must be one of {SYNC_MODES}")


def step_imbalance(loads: np.ndarray, sync: str, speeds: Optional[np.ndarray] = None) -> float:
    """Makespan over the ideal, minus one: ``step_makespan / (total time / R) - 1``
    (0 when balanced or empty; with speeds, times = load / speed)."""
    times = _times(loads, speeds)
    total = times.sum()
    if total <= 0:
        return 0.0
    return float(step_makespan(times, sync) / (total / times.shape[0]) - 1.0)


def token_cap(tokens, num_slots: int, max_tokens: Optional[int], max_token_ratio: float,
              largest_slot: int = 0) -> int:
    """Hard tokens per slot: `max_tokens` when given (memory), else `max_token_ratio` x mean per slot.

    Without an absolute cap, the cap never falls below the largest slot the
    dataloader itself produced this step (`largest_slot`; it fits, or training
    without balancing would fail) nor below the longest sample, so "no move"
    is always feasible and planning never fails on the cap alone.
    """
    if max_tokens is not None:
        return int(max_tokens)
    tokens = np.asarray(tokens)
    mean = tokens.sum() / max(1, num_slots)
    longest = int(tokens.max()) if tokens.size else 0
    return max(longest, int(largest_slot), int(math.ceil(max_token_ratio * mean)))


def plan_hash(dest_rank, dest_micro) -> str:
    """16 hex digits of sha1 over the int64 (dest rank, dest micro-batch) arrays: equal plans, equal hashes."""
    h = hashlib.sha1(np.ascontiguousarray(dest_rank, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(dest_micro, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]
