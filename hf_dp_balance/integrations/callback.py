"""`DPBalanceCallback`: everything a stock `Trainer` needs to balance its data-parallel ranks.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DPBalanceCallback()])

What it does, by Trainer event:

* `on_init_end`: moves itself right after `DefaultFlowCallback`, so the
  metrics it adds to `logs` reach the reporting callbacks (TensorBoard, W&B,
  console) that Trainer placed before the user's callbacks.
* `on_train_begin` (receives the prepared train dataloader before the first
  epoch iterator is made): resolves the `DPBalanceConfig` (callback argument,
  else `dp_balance_*` TrainingArguments fields, else defaults; then
  `HF_DP_BALANCE_*` environment variables), installs the balanced loader
  (sample exchange + `PackedCollator`) and, with `vision=True`, the vision
  wrapper; restores a cost model from the resumed checkpoint or from
  `cost_model_path`; puts a forward pre-hook on the model that reads each
  micro-batch's per-sample lengths (from the position restarts of the packed
  row), so the callback knows what each rank really computed.
* `on_step_begin` / `on_step_end`: time each rank's compute. On CPU the main
  thread's CPU time (`time.thread_time`) is clean per-rank compute: a rank
  blocked in a collective burns no CPU (fit mode `per_rank`). On accelerators
  the step's wall time is the slowest rank's (ranks meet in the gradient
  all-reduce), so the fit uses the step maximum (`step_max`).
* After `warmup_steps` steps, and then every `refit_every` steps: every rank
  gathers the (features, time) records of all ranks over a side gloo group,
  rank 0 fits `fit_cost_model` (decoder; and the vision tower when it was
  timed) and broadcasts the coefficients, and every rank hands the same models
  to its loader (planning switches on). Without vision-tower balancing the
  loader plans each sample at decoder + vision-encoder cost (its images are
  encoded where it goes); with it, at decoder cost only.
* `on_log`: adds `dp_balance/*` metrics (imbalance before / after, applied /
  skipped steps, moved samples / bytes, measured compute imbalance, the cost
  coefficients) to Trainer's own log stream.
* `on_save`: writes `dp_balance_cost_model.json` into `checkpoint-N/`.
* With `lookahead_steps` = K > 1, `on_step_end` holds a checkpoint that falls
  inside a look-ahead window until the window ends (`on_epoch_end` at the
  latest): samples change step within a window, so only its end is a point
  from which a resume trains every sample exactly once.

Cost: one `thread_time` pair per step and one tiny forward pre-hook per
micro-batch; collectives only at log steps and fit steps, on the side group.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.core.packing import segment_lengths as packed_segment_lengths
from hf_dp_balance.core.fitting import fit_cost_model

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "dp_balance_cost_model.json"
LOG_PREFIX = "dp_balance/"
# Timing records kept for refits: enough steps to determine the 4 unknowns many times over.
_MAX_RECORDS = 64


# --------------------------------------------------------------------------- pure helpers


def segment_lengths(inputs: Dict[str, Any]) -> List[int]:
    """Per-sample token lengths of one micro-batch, as the model will compute it.

    Packed rows: a sample starts wherever the plain position id restarts at 0
    (Qwen-VL: row 0 of the [4, B, T] position ids; text: [B, T]). Padded rows:
    the attention mask's row sums. Otherwise every row is one sample.
    """
    import torch

    pos = inputs.get("position_ids")
    if isinstance(pos, torch.Tensor) and (pos.dim() == 2 or (pos.dim() == 3 and pos.shape[0] == 4)):
        return packed_segment_lengths(pos)
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return [int(x) for x in mask.sum(dim=1).tolist()]
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return [int(ids.shape[-1])] * (int(ids.shape[0]) if ids.dim() == 2 else 1)
    return []


def image_patches(inputs: Dict[str, Any]) -> List[int]:
    """Patch rows of every image / video in a micro-batch (Qwen-VL grids t*h*w; InternVL: one tile each)."""
    import torch

    out: List[int] = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = inputs.get(key)
        if isinstance(grid, torch.Tensor) and grid.numel():
            out.extend(int(x) for x in grid.reshape(-1, 3).prod(dim=1).tolist())
    if not out and inputs.get("pixel_values") is not None and inputs.get("image_grid_thw") is None:
        pv = inputs["pixel_values"]
        if isinstance(pv, torch.Tensor) and pv.dim() == 4:  # InternVL tiles: cost per tile is fixed
            out.extend([int(pv.shape[-1] * pv.shape[-2]) // (14 * 14)] * int(pv.shape[0]))
    return out


def feature_row(lengths: Sequence[int]) -> np.ndarray:
    """(sum L^2, sum L, n, 1): the cost model's feature row of one rank's step."""
    arr = np.asarray(list(lengths), dtype=np.float64)
    return np.array([float((arr * arr).sum()), float(arr.sum()), float(arr.size), 1.0])


def compute_imbalance(times: np.ndarray) -> float:
    """Mean over steps of (slowest rank / mean rank - 1) of a [steps, ranks] time table."""
    times = np.asarray(times, dtype=np.float64)
    if times.size == 0:
        return float("nan")
    mean = times.mean(axis=1)
    ok = mean > 0
    if not ok.any():
        return float("nan")
    return float((times.max(axis=1)[ok] / mean[ok] - 1.0).mean())


def fit_from_records(features: np.ndarray, times: np.ndarray, mode: str):
    """Fit the decoder cost model from gathered records: features [steps, ranks, 4], times [steps, ranks].

    The first recorded step is dropped when there are at least 3 (allocator warm-up,
    lazy initialisation); `step_max` fits the slowest rank of each step only.
    """
    features = np.asarray(features, dtype=np.float64)
    times = np.asarray(times, dtype=np.float64)
    if features.shape[0] >= 3:
        features, times = features[1:], times[1:]
    if mode == "step_max":
        return fit_cost_model(features, times.max(axis=1), mode="step_max")
    return fit_cost_model(features, times, mode="per_rank")


def resolve_config(explicit: Optional[DPBalanceConfig], args: Any, environ=None) -> DPBalanceConfig:
    """The config in force: the callback's own, else the `dp_balance_*` fields of `args`, else defaults;
    `HF_DP_BALANCE_*` environment variables always apply on top."""
    if explicit is not None:
        return DPBalanceConfig.from_env(explicit, environ)
    if hasattr(args, "dp_balance"):
        from hf_dp_balance.integrations.arguments import config_from_arguments

        return config_from_arguments(args, environ)
    return DPBalanceConfig.from_env(None, environ)


def load_checkpoint_models(path: str) -> Dict[str, Any]:
    """Read `dp_balance_cost_model.json`: {"decoder": CostModel, "vision": CostModel|None, "fitted_step": int}."""
    with open(path, "r", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "decoder" not in data:
        raise ValueError(f"{path}: not a dp_balance cost model checkpoint (no 'decoder' key)")
    return {
        "decoder": CostModel.from_dict(data["decoder"]),
        "vision": CostModel.from_dict(data["vision"]) if data.get("vision") else None,
        "fitted_step": int(data.get("fitted_step", -1)),
    }


# --------------------------------------------------------------------------- per-rank recording


@dataclass
class _StepRecorder:
    """What this rank computed in the current optimizer step, and how long it took."""

    lengths: List[int] = field(default_factory=list)
    patches: List[int] = field(default_factory=list)
    vision_s: float = 0.0
    started: Optional[float] = None
    wall_started: Optional[float] = None

    def reset(self) -> None:
        self.lengths, self.patches, self.vision_s = [], [], 0.0


# --------------------------------------------------------------------------- the callback


class DPBalanceCallback(TrainerCallback):
    """Balance the real compute of data-parallel ranks in a stock `Trainer`.

    Args:
        config: a `DPBalanceConfig`; None reads the `dp_balance_*` fields of the
            TrainingArguments (`DPBalanceTrainingArguments`) or uses the defaults.
            `HF_DP_BALANCE_*` environment variables override either.
        cost_model: a decoder `CostModel` to start from (no warm-up fit needed).
    """

    def __init__(self, config: Optional[DPBalanceConfig] = None, cost_model: Optional[CostModel] = None):
        self._explicit_config = config
        self.config: Optional[DPBalanceConfig] = None
        self.decoder_model: Optional[CostModel] = cost_model
        self.vision_model: Optional[CostModel] = None
        self.fitted_step: int = -1
        self.fit_reports: List[dict] = []
        self.loader = None
        self._group = None
        self._rank, self._world = 0, 1
        self._timing = "thread_cpu"
        self._rec = _StepRecorder()
        self._records: collections.deque = collections.deque(maxlen=_MAX_RECORDS)
        self._window: List[tuple] = []  # (features, time) since the last log, for the measured imbalance
        self._pending_logs: Dict[str, float] = {}
        self._hooks: list = []
        self._vision = None
        self._trainer_ref = None
        self._installed_on = None
        self._active = False
        self._save_held = False  # a checkpoint waits for the end of a look-ahead window
        self._hold_warned = False

    # -- wiring -------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        # Trainer puts the reporting callbacks (TensorBoard, W&B, ...) before the user's; they read
        # `logs` in their own on_log, so ours must run first for them to see the dp_balance keys.
        # DefaultFlowCallback stays first: it sets `control.should_log`, which our on_step_end reads.
        handler = sys._getframe(1).f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and any(cb is self for cb in callbacks):
            others = [cb for cb in callbacks if cb is not self]
            at = 1 if others and isinstance(others[0], DefaultFlowCallback) else 0
            callbacks[:] = others[:at] + [self] + others[at:]
        # Callbacks are never handed the Trainer; the balanced loader's trainer mode (which keeps
        # Trainer's own resume / skip_first_batches) needs it, so find the Trainer that is calling us.
        trainer = _calling_instance(Trainer)
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.config = resolve_config(self._explicit_config, args)
        if not self.config.enabled:
            return
        import torch
        import torch.distributed as dist

        self._active = True
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            # Our own gloo group: coefficients and timing records travel beside training's
            # collectives (NCCL on GPUs) without touching them.
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.config.timeout_s))
        device = getattr(args, "device", torch.device("cpu"))
        self._timing = "thread_cpu" if torch.device(device).type == "cpu" else "wall"
        self._restore(args, state)
        if model is not None:
            self._install_hooks(model)
        if self.config.vision and model is not None:
            self._install_vision(model)
        if train_dataloader is not None and self._world > 1:
            self.loader = self._install_loader(train_dataloader, model, args)
        self._publish_models()
        if self.config.verbose and self._rank == 0:
            logger.info("dp_balance: on (%d ranks, timing=%s, fitted=%s)", self._world, self._timing,
                        self.decoder_model is not None)

    def _install_loader(self, train_dataloader, model, args):
        """Balance the training data: through the Trainer when we found it (resume keeps Trainer's own
        skip_first_batches), else in place in the prepared dataloader (the object Trainer iterates)."""
        try:
            from hf_dp_balance.integrations.install import install_balanced_loader
        except ImportError as exc:  # the exchange part is not installed: time and fit, move nothing
            logger.warning("dp_balance: balanced loader unavailable (%s); measuring only", exc)
            return None
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is not None and trainer.callback_handler.train_dataloader is train_dataloader:
            self._installed_on = trainer
            return install_balanced_loader(trainer, self.config)
        self._installed_on = train_dataloader
        return install_balanced_loader(train_dataloader, self.config, model_config=getattr(model, "config", None),
                                       gradient_accumulation_steps=args.gradient_accumulation_steps)

    def _install_vision(self, model) -> None:
        try:
            from hf_dp_balance.runtime.vision import balance_vision_encoder
        except ImportError as exc:
            logger.warning("dp_balance: vision balancing unavailable (%s)", exc)
            return
        balance_vision_encoder(model, self.config, cost_model=self.vision_model)
        self._vision = getattr(model, "_dp_balance_vision", None)

    def _install_hooks(self, model) -> None:
        # A previous train() that raised never reached on_train_end: drop its hooks, or every
        # forward would be recorded twice.
        self._remove_hooks()
        rec = self._rec

        tower = _vision_tower(model)

        def before_forward(module, args, kwargs):
            inputs = dict(kwargs)
            rec.lengths.extend(segment_lengths(inputs))
            if tower is None:
                rec.patches.extend(image_patches(inputs))
            return None

        self._hooks.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
        if tower is not None:
            marks = {}

            def tower_begin(module, args, kwargs):
                # The images this rank's tower really computes (after vision balancing moved some).
                grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
                if grid is not None:
                    rec.patches.extend(image_patches({"image_grid_thw": grid}))
                elif args and hasattr(args[0], "dim") and args[0].dim() == 4:  # InternVL tiles
                    rec.patches.extend(image_patches({"pixel_values": args[0]}))
                marks["t"] = time.thread_time()

            def tower_end(module, args, output):
                if "t" in marks:
                    # Backward of the tower costs ~2x its forward: 3x forward is its share of the step.
                    rec.vision_s += 3.0 * (time.thread_time() - marks.pop("t"))

            self._hooks.append(tower.register_forward_pre_hook(tower_begin, with_kwargs=True))
            self._hooks.append(tower.register_forward_hook(tower_end))

    def _publish_models(self) -> None:
        """Hand the current cost models to the loader and the vision wrapper (None: keep everything in place)."""
        if self.loader is not None and hasattr(self.loader, "set_cost_model"):
            # Without vision-tower balancing a sample's images are encoded where the sample goes, so
            # the loader plans with decoder + vision cost; with it, the tower is balanced per image.
            vision = None if self.config.vision else self.vision_model
            self.loader.set_cost_model(self.decoder_model, vision=vision)
        if self._vision is not None and self.vision_model is not None:
            self._vision.cost_model = self.vision_model

    # -- timing -------------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs):
        if not self._active:
            return
        self._rec.reset()
        if self._timing == "wall":
            _synchronize()
            self._rec.started = time.perf_counter()
        else:
            self._rec.started = time.thread_time()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active or self._rec.started is None:
            return
        if self._timing == "wall":
            _synchronize()
            elapsed = time.perf_counter() - self._rec.started
        else:
            elapsed = time.thread_time() - self._rec.started
        self._rec.started = None
        row = feature_row(self._rec.lengths)
        decoder_s = max(elapsed - self._rec.vision_s, 0.0)
        self._records.append((row, decoder_s, feature_row(self._rec.patches), self._rec.vision_s))
        self._window.append((row, elapsed))

        step = state.global_step
        warmup = self.config.warmup_steps
        due = (self.decoder_model is None and step >= max(warmup, 1)) or (
            self.config.refit_every > 0 and self.fitted_step >= 0 and step - self.fitted_step >= self.config.refit_every)
        if due:
            self._fit(step)
        if control.should_log:
            self._prepare_logs()
        self._checkpoint_on_window_boundary(state, control)

    def _checkpoint_on_window_boundary(self, state, control) -> None:
        """With look-ahead, a checkpoint due inside a window is written at the window's end instead.

        Inside a window some samples of later steps are already trained and some of earlier steps are
        not: a resume from there would train samples twice and skip others. The final step of the run
        still saves where it falls (nothing is left to train).
        """
        loader = self.loader
        if loader is None or self.config.lookahead_steps <= 1 or not hasattr(loader, "at_window_boundary"):
            return
        boundary = loader.at_window_boundary()
        if control.should_save and not boundary and state.global_step < state.max_steps:
            control.should_save = False
            if not self._hold_warned:
                self._hold_warned = True
                logger.warning("dp_balance: checkpoint of step %d held to the end of its look-ahead window "
                               "(lookahead_steps=%d; said once): a resume from inside a window would train "
                               "samples twice; save_steps a multiple of it avoids the shift",
                               state.global_step, self.config.lookahead_steps)
            self._save_held = True
        elif self._save_held and boundary:
            control.should_save = True
            self._save_held = False

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._save_held:  # a pass over the data ends its last window
            control.should_save = True
            self._save_held = False

    def _gather(self, obj):
        """All ranks' `obj`, in rank order (side group); [obj] on a single process."""
        if self._world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _fit(self, step: int) -> None:
        """Gather every rank's records, fit on rank 0, broadcast, publish (same coefficients everywhere)."""
        records = list(self._records)
        mine = (np.array([r[0] for r in records]), np.array([r[1] for r in records]),
                np.array([r[2] for r in records]), np.array([r[3] for r in records]))
        gathered = self._gather(mine)
        steps = min(len(g[1]) for g in gathered)
        payload = None
        if self._rank == 0:
            payload = self._fit_gathered(gathered, steps)
        if self._world > 1:
            import torch.distributed as dist

            box = [payload]
            dist.broadcast_object_list(box, src=0, group=self._group)
            payload = box[0]
        if payload.get("decoder") is not None:
            self.decoder_model = CostModel.from_dict(payload["decoder"])
            self.fitted_step = step
        if payload.get("vision") is not None:
            self.vision_model = CostModel.from_dict(payload["vision"])
        if payload.get("report"):
            self.fit_reports.append({"step": step, **payload["report"]})
        if payload.get("error"):
            logger.warning("dp_balance: cost model fit at step %d failed (%s); keeping the previous model",
                           step, payload["error"])
            self.fitted_step = step  # retry at the next refit, not at every step
        self._publish_models()
        if self.config.verbose and self._rank == 0 and payload.get("report"):
            logger.info("dp_balance: fitted at step %d: %s", step, payload["report"])

    def _fit_gathered(self, gathered, steps: int) -> dict:
        """Rank 0: fit the decoder (and the vision tower, when it was timed) from [steps, ranks] tables."""
        feats = np.stack([g[0][-steps:] for g in gathered], axis=1)
        times = np.stack([g[1][-steps:] for g in gathered], axis=1)
        mode = self.config.fit_mode
        if mode == "auto":
            mode = "per_rank" if self._timing == "thread_cpu" else "step_max"
        try:
            result = fit_from_records(feats, times, mode)
        except (ValueError, RuntimeError, FloatingPointError) as exc:
            return {"error": str(exc)}
        payload = {"decoder": result.model.to_dict(), "report": result.report.to_dict()}
        vfeats = np.stack([g[2][-steps:] for g in gathered], axis=1)
        vtimes = np.stack([g[3][-steps:] for g in gathered], axis=1)
        if (vtimes > 0).sum() >= 8:  # the tower was timed: fit it (the loader or the vision wrapper uses it)
            try:
                payload["vision"] = fit_cost_model(vfeats, vtimes, mode="per_rank").model.to_dict()
            except (ValueError, RuntimeError, FloatingPointError) as exc:
                logger.warning("dp_balance: vision cost model fit failed: %s", exc)
        return payload

    # -- logging ------------------------------------------------------------------------

    def _prepare_logs(self) -> None:
        """At a log step (every rank reaches it): measured imbalance over the window, loader counters."""
        window, self._window = self._window, []
        logs: Dict[str, float] = {}
        if window:
            times = np.array([w[1] for w in window])
            table = self._gather(times.tolist())
            steps = min(len(t) for t in table)
            if steps:
                arr = np.array([t[-steps:] for t in table]).T  # [steps, ranks]
                logs["compute_imbalance"] = compute_imbalance(arr)
                logs["slowest_rank_compute_s"] = float(arr.max(axis=1).sum())
        logs.update(_loader_stats(self.loader))
        logs.update(_vision_stats(self._vision))
        if self.decoder_model is not None:
            for name, value in self.decoder_model.to_dict().items():
                logs[f"cost_{name}"] = value
        logs["fitted"] = float(self.decoder_model is not None)
        self._pending_logs = {LOG_PREFIX + k: float(v) for k, v in logs.items() if v is not None}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._active or not self._pending_logs or logs is None or "loss" not in logs:
            return
        logs.update(self._pending_logs)
        # Trainer appended a copy of `logs` to log_history just before on_log: complete that entry too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending_logs)
        self._pending_logs = {}

    # -- checkpoints --------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        if not self._active or self.decoder_model is None or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(folder):
            return
        data = {
            "decoder": self.decoder_model.to_dict(),
            "vision": self.vision_model.to_dict() if self.vision_model is not None else None,
            "fitted_step": self.fitted_step,
            "config": self.config.to_dict(),
        }
        with open(os.path.join(folder, CHECKPOINT_FILE), "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)

    def _restore(self, args, state) -> None:
        """Resume: the model saved in the checkpoint being resumed; else `cost_model_path`; else warm-up."""
        candidates = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str):
            candidates.append(os.path.join(resume, CHECKPOINT_FILE))
        if state.global_step > 0:
            candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}", CHECKPOINT_FILE))
        for path in candidates:
            if os.path.isfile(path):
                saved = load_checkpoint_models(path)
                self.decoder_model, self.vision_model = saved["decoder"], saved["vision"]
                self.fitted_step = state.global_step
                self.restored_from = path
                return
        if self.decoder_model is None and self.config.cost_model_path:
            self.decoder_model = CostModel.load(self.config.cost_model_path)
            self.fitted_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        if self.loader is not None:
            from hf_dp_balance.integrations.install import uninstall_balanced_loader

            uninstall_balanced_loader(self._installed_on)  # stops the exchange thread
            self.loader, self._installed_on = None, None
        self._remove_hooks()
        self._active = False

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


