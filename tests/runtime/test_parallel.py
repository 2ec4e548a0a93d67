"""The data-parallel group: from a device mesh (tp / cp / sp peers share a group index, never a group),
from an explicit ProcessGroup or 1-D mesh; side groups over it carry collectives of that group only."""

import pytest

from hf_dp_balance.runtime.parallel import DataParallelGroup, data_parallel_dims
from hf_dp_balance.testing.spawn import run_ranks


def test_data_parallel_dims_are_the_dp_dimensions_only():
    assert data_parallel_dims(("dp_replicate", "dp_shard", "cp", "tp")) == ("dp_replicate", "dp_shard")
    assert data_parallel_dims(("dp", "tp")) == ("dp",)
    assert data_parallel_dims(("tp", "cp", "sp")) == ()


def test_from_ranks_needs_this_rank_in_the_group():
    assert DataParallelGroup.from_ranks([1, 3], 3) == DataParallelGroup((1, 3), 1)
    with pytest.raises(ValueError, match="not in the data-parallel group"):
        DataParallelGroup.from_ranks([1, 3], 0)


def _groups(rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.runtime.parallel import resolve_data_parallel_group

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    three = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    cp_outer = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "dp_shard"))
    out = {"mesh": DataParallelGroup.from_mesh(mesh), "one_d": resolve_data_parallel_group(None, mesh["dp"]),
           "three": DataParallelGroup.from_mesh(three), "cp_outer": DataParallelGroup.from_mesh(cp_outer)}
    # the mesh accelerate builds from a ParallelismConfig (its Accelerator refuses one on CPU, so only the
    # accelerator is stood in for: mesh and config are accelerate's own)
    from accelerate.parallelism_config import ParallelismConfig

    class AcceleratorOnCpu:
        parallelism_config = ParallelismConfig(dp_shard_size=2, tp_size=2)
        torch_device_mesh = parallelism_config.build_device_mesh("cpu")

    out["accelerator"] = resolve_data_parallel_group(AcceleratorOnCpu())
    group = DataParallelGroup.from_process_group(mesh["dp"].get_group())
    from hf_dp_balance.runtime.side_channel import new_side_group

    side = new_side_group(group, 30)
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=side)  # sums over this dp group only
    out["pg"], out["sum"] = group, float(value)
    return out


def test_groups_from_meshes_and_process_groups_on_four_ranks():
    out = run_ranks(_groups, 4, timeout=90, pg_timeout_s=40)
    # mesh [[0, 1], [2, 3]] as (dp, tp): the dp groups are the columns, tp peers share the index
    assert [o["mesh"] for o in out] == [DataParallelGroup((0, 2), 0), DataParallelGroup((1, 3), 0),
                                        DataParallelGroup((0, 2), 1), DataParallelGroup((1, 3), 1)]
    assert [o["one_d"] for o in out] == [o["mesh"] for o in out] == [o["pg"] for o in out]
    assert [o["three"] for o in out] == [o["mesh"] for o in out]  # dp_replicate x dp_shard, size-1 replicate
    assert [o["accelerator"] for o in out] == [o["mesh"] for o in out]  # accelerate's (dp_shard, tp) mesh
    # (cp, dp_shard): cp peers 0/2 and 1/3 share an index; each cp slice is a dp group
    assert [o["cp_outer"].ranks for o in out] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [o["sum"] for o in out] == [2.0, 4.0, 2.0, 4.0]


def _sub_mesh_slices(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.runtime.parallel import resolve_data_parallel_group

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    group = resolve_data_parallel_group(None, mesh["dp"])
    return group.ranks, group.index, group.slices


def test_a_sliced_mesh_dimension_knows_every_slice():
    from hf_dp_balance.testing.spawn import run_ranks

    out = run_ranks(_sub_mesh_slices, 4, timeout=90)
    assert [o[:2] for o in out] == [((0, 2), 0), ((1, 3), 0), ((0, 2), 1), ((1, 3), 1)]
    assert all(o[2] == ((0, 2), (1, 3)) for o in out)  # so every process can take part in every slice's group
