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
  Call it after the train dataloader exists (from `on_train_begin` with a
  reference to the trainer, or by overriding `get_train_dataloader`).

Not supported: accelerate's `DataLoaderDispatcher` (`dispatch_batches=True`,
iterable datasets): it runs collectives on the training group per batch,
which must not happen in the exchange thread.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Optional

from .config import DPBalanceConfig
from .loader import BalancedLoader, list_collate

_INSTALLED_ATTR = "_hf_dp_balance_loader"


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


def _defer_collate(dataloader) -> Any:
    """Make the (inner) torch DataLoader return lists of sample dicts; returns that inner loader."""
    inner = getattr(dataloader, "base_dataloader", dataloader)
    if isinstance(inner, _BalancedBase):
        raise ValueError("install_balanced_loader: this dataloader is already balanced")
    if not hasattr(inner, "collate_fn"):
        raise ValueError(f"install_balanced_loader: {type(inner).__name__} has no collate_fn to defer")
    inner.collate_fn = list_collate
    return inner


def _default_sync(trainer, config: DPBalanceConfig) -> Optional[str]:
    if config.sync != "auto" or trainer is None:
        return None
    fsdp = bool(getattr(trainer, "is_fsdp_enabled", False))
    zero3 = False
    ds = getattr(getattr(trainer, "accelerator", None), "state", None)
    plugin = getattr(ds, "deepspeed_plugin", None) if ds is not None else None
    if plugin is not None:
        zero3 = getattr(plugin, "zero_stage", 0) == 3
    return "micro_batch" if fsdp or zero3 else "step"


def install_balanced_loader(target, config: Optional[DPBalanceConfig] = None, *, model_config: Any = None,
                            gradient_accumulation_steps: Optional[int] = None,
                            collator: Optional[Callable[[list], Any]] = None, cost_model: Any = None,
                            **loader_kwargs) -> BalancedLoader:
    """Balance a Trainer's training data across data-parallel ranks; returns the `BalancedLoader`.

    `target`: a `transformers.Trainer` (trainer mode; call after its train
    dataloader exists and before the first step) or the prepared train
    dataloader (`DataLoaderShard`, dataloader mode; e.g. `train_dataloader`
    in `on_train_begin`). Must run on every rank (it creates the side gloo
    group: a collective). Idempotent per target.

    `config`: `DPBalanceConfig` (default: from `HF_DP_BALANCE_*`).
    `model_config`: the model's config, for `PackedCollator` / features (trainer
    mode: taken from `trainer.model`). `gradient_accumulation_steps`: required
    in dataloader mode (trainer mode: `trainer.args`). `cost_model`: planning
    starts only once a cost model is set (`loader.set_cost_model`, done by
    `DPBalanceCallback` after warm-up). Further keywords go to `BalancedLoader`.
    """
    config = config if config is not None else DPBalanceConfig.from_env()
    existing = getattr(target, _INSTALLED_ATTR, None)
    if existing is not None:
        return existing
    is_trainer = hasattr(target, "get_batch_samples") and hasattr(target, "callback_handler")
    if is_trainer:
        trainer = target
        dataloader = trainer.callback_handler.train_dataloader
        if dataloader is None:
            raise ValueError("install_balanced_loader(trainer): the trainer has no train dataloader yet; call it "
                             "from on_train_begin or after get_train_dataloader()")
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        model_config = model_config if model_config is not None else model.config
        ga = gradient_accumulation_steps or trainer.args.gradient_accumulation_steps
    else:
        trainer, dataloader = None, target
        if gradient_accumulation_steps is None:
            raise ValueError("install_balanced_loader(dataloader): pass gradient_accumulation_steps (args.gradient_accumulation_steps)")
        ga = gradient_accumulation_steps
    _check_loader_type(dataloader)
    inner = _defer_collate(dataloader)
    sync = loader_kwargs.pop("sync", None) or _default_sync(trainer, config)

    if is_trainer:
        if getattr(dataloader, "device", None) is not None:
            dataloader.device = None  # raw samples stay on CPU for the exchange; Trainer moves packed rows
        loader = BalancedLoader(dataloader, config, gradient_accumulation_steps=ga, model_config=model_config,
                                collator=collator, cost_model=cost_model, sync=sync, **loader_kwargs)
        trainer.get_batch_samples = types.MethodType(_balanced_get_batch_samples, trainer)
    else:
        loader = BalancedLoader(inner, config, gradient_accumulation_steps=ga, model_config=model_config,
                                collator=collator, cost_model=cost_model, sync=sync, **loader_kwargs)
        if inner is dataloader:
            raise ValueError("install_balanced_loader(dataloader): expected accelerate's prepared DataLoaderShard "
                             "(Trainer's train dataloader); wrap a plain DataLoader with BalancedLoader(...) instead")
        dataloader.base_dataloader = _BalancedBase(inner, loader)
    try:
        setattr(target, _INSTALLED_ATTR, loader)
    except AttributeError:
        pass
    return loader


def _balanced_get_batch_samples(self, epoch_iterator, num_batches: int, device):
    """Trainer.get_batch_samples over the balanced stream: packed micro-batches, then Trainer's own item count."""
    loader: BalancedLoader = getattr(self, _INSTALLED_ATTR)
    state = getattr(self, "state", None)
    limit = None
    if state is not None and getattr(state, "max_steps", 0) and state.max_steps > 0:
        limit = max(0, int(state.max_steps) - int(state.global_step))  # never prefetch past the last step
    stream = loader.stream_for(epoch_iterator, step_limit=limit)
    batches = stream.next_step() or []
    if len(batches) > num_batches:
        raise RuntimeError(f"hf_dp_balance: the balanced stream produced {len(batches)} micro-batches for a step "
                           f"where Trainer expects {num_batches}; gradient_accumulation_steps changed?")
    return batches, self._get_num_items_in_batch(batches, device)


def uninstall_balanced_loader(target) -> None:
    """Stop the exchange thread (end of training, on every rank); restore `get_batch_samples` (trainer mode)
    or the shard's inner loader (dataloader mode). The collate stays `list_collate`."""
    loader = getattr(target, _INSTALLED_ATTR, None)
    if loader is None:
        return
    loader.close()
    if "get_batch_samples" in getattr(target, "__dict__", {}):
        del target.get_batch_samples
    base = target.__dict__.get("base_dataloader") if hasattr(target, "__dict__") else None
    if isinstance(base, _BalancedBase):
        target.base_dataloader = base._raw
    try:
        delattr(target, _INSTALLED_ATTR)
    except AttributeError:
        pass


__all__ = ["install_balanced_loader", "uninstall_balanced_loader"]
