"""`hf-dp-balance simulate`: the what-if gain of balancing at DP 8..4096, before renting the GPUs.

This module is the report (markdown table, plot) and the command line; the model of a step is in
`sim_model`, the runs in `sim_runs`; what the numbers mean is in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import List

import numpy as np

from hf_dp_balance.apps.sim_model import COST_PRESETS, DEFAULT_BANDWIDTH_GBS, load_cost
from hf_dp_balance.apps.sim_plot import plot_results
from hf_dp_balance.apps.sim_price import (ADAM_BYTES_PER_PARAM, GPUS_PER_NODE, GRAD_BYTES, HBM_GBPS, INTER_NODE_GBPS,
                                          INTRA_NODE_GBPS, StepPrice)
from hf_dp_balance.apps.sim_runs import simulate
from hf_dp_balance.testing.mix import mix_names

# Setups: defaults for the flags a user did not give. "published": the published system's cluster as far as
# its blog states it (DP 32..512, 32K packs, all-reduce not overlapped) with its measured gains of the
# reference method; the model and the data mix are not stated there: the 7b preset and qwen2vl-sft are guesses.
SETUPS = {
    "default": {"dp": [32, 64, 128, 256, 512, 1024], "pack": 32768, "allreduce": "overlapped", "cost": "7b"},
    "published": {"dp": [32, 64, 128, 256, 512], "pack": 32768, "allreduce": "exposed", "cost": "7b"},
}
PUBLISHED_GAINS = {256: "+3.3%", 512: "~+10%"}  # the blog's table (no all-reduce overlap)

# --------------------------------------------------------------------------- CLI


def _dp_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 32,64,128") from None
    if not values or any(v < 1 or v > 65536 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each DP size must be an integer in 1..65536")
    return values


def _checked_number(cast, kind: str, ok, requirement: str):
    """An argparse `type` that parses with `cast` and accepts only values with `ok(value)`."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{value} must be {requirement}")
        return value

    return parse


