"""Cost-model fitting across data-parallel ranks, framework-free (torch and torch.distributed only).

`runtime.recorder.StepRecorder` measures what this rank computed in one optimizer step and how long it
took. `CostModelFitter` keeps the bounded timing records, gathers them over a side gloo group, fits on
rank 0 (`core.fitting`, around the FLOP prior when one is given), gates the fit against the model in force
on held-out steps (`core.fit_gate`: adopted only when it predicts them better), estimates each rank's speed
from its residuals, broadcasts, and refits early (2x, 4x ... the warm-up) until the held-out error settles,
then every `refit_every` steps. Until a fit is adopted it plans with the prior (`planning_models`), hedged
(`plans_hedged`) as long as the model in force is uncertain. Guarantees: after `fit(step)` every rank holds the
same models, speeds, verdicts and schedule (rank 0's, bit for bit); a model in force is replaced only by a fit
that predicted held-out steps better (or, over a FLOP prior, an unverified one when no step can be held out,
planned hedged); memory is bounded whatever the run length (records, the measured window and the fit reports
are capped). `fit` and `window_metrics` are collectives: every rank calls them at the same step.
Trainer's `DPBalanceCallback` only adapts its events to these objects.
"""

from __future__ import annotations

import collections
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fit_gate import (TOKENS, GateDecision, gate_decision, gate_fit, heldout_error,
                                         heldout_split, next_fit_step, settled, uncertain)
from hf_dp_balance.core.fitting import compute_imbalance, fit_cost_model, fit_from_micro_batches, fit_from_records
from hf_dp_balance.runtime.recorder import (StepClock, StepRecorder, image_patches, micro_batch_lengths,
                                            sharded_units, synchronize, vision_tower)
from hf_dp_balance.runtime.logs import get_logger

logger = get_logger(__name__)

# Timing records kept for refits: enough steps to determine the 4 unknowns many times over.
MAX_RECORDS = 64
# Step times kept for the measured imbalance between two logs (a run that never logs stays bounded).
MAX_WINDOW_STEPS = 1024
# Fit reports kept (one per fit; refit_every=1 on a long run must not grow without bound).
MAX_FIT_REPORTS = 256
# The vision tower is fitted once this many (rank, step) observations timed it.
_MIN_VISION_OBSERVATIONS = 8


# --------------------------------------------------------------------------- clock


def resolve_timing(timing: str, device_type: str, sync: Optional[str] = None, model=None) -> str:
    """`auto` -> `thread_cpu` on a CPU device; on an accelerator `forward_events` under DDP (`sync="step"`:
    its forward has no collective), `unit_events` under FSDP (`micro_batch` and FSDP units in `model`,
    `runtime.recorder.sharded_units`: the spans of its units exclude the all-gather waits), `wall` where
    the forward meets other ranks and no such unit is found (ZeRO-3, a model not yet sharded, no model) or
    the strategy is unknown (None). Explicit choices stay."""
    if timing != "auto":
        return timing
    if device_type == "cpu":
        return "thread_cpu"
    if sync == "step":
        return "forward_events"
    if sync == "micro_batch" and model is not None and sharded_units(model):
        return "unit_events"
    return "wall"


def resolve_fit_mode(fit_mode: str, timing: str) -> str:
    """`auto` -> `per_rank` with thread CPU time (clean per-rank compute: a rank blocked in a collective
    burns no CPU), forward events (no collective in a DDP forward) or unit events (FSDP units' spans start
    after their all-gather's wait); `step_max` with wall time (ranks meet in the gradient all-reduce)."""
    if fit_mode != "auto":
        return fit_mode
    return "step_max" if timing == "wall" else "per_rank"


