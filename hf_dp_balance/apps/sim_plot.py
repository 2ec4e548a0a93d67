"""The simulator's plot: TGS against DP size per method (gains annotated), and each method's step split into
its parts (compute, all-reduce, optimizer, fixed, exchange) at every DP size."""

from __future__ import annotations

import numpy as np

from hf_dp_balance.apps.sim_price import PARTS

# (row key, legend label, colour, marker, line style); the table calls ours "ours" too.
_LINES = [
    ("none", "no balancing", "tab:gray", "o", "-"),
    ("reference", "reference (published skip rules, 1.2x avg token cap)", "tab:orange", "s", "-"),
    ("reference_capped", "reference held to the per-rank cap", "tab:red", "v", "--"),
    ("ours", "ours (plan_balance)", "tab:blue", "^", "-"),
    ("lookahead", "ours + look-ahead", "tab:green", "D", "-"),
]
_PART_COLOURS = {"compute": "tab:blue", "allreduce": "tab:purple", "optimizer": "tab:brown", "fixed": "tab:gray",
                 "exchange": "tab:red"}
_BAR_METHODS = (("none", "none"), ("reference", "ref"), ("ours", "ours"))


def plot_results(result: dict, path: str) -> None:
    """Write the two-panel PNG of a `simulate` result to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8.4), dpi=100, gridspec_kw={"height_ratios": [1.15, 1]})
    _throughput(top, result)
    _step_parts(bottom, result)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _throughput(ax, result: dict) -> None:
    rows = result["results"]
    dp = [r["dp"] for r in rows]
    for key, label, colour, marker, style in _LINES:
        if f"tgs_{key}" not in rows[0]:
            continue
        # the capped reference often lies on the reference: hollow markers and a dashed line keep both visible
        hollow = dict(markerfacecolor="none", markersize=9) if key == "reference_capped" else {}
        ax.plot(dp, [r[f"tgs_{key}"] for r in rows], color=colour, marker=marker, linestyle=style, label=label,
                zorder=3 if key == "reference" else 2, **hollow)
    ax.plot(dp, [r["tgs_lower_bound"] for r in rows], color="black", linestyle=":",
            label="ceiling: best placement within each step")
    for r in rows:  # ours above its point, the reference below its own
        ax.annotate(f"{100 * r['gain_ours']:+.1f}%", (r["dp"], r["tgs_ours"]), textcoords="offset points",
                    xytext=(0, 7), ha="center", fontsize=8, color="tab:blue")
        ax.annotate(f"{100 * r['gain_reference']:+.1f}%", (r["dp"], r["tgs_reference"]), textcoords="offset points",
                    xytext=(0, -13), ha="center", fontsize=8, color="tab:orange")
    top = max(max(r["tgs_lower_bound"], r["tgs_ours"]) for r in rows)
    ax.set_ylim(0, top * 1.15)  # from 0, with room for the top label
    _dp_axis(ax, dp)
    ax.set_ylabel("tokens per GPU per second")
    s = result["settings"]
    ax.set_title(f"mix {s['mix']}, pack {s['pack']}, GA {s['ga']}, cost {s['cost']['name']}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")


def _step_parts(ax, result: dict) -> None:
    rows = result["results"]
    x = np.arange(len(rows))
    width = 0.8 / len(_BAR_METHODS)
    for j, (method, short) in enumerate(_BAR_METHODS):
        pos = x + (j - (len(_BAR_METHODS) - 1) / 2) * width
        bottom = np.zeros(len(rows))
        for part in PARTS:
            heights = np.array([r[f"step_parts_s_{method}"][part] for r in rows])
            ax.bar(pos, heights, width * 0.92, bottom=bottom, color=_PART_COLOURS[part],
                   label=part if j == 0 else None)
            bottom += heights
        for p, h in zip(pos, bottom):
            ax.text(p, h, short, ha="center", va="bottom", fontsize=6)
    ax.set_xticks(x)
    ax.set_xticklabels([str(r["dp"]) for r in rows])
    ax.set_xlabel("data-parallel size (bars: none, reference, ours)")
    ax.set_ylabel("seconds per step")
    ax.set_title("step time by part (exchange: the part not hidden behind the step)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    tallest = max(sum(r[f"step_parts_s_{m}"].values()) for r in rows for m, _ in _BAR_METHODS)
    ax.set_ylim(0, tallest * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=len(PARTS), loc="upper left")


def _dp_axis(ax, dp) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(dp)
    ax.set_xticklabels([str(d) for d in dp])
    ax.set_xlabel("data-parallel size")
