"""Does the fitted cost model predict real compute? Timed forward+backward, side by side.

Decoder: a small Qwen2 (random weights, one thread, the varlen attention of
hf_dp_balance.runtime.attention, so a pack costs sum(L^2) and not T^2) on packs of
many compositions (one long sample ... many short ones, mixed). Vision: a tiny
Qwen2-VL vision tower called directly with pixel rows and grid_thw, on sets of
images of 64..4096 patches. Compute of a pack = its thread CPU time
(`time.thread_time()`), robust to the other processes sharing the cores.

First, synthetic step times with known coefficients (bench/cost_fit_synthetic.py). Then real CPU timings,
with fits around `CostModel.from_config` too. Every pack is one "rank" observation. On held-out packs:
  ours       CostModel fitted per rank from the first --fit-packs packs
  tokens     time = k * tokens (fixed-length packing's assumption), k fitted
  rebalance  transformers' BatchRebalanceSampler cost bs*max_len + 0.001*bs*max_len^2, scale fitted
and the step time of simulated steps (8 ranks drawn from the held-out packs, step time = slowest rank),
with the step-max fits (old soft-max, new noise-aware; only the step time observed) from W warm-up
steps drawn from the training packs; the warm-up table: step-time MAPE against the warm-up steps.

    python bench/cost_fit.py          # reduced: hidden 256, 2 layers, packs of 2K-4K tokens; ViT 128 wide, depth 2
    python bench/cost_fit.py --full   # full sizes: hidden 256, 4 layers, packs of 4K-8K tokens; ViT depth 4
    python bench/cost_fit.py --plans  # step times alone: share of the true-cost cut a plan from the fit reaches
                                      # (bench/cost_fit_plans.py; with --full its 8 / 16 warm-up steps, 8 draws)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from typing import List

import numpy as np
import torch

import cost_fit_plans  # bench/ (run as a script: its folder is on sys.path)
import cost_fit_synthetic
from cost_fit_synthetic import predicted_steps
from hf_dp_balance.runtime.attention import register_varlen_attention
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fitting import fit_cost_model

RANKS = 8


# --------------------------------------------------------------------------- compositions


def pack_compositions(rng, count: int, min_total: int, max_total: int, min_len: int, quantum: int = 1) -> List[List[int]]:
    """`count` packs of min_total..max_total units, cycling three shapes so that all kinds appear:
    n equal samples (n = 1, 2, 4, ... while >= min_len), uneven (Dirichlet) splits, one long + shorts."""
    packs = []
    kinds = ("equal", "mixed", "long_short")
    for i in range(count):
        total = int(rng.integers(min_total, max_total + 1)) // quantum * quantum
        kind = kinds[i % 3] if i >= 3 else kinds[i]
        max_n = max(1, total // min_len)
        if kind == "equal":
            n = 2 ** int(rng.integers(0, int(math.log2(max_n)) + 1))
            lengths = [total // n] * n
        elif kind == "mixed":
            n = int(rng.integers(2, min(max_n, 32) + 1))
            weights = rng.dirichlet(np.full(n, 0.7))
            lengths = np.maximum(np.round(weights * (total - n * min_len)).astype(int) + min_len, min_len).tolist()
        else:
            long = int(total * rng.uniform(0.35, 0.8))
            n_short = int(rng.integers(1, max(2, min((total - long) // min_len, 24)) + 1))
            lengths = [long] + [max(min_len, (total - long) // n_short)] * n_short
        lengths = [max(quantum, int(x) // quantum * quantum) for x in lengths]
        packs.append(lengths)
    return packs


def image_grids(patches: List[int]) -> torch.Tensor:
    """Grid (1, h, w) per image with h, w even (2x2 merge) and h*w close to the wanted patches."""
    grids = []
    for i, p in enumerate(patches):
        aspect = (1.0, 1.5, 0.75, 2.0)[i % 4]
        h = max(2, int(round(math.sqrt(p * aspect) / 2)) * 2)
        w = max(2, int(round(p / h / 2)) * 2)
        grids.append((1, h, w))
    return torch.tensor(grids)


# --------------------------------------------------------------------------- timing


def time_call(fn) -> float:
    """Thread CPU seconds of fn() (one torch thread: the work runs on this thread)."""
    gc.collect()
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def time_rounds(calls, repeats: int, label: str, seed: int = 0) -> np.ndarray:
    """Thread CPU seconds [len(calls), repeats]: `repeats` rounds over all calls, each round in a
    new random order, so that a slow spell of the shared machine hits different packs each round."""
    rng = np.random.default_rng(seed)
    times = np.zeros((len(calls), repeats))
    for r in range(repeats):
        for i in rng.permutation(len(calls)):
            times[i, r] = time_call(calls[i])
        print(f"  {label}: round {r + 1}/{repeats} done ({times[:, r].sum():.1f} s CPU)", file=sys.stderr, flush=True)
    return times


def decoder_config(hidden: int, layers: int, vocab: int = 1024):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 8 * 8, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=65536, use_cache=False, bos_token_id=1, eos_token_id=2,
    )


def vision_config(embed_dim: int, depth: int):
    """A Qwen2-VL composite config around the tower (the prior reads `vision_config`)."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(vision_config=dict(
        depth=depth, embed_dim=embed_dim, hidden_size=2 * embed_dim, num_heads=max(1, embed_dim // 32), mlp_ratio=4,
        patch_size=14, temporal_patch_size=2, spatial_merge_size=2))