WARMUP_PER_RANK = 5  # every rank's time is seen: 5 steps pin the four coefficients (docs/cost_model.md)
WARMUP_STEP_MAX = 16  # only the slowest rank's: 4 probe cycles (core/hedge.py), 11 of 12 cells >= 95% of the cut
# Where every micro-batch is a step-max observation of its own (FSDP / ZeRO-3), what the fit needs is about this
# many of them: M = 2 from 16 steps and M = 4 from 8 met the share of the cut in 12 of 12 bar cells, M = 2 from 8
# steps (16 observations) in 10 (the cost-fit study at eff4fc4, docs/cost_model.md) ...
WARMUP_OBSERVATIONS = 32
# ... and never fewer steps than this: two probe cycles (core/hedge.py), each of its placements twice.
WARMUP_STEP_MAX_MIN = 8


def resolve_warmup_steps(warmup_steps: Optional[int], fit_mode: str, micro_batches: int = 1) -> int:
    """The steps timed before the first fit: `warmup_steps` when set, else by what the fit sees. The step-time
    fit with `micro_batches` step-max observations a step (each micro-batch meets across the ranks) waits for
    `WARMUP_OBSERVATIONS` of them, within [WARMUP_STEP_MAX_MIN, WARMUP_STEP_MAX] steps: 16 at 1-2 micro-batches,
    11 at 3, 8 from 4."""
    if warmup_steps is not None:
        return warmup_steps
    if fit_mode != "step_max":
        return WARMUP_PER_RANK
    per_step = max(int(micro_batches), 1)
    return min(WARMUP_STEP_MAX, max(WARMUP_STEP_MAX_MIN, -(-WARMUP_OBSERVATIONS // per_step)))


def priors_from_config(model_config) -> Tuple[Optional[CostModel], Optional[CostModel]]:
    """(decoder prior, vision prior) from the model's config (`CostModel.from_config`); None for what the
    config does not describe (logged once: planning then waits for the fit)."""
    if model_config is None:
        return None, None
    try:
        decoder = CostModel.from_config(model_config)
    except ValueError as exc:
        logger.warning("dp_balance: no FLOP prior from %s (%s); nothing is planned before the first fit",
                       type(model_config).__name__, exc)
        return None, None
    try:
        vision = CostModel.from_config(model_config, module="vision")
    except ValueError:
        vision = None  # a text model, or a tower we do not describe: the decoder prior alone
    return decoder, vision


# A rank's speed is reported only beyond this relative distance from 1: timing noise alone moves the
# median residual of a few steps by ~1%, and a plan must not chase it.
SPEED_DEADBAND = 0.02


def rank_speeds(model: CostModel, features: np.ndarray, times: np.ndarray) -> np.ndarray:
    """Relative speed of each rank [R] from per-rank times [S, R] of work `features` [S, R, 4]: the median
    over steps of predicted / observed time, divided by its median over ranks (a rank consistently slower
    for the same predicted work gets < 1); within `SPEED_DEADBAND` of 1: exactly 1."""
    predicted = model.predict(features)
    ok = (predicted > 0) & (times > 0)
    ratio = np.where(ok, predicted / np.where(ok, times, 1.0), np.nan)
    per_rank = np.nanmedian(ratio, axis=0)
    if not np.all(np.isfinite(per_rank)):
        return np.ones(features.shape[1])
    speeds = per_rank / np.median(per_rank)
    return np.where(np.abs(speeds - 1.0) <= SPEED_DEADBAND, 1.0, speeds)


def fit_ranks(features: np.ndarray, times: np.ndarray, fit_mode: str, prior: Optional[CostModel] = None,
              estimate_speeds: bool = False, shape_prior: bool = False, drop_first: bool = True):
    """(FitResult, speeds or None) of gathered records [steps, ranks, 4] / [steps, ranks] (`fit_from_records`).
    With `estimate_speeds` and the per-rank fit: each rank's speed from the residuals, and the fit redone on
    speed-corrected times, so a slow rank does not bend the shared model toward it."""
    result = fit_from_records(features, times, fit_mode, prior=prior, shape_prior=shape_prior, drop_first=drop_first)
    speeds = None
    if estimate_speeds and fit_mode == "per_rank":
        if drop_first and features.shape[0] >= 3:
            features, times = features[1:], times[1:]
        speeds = rank_speeds(result.model, features, times)
        if np.any(speeds != 1.0):
            result = fit_from_records(features, times * speeds, fit_mode, prior=prior, shape_prior=shape_prior,
                                      drop_first=False)
            speeds = rank_speeds(result.model, features, times)
    return result, speeds


# --------------------------------------------------------------------------- fitting across ranks


class StepRecord(NamedTuple):
    """One rank's optimizer step: decoder feature row and seconds, vision feature row and seconds, and (when
    each micro-batch was timed) the decoder's feature rows [M, 4] and seconds [M] of every micro-batch."""

    features: np.ndarray
    decoder_s: float
    vision_features: np.ndarray
    vision_s: float
    micro_features: Optional[np.ndarray] = None
    micro_s: Optional[np.ndarray] = None


MicroBatches = Tuple[Sequence[Sequence[int]], Sequence[float], Sequence[float]]
"""What `StepRecorder.micro_batches()` gives: per micro-batch its sample lengths, seconds and tower seconds."""


def micro_table(gathered_micro: list, steps: int):
    """The per-micro-batch table of the last `steps` steps from every rank's records, or None where it is
    not complete: features per step [M_s, ranks, 4] and seconds [M_s, ranks]. Complete: every rank timed
    every one of those steps' micro-batches and the ranks agree on each step's count (one plan for the
    step's ranks x micro-batches: micro-batch m meets across the ranks)."""
    feats, secs = [], []
    for s in range(steps):
        per_rank = [g[len(g) - steps + s] for g in gathered_micro]
        if any(r is None for r in per_rank) or len({len(r[1]) for r in per_rank}) != 1 or not len(per_rank[0][1]):
            return None
        feats.append(np.stack([r[0] for r in per_rank], axis=1))
        secs.append(np.stack([r[1] for r in per_rank], axis=1))
    return feats, secs


class CostModelFitter:
    """Timing records of this rank, fitted across ranks into the cost models every rank plans with.

    Args:
        config: `warmup_steps` (first fit; None: by the fit mode, `resolve_warmup_steps`), `refit_every`, `fit_mode`, `verbose` are read.
        rank, world, group: this process in the data-parallel group and the side (gloo) group over that
            slice that carries records and coefficients (None with world 1); its rank 0 fits.
        relay: under a dp x tp / cp mesh, what carries the fitting slice's models to the other slices (a
            `runtime.side_channel.StoreRelay`); only the slice of global rank 0 gathers records and fits.
        timing: the resolved clock (`thread_cpu`, `wall`, `forward_events`, `unit_events`); `fit_mode="auto"`
            follows it.
        decoder, vision, fitted_step: models to start from (a checkpoint, `cost_model_path`).
        prior, vision_prior: FLOP priors (`CostModel.from_config`): planned with until the first fit, and
            fitted around (`config.prior`).
        sync: the loader's resolved sync (`step` / `micro_batch`; None: `config.sync`): whether the step-time
            fit reads each micro-batch (`fits_micro_batches`).
    """

    def __init__(self, config: DPBalanceConfig, *, rank: int = 0, world: int = 1, group=None,
                 timing: str = "thread_cpu", decoder: Optional[CostModel] = None,
                 vision: Optional[CostModel] = None, fitted_step: int = -1,
                 prior: Optional[CostModel] = None, vision_prior: Optional[CostModel] = None,
                 sync: Optional[str] = None, relay=None):
        self.config = config
        self.rank, self.world, self.group = rank, world, group
        self.relay = relay  # models between data-parallel slices (`runtime.side_channel.StoreRelay`; None: one slice)
        self.timing = timing
        self.sync = config.sync if sync is None else sync
        self.fit_mode = resolve_fit_mode(config.fit_mode, timing)
        # by the fit mode; under FSDP / ZeRO-3 also by the micro-batches a step, known from the first record
        self.warmup_steps = resolve_warmup_steps(config.warmup_steps, self.fit_mode)
        self.decoder: Optional[CostModel] = decoder
        self.vision: Optional[CostModel] = vision
        self.fitted_step = fitted_step  # the step of the last fit, adopted or not (-1: none yet)
        self.adopted_step = fitted_step  # the step whose fit is in force (-1: none fitted here)
        self.given_step = fitted_step if decoder is not None else -2  # a given model's step: not fitted here
        self.vision_step = -1  # the step whose vision fit is in force (-1: none fitted here)
        # the step of the next fit (`fit_due`): after the warm-up without a model, `refit_every` after a given one
        self.next_fit_step: Optional[int] = None if decoder is None else (
            fitted_step + config.refit_every if config.refit_every > 0 else None)
        self.heldout_errors: list = []  # the candidate's held-out error at every gated fit (`settled`)
        self.last_gate: Optional[GateDecision] = None  # the decoder gate's last verdict
        self.last_vision_gate: Optional[GateDecision] = None
        # a fitted model whose held-out error is unknown or not clearly below the tokens' is planned hedged
        self.uncertain = False
        self.prior, self.vision_prior = (prior, vision_prior) if config.prior else (None, None)
        self.speeds = np.ones(world)  # relative speed of every rank (1: nominal), from the last fit
        self.records: collections.deque = collections.deque(maxlen=MAX_RECORDS)
        self.window: collections.deque = collections.deque(maxlen=MAX_WINDOW_STEPS)  # step seconds since the last log
        self.fit_reports: collections.deque = collections.deque(maxlen=MAX_FIT_REPORTS)

    def restore(self, decoder: CostModel, vision: Optional[CostModel], fitted_step: int) -> None:
        """Put a saved run's models in force as a given model is (its records are not here: every recorded step
        is unseen, the next fit `refit_every` after `fitted_step`), dropping any gate state of this run."""
        self.decoder, self.vision = decoder, vision
        self.fitted_step = self.adopted_step = self.given_step = int(fitted_step)
        self.next_fit_step = fitted_step + self.config.refit_every if self.config.refit_every > 0 else None
        self.uncertain, self.last_gate, self.last_vision_gate, self.heldout_errors = False, None, None, []

    @property
    def fits_micro_batches(self) -> bool:
        """Whether each timed micro-batch is a step-max observation of its own: the step-time fit where every
        micro-batch meets across the ranks (`sync` micro_batch: FSDP / ZeRO-3). A config's `auto` sync counts
        as that, since `resolve_timing` picks the wall clock (and so the step-time fit) for `auto` only under
        FSDP / ZeRO-3 or an unknown strategy; `sync="step"` (DDP: ranks meet once a step) keeps the step's sums."""
        return self.fit_mode == "step_max" and self.sync != "step"

    @property
    def shape_prior(self) -> bool:
        """Whether the per-rank fit reads every rank's time with the prior as a distribution
        (`core.fitting.fit_each_rank`): for `unit_events` timing (FSDP), whose fixed-length packs leave
        attention a few percent of a rank's time, where the penalty rows kept most of a prior's 2x error. The
        other per-rank timings (CPU, DDP) keep the penalty-row fit they were measured with."""
        return self.timing == "unit_events" and self.fit_mode == "per_rank"

    @property
    def planning_with_prior(self) -> bool:
        """Whether the loader plans with the FLOP prior (no model fitted or given yet): its plans are hedged."""
        return self.decoder is None and self.prior is not None

    @property
    def plans_hedged(self) -> bool:
        """Whether the loader plans as it plans the prior (`core.hedge`: no worse than the token-balanced plan
        under the model and the tokens): with the prior, or with a fitted model that is `uncertain`
        (`core.fit_gate`: its held-out error is unknown or not clearly below the token count's)."""
        return self.planning_with_prior or (self.decoder is not None and self.uncertain)

    def planning_models(self) -> Tuple[Optional[CostModel], Optional[CostModel]]:
        """(decoder, vision) the loader plans with: the fitted models, else the priors. The vision prior
        only beside the decoder prior: one plan never adds seconds to FLOPs."""
        if self.decoder is not None:
            return self.decoder, self.vision
        return self.prior, self.vision_prior if self.prior is not None else None

    # -- recording ----------------------------------------------------------------------

    def record(self, lengths: Sequence[int], elapsed_s: float, patches: Sequence[int] = (), vision_s: float = 0.0,
               micro: Optional[MicroBatches] = None) -> None:
        """One step of this rank: its sample lengths, its seconds, and the vision tower's share of them;
        `micro`: each micro-batch's lengths, seconds and tower seconds (`StepRecorder.micro_batches()`), kept
        where the fit reads them (`fits_micro_batches`: under FSDP / ZeRO-3 every micro-batch meets)."""
        decoder_s = max(elapsed_s - vision_s, 0.0)
        micro_f = micro_s = None
        if micro is not None and self.fits_micro_batches:
            micro_f = np.stack([features_of(x) for x in micro[0]])
            micro_s = np.maximum(np.asarray(micro[1], dtype=np.float64) - np.asarray(micro[2], dtype=np.float64), 0.0)
        if micro_s is not None and not self.records and self.decoder is None:
            # the first step's micro-batch count sets the warm-up (every rank records the same first step, so
            # every rank agrees on the step of the first fit, a collective)
            self.warmup_steps = resolve_warmup_steps(self.config.warmup_steps, self.fit_mode, len(micro_s))
        self.records.append(StepRecord(features_of(lengths), decoder_s, features_of(patches), vision_s,
                                       micro_f, micro_s))
        self.window.append(elapsed_s)

    def fit_due(self, step: int) -> bool:
        """The first fit after `warmup_steps` steps (when no model is given); then the steps `core.fit_gate.
        next_fit_step` names: early refits at 2x, 4x ... the warm-up until the held-out error settles (or
        while every fit so far was rejected or failed), then every `refit_every`."""
        if self.fitted_step < 0 and self.decoder is None:
            return step >= max(self.warmup_steps, 1)
        return self.next_fit_step is not None and step >= self.next_fit_step

    def end_step(self, step: int, lengths: Sequence[int], elapsed_s: float, patches: Sequence[int] = (),
                 vision_s: float = 0.0, micro: Optional[MicroBatches] = None) -> bool:
        """Record the step, and fit when due (a collective: every rank ends the same steps). True if it fitted."""
        self.record(lengths, elapsed_s, patches, vision_s, micro)
        if not self.fit_due(step):
            return False
        self.fit(step)
        return True

    # -- collectives --------------------------------------------------------------------

    def _gather(self, obj, to: Optional[int] = None) -> Optional[list]:
        """All ranks' `obj` in rank order (side group): on every rank (`to` None), or on rank `to` only, the
        others getting None (a gather, not an all-gather: one rank fits). A slice that does not fit (under a
        mesh the models come from the slice of global rank 0, `relay`) gathers nothing for `to`."""
        if to is not None and self.relay is not None and not self.relay.sends:
            return None
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        if to is None:
            out = [None] * self.world
            dist.all_gather_object(out, obj, group=self.group)
            return out
        out = [None] * self.world if self.rank == to else None
        dist.gather_object(obj, out, group=self.group, group_dst=to)
        return out

    def _broadcast(self, obj):
        """Rank 0's `obj` (the group's first rank fits) on every rank; under a mesh, from the fitting slice's
        first process to every slice (`runtime.side_channel.share_from_first`)."""
        if self.world == 1 and self.relay is None:
            return obj
        from hf_dp_balance.runtime.side_channel import share_from_first

        return share_from_first(obj, self.group, self.rank, self.world, self.relay)

    def fit(self, step: int) -> None:
        """Gather every rank's records, fit and gate on rank 0, broadcast: every rank holds the same models,
        verdicts and schedule after. A new model replaces the one in force only when the gate adopts it
        (`core.fit_gate`); otherwise the model in force stays and the next scheduled fit tries again."""
        records = list(self.records)
        mine = tuple(np.array([r[i] for r in records]) for i in range(4))
        if self.fits_micro_batches:
            mine += ([None if r.micro_s is None else (r.micro_features, r.micro_s) for r in records],)
        gathered = self._gather(mine, to=0)  # None on every rank but the fitting one
        payload = None
        if gathered is not None:
            payload = self._fit_gathered(gathered, min(len(g[1]) for g in gathered), step)
        payload = self._broadcast(payload)
        self._apply(step, payload)

    def _apply(self, step: int, payload: dict) -> None:
        """Install what rank 0 decided (every rank alike) and schedule the next fit."""
        self.fitted_step = step
        gate = payload.get("gate")
        self.last_gate = None if gate is None else GateDecision(**gate)
        vgate = payload.get("vision_gate")
        self.last_vision_gate = None if vgate is None else GateDecision(**vgate)
        if payload.get("decoder") is not None:
            self.decoder = CostModel.from_dict(payload["decoder"])
            self.adopted_step = step
            if payload.get("speeds") is not None:
                self.speeds = np.asarray(payload["speeds"], dtype=np.float64)
        if payload.get("vision") is not None:
            self.vision = CostModel.from_dict(payload["vision"])
            self.vision_step = step
        if self.last_gate is not None:
            if np.isfinite(self.last_gate.candidate_error):
                self.heldout_errors = (self.heldout_errors + [self.last_gate.candidate_error])[-MAX_FIT_REPORTS:]
            # the error of the model that now plans, measured on the steps just held out
            g = self.last_gate
            self.uncertain = uncertain(g.candidate_error if g.adopt else g.in_force_error, g.tokens_error)
        if payload.get("report"):
            # the fit's coefficients whether adopted or not: what the data says, beside what plans
            self.fit_reports.append({"step": step, **payload["report"], "gate": gate, "vision_gate": vgate,
                                     "hedged": self.plans_hedged, "fitted": payload.get("fitted")})
        if payload.get("error"):
            logger.warning("dp_balance: cost model fit at step %d failed (%s); keeping the model in force",
                           step, payload["error"])
        elif self.last_gate is not None and not self.last_gate.adopt and self.rank == 0:  # one line per run
            g = self.last_gate
            logger.warning("dp_balance: the cost model fitted at step %d was not adopted (held-out error %.3f against "
                           "%.3f of the model in force); retried at the next fit", step, g.candidate_error,
                           g.in_force_error)
        # settled: two successive fits predicted their held-out steps alike, adopted or not (more data no longer
        # changes the fit); a rejected or failed fit is tried again at the next scheduled step either way
        is_settled = self.last_gate is not None and settled(self.heldout_errors)
        self.next_fit_step = next_fit_step(step, self.warmup_steps, self.config.refit_every, is_settled,
                                           self.adopted_step >= 0 and self.decoder is not None)
        if self.config.verbose and self.rank == 0 and payload.get("report"):
            logger.info("dp_balance: fitted at step %d: %s; gate: %s", step, payload["report"], gate)

    def _decoder_tables(self, gathered, steps: int):
        """What the decoder's fit reads and the gate scores, from the last `steps` records (the first recorded
        step dropped from 3 on): (fit(step indices) -> (FitResult, speeds), features [N, ranks, 4], observed
        times [N, ranks] (per-rank) or [N] (step times, or each micro-batch's maximum), the recorded step of
        each of the N rows, the number of steps)."""
        feats = np.stack([g[0][-steps:] for g in gathered], axis=1)
        times = np.stack([g[1][-steps:] for g in gathered], axis=1)
        micro = micro_table([g[4] for g in gathered], steps) if len(gathered[0]) > 4 else None
        drop = 1 if steps >= 3 else 0
        if micro is not None:  # one step-max observation per micro-batch: the model FSDP / ZeRO-3 runs
            mfeats, msecs = micro[0][drop:], micro[1][drop:]

            def fit_micro(idx):
                return fit_from_micro_batches([mfeats[i] for i in idx], [msecs[i] for i in idx],
                                              prior=self.prior, drop_first=False), None

            step_of = np.concatenate([np.full(len(t), s) for s, t in enumerate(msecs)])
            return (fit_micro, np.concatenate(mfeats), np.concatenate([t.max(axis=1) for t in msecs]), step_of,
                    len(mfeats))
        feats, times = feats[drop:], times[drop:]

        def fit_records(idx):
            return fit_ranks(feats[idx], times[idx], self.fit_mode, self.prior, self.config.estimate_speeds,
                             shape_prior=self.shape_prior, drop_first=False)

        observed = times if self.fit_mode == "per_rank" else times.max(axis=1)
        return fit_records, feats, observed, np.arange(len(times)), len(times)

    def _unseen(self, step: int, n_steps: int) -> Optional[np.ndarray]:
        """Indices of the last `n_steps` recorded steps (ending at `step`) that the fitted model in force was not
        fitted on: those after the step of its fit. None while a prior (fitted on nothing) or a given model
        (a checkpoint's: its records are not here) is in force: every step is unseen."""
        if self.decoder is None or self.adopted_step < 0 or self.adopted_step == self.given_step:
            return None
        first = step - n_steps + 1  # the step of index 0
        return np.flatnonzero(np.arange(first, first + n_steps) > self.adopted_step)

    def _fit_gathered(self, gathered, steps: int, step: int) -> dict:
        """Rank 0: fit the decoder (and the vision tower, when it was timed) from [steps, ranks] tables, each
        gated against the model in force on held-out steps (`core.fit_gate`)."""
        try:
            fit, feats, observed, step_of, n_steps = self._decoder_tables(gathered, steps)
            decision = gate_fit(fit, feats, observed, step_of, n_steps, step, self.decoder or self.prior,
                                prior_in_force=self.decoder is None, unseen=self._unseen(step, n_steps))
            result, speeds = fit(np.arange(n_steps))
        except (ValueError, RuntimeError, FloatingPointError) as exc:
            return {"error": str(exc)}
        payload = {"decoder": result.model.to_dict() if decision.adopt else None, "report": result.report.to_dict(),
                   "speeds": None if speeds is None else speeds.tolist(), "gate": decision.to_dict(),
                   "fitted": {"decoder": result.model.to_dict()}}
        vfeats = np.stack([g[2][-steps:] for g in gathered], axis=1)
        vtimes = np.stack([g[3][-steps:] for g in gathered], axis=1)
        timed = vtimes > 0  # a (step, rank) whose tower ran no image is no observation
        if timed.sum() >= _MIN_VISION_OBSERVATIONS:  # the tower was timed: fit it
            try:
                model, vdecision = self._fit_vision(vfeats, vtimes, timed, step)
                payload["vision_gate"] = vdecision.to_dict()
                payload["fitted"]["vision"] = model.to_dict()
                if vdecision.adopt:
                    payload["vision"] = model.to_dict()
            except (ValueError, RuntimeError, FloatingPointError) as exc:
                logger.warning("dp_balance: vision cost model fit failed: %s", exc)
        return payload

    def _fit_vision(self, vfeats: np.ndarray, vtimes: np.ndarray, timed: np.ndarray, step: int):
        """(the vision model fitted on every timed (step, rank), the gate's verdict on it): per-rank
        observations of the tower, steps held out as for the decoder."""
        def fit_on(mask):
            return fit_cost_model(vfeats[mask][:, None, :], vtimes[mask][:, None], mode="per_rank",
                                  prior=self.vision_prior).model

        in_force = self.vision or self.vision_prior
        train, test = heldout_split(vfeats.shape[0], vfeats.shape[1], seed=step + 1)
        if self.vision is not None and self.vision_step >= 0:  # a fitted model in force: the steps it never saw
            first = step - vfeats.shape[0] + 1
            test = np.flatnonzero(np.arange(first, first + vfeats.shape[0]) > self.vision_step)
            train = np.setdiff1d(np.arange(vfeats.shape[0]), test)
        train_mask, test_mask = timed.copy(), timed.copy()
        train_mask[test], test_mask[train] = False, False
        model = fit_on(timed)
        if in_force is None:
            return model, gate_decision(float("nan"), float("nan"), has_model_in_force=False)
        if train_mask.sum() < _MIN_VISION_OBSERVATIONS or not test_mask.any():
            nan = float("nan")
            if self.vision is None:  # only the prior in force: adopted unverified, as the decoder's first fit
                return model, GateDecision(True, nan, nan, nan, "too few timed steps to hold one out: adopted "
                                                                "unverified")
            return model, gate_decision(nan, nan, nan)
        candidate = fit_on(train_mask)
        f = np.concatenate([vfeats[train_mask], vfeats[test_mask]])[:, None, :]
        t = np.concatenate([vtimes[train_mask], vtimes[test_mask]])[:, None]
        n_train = int(train_mask.sum())
        tr, te = np.arange(n_train), np.arange(n_train, len(t))
        errors = [heldout_error(m, f, t, tr, te) for m in (candidate, in_force, TOKENS)]
        return model, gate_decision(errors[0], errors[1], errors[2])

    def window_metrics(self) -> Dict[str, float]:
        """Measured compute since the last call (a collective): `compute_imbalance` (mean over steps of
        slowest / mean rank - 1) and `slowest_rank_compute_s` (sum over steps of the slowest rank)."""
        window = list(self.window)
        self.window.clear()
        if not window:
            return {}
        table = self._gather(window)
        steps = min(len(t) for t in table)
        if not steps:
            return {}
        arr = np.array([t[-steps:] for t in table]).T  # [steps, ranks]
        return {"compute_imbalance": compute_imbalance(arr), "slowest_rank_compute_s": float(arr.max(axis=1).sum())}

    def model_metrics(self) -> Dict[str, float]:
        """The decoder coefficients in force (`cost_<name>`), `fitted` (1.0 once a model is set),
        `planning_with_prior` (1.0 while the prior plans) and every rank's `speed_rank_<k>`."""
        out = {}
        if self.decoder is not None:
            out.update({f"cost_{name}": value for name, value in self.decoder.to_dict().items()})
        out["fitted"] = float(self.decoder is not None)
        if self.prior is not None:
            out["planning_with_prior"] = float(self.planning_with_prior)
        out["planning_hedged"] = float(self.plans_hedged)
        if self.last_gate is not None:  # the last fit: rejected or not, and the two held-out errors it compared
            out["fit_rejected"] = float(not self.last_gate.adopt)
            out["heldout_error_candidate"] = self.last_gate.candidate_error
            out["heldout_error_in_force"] = self.last_gate.in_force_error
            out["heldout_error_tokens"] = self.last_gate.tokens_error
        if self.config.estimate_speeds and self.world > 1:
            out.update({f"speed_rank_{k}": float(v) for k, v in enumerate(self.speeds)})
        return out


# StepClock, StepRecorder and what a micro-batch computes live in runtime.recorder; importable from here.
__all__ = ["CostModelFitter", "MAX_FIT_REPORTS", "MAX_RECORDS", "MAX_WINDOW_STEPS", "MicroBatches", "SPEED_DEADBAND",
           "StepClock", "StepRecord", "StepRecorder", "fit_ranks", "image_patches", "micro_batch_lengths", "micro_table",
           "priors_from_config", "rank_speeds", "resolve_fit_mode", "resolve_timing", "resolve_warmup_steps",
           "synchronize", "vision_tower"]