# --------------------------------------------------------------------------- small shell helpers


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _calling_instance(cls, max_depth: int = 8):
    """The nearest `self` up the call stack that is an instance of `cls` (None if there is none)."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, cls):
            return candidate
    return None


def _vision_tower(model):
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


def summarize_step_stats(stats: Sequence[Any]) -> Dict[str, float]:
    """Loader statistics of the steps since the last log: mean predicted imbalance before / after,
    steps applied / skipped, samples and bytes moved (sums)."""
    if not stats:
        return {}
    before = [s.imbalance_before for s in stats if math.isfinite(s.imbalance_before)]
    after = [s.imbalance_after for s in stats if math.isfinite(s.imbalance_after)]
    out = {
        "applied": float(sum(1 for s in stats if s.applied)),
        "skipped": float(sum(1 for s in stats if not s.applied)),
        "moved_samples": float(sum(s.moved_samples for s in stats)),
        "moved_bytes": float(sum(s.moved_bytes for s in stats)),
        "wait_s": float(sum(getattr(s, "wait_s", 0.0) for s in stats)),
    }
    if before:
        out["imbalance_before"] = float(np.mean(before))
    if after:
        out["imbalance_after"] = float(np.mean(after))
    return out


def _vision_stats(balancer) -> Dict[str, float]:
    """Vision-tower balancing since the last call: forwards applied / skipped, images moved."""
    take = getattr(balancer, "pop_stats", None)
    stats = take() if callable(take) else []
    if not stats:
        return {}
    out = {"vision_applied": float(sum(1 for s in stats if s.get("applied"))),
           "vision_skipped": float(sum(1 for s in stats if not s.get("applied")))}
    out["vision_moved_images"] = float(sum(s.get("items_moved", 0) for s in stats))
    out["vision_moved_bytes"] = float(sum(s.get("pixel_bytes_moved", 0) + s.get("embedding_bytes_moved", 0)
                                          for s in stats))
    return out


def _loader_stats(loader) -> Dict[str, float]:
    """Counters of the balanced loader since the last call (empty without a loader)."""
    take = getattr(loader, "pop_stats", None)
    return summarize_step_stats(take()) if callable(take) else {}


__all__ = ["DPBalanceCallback", "CHECKPOINT_FILE", "summarize_step_stats", "segment_lengths", "feature_row", "compute_imbalance",
           "fit_from_records", "resolve_config", "load_checkpoint_models"]
