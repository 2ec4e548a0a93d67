"""`hf-dp-balance fit`: fit a cost model from recorded timings (JSON or NPZ) and write it as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Tuple, Union

import numpy as np

from hf_dp_balance.core.choices import FIT_MODES
from hf_dp_balance.core.cost import features_of_ranks
from hf_dp_balance.core.fitting import fit_cost_model, fit_from_micro_batches

TAILS = ("estimate", "drop", "keep")


def _read(path: str) -> dict:
    if str(path).endswith(".npz"):
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def load_timings(path: str) -> Tuple[Union[np.ndarray, List[np.ndarray]], Union[np.ndarray, List[np.ndarray]]]:
    """Read recorded timings: JSON or NPZ with `times` and either `features` [steps, ranks, 4] or `lengths`
    (per step, per rank, a list of item lengths). Micro-batch records (FSDP / ZeRO-3 with gradient
    accumulation, each micro-batch timed on the synchronised clock) hold `micro_times` (per step
    [micro, ranks] or [micro]) and either `micro_features` (per step [micro, ranks, 4]) or `micro_lengths`
    (per step, per micro-batch, per rank, a list of item lengths): then both results are per-step lists."""
    record = _read(path)
    if not isinstance(record, dict) or not ("times" in record or "micro_times" in record):
        raise ValueError(f"{path}: expected an object with 'times' and 'features' (or 'lengths'), "
                         "or 'micro_times' and 'micro_features' (or 'micro_lengths')")
    if "micro_times" in record:
        if "micro_features" in record:
            features = [np.asarray(step, dtype=np.float64) for step in record["micro_features"]]
        elif "micro_lengths" in record:
            features = [np.stack([features_of_ranks(micro) for micro in step]) for step in record["micro_lengths"]]
        else:
            raise ValueError(f"{path}: 'micro_times' needs 'micro_features' [steps][micro, ranks, 4] or "
                             "'micro_lengths' [steps][micro][ranks][items]")
        return features, [np.asarray(step, dtype=np.float64) for step in record["micro_times"]]
    if "features" in record:
        features = np.asarray(record["features"], dtype=np.float64)
    elif "lengths" in record:
        features = np.stack([features_of_ranks(step) for step in record["lengths"]])
    else:
        raise ValueError(f"{path}: needs 'features' [steps, ranks, 4] or 'lengths' [steps][ranks][items]")
    return features, np.asarray(record["times"], dtype=np.float64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSON or NPZ with 'times' and 'features' [steps, ranks, 4] or 'lengths', "
                        "or micro-batch records ('micro_times' with 'micro_features' or 'micro_lengths')")
    parser.add_argument("-o", "--output", help="write the fitted CostModel (and report) as JSON here")
    parser.add_argument("--mode", choices=FIT_MODES, default="auto")
    parser.add_argument("--holdout", type=float, default=0.25, help="fraction of steps held out for R^2 / MAPE")
    parser.add_argument("--temperature", type=float, default=None, help="step-max soft-max temperature (relative)")
    parser.add_argument("--no-robust", dest="robust", action="store_false", help="plain least squares, keep outliers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out step choice")
    parser.add_argument("--tail", choices=TAILS, default="estimate",
                        help="micro-batch records: the step's tail in the last micro-batch (optimizer, exposed "
                        "gradient reduction) is estimated and subtracted, dropped with those micro-batches, or kept")


def _fit(args: argparse.Namespace, features, times):
    if isinstance(times, list):  # micro-batch records: each micro-batch's maximum over the ranks is observed
        if args.mode == "per_rank":
            raise ValueError("micro-batch records are synchronised across the ranks (FSDP / ZeRO-3): "
                             "they fit step_max only, not --mode per_rank")
        return fit_from_micro_batches(features, times, tail=args.tail)
    return fit_cost_model(features, times, mode=args.mode, holdout=args.holdout, temperature=args.temperature,
                          robust=args.robust, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    try:
        features, times = load_timings(args.input)
        result = _fit(args, features, times)
    except (OSError, ValueError) as exc:
        print(f"hf-dp-balance fit: {exc}", file=sys.stderr)
        return 2
    m = result.model
    print(f"cost = {m.quadratic:.6g}*sum(L^2) + {m.linear:.6g}*sum(L) + {m.per_sample:.6g}*n + {m.constant:.6g}")
    print(result.report.summary())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(result.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"wrote {args.output}")
    return 0
