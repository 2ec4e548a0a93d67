"""`DPBalancer`: data-parallel balancing for a custom Accelerate training loop (docs/accelerate.md).

    balancer = DPBalancer(accelerator, model=model, config=DPBalanceConfig())
    train_dl = balancer.prepare(dataloader)        # a DataLoader of per-sample dicts
    for batch in train_dl:                          # packed, balanced, on the device
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)   # batch["num_items_in_batch"]: the step's global count
            ...

Only the data-parallel dimension is balanced: the group comes from the accelerator's device mesh
(dp_replicate x dp_shard) or `data_parallel_group=`. The balancer makes two side gloo groups over it
per loader (the exchange thread's, and one for the main thread's per-step item count), times each
rank's steps between the loader's own step boundaries into `timings` (a `StepTimings`), and plans
with the cost model it is given (`cost_model=`, or `config.cost_model_path`); without one it packs
and times but moves nothing.
"""

from __future__ import annotations

import collections
from typing import Any, List, Optional

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.integrations.accelerate_loader import BalancedDataLoader
from hf_dp_balance.runtime.parallel import resolve_data_parallel_group
from hf_dp_balance.runtime.step_timing import StepClock, StepTimings

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


class DPBalancer:
    """Balance a custom Accelerate loop's data across its data-parallel ranks.

    Args:
        accelerator: the `accelerate.Accelerator` (its gradient accumulation steps, device, mesh).
        model: the (prepared) model; its config selects the packing (`PackedCollator`, features).
        config: `DPBalanceConfig` (`HF_DP_BALANCE_*` environment variables apply on top).
        model_config: instead of `model` (or when the model has no `config`).
        cost_model / vision_cost_model: fitted `CostModel`s to plan with (else `config.cost_model_path`).
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
        if cost_model is None and self.config.cost_model_path:
            from hf_dp_balance.core.cost import CostModel

            cost_model = CostModel.load(self.config.cost_model_path)
        self.cost_model, self.vision_cost_model = cost_model, vision_cost_model
        self.gradient_accumulation_steps = int(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
        self.sync = _sync_mode(accelerator, self.config)
        device = getattr(accelerator, "device", None)
        self.device = device
        self.timings = StepTimings()
        self._clock = StepClock(getattr(device, "type", "cpu"))
        self._loader_kwargs = loader_kwargs
        self._loaders: List[Any] = []   # (BalancedLoader-like, restore callables, groups)
        self._groups: List[Any] = []
        self._control_group = self.data_parallel.new_side_group(self.config.timeout_s)
        self._groups.append(self._control_group)
        self.step_stats: collections.deque = collections.deque(maxlen=_MAX_STATS)
        self._pending_stats: List[Any] = []
        self._closed = False

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
        from hf_dp_balance.runtime.exchange import SampleExchange

        config = self.config
        if self._dispatches(dataloader):
            from hf_dp_balance.runtime.dispatch import DispatchedLoader as loader_class

            prepared, restore = self._plain_for_dispatch(dataloader)
            config = config.replace(lookahead_steps=0)
            size = self.data_parallel.size
            length = lambda: -(-len(prepared) // size)  # noqa: E731 - micro-batches per rank
        else:
            from hf_dp_balance.runtime.loader import BalancedLoader as loader_class

            prepared, restore = self._prepared_shard(dataloader)
            length = None
        group = self.data_parallel.new_side_group(self.config.timeout_s)
        self._groups.append(group)
        loader = loader_class(prepared, config, gradient_accumulation_steps=self.gradient_accumulation_steps,
                              model_config=self.model_config, cost_model=None,
                              exchange=SampleExchange(self.config.timeout_s, group=group), sync=self.sync,
                              **self._loader_kwargs)
        if self.cost_model is not None:
            loader.set_cost_model(self.cost_model, vision=None if self.config.vision else self.vision_cost_model)
        self._loaders.append((loader, restore))
        return BalancedDataLoader(prepared, lambda raw: loader.iter_steps(raw), device=self.device,
                                  count_items=self._global_count, clock=self._clock, length=length,
                                  on_step=self._step_done, before_last=lambda step: self._collect_stats(loader))

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
            return dataloader, restore
        old = dataloader.collate_fn
        dataloader.collate_fn = list_collate  # copied into the prepared loader, then put back at once
        try:
            prepared = self.accelerator.prepare_data_loader(dataloader, device_placement=False)
        finally:
            dataloader.collate_fn = old
        return prepared, restore

    # -- per step ------------------------------------------------------------------------------
    def _global_count(self, local: int) -> int:
        """Sum of `local` over the data-parallel group (main thread, on the balancer's own side group)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([int(local)], dtype=torch.int64)
        if self.data_parallel.size > 1:
            dist.all_reduce(value, group=self._control_group)
        return int(value.item())

    def _collect_stats(self, loader) -> None:
        """The statistics of the step about to finish (before the next step is taken from the stream)."""
        stats = loader.pop_stats()
        self.step_stats.extend(stats)
        self._pending_stats.extend(stats)

    def _step_done(self, step: int, batches: list, seconds: Optional[float]) -> None:
        """A step's micro-batches were all trained: record its timing.

        Runs on every data-parallel rank at the same step (main thread, between the user's steps), so a
        collective is safe here. Plug point for the cross-rank fitter (runtime/fitter.py): after
        `self.timings.record(...)`, when a fit is due (warm-up done / refit_every), gather the records,
        fit on rank 0, broadcast, then `self.cost_model = decoder` and, for every `loader, _ in
        self._loaders`, `loader.set_cost_model(decoder, vision=None if config.vision else vision)`.
        """
        from hf_dp_balance.integrations.callback import feature_row, image_patches, segment_lengths

        lengths, patches = [], []
        for b in batches:
            lengths.extend(segment_lengths(b))
            patches.extend(image_patches(b))
        if seconds is not None:
            self.timings.record(step, feature_row(lengths), feature_row(patches), seconds)

    # -- results and teardown ------------------------------------------------------------------
    def metrics(self) -> dict:
        """The dp_balance/* numbers of the steps since the last call (local: no collective)."""
        from hf_dp_balance.integrations.callback import LOG_PREFIX, summarize_step_stats

        stats, self._pending_stats = self._pending_stats, []
        out = dict(summarize_step_stats(stats))
        out["steps"] = float(len(stats))
        if self.cost_model is not None:
            for name, value in self.cost_model.to_dict().items():
                if isinstance(value, (int, float)):
                    out[f"cost_{name}"] = float(value)
        out["fitted"] = float(self.cost_model is not None)
        return {LOG_PREFIX + k: float(v) for k, v in out.items()}

    def close(self) -> None:
        """Stop every exchange thread, put back what `prepare` changed, destroy the side groups."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        for loader, restore in self._loaders:
            loader.close()
            for undo in reversed(restore):
                undo()
        self._loaders = []
        for group in self._groups:
            try:
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - already gone with the default group
                pass
        self._groups = []

    def __enter__(self) -> "DPBalancer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DPBalancer"]
