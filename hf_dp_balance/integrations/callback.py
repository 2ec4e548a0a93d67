"""`DPBalanceCallback`: everything a stock `Trainer` needs to balance its data-parallel ranks.

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[DPBalanceCallback()])

An adapter of Trainer's events onto one `runtime.session.BalanceSession` per `train()`: the session's side
channel, fitter (gather, fit on rank 0, broadcast, refit), recorder, balanced loader and vision balancer are
made at train begin and closed at train end. Guarantees: every rank plans with the same cost models (read on
rank 0 and broadcast); tp / cp peers of one data-parallel index get the same batches; `dp_balance/*` metrics
reach Trainer's own log stream; every checkpoint carries the session's state (the loader's position, its look-ahead
window and plan, the settings that order the samples, the cost models), restored at train begin, so a resume
from any step, inside a look-ahead window too, trains every sample once. Event by event: docs/usage.md.
"""
from __future__ import annotations

import os
import sys
import weakref
from typing import Any, Dict, List, Optional

from transformers import Trainer, TrainerCallback

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.runtime.logs import get_logger, set_verbose
from hf_dp_balance.runtime.balance_metrics import LOG_PREFIX, summarize_step_stats
from hf_dp_balance.runtime.packed_input import packed_input_for
from hf_dp_balance.runtime.fitter import image_patches
from hf_dp_balance.runtime.framework import check_sharded_by, resolve_sync, shard_by
from hf_dp_balance.runtime.parallel import resolve_data_parallel_group
from hf_dp_balance.runtime.session import (CHECKPOINT_FILE, BalanceSession, load_checkpoint_models,
                                           read_checkpoint_state)
from hf_dp_balance.integrations.install import install_balanced_loader, uninstall_balanced_loader
from hf_dp_balance.integrations.loss_contract import check_trainer_loss

logger = get_logger(__name__)


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


# --------------------------------------------------------------------------- the callback


