"""`DPBalancer`: data-parallel balancing for a custom Accelerate training loop (docs/accelerate.md).

    balancer = DPBalancer(accelerator, model=model, config=DPBalanceConfig())
    train_dl = balancer.prepare(dataloader)        # a DataLoader of per-sample dicts
    for batch in train_dl:                          # packed, balanced, on the device
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)   # batch["num_items_in_batch"]: the step's global count
            ...

Only the data-parallel dimension is balanced: the group comes from the accelerator's device mesh
(dp_replicate x dp_shard) or `data_parallel_group=` (a plain DataLoader is then sharded by
data-parallel index, so tp / cp peers read the same samples). An adapter over one
`runtime.session.BalanceSession`, as the Trainer callback is: its `SideChannel` makes every side group
(one exchange group, one more per further loader, the main thread's control group, the one watchdog's
heartbeat group, each over the data-parallel slice), its fitter
times each rank's steps between the loader's own step boundaries and fits, broadcasts and refits the
cost model, unless it is given one (`cost_model=`, or `config.cost_model_path`, read on rank 0 and
broadcast). Until a model is fitted it plans with the FLOP prior of the model's config (`config.prior`).
A DataLoader whose collator packs rows itself is split and packed back in its layout (`config.input`).
The session's state (every loader's position, look-ahead window and plan, the settings that order the samples,
the cost models) is registered with `accelerator.register_for_checkpointing`: `save_state` / `load_state` carry
it. `close()` closes the session.
"""

from __future__ import annotations

import collections
from typing import Any, List, Optional

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.integrations.accelerate_loader import BalancedDataLoader
from hf_dp_balance.integrations.loss_contract import check_loop_loss
from hf_dp_balance.runtime.fitter import image_patches, micro_batch_lengths, resolve_timing
from hf_dp_balance.runtime.packed_input import packed_input_for
from hf_dp_balance.runtime.parallel import resolve_data_parallel_group
from hf_dp_balance.runtime.session import BalanceSession

_MAX_STATS = 4096  # step statistics kept for inspection (`step_stats`)


def torch_iterable_dataset():
    import torch.utils.data

    return torch.utils.data.IterableDataset


def _sync_mode(accelerator, config: DPBalanceConfig) -> str:
    """DDP meets once per optimizer step; FSDP and DeepSpeed ZeRO-3 meet in every micro-batch."""
    if config.sync != "auto":
        return config.sync
    kind = str(getattr(accelerator, "distributed_type", "")).upper()
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    zero3 = plugin is not None and getattr(plugin, "zero_stage", 0) == 3
    return "micro_batch" if "FSDP" in kind or zero3 else "step"


def _model_config(model, model_config):
    if model_config is not None or model is None:
        return model_config
    inner = getattr(model, "module", model)  # DDP / DeepSpeed wrappers
    return getattr(inner, "config", None)


def _name_distributed_errors(owner, name: str, loader, step):
    """Wrap `owner.name` (an instance attribute, until the returned undo): a torch.distributed error inside it
    (a peer killed while this rank is in DDP's collectives) is raised as the library's error naming the
    step (`step()`), the rank and the phase, chained from it (`runtime.watchdog.training_errors`; `loader()`:
    the BalancedLoader iterated now). Anything else passes through untouched."""
    from hf_dp_balance.runtime.watchdog import named_training_call

    own = vars(owner).get(name)
    setattr(owner, name, named_training_call(getattr(owner, name), loader, step))
    return (lambda: setattr(owner, name, own)) if own is not None else (lambda: vars(owner).pop(name, None))


def _register_for_checkpointing(accelerator, session):
    """`accelerator.register_for_checkpointing(session)`, and its undo (the session is closed with the balancer)."""
    register = getattr(accelerator, "register_for_checkpointing", None)
    if register is None:
        return lambda: None
    register(session)

    def undo():
        objects = getattr(accelerator, "_custom_objects", [])
        objects[:] = [obj for obj in objects if obj is not session]

    return undo


