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
from hf_dp_balance.runtime.framework import check_sharded_by, dispatches_batches, resolve_sync
from hf_dp_balance.runtime.packed_input import packed_input_for
from hf_dp_balance.runtime.parallel import resolve_data_parallel_group
from hf_dp_balance.runtime.patches import defer_collate, register_for_checkpointing
from hf_dp_balance.runtime.session import BalanceSession

_MAX_STATS = 4096  # step statistics kept for inspection (`step_stats`)


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
        self._model = getattr(model, "module", model)  # DDP / DeepSpeed wrappers: hooks on the inner model
        self.model_config = model_config if model_config is not None else getattr(self._model, "config", None)
        self.data_parallel = resolve_data_parallel_group(accelerator, data_parallel_group)
        check_loop_loss(model, self.config, self.data_parallel.size)  # loss normalisation: integrations.loss_contract
        self._explicit_group = data_parallel_group is not None
        self.gradient_accumulation_steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        self.sync = resolve_sync(self.config.sync, accelerator)
        self.device = getattr(accelerator, "device", None)
        self._loader_kwargs = loader_kwargs
        self._steps_trained = 0  # optimizer steps trained through the balanced loaders (all passes)
        # Every group, thread, hook and patch of the run: the session (the Trainer callback's too). A model
        # given here is used as is (never refitted); `cost_model_path`'s is read on rank 0 and refitted.
        self.session = BalanceSession.open(
            self.config, self.data_parallel, setup=lambda session: self._wire(session, model),
            model=self._model, model_config=self.model_config,
            device_type=getattr(self.device, "type", "cpu"), sync=self.sync, decoder=cost_model,
            vision=vision_cost_model, fitted_step=-1, file_step=0)
        self.fitter = self.session.fitter
        self.recorder = self.session.recorder
        self.step_stats: collections.deque = collections.deque(maxlen=_MAX_STATS)
        self._pending_stats: List[Any] = []
        self._closed = False

    def _wire(self, session: BalanceSession, model) -> None:
        """The accelerator's calls and the model onto the session (every change undone at its `close`)."""
        session.attach_vision(self._model)  # config.vision: over the data-parallel slice, removed at close
        # The training collectives run in the user's calls: their distributed errors name step, rank and phase.
        session.patches.name_errors(self.accelerator, "backward", self._current_loader, self._step)
        if model is not None:  # DDP's forward broadcasts buffers
            session.patches.name_errors(model, "forward", self._current_loader, self._step)
        # accelerator.save_state / load_state carry the session's state (positions, settings, cost models)
        register_for_checkpointing(self.accelerator, session, session.patches)

    def _current_loader(self):
        return self.session.loaders[-1] if self.session.loaders else None  # the latest `prepare`d

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
        if dispatches_batches(dataloader, self.accelerator):
            from hf_dp_balance.runtime.dispatch import DispatchedLoader as loader_class

            if packed_input is not None or config.input == "packed":
                # rank 0 alone reads (and would split) the rows, so the other ranks never see the user's layout
                raise ValueError("DPBalancer: packed input (input='packed' or packed_input=) is not supported in "
                                 "dispatch mode; give per-sample rows (input='samples', the library packs) or "
                                 "Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=False))")
            packed_input = False  # per-sample, packed here (a user's collator is deferred, not split)
            # rank 0 reads a dispatcher's own inner loader, or `dataloader`; its collate deferred until close()
            prepared = defer_collate(dataloader, self.session.patches)
            config = config.replace(lookahead_steps=0)
            size = self.data_parallel.size
            length = lambda: -(-len(prepared) // size)  # noqa: E731 - micro-batches per rank
        else:
            from hf_dp_balance.runtime.loader import BalancedLoader as loader_class

            prepared = self._prepared_shard(dataloader)
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
        balanced = BalancedDataLoader(prepared, lambda raw: loader.iter_steps(raw), device=self.device,
                                      count_items=self.session.sum_over_data_parallel, recorder=self.recorder,
                                      length=length, on_step=self._step_done,
                                      before_last=lambda step: self._collect_stats(loader),
                                      window_state=loader.window_state, resume_in_window=loader.resume_in_window,
                                      state_owner=self.session, micro_per_step=self.gradient_accumulation_steps,
                                      raw_per_micro=loader.raw_batches_per_micro)
        workers = int(getattr(getattr(prepared, "base_dataloader", prepared), "num_workers", 0) or 0)
        self.session.track_loader(loader, balanced.position, balanced.restore, workers)
        return balanced

    def _prepared_shard(self, dataloader):
        """The prepared loader, yielding lists of samples without device placement (undone at close)."""
        from hf_dp_balance.runtime.patches import Patches

        if getattr(dataloader, "_is_accelerate_prepared", False) or hasattr(dataloader, "base_dataloader"):
            defer_collate(dataloader, self.session.patches, keep_on_cpu=True)
            if self._slices_without_mesh():
                check_sharded_by(dataloader, self.data_parallel, owner="DPBalancer", loader="the prepared dataloader",
                                 fix="accelerator.prepare shards by process when it has no device mesh: pass the "
                                     "plain DataLoader to DPBalancer.prepare (it shards by data-parallel index)")
            return dataloader
        with Patches() as copied:  # the collate is copied into the prepared loader, then put back at once
            defer_collate(dataloader, copied)
            return self._shard_by_data_parallel_index(dataloader)

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

    # -- per step ------------------------------------------------------------------------------
    def _collect_stats(self, loader) -> None:
        """The statistics of the step about to finish (before the next step is taken from the stream)."""
        stats = loader.pop_stats()
        self.step_stats.extend(stats)
        self._pending_stats.extend(stats)

    def _step_done(self, step: int, batches: list, seconds: Optional[float]) -> None:
        """A step's micro-batches were all trained: record its timing, fit when due (warm-up, refit_every).

        Runs on every data-parallel rank at the same step (main thread, between the user's steps), so the
        fitter's collectives are safe here.
        """
        self._steps_trained += 1
        cadence = self.config.metrics_every
        if cadence > 0 and self._steps_trained % cadence == 0:
            self.session.measure()  # every rank ends the same steps: the measurement's collective meets here
        if seconds is not None:
            self.session.end_step(step + 1, seconds, batches)  # steps done, as Trainer counts them

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
        """Close the session: every exchange thread stopped, everything `prepare` and the constructor changed put
        back (`session.patches`), the side groups closed."""
        if self._closed:
            return
        self._closed = True
        self.session.close()

    def __enter__(self) -> "DPBalancer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DPBalancer"]
