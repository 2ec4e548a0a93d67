"""Calibrate the cost model on one GPU: Qwen2-VL-2B-sized decoder and vision tower, random weights, bf16.

For the day a GPU is available. Times forward + backward (CUDA events) of the decoder on packs of many
compositions (flash-attention-2 varlen when installed, else hf_dp_balance's varlen attention over SDPA)
and of the vision tower on sets of frames; each pack is one per-rank observation. Fits per rank on the
first packs, with and without the FLOP prior (`CostModel.from_config`), and from step times alone (steps of
8 ranks drawn from the packs, only the slowest rank seen); prints held-out MAPE of pack, step and
single-sample cost (packs holding one sample, timed on their own), the fitted coefficients next to the
prior's (the prior scaled by the fitted seconds per FLOP) and the fitted quadratic/linear ratio beside the
prior's. `bench/gpu_check.py` runs the same calibration before its virtual data-parallel run.

    python bench/gpu_calibrate.py            # the GPU run (cuda, bf16, 2B sizes, packs of 4K-16K tokens)
    python bench/gpu_calibrate.py --tiny     # the same code on CPU: tiny configs, float32, small packs
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

import cost_fit  # bench/: pack_compositions, image_grids (run as a script: its folder is on sys.path)
from cost_fit_synthetic import predicted_steps
from hf_dp_balance.core.cost import COEFF_NAMES, CostModel, features_of
from hf_dp_balance.core.fitting import fit_cost_model

STEP_RANKS = 8  # ranks of the steps the step-time fit sees


def qwen2_vl_2b_config():
    """Qwen2-VL-2B's published sizes (config.json), built from the class: no download."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, use_cache=False,
                         tie_word_embeddings=True),
        vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2))


def attention_implementation(device: str) -> str:
    if device == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    from hf_dp_balance.runtime.attention import register_varlen_attention

    return register_varlen_attention()


class Timer:
    """Seconds of fn() on the device: CUDA events on a GPU, thread CPU time on CPU (one torch thread)."""

    def __init__(self, device: str):
        self.device = device

    @property
    def clock(self) -> str:
        return "CUDA events" if self.device == "cuda" else "thread CPU time"

    def __call__(self, fn) -> float:
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        t0 = time.thread_time()
        fn()
        return time.thread_time() - t0


@dataclass(frozen=True)
class Bench:
    """Where the GPU benchmarks run: the model config, device, dtype and the device timer."""

    config: object
    device: str
    dtype: torch.dtype
    timer: Timer
    tiny: bool

    def describe(self) -> str:
        name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu (tiny configs)"
        return (f"device {name}, dtype {str(self.dtype).replace('torch.', '')}, decoder attention "
                f"{attention_implementation(self.device)}, clock {self.timer.clock}")


def bench_setup(tiny: bool) -> Optional[Bench]:
    """The tiny CPU setup (float32, one thread) or the GPU one (cuda, bf16, 2B sizes); None without CUDA."""
    if tiny:
        from hf_dp_balance.testing.models import tiny_config

        torch.set_num_threads(1)
        return Bench(tiny_config("qwen2_vl"), "cpu", torch.float32, Timer("cpu"), True)
    if not torch.cuda.is_available():
        return None
    return Bench(qwen2_vl_2b_config(), "cuda", torch.bfloat16, Timer("cuda"), False)


def decoder_runner(config, device: str, dtype) -> Callable:
    """prepare(lengths) -> run(): forward + backward of the decoder on one packed row of samples of these
    lengths (the inputs are built on the device before, outside the timed call)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text = config.text_config.to_dict()
    text.pop("model_type", None)
    lm_config = Qwen2Config(**{k: v for k, v in text.items() if k in Qwen2Config().to_dict() or k == "head_dim"})
    torch.manual_seed(0)
    with torch.device(device):  # random init on the device itself: seconds for 2B parameters, not minutes
        model = Qwen2ForCausalLM._from_config(lm_config, attn_implementation=attention_implementation(device),
                                              dtype=dtype)
    model.to(device)  # a no-op unless some buffer was made on the host
    vocab = lm_config.vocab_size

    def prepare(lengths):
        ids = torch.randint(0, vocab, (1, int(sum(lengths))), device=device)
        positions = torch.from_numpy(np.concatenate([np.arange(int(n)) for n in lengths]))[None].to(device)

        def run():
            model(input_ids=ids, position_ids=positions, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    return prepare


def vision_runner(config, device: str, dtype):
    """(prepare(patches) -> run(), frames_of(patches)): forward + backward of the vision tower on one frame
    per entry of `patches`; `frames_of` gives the patches of the frames it really builds (even h and w)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vc = config.vision_config
    torch.manual_seed(0)
    with torch.device(device):
        tower = Qwen2VisionTransformerPretrainedModel._from_config(vc, attn_implementation="sdpa", dtype=dtype)
    tower.to(device)
    patch_dim = 3 * vc.temporal_patch_size * vc.patch_size ** 2

    def prepare(patches):
        grid = cost_fit.image_grids(patches).to(device)
        pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, device=device, dtype=dtype)

        def run():
            out = tower(pixels, grid_thw=grid)
            getattr(out, "pooler_output", out).float().square().mean().backward()
            tower.zero_grad(set_to_none=True)

        return run

    return prepare, lambda patches: [int(g[1] * g[2]) for g in cost_fit.image_grids(patches).tolist()]


