"""On real kernels, how much faster is the slowest rank? One command for one GPU (an H200, under 8 minutes).

1. Calibration (`bench/gpu_calibrate.py`'s): a Qwen2-VL-2B-sized decoder and vision tower from the published
   sizes, random weights, bf16, flash-attention-2 varlen when installed else the library's varlen attention
   over SDPA; forward + backward timed with CUDA events; held-out errors of the per-rank and step-time fits;
   the fitted quadratic/linear ratio beside the FLOP prior's.
2. Virtual data parallelism on the one device: for P = 8 and 32 ranks, steps of a long-tail multimodal mix in
   fixed-length packs (32K tokens scaled down to --pack), each rank's micro-batches built the way each method
   would (`bench/gpu_methods.py`: none, transformers' batch_rebalance, hf_dp_balance's plan from the fitted
   models, and a plan on the costs measured in this run); every rank's micro-batches run one after another
   with real kernels (decoder over the packed row, vision tower over its frames); per step the slowest
   rank's device time and the mean rank's, per method.
3. The host side beside it (`bench/gpu_host.py`): plan_step at P = 8, 32 and DP 4096, one rank's
   BatchRebalanceSampler pass, and the exchange's encode / decode of the moved samples.

One table printed (and written with --json). `--tiny` runs the same code on CPU: tiny configs, float32, thread
CPU time, small packs (a check of the code path, under a minute; its numbers say nothing about a GPU).

    python bench/gpu_check.py --json gpu_check.json            # one GPU
    python bench/gpu_check.py --tiny --json gpu_check_tiny.json   # CPU, tiny configs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np
from tqdm import tqdm

import gpu_calibrate
import gpu_host
import gpu_methods
from hf_dp_balance.testing.mix import mix_names
from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fitting import fit_cost_model

RANKS = (8, 32)
# Per size: pack tokens, steps, calibration packs (fitted), repeats, seconds for the whole run (the steps of
# the virtual runs are cut to what the fitted models predict fits in what is left after the calibration).
SIZES = {"gpu": dict(pack=8192, steps=4, packs=32, fit_packs=16, repeats=2, budget_s=420.0),
         "tiny": dict(pack=256, steps=2, packs=8, fit_packs=5, repeats=1, budget_s=120.0)}
HOST_RESERVE_S = 20.0  # the host-side part after the virtual runs
LARGE_DP = 4096


class DeviceRanks:
    """Runs each rank's micro-batches one after another on the device; keeps every micro-batch's features
    and time per module (what the `measured` plan is fitted on)."""

    def __init__(self, bench, decoder_run, vision_run, bar):
        self.bench, self.decoder_run, self.vision_run, self.bar = bench, decoder_run, vision_run, bar
        self.observed: Dict[str, List] = {"decoder": [], "vision": []}

    def run(self, samples, frames, batches, where: str) -> tuple:
        """(seconds per rank, sample ids trained) of one method's step; `where` names it in errors."""
        seconds, trained = [], []
        for r, per_rank in enumerate(batches):
            total = 0.0
            for m, mb in enumerate(per_rank):
                lengths = samples.tokens[mb].tolist()
                mb_frames = [p for i in mb.tolist() for p in frames[i]]
                try:
                    total += self._time("decoder", self.decoder_run, lengths)
                    total += self._time("vision", self.vision_run, mb_frames)
                except Exception as exc:  # out of memory above all: say which micro-batch, then stop
                    raise RuntimeError(f"{where}, rank {r}, micro-batch {m}: {len(lengths)} samples, "
                                       f"{sum(lengths)} tokens, {sum(mb_frames)} patches: {exc}") from exc
                trained += mb.tolist()
                self.bar.update(1)
            seconds.append(total)
        return seconds, sorted(trained)

    def _time(self, module: str, prepare, items) -> float:
        if not items:
            return 0.0
        t = self.bench.timer(prepare(items))
        self.observed[module].append((features_of(items), t))
        return t

    def measured_model(self, module: str) -> Optional[CostModel]:
        """Per-rank fit (no prior) on every micro-batch of `module` timed so far (None: none timed)."""
        if not self.observed[module]:
            return None
        feats = np.stack([f for f, _ in self.observed[module]])
        times = np.array([t for _, t in self.observed[module]])
        return fit_cost_model(feats[:, None, :], times[:, None], mode="per_rank", holdout=0).model


def _gain(a: float, b: float) -> Optional[float]:
    """1 - a / b: how much lower `a` is than `b` (None when b is 0)."""
    return 1.0 - a / b if b > 0 else None