def time_decoder(packs, hidden: int, layers: int, repeats: int, vocab: int = 1024) -> np.ndarray:
    """Forward + backward of a small Qwen2 with the varlen attention on each pack; [packs, repeats] s."""
    from transformers import Qwen2ForCausalLM

    name = register_varlen_attention()
    config = decoder_config(hidden, layers, vocab)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM._from_config(config, attn_implementation=name)
    g = torch.Generator().manual_seed(0)

    def step(lengths):
        ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]

        def run():
            model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    time_call(step([max(max(p) for p in packs)]))  # warm-up: first-call allocations at the largest size
    return time_rounds([step(p) for p in packs], repeats, "decoder")


def time_vision(packs, embed_dim: int, depth: int, repeats: int) -> np.ndarray:
    """Forward + backward of a Qwen2-VL vision tower (default sdpa: one call per image); [packs, repeats] s."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = vision_config(embed_dim, depth).vision_config
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel._from_config(config, attn_implementation="sdpa")
    patch_dim = 3 * 2 * 14 * 14
    g = torch.Generator().manual_seed(1)

    def step(grid):
        pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=g)

        def run():
            out = tower(pixels, grid_thw=grid)
            out = getattr(out, "pooler_output", out)
            out.square().mean().backward()
            tower.zero_grad(set_to_none=True)

        return run

    time_call(step(image_grids([max(max(p) for p in packs)])))
    return time_rounds([step(image_grids(p)) for p in packs], repeats, "vision")


def noise_summary(samples: np.ndarray) -> str:
    """How much one measurement of the same work varies on this machine (repeats of each pack)."""
    if samples.shape[1] < 2:
        return "one measurement per pack (no spread measured)"
    spread = samples.max(axis=1) / samples.min(axis=1) - 1
    cv = samples.std(axis=1, ddof=1) / samples.mean(axis=1)
    return (f"same pack measured {samples.shape[1]}x: coefficient of variation median {100 * np.median(cv):.1f}%, "
            f"max/min - 1 median {100 * np.median(spread):.1f}% (max {100 * spread.max():.1f}%); the minimum is used")


# --------------------------------------------------------------------------- baselines and metrics


def scale_fit(x: np.ndarray, y: np.ndarray) -> float:
    """k minimising sum((k*x/y - 1)^2): the one-parameter fit of a fixed cost shape, in relative error."""
    r = x / y
    return float(np.sum(r) / np.sum(r * r))


def rebalance_cost(lengths) -> float:
    """transformers' BatchRebalanceSampler cost: bs*max_len + 0.001*bs*max_len^2."""
    bs, max_len = len(lengths), max(lengths)
    return bs * max_len + 0.001 * bs * max_len**2


def mape(pred, true) -> float:
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    return float(np.mean(np.abs(pred - true) / true))


@dataclass
class Timed:
    packs: list
    features: np.ndarray  # [packs, 4]
    times: np.ndarray  # [packs]