class DPBalanceCallback(TrainerCallback):
    """Balance the real compute of data-parallel ranks in a stock `Trainer`.

    An adapter: Trainer's events drive one `runtime.session.BalanceSession` per `train()` (side groups,
    fitter, recorder, loader, vision balancer, model state), made at train begin and closed at train end.

    Args:
        config: a `DPBalanceConfig`; None reads the `dp_balance_*` fields of the
            TrainingArguments (`DPBalanceTrainingArguments`) or uses the defaults.
            `HF_DP_BALANCE_*` environment variables override either.
        cost_model: a decoder `CostModel` to start from (no warm-up fit needed).
        data_parallel_group: the processes that trade samples, as in `DPBalancer`: a ProcessGroup, a 1-D
            DeviceMesh or a `DataParallelGroup` (default: the Trainer accelerator's device mesh, else every
            process). Processes of one data-parallel index (tp / cp peers) get byte-identical batches.
    """

    def __init__(self, config: Optional[DPBalanceConfig] = None, cost_model: Optional[CostModel] = None,
                 data_parallel_group: Any = None):
        self._explicit_config = config
        self._explicit_group = data_parallel_group
        self.config: Optional[DPBalanceConfig] = None
        self.session: Optional[BalanceSession] = None  # one per train(), made at train begin
        self._initial_models = (cost_model, None, -1)  # (decoder, vision, fitted_step) before a session exists
        self.loader = None
        self.restored_from: Optional[str] = None
        self._trainer_ref = None
        self._installed_on = None
        self._active = False
        self._global_step = 0  # Trainer's state.global_step at the last step or epoch begin

    # -- the session's state, read by checkpoints, logs and callers ------------------------

    @property
    def fitter(self):
        return self.session.fitter if self.session is not None else None

    @property
    def recorder(self):
        return self.session.recorder if self.session is not None else None

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
        self._take_trainer(trainer)
        if trainer is not None and self._explicit_group is not None:
            # Trainer builds its train dataloader, and counts its steps from its length, before any event of
            # train(): sharded by data-parallel index from the start, the counts are right.
            shard_train_dataloader_by_data_parallel_index(trainer, self._explicit_group)

    def _take_trainer(self, trainer) -> None:
        """Hold the Trainer (weakly): its get_batch_samples carries the balanced stream (resume included), its
        training_step names training errors, its callback list decides who reads `logs` first."""
        if trainer is None:
            return
        self._trainer_ref = weakref.ref(trainer)
        # Reporting callbacks (TensorBoard, W&B, printer, ...) read `logs` in their own on_log, and
        # Trainer puts them before the user's: ours must run first for them to see the dp_balance keys.
        place_before_log_readers(trainer.callback_handler.callbacks, self)

    def _trainer(self):
        return self._trainer_ref() if self._trainer_ref is not None else None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._close_session()  # a previous train() that raised never reached on_train_end
        self.config = resolve_config(self._explicit_config, args)
        if not self.config.enabled:
            return
        set_verbose(self.config.verbose)  # --dp_balance_verbose shows our INFO lines whatever Trainer's log level
        import torch

        if self._trainer() is None:  # added with trainer.add_callback after init: on_init_end never ran for us
            self._take_trainer(_trainer_calling(self))
        trainer = self._trainer()
        data_parallel = resolve_data_parallel_group(getattr(trainer, "accelerator", None), self._explicit_group)
        checks = [lambda: _check_sft(args, train_dataloader, model, getattr(trainer, "data_collator", None)),
                  lambda: check_trainer_loss(args, trainer, self.config, data_parallel.size),
                  lambda: _check_data_parallel_sharding(train_dataloader, data_parallel, self._explicit_group)]
        decoder, vision, fitted_step = self._initial_models
        folders = self._checkpoint_folders(args, state)
        # A refused setup (a check, the loader, the resume state) closes whatever the session made and raises.
        self.session = None  # until the new one is made: the last train()'s closed session answers no more
        self.session = BalanceSession.open(
            self.config, data_parallel,
            setup=lambda session: self._wire(session, args, state, model, train_dataloader, folders),
            model=model, model_config=getattr(model, "config", None),
            device_type=torch.device(getattr(args, "device", torch.device("cpu"))).type,
            sync=resolve_sync(self.config.sync, getattr(trainer, "accelerator", None)),
            decoder=decoder, vision=vision, fitted_step=fitted_step,
            checkpoints=[os.path.join(folder, CHECKPOINT_FILE) for folder in folders],
            file_step=state.global_step, checks=checks)
        self._active = True
        self.restored_from = self.session.restored_from
        if self.config.verbose and self.session.rank == 0:
            logger.info("dp_balance: on (%d ranks, %d data-parallel, fitted=%s)", self.session.world,
                        data_parallel.size, self.decoder_model is not None)

    def _wire(self, session: BalanceSession, args, state, model, train_dataloader, folders: List[str]) -> None:
        """Trainer's data and model onto the started session: the balanced loader (its resume point restored from
        the checkpoint) and the vision balancer; every change undone at the session's `close`."""
        self.session = session
        session.patches.add(self._release_loader)  # undone last: after the loader's own uninstall
        if train_dataloader is not None and session.data_parallel.size > 1:
            self.loader = session.add_loader(self._install_loader(train_dataloader, model, args))
            installed_on = self._installed_on
            session.patches.add(lambda: uninstall_balanced_loader(installed_on))  # stops the thread too
            self._track_loader(args, state)
            # the cost models came with the checkpoint's model file (`start`, counted as fitted at this step)
            session.load_state_dict(read_checkpoint_state(folders), models=False)
        # errors name the optimizer step the user sees (1-based, as Trainer logs)
        session.attach_vision(model, step_source=lambda: self._global_step + 1)

    def _release_loader(self) -> None:
        self.loader, self._installed_on = None, None

    @staticmethod
    def _checkpoint_folders(args, state) -> List[str]:
        """Where a resume finds the balancing state (read on rank 0 only): the checkpoint resumed from, else the
        checkpoint of the step Trainer resumes at."""
        candidates = []
        resume = getattr(args, "resume_from_checkpoint", None)
        if isinstance(resume, str):
            candidates.append(resume)
        if state.global_step > 0:
            candidates.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        return candidates

    def _track_loader(self, args, state) -> None:
        """The loader's part of the session's state: Trainer counts the steps (its global_step) and skips their
        raw batches on resume; the state adds the look-ahead window a checkpoint falls inside."""
        loader, workers = self.loader, int(getattr(args, "dataloader_num_workers", 0) or 0)

        def position() -> dict:
            return {"steps": int(state.global_step), "window": loader.window_state(loader.stream_position())}

        def restore(saved: dict) -> None:
            if int(saved["steps"]) != int(state.global_step):
                raise ValueError(f"hf_dp_balance: the checkpoint's balancing state was taken at step {saved['steps']}, "
                                 f"Trainer resumes at step {state.global_step}: resume from the checkpoint that wrote it")
            if saved.get("window") and self._installed_on is not self._trainer():
                raise ValueError("hf_dp_balance: the checkpoint was taken inside a look-ahead window, and the loader "
                                 "is balanced in dataloader mode, which cannot resume mid-epoch; give the callback "
                                 "in Trainer(callbacks=[...]) (trainer mode)")
            loader.resume_in_window(saved.get("window"))

        self.session.track_loader(loader, position, restore, workers)

    def _install_loader(self, train_dataloader, model, args):
        """Balance the training data: through the Trainer when we hold it (resume keeps Trainer's own
        skip_first_batches), else in place in the prepared dataloader (the object Trainer iterates)."""
        trainer = self._trainer()
        side = self.session.side
        if trainer is not None and trainer.callback_handler.train_dataloader is train_dataloader:
            self._installed_on = trainer
            packed = packed_input_for(self.config.input, trainer.data_collator, getattr(model, "config", None))
            return install_balanced_loader(trainer, self.config, packed_input=packed, side_channel=side)
        self._installed_on = train_dataloader
        return install_balanced_loader(train_dataloader, self.config, model_config=getattr(model, "config", None),
                                       gradient_accumulation_steps=args.gradient_accumulation_steps,
                                       side_channel=side)

    # -- timing -------------------------------------------------------------------------

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step
        if self._active and self.loader is not None:
            # the loader counts steps from 0 in every pass (epoch, resume): its errors name the user's step
            self.loader.set_step_offset(state.global_step + 1)

    def on_step_begin(self, args, state, control, **kwargs):
        self._global_step = state.global_step
        if self._active and self.session is not None:
            self.session.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active or self.session is None:
            return
        self.session.end_step(state.global_step)

    # -- logging ------------------------------------------------------------------------

    def _collect_logs(self) -> Dict[str, float]:
        """At a training log (every rank logs the same steps): measured imbalance over the window (a
        collective), loader and vision counters, the cost model."""
        take = getattr(self.loader, "pop_stats", None)
        self.session.measure()  # Trainer logs on every rank at the same step: the collective meets there
        return self.session.metrics(take() if callable(take) else [])

    def on_log(self, args, state, control, logs=None, **kwargs):
        # Computed here, not at on_step_end from control.should_log: no reliance on DefaultFlowCallback
        # having run before us. Training logs carry "loss" on every rank; eval and summary logs do not.
        if not self._active or self.session is None or logs is None or "loss" not in logs:
            return
        ours = self._collect_logs()
        logs.update(ours)
        # Trainer appended a copy of `logs` to log_history just before on_log: complete that entry too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(ours)

    # -- checkpoints --------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        """Every checkpoint gets the session's state (equal on every rank: rank 0 writes it) and the cost models."""
        if not self._active or self.session is None or not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            self.session.save_checkpoint(folder)

    def on_train_end(self, args, state, control, **kwargs):
        self._close_session()

    def _close_session(self) -> None:
        """Undo the run: the session closes the loader's thread and installation, the hooks, the vision balancer
        and the groups (`BalanceSession.close`), and drops the callback's references to the loader."""
        self._active = False
        if self.session is not None:
            self.session.close()


