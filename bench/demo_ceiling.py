"""How much can per-step balancing cut the slowest rank in the demo's setting? Predicted, side by side.

`hf-dp-balance demo` trains the synthetic long-tail mix (`testing.mix.plan_samples`, the same seeds) on a few
ranks. Here the same steps are priced with fitted costs instead of trained, for many settings at once:

* none:   each step cut into one equal-token pack per rank (`demo_ways.token_balanced_packs`), the slowest pack;
* ours:   `plan_balance` on the step's samples (hard cap `max_token_ratio` x the mean rank's tokens);
* bound:  max(heaviest sample, the step's total / ranks): no placement of the step's samples does better;
* ours K: `plan_lookahead` over windows of K steps first (samples change step), then `plan_balance`;
* perfect balance: every rank at the mean (the same work in every way): the ceiling of any balancing.

Sample cost = decoder (a L^2 + b L + c) + ViT of its images (patches = 4 x the image's LLM tokens, the
2x2 merge), plus the per-step constant of each rank. The ViT is scaled to a given weight: the ViT's
cost per image token over the decoder's cost per token ("vit/tok"); the demo's tiny ViT is the first
value, Qwen2-VL-7B's proportion ~0.4, Qwen2-VL-2B's ~1.8 (675M ViT, 4 patches per LLM token).
Printed: the mean over seeds of each way's sum over steps of the slowest rank, as % below none.

Run: python bench/demo_ceiling.py [--demo-json demo.json] [--steps 32] [--seeds 3] [--lookahead 4,8]
(the default coefficients are the fitted models of the demo run in docs/benchmarks/demo.md)
"""
import argparse
import json

import numpy as np

from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.testing.mix import plan_samples
from hf_dp_balance.apps.demo_ways import token_balanced_packs
from hf_dp_balance.core.costing import planning_costs
from hf_dp_balance.core.lookahead import plan_lookahead
from hf_dp_balance.core.planner import plan_balance

DEFAULT_DECODER = CostModel(quadratic=9.8e-8, linear=3.0e-4, per_sample=0.0, constant=0.0)
DEFAULT_VISION = CostModel(quadratic=4.3e-9, linear=1.6e-5, per_sample=0.0, constant=0.023)


def one_setting(mix, ranks, spr, vit_scale, windows, steps, seed, decoder, vision, ratio=1.5):
    """Sums over `steps` of the slowest rank: none, ours, bound (per step), [ours with look-ahead K] per K,
    and of the mean rank (the same for every way: total cost / ranks + constant)."""
    b = ranks * spr
    plans = plan_samples(steps * b, seed=seed, mix=mix)
    tokens = np.array([p["text_tokens"] + sum(p["vision_tokens"]) for p in plans], dtype=np.int64)
    vit = CostModel(*(vit_scale * vision.coefficients))  # the ViT at the given weight
    costs = planning_costs(tokens, [[4 * v for v in p["vision_tokens"]] for p in plans], decoder, vit)
    constant = decoder.constant + vit.constant
    step_of = np.repeat(np.arange(steps), b)
    caps = []
    none = ours = bound = 0.0
    for k in range(steps):
        ids = np.arange(k * b, (k + 1) * b)
        tok, c = tokens[ids], costs[ids]
        packs = token_balanced_packs(tok, ranks)
        none += max(c[p].sum() for p in packs) + constant
        owners = np.repeat(np.arange(ranks), spr)
        largest = max(tok[owners == r].sum() for r in range(ranks))
        cap = int(max(tok.max(), largest, np.ceil(ratio * tok.sum() / ranks)))
        caps.append(cap)
        ours += plan_balance(c, owners, ranks, tokens=tok, max_tokens=cap).loads_after.max() + constant
        bound += max(c.max(), c.sum() / ranks) + constant
    ours_k = []
    for window in windows:
        new_step = plan_lookahead(costs, tokens, step_of, ranks, window=window, max_tokens=max(caps))
        total = 0.0
        for k in range(steps):
            ids = np.flatnonzero(new_step == k)
            owners = np.arange(ids.size) * ranks // ids.size
            total += plan_balance(costs[ids], owners, ranks, tokens=tokens[ids],
                                  max_tokens=max(max(caps), int(tokens[ids].max()))).loads_after.max() + constant
        ours_k.append(total)
    return none, ours, bound, ours_k, costs.sum() / ranks + steps * constant


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--demo-json", help="take the decoder and ViT models fitted in this demo.json")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--lookahead", default="4,8", help="look-ahead windows K to price (comma-separated)")
    args = ap.parse_args()
    decoder, vision = DEFAULT_DECODER, DEFAULT_VISION
    if args.demo_json:
        run = json.load(open(args.demo_json))["runs"]["hf_dp_balance"]
        decoder, vision = CostModel.from_dict(run["cost_model"]), CostModel.from_dict(run["vision_cost_model"])
    base = 4 * vision.linear / decoder.linear  # the demo ViT's cost per image token / decoder's per token
    weights = [("demo", 1.0), ("7B-like", 0.4 / base), ("2B-like", 1.8 / base)]
    ks = [int(k) for k in args.lookahead.split(",") if k.strip()]
    settings = ([("long_tail", 4, spr, w, ks) for w in weights for spr in (8, 12, 16, 20, 24)]
                + [("long_tail", 8, spr, weights[0], ks) for spr in (8, 16)]
                + [("bounded", 4, spr, weights[0], []) for spr in (8, 16)])
    print(f"decoder {decoder.quadratic:.3g} L^2 + {decoder.linear:.3g} L; ViT {vision.quadratic:.3g} P^2 + "
          f"{vision.linear:.3g} P (+{vision.constant:.3g} s/step) x scale; {args.steps} steps x {args.seeds} seeds")
    print("| mix | ranks | samples/rank | ViT (vit/tok) | none excess over mean | perfect balance vs none "
          "| ours vs none | bound vs none | ours / bound cut | " + " | ".join(f"ours K={k} vs none" for k in ks) + " |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|" + "---:|" * len(ks))
    for mix, ranks, spr, (wname, scale), windows in settings:
        rows = [one_setting(mix, ranks, spr, scale, windows, args.steps, s, decoder, vision) for s in range(args.seeds)]
        none, ours, bound, mean = (np.array([r[i] for r in rows]) for i in (0, 1, 2, 4))
        cut, cut_b = 1 - ours / none, 1 - bound / none
        k_cols = [f"{100 * (1 - np.array([r[3][j] for r in rows]) / none).mean():.1f}%" if j < len(windows) else "-"
                  for j in range(len(ks))]
        print(f"| {mix} | {ranks} | {spr} | {wname} ({4 * vision.linear * scale / decoder.linear:.2f}) | "
              f"{100 * (none / mean - 1).mean():.1f}% | {100 * (1 - mean / none).mean():.1f}% | "
              f"{100 * cut.mean():.1f}% | "
              f"{100 * cut_b.mean():.1f}% | {100 * (cut.mean() / cut_b.mean()):.0f}% | " + " | ".join(k_cols) + " |",
              flush=True)


if __name__ == "__main__":
    main()
