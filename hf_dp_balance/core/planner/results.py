"""What the planner returns (`Plan`, `StepPlan`) and the reasons and errors it gives."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

# what made a plan: "kept" (not applied), "incremental" (shed / place / refine / exchange from the current placement),
# "trades" (the full-cap trades), "repack" (the repack fallback), "reference" (the published baseline, apps.reference)
PATHS = ("kept", "incremental", "trades", "repack", "reference")


@dataclass(frozen=True)
class _Outcome:
    """What both plan results hold: the loads that justify the destinations, in cost units (not divided by
    speed); makespans and the lower bound in time units (load / speed)."""

    applied: bool
    reason: str
    loads_before: np.ndarray
    loads_after: np.ndarray
    lower_bound: float
    makespan_before: float
    makespan_after: float
    moved: int
    path: str  # what produced the destinations: one of PATHS

    @property
    def gain(self) -> float:
        """The relative cut of the slowest rank, 1 - after / before (0 when not applied)."""
        if not self.applied or self.makespan_before <= 0:
            return 0.0
        return 1.0 - self.makespan_after / self.makespan_before


@dataclass(frozen=True)
class Plan(_Outcome):
    """Destination rank of every item (`dest`), with the loads that justify it."""

    dest: np.ndarray


@dataclass(frozen=True)
class StepPlan(_Outcome):
    """Destination (rank, micro-batch) slot of every item of one optimizer step; makespans follow the sync
    mode's objective. `moved` counts rank changes only: a new micro-batch on the same rank costs no communication."""

    dest_rank: np.ndarray
    dest_micro_batch: np.ndarray


def _first(mask: np.ndarray) -> Optional[int]:
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def _verdict(made, keep, required: Optional[str], min_gain: float):
    """The made plan if it is required (`required`: why) or beats keeping in place by at least `min_gain`,
    else `keep(reason)`."""
    if required is not None:
        return replace(made, reason=f"required: {required}")
    if made.makespan_after >= made.makespan_before:
        return keep("no plan beats keeping in place")
    gain = 1.0 - made.makespan_after / made.makespan_before
    if gain < min_gain:
        return keep(f"gain {gain:.1%} < min_gain {min_gain:.1%}")
    return replace(made, reason=f"gain {gain:.1%} >= min_gain {min_gain:.1%}")


def _cap_error(ntok, cap, rank, detail="") -> ValueError:
    return ValueError(f"token cap cannot be met: rank {rank} holds {ntok[rank]:.0f} tokens > cap {cap:.0f} "
                      f"(all ranks: {ntok.sum():.0f} tokens, total capacity {cap * ntok.size:.0f})"
                      + (f"; {detail}" if detail else ""))


def _slot_error(slot_index, slot_tok, cap, num_mb, detail) -> ValueError:
    r, m = divmod(int(slot_index), num_mb)
    held = "" if slot_tok is None else (f" holds {slot_tok[slot_index]:.0f} tokens (cap {cap:.0f}, "
                                        f"all slots {slot_tok.sum():.0f} tokens)")
    return ValueError(f"cannot make a valid step plan: slot (rank {r}, micro-batch {m}){held}; "
                      f"no placement found that fixes it ({detail})")
