"""Putting `BalancedLoader` into a stock `transformers.Trainer` (5.x) with the least patching.

How Trainer consumes data (transformers 5.24, `Trainer._run_epoch`): it builds
the train dataloader once (`get_train_dataloader` -> accelerate `prepare` ->
a `DataLoaderShard`), hands it to the callbacks (`callback_handler.
train_dataloader`, `on_train_begin`), then per epoch optionally
`skip_first_batches` (resume), `set_epoch`, `iter(...)`, and per optimizer step
`get_batch_samples(epoch_iterator, GA, device)`, which pulls the step's
micro-batches and computes `num_items_in_batch` (the step's target-token count,
gathered across ranks) from them. Because our micro-batches are packed AFTER
the exchange and `PackedCollator` masks the first label of every sample,
the count Trainer computes is exactly the unbalanced one (sum over samples of
labels[1:] != -100): the loss normalisation, hence the gradient, is unchanged.

Two ways in, both by `install_balanced_loader`:

* **dataloader mode** -- `install_balanced_loader(train_dataloader, config,
  model_config=..., gradient_accumulation_steps=...)`, e.g. from a callback's
  `on_train_begin(args, state, control, model=..., train_dataloader=...)`
  (callbacks never see the Trainer). In place: the `DataLoaderShard`'s inner
  `base_dataloader` is replaced by one that yields packed, balanced
  micro-batches; its collate becomes `list_collate` (the user's data collator
  is no longer called: `PackedCollator` packs). The shard still does RNG
  sync, `set_epoch`, `len()` and device placement of the packed rows.
  Limitation: on resume mid-epoch Trainer rebuilds the loader with
  `skip_first_batches` from the inner loader's parts, which yields unpacked
  lists -- use trainer mode to resume mid-epoch.
* **trainer mode** -- `install_balanced_loader(trainer, config)`: the prepared
  loader keeps yielding raw sample lists (collate `list_collate`, no device
  move) and the trainer instance's `get_batch_samples` is replaced by one
  that takes the step from the balanced stream over Trainer's own epoch
  iterator, then calls Trainer's `_get_num_items_in_batch` on the packed
  rows. Resume (`skip_first_batches`), `set_epoch`, `len()` stay Trainer's.
  The instance's `training_step` is wrapped too: a torch.distributed error in
  it (a peer killed while this rank is in DDP's all-reduce) is raised as the
  library's error naming the user's step, the rank and the phase
  (`runtime.watchdog.training_errors`); so is one from the item count's all_gather.
  Call it after the train dataloader exists (from `on_train_begin` with a
  reference to the trainer, or by overriding `get_train_dataloader`).

Not supported: accelerate's `DataLoaderDispatcher` (`dispatch_batches=True`,
iterable datasets): it runs collectives on the training group per batch,
which must not happen in the exchange thread.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.runtime.framework import resolve_sync
from hf_dp_balance.runtime.loader import BalancedLoader
from hf_dp_balance.runtime.patches import Patches, defer_collate
from hf_dp_balance.runtime.watchdog import training_errors

_INSTALLED_ATTR = "_hf_dp_balance_installation"


@dataclass
class _Installation:
    """One `install_balanced_loader`: its loader, the prepared loader it balances (in trainer mode a later
    `train()` builds a new one, and an installation on an older loader is stale) and everything it changed
    (`patches`, put back by uninstall). Lives on the target (Trainer or shard) under `_INSTALLED_ATTR`."""

    loader: BalancedLoader
    dataloader: Any
    patches: Patches = field(default_factory=Patches)


class _BalancedBase:
    """Stands in for `DataLoaderShard.base_dataloader`: iterating yields packed, balanced micro-batches.

    Everything else (dataset, batch_sampler, sampler, num_workers, ...) is
    the original inner DataLoader's, so accelerate's wrapper keeps
    working; `__class__` is reported as the inner loader's class, as
    accelerate's own adapter does.
    """

    def __init__(self, raw, loader: BalancedLoader):
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_loader", loader)

    def __iter__(self):
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._raw)

    def __getattr__(self, name: str):
        if name in ("_raw", "_loader"):
            raise AttributeError(name)
        return getattr(self._raw, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._raw, name, value)

    @property
    def collate_fn(self):
        # Only code that rebuilds the loader from its parts reads this (accelerate's
        # skip_first_batches on resume): such a loader would feed unpacked lists to the model.
        return _resume_unsupported

    @property
    def __class__(self):  # isinstance(shard.base_dataloader, DataLoader) stays true
        return self._raw.__class__


def _resume_unsupported(samples):
    raise RuntimeError("hf_dp_balance: this train dataloader was rebuilt from a balanced one (Trainer resuming "
                       "mid-epoch via skip_first_batches); dataloader mode cannot balance it. Install with "
                       "install_balanced_loader(trainer, ...) (trainer mode) to resume mid-epoch.")


def _check_loader_type(dataloader) -> None:
    kind = type(dataloader).__name__
    if kind == "DataLoaderDispatcher":
        raise ValueError("install_balanced_loader: accelerate's DataLoaderDispatcher (dispatch_batches=True) runs "
                         "collectives on the training group for every batch; use the default per-rank sharding "
                         "(accelerator_config={'dispatch_batches': False})")


def _inner_loader(dataloader) -> Any:
    """The (inner) torch DataLoader whose collate is deferred: the shard's `base_dataloader`, or `dataloader`."""
    inner = getattr(dataloader, "base_dataloader", dataloader)
    if isinstance(inner, _BalancedBase):
        raise ValueError("install_balanced_loader: this dataloader is already balanced")
    if not hasattr(inner, "collate_fn"):
        raise ValueError(f"install_balanced_loader: {type(inner).__name__} has no collate_fn to defer")
    return inner