def measure(timer, prepare, items, repeats: int, label: str = "") -> np.ndarray:
    """Minimum over `repeats` interleaved rounds of each item's time (`prepare(item)` gives the timed call)."""
    timer(prepare(max(items, key=sum)))  # warm-up at the largest size (allocator, kernels)
    times = np.full(len(items), np.inf)
    with tqdm(total=repeats * len(items), desc=label, unit="pack", file=sys.stderr, mininterval=1.0) as bar:
        for _ in range(repeats):
            for i in np.random.default_rng(len(items)).permutation(len(items)):
                times[i] = min(times[i], timer(prepare(items[i])))
                bar.update(1)
    return times


def _mape(pred, true) -> float:
    return float(np.mean(np.abs(np.asarray(pred) - true) / true))


def quadratic_over_linear(model: CostModel) -> float:
    """quadratic / linear: 1 / the sample length at which attention costs as much as the dense layers."""
    return model.quadratic / model.linear if model.linear > 0 else float("inf")


def _step_time_fit(feats, times, fit_packs: int, prior: CostModel, seed: int) -> dict:
    """Fit from step times alone (steps of STEP_RANKS ranks drawn from the fitted packs, only the slowest
    rank seen) around the prior; held-out step MAPE on steps drawn from the held-out packs."""
    rng = np.random.default_rng(seed)
    train = rng.integers(0, fit_packs, size=(2 * fit_packs, STEP_RANKS))
    test = rng.integers(fit_packs, len(times), size=(4 * (len(times) - fit_packs), STEP_RANKS))
    fit = fit_cost_model(feats[train], times[train].max(axis=1), mode="step_max", holdout=0, prior=prior)
    pred = predicted_steps(fit.model, fit.report.step_noise, feats[test])
    return {"step_mape": _mape(pred, times[test].max(axis=1)), "model": fit.model.to_dict(),
            "train_steps": int(train.shape[0]), "test_steps": int(test.shape[0])}


