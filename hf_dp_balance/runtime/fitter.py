"""Cost-model fitting across data-parallel ranks, framework-free (torch and torch.distributed only).

`StepRecorder` measures what this rank computed in one optimizer step (per-sample token lengths from
forward pre-hooks, image patches and the vision tower's time from hooks on the tower) and how long
the step took, on one `StepClock` for both. `CostModelFitter` keeps the bounded timing records,
gathers them over a side gloo group, fits on rank 0 (`core.fitting`), broadcasts the coefficients,
and refits every `refit_every` steps. Guarantees: after `fit(step)` every rank holds the same
models (rank 0's, bit for bit); memory is bounded whatever the run length (records, the measured
window and the fit reports are capped). `fit` and `window_metrics` are collectives: every rank calls
them at the same step. Trainer's `DPBalanceCallback` only adapts its events to these objects.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel, features_of
from hf_dp_balance.core.fitting import compute_imbalance, fit_cost_model, fit_from_records
from hf_dp_balance.core.packing import segment_lengths

logger = logging.getLogger(__name__)

# Timing records kept for refits: enough steps to determine the 4 unknowns many times over.
MAX_RECORDS = 64
# Step times kept for the measured imbalance between two logs (a run that never logs stays bounded).
MAX_WINDOW_STEPS = 1024
# Fit reports kept (one per fit; refit_every=1 on a long run must not grow without bound).
MAX_FIT_REPORTS = 256
# The vision tower is fitted once this many (rank, step) observations timed it.
_MIN_VISION_OBSERVATIONS = 8


# --------------------------------------------------------------------------- clock


def resolve_timing(timing: str, device_type: str) -> str:
    """`auto` -> `thread_cpu` on a CPU device, `wall` on any accelerator; explicit choices stay."""
    if timing != "auto":
        return timing
    return "thread_cpu" if device_type == "cpu" else "wall"


def resolve_fit_mode(fit_mode: str, timing: str) -> str:
    """`auto` -> `per_rank` with thread CPU time (clean per-rank compute: a rank blocked in a collective
    burns no CPU); `step_max` with wall time (ranks meet in the gradient all-reduce)."""
    if fit_mode != "auto":
        return fit_mode
    return "per_rank" if timing == "thread_cpu" else "step_max"


def synchronize() -> None:
    """Wait for the accelerator's queued kernels (CUDA), so that wall time covers their compute."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """The one clock of a run: `thread_cpu` (`time.thread_time`) or `wall` (synchronised `perf_counter`).

    The step and the vision tower inside it read the same clock, so their difference is the decoder's time.
    """

    def __init__(self, timing: str):
        if timing not in ("thread_cpu", "wall"):
            raise ValueError(f"StepClock: timing={timing!r} must be 'thread_cpu' or 'wall' (resolve 'auto' first)")
        self.timing = timing

    def now(self) -> float:
        if self.timing == "wall":
            synchronize()
            return time.perf_counter()
        return time.thread_time()


# --------------------------------------------------------------------------- what a micro-batch computes


def micro_batch_lengths(inputs: Dict[str, Any]) -> List[int]:
    """Per-sample token lengths of one micro-batch, as the model will compute it.

    Packed rows ([B, T] or Qwen-VL's [4, B, T] position ids): the samples of
    `core.packing.segment_lengths`. Padded rows: the attention mask's row sums.
    Otherwise every row is one sample.
    """
    import torch

    pos = inputs.get("position_ids")
    if isinstance(pos, torch.Tensor) and (pos.dim() == 2 or (pos.dim() == 3 and pos.shape[0] == 4)):
        return segment_lengths(pos)
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return [int(x) for x in mask.sum(dim=1).tolist()]
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return [int(ids.shape[-1])] * (int(ids.shape[0]) if ids.dim() == 2 else 1)
    return []


def image_patches(inputs: Dict[str, Any]) -> List[int]:
    """Patches of every frame of every image / video in a micro-batch: the vision cost model's unit
    (`core.costing.frame_patches`: a Qwen-VL grid (t, h, w) is t frames of h*w; InternVL: one tile each)."""
    import torch

    from hf_dp_balance.core.costing import frame_patches

    out: List[int] = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = inputs.get(key)
        if isinstance(grid, torch.Tensor) and grid.numel():
            out.extend(int(x) for x in frame_patches(grid.detach().cpu().numpy().reshape(-1, 3))[0].tolist())
    if not out and inputs.get("pixel_values") is not None and inputs.get("image_grid_thw") is None:
        pv = inputs["pixel_values"]
        if isinstance(pv, torch.Tensor) and pv.dim() == 4:  # InternVL tiles: cost per tile is fixed
            out.extend([int(pv.shape[-1] * pv.shape[-2]) // (14 * 14)] * int(pv.shape[0]))
    return out


def vision_tower(model):
    """The vision tower module of a Qwen-VL / InternVL model, or None."""
    for path in ("model.visual", "visual", "model.vision_tower", "vision_tower"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


class StepRecorder:
    """What this rank computed in the current optimizer step, and how long it took (on `clock`)."""

    def __init__(self, clock: StepClock):
        self.clock = clock
        self.lengths: List[int] = []
        self.patches: List[int] = []
        self.vision_s = 0.0
        self.started: Optional[float] = None
        self._hooks: list = []

    def begin(self) -> None:
        self.lengths, self.patches, self.vision_s = [], [], 0.0
        self.started = self.clock.now()

    def end(self) -> Optional[float]:
        """Seconds since `begin` (None when no step was begun)."""
        if self.started is None:
            return None
        elapsed = self.clock.now() - self.started
        self.started = None
        return elapsed

    def install(self, model) -> None:
        """Hooks: the model's forward inputs give the sample lengths (and, without a separate tower, the
        image patches); the vision tower's forward gives the images it really computes and its time.
        Installing again first removes this recorder's previous hooks (no forward is recorded twice)."""
        self.remove()
        tower = vision_tower(model)

        def before_forward(module, args, kwargs):
            inputs = dict(kwargs)
            self.lengths.extend(micro_batch_lengths(inputs))
            if tower is None:
                self.patches.extend(image_patches(inputs))
            return None

        self._hooks.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
        if tower is not None:
            self._install_tower(tower)

    def _install_tower(self, tower) -> None:
        marks = {}

        def tower_begin(module, args, kwargs):
            # The images this rank's tower really computes (after vision balancing moved some).
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if grid is not None:
                self.patches.extend(image_patches({"image_grid_thw": grid}))
            elif args and hasattr(args[0], "dim") and args[0].dim() == 4:  # InternVL tiles
                self.patches.extend(image_patches({"pixel_values": args[0]}))
            marks["t"] = self.clock.now()

        def tower_end(module, args, output):
            if "t" in marks:
                # Backward of the tower costs ~2x its forward: 3x forward is its share of the step.
                self.vision_s += 3.0 * (self.clock.now() - marks.pop("t"))

        self._hooks.append(tower.register_forward_pre_hook(tower_begin, with_kwargs=True))
        self._hooks.append(tower.register_forward_hook(tower_end))

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