def _installation(target) -> Optional[_Installation]:
    # The target's own attribute only: accelerate's DataLoaderShard forwards unknown names to its inner loader.
    return vars(target).get(_INSTALLED_ATTR) if hasattr(target, "__dict__") else None


def installed_loader(target) -> Optional[BalancedLoader]:
    """The `BalancedLoader` installed on `target` (Trainer or prepared dataloader), or None."""
    record = _installation(target)
    return record.loader if record is not None else None


def install_balanced_loader(target, config: Optional[DPBalanceConfig] = None, *, model_config: Any = None,
                            gradient_accumulation_steps: Optional[int] = None,
                            collator: Optional[Callable[[list], Any]] = None, cost_model: Any = None,
                            **loader_kwargs) -> BalancedLoader:
    """Balance a Trainer's training data across data-parallel ranks; returns the `BalancedLoader`.

    `target`: a `transformers.Trainer` (trainer mode; call after its train
    dataloader exists and before the first step) or the prepared train
    dataloader (`DataLoaderShard`, dataloader mode; e.g. `train_dataloader`
    in `on_train_begin`). Must run on every rank; give `side_channel=` (the run's
    `SideChannel`, the callback's session's) or the loader makes and closes its own. Idempotent: on a target that already balances its
    current train dataloader it returns that loader. An installation left
    over from an earlier `train()` (which built another dataloader and never
    uninstalled, e.g. it raised) is uninstalled and replaced, so a second
    `train()` is balanced too. Undo with `uninstall_balanced_loader(target)`.

    `config`: `DPBalanceConfig` (default: from `HF_DP_BALANCE_*`).
    `model_config`: the model's config, for `PackedCollator` / features (trainer
    mode: taken from `trainer.model`). `gradient_accumulation_steps`: required
    in dataloader mode (trainer mode: `trainer.args`). `cost_model`: planning
    starts only once a cost model is set (`loader.set_cost_model`, done by
    `DPBalanceCallback` after warm-up). Further keywords go to `BalancedLoader`.
    """
    config = config if config is not None else DPBalanceConfig.from_env()
    is_trainer = hasattr(target, "get_batch_samples") and hasattr(target, "callback_handler")
    dataloader = target.callback_handler.train_dataloader if is_trainer else target
    existing = _installation(target)
    if existing is not None:
        if existing.dataloader is dataloader:
            return existing.loader  # still balancing the loader Trainer iterates: install is idempotent
        # A stale installation: a new train() built a new train dataloader after a run that never
        # uninstalled (it raised, or nobody called uninstall). Undo it, then balance the new loader.
        uninstall_balanced_loader(target)
    if is_trainer:
        trainer = target
        if dataloader is None:
            raise ValueError("install_balanced_loader(trainer): the trainer has no train dataloader yet; call it "
                             "from on_train_begin or after get_train_dataloader()")
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        model_config = model_config if model_config is not None else model.config
        ga = gradient_accumulation_steps or trainer.args.gradient_accumulation_steps
    else:
        trainer = None
        if gradient_accumulation_steps is None:
            raise ValueError("install_balanced_loader(dataloader): pass gradient_accumulation_steps (args.gradient_accumulation_steps)")
        ga = gradient_accumulation_steps
    _check_loader_type(dataloader)
    inner = _inner_loader(dataloader)
    if not is_trainer and inner is dataloader:
        raise ValueError("install_balanced_loader(dataloader): expected accelerate's prepared DataLoaderShard "
                         "(Trainer's train dataloader); wrap a plain DataLoader with BalancedLoader(...) instead")
    sync = loader_kwargs.pop("sync", None) or resolve_sync(config.sync, getattr(trainer, "accelerator", None))
    # Built before anything is changed: a bad argument leaves the target untouched.
    loader = BalancedLoader(dataloader if is_trainer else inner, config, gradient_accumulation_steps=ga,
                            model_config=model_config, collator=collator, cost_model=cost_model, sync=sync,
                            **loader_kwargs)
    record = _Installation(loader=loader, dataloader=dataloader)
    patches = record.patches
    # trainer mode: raw samples stay on CPU for the exchange; Trainer moves the packed rows
    defer_collate(dataloader, patches, keep_on_cpu=is_trainer)
    if is_trainer:
        # Bound to this installation, not looked up on the trainer: a stale patch can never reach a newer loader.
        patches.set(trainer, "get_batch_samples",
                    types.MethodType(functools.partial(_balanced_get_batch_samples, loader=loader), trainer))
        if hasattr(trainer, "get_resumed_dataloader"):
            patches.set(trainer, "get_resumed_dataloader", types.MethodType(
                functools.partial(_balanced_resumed_dataloader, skip=trainer.get_resumed_dataloader, loader=loader),
                trainer))
        # the user's step in training: Trainer's global_step + 1
        patches.name_errors(trainer, "training_step", lambda: loader, lambda: trainer.state.global_step + 1)
    else:
        patches.set(dataloader, "base_dataloader", _BalancedBase(inner, loader))
    setattr(target, _INSTALLED_ATTR, record)
    return loader


