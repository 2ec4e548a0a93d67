"""The simulator's runs: packed samples at one DP size (`simulate_packed`), a mix drawn and packed at one DP
size (`simulate_dp`), and a sweep over DP sizes (`simulate`); one step is `sim_step.simulate_step`.

Deterministic for a seed; how a step is priced is in `sim_model` and docs/simulator.md.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from hf_dp_balance.testing.mix import SampleShapes, draw_mix, mix_names, pack_fixed_length, truncate
from hf_dp_balance.apps.sim_model import BYTES_PER_PATCH, BYTES_PER_TOKEN, DEFAULT_BANDWIDTH_GBS, SampleCost, load_cost
from hf_dp_balance.apps.sim_price import StepPrice
from hf_dp_balance.apps.sim_step import METHODS, Tally, run_steps
from hf_dp_balance.core.lookahead import assign_slots, plan_lookahead

# --------------------------------------------------------------------------- one DP size


def default_steps(dp: int, ga: int) -> int:
    """Steps simulated at one DP size when --steps is not given: clip(32768 // (dp*ga), 16, 256)."""
    return int(min(256, max(16, 32768 // (dp * ga))))


def draw_packed(source, n_packs: int, pack: int, rng: np.random.Generator):
    """Samples filling at least `n_packs` fixed-length packs, and each sample's pack index.

    `source` is a mix name, or a SampleShapes pool / 1-D lengths array drawn from with replacement.
    Samples longer than `pack` are truncated to it.
    """
    chunks: List[SampleShapes] = []
    total_tokens = 0
    need = n_packs * pack
    while True:
        n = max(1024, int(1.15 * (need - total_tokens) / 1500) + 1)
        if isinstance(source, str):
            chunk = draw_mix(source, n, rng)
        else:
            pool = source if isinstance(source, SampleShapes) else SampleShapes.text_only(source)
            chunk = pool.take(rng.integers(0, len(pool), size=n))
        chunk = truncate(chunk, pack)
        chunks.append(chunk)
        total_tokens += int(chunk.tokens.sum())
        if total_tokens >= need:
            samples = SampleShapes.concat(chunks)
            pack_of = pack_fixed_length(samples.tokens, pack)
            if pack_of.size and pack_of[-1] >= n_packs:
                keep = pack_of < n_packs
                return samples.take(np.flatnonzero(keep)), pack_of[keep]
            # Padding left more packs short than estimated: draw more.


def simulate_dp(source, dp: int, cost: SampleCost, *, pack: int = 32768, ga: int = 1, steps: Optional[int] = None,
                seed: int = 0, **run) -> dict:
    """Simulate `steps` steps at one DP size; returns the row of `results` for it (`run`: simulate_packed's
    keywords)."""
    n_steps = default_steps(dp, ga) if steps is None else int(steps)
    rng = np.random.default_rng([int(seed), int(dp)])
    samples, pack_of = draw_packed(source, n_steps * dp * ga, pack, rng)
    return simulate_packed(samples, pack_of, dp, cost, pack=pack, ga=ga, **run)


@dataclass
class _PackedSteps:
    """Per-sample columns of a packed run: cost, tokens, bytes if moved, and the slot fixed-length packing gives."""

    costs: np.ndarray
    tokens: np.ndarray
    nbytes: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    n_steps: int


def _packed_steps(samples: SampleShapes, pack_of, dp: int, ga: int, cost: SampleCost) -> _PackedSteps:
    pack_of = np.asarray(pack_of, dtype=np.int64)
    if pack_of.shape != (len(samples),) or (pack_of.size and np.any(np.diff(pack_of) < 0)):
        raise ValueError("simulate_packed: pack_of must give a non-decreasing pack index per sample")
    n_packs = int(pack_of[-1]) + 1 if pack_of.size else 0
    if n_packs == 0 or n_packs % (dp * ga):
        raise ValueError(f"simulate_packed: {n_packs} packs do not fill whole steps of dp*ga={dp * ga} packs")
    tokens = samples.tokens
    patches = np.bincount(samples.item_sample, weights=samples.item_patches, minlength=len(samples))
    nbytes = tokens * float(BYTES_PER_TOKEN) + patches * float(BYTES_PER_PATCH)
    return _PackedSteps(cost.costs(samples), tokens, nbytes, pack_of // (dp * ga), (pack_of // dp) % ga,
                        pack_of % dp, n_packs // (dp * ga))


def _lookahead_slots(data: _PackedSteps, dp: int, ga: int, cap: int, sync: str, window: int):
    """The look-ahead's placement: (sample indices of each new step, rank, micro-batch, new step, plan seconds)."""
    t0 = time.thread_time()
    # DDP meets once per step: a rank (its ga micro-batches together) is the unit that an
    # outlier must not share. FSDP / ZeRO-3 meets every micro-batch: the unit is a slot.
    units, unit_cap = (dp, cap * ga) if sync == "step" else (dp * ga, cap)
    new_step = plan_lookahead(data.costs, data.tokens, data.step, units, window=window, max_tokens=unit_cap)
    slot = assign_slots(data.tokens, data.step, new_step, data.micro * dp + data.rank, dp * ga, cap)
    plan_s = time.thread_time() - t0
    order = np.argsort(new_step, kind="stable")
    bounds = np.searchsorted(new_step[order], np.arange(data.n_steps + 1))
    groups = [order[bounds[s]:bounds[s + 1]] for s in range(data.n_steps)]
    return groups, slot % dp, slot // dp, new_step, plan_s


def simulate_packed(
    samples: SampleShapes,
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
    price: Optional[StepPrice] = None,
    progress=None,
) -> dict:
    """The row of `results` for samples already packed (`pack_of`: pack index per sample,
    non-decreasing; pack j is step j // (dp*ga), micro-batch (j // dp) % ga, rank j % dp).

    Every step must be complete (dp*ga packs each). `max_tokens` (default `pack`) is the
    hard per-rank (per micro-batch) token cap of ours and of the look-ahead. `price`: the step's
    parts besides compute (default: only the cost's fixed `step_overhead`; no all-reduce, no optimizer).
    """
    cap = int(pack if max_tokens is None else max_tokens)
    if cap < pack:
        raise ValueError(f"--max-tokens {cap}: must be >= --pack {pack} (a pack must fit on its own rank)")
    data = _packed_steps(samples, pack_of, dp, ga, cost)
    price = StepPrice(fixed_s=cost.step_overhead) if price is None else price
    run = dict(cap=cap, sync=sync, bandwidth=bandwidth_gbs * 1e9, price=price, overlap=overlap, progress=progress)
    bounds = np.searchsorted(data.step, np.arange(data.n_steps + 1))
    groups = [slice(bounds[s], bounds[s + 1]) for s in range(data.n_steps)]
    tallies, lower, lower_compute, single_bound = run_steps(data, groups, data.rank, data.micro, dp, ga, METHODS,
                                                            **run)
    row = _row(data, dp, len(samples), tallies, lower, lower_compute, single_bound)
    row["allreduce_s"] = price.allreduce_s(dp)
    if lookahead > 1:
        la_groups, la_rank, la_micro, new_step, plan_s = _lookahead_slots(data, dp, ga, cap, sync, lookahead)
        la, _, _, single_la = run_steps(data, la_groups, la_rank, la_micro, dp, ga, ["ours"], **run)
        la = la["ours"]
        la.plan_s += plan_s
        tgs_none = row["tgs_none"]
        n, tgs_la = data.n_steps, float(data.tokens.sum()) / (dp * la.time)
        row.update({
            "tgs_lookahead": tgs_la,
            "gain_lookahead": tgs_la / tgs_none - 1.0,
            "single_sample_bound_share_lookahead": single_la / n,
            "moved_share_lookahead": la.moved / len(samples),
            "step_changed_share_lookahead": float(np.mean(new_step != data.step)),
            "plan_failures_lookahead": la.failed,
            "over_cap_share_lookahead": la.over_cap / n,
            "plan_ms_per_step_lookahead": 1e3 * la.plan_s / n,
            **_exchange_columns("lookahead", la, n, tgs_none, float(data.tokens.sum()) / dp),
        })
    return row


def _row(data: _PackedSteps, dp: int, n_samples: int, tallies: Dict[str, Tally], lower: float,
         lower_compute: float, single_bound: int) -> dict:
    """The result row of one DP size from the methods' sums (TGS = tokens / (dp * total step time))."""
    n = data.n_steps
    total_tokens = float(data.tokens.sum())
    tgs = {m: total_tokens / (dp * t.time) for m, t in tallies.items()}
    tgs["lower_bound"] = total_tokens / (dp * lower)
    t = tallies
    row = {
        "dp": int(dp),
        "steps": n,
        "samples": int(n_samples),
        "samples_per_rank_step": n_samples / (n * dp),
        "tgs_none": tgs["none"],
        "tgs_reference": tgs["reference"],
        "tgs_reference_capped": tgs["reference_capped"],
        "tgs_ours": tgs["ours"],
        "tgs_lower_bound": tgs["lower_bound"],
        "gain_reference": tgs["reference"] / tgs["none"] - 1.0,
        "gain_reference_capped": tgs["reference_capped"] / tgs["none"] - 1.0,
        "gain_ours": tgs["ours"] / tgs["none"] - 1.0,
        "gain_lower_bound": tgs["lower_bound"] / tgs["none"] - 1.0,
        "single_sample_bound_share": single_bound / n,
        "imbalance_none": t["none"].compute / lower_compute - 1.0,
        "applied_share_reference": t["reference"].applied / n,
        "applied_share_ours": t["ours"].applied / n,
        "moved_share_reference": t["reference"].moved / n_samples,
        "over_cap_share_reference": t["reference"].over_cap / n,
        "over_cap_share_reference_capped": t["reference_capped"].over_cap / n,
        "over_cap_share_ours": t["ours"].over_cap / n,
        "plan_failures_ours": t["ours"].failed,
        "moved_share_ours": t["ours"].moved / n_samples,
        "exposed_move_s_per_step_ours": t["ours"].parts["exchange"] / n,
        "exposed_move_s_per_step_reference": t["reference"].parts["exchange"] / n,
        "plan_ms_per_step_reference": 1e3 * t["reference"].plan_s / n,
        "plan_ms_per_step_reference_capped": 1e3 * t["reference_capped"].plan_s / n,
        "plan_ms_per_step_ours": 1e3 * t["ours"].plan_s / n,
    }
    for m in METHODS:
        row.update(_exchange_columns(m, t[m], n, tgs["none"], total_tokens / dp))
    return row


def _exchange_columns(method: str, tally: Tally, n_steps: int, tgs_none: float, tokens_per_gpu: float) -> dict:
    """A method's step split into its parts, the bytes it moves, the exchange's share of the step if it were
    not hidden, and the gain with that whole exchange on the step."""
    return {
        f"step_parts_s_{method}": {p: v / n_steps for p, v in tally.parts.items()},
        f"gb_moved_per_step_{method}": tally.bytes_moved / n_steps / 1e9,
        f"exchange_share_{method}": tally.exchange_share / n_steps,
        f"gain_{method}_exchange_shown": tokens_per_gpu / tally.time_exchange_shown / tgs_none - 1.0,
    }


# --------------------------------------------------------------------------- whole run


def simulate(
    source: Union[str, SampleShapes, np.ndarray],
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
    price: Optional[StepPrice] = None,
    progress: bool = False,
) -> dict:
    """Simulate every DP size; returns {"settings": {...}, "results": [row per DP size]}.

    `price` (default: `StepPrice.adam` over the cost's parameter count on documented H100-class
    hardware, fixed part = the cost's `step_overhead`) prices the step besides its compute.

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
    price = StepPrice.adam(cost.params, fixed_s=cost.step_overhead) if price is None else price
    per_dp_steps = [default_steps(d, ga) if steps is None else int(steps) for d in dp_sizes]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(per_dp_steps) * (2 if lookahead > 1 else 1), unit="step", desc="simulate")
    try:
        results = [
            simulate_dp(
                source, d, cost, pack=pack, ga=ga, steps=n, seed=seed, lookahead=lookahead, sync=sync,
                bandwidth_gbs=bandwidth_gbs, overlap=overlap, max_tokens=max_tokens, price=price, progress=bar,
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
        "step_price": price.to_dict(dp_sizes),
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


