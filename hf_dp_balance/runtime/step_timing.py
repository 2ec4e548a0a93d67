"""Per-rank step timing between a loader's own step boundaries, and the records a cost fit reads.

`StepClock` measures one rank's compute of one optimizer step: on CPU the main thread's CPU time
(`time.thread_time`; a rank blocked in a collective or waiting for data burns none, so the time is
this rank's own work), on accelerators the wall time between device synchronisations (kernels run
asynchronously; a synchronised boundary makes the step's time the device work up to it).

`StepTimings` keeps the most recent records, `record(step, decoder_features, vision_features,
seconds)`; a cross-rank fitter reads them with `arrays()`. Cost: two clock reads per step (plus two
device synchronisations on accelerators).
"""

from __future__ import annotations

import collections
import time
from typing import Optional, Sequence, Tuple

import numpy as np

# Enough steps to determine the cost model's 4 unknowns many times over (as the Trainer callback keeps).
DEFAULT_MAX_RECORDS = 64


def _synchronize_device(device_type: str) -> None:
    import torch

    if device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    elif device_type not in ("cpu", "cuda") and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize()


class StepClock:
    """Thread CPU time on CPU, synchronised wall time on an accelerator (`device_type` other than cpu)."""

    def __init__(self, device_type: str = "cpu"):
        self.device_type = str(device_type)
        self.mode = "thread_cpu" if self.device_type == "cpu" else "wall"
        self._started: Optional[float] = None
        self._excluded = 0.0

    def _now(self) -> float:
        if self.mode == "wall":
            _synchronize_device(self.device_type)
            return time.perf_counter()
        return time.thread_time()

    def start(self) -> None:
        self._started, self._excluded = self._now(), 0.0

    def exclude(self, wall_seconds: float) -> None:
        """Leave out time the loader itself waited inside the step (wall mode; CPU time has none of it)."""
        if self.mode == "wall":
            self._excluded += float(wall_seconds)

    def stop(self) -> Optional[float]:
        """Seconds since `start` (None when not started)."""
        if self._started is None:
            return None
        elapsed = self._now() - self._started - self._excluded
        self._started = None
        return max(elapsed, 0.0)


class StepTimings:
    """The most recent per-step records of this rank: features of what it computed, and how long it took.

    `decoder_features` / `vision_features`: the cost model's feature row (sum L^2, sum L, n, 1) of the
    step's samples (tokens) and images (patch rows). A fitter gathers `arrays()` from every rank.
    """

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS):
        self._records: collections.deque = collections.deque(maxlen=int(max_records))

    def record(self, step: int, decoder_features: Sequence[float], vision_features: Sequence[float],
               seconds: float) -> None:
        self._records.append((int(step), np.asarray(decoder_features, dtype=np.float64).reshape(4),
                              np.asarray(vision_features, dtype=np.float64).reshape(4), float(seconds)))

    def __len__(self) -> int:
        return len(self._records)

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(steps [n], decoder features [n, 4], vision features [n, 4], seconds [n]), oldest first."""
        recs = list(self._records)
        return (np.array([r[0] for r in recs], dtype=np.int64), np.array([r[1] for r in recs]).reshape(-1, 4),
                np.array([r[2] for r in recs]).reshape(-1, 4), np.array([r[3] for r in recs], dtype=np.float64))

    def clear(self) -> None:
        self._records.clear()


__all__ = ["DEFAULT_MAX_RECORDS", "StepClock", "StepTimings"]
