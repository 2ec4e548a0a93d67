"""Analysis of the demo's runs (pure): per-way summaries, the placement bound and reachable cut, the invariants,
the table, the headline and the plot. What the numbers mean: docs/usage.md (the demo)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

WAYS = ("none", "batch_rebalance", "hf_dp_balance")
LOSS_RTOL = 1e-4  # per-step loss agreement across ways (float32 summation order differs)


def summarize_way(compute: np.ndarray, tokens_per_step: np.ndarray, losses: Sequence[float],
                  samples_per_step: Sequence[Sequence[int]], moved_samples: int, warmup: int) -> dict:
    """One way's numbers over the compared steps (after `warmup`), the `all_steps_*` sums over every step
    (warm-up included: what a user's run pays); per-step arrays over all steps.

    compute: [steps, ranks] seconds; tokens_per_step: [steps].
    """
    compute = np.asarray(compute, dtype=np.float64)
    sl = slice(warmup, None)
    slowest = compute.max(axis=1)
    mean = compute.mean(axis=1)
    slowest_s = float(slowest[sl].sum())
    return {
        "slowest_rank_compute_s": slowest_s,
        "mean_rank_compute_s": float(mean[sl].sum()),
        "imbalance": float(slowest[sl].sum() / max(mean[sl].sum(), 1e-12) - 1.0),
        "samples_trained": int(sum(len(s) for s in samples_per_step[sl])),
        "tokens_trained": int(np.asarray(tokens_per_step)[sl].sum()),
        "tokens_per_s": float(np.asarray(tokens_per_step)[sl].sum() / max(slowest_s, 1e-12)),
        "all_steps_slowest_rank_compute_s": float(slowest.sum()),
        "all_steps_mean_rank_compute_s": float(mean.sum()),
        "warmup_slowest_rank_compute_s": float(slowest[:warmup].sum()),
        "moved_samples": int(moved_samples),
        "losses": [float(x) for x in losses],
        "per_step_slowest_s": slowest.tolist(),
        "per_step_mean_s": mean.tolist(),
        "per_rank_compute_s": compute.tolist(),
        "samples_per_step": [sorted(int(i) for i in s) for s in samples_per_step],
    }


def placement_bound(costs: np.ndarray, samples_per_step: Sequence[Sequence[int]], ranks: int) -> List[float]:
    """Per step: the least slowest-rank excess over the mean any placement of its samples can reach.

    max(heaviest sample, total / ranks) / (total / ranks) - 1, with `costs` per sample id (the fitted
    models' prediction). Above 0 only where one sample outweighs a rank's whole share: then no per-step
    balancing can go lower (only moving samples to other steps could). O(samples).
    """
    costs = np.asarray(costs, dtype=np.float64)
    out = []
    for ids in samples_per_step:
        c = costs[np.asarray(ids, dtype=np.int64)] if len(ids) else np.zeros(1)
        share = c.sum() / ranks
        out.append(float(max(c.max(), share) / share - 1.0) if share > 0 else 0.0)
    return out


def reachable_cut(costs: np.ndarray, none_rank_samples: Sequence[Sequence[Sequence[int]]],
                  ranks: int, step_constant: float = 0.0) -> dict:
    """How far below fixed-length packs any per-step placement can bring the slowest rank (predicted).

    `none_rank_samples[k][r]`: sample ids rank r trained in step k under fixed-length packs; `costs`
    per sample id and `step_constant` per rank-step come from the fitted models. Returns
    ``none_predicted_s`` (sum over steps of none's slowest rank), ``bound_s`` (sum over steps of
    max(heaviest sample, share) + constant: no placement of a step's samples does better) and
    ``ceiling`` = 1 - bound_s / none_predicted_s, the largest cut per-step balancing can make on
    these steps. Both sums use the same model, so its error mostly cancels in the ratio. O(samples).
    """
    costs = np.asarray(costs, dtype=np.float64)
    none_s = bound_s = 0.0
    for per_rank in none_rank_samples:
        loads = np.array([costs[np.asarray(ids, dtype=np.int64)].sum() if len(ids) else 0.0 for ids in per_rank])
        ids = [i for r in per_rank for i in r]
        heaviest = float(costs[np.asarray(ids, dtype=np.int64)].max()) if ids else 0.0
        none_s += float(loads.max()) + step_constant
        bound_s += max(heaviest, float(loads.sum()) / ranks) + step_constant
    return {"none_predicted_s": none_s, "bound_s": bound_s,
            "ceiling": 1.0 - bound_s / none_s if none_s > 0 else 0.0}


def check_invariants(runs: Dict[str, dict], reference: str = "none", rtol: float = LOSS_RTOL,
                     window: int = 1, window_from: Optional[int] = None, windowed: Sequence[str] = ()) -> dict:
    """Same sample ids in every step of every way; per-step losses equal to the reference's within `rtol`.

    With look-ahead (`window` K > 1) the ways in `windowed` may train a sample in another step of its
    window (aligned windows of K steps from step index `window_from`): from there on their samples are
    compared per window and their losses are not compared (a reordered step trains other samples, and
    every later step starts from other weights). Steps before `window_from` are compared as usual.
    """
    ref = runs[reference]
    out = {"same_samples": True, "losses_equal": True, "max_loss_rel_diff": 0.0, "loss_rtol": rtol}
    if window > 1:
        out.update(window=window, windows_from_step=window_from, windowed=list(windowed))
    for name, run in runs.items():
        a, b = np.asarray(run["losses"]), np.asarray(ref["losses"])
        mine, theirs = run["samples_per_step"], ref["samples_per_step"]
        if window > 1 and name in windowed:
            cut = int(window_from)
            a, b = a[:cut], b[:cut]
            same = mine[:cut] == theirs[:cut] and len(mine) == len(theirs) and all(
                sorted(i for s in mine[w:w + window] for i in s) == sorted(i for s in theirs[w:w + window] for i in s)
                for w in range(cut, len(theirs), window))
        else:
            same = mine == theirs
        out["same_samples"] = out["same_samples"] and same
        if a.shape != b.shape:
            out["losses_equal"] = False
            continue
        rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))) if a.size else 0.0
        out["max_loss_rel_diff"] = max(out["max_loss_rel_diff"], rel)
        out["losses_equal"] = out["losses_equal"] and rel <= rtol
    return out


def format_table(runs: Dict[str, dict]) -> str:
    none = runs["none"]["slowest_rank_compute_s"]
    lines = [f"{'way':<16}{'slowest rank s':>15}{'mean rank s':>13}{'imbalance':>11}{'samples':>9}"
             f"{'tokens/s':>10}{'moved':>7}{'vs none':>9}"]
    for name, r in runs.items():
        lines.append(f"{name:<16}{r['slowest_rank_compute_s']:>15.3f}{r['mean_rank_compute_s']:>13.3f}"
                     f"{100 * r['imbalance']:>10.1f}%{r['samples_trained']:>9d}{r['tokens_per_s']:>10.0f}"
                     f"{r['moved_samples']:>7d}{100 * (r['slowest_rank_compute_s'] / none - 1):>+8.1f}%")
    return "\n".join(lines)


def assemble(by_rank: Dict[int, dict], ranks: int, steps: int, warmup: int, samples_per_rank: int, seed: int,
             mix: str, wall_s: float, lookahead: int = 0, model: str = "tiny Qwen2-VL") -> dict:
    """Combine the ranks' records into demo.json's content (pure).

    `by_rank[r][way]`: rank r's record of a way (per-step compute, sample ids, losses, moved samples);
    `by_rank[0]` also holds every sample's `tokens` and vision `patches`. `model` describes the model.
    """
    tokens = np.asarray(by_rank[0]["tokens"])
    runs = {}
    for way in WAYS:
        compute = np.array([by_rank[r][way]["compute"] for r in range(ranks)]).T  # [steps, ranks]
        samples = [sorted(s for r in range(ranks) for s in by_rank[r][way]["samples"][k])
                   for k in range(compute.shape[0])]
        step_tokens = np.array([tokens[s].sum() if s else 0 for s in samples])
        runs[way] = summarize_way(compute, step_tokens, by_rank[0][way]["losses"], samples,
                                  by_rank[0][way]["moved"], warmup)
    hf = by_rank[0]["hf_dp_balance"]
    runs["hf_dp_balance"].update({k: hf[k] for k in ("cost_model", "vision_cost_model", "vision_tower_balanced",
                                                      "fit_reports", "applied_steps", "balanced_loader") if k in hf})
    none, br, ours = (runs[w]["slowest_rank_compute_s"] for w in WAYS)
    all_none, all_br, all_ours = (runs[w]["all_steps_slowest_rank_compute_s"] for w in WAYS)
    bound = _placement_summary(by_rank, runs, ranks, warmup)
    return {
        "settings": {"ranks": ranks, "steps": steps, "warmup_steps": warmup, "samples_per_rank": samples_per_rank,
                     "samples_per_step": ranks * samples_per_rank, "seed": seed, "mix": mix,
                     "lookahead_steps": lookahead,
                     "model": model,
                     "compute": "thread CPU time of forward+backward+optimizer per rank per step"},
        "runs": runs,
        # every way trains the same samples, so the same work: no placement gets the slowest rank below the mean
        "gain": _gains(none, br, ours, runs["none"]["mean_rank_compute_s"]),
        # the same over every step, warm-up included (hf_dp_balance plans it with the FLOP prior)
        "gain_all_steps": _gains(all_none, all_br, all_ours, runs["none"]["all_steps_mean_rank_compute_s"]),
        "invariants": check_invariants(runs, window=lookahead, window_from=warmup, windowed=["hf_dp_balance"]),
        "placement_bound": bound,
        "wall_s": wall_s,
    }


def _gains(none: float, br: float, ours: float, none_mean: float) -> dict:
    """The cuts of demo.json from slowest-rank sums (s) of each way and none's mean-rank sum."""
    return {"vs_none": 1.0 - ours / none, "vs_batch_rebalance": 1.0 - ours / br,
            "batch_rebalance_vs_none": 1.0 - br / none, "perfect_balance_vs_none": 1.0 - none_mean / none}


def plot(result: dict, path: str) -> None:
    """Per-step slowest vs mean rank compute for each way, and below it the slowest rank summed from step 1
    (its last point is the all-steps headline) (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, total) = plt.subplots(2, 1, figsize=(9, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    colors = {"none": "tab:red", "batch_rebalance": "tab:orange", "hf_dp_balance": "tab:green"}
    warmup = result["settings"]["warmup_steps"]
    for way, run in result["runs"].items():
        x = np.arange(1, len(run["per_step_slowest_s"]) + 1)
        ax.plot(x, run["per_step_slowest_s"], "-", color=colors.get(way), label=f"{way}: slowest rank")
        ax.plot(x, run["per_step_mean_s"], "--", color=colors.get(way), alpha=0.6, label=f"{way}: mean rank")
        summed = np.cumsum(run["per_step_slowest_s"])
        total.plot(x, summed, "-", color=colors.get(way), label=f"{way}: {summed[-1]:.2f} s over all {x[-1]} steps")
    total.axvspan(0.5, warmup + 0.5, color="0.9")
    ax.axvspan(0.5, warmup + 0.5, color="0.9",
               label="warm-up (hf_dp_balance: the FLOP prior plans, hedged, until the gate adopts a fit)")
    total.set_xlabel("optimizer step")
    ax.set_ylabel("rank compute per step (s, thread CPU time)")
    total.set_ylabel("slowest rank, summed from step 1 (s)")
    s = result["settings"]
    ax.set_title(f"tiny Qwen2-VL, {s['ranks']} gloo ranks, {s['mix']} mix: slowest vs mean rank")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.02))  # below: the lines stay clear
    total.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pricing_models(hf: dict):
    """(decoder, vision) coefficient dicts that price the demo's reachable cut: of each module, the last fit
    on the run's timings (the most data), whether the gate adopted it or kept the model in force; the models in
    force where no fit is reported. None for a module never fitted."""
    decoder, vision = hf.get("cost_model"), hf.get("vision_cost_model")
    for report in hf.get("fit_reports") or []:
        fitted = report.get("fitted") or {}
        decoder = fitted.get("decoder") or decoder
        vision = fitted.get("vision") or vision
    return decoder, vision


def _placement_summary(by_rank: Dict[int, dict], runs: Dict[str, dict], ranks: int, warmup: int) -> Optional[dict]:
    """placement_bound of demo.json: per-step excess of the best placement, the reachable cut over the
    compared steps and (`all_steps`) over every step, priced by `pricing_models` (None before both were
    fitted)."""
    tokens = np.asarray(by_rank[0]["tokens"])
    decoder, vision = pricing_models(by_rank[0]["hf_dp_balance"])
    if decoder is None or vision is None or "patches" not in by_rank[0]:
        return None
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.core.costing import planning_costs

    costs = planning_costs(tokens, by_rank[0]["patches"], CostModel.from_dict(decoder), CostModel.from_dict(vision))
    per_step = placement_bound(costs, runs["none"]["samples_per_step"], ranks)
    excess = np.asarray(per_step)
    constant = decoder.get("constant", 0.0) + vision.get("constant", 0.0)
    none_rank_samples = [[by_rank[r]["none"]["samples"][k] for r in range(ranks)] for k in range(len(per_step))]
    # the fitted costs price every step's samples alike, warm-up steps included
    all_steps = {"steps": int(excess.size), "steps_bound_by_one_sample": int((excess > 0.02).sum()),
                 **reachable_cut(costs, none_rank_samples, ranks, constant)}
    return {"per_step_excess": per_step, "compared_steps_bound_by_one_sample": int((excess[warmup:] > 0.02).sum()),
            "compared_steps": int(excess[warmup:].size),
            **reachable_cut(costs, none_rank_samples[warmup:], ranks, constant), "all_steps": all_steps}


def _share(gain: float, bound: Optional[dict]) -> str:
    """" (N% of the M% reachable)" when the per-step placement bound leaves a cut to reach, else ""."""
    if not bound or not bound.get("ceiling", 0) > 0:
        return ""
    return f" ({100 * gain / bound['ceiling']:.0f}% of the {100 * bound['ceiling']:.1f}% reachable)"


def _cut(x: float) -> str:
    return f"{100 * abs(x):.1f}% {'lower' if x >= 0 else 'higher'}"


def _pct(x) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{100 * x:.1f}%"


def fit_lines(fit_reports: Sequence[dict]) -> List[str]:
    """One line per cost-model fit of hf_dp_balance: the step, what the gate decided, the held-out errors it
    compared (the fit's, the model in force's, the token count's) and whether the plans that follow are hedged."""
    lines = []
    for r in fit_reports:
        gate = r.get("gate")
        if not gate:
            lines.append(f"fit at step {r['step']}: no gate verdict (the fit failed)")
            continue
        verdict = "adopted" if gate["adopt"] else "rejected, the model in force stays"
        lines.append(f"fit at step {r['step']}: {verdict}; held-out error {_pct(gate['candidate_error'])} "
                     f"(in force {_pct(gate['in_force_error'])}, tokens {_pct(gate['tokens_error'])}); plans "
                     f"{'hedged' if r.get('hedged') else 'as fitted'} from then on ({gate['reason']})")
    return lines


def report_lines(result: dict) -> List[str]:
    """What `hf-dp-balance demo` prints after its table. The headline: the slowest rank summed over all steps
    (warm-up included: what a user's run pays) against none and batch_rebalance, with the share of the
    cut any per-step placement could reach there; then the same over the compared steps, perfect balance,
    the per-step placement bound, and the invariants."""
    g, inv, s = result["gain"], result["invariants"], result["settings"]
    warmup, steps = s["warmup_steps"], s["steps"]
    bound = result.get("placement_bound")
    everything = result.get("gain_all_steps")
    lines = []
    if everything:
        lines.append(f"\nslowest-rank compute over all {warmup + steps} steps (warm-up included: what a run pays): "
                     f"{_cut(everything['vs_none'])} than none{_share(everything['vs_none'], (bound or {}).get('all_steps'))}, "
                     f"{_cut(everything['vs_batch_rebalance'])} than batch_rebalance")
    first = "" if everything else "\n"  # the compared steps are the headline only without the all-steps sums
    lines += [f"{first}slowest-rank compute: {_cut(g['vs_none'])} than none{_share(g['vs_none'], bound)}, "
              f"{_cut(g['vs_batch_rebalance'])} than batch_rebalance (steps {warmup + 1}..{warmup + steps} only, after "
              f"{warmup} warm-up steps)",
              f"perfect balance (every rank at none's mean rank compute, the same work) would be "
              f"{100 * g['perfect_balance_vs_none']:.1f}% lower than none" +
              (f" ({100 * everything['perfect_balance_vs_none']:.1f}% over all steps)" if everything else "")]
    if bound:
        lines.append(f"{bound['compared_steps_bound_by_one_sample']} of {bound['compared_steps']} compared steps hold "
                     f"a sample heavier than a rank's share (fitted costs): no placement within the step gets their "
                     f"slowest rank down to the mean (placement_bound in the JSON)")
        if "ceiling" in bound:
            got = g["vs_none"] / bound["ceiling"] if bound["ceiling"] > 0 else float("nan")
            lines.append(f"reachable by any per-step placement of these steps (fitted costs): "
                         f"{100 * bound['ceiling']:.1f}% below none; hf_dp_balance measured "
                         f"{100 * g['vs_none']:.1f}% ({100 * got:.0f}% of it)")
        full = bound.get("all_steps")
        if full and everything:
            got = everything["vs_none"] / full["ceiling"] if full["ceiling"] > 0 else float("nan")
            lines.append(f"over all {full['steps']} steps: reachable {100 * full['ceiling']:.1f}% below none, "
                         f"hf_dp_balance measured {100 * everything['vs_none']:.1f}% ({100 * got:.0f}% of it); "
                         f"{full['steps_bound_by_one_sample']} steps hold a sample heavier than a rank's share")
    lines += fit_lines(result.get("runs", {}).get("hf_dp_balance", {}).get("fit_reports") or [])
    if inv.get("window", 1) > 1:
        lines.append(f"look-ahead K={inv['window']}: hf_dp_balance may train a sample in another step of its window, "
                     f"so the per-step bound above does not hold for it; same samples in every step before step "
                     f"{inv['windows_from_step'] + 1} and in every window of {inv['window']} steps from there: "
                     f"{inv['same_samples']}; losses equal before step {inv['windows_from_step'] + 1} "
                     f"(rtol {inv['loss_rtol']:g}): {inv['losses_equal']} "
                     f"(max rel. diff {inv['max_loss_rel_diff']:.2e})")
    else:
        lines.append(f"same samples in every step: {inv['same_samples']}; per-step losses equal "
                     f"(rtol {inv['loss_rtol']:g}): {inv['losses_equal']} (max rel. diff {inv['max_loss_rel_diff']:.2e})")
    return lines