_positive_int = _checked_number(int, "an integer", lambda v: v >= 1, ">= 1")
_non_negative_int = _checked_number(int, "an integer", lambda v: v >= 0, ">= 0")
_positive_float = _checked_number(float, "a number", lambda v: v > 0 and math.isfinite(v), "a positive number")
_non_negative_float = _checked_number(float, "a number", lambda v: v >= 0 and math.isfinite(v), ">= 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--setup", choices=tuple(SETUPS), default="default",
                        help="defaults of --dp, --pack, --allreduce, --cost: 'published' states the published "
                             "system's cluster (DP 32..512, 32K packs, all-reduce not overlapped) and prints its "
                             "measured gains beside the simulated ones")
    parser.add_argument("--dp", type=_dp_list, default=None,
                        help="comma-separated data-parallel sizes (default 32,...,1024; published: 32,...,512)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--mix", choices=mix_names(), default=None, help="sample mix (default qwen2vl-sft)")
    src.add_argument("--lengths-from", default=None, metavar="SPEC",
                     help="your own lengths: dataset:PATH_OR_NAME:COLUMN (from disk) or a text file, one per line")
    parser.add_argument("--pack", type=_positive_int, default=None,
                        help="tokens per fixed-length pack (= per-rank cap; default 32768)")
    parser.add_argument("--max-tokens", type=_positive_int, default=None,
                        help="hard per-rank token cap of plan_balance (default: --pack)")
    parser.add_argument("--ga", type=_positive_int, default=1, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--cost", default=None,
                        help=f"cost preset ({', '.join(COST_PRESETS)}; default 7b) or a fitted CostModel JSON (seconds)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="steps per DP size (default clip(32768 // (dp*ga), 16, 256))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lookahead", type=_non_negative_int, default=0, metavar="K",
                        help="also simulate look-ahead over windows of K steps (0/1 = off)")
    parser.add_argument("--sync", choices=("step", "micro_batch"), default="step",
                        help="ranks meet once per step (DDP) or every micro-batch (FSDP / ZeRO-3)")
    _add_price_arguments(parser)
    parser.add_argument("--json", default=None, metavar="PATH", help="write settings and results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="write a PNG: TGS against DP size, and each method's step split into its parts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_price_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the step's parts besides compute (`sim_price.StepPrice`) and of the exchange."""
    g = parser.add_argument_group("step price (documented H100/H200-class defaults; docs/simulator.md)")
    g.add_argument("--params", type=_non_negative_float, default=None,
                   help="parameters all-reduced per step (default: the preset's; 0 for a fitted JSON)")
    g.add_argument("--grad-dtype", choices=tuple(GRAD_BYTES), default="bf16", help="gradient dtype (default bf16)")
    g.add_argument("--gpus-per-node", type=_positive_int, default=GPUS_PER_NODE, help="GPUs per node (default 8)")
    g.add_argument("--intra-node-gbps", type=_positive_float, default=INTRA_NODE_GBPS,
                   help="Gb/s per GPU inside a node (default 3600: NVLink 450 GB/s)")
    g.add_argument("--inter-node-gbps", type=_positive_float, default=INTER_NODE_GBPS,
                   help="Gb/s per GPU between nodes (default 400: one 400G NIC per GPU)")
    g.add_argument("--allreduce", choices=("overlapped", "exposed"), default=None,
                   help="gradient all-reduce hidden behind the backward pass (default) or after it (published)")
    g.add_argument("--optimizer-s", type=_non_negative_float, default=None,
                   help=f"seconds of the optimizer step (default: Adam, {ADAM_BYTES_PER_PARAM} B per parameter "
                        f"at {HBM_GBPS:.0f} GB/s HBM)")
    g.add_argument("--step-overhead", type=float, default=None,
                   help="fixed seconds per step besides compute, all-reduce and optimizer (default: the preset's)")
    g.add_argument("--bandwidth", type=_positive_float, default=DEFAULT_BANDWIDTH_GBS,
                   help="GB/s per GPU of the side network that moves samples (default 25)")
    g.add_argument("--no-overlap", action="store_true",
                   help="charge the whole exchange time (default: hidden behind the step it overlaps)")


def _price(args: argparse.Namespace, cost, allreduce: str) -> StepPrice:
    params = cost.params if args.params is None else args.params
    kw = dict(grad_dtype=args.grad_dtype, gpus_per_node=args.gpus_per_node, intra_node_gbps=args.intra_node_gbps,
              inter_node_gbps=args.inter_node_gbps, allreduce_overlapped=allreduce == "overlapped",
              fixed_s=cost.step_overhead)
    if args.optimizer_s is None:
        return StepPrice.adam(params, **kw)
    return StepPrice(params=params, optimizer_s=args.optimizer_s, **kw)


def run(args: argparse.Namespace) -> int:
    if args.step_overhead is not None and not (args.step_overhead >= 0 and math.isfinite(args.step_overhead)):
        raise SystemExit(f"hf-dp-balance simulate: error: --step-overhead {args.step_overhead}: must be >= 0")
    setup = SETUPS[args.setup]
    given = {k: getattr(args, k) for k in setup}
    dp, pack, allreduce, cost_spec = (setup[k] if v is None else v for k, v in given.items())
    try:
        source = load_lengths(args.lengths_from) if args.lengths_from else (args.mix or "qwen2vl-sft")
        cost = load_cost(cost_spec, args.step_overhead)
        result = simulate(
            source, dp, cost, pack=pack, ga=args.ga, steps=args.steps, seed=args.seed,
            lookahead=args.lookahead, sync=args.sync, bandwidth_gbs=args.bandwidth,
            overlap=not args.no_overlap, max_tokens=args.max_tokens, price=_price(args, cost, allreduce),
            progress=not args.no_progress,
        )
    except ValueError as e:
        raise SystemExit(f"hf-dp-balance simulate: error: {e}") from None
    result["settings"]["setup"] = args.setup
    if args.lengths_from:
        result["settings"]["mix"] = f"lengths from {args.lengths_from}"
    print(format_table(result))
    if args.setup == "published":
        print()
        print(format_published(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        plot_results(result, args.plot)
    return 0


def format_published(result: dict) -> str:
    """The reference method's simulated gains beside the published system's measured ones (markdown)."""
    lines = ["| DP | reference method, simulated | with its exchange shown | published (blog) |",
             "|---:|---:|---:|---:|"]
    for r in result["results"]:
        lines.append(f"| {r['dp']} | {100 * r['gain_reference']:+.1f}% | "
                     f"{100 * r['gain_reference_exchange_shown']:+.1f}% | {PUBLISHED_GAINS.get(r['dp'], '')} |")
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """Markdown table of the results: TGS, gains, single-sample-bound share, and per method (reference / ours) the
    GB moved per step, the share of the step the exchange would take if not hidden, and the gain with it shown."""
    rows = result["results"]
    la = "tgs_lookahead" in rows[0]
    head = ("| DP | steps | TGS none | TGS reference (over cap) | TGS reference capped | TGS ours | TGS ceiling "
            "| gain ref | gain ref capped | gain ours | single-sample-bound | GB moved/step ref / ours "
            "| exchange share ref / ours | gain, exchange shown, ref / ours |")
    sep = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if la:
        head += " TGS look-ahead | gain look-ahead | single-bound look-ahead |"
        sep += "---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = (
            f"| {r['dp']} | {r['steps']} | {r['tgs_none']:.0f} | {r['tgs_reference']:.0f} "
            f"({100 * r['over_cap_share_reference']:.0f}%) | {r['tgs_reference_capped']:.0f} | {r['tgs_ours']:.0f} | "
            f"{r['tgs_lower_bound']:.0f} | {100 * r['gain_reference']:+.1f}% | {100 * r['gain_reference_capped']:+.1f}% | "
            f"{100 * r['gain_ours']:+.1f}% | {100 * r['single_sample_bound_share']:.0f}% | "
            f"{r['gb_moved_per_step_reference']:.2f} / {r['gb_moved_per_step_ours']:.2f} | "
            f"{100 * r['exchange_share_reference']:.1f}% / {100 * r['exchange_share_ours']:.1f}% | "
            f"{100 * r['gain_reference_exchange_shown']:+.1f}% / {100 * r['gain_ours_exchange_shown']:+.1f}% |"
        )
        if la:
            line += (
                f" {r['tgs_lookahead']:.0f} | {100 * r['gain_lookahead']:+.1f}% | "
                f"{100 * r['single_sample_bound_share_lookahead']:.0f}% |"
            )
        lines.append(line)
    return "\n".join(lines)


# --------------------------------------------------------------------------- user lengths


def load_lengths(spec: str) -> np.ndarray:
    """A user's own sample lengths (tokens), as int64.

    ``spec`` is ``dataset:PATH:COLUMN`` (a `datasets` dataset saved with
    ``save_to_disk`` at PATH, or a local data file / folder that ``load_dataset``
    reads, with COLUMN holding lengths, or token lists whose lengths are taken)
    or the path of a text file with one length per line. Loads from disk only.
    """
    if spec.startswith("dataset:"):
        rest = spec[len("dataset:"):]
        path, sep, column = rest.rpartition(":")
        if not sep or not path or not column:
            raise ValueError(f"--lengths-from {spec!r}: expected dataset:PATH_OR_NAME:COLUMN")
        values = _dataset_column(path, column)
        source = f"column {column!r} of {path}"
    else:
        if not os.path.isfile(spec):
            raise ValueError(f"--lengths-from {spec!r}: no such file (or use dataset:PATH:COLUMN)")
        values = []
        with open(spec, "r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    values.append(float(line))
                except ValueError:
                    raise ValueError(f"--lengths-from {spec}: line {lineno} is not a number: {line!r}") from None
        source = spec
    lengths = np.asarray(values, dtype=np.float64)
    if lengths.size == 0:
        raise ValueError(f"--lengths-from: {source} holds no lengths")
    bad = np.flatnonzero(~np.isfinite(lengths) | (lengths < 1) | (lengths != np.round(lengths)))
    if bad.size:
        raise ValueError(f"--lengths-from: {source}, sample {int(bad[0])} has length {lengths[bad[0]]:g} (need an integer >= 1)")
    return lengths.astype(np.int64)


def _dataset_column(path: str, column: str):
    import datasets  # imported here: the simulator's other paths need no `datasets`

    if os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "state.json"))
        or os.path.exists(os.path.join(path, "dataset_dict.json"))
    ):
        ds = datasets.load_from_disk(path)
    elif os.path.exists(path):
        ds = datasets.load_dataset(path) if os.path.isdir(path) else datasets.load_dataset(
            _builder_for(path), data_files=path
        )
    else:
        raise ValueError(f"--lengths-from dataset:{path}:{column}: no such path (datasets are loaded from disk only)")
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else sorted(ds)[0]
        ds = ds[split]
    if column not in ds.column_names:
        raise ValueError(f"--lengths-from dataset:{path}:{column}: no column {column!r}; columns are {ds.column_names}")
    values = ds[column]
    values = list(values) if not isinstance(values, list) else values
    if values and isinstance(values[0], (list, tuple, np.ndarray)):
        return [len(v) for v in values]  # token lists: their lengths
    return values


def _builder_for(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "txt": "text", "arrow": "arrow"}.get(ext, ext)
