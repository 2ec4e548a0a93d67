"""`hf-dp-balance simulate`: the what-if gain of balancing at DP 8..4096, before renting the GPUs.

This module is the report (markdown table, plot) and the command line; the model of a step is in
`sim_model`, the runs in `sim_runs`; what the numbers mean is in docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import List

from hf_dp_balance.apps.mixes import load_lengths, mix_names
from hf_dp_balance.apps.sim_model import COST_PRESETS, DEFAULT_BANDWIDTH_GBS, load_cost
from hf_dp_balance.apps.sim_runs import simulate

# --------------------------------------------------------------------------- plot


def plot_results(result: dict, path: str) -> None:
    """TGS against DP size (log2 x axis), one line per method; gains annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["results"]
    dp = [r["dp"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    lines = [
        ("tgs_none", "no balancing", "tab:gray", "o"),
        ("tgs_reference", "reference (published skip rules, 1.2x avg token cap)", "tab:orange", "s"),
        ("tgs_reference_capped", "reference held to the per-rank cap", "tab:red", "v"),
        ("tgs_ours", "plan_balance", "tab:blue", "^"),
        ("tgs_lookahead", f"plan_balance + look-ahead K={result['settings'].get('lookahead')}", "tab:green", "D"),
        ("tgs_lower_bound", "lower bound", "black", None),
    ]
    for key, label, color, marker in lines:
        if key not in rows[0]:
            continue
        style = dict(color=color, marker=marker, label=label)
        if key == "tgs_lower_bound":
            style.update(linestyle=":", marker=None)
        ax.plot(dp, [r[key] for r in rows], **style)
    for r in rows:
        ax.annotate(f"+{100 * r['gain_ours']:.1f}%", (r["dp"], r["tgs_ours"]), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=8, color="tab:blue")
    ax.set_xscale("log", base=2)
    ax.set_xticks(dp)
    ax.set_xticklabels([str(d) for d in dp])
    ax.set_xlabel("data-parallel size")
    ax.set_ylabel("tokens per GPU per second")
    s = result["settings"]
    ax.set_title(f"mix {s['mix']}, pack {s['pack']}, GA {s['ga']}, cost {s['cost']['name']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", type=_dp_list, default=[32, 64, 128, 256, 512, 1024],
                        help="comma-separated data-parallel sizes (default 32,...,1024)")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--mix", choices=mix_names(), default=None, help="sample mix (default qwen2vl-sft)")
    src.add_argument("--lengths-from", default=None, metavar="SPEC",
                     help="your own lengths: dataset:PATH_OR_NAME:COLUMN (from disk) or a text file, one per line")
    parser.add_argument("--pack", type=_positive_int, default=32768, help="tokens per fixed-length pack (= per-rank cap)")
    parser.add_argument("--max-tokens", type=_positive_int, default=None,
                        help="hard per-rank token cap of plan_balance (default: --pack)")
    parser.add_argument("--ga", type=_positive_int, default=1, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--cost", default="7b",
                        help=f"cost preset ({', '.join(COST_PRESETS)}) or a fitted CostModel JSON (seconds)")
    parser.add_argument("--steps", type=_positive_int, default=None,
                        help="steps per DP size (default clip(32768 // (dp*ga), 16, 256))")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lookahead", type=_non_negative_int, default=0, metavar="K",
                        help="also simulate look-ahead over windows of K steps (0/1 = off)")
    parser.add_argument("--sync", choices=("step", "micro_batch"), default="step",
                        help="ranks meet once per step (DDP) or every micro-batch (FSDP / ZeRO-3)")
    parser.add_argument("--step-overhead", type=float, default=None,
                        help="fixed seconds per step that balancing does not change (default: the preset's)")
    parser.add_argument("--bandwidth", type=_positive_float, default=DEFAULT_BANDWIDTH_GBS,
                        help="GB/s per GPU for moving samples (default 25)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="charge the whole exchange time (default: hidden behind the previous step's compute)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write settings and results as JSON")
    parser.add_argument("--plot", default=None, metavar="PATH", help="write a PNG: TGS against DP size")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.step_overhead is not None and not (args.step_overhead >= 0 and math.isfinite(args.step_overhead)):
        raise SystemExit(f"hf-dp-balance simulate: error: --step-overhead {args.step_overhead}: must be >= 0")
    try:
        source = load_lengths(args.lengths_from) if args.lengths_from else (args.mix or "qwen2vl-sft")
        cost = load_cost(args.cost, args.step_overhead)
        result = simulate(
            source, args.dp, cost, pack=args.pack, ga=args.ga, steps=args.steps, seed=args.seed,
            lookahead=args.lookahead, sync=args.sync, bandwidth_gbs=args.bandwidth,
            overlap=not args.no_overlap, max_tokens=args.max_tokens, progress=not args.no_progress,
        )
    except ValueError as e:
        raise SystemExit(f"hf-dp-balance simulate: error: {e}") from None
    if args.lengths_from:
        result["settings"]["mix"] = f"lengths from {args.lengths_from}"
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    if args.plot:
        plot_results(result, args.plot)
    return 0


def format_table(result: dict) -> str:
    """Markdown table of the results (TGS, gains, single-sample-bound share)."""
    rows = result["results"]
    la = "tgs_lookahead" in rows[0]
    head = ("| DP | steps | TGS none | TGS reference (over cap) | TGS reference capped | TGS ours | lower bound "
            "| gain ref | gain ref capped | gain ours | single-sample-bound |")
    sep = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if la:
        head += " TGS look-ahead | gain look-ahead | single-bound look-ahead |"
        sep += "---:|---:|---:|"
    lines = [head, sep]
    for r in rows:
        line = (
            f"| {r['dp']} | {r['steps']} | {r['tgs_none']:.0f} | {r['tgs_reference']:.0f} "
            f"({100 * r['over_cap_share_reference']:.0f}%) | {r['tgs_reference_capped']:.0f} | {r['tgs_ours']:.0f} | "
            f"{r['tgs_lower_bound']:.0f} | {100 * r['gain_reference']:+.1f}% | {100 * r['gain_reference_capped']:+.1f}% | "
            f"{100 * r['gain_ours']:+.1f}% | {100 * r['single_sample_bound_share']:.0f}% |"
        )
        if la:
            line += (
                f" {r['tgs_lookahead']:.0f} | {100 * r['gain_lookahead']:+.1f}% | "
                f"{100 * r['single_sample_bound_share_lookahead']:.0f}% |"
            )
        lines.append(line)
    return "\n".join(lines)