def calibrate(name: str, packs, singles, prepare, timer, prior: CostModel, fit_packs: int, repeats: int,
              seed: int = 0) -> dict:
    """Fit per rank on the first `fit_packs` packs (with / without the prior) and from step times; held-out
    pack, step and single-sample MAPE; coefficients and the quadratic/linear ratio next to the prior's.
    Returns the numbers, the fitted models and every pack's features and time."""
    times = measure(timer, prepare, packs, repeats, f"{name}: packs")
    single_times = measure(timer, prepare, [[n] for n in singles], repeats, f"{name}: single samples")
    feats = np.stack([features_of(p) for p in packs])
    test = np.arange(fit_packs, len(packs))
    print(f"\n{name}: {len(packs)} packs ({fit_packs} fitted, {test.size} held out), {len(singles)} single samples")
    out = {"pack_features": feats.tolist(), "pack_times": times.tolist()}
    held = _held_out_steps(test, seed)
    for label, with_prior in (("per-rank fit", None), ("per-rank fit + prior", prior)):
        fit = fit_cost_model(feats[:fit_packs, None, :], times[:fit_packs, None], mode="per_rank", holdout=0,
                             prior=with_prior)
        model = fit.model
        # a single sample timed alone also pays the pack's constant
        single_pred = model.sample_costs(np.asarray(singles)) + model.constant
        out[label] = {"pack_mape": _mape(model.predict(feats[test]), times[test]),
                      "step_mape": _mape(model.step_time(feats[held]), times[held].max(axis=1)),
                      "single_mape": _mape(single_pred, single_times), "model": model.to_dict()}
        print(f"  {label:22s} held-out pack MAPE {100 * out[label]['pack_mape']:6.2f}%   "
              f"step MAPE {100 * out[label]['step_mape']:6.2f}%   "
              f"single-sample MAPE {100 * out[label]['single_mape']:6.2f}%")
    out["step-time fit + prior"] = _step_time_fit(feats, times, fit_packs, prior, seed)
    print(f"  {'step-time fit + prior':22s} held-out step MAPE {100 * out['step-time fit + prior']['step_mape']:6.2f}%"
          f"   ({out['step-time fit + prior']['train_steps']} steps of {STEP_RANKS} ranks, slowest rank only)")
    fitted = CostModel.from_dict(out["per-rank fit + prior"]["model"])
    per_tflop = fitted.linear / prior.linear if prior.linear else float("nan")  # the prior is in TFLOPs
    out["effective_tflops"] = 1 / per_tflop if per_tflop > 0 else float("nan")
    print(f"  {'coefficient':12s} {'fitted (s)':>12s} {'prior x s/TFLOP':>16s}   (dense layers at "
          f"{out['effective_tflops']:.3g} effective TFLOP/s)")
    for k, cname in enumerate(COEFF_NAMES):
        print(f"  {cname:12s} {fitted.coefficients[k]:12.4g} {prior.coefficients[k] * per_tflop:16.4g}")
    ratios = {"per-rank fit": quadratic_over_linear(CostModel.from_dict(out["per-rank fit"]["model"])),
              "per-rank fit + prior": quadratic_over_linear(fitted), "prior": quadratic_over_linear(prior)}
    out["quadratic_over_linear"] = ratios
    print(f"  quadratic/linear: fitted {ratios['per-rank fit']:.3g} (free), {ratios['per-rank fit + prior']:.3g} "
          f"(around the prior), prior {ratios['prior']:.3g}: fitted/prior "
          f"{ratios['per-rank fit'] / ratios['prior'] if ratios['prior'] else float('nan'):.3g}")
    return out


def _held_out_steps(test: np.ndarray, seed: int) -> np.ndarray:
    """[steps, STEP_RANKS] indices of held-out packs: simulated steps for the per-rank fits' step MAPE."""
    return np.random.default_rng(seed + 1).choice(test, size=(4 * test.size, STEP_RANKS))


def calibrate_modules(bench: Bench, decoder, vision, tokens, patches, n: int, fit_n: int, repeats: int,
                      rng) -> dict:
    """`calibrate` of the decoder on `n` packs of tokens[0]..tokens[1] tokens and (unless `vision` is None;
    else its `vision_runner` pair) of the vision tower on sets of frames of patches[0]..patches[1] patches."""
    packs = cost_fit.pack_compositions(rng, n, tokens[0], tokens[1], min_len=64)
    singles = sorted({int(x) for x in np.linspace(64, tokens[1], 8)})
    out = {"decoder": calibrate("decoder", packs, singles, decoder, bench.timer,
                                CostModel.from_config(bench.config), fit_n, repeats)}
    if vision is not None:
        prepare, frames_of = vision
        vpacks = [frames_of(p) for p in cost_fit.pack_compositions(rng, n, patches[0], patches[1], min_len=64,
                                                                    quantum=4)]
        vsingles = frames_of(sorted({int(x) // 4 * 4 for x in np.linspace(64, patches[1] // 2, 6)}))
        out["vision"] = calibrate("vision tower (per frame)", vpacks, vsingles, prepare, bench.timer,
                                  CostModel.from_config(bench.config, module="vision"), fit_n, repeats)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny configs, float32: checks the code path")
    parser.add_argument("--packs", type=int, default=None, help="packs per module (default 40, --tiny 10)")
    parser.add_argument("--fit-packs", type=int, default=None, help="packs fitted (default 16, --tiny 6)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-vision", action="store_true")
    args = parser.parse_args(argv)
    bench = bench_setup(args.tiny)
    if bench is None:
        print("gpu_calibrate: no CUDA device (use --tiny to check the code path on CPU)", file=sys.stderr)
        return 2
    if args.tiny:
        tokens, patches, n, fit_n = (256, 1024), (256, 1024), args.packs or 10, args.fit_packs or 6
    else:
        tokens, patches, n, fit_n = (4096, 16384), (1024, 8192), args.packs or 40, args.fit_packs or 16
    wall = time.perf_counter()
    print(bench.describe())
    vision = None if args.skip_vision else vision_runner(bench.config, bench.device, bench.dtype)
    calibrate_modules(bench, decoder_runner(bench.config, bench.device, bench.dtype), vision, tokens, patches,
                      n, fit_n, args.repeats, np.random.default_rng(0))
    print(f"\nwall time {time.perf_counter() - wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