def summarize(record: Dict[str, dict], moved: Dict[str, List[int]]) -> dict:
    """Rows per method (sums over steps) and the gains of hf_dp_balance."""
    rows = {}
    for method, r in record.items():
        slow = np.array([max(s) for s in r["rank_s"]])
        mean = np.array([np.mean(s) for s in r["rank_s"]])
        rows[method] = {"slowest_s": float(slow.sum()), "mean_s": float(mean.sum()),
                        "imbalance": float(slow.sum() / mean.sum() - 1.0) if mean.sum() > 0 else None,
                        "moved_per_step": float(np.mean(moved[method])) if method in moved else None,
                        "per_step_slowest_s": slow.tolist(), "per_step_mean_s": mean.tolist(),
                        "samples_per_step": r["samples"]}
    none, ours = rows["none"]["slowest_s"], rows["hf_dp_balance"]["slowest_s"]
    cut = none - rows["measured"]["slowest_s"]
    gains = {"vs_none": _gain(ours, none), "vs_batch_rebalance": _gain(ours, rows["batch_rebalance"]["slowest_s"]),
             "measured_vs_none": _gain(rows["measured"]["slowest_s"], none),
             "share_of_measured_cut": (none - ours) / cut if cut > 0 else None}
    for method, row in rows.items():
        row["vs_none"] = _gain(row["slowest_s"], none)
    return {"methods": rows, "gains": gains}


def run_ranks(device: DeviceRanks, samples, steps, costs, ranks: int, ga: int, config) -> tuple:
    """Every method's micro-batches of these steps on the device, rank after rank: (summary, hf_dp_balance's
    batches per step). The `measured` plan comes last: it is fitted on every micro-batch timed before it."""
    frames = gpu_methods.frames_per_sample(samples)
    record = {m: {"rank_s": [], "samples": []} for m in gpu_methods.METHODS}
    # samples the exchange moves; batch_rebalance's ranks read their own samples (nothing is sent)
    moved = {"none": [0], "hf_dp_balance": [], "measured": []}

    def run(method, batches):
        device.bar.set_description(f"P={ranks} {method}")
        where = f"P={ranks} {method} step {len(record[method]['rank_s']) + 1}"
        seconds, trained = device.run(samples, frames, batches, where)
        record[method]["rank_s"].append(seconds)
        record[method]["samples"].append(trained)

    ours = []
    for k, step in enumerate(steps):
        planned, n_moved = gpu_methods.planned_batches(step, costs, samples.tokens, ranks, ga, config)
        ours.append(planned)
        moved["hf_dp_balance"].append(n_moved)
        ways = {"none": gpu_methods.none_batches(step, ranks, ga),
                "batch_rebalance": gpu_methods.rebalance_batches(step, samples.tokens, ranks, ga),
                "hf_dp_balance": planned}
        for method in list(ways)[k % 3:] + list(ways)[:k % 3]:  # no method always runs right after another
            run(method, ways[method])
    measured_costs = gpu_methods.sample_costs(samples, device.measured_model("decoder"),
                                              device.measured_model("vision"))
    for step in steps:
        batches, n_moved = gpu_methods.planned_batches(step, measured_costs, samples.tokens, ranks, ga, config)
        moved["measured"].append(n_moved)
        run("measured", batches)
    return summarize(record, moved), ours


def _steps_in_budget(drawn: Dict[int, tuple], decoder, vision, ranks_ga: int, budget_s: float, wanted: int) -> int:
    """Steps (at least 1) whose predicted device time over all ranks and methods fits `budget_s`."""
    per_step = np.zeros(wanted)
    for ranks, (samples, steps) in drawn.items():
        costs = gpu_methods.sample_costs(samples, decoder, vision)
        for k, s in enumerate(steps):
            constants = ranks * ranks_ga * (decoder.constant + vision.constant)
            per_step[k] += len(gpu_methods.METHODS) * (costs[s.ids].sum() + constants)
    return max(1, int(np.searchsorted(np.cumsum(per_step), budget_s, side="right")))