# --------------------------------------------------------------------------- fitting across ranks


class StepRecord(NamedTuple):
    """One rank's optimizer step: decoder feature row and seconds, vision feature row and seconds."""

    features: np.ndarray
    decoder_s: float
    vision_features: np.ndarray
    vision_s: float


class CostModelFitter:
    """Timing records of this rank, fitted across ranks into the cost models every rank plans with.

    Args:
        config: `warmup_steps` (first fit), `refit_every`, `fit_mode`, `verbose` are read.
        rank, world, group: this process in the data-parallel group and the side (gloo) group that
            carries records and coefficients (None with world 1).
        timing: the resolved clock (`thread_cpu` / `wall`); `fit_mode="auto"` follows it.
        decoder, vision, fitted_step: models to start from (a checkpoint, `cost_model_path`).
    """

    def __init__(self, config: DPBalanceConfig, *, rank: int = 0, world: int = 1, group=None,
                 timing: str = "thread_cpu", decoder: Optional[CostModel] = None,
                 vision: Optional[CostModel] = None, fitted_step: int = -1):
        self.config = config
        self.rank, self.world, self.group = rank, world, group
        self.timing = timing
        self.fit_mode = resolve_fit_mode(config.fit_mode, timing)
        self.decoder: Optional[CostModel] = decoder
        self.vision: Optional[CostModel] = vision
        self.fitted_step = fitted_step
        self.records: collections.deque = collections.deque(maxlen=MAX_RECORDS)
        self.window: collections.deque = collections.deque(maxlen=MAX_WINDOW_STEPS)  # step seconds since the last log
        self.fit_reports: collections.deque = collections.deque(maxlen=MAX_FIT_REPORTS)

    # -- recording ----------------------------------------------------------------------

    def record(self, lengths: Sequence[int], elapsed_s: float, patches: Sequence[int] = (), vision_s: float = 0.0) -> None:
        """One step of this rank: its sample lengths, its seconds, and the vision tower's share of them."""
        decoder_s = max(elapsed_s - vision_s, 0.0)
        self.records.append(StepRecord(features_of(lengths), decoder_s, features_of(patches), vision_s))
        self.window.append(elapsed_s)

    def fit_due(self, step: int) -> bool:
        """The first fit after `warmup_steps` steps (when no model is given), then every `refit_every`."""
        first = self.decoder is None and step >= max(self.config.warmup_steps, 1)
        refit = self.config.refit_every > 0 and self.fitted_step >= 0 and step - self.fitted_step >= self.config.refit_every
        return first or refit

    def end_step(self, step: int, lengths: Sequence[int], elapsed_s: float, patches: Sequence[int] = (),
                 vision_s: float = 0.0) -> bool:
        """Record the step, and fit when due (a collective: every rank ends the same steps). True if it fitted."""
        self.record(lengths, elapsed_s, patches, vision_s)
        if not self.fit_due(step):
            return False
        self.fit(step)
        return True

    # -- collectives --------------------------------------------------------------------

    def _gather(self, obj) -> list:
        """All ranks' `obj`, in rank order (side group); [obj] on a single process."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _broadcast(self, obj):
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def fit(self, step: int) -> None:
        """Gather every rank's records, fit on rank 0, broadcast: every rank holds the same models after."""
        records = list(self.records)
        mine = tuple(np.array([r[i] for r in records]) for i in range(4))
        gathered = self._gather(mine)
        steps = min(len(g[1]) for g in gathered)
        payload = self._fit_gathered(gathered, steps) if self.rank == 0 else None
        payload = self._broadcast(payload)
        if payload.get("decoder") is not None:
            self.decoder = CostModel.from_dict(payload["decoder"])
            self.fitted_step = step
        if payload.get("vision") is not None:
            self.vision = CostModel.from_dict(payload["vision"])
        if payload.get("report"):
            self.fit_reports.append({"step": step, **payload["report"]})
        if payload.get("error"):
            logger.warning("dp_balance: cost model fit at step %d failed (%s); keeping the previous model",
                           step, payload["error"])
            self.fitted_step = step  # retry at the next refit, not at every step
        if self.config.verbose and self.rank == 0 and payload.get("report"):
            logger.info("dp_balance: fitted at step %d: %s", step, payload["report"])

    def _fit_gathered(self, gathered, steps: int) -> dict:
        """Rank 0: fit the decoder (and the vision tower, when it was timed) from [steps, ranks] tables."""
        feats = np.stack([g[0][-steps:] for g in gathered], axis=1)
        times = np.stack([g[1][-steps:] for g in gathered], axis=1)
        try:
            result = fit_from_records(feats, times, self.fit_mode)
        except (ValueError, RuntimeError, FloatingPointError) as exc:
            return {"error": str(exc)}
        payload = {"decoder": result.model.to_dict(), "report": result.report.to_dict()}
        vfeats = np.stack([g[2][-steps:] for g in gathered], axis=1)
        vtimes = np.stack([g[3][-steps:] for g in gathered], axis=1)
        if (vtimes > 0).sum() >= _MIN_VISION_OBSERVATIONS:  # the tower was timed: fit it
            try:
                payload["vision"] = fit_cost_model(vfeats, vtimes, mode="per_rank").model.to_dict()
            except (ValueError, RuntimeError, FloatingPointError) as exc:
                logger.warning("dp_balance: vision cost model fit failed: %s", exc)
        return payload

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
        """The decoder coefficients in force (`cost_<name>`) and `fitted` (1.0 once a model is set)."""
        out = {}
        if self.decoder is not None:
            out.update({f"cost_{name}": value for name, value in self.decoder.to_dict().items()})
        out["fitted"] = float(self.decoder is not None)
        return out


__all__ = ["CostModelFitter", "MAX_FIT_REPORTS", "MAX_RECORDS", "MAX_WINDOW_STEPS", "StepClock", "StepRecord",
           "StepRecorder", "image_patches", "micro_batch_lengths", "resolve_fit_mode", "resolve_timing",
           "synchronize", "vision_tower"]
