"""`DPBalanceCallback`: everything a stock `Trainer` needs to balance its data-parallel ranks.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DPBalanceCallback()])

An adapter of Trainer's events: it resolves the `DPBalanceConfig`, installs the balanced loader (and the
vision wrapper), and drives the framework-free `runtime.fitter` objects (`StepRecorder`: what each rank
computed and how long it took, on one clock; `CostModelFitter`: gather, fit on rank 0, broadcast, refit).
Guarantees: every rank plans with the same cost models; `dp_balance/*` metrics reach Trainer's own log
stream; with look-ahead, checkpoints fall on window ends only. Event by event: docs/usage.md.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import weakref
from typing import Any, Dict, List, Optional

from transformers import Trainer, TrainerCallback

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.runtime.logs import get_logger, set_verbose
from hf_dp_balance.runtime.balance_metrics import LOG_PREFIX, balance_metrics, summarize_step_stats
from hf_dp_balance.runtime.packed_input import packed_input_for
from hf_dp_balance.runtime.fitter import (CostModelFitter, StepClock, StepRecorder, image_patches, priors_from_config,
                                          resolve_timing)

logger = get_logger(__name__)

CHECKPOINT_FILE = "dp_balance_cost_model.json"


# --------------------------------------------------------------------------- pure helpers


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




# --------------------------------------------------------------------------- the callback


class DPBalanceCallback(TrainerCallback):
    """Balance the real compute of data-parallel ranks in a stock `Trainer`.

    An adapter: Trainer's events drive a `StepRecorder` (what each rank computed, on one clock) and a
    `CostModelFitter` (records, gather, fit on rank 0, broadcast), both framework-free.

    Args:
        config: a `DPBalanceConfig`; None reads the `dp_balance_*` fields of the
            TrainingArguments (`DPBalanceTrainingArguments`) or uses the defaults.
            `HF_DP_BALANCE_*` environment variables override either.
        cost_model: a decoder `CostModel` to start from (no warm-up fit needed).
    """

    def __init__(self, config: Optional[DPBalanceConfig] = None, cost_model: Optional[CostModel] = None):
        self._explicit_config = config
        self.config: Optional[DPBalanceConfig] = None
        self.fitter: Optional[CostModelFitter] = None  # made at train begin, when the ranks are known
        self.recorder: Optional[StepRecorder] = None
        self._initial_models = (cost_model, None, -1)  # (decoder, vision, fitted_step) before a fitter exists
        self.loader = None
        self._group = None
        self._rank, self._world = 0, 1
        self._vision = None
        self._trainer_ref = None
        self._installed_on = None
        self._active = False
        self._global_step = 0  # Trainer's state.global_step at the last step or epoch begin
        self._save_held = False  # a checkpoint waits for the end of a look-ahead window
        self._hold_warned = False

    # -- the fitter's state, read by checkpoints, logs and callers ------------------------

    @property
    def decoder_model(self) -> Optional[CostModel]:
        return self.fitter.decoder if self.fitter is not None else self._initial_models[0]

    @property
    def vision_model(self) -> Optional[CostModel]:
        return self.fitter.vision if self.fitter is not None else self._initial_models[1]

    @property
    def fitted_step(self) -> int:
        return self.fitter.fitted_step if self.fitter is not None else self._initial_models[2]

    @property
    def fit_reports(self) -> List[dict]:
        """One report per fit (the most recent `runtime.fitter.MAX_FIT_REPORTS`)."""
        return list(self.fitter.fit_reports) if self.fitter is not None else []

    # -- wiring -------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _trainer_calling(self)
        # The balanced loader's trainer mode (Trainer's own resume / skip_first_batches) needs the Trainer.
        self._trainer_ref = weakref.ref(trainer) if trainer is not None else None
        if trainer is not None:
            # Reporting callbacks (TensorBoard, W&B, printer, ...) read `logs` in their own on_log, and
            # Trainer puts them before the user's: ours must run first for them to see the dp_balance keys.
            place_before_log_readers(trainer.callback_handler.callbacks, self)

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.config = resolve_config(self._explicit_config, args)
        if not self.config.enabled:
            return
        set_verbose(self.config.verbose)  # --dp_balance_verbose shows our INFO lines whatever Trainer's log level
        import torch
        import torch.distributed as dist

        from hf_dp_balance.integrations.loss_contract import check_trainer_loss
        from hf_dp_balance.integrations.trl import check_sft_setup

        # TRL's SFTTrainer: its settings that would feed the loader other samples than the user's (same on every rank)
        check_sft_setup(args, getattr(train_dataloader, "dataset", None), getattr(model, "config", None),
                        getattr(self._trainer_ref() if self._trainer_ref is not None else None, "data_collator", None))
        check_trainer_loss(args, self._trainer_ref() if self._trainer_ref is not None else None, self.config)
        self._active = True
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
            # Our own gloo group: coefficients and timing records travel beside training's
            # collectives (NCCL on GPUs) without touching them.
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.config.timeout_s))
        device_type = torch.device(getattr(args, "device", torch.device("cpu"))).type
        if train_dataloader is not None and self._world > 1:
            self.loader = self._install_loader(train_dataloader, model, args)
        # DDP (`step`): the forward has no collective, its device time is this rank's own compute.
        sync = getattr(self.loader, "sync", None) or ("step" if self.config.sync == "auto" else self.config.sync)
        timing = resolve_timing(self.config.timing, device_type, sync)
        decoder, vision, fitted_step = self._restore(args, state)
        prior, vision_prior = priors_from_config(getattr(model, "config", None)) if self.config.prior else (None, None)
        self.fitter = CostModelFitter(self.config, rank=self._rank, world=self._world, group=self._group,
                                      timing=timing, decoder=decoder, vision=vision, fitted_step=fitted_step,
                                      prior=prior, vision_prior=vision_prior)
        self._install_hooks(model, timing, device_type)
        if self.config.vision and model is not None:
            self._install_vision(model)
        self._publish_models()
        if self.config.verbose and self._rank == 0:
            logger.info("dp_balance: on (%d ranks, timing=%s, fitted=%s)", self._world, timing,
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
            packed = packed_input_for(self.config.input, trainer.data_collator, getattr(model, "config", None))
            return install_balanced_loader(trainer, self.config, packed_input=packed)
        self._installed_on = train_dataloader
        return install_balanced_loader(train_dataloader, self.config, model_config=getattr(model, "config", None),
                                       gradient_accumulation_steps=args.gradient_accumulation_steps)

    def _install_vision(self, model) -> None:
        try:
            from hf_dp_balance.runtime.vision import balance_vision_encoder
        except ImportError as exc:
            logger.warning("dp_balance: vision balancing unavailable (%s)", exc)
            return
        balance_vision_encoder(model, self.config, cost_model=self.fitter.planning_models()[1])
        self._vision = getattr(model, "_dp_balance_vision", None)
        if self._vision is not None:  # errors name the optimizer step the user sees (1-based, as Trainer logs)
            self._vision.step_source = lambda: self._global_step + 1

    def _install_hooks(self, model, timing: str, device_type: str = "cpu") -> None:
        # A previous train() that raised never reached on_train_end: drop its hooks, or every
        # forward would be recorded twice.
        self._remove_hooks()
        self.recorder = StepRecorder(StepClock(timing, device_type))
        if model is not None:
            self.recorder.install(model)

    def _publish_models(self) -> None:
        """Hand the current cost models (the fitted ones, else the FLOP priors) and this rank's speed to the
        loader and the vision wrapper (no model: keep everything in place)."""
        decoder, vision = self.fitter.planning_models()
        if self.loader is not None and hasattr(self.loader, "set_cost_model"):
            # Without vision-tower balancing a sample's images are encoded where the sample goes, so
            # the loader plans with decoder + vision cost; with it, the tower is balanced per image.
            # Before the fit the models are the FLOP prior: the loader hedges its plans against the tokens.
            self.loader.set_cost_model(decoder, vision=None if self.config.vision else vision,
                                       prior=self.fitter.planning_with_prior)
            if hasattr(self.loader, "set_speed"):
                self.loader.set_speed(float(self.fitter.speeds[self._rank]))
        if self._vision is not None and vision is not None:
            self._vision.cost_model = vision

    # -- timing -------------------------------------------------------------------------

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step
        if self._active and self.loader is not None and hasattr(self.loader, "set_step_offset"):
            # the loader counts steps from 0 in every pass (epoch, resume): its errors name the user's step
            self.loader.set_step_offset(state.global_step + 1)

    def on_step_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step
        if self._active and self.recorder is not None:
            self.recorder.begin()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active or self.recorder is None:
            return
        elapsed = self.recorder.end()
        if elapsed is None:
            return
        rec = self.recorder
        if self.fitter.end_step(state.global_step, rec.lengths, elapsed, rec.patches, rec.vision_s):
            self._publish_models()
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

    # -- logging ------------------------------------------------------------------------

    def _collect_logs(self) -> Dict[str, float]:
        """At a training log (every rank logs the same steps): measured imbalance over the window (a
        collective), loader and vision counters, the cost model."""
        take = getattr(self.loader, "pop_stats", None)
        return balance_metrics(self.fitter, take() if callable(take) else [], self._vision)

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Computed here, not at on_step_end from control.should_log: no reliance on DefaultFlowCallback
        # having run before us. Training logs carry "loss" on every rank; eval and summary logs do not.
        if not self._active or self.fitter is None or logs is None or "loss" not in logs:
            return
        ours = self._collect_logs()
        logs.update(ours)
        # Trainer appended a copy of `logs` to log_history just before on_log: complete that entry too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(ours)

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

    def _restore(self, args, state):
        """Resume: the model saved in the checkpoint being resumed; else `cost_model_path`; else warm-up.
        Returns (decoder, vision, fitted_step) to start from."""
        decoder, vision, fitted_step = self.decoder_model, self.vision_model, self.fitted_step
        candidates = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str):
            candidates.append(os.path.join(resume, CHECKPOINT_FILE))
        if state.global_step > 0:
            candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}", CHECKPOINT_FILE))
        for path in candidates:
            if os.path.isfile(path):
                saved = load_checkpoint_models(path)
                self.restored_from = path
                return saved["decoder"], saved["vision"], state.global_step
        if decoder is None and self.config.cost_model_path:
            return CostModel.load(self.config.cost_model_path), vision, state.global_step
        return decoder, vision, fitted_step

    def on_train_end(self, args, state, control, **kwargs):
        if self.loader is not None:
            from hf_dp_balance.integrations.install import uninstall_balanced_loader

            uninstall_balanced_loader(self._installed_on)  # stops the exchange thread
            self.loader, self._installed_on = None, None
        self._remove_hooks()
        self._active = False

    def _remove_hooks(self) -> None:
        if self.recorder is not None:
            self.recorder.remove()


# --------------------------------------------------------------------------- small shell helpers


def place_before_log_readers(callbacks: list, callback: Any) -> None:
    """Move `callback` in place right before the first other callback that reads logs (overrides `on_log`)."""
    if not any(cb is callback for cb in callbacks):
        return
    others = [cb for cb in callbacks if cb is not callback]
    at = next((i for i, cb in enumerate(others) if type(cb).on_log is not TrainerCallback.on_log), len(others))
    callbacks[:] = others[:at] + [callback] + others[at:]


def _trainer_calling(callback, max_depth: int = 8):
    """The Trainer whose callback handler runs `callback`'s event now (on_init_end), or None.

    Contained here because Trainer offers no hook for it: events are never handed the Trainer (nor its
    callback handler), yet the only data hook that survives a mid-epoch resume is the instance's
    `get_batch_samples` (skip_first_batches rebuilds the prepared loader from its parts, so no balanced
    loader composed with it survives), and only the handler's list decides who reads `logs` first.
    The one frame inspection of the package: the nearest Trainer up the event's call that holds `callback`.
    """
    frame = sys._getframe(1)
    for _ in range(max_depth):
        frame = frame.f_back
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and any(cb is callback for cb in candidate.callback_handler.callbacks):
            return candidate
    return None


# image_patches (runtime.fitter), LOG_PREFIX and summarize_step_stats (runtime.balance_metrics): importable
# from here as before.

__all__ = ["DPBalanceCallback", "CHECKPOINT_FILE", "LOG_PREFIX", "image_patches", "load_checkpoint_models", "resolve_config",
           "summarize_step_stats"]