def run_check(args, bench, save=lambda result: None) -> dict:
    """The whole check; `save(result)` gets the result so far after the calibration and after each P (a
    run cut short by the lease or an error still leaves what it measured)."""
    size = SIZES["tiny" if args.tiny else "gpu"]
    pack, ga = args.pack or size["pack"], args.ga
    wall = time.perf_counter()
    print(bench.describe(), flush=True)
    decoder_run = gpu_calibrate.decoder_runner(bench.config, bench.device, bench.dtype)
    vision_run, frames_of = gpu_calibrate.vision_runner(bench.config, bench.device, bench.dtype)
    calibration = gpu_calibrate.calibrate_modules(
        bench, decoder_run, (vision_run, frames_of), (pack // 2, 2 * pack), (pack, 4 * pack), size["packs"],
        size["fit_packs"], size["repeats"], np.random.default_rng(args.seed))
    decoder = CostModel.from_dict(calibration["decoder"]["per-rank fit + prior"]["model"])
    vision = CostModel.from_dict(calibration["vision"]["per-rank fit + prior"]["model"])
    config = DPBalanceConfig()
    wanted = args.steps or size["steps"]
    drawn = {p: gpu_methods.draw_steps(args.mix, p, ga, wanted, pack, np.random.default_rng([args.seed, p]),
                                       frames_of) for p in RANKS}
    budget = (args.budget_s or size["budget_s"]) - (time.perf_counter() - wall) - HOST_RESERVE_S
    steps = _steps_in_budget(drawn, decoder, vision, ga, budget, wanted)
    if steps < wanted:
        print(f"{steps} of {wanted} steps fit the device budget (predicted by the fitted models)", flush=True)
    result = {"settings": {"device": bench.describe(), "tiny": bool(args.tiny), "mix": args.mix, "pack": pack,
                           "scale_of_32k": pack / gpu_methods.PUBLISHED_PACK, "ga": ga, "steps": steps,
                           "steps_wanted": wanted, "budget_s": args.budget_s or size["budget_s"],
                           "ranks": list(RANKS), "seed": args.seed, "large_dp": args.large_dp,
                           "clock": bench.timer.clock},
              "calibration": {m: _calibration_row(c) for m, c in calibration.items()}, "virtual_dp": {}}
    save(result)
    host_inputs = {}
    units = len(gpu_methods.METHODS) * steps * ga * sum(RANKS)
    with tqdm(total=units, desc="virtual ranks", unit="micro-batch", file=sys.stderr, mininterval=1.0) as bar:
        device = DeviceRanks(bench, decoder_run, vision_run, bar)
        for p in RANKS:
            samples, all_steps = drawn[p]
            costs = gpu_methods.sample_costs(samples, decoder, vision)
            result["virtual_dp"][str(p)], batches = run_ranks(device, samples, all_steps[:steps], costs, p, ga,
                                                              config)
            host_inputs[p] = {"samples": samples, "steps": all_steps[:steps], "costs": costs, "batches": batches}
            save(result)
    vc = bench.config.vision_config
    result["host"] = gpu_host.host_costs(host_inputs, args.mix, ga, decoder, vision, config, args.seed,
                                         args.large_dp, bench.dtype, 3 * vc.temporal_patch_size * vc.patch_size ** 2)
    result["wall_s"] = time.perf_counter() - wall
    save(result)
    return result


def _calibration_row(c: dict) -> dict:
    q = c["quadratic_over_linear"]
    return {"per_rank_pack_mape": c["per-rank fit"]["pack_mape"],
            "per_rank_prior_pack_mape": c["per-rank fit + prior"]["pack_mape"],
            "per_rank_prior_step_mape": c["per-rank fit + prior"]["step_mape"],
            "step_time_prior_step_mape": c["step-time fit + prior"]["step_mape"],
            "single_sample_mape": c["per-rank fit + prior"]["single_mape"],
            "quadratic_over_linear_fitted": _finite(q["per-rank fit"]),
            "quadratic_over_linear_fitted_with_prior": _finite(q["per-rank fit + prior"]),
            "quadratic_over_linear_prior": _finite(q["prior"]), "effective_tflops": _finite(c["effective_tflops"]),
            "model": c["per-rank fit + prior"]["model"]}


def _finite(x: float) -> Optional[float]:
    """x, or None where it is not finite (a fitted linear term of 0 makes the ratio infinite); JSON-safe."""
    return float(x) if np.isfinite(x) else None


def _num(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _pct(x: Optional[float]) -> str:
    return "   n/a" if x is None else f"{100 * x:5.1f}%"


def _count(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1f}"


def _cut(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * abs(x):.1f}% {'lower' if x >= 0 else 'higher'}"


def format_table(result: dict) -> str:
    s = result["settings"]
    lines = [f"GPU check ({s['device']}); mix {s['mix']} in packs of {s['pack']} tokens (32K x {s['scale_of_32k']:g}),"
             f" GA {s['ga']}, {s['steps']} steps per P; device seconds summed over the steps",
             "", f"{'calibration':14s}{'per-rank':>10s}{'+prior':>9s}{'step fit':>10s}{'single':>9s}"
             f"{'q/l fitted':>12s}{'q/l prior':>11s}{'fitted/prior':>13s}"]
    for module, c in result["calibration"].items():
        fitted, prior = c["quadratic_over_linear_fitted"], c["quadratic_over_linear_prior"]
        ratio = fitted / prior if fitted is not None and prior else None
        lines.append(f"{module:14s}{_pct(c['per_rank_pack_mape']):>10s}{_pct(c['per_rank_prior_pack_mape']):>9s}"
                     f"{_pct(c['step_time_prior_step_mape']):>10s}{_pct(c['single_sample_mape']):>9s}"
                     f"{_num(fitted):>12s}{_num(prior):>11s}{_num(ratio):>13s}")
    lines += ["", f"{'P':>3s} {'method':16s}{'slowest s':>10s}{'mean s':>9s}{'imbalance':>10s}{'vs none':>9s}"
                  f"{'moved/step':>11s}   per step: slowest / mean rank (s)"]
    for p, run in result["virtual_dp"].items():
        for method, r in run["methods"].items():
            lines.append(f"{p:>3s} {method:16s}{r['slowest_s']:10.4g}{r['mean_s']:9.4g}{_pct(r['imbalance']):>10s}"
                         f"{_pct(r['vs_none']):>9s}{_count(r['moved_per_step']):>11s}   "
                         + "  ".join(f"{a:.3g}/{b:.3g}"
                                     for a, b in zip(r["per_step_slowest_s"], r["per_step_mean_s"])))
        g = run["gains"]
        lines.append(f"{'':4s}hf_dp_balance's slowest rank: {_cut(g['vs_none'])} than none, "
                     f"{_cut(g['vs_batch_rebalance'])} than batch_rebalance; {_pct(g['share_of_measured_cut']).strip()}"
                     f" of the cut of a plan on the measured costs ({_cut(g['measured_vs_none'])} than none)")
    h = result["host"]
    lines += ["", f"{'host per step':14s}{'plan_step ms':>13s}{'sampler ms':>11s}{'codec ms':>9s}{'moved MiB':>10s}"
                  f"{'of the step':>12s}"]
    for p in result["virtual_dp"]:
        r, run = h[p], result["virtual_dp"][p]["methods"]["hf_dp_balance"]
        step_s = run["slowest_s"] / max(1, len(run["per_step_slowest_s"]))
        share = (r["plan_s"] + r["codec_slowest_rank_s"]) / step_s if step_s > 0 else float("nan")
        lines.append(f"{'P=' + p:14s}{1e3 * r['plan_s']:13.2f}{1e3 * r['batch_rebalance_sampler_s']:11.1f}"
                     f"{1e3 * r['codec_slowest_rank_s']:9.2f}{r['moved_mib_per_step']:10.2f}{_pct(share):>12s}")
    big = h["large"]
    lines.append(f"{'DP ' + str(big['ranks']):14s}{1e3 * big['plan_s']:13.2f}   ({big['samples']} samples in "
                 f"32K packs, planned with the fitted models)")
    lines.append(f"\nwall time {result['wall_s']:.0f} s")
    return "\n".join(lines)


def _check_args(parser, args) -> None:
    """Refuse bad options before minutes of device time are spent."""
    if args.mix not in mix_names():
        parser.error(f"--mix {args.mix!r}: unknown; choose one of {', '.join(mix_names())}")
    for name in ("pack", "ga", "steps", "large_dp", "budget_s"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be > 0")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: its folder does not exist")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny configs, float32: checks the code path")
    parser.add_argument("--json", metavar="PATH", help="also write the table and the per-step numbers as JSON")
    parser.add_argument("--mix", default="qwen2vl-sft", help="a mix of hf_dp_balance.testing.mix (default long tail)")
    parser.add_argument("--pack", type=int, default=None, help="pack tokens (default 8192, --tiny 256)")
    parser.add_argument("--ga", type=int, default=1, help="gradient-accumulation micro-batches per step")
    parser.add_argument("--steps", type=int, default=None, help="steps per P (default 4, --tiny 2; fewer when "
                                                                 "they do not fit --budget-s)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole run (default 420, --tiny 120): fewer steps when they do not fit")
    parser.add_argument("--large-dp", type=int, default=LARGE_DP, help="DP size of the planning-time row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _check_args(parser, args)
    bench = gpu_calibrate.bench_setup(args.tiny)
    if bench is None:
        print("gpu_check: no CUDA device (use --tiny to check the code path on CPU)", file=sys.stderr)
        return 2
    result = run_check(args, bench, save=lambda partial: _write_json(args.json, partial))
    print("\n" + format_table(result))
    return 0


def _write_json(path: Optional[str], result: dict) -> None:
    """Write (replace) the JSON of the result so far; nothing without --json."""
    if path:
        with open(path + ".part", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".part", path)


if __name__ == "__main__":
    raise SystemExit(main())