def _balanced_get_batch_samples(self, epoch_iterator, num_batches: int, device, *, loader: BalancedLoader):
    """Trainer.get_batch_samples over the balanced stream: packed micro-batches, then Trainer's own item count."""
    state = getattr(self, "state", None)
    limit = None
    if state is not None and getattr(state, "max_steps", 0) and state.max_steps > 0:
        limit = max(0, int(state.max_steps) - int(state.global_step))  # never prefetch past the last step
    stream = loader.stream_for(epoch_iterator, step_limit=limit)
    batches = stream.next_step() or []
    if len(batches) > num_batches:
        raise RuntimeError(f"hf_dp_balance: the balanced stream produced {len(batches)} micro-batches for a step "
                           f"where Trainer expects {num_batches}; gradient_accumulation_steps changed?")
    with training_errors(loader, "num_items_in_batch all_gather (Trainer)", lambda: self.state.global_step + 1):
        return batches, self._get_num_items_in_batch(batches, device)


def _balanced_resumed_dataloader(self, dataloader, num_batches: int, *, skip, loader: BalancedLoader):
    """Trainer's mid-epoch resume skips the raw batches of the steps it trained; a resume inside a look-ahead
    window reads the window again from its start (its samples may train in any of its steps), so the window's
    trained steps are not skipped here: the balanced stream skips them after re-planning the window."""
    rewind = loader.resume_trained_steps() * loader.gradient_accumulation_steps
    return skip(dataloader, num_batches - rewind) if num_batches > rewind else dataloader


def uninstall_balanced_loader(target) -> None:
    """Undo `install_balanced_loader(target)` (end of training, on every rank); a no-op when not installed.

    Stops the exchange thread, then puts back exactly what install changed: the
    inner loader's collate, the shard's device (trainer mode) or inner loader
    (dataloader mode), the instance's `get_batch_samples` and `training_step`, and removes the
    installation record, so the next `install_balanced_loader` builds a fresh
    loader. The target is restored even when stopping the thread fails.
    """
    record = _installation(target)
    if record is None:
        return
    try:
        record.loader.close()
    finally:
        delattr(target, _INSTALLED_ATTR)
        record.patches.undo()


__all__ = ["install_balanced_loader", "installed_loader", "uninstall_balanced_loader"]