def _check_sft(args, train_dataloader, model, collator) -> None:
    """TRL's SFTTrainer: its settings that would feed the loader other samples than the user's (same on every rank)."""
    from hf_dp_balance.integrations.trl import check_sft_setup

    check_sft_setup(args, getattr(train_dataloader, "dataset", None), getattr(model, "config", None), collator)


def _check_data_parallel_sharding(train_dataloader, data_parallel, explicit) -> None:
    """An explicit data-parallel group smaller than the world needs Trainer's loader sharded by data-parallel
    index (tp / cp peers read the same samples): done at init when the callback was given in `callbacks=`."""
    if explicit is None or train_dataloader is None:
        return
    check_sharded_by(train_dataloader, data_parallel, owner="DPBalanceCallback", loader="Trainer's train dataloader",
                     fix="Trainer builds the loader (and counts its steps) before any event of train(), so only a "
                         "callback given at init can shard it: pass it in Trainer(callbacks=[...]) rather than "
                         "trainer.add_callback, or give Trainer a parallelism_config")


def shard_train_dataloader_by_data_parallel_index(trainer, explicit) -> None:
    """Wrap the instance's `get_train_dataloader`: the prepared loader's batch sampler shards by data-parallel
    index (accelerate's, without a device mesh, shards by process), before Trainer reads its length."""
    if "get_train_dataloader" in vars(trainer):
        return  # wrapped already (or the user's own)
    build = trainer.get_train_dataloader

    def get_train_dataloader(*args, **kwargs):
        loader = build(*args, **kwargs)
        shard_by(loader, resolve_data_parallel_group(getattr(trainer, "accelerator", None), explicit))
        return loader

    trainer.get_train_dataloader = get_train_dataloader


# --------------------------------------------------------------------------- small shell helpers


def place_before_log_readers(callbacks: list, callback: Any) -> None:
    """Move `callback` in place right before the first other callback that reads logs (overrides `on_log`)."""
    if not any(cb is callback for cb in callbacks):
        return
    others = [cb for cb in callbacks if cb is not callback]
    at = next((i for i, cb in enumerate(others) if type(cb).on_log is not TrainerCallback.on_log), len(others))
    callbacks[:] = others[:at] + [callback] + others[at:]


def _trainer_calling(callback, max_depth: int = 8):
    """The Trainer whose callback handler runs `callback`'s event now, or None: at on_init_end for a callback
    given in `callbacks=`, at on_train_begin for one added with `trainer.add_callback` (no event reaches it
    earlier), so both ways hold the same Trainer before the first step.

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
