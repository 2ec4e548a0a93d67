"""The `dp_balance/*` numbers a run reports, one definition for the Trainer callback and `DPBalancer`.

`balance_metrics` joins the fitter's measured compute since the last call (a collective on the fitter's
side group: every data-parallel rank calls it at the same step), the loader's step statistics, the
vision-tower balancing counters and the cost model in force. Equal on every rank except the local byte
counts of the loader's statistics.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Sequence

import numpy as np

LOG_PREFIX = "dp_balance/"


def summarize_step_stats(stats: Sequence[Any]) -> Dict[str, float]:
    """Loader statistics of the steps since the last log: mean predicted imbalance before / after,
    steps applied / skipped, samples and bytes moved (sums)."""
    if not stats:
        return {}
    before = [s.imbalance_before for s in stats if math.isfinite(s.imbalance_before)]
    after = [s.imbalance_after for s in stats if math.isfinite(s.imbalance_after)]
    out = {
        "applied": float(sum(1 for s in stats if s.applied)),
        "skipped": float(sum(1 for s in stats if not s.applied)),
        "moved_samples": float(sum(s.moved_samples for s in stats)),
        "moved_bytes": float(sum(s.moved_bytes for s in stats)),
        "wait_s": float(sum(getattr(s, "wait_s", 0.0) for s in stats)),
    }
    if before:
        out["imbalance_before"] = float(np.mean(before))
    if after:
        out["imbalance_after"] = float(np.mean(after))
    return out


def vision_stats(balancer) -> Dict[str, float]:
    """Vision-tower balancing since the last call: forwards applied / skipped, images moved (empty without)."""
    take = getattr(balancer, "pop_stats", None)
    stats = take() if callable(take) else []
    if not stats:
        return {}
    out = {"vision_applied": float(sum(1 for s in stats if s.get("applied"))),
           "vision_skipped": float(sum(1 for s in stats if not s.get("applied")))}
    out["vision_moved_images"] = float(sum(s.get("items_moved", 0) for s in stats))
    out["vision_moved_bytes"] = float(sum(s.get("pixel_bytes_moved", 0) + s.get("embedding_bytes_moved", 0)
                                          for s in stats))
    return out


def balance_metrics(fitter, step_stats: Sequence[Any], vision_balancer=None) -> Dict[str, float]:
    """`dp_balance/<name>` -> value: measured compute (`fitter.window_metrics`, a collective), the loader's
    `step_stats` since the last call, the vision wrapper's counters, the cost model (`fitter.model_metrics`)."""
    logs: Dict[str, float] = fitter.window_metrics()
    logs.update(summarize_step_stats(step_stats))
    logs.update(vision_stats(vision_balancer))
    logs.update(fitter.model_metrics())
    return {LOG_PREFIX + k: float(v) for k, v in logs.items() if v is not None}


__all__ = ["LOG_PREFIX", "balance_metrics", "summarize_step_stats", "vision_stats"]