def draw_steps(rng, pool: np.ndarray, steps: int) -> np.ndarray:
    """Indices [steps, RANKS] of packs drawn with replacement: one pack per simulated rank."""
    return rng.integers(0, len(pool), size=(steps, RANKS))


def compare(title: str, timed: Timed, fit_packs: int, train_packs: int, warmup_steps: int, draws: int, seed: int,
            prior=None) -> dict:
    """Print and return the side-by-side held-out errors of one module (`prior`: also the fits around it;
    single-sample MAPE against the per-rank fit on every pack, the best estimate of the truth here)."""
    f, t = timed.features, timed.times
    fit_idx = np.arange(fit_packs)
    train_idx = np.arange(train_packs)
    test_idx = np.arange(train_packs, len(t))

    ours = fit_cost_model(f[fit_idx][:, None, :], t[fit_idx][:, None], mode="per_rank", holdout=0).model
    tokens_k = scale_fit(f[fit_idx, 1], t[fit_idx])
    rebalance = np.array([rebalance_cost(p) for p in timed.packs])
    rebalance_k = scale_fit(rebalance[fit_idx], t[fit_idx])
    predictions = {
        "ours (per-rank fit)": ours.predict(f),
        "tokens only": tokens_k * f[:, 1],
        "BatchRebalanceSampler cost": rebalance_k * rebalance,
    }
    fitted = {"ours (per-rank fit)": ours}
    if prior is not None:
        around = fit_cost_model(f[fit_idx][:, None, :], t[fit_idx][:, None], mode="per_rank", holdout=0,
                                prior=prior).model
        predictions["ours (per-rank fit + prior)"] = around.predict(f)
        fitted["ours (per-rank fit + prior)"] = around
        predictions["prior alone (one scale)"] = scale_fit(prior.predict(f[fit_idx]), t[fit_idx]) * prior.predict(f)

    rng = np.random.default_rng(seed)
    test_steps = test_idx[draw_steps(rng, test_idx, 500)]
    true_step = t[test_steps].max(axis=1)
    results = {}
    print(f"\n{title}: fitted on {fit_packs} packs, evaluated on {len(test_idx)} held-out packs "
          f"and 500 simulated {RANKS}-rank steps drawn from them")
    print(f"  {'model':36s} {'pack MAPE':>10s} {'pack max APE':>13s} {'step MAPE':>10s}")
    for label, pred in predictions.items():
        pack_err = np.abs(pred[test_idx] - t[test_idx]) / t[test_idx]
        step_err = mape(pred[test_steps].max(axis=1), true_step)
        results[label] = {"pack_mape": float(pack_err.mean()), "pack_max_ape": float(pack_err.max()), "step_mape": step_err}
        print(f"  {label:36s} {100 * pack_err.mean():9.2f}% {100 * pack_err.max():12.2f}% {100 * step_err:9.2f}%")

    # step-max fit: only the slowest of RANKS ranks observed per step
    reference = fit_cost_model(f[:, None, :], t[:, None], mode="per_rank", holdout=0).model
    singles = np.concatenate([np.asarray(p, float) for p in timed.packs])
    for label, model in fitted.items():
        results[label]["single_mape"] = mape(model.sample_costs(singles), reference.sample_costs(singles))
    for noise, with_prior in [(n, p) for n in (False, True) for p in ((False, True) if prior is not None else (False,))]:
        step_max_errors, single_errors = [], []
        for d in range(draws):
            idx = train_idx[draw_steps(np.random.default_rng(seed + 1 + d), train_idx, warmup_steps)]
            fit = fit_cost_model(f[idx], t[idx].max(axis=1), mode="step_max", holdout=0, step_noise=noise,
                                 prior=prior if with_prior else None)
            step_max_errors.append(mape(predicted_steps(fit.model, fit.report.step_noise, f[test_steps]), true_step))
            single_errors.append(mape(fit.model.sample_costs(singles), reference.sample_costs(singles)))
        label = f"ours (step-max {'new' if noise else 'old'}{' + prior' if with_prior else ''}, {warmup_steps} st.)"
        results[label] = {"step_mape": float(np.median(step_max_errors)), "single_mape": float(np.median(single_errors))}
        print(f"  {label:36s} {'-':>10s} {'-':>13s} {100 * np.median(step_max_errors):9.2f}%  (median of {draws} draws;"
              f" single sample vs the all-pack fit {100 * np.median(single_errors):.1f}%)")
    for label, model in fitted.items():
        print(f"  {label}: single-sample cost vs the per-rank fit on all packs {100 * results[label]['single_mape']:.2f}%")
    m = ours
    print(f"  ours: cost = {m.quadratic:.4g}*sum(L^2) + {m.linear:.4g}*sum(L) + {m.per_sample:.4g}*n + {m.constant:.4g} s"
          f"  (attention = dense at L = {m.linear / m.quadratic if m.quadratic else float('inf'):.0f})")
    results["model"] = ours.to_dict()
    return results


