"""What both front ends read from accelerate alike: when the ranks meet, how a prepared loader is sharded (and
the error that refuses one sharded otherwise), and whether accelerate dispatches a loader's batches.

The Trainer and a custom Accelerate loop share one `accelerate.Accelerator`; the rules below read its facts, so
the Trainer callback and `DPBalancer` resolve the same setup to the same answer.
"""

from __future__ import annotations

from typing import Any, Optional

from hf_dp_balance.runtime.parallel import DataParallelGroup


def resolve_sync(sync: str, accelerator: Any = None) -> str:
    """The sync mode in force: `sync` unless it is `auto`; then `micro_batch` under FSDP or DeepSpeed ZeRO-3
    (their collectives run in every micro-batch's forward and backward), else `step` (DDP meets once per
    optimizer step; also without an accelerator to ask)."""
    if sync != "auto":
        return sync
    if accelerator is None:
        return "step"
    state = getattr(accelerator, "state", None)
    fsdp = (getattr(state, "fsdp_plugin", None) is not None
            or "FSDP" in str(getattr(accelerator, "distributed_type", "")).upper())
    plugin = getattr(state, "deepspeed_plugin", None)
    zero3 = plugin is not None and getattr(plugin, "zero_stage", 0) == 3
    return "micro_batch" if fsdp or zero3 else "step"


def sharding_of(dataloader: Any) -> Optional[int]:
    """How many shards a prepared loader's batch sampler splits the data into (None: not a sharding sampler)."""
    return getattr(getattr(dataloader, "batch_sampler", None), "num_processes", None)


def is_sharded_by(dataloader: Any, data_parallel: DataParallelGroup) -> bool:
    """Whether the prepared loader shards by data-parallel index (tp / cp peers of one index read the same
    batches): its sampler has one shard per data-parallel rank and reads this rank's index, or it shards not."""
    sampler = getattr(dataloader, "batch_sampler", None)
    shards = getattr(sampler, "num_processes", None)
    return shards is None or (shards == data_parallel.size
                              and getattr(sampler, "process_index", None) == data_parallel.index)


def check_sharded_by(dataloader: Any, data_parallel: DataParallelGroup, *, owner: str, loader: str,
                     fix: str) -> None:
    """Refuse a prepared loader that does not shard by data-parallel index (`is_sharded_by`): tp / cp peers of
    one index would train different samples. The error names `owner` (the front end), the `loader`, its shard
    count, the group's size, and the `fix` the front end offers."""
    if not is_sharded_by(dataloader, data_parallel):
        raise ValueError(f"{owner}(data_parallel_group=...): {loader} is sharded over {sharding_of(dataloader)} "
                         f"processes, the data-parallel group has {data_parallel.size}: tp / cp peers would train "
                         f"different samples. {fix}")


def dispatches_batches(dataloader: Any, accelerator: Any = None) -> bool:
    """Whether accelerate dispatches `dataloader` (one process reads, every process gets its part): a
    `DataLoaderDispatcher` does, another loader accelerate prepared does not; a plain one follows the
    accelerator's `dispatch_batches` flag, and unset, accelerate's default (an IterableDataset dispatches)."""
    if type(dataloader).__name__ == "DataLoaderDispatcher":
        return True
    if getattr(dataloader, "_is_accelerate_prepared", False):
        return False
    flag = getattr(accelerator, "dispatch_batches", None)
    if flag is not None:
        return bool(flag)
    import torch.utils.data

    return isinstance(getattr(dataloader, "dataset", None), torch.utils.data.IterableDataset)


def shard_by(dataloader: Any, data_parallel: DataParallelGroup) -> None:
    """Make a prepared loader's sharding sampler shard by data-parallel index (before anything reads its length)."""
    if not is_sharded_by(dataloader, data_parallel):
        sampler = dataloader.batch_sampler
        sampler.num_processes, sampler.process_index = data_parallel.size, data_parallel.index


__all__ = ["check_sharded_by", "dispatches_batches", "is_sharded_by", "resolve_sync", "shard_by", "sharding_of"]