class DPBalancer:
    """Balance a custom Accelerate loop's data across its data-parallel ranks.

    Args:
        accelerator: the `accelerate.Accelerator` (its gradient accumulation steps, device, mesh).
        model: the (prepared) model; its config selects the packing (`PackedCollator`, features).
        config: `DPBalanceConfig` (`HF_DP_BALANCE_*` environment variables apply on top).
        model_config: instead of `model` (or when the model has no `config`).
        cost_model / vision_cost_model: fitted `CostModel`s to plan with (else `config.cost_model_path`,
            refitted every `refit_every` steps; else fitted after `warmup_steps`, as the Trainer callback).
        data_parallel_group: a ProcessGroup, a 1-D DeviceMesh or a `DataParallelGroup` (default: from
            the accelerator's device mesh, else every process).
        further keywords go to `BalancedLoader` (collator, features_fn, plan_fn, id_key, ...).

    Every data-parallel rank must construct it, `prepare` and iterate alike (they are collectives).
    """

    def __init__(self, accelerator, model=None, config: Optional[DPBalanceConfig] = None, *,
                 model_config: Any = None, cost_model: Any = None, vision_cost_model: Any = None,
                 data_parallel_group: Any = None, **loader_kwargs):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("DPBalancer needs torch.distributed to be initialized (Accelerator() on several "
                             "processes, e.g. under torchrun)")
        self.accelerator = accelerator
        self.config = DPBalanceConfig.from_env(config)
        self.model_config = _model_config(model, model_config)
        self.data_parallel = resolve_data_parallel_group(accelerator, data_parallel_group)
        check_loop_loss(model, self.config, self.data_parallel.size)  # loss normalisation: integrations.loss_contract
        self._explicit_group = data_parallel_group is not None
        self.gradient_accumulation_steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        self.sync = _sync_mode(accelerator, self.config)
        device = getattr(accelerator, "device", None)
        self.device = device
        self._loader_kwargs = loader_kwargs
        self._loaders: List[Any] = []   # (BalancedLoader-like, restore callables)
        # Every group, thread and model of the run: the session (the Trainer callback's too).
        self.session = BalanceSession(self.config, self.data_parallel)
        self.session.vision_source = lambda: getattr(self._model, "_dp_balance_vision", None)
        device_type = getattr(device, "type", "cpu")
        # DDP (`step`): forward events; FSDP with its units in the model: unit events; else wall (`resolve_timing`).
        self._model = getattr(model, "module", model)  # DDP / DeepSpeed wrappers: hooks on the inner model
        timing = resolve_timing(self.config.timing, device_type, self.sync, self._model)
        # A model given here is used as is (never refitted); `cost_model_path`'s is read on rank 0 and refitted.
        try:
            self.session.start(model=self._model, model_config=self.model_config, timing=timing,
                               device_type=device_type, sync=self.sync, decoder=cost_model, vision=vision_cost_model, fitted_step=-1,
                               file_step=0)
            if self._model is not None and (self.config.vision or hasattr(self._model, "_dp_balance_vision")):
                # the vision tower balanced over the data-parallel slice, on the session's group (a wrapper the
                # user made, on its own group, is replaced); removed at close
                self.session.install_vision(self._model)
        except BaseException:
            self.session.close()  # a refused setup leaves no group behind
            raise
        self.fitter = self.session.fitter
        self.recorder = self.session.recorder
        self.step_stats: collections.deque = collections.deque(maxlen=_MAX_STATS)
        self._pending_stats: List[Any] = []
        self._closed = False
        # The training collectives run in the user's calls: their distributed errors name step, rank and phase.
        self._steps_trained = 0  # optimizer steps trained through the balanced loaders (all passes)
        self._unwrap = [_name_distributed_errors(self.accelerator, "backward", self._current_loader, self._step)]
        if model is not None:  # DDP's forward broadcasts buffers
            self._unwrap.append(_name_distributed_errors(model, "forward", self._current_loader, self._step))
        # accelerator.save_state / load_state carry the session's state (positions, settings, cost models)
        self._unwrap.append(_register_for_checkpointing(accelerator, self.session))

    def _current_loader(self):
        return self._loaders[-1][0] if self._loaders else None

    def _step(self) -> int:
        return self._steps_trained + 1  # the step in training, counted from 1 as Trainer's global_step + 1

    @property
    def cost_model(self):
        """The decoder cost model the loaders plan with (None until fitted or given)."""
        return self.fitter.decoder

    @property
    def vision_cost_model(self):
        return self.fitter.vision

    # -- building the balanced loader -----------------------------------------------------------
    def prepare(self, dataloader) -> BalancedDataLoader:
        """The balanced loader over `dataloader` (a torch DataLoader of per-sample dicts, or accelerate's
        prepared `DataLoaderShard` of one). A plain DataLoader is prepared here with
        `accelerator.prepare_data_loader(..., device_placement=False)`: batches are placed on the device
        after the exchange. Its collate is deferred while preparing (the balancer packs the samples).

        Dispatch mode (`dispatch_batches=True`, or accelerate's default for an IterableDataset, or a
        `DataLoaderDispatcher`): data-parallel rank 0 reads the DataLoader (per-process batches), plans
        each global batch and sends every rank its samples (`runtime.dispatch.DispatchedLoader`)."""
        if self._closed:
            raise RuntimeError("DPBalancer.prepare after close()")
        config = self.config
        user_collate = getattr(getattr(dataloader, "base_dataloader", dataloader), "collate_fn", None)
        packed_input = self._loader_kwargs.get("packed_input")
        if self._dispatches(dataloader):
            from hf_dp_balance.runtime.dispatch import DispatchedLoader as loader_class

            if packed_input is not None or config.input == "packed":
                # rank 0 alone reads (and would split) the rows, so the other ranks never see the user's layout
                raise ValueError("DPBalancer: packed input (input='packed' or packed_input=) is not supported in "
                                 "dispatch mode; give per-sample rows (input='samples', the library packs) or "
                                 "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))")
            packed_input = False  # per-sample, packed here (a user's collator is deferred, not split)
            prepared, restore = self._plain_for_dispatch(dataloader)
            config = config.replace(lookahead_steps=0)
            size = self.data_parallel.size
            length = lambda: -(-len(prepared) // size)  # noqa: E731 - micro-batches per rank
        else:
            from hf_dp_balance.runtime.loader import BalancedLoader as loader_class

            prepared, restore = self._prepared_shard(dataloader)
            length = None
        kwargs = dict(self._loader_kwargs)
        if packed_input is None:  # the rule the Trainer callback follows (`DPBalanceConfig.input`)
            kwargs["packed_input"] = packed_input_for(config.input, user_collate, self.model_config)
        elif packed_input is False:
            kwargs["packed_input"] = None
        loader = loader_class(prepared, config, gradient_accumulation_steps=self.gradient_accumulation_steps,
                              model_config=self.model_config, cost_model=None,
                              side_channel=self.session.side, sync=self.sync, **kwargs)
        self.session.add_loader(loader)
        self._loaders.append((loader, restore))
        balanced = BalancedDataLoader(prepared, lambda raw: loader.iter_steps(raw), device=self.device,
                                      count_items=self._global_count, recorder=self.recorder, length=length,
                                      on_step=self._step_done, before_last=lambda step: self._collect_stats(loader),
                                      window_state=loader.window_state, resume_in_window=loader.resume_in_window,
                                      state_owner=self.session, micro_per_step=self.gradient_accumulation_steps,
                                      raw_per_micro=loader.raw_batches_per_micro)
        workers = int(getattr(getattr(prepared, "base_dataloader", prepared), "num_workers", 0) or 0)
        self.session.track(lambda: {**loader.settings(), "dataloader_workers": workers}, balanced.position,
                           balanced.restore)
        return balanced

    def _dispatches(self, dataloader) -> bool:
        """Dispatch mode as accelerate decides it: its flag, else an IterableDataset (with device placement)."""
        if type(dataloader).__name__ == "DataLoaderDispatcher":
            return True
        if getattr(dataloader, "_is_accelerate_prepared", False):
            return False
        flag = getattr(self.accelerator, "dispatch_batches", None)
        if flag is not None:
            return bool(flag)
        return isinstance(getattr(dataloader, "dataset", None), torch_iterable_dataset())

    @staticmethod
    def _plain_for_dispatch(dataloader):
        """(the torch DataLoader rank 0 reads, undo): a dispatcher's own inner loader, or `dataloader`;
        its collate is deferred until `close()`."""
        from hf_dp_balance.runtime.loader import list_collate

        inner = getattr(dataloader, "base_dataloader", dataloader)
        restore = []
        if inner.collate_fn is not list_collate:
            old = inner.collate_fn
            inner.collate_fn = list_collate
            restore.append(lambda: setattr(inner, "collate_fn", old))
        return inner, restore

    def _prepared_shard(self, dataloader):
        """(prepared loader yielding lists of samples without device placement, undo) -- see `prepare`."""
        from hf_dp_balance.runtime.loader import list_collate

        restore = []
        if getattr(dataloader, "_is_accelerate_prepared", False) or hasattr(dataloader, "base_dataloader"):
            inner = getattr(dataloader, "base_dataloader", dataloader)
            if inner.collate_fn is not list_collate:
                old = inner.collate_fn
                inner.collate_fn = list_collate
                restore.append(lambda: setattr(inner, "collate_fn", old))
            if getattr(dataloader, "device", None) is not None:
                dev = dataloader.device
                dataloader.device = None  # samples stay on the CPU for the exchange; packed rows move after
                restore.append(lambda: setattr(dataloader, "device", dev))
            self._check_prepared_shard(dataloader)
            return dataloader, restore
        old = dataloader.collate_fn
        dataloader.collate_fn = list_collate  # copied into the prepared loader, then put back at once
        try:
            prepared = self._shard_by_data_parallel_index(dataloader)
        finally:
            dataloader.collate_fn = old
        return prepared, restore

    def _slices_without_mesh(self) -> bool:
        """An explicit data-parallel group smaller than the world, and no device mesh accelerate shards by."""
        import torch.distributed as dist

        return (self._explicit_group and self.data_parallel.size != dist.get_world_size()
                and getattr(self.accelerator, "torch_device_mesh", None) is None)

    def _shard_by_data_parallel_index(self, dataloader):
        """Accelerate's prepared loader, sharded by data-parallel index: the processes of one index (tp / cp
        peers) read the same batches. Accelerate shards by its device mesh when it has one, else by process;
        with an explicit group and no mesh the shard is given here (its own prepare_data_loader, its settings)."""
        if not self._slices_without_mesh():
            return self.accelerator.prepare_data_loader(dataloader, device_placement=False)
        from accelerate.data_loader import prepare_data_loader

        acc = self.accelerator
        return prepare_data_loader(
            dataloader, acc.device, num_processes=self.data_parallel.size, process_index=self.data_parallel.index,
            split_batches=acc.split_batches, put_on_device=False, rng_types=acc.rng_types.copy(),
            dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler, data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking, use_stateful_dataloader=acc.use_stateful_dataloader)

    def _check_prepared_shard(self, dataloader) -> None:
        """A loader the user prepared must shard by data-parallel index, or tp / cp peers train other samples."""
        if not self._slices_without_mesh():
            return
        sampler = getattr(dataloader, "batch_sampler", None)
        shards = getattr(sampler, "num_processes", None)
        if shards is not None and (shards != self.data_parallel.size
                                   or getattr(sampler, "process_index", None) != self.data_parallel.index):
            raise ValueError(
                f"DPBalancer(data_parallel_group=...): the prepared dataloader is sharded over {shards} processes "
                f"(accelerator.prepare shards by process, it has no device mesh), but the data-parallel group has "
                f"{self.data_parallel.size}: tp / cp peers would train different samples. Pass the plain DataLoader "
                f"to DPBalancer.prepare (it shards by data-parallel index)")

    # -- per step ------------------------------------------------------------------------------
    def _global_count(self, local: int) -> int:
        """Sum of `local` over the data-parallel group (main thread, on the balancer's own side group)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([int(local)], dtype=torch.int64)
        if self.data_parallel.size > 1:
            dist.all_reduce(value, group=self.session.side.control_group)
        return int(value.item())

    def _collect_stats(self, loader) -> None:
        """The statistics of the step about to finish (before the next step is taken from the stream)."""
        stats = loader.pop_stats()
        self.step_stats.extend(stats)
        self._pending_stats.extend(stats)

    def _step_done(self, step: int, batches: list, seconds: Optional[float]) -> None:
        """A step's micro-batches were all trained: record its timing, fit when due (warm-up, refit_every).

        Runs on every data-parallel rank at the same step (main thread, between the user's steps), so the
        fitter's collectives are safe here. Without a model to hook, the step's packed rows tell what it computed.
        """
        self._steps_trained += 1
        cadence = self.config.metrics_every
        if cadence > 0 and self._steps_trained % cadence == 0:
            self.session.measure()  # every rank ends the same steps: the measurement's collective meets here
        if seconds is None:
            return
        rec = self.recorder
        if self._model is None:
            for b in batches:
                rec.lengths.extend(micro_batch_lengths(b))
                rec.patches.extend(image_patches(b))
        self.session.end_step(step + 1, seconds)  # steps done, as Trainer counts them

    # -- results and teardown ------------------------------------------------------------------
    def metrics(self) -> dict:
        """The `dp_balance/*` numbers of the steps since the last call, as the Trainer callback logs them
        (plus `dp_balance/steps`). Local: call it on any rank, at any step (`if accelerator.is_main_process:
        log(balancer.metrics())`); the measured compute imbalance comes from the collective the balancer runs
        inside the step every `config.metrics_every` steps."""
        stats, self._pending_stats = self._pending_stats, []
        out = self.session.metrics(stats)
        out["dp_balance/steps"] = float(len(stats))
        return out

    def close(self) -> None:
        """Stop every exchange thread, put back what `prepare` changed, close the session (its side groups)."""
        if self._closed:
            return
        self._closed = True
        try:
            for loader, restore in self._loaders:
                loader.close()
                for undo in reversed(restore):
                    undo()
            self._loaders = []
            for undo in self._unwrap:
                undo()
        finally:
            self.session.close()

    def __enter__(self) -> "DPBalancer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DPBalancer"]