def warmup_table(title: str, timed: Timed, train_packs: int, draws: int, seed: int, steps_list=(1, 2, 4, 8, 16, 32)) -> dict:
    """Step-time MAPE against warm-up steps: per-rank (RANKS observations per step) vs step-max (one; old
    soft-max fit and the new noise-aware one)."""
    f, t = timed.features, timed.times
    train_idx, test_idx = np.arange(train_packs), np.arange(train_packs, len(t))
    test_steps = test_idx[draw_steps(np.random.default_rng(seed), test_idx, 500)]
    true_step = t[test_steps].max(axis=1)
    print(f"\n{title}: step-time MAPE vs warm-up steps ({RANKS} ranks; median of {draws} draws from {train_packs} training packs)")
    columns = {"per_rank": ("per_rank", False), "step_max_old": ("step_max", False), "step_max": ("step_max", True)}
    print(f"  {'warm-up steps':>13s} {'per-rank':>9s} {'step-max old':>12s} {'step-max new':>12s}")
    table = {}
    for steps in steps_list:
        row = {}
        for column, (mode, noise) in columns.items():
            if (steps * (RANKS if mode == "per_rank" else 1)) < 4:
                row[column] = float("nan")
                continue
            errors = []
            for d in range(draws):
                idx = train_idx[draw_steps(np.random.default_rng(seed + 100 * steps + d), train_idx, steps)]
                times = t[idx] if mode == "per_rank" else t[idx].max(axis=1)
                fit = fit_cost_model(f[idx], times, mode=mode, holdout=0, step_noise=noise)
                errors.append(mape(predicted_steps(fit.model, fit.report.step_noise, f[test_steps]), true_step))
            row[column] = float(np.median(errors))
        table[steps] = row
        cells = ["n/a" if math.isnan(row[m]) else f"{100 * row[m]:.2f}%" for m in columns]
        print(f"  {steps:13d} {cells[0]:>9s} {cells[1]:>12s} {cells[2]:>12s}")
    return table


# --------------------------------------------------------------------------- main


