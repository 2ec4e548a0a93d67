"""One simulated step: every method's placement of the step's samples and what it costs (`simulate_step`),
and the sums of a method over the steps of a run. Pure numpy (the planners are)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Sequence

import numpy as np

from hf_dp_balance.apps.sim_model import DEFAULT_BANDWIDTH_GBS, move_seconds
from hf_dp_balance.core.steps import slot_loads, step_makespan
from hf_dp_balance.apps.sim_price import PARTS, StepPrice

# --------------------------------------------------------------------------- one step

# The methods compared on every step (the look-ahead runs apart: it changes which step a sample is in).
METHODS = ("none", "reference", "reference_capped", "ours")


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
    bytes_moved: Dict[str, float] = field(default_factory=dict)  # all ranks together


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
    methods: Sequence[str] = METHODS,
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
        out.bytes_moved[method] = float(nbytes[dest_rank != owners].sum())
        out.applied[method] = applied
        # The reference's own cap is 1.2x the average tokens: it may exceed the per-rank cap.
        slot_tokens = slot_loads(tokens.astype(np.float64), dest_rank, dest_micro, num_ranks, ga)
        out.over_cap[method] = bool(slot_tokens.max() > max_tokens) if tokens.size else False
    return out


# --------------------------------------------------------------------------- sums over steps


@dataclass
class Tally:
    """One method's sums over the steps of a run (seconds, counts, bytes)."""

    time: float = 0.0  # step time: every part of `StepPrice.parts`, the exchange as configured
    time_exchange_shown: float = 0.0  # the same with the whole exchange on the step (not hidden)
    parts: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PARTS})
    exchange_share: float = 0.0  # sum over steps of exchange / (step with the exchange shown)
    bytes_moved: float = 0.0
    plan_s: float = 0.0
    moved: int = 0
    applied: int = 0
    over_cap: int = 0
    failed: int = 0

    def add(self, outcome: StepOutcome, method: str, price: StepPrice, dp: int, overlap: bool) -> None:
        parts = price.parts(dp, outcome.makespan[method], outcome.move_seconds[method], overlap)
        shown = price.parts(dp, outcome.makespan[method], outcome.move_seconds[method], False)
        for p in PARTS:
            self.parts[p] += parts[p]
        self.time += sum(parts.values())
        self.time_exchange_shown += sum(shown.values())
        self.exchange_share += shown["exchange"] / sum(shown.values())
        self.bytes_moved += outcome.bytes_moved[method]
        self.plan_s += outcome.plan_seconds[method]
        self.moved += outcome.moved[method]
        self.applied += int(outcome.applied[method])
        self.over_cap += int(outcome.over_cap[method])
        self.failed += int(outcome.failed.get(method, False))

    @property
    def compute(self) -> float:
        return self.parts["compute"]


def run_steps(data, groups, ranks: np.ndarray, micros: np.ndarray, dp: int, ga: int,
              methods: Sequence[str], *, cap: int, sync: str, bandwidth: float, price: StepPrice, overlap: bool,
              progress=None):
    """Every step (`groups`: the sample indices of each) under every method: (tallies, lower-bound step
    time, its compute, steps bound by a single sample). The lower bound moves nothing."""
    tallies = {m: Tally() for m in methods}
    lower = lower_compute = 0.0
    single_bound = 0
    for idx in groups:
        o = simulate_step(
            data.costs[idx], data.tokens[idx], data.nbytes[idx], ranks[idx], micros[idx], dp, ga,
            max_tokens=cap, sync=sync, bandwidth=bandwidth, methods=methods,
        )
        for m in methods:
            tallies[m].add(o, m, price, dp, overlap)
        lower += sum(price.parts(dp, o.lower_bound, 0.0, overlap).values())
        lower_compute += o.lower_bound
        single_bound += int(o.single_sample_bound)
        if progress is not None:
            progress.update(1)
    return tallies, lower, lower_compute, single_bound
