"""The run's one undo registry (`runtime.patches`) and the framework facts both front ends read
(`runtime.framework`), on real torch / accelerate objects; no process is started."""

import types

import pytest
import torch

from hf_dp_balance.runtime.framework import (check_sharded_by, dispatches_batches, is_sharded_by, resolve_sync,
                                             shard_by, sharding_of)
from hf_dp_balance.runtime.loader import list_collate
from hf_dp_balance.runtime.parallel import DataParallelGroup
from hf_dp_balance.runtime.patches import Patches, defer_collate


class _Owner:
    def method(self):
        return "class"


def test_patches_put_back_instance_attributes_and_remove_ones_that_were_not_there():
    owner = _Owner()
    owner.value = 1
    patches = Patches()
    patches.set(owner, "value", 2)
    patches.set(owner, "method", lambda: "patched")
    assert (owner.value, owner.method()) == (2, "patched")
    patches.undo()
    assert owner.value == 1
    assert "method" not in vars(owner) and owner.method() == "class"  # the class's method again
    patches.undo()  # a second undo is a no-op
    assert owner.value == 1 and len(patches) == 0


def test_patches_undo_newest_first_and_every_undo_runs_when_one_raises():
    order = []
    patches = Patches()
    patches.add(lambda: order.append("first"))

    def broken():
        order.append("broken")
        raise RuntimeError("undo failed")

    patches.add(broken)
    patches.add(lambda: order.append("last"))
    with pytest.raises(RuntimeError, match="undo failed"):
        patches.undo()
    assert order == ["last", "broken", "first"]


def test_the_same_attribute_patched_twice_comes_back_as_it_was_first():
    owner = _Owner()
    owner.value = "original"
    with Patches() as patches:
        patches.set(owner, "value", "a")
        patches.set(owner, "value", "b")
    assert owner.value == "original"


def test_defer_collate_swaps_a_real_dataloader_s_collate_and_puts_it_back():
    def users_collate(samples):
        return samples

    loader = torch.utils.data.DataLoader(list(range(6)), batch_size=2, collate_fn=users_collate)
    patches = Patches()
    assert defer_collate(loader, patches) is loader
    assert loader.collate_fn is list_collate
    assert next(iter(loader)) == [0, 1]
    patches.undo()
    assert loader.collate_fn is users_collate


def test_defer_collate_keeps_a_prepared_loader_s_samples_on_the_cpu_until_undone():
    from accelerate import Accelerator

    inner = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    shard = Accelerator(cpu=True).prepare_data_loader(inner)
    device, collate = shard.device, shard.base_dataloader.collate_fn
    assert device is not None
    patches = Patches()
    assert defer_collate(shard, patches, keep_on_cpu=True) is shard.base_dataloader
    assert shard.device is None and shard.base_dataloader.collate_fn is list_collate
    patches.undo()
    assert shard.device == device and shard.base_dataloader.collate_fn is collate


def test_sync_follows_the_config_else_the_accelerator_s_strategy():
    from accelerate import Accelerator

    assert resolve_sync("micro_batch", None) == "micro_batch"
    assert resolve_sync("auto", None) == "step"
    assert resolve_sync("auto", Accelerator(cpu=True)) == "step"  # no FSDP, no DeepSpeed: DDP semantics
    # FSDP / ZeRO-3 need a multi-device launch to build: their facts as accelerate records them
    fsdp = types.SimpleNamespace(distributed_type="DistributedType.FSDP", state=types.SimpleNamespace())
    zero3 = types.SimpleNamespace(distributed_type="DEEPSPEED",
                                  state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3)))
    zero2 = types.SimpleNamespace(distributed_type="DEEPSPEED",
                                  state=types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=2)))
    assert [resolve_sync("auto", acc) for acc in (fsdp, zero3, zero2)] == ["micro_batch", "micro_batch", "step"]
    assert resolve_sync("step", fsdp) == "step"


def test_a_loader_sharded_by_process_is_resharded_by_data_parallel_index():
    from accelerate.data_loader import BatchSamplerShard

    # accelerate's sharding sampler as a process-sharded prepare builds it: 4 shards, this process's is 0
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8)), batch_size=1, drop_last=False)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_sampler=BatchSamplerShard(batches, 4, 0))
    slice_of_two = DataParallelGroup.from_ranks([0, 2], 2)  # this process is data-parallel index 1 of 2
    assert sharding_of(loader) == 4 and not is_sharded_by(loader, slice_of_two)
    shard_by(loader, slice_of_two)
    assert is_sharded_by(loader, slice_of_two)
    assert [int(b) for b in loader] == [1, 3, 5, 7]  # data-parallel index 1's share of the batches
    assert is_sharded_by(torch.utils.data.DataLoader(list(range(4))), slice_of_two)  # no sharding sampler


def test_a_loader_sharded_by_process_is_refused_naming_the_front_end_the_counts_and_the_fix():
    from accelerate.data_loader import BatchSamplerShard

    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(8)), batch_size=1, drop_last=False)
    loader = torch.utils.data.DataLoader(list(range(8)), batch_sampler=BatchSamplerShard(batches, 4, 0))
    slice_of_two = DataParallelGroup.from_ranks([0, 2], 2)
    with pytest.raises(ValueError) as refused:
        check_sharded_by(loader, slice_of_two, owner="DPBalancer", loader="the prepared dataloader", fix="do this")
    message = str(refused.value)
    assert message.startswith("DPBalancer(data_parallel_group=...): the prepared dataloader is sharded over 4 ")
    assert "the data-parallel group has 2" in message and message.endswith("do this")
    shard_by(loader, slice_of_two)
    check_sharded_by(loader, slice_of_two, owner="DPBalancer", loader="it", fix="")  # sharded by index: accepted


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


def test_dispatch_follows_accelerate_s_loader_type_else_its_flag_else_the_dataset_kind():
    from accelerate import Accelerator, DataLoaderConfiguration

    plain = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    stream = torch.utils.data.DataLoader(_Stream(), batch_size=2)
    flag = lambda value: types.SimpleNamespace(dispatch_batches=value)  # noqa: E731 - the accelerator's one fact
    assert [dispatches_batches(plain, flag(None)), dispatches_batches(stream, flag(None))] == [False, True]
    assert [dispatches_batches(plain, flag(True)), dispatches_batches(stream, flag(False))] == [True, False]
    dispatching = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    dispatcher = dispatching.prepare_data_loader(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    assert type(dispatcher).__name__ == "DataLoaderDispatcher" and dispatches_batches(dispatcher, flag(False))
    shard = Accelerator(cpu=True).prepare(torch.utils.data.DataLoader(list(range(8)), batch_size=2))
    assert not dispatches_batches(shard, flag(True))  # prepared already, and not a dispatcher: sharded as it is