def report(key: str, title: str, lengths, samples: np.ndarray, args, record: dict, prior=None) -> None:
    """Print the noise, the fit comparison and the warm-up table of one module's timings; fill `record`."""
    timed = Timed(lengths, np.stack([features_of(p) for p in lengths]), samples.min(axis=1))
    print(f"\n{key} timing noise: {noise_summary(samples)}")
    record[key] = {"lengths": lengths, "times": timed.times.tolist(), "samples": samples.tolist()}
    record[f"{key}_results"] = compare(title, timed, args.fit_packs, args.train_packs, args.warmup_steps, args.draws,
                                       args.seed, prior)
    record[f"{key}_warmup"] = warmup_table(title, timed, args.train_packs, args.draws, args.seed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="full sizes: 4 layers, packs of 4096-8192 tokens / patches")
    parser.add_argument("--hidden", type=int, default=256, help="decoder hidden size")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 2, --full 4)")
    parser.add_argument("--min-tokens", type=int, default=None, help="default 2048 (--full 4096)")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 4096 (--full 8192)")
    parser.add_argument("--fit-packs", type=int, default=8, help="packs the per-rank fit sees")
    parser.add_argument("--train-packs", type=int, default=12, help="packs warm-up steps are drawn from (first ones)")
    parser.add_argument("--test-packs", type=int, default=20, help="held-out packs")
    parser.add_argument("--warmup-steps", type=int, default=16, help="warm-up steps of the step-max fit in the main table")
    parser.add_argument("--draws", type=int, default=10, help="random warm-up draws per cell (median reported)")
    parser.add_argument("--vision-embed", type=int, default=128, help="ViT width")
    parser.add_argument("--vision-depth", type=int, default=None, help="default 2 (--full 4)")
    parser.add_argument("--min-patches", type=int, default=None, help="patches per rank, default 2048 (--full 4096)")
    parser.add_argument("--max-patches", type=int, default=None, help="default 4096 (--full 8192); images <= 4096 patches")
    parser.add_argument("--skip-vision", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per pack (interleaved rounds; minimum kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the timed features / times / results as JSON here (input of `hf-dp-balance fit`)")
    parser.add_argument("--synthetic-only", action="store_true", help="the synthetic known-coefficient tables only")
    parser.add_argument("--plans", action="store_true",
                        help="only the step-time study of bench/cost_fit_plans.py (share of the cut, single sample)")
    args = parser.parse_args(argv)
    if args.plans:
        return cost_fit_plans.main(["--full"] if args.full else [])
    synthetic = cost_fit_synthetic.run(draws=args.draws)
    cost_fit_synthetic.print_table(synthetic)
    conditioning = cost_fit_synthetic.conditioning(draws=args.draws)
    cost_fit_synthetic.print_conditioning(conditioning)
    if args.synthetic_only:
        return 0
    hidden = args.hidden
    layers = args.layers or (4 if args.full else 2)
    vision_embed = args.vision_embed
    min_tokens = args.min_tokens or (4096 if args.full else 2048)
    max_tokens = args.max_tokens or (8192 if args.full else 4096)
    vision_depth = args.vision_depth or (4 if args.full else 2)
    min_patches = args.min_patches or (4096 if args.full else 2048)
    max_patches = args.max_patches or (8192 if args.full else 4096)
    torch.set_num_threads(1)
    if args.fit_packs > args.train_packs:
        parser.error("--fit-packs must be <= --train-packs")

    n_packs = args.train_packs + args.test_packs
    rng = np.random.default_rng(args.seed)
    wall = time.perf_counter()
    record = {"argv": sys.argv[1:], "layers": layers, "hidden": hidden, "tokens": [min_tokens, max_tokens],
              "synthetic": {f"attn_off={k[0]} ranks={k[1]} warmup={k[2]}": v for k, v in synthetic.items()},
              "conditioning": conditioning}

    packs = pack_compositions(rng, n_packs, min_tokens, max_tokens, min_len=128)
    print(f"decoder: Qwen2 hidden {hidden}, {layers} layers, varlen attention, 1 thread; {n_packs} packs of "
          f"{min_tokens}-{max_tokens} tokens", file=sys.stderr)
    report("decoder", "Decoder", packs, time_decoder(packs, hidden, layers, args.repeats), args, record,
           CostModel.from_config(decoder_config(hidden, layers)))

    if not args.skip_vision:
        # images of 64..4096 patches; a "pack" is one rank's images (total patches like the decoder's tokens)
        vpacks = pack_compositions(rng, n_packs, min_patches, max_patches, min_len=64, quantum=4)
        vpacks = [[min(4096, p) for p in pack] for pack in vpacks]
        grids = [image_grids(p) for p in vpacks]
        vlengths = [g.prod(dim=1).tolist() for g in grids]
        print(f"vision: Qwen2-VL tower embed {vision_embed}, depth {vision_depth}, sdpa per image; "
              f"{n_packs} sets of images of {min_patches}-{max_patches} patches", file=sys.stderr)
        report("vision", "Vision tower", vlengths, time_vision(vlengths, vision_embed, vision_depth, args.repeats),
               args, record, CostModel.from_config(vision_config(vision_embed, vision_depth), module="vision"))

    print(f"\nwall time {time.perf_counter() - wall:.0f} s (timings are thread CPU time; the machine was shared)")
    if args.save:
        # `hf-dp-balance fit` input: one rank per pack, steps of one rank
        record["lengths"] = [[p] for p in packs]
        record["times"] = [[x] for x in record["decoder"]["times"]]
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=float)
        print(f"wrote {args.save}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
