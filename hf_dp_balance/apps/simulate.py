"""What-if simulator: the gain of balancing at DP 8..4096 before renting the GPUs.

`hf-dp-balance simulate --dp 32,64,128,256,512,1024 --mix qwen2vl-sft --pack 32768
--ga 1 --cost 7b --json out.json --plot out.png`

Model of one optimizer step (pure numpy, no torch):

* Samples of a mix (`mixes.py`) arrive in order and are packed fixed-length
  into `pack`-token packs (greedy in arrival order). Pack j goes to step
  ``j // (dp*ga)``, micro-batch ``(j // dp) % ga``, rank ``j % dp``: every rank
  gets the same tokens, not the same compute.
* The cost of a sample is its decoder cost (quadratic*L^2 + linear*L +
  per_sample over its LLM length L) plus the vision encoder's cost of each
  vision item (same form over its patch count), in seconds (`SampleCost`).
* A rank's time over the step is the sum of its samples' costs over the
  step's micro-batches (DDP: ranks meet once per step; ``sync="micro_batch"``
  for FSDP / ZeRO-3, where they meet every micro-batch and the step is the sum
  of the micro-batch maxima). The step time is the slowest rank, plus a fixed
  per-step overhead that balancing does not change (the exposed tail of the
  gradient all-reduce and the optimizer step), plus the exposed time of
  moving samples: the bytes a rank sends or receives (the larger) over the
  network bandwidth; with the exchange overlapped (default: it runs in the
  loader's thread during the previous step's compute) only what exceeds that
  compute is exposed.
* Methods, side by side on the same steps: no balancing; the published
  system's method (`reference.plan_reference_greedy`, its skip rules on:
  imbalance < 0.2, a single sample heavier than the average rank); ours
  (`planner.plan_balance`, or `planner.plan_step` when ga > 1) under the hard
  per-rank cap of `pack` tokens per micro-batch; optionally ours after the
  look-ahead (`lookahead.plan_lookahead`) over K steps.
* TGS (tokens per GPU per second) = real tokens of all steps / (dp * total
  step time). Gain = TGS / TGS without balancing - 1.

Steps per DP size: `--steps`, or by default clip(32768 // (dp * ga), 16, 256)
(fewer steps at larger DP: each holds more packs, and the maximum over ranks
is what varies).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.apps.mixes import MERGE, Samples, draw_mix, load_lengths, mix_names, pack_fixed_length, truncate
from hf_dp_balance.core.lookahead import assign_slots, plan_lookahead
from hf_dp_balance.core.steps import slot_loads, step_makespan

# --------------------------------------------------------------------------- cost presets

# Effective throughput the FLOP presets assume: H100 SXM bf16 dense peak 989 TFLOP/s at
# about 40% MFU. Only ratios matter for the gain; absolute TGS scales with this number.
EFFECTIVE_TFLOPS = 400.0
# Bytes moved per sample: per LLM token input ids, labels (int64) and 4 rows of positions
# (int64) = 48 B; per vision patch 3*2*14*14 = 1176 bf16 values = 2352 B (Qwen2-VL
# pixel_values rows). InternVL tiles are 3*448*448 bf16 = 1204224 B per 1024 patches ~ 1176 B/patch.
BYTES_PER_TOKEN = 48
BYTES_PER_PATCH = 2352
# Network bandwidth per GPU for the sample exchange: 25 GB/s (200 Gb/s of a 400 Gb/s NIC).
DEFAULT_BANDWIDTH_GBS = 25.0


@dataclass(frozen=True)
class SampleCost:
    """Seconds of one sample: decoder over its LLM length + vision encoder over each vision item.

    `step_overhead` is the fixed time per optimizer step that balancing does not change.
    """

    name: str
    decoder: CostModel
    vision: Optional[CostModel]
    step_overhead: float
    assumption: str

    def costs(self, samples: Samples) -> np.ndarray:
        """Seconds per sample (float64 [n])."""
        out = self.decoder.sample_costs(samples.tokens)
        if self.vision is not None and samples.item_patches.size:
            per_item = self.vision.sample_costs(samples.item_patches)
            out = out + np.bincount(samples.item_sample, weights=per_item, minlength=len(samples))
        return out

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "decoder": self.decoder.to_dict(),
            "vision": None if self.vision is None else self.vision.to_dict(),
            "step_overhead_s": self.step_overhead,
            "assumption": self.assumption,
        }


def _seconds(model: CostModel, tflops: float) -> CostModel:
    """A TFLOP-valued CostModel in seconds at `tflops` TFLOP/s."""
    return CostModel(model.quadratic / tflops, model.linear / tflops, model.per_sample / tflops, model.constant / tflops)


def _flop_preset(name, params, d_model, layers, vit, overhead, what) -> SampleCost:
    vit_params, vit_d, vit_layers = vit
    return SampleCost(
        name=name,
        decoder=_seconds(CostModel.from_flops(params, d_model, layers, causal=True), EFFECTIVE_TFLOPS),
        vision=_seconds(CostModel.from_flops(vit_params, vit_d, vit_layers, causal=False), EFFECTIVE_TFLOPS),
        step_overhead=overhead,
        assumption=(
            f"{what}: FLOPs 6*params per token + causal flash attention 6*d*layers per L^2 (decoder), "
            f"6*params per patch + full attention 12*d*layers per patches^2 within each image / frame pair / "
            f"tile (vision encoder), at {EFFECTIVE_TFLOPS:.0f} TFLOP/s effective (H100 bf16 at ~40% MFU); "
            f"fixed step overhead {overhead} s (exposed all-reduce tail + optimizer step)"
        ),
    )


COST_PRESETS = {
    # Decoder 7B of the generic shape (d 4096, 32 layers) + Qwen2-VL's 675M ViT (d 1280, 32 layers).
    "7b": lambda: _flop_preset("7b", 7e9, 4096, 32, (675e6, 1280, 32), 0.15, "7B decoder + Qwen2-VL ViT-675M"),
    # Qwen2-VL-72B: d 8192, 80 layers, same ViT.
    "72b": lambda: _flop_preset("72b", 72e9, 8192, 80, (675e6, 1280, 32), 0.8, "72B decoder + Qwen2-VL ViT-675M"),
    # InternVL2.5-8B: InternLM2.5-7B (d 4096, 32 layers) + InternViT-300M (d 1024, 24 layers).
    "internvl-8b": lambda: _flop_preset(
        "internvl-8b", 7.7e9, 4096, 32, (304e6, 1024, 24), 0.15, "InternLM2.5-7B + InternViT-300M"
    ),
}


def load_cost(spec: str, step_overhead: Optional[float] = None) -> SampleCost:
    """A preset name (7b, 72b, internvl-8b) or the path of a fitted CostModel JSON.

    A JSON holds one CostModel in seconds (as `hf-dp-balance fit` writes it:
    applied to each sample's LLM length, vision included in L), or
    ``{"decoder": {...}, "vision": {...}}`` for separate vision costs. Its
    `constant` is added once per step, with `step_overhead` (default 0).
    """
    if spec in COST_PRESETS:
        preset = COST_PRESETS[spec]()
        if step_overhead is not None:
            preset = SampleCost(preset.name, preset.decoder, preset.vision, float(step_overhead), preset.assumption)
        return preset
    if not os.path.isfile(spec):
        raise ValueError(f"--cost {spec!r}: neither a preset ({', '.join(COST_PRESETS)}) nor an existing JSON file")
    try:
        with open(spec, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--cost {spec}: cannot read a JSON cost model ({e})") from None
    if isinstance(data, dict) and "decoder" in data:
        decoder = CostModel.from_json(json.dumps(data["decoder"]))
        vision = None if data.get("vision") is None else CostModel.from_json(json.dumps(data["vision"]))
    else:
        decoder, vision = CostModel.from_json(json.dumps(data)), None
    overhead = float(step_overhead or 0.0) + decoder.constant + (vision.constant if vision else 0.0)
    decoder = CostModel(decoder.quadratic, decoder.linear, decoder.per_sample, 0.0)
    if vision is not None:
        vision = CostModel(vision.quadratic, vision.linear, vision.per_sample, 0.0)
    return SampleCost(os.path.basename(spec), decoder, vision, overhead, f"fitted cost model from {spec} (seconds)")


# --------------------------------------------------------------------------- one step


@dataclass
class StepOutcome:
    """Per-step numbers of every method (seconds of compute: the slowest rank)."""

    makespan: Dict[str, float]
    move_seconds: Dict[str, float]
    moved: Dict[str, int]
    applied: Dict[str, bool]
    over_cap: Dict[str, bool]
    lower_bound: float
    single_sample_bound: bool
    plan_seconds: Dict[str, float] = field(default_factory=dict)
    failed: Dict[str, bool] = field(default_factory=dict)


def move_seconds(nbytes: np.ndarray, src: np.ndarray, dst: np.ndarray, num_ranks: int, bandwidth: float) -> float:
    """Exchange time: the busiest rank's max(bytes sent, bytes received) / bandwidth (B/s)."""
    moving = src != dst
    if not moving.any():
        return 0.0
    sent = np.bincount(src[moving], weights=nbytes[moving], minlength=num_ranks)
    received = np.bincount(dst[moving], weights=nbytes[moving], minlength=num_ranks)
    return float(max(sent.max(), received.max()) / bandwidth)


def simulate_step(
    costs: np.ndarray,
    tokens: np.ndarray,
    nbytes: np.ndarray,
    owners: np.ndarray,
    micro: np.ndarray,
    num_ranks: int,
    ga: int,
    *,
    max_tokens: int,
    sync: str = "step",
    bandwidth: float = DEFAULT_BANDWIDTH_GBS * 1e9,
    methods: Sequence[str] = ("none", "reference", "reference_capped", "ours"),
) -> StepOutcome:
    """Makespan of one step without balancing, with the reference greedy, and with ours.

    costs/tokens/nbytes/owners/micro: per sample of the step. The reference is
    run per micro-batch (it plans one batch at a time); ours plans the whole
    step (`plan_step`) when ga > 1.
    """
    from hf_dp_balance.core.planner import plan_balance, plan_step
    from hf_dp_balance.apps.reference import plan_reference_greedy

    total = float(costs.sum())
    heaviest = float(costs.max()) if costs.size else 0.0
    # No plan beats the average rank over the step, nor its heaviest sample (either sync).
    lower = max(total / num_ranks, heaviest)
    # Single-sample bound: the heaviest sample outweighs an average rank of the unit that
    # meets (the step for DDP, a micro-batch for FSDP / ZeRO-3).
    unit_mean = total / num_ranks if sync == "step" else total / (num_ranks * ga)
    out = StepOutcome({}, {}, {}, {}, {}, lower, heaviest > unit_mean)
    for method in methods:
        t0 = time.thread_time()
        if method == "none":
            dest_rank, dest_micro, applied = owners, micro, False
        elif method in ("reference", "reference_capped"):
            dest_rank, dest_micro, applied = owners.copy(), micro, False
            for m in range(ga):
                sel = np.flatnonzero(micro == m)
                if sel.size == 0:
                    continue
                # Published: 1.2x the average tokens per rank (may exceed the pack). Capped: the
                # same method held to our hard cap, for a comparison under one memory limit.
                ratio = 1.2 if method == "reference" else max(1.0, max_tokens * num_ranks / max(tokens[sel].sum(), 1))
                plan = plan_reference_greedy(costs[sel], owners[sel], num_ranks, tokens=tokens[sel], max_token_ratio=ratio)
                dest_rank[sel] = np.asarray(plan.dest)
                applied = applied or bool(plan.applied)
        elif method == "ours":
            try:
                if ga == 1:
                    plan = plan_balance(costs, owners, num_ranks, tokens=tokens, max_tokens=max_tokens)
                    dest_rank, dest_micro = np.asarray(plan.dest), micro
                else:
                    plan = plan_step(
                        costs, owners, micro, num_ranks, ga, tokens=tokens, max_tokens=max_tokens, sync=sync
                    )
                    dest_rank, dest_micro = np.asarray(plan.dest_rank), np.asarray(plan.dest_micro_batch)
                applied = bool(plan.applied)
            except ValueError:
                # As in training: a planning failure keeps everything in place (counted).
                dest_rank, dest_micro, applied = owners, micro, False
                out.failed[method] = True
        else:
            raise ValueError(f"simulate_step: unknown method {method!r}")
        out.plan_seconds[method] = time.thread_time() - t0
        after = slot_loads(costs, dest_rank, dest_micro, num_ranks, ga)
        out.makespan[method] = step_makespan(after, sync)
        out.move_seconds[method] = move_seconds(nbytes, owners, dest_rank, num_ranks, bandwidth)
        out.moved[method] = int(np.count_nonzero(dest_rank != owners))
        out.applied[method] = applied
        # The reference's own cap is 1.2x the average tokens: it may exceed the per-rank cap.
        slot_tokens = slot_loads(tokens.astype(np.float64), dest_rank, dest_micro, num_ranks, ga)
        out.over_cap[method] = bool(slot_tokens.max() > max_tokens) if tokens.size else False
    return out


# --------------------------------------------------------------------------- one DP size


def default_steps(dp: int, ga: int) -> int:
    """Steps simulated at one DP size when --steps is not given: clip(32768 // (dp*ga), 16, 256)."""
    return int(min(256, max(16, 32768 // (dp * ga))))


def draw_packed(source, n_packs: int, pack: int, rng: np.random.Generator):
    """Samples filling at least `n_packs` fixed-length packs, and each sample's pack index.

    `source` is a mix name, or a Samples pool / 1-D lengths array drawn from with replacement.
    Samples longer than `pack` are truncated to it.
    """
    chunks: List[Samples] = []
    total_tokens = 0
    need = n_packs * pack
    while True:
        n = max(1024, int(1.15 * (need - total_tokens) / 1500) + 1)
        if isinstance(source, str):
            chunk = draw_mix(source, n, rng)
        else:
            pool = source if isinstance(source, Samples) else Samples.text_only(source)
            chunk = pool.take(rng.integers(0, len(pool), size=n))
        chunk = truncate(chunk, pack)
        chunks.append(chunk)
        total_tokens += int(chunk.tokens.sum())
        if total_tokens >= need:
            samples = Samples.concat(chunks)
            pack_of = pack_fixed_length(samples.tokens, pack)
            if pack_of.size and pack_of[-1] >= n_packs:
                keep = pack_of < n_packs
                return samples.take(np.flatnonzero(keep)), pack_of[keep]
            # Padding left more packs short than estimated: draw more.


def simulate_dp(
    source,
    dp: int,
    cost: SampleCost,
    *,
    pack: int = 32768,
    ga: int = 1,
    steps: Optional[int] = None,
    seed: int = 0,
    lookahead: int = 0,
    sync: str = "step",
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS,
    overlap: bool = True,
    max_tokens: Optional[int] = None,
    progress=None,
) -> dict:
    """Simulate `steps` steps at one DP size; returns the row of `results` for it."""
    n_steps = default_steps(dp, ga) if steps is None else int(steps)
    rng = np.random.default_rng([int(seed), int(dp)])
    samples, pack_of = draw_packed(source, n_steps * dp * ga, pack, rng)
    return simulate_packed(
        samples, pack_of, dp, cost, pack=pack, ga=ga, lookahead=lookahead, sync=sync,
        bandwidth_gbs=bandwidth_gbs, overlap=overlap, max_tokens=max_tokens, progress=progress,
    )


def simulate_packed(
    samples: Samples,
    pack_of: np.ndarray,
    dp: int,
    cost: SampleCost,
    *,
    pack: int,
    ga: int = 1,
    lookahead: int = 0,
    sync: str = "step",
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS,
    overlap: bool = True,
    max_tokens: Optional[int] = None,
    progress=None,
) -> dict:
    """The row of `results` for samples already packed (`pack_of`: pack index per sample,
    non-decreasing; pack j is step j // (dp*ga), micro-batch (j // dp) % ga, rank j % dp).

    Every step must be complete (dp*ga packs each). `max_tokens` (default `pack`) is the
    hard per-rank (per micro-batch) token cap of ours and of the look-ahead.
    """
    cap = int(pack if max_tokens is None else max_tokens)
    if cap < pack:
        raise ValueError(f"--max-tokens {cap}: must be >= --pack {pack} (a pack must fit on its own rank)")
    pack_of = np.asarray(pack_of, dtype=np.int64)
    if pack_of.shape != (len(samples),) or (pack_of.size and np.any(np.diff(pack_of) < 0)):
        raise ValueError("simulate_packed: pack_of must give a non-decreasing pack index per sample")
    n_packs = int(pack_of[-1]) + 1 if pack_of.size else 0
    if n_packs == 0 or n_packs % (dp * ga):
        raise ValueError(f"simulate_packed: {n_packs} packs do not fill whole steps of dp*ga={dp * ga} packs")
    n_steps = n_packs // (dp * ga)
    costs = cost.costs(samples)
    tokens = samples.tokens
    patches = np.bincount(samples.item_sample, weights=samples.item_patches, minlength=len(samples))
    nbytes = tokens * float(BYTES_PER_TOKEN) + patches * float(BYTES_PER_PATCH)
    step_of = pack_of // (dp * ga)
    micro_of = (pack_of // dp) % ga
    rank_of = pack_of % dp
    bandwidth = bandwidth_gbs * 1e9
    methods = ["none", "reference", "reference_capped", "ours"]

    totals = {m: 0.0 for m in methods + ["lookahead", "lower_bound"]}
    compute = {m: 0.0 for m in methods + ["lookahead"]}
    moved = {m: 0 for m in methods + ["lookahead"]}
    applied = {m: 0 for m in methods + ["lookahead"]}
    exposed = {m: 0.0 for m in methods + ["lookahead"]}
    over_cap = {m: 0 for m in methods + ["lookahead"]}
    failed = {m: 0 for m in methods + ["lookahead"]}
    plan_s = {m: 0.0 for m in methods + ["lookahead"]}
    single_bound = 0
    single_bound_la = 0
    bounds = np.searchsorted(step_of, np.arange(n_steps + 1))

    def exposed_move(outcome: StepOutcome, method: str) -> float:
        hidden = outcome.makespan[method] if overlap else 0.0  # the previous step's compute, about as long
        return max(0.0, outcome.move_seconds[method] - hidden)

    def step_time(outcome: StepOutcome, method: str) -> float:
        return outcome.makespan[method] + cost.step_overhead + exposed_move(outcome, method)

    for s in range(n_steps):
        sl = slice(bounds[s], bounds[s + 1])
        o = simulate_step(
            costs[sl], tokens[sl], nbytes[sl], rank_of[sl], micro_of[sl], dp, ga,
            max_tokens=cap, sync=sync, bandwidth=bandwidth, methods=methods,
        )
        for m in methods:
            t = step_time(o, m)
            totals[m] += t
            compute[m] += o.makespan[m]
            moved[m] += o.moved[m]
            applied[m] += int(o.applied[m])
            exposed[m] += exposed_move(o, m)
            over_cap[m] += int(o.over_cap[m])
            failed[m] += int(o.failed.get(m, False))
            plan_s[m] += o.plan_seconds[m]
        totals["lower_bound"] += o.lower_bound + cost.step_overhead
        single_bound += int(o.single_sample_bound)
        if progress is not None:
            progress.update(1)

    if lookahead > 1:
        t0 = time.thread_time()
        # DDP meets once per step: a rank (its ga micro-batches together) is the unit that an
        # outlier must not share. FSDP / ZeRO-3 meets every micro-batch: the unit is a slot.
        units, unit_cap = (dp, cap * ga) if sync == "step" else (dp * ga, cap)
        new_step = plan_lookahead(costs, tokens, step_of, units, window=lookahead, max_tokens=unit_cap)
        slot = assign_slots(tokens, step_of, new_step, micro_of * dp + rank_of, dp * ga, cap)
        la_rank, la_micro = slot % dp, slot // dp
        plan_s["lookahead"] += time.thread_time() - t0
        order = np.argsort(new_step, kind="stable")
        la_bounds = np.searchsorted(new_step[order], np.arange(n_steps + 1))
        for s in range(n_steps):
            idx = order[la_bounds[s]:la_bounds[s + 1]]
            o = simulate_step(
                costs[idx], tokens[idx], nbytes[idx], la_rank[idx], la_micro[idx], dp, ga,
                max_tokens=cap, sync=sync, bandwidth=bandwidth, methods=["ours"],
            )
            t = step_time(o, "ours")
            totals["lookahead"] += t
            compute["lookahead"] += o.makespan["ours"]
            moved["lookahead"] += o.moved["ours"]
            applied["lookahead"] += int(o.applied["ours"])
            exposed["lookahead"] += exposed_move(o, "ours")
            over_cap["lookahead"] += int(o.over_cap["ours"])
            failed["lookahead"] += int(o.failed.get("ours", False))
            plan_s["lookahead"] += o.plan_seconds["ours"]
            single_bound_la += int(o.single_sample_bound)
            if progress is not None:
                progress.update(1)

    total_tokens = float(tokens.sum())
    tgs = {m: total_tokens / (dp * totals[m]) for m in totals if totals[m] > 0}
    row = {
        "dp": int(dp),
        "steps": n_steps,
        "samples": int(len(samples)),
        "samples_per_rank_step": len(samples) / (n_steps * dp),
        "tgs_none": tgs["none"],
        "tgs_reference": tgs["reference"],
        "tgs_reference_capped": tgs["reference_capped"],
        "tgs_ours": tgs["ours"],
        "tgs_lower_bound": tgs["lower_bound"],
        "gain_reference": tgs["reference"] / tgs["none"] - 1.0,
        "gain_reference_capped": tgs["reference_capped"] / tgs["none"] - 1.0,
        "gain_ours": tgs["ours"] / tgs["none"] - 1.0,
        "gain_lower_bound": tgs["lower_bound"] / tgs["none"] - 1.0,
        "single_sample_bound_share": single_bound / n_steps,
        "imbalance_none": compute["none"] / (totals["lower_bound"] - n_steps * cost.step_overhead) - 1.0,
        "applied_share_reference": applied["reference"] / n_steps,
        "applied_share_ours": applied["ours"] / n_steps,
        "moved_share_reference": moved["reference"] / len(samples),
        "over_cap_share_reference": over_cap["reference"] / n_steps,
        "over_cap_share_reference_capped": over_cap["reference_capped"] / n_steps,
        "over_cap_share_ours": over_cap["ours"] / n_steps,
        "plan_failures_ours": failed["ours"],
        "moved_share_ours": moved["ours"] / len(samples),
        "exposed_move_s_per_step_ours": exposed["ours"] / n_steps,
        "exposed_move_s_per_step_reference": exposed["reference"] / n_steps,
        "plan_ms_per_step_reference": 1e3 * plan_s["reference"] / n_steps,
        "plan_ms_per_step_reference_capped": 1e3 * plan_s["reference_capped"] / n_steps,
        "plan_ms_per_step_ours": 1e3 * plan_s["ours"] / n_steps,
    }
    if lookahead > 1:
        row.update({
            "tgs_lookahead": tgs["lookahead"],
            "gain_lookahead": tgs["lookahead"] / tgs["none"] - 1.0,
            "single_sample_bound_share_lookahead": single_bound_la / n_steps,
            "moved_share_lookahead": moved["lookahead"] / len(samples),
            "step_changed_share_lookahead": float(np.mean(new_step != step_of)),
            "plan_failures_lookahead": failed["lookahead"],
            "over_cap_share_lookahead": over_cap["lookahead"] / n_steps,
            "plan_ms_per_step_lookahead": 1e3 * plan_s["lookahead"] / n_steps,
        })
    return row


# --------------------------------------------------------------------------- whole run


def simulate(
    source: Union[str, Samples, np.ndarray],
    dp_sizes: Sequence[int],
    cost: Union[str, SampleCost] = "7b",
    *,
    pack: int = 32768,
    ga: int = 1,
    steps: Optional[int] = None,
    seed: int = 0,
    lookahead: int = 0,
    sync: str = "step",
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS,
    overlap: bool = True,
    max_tokens: Optional[int] = None,
    progress: bool = False,
) -> dict:
    """Simulate every DP size; returns {"settings": {...}, "results": [row per DP size]}.

    Deterministic for a given seed: each DP size draws its own samples from
    ``default_rng([seed, dp])``. Rows hold tgs_none / tgs_reference / tgs_ours /
    tgs_lower_bound (tokens per GPU per second), gain_* (relative to no
    balancing) and single_sample_bound_share (steps whose heaviest sample
    outweighs the average rank, so no within-step plan reaches the mean).
    """
    dp_sizes = [int(d) for d in dp_sizes]
    _check_settings(source, dp_sizes, pack, ga, steps, lookahead, sync, bandwidth_gbs)
    if max_tokens is not None and int(max_tokens) < int(pack):
        raise ValueError(f"--max-tokens {max_tokens}: must be >= --pack {pack} (a pack must fit on its own rank)")
    cost = load_cost(cost) if isinstance(cost, str) else cost
    per_dp_steps = [default_steps(d, ga) if steps is None else int(steps) for d in dp_sizes]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(per_dp_steps) * (2 if lookahead > 1 else 1), unit="step", desc="simulate")
    try:
        results = [
            simulate_dp(
                source, d, cost, pack=pack, ga=ga, steps=n, seed=seed, lookahead=lookahead, sync=sync,
                bandwidth_gbs=bandwidth_gbs, overlap=overlap, max_tokens=max_tokens, progress=bar,
            )
            for d, n in zip(dp_sizes, per_dp_steps)
        ]
    finally:
        if bar is not None:
            bar.close()
    settings = {
        "mix": source if isinstance(source, str) else f"user lengths ({len(source)} samples)",
        "dp": dp_sizes,
        "pack": pack,
        "ga": ga,
        "steps": steps if steps is not None else "auto: clip(32768 // (dp*ga), 16, 256)",
        "seed": seed,
        "lookahead": lookahead,
        "sync": sync,
        "cost": cost.to_dict(),
        "max_tokens_per_rank": pack if max_tokens is None else int(max_tokens),
        "bandwidth_GBps": bandwidth_gbs,
        "exchange_overlapped": overlap,
        "bytes_per_token": BYTES_PER_TOKEN,
        "bytes_per_patch": BYTES_PER_PATCH,
    }
    return {"settings": settings, "results": results}


def _check_settings(source, dp_sizes, pack, ga, steps, lookahead, sync, bandwidth_gbs) -> None:
    if not dp_sizes:
        raise ValueError("--dp: give at least one DP size")
    for d in dp_sizes:
        if not 1 <= d <= 65536:
            raise ValueError(f"--dp {d}: each DP size must be in 1..65536")
    if int(pack) < 1:
        raise ValueError(f"--pack {pack}: must be >= 1 token")
    if int(ga) < 1:
        raise ValueError(f"--ga {ga}: must be >= 1")
    if steps is not None and int(steps) < 1:
        raise ValueError(f"--steps {steps}: must be >= 1")
    if int(lookahead) < 0:
        raise ValueError(f"--lookahead {lookahead}: must be >= 0 (0 or 1 = off)")
    if sync not in ("step", "micro_batch"):
        raise ValueError(f"--sync {sync!r}: must be 'step' (DDP) or 'micro_batch' (FSDP / ZeRO-3)")
    if not (bandwidth_gbs > 0 and math.isfinite(bandwidth_gbs)):
        raise ValueError(f"--bandwidth {bandwidth_gbs}: must be a positive number of GB/s")
    if isinstance(source, str) and source not in mix_names():
        raise ValueError(f"--mix {source!r}: unknown; choose one of {', '.join(mix_names())}")


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
