"""The data-parallel group: which processes may trade samples, and the side gloo groups over them.

Only the data-parallel dimension is rebalanced. Under a device mesh with tensor,
context or sequence parallel dimensions, the processes of one tp/cp/sp slice form one data-parallel
group; each slice runs its own exchange over its own group, and since the plan is a pure function of
the gathered metadata, peers that share a data-parallel index receive byte-identical batches.

`DataParallelGroup.from_mesh` reads every group from the mesh itself (no communication), so it also
knows every other slice (`slices`); `from_process_group` takes one explicit group and knows only its
own. The side groups over it are made by `runtime.side_channel.SideChannel`: where every slice is known,
every process takes part in making each slice's group (names that never repeat in a process); where
not, each slice makes its own with local synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Tuple

# Mesh dimensions that carry data parallelism (accelerate's ParallelismConfig names, plus the
# flattened "dp" and the common plain names); every other dimension (tp, cp, sp, ...) gets the same batch.
DATA_PARALLEL_DIMS = ("dp", "dp_replicate", "dp_shard", "ddp", "fsdp", "data", "data_parallel")
_FLATTENED = ("dp",)  # accelerate flattens dp_replicate x dp_shard into "dp"; never count both


@dataclass(frozen=True)
class DataParallelGroup:
    """This process's data-parallel group: the global ranks in data-parallel order, and its position."""

    ranks: Tuple[int, ...]   # global ranks, index = data-parallel index
    index: int               # this process's data-parallel index
    # Every data-parallel group of the job (this one included), in an order every process derives alike;
    # empty where only this group is known (an explicit process group that is not the whole world).
    slices: Tuple[Tuple[int, ...], ...] = field(default=(), compare=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def world(cls) -> "DataParallelGroup":
        """Every process is a data-parallel rank (no mesh)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return cls((0,), 0, ((0,),))
        ranks = tuple(range(dist.get_world_size()))
        return cls(ranks, dist.get_rank(), (ranks,))

    @classmethod
    def from_ranks(cls, ranks: Sequence[int], rank: int) -> "DataParallelGroup":
        ranks = tuple(int(r) for r in ranks)
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the data-parallel group {list(ranks)}")
        return cls(ranks, ranks.index(rank))

    @classmethod
    def from_process_group(cls, group) -> "DataParallelGroup":
        import torch.distributed as dist

        return cls.from_ranks(dist.get_process_group_ranks(group), dist.get_rank())

    @classmethod
    def from_mesh(cls, mesh, dims: Sequence[str] = ()) -> "DataParallelGroup":
        """The group along the mesh's data-parallel dimensions (`dims`, or those named in DATA_PARALLEL_DIMS).

        A 1-D mesh is taken as the data-parallel group itself. Data-parallel index: row-major over the
        data-parallel dimensions in mesh order (dp_replicate outer, dp_shard inner), as accelerate shards.
        """
        import torch.distributed as dist

        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        grid = mesh.mesh
        if grid.dim() == 1:
            group = cls.from_ranks(grid.tolist(), dist.get_rank())
            return cls(group.ranks, group.index, (group.ranks,) if group.size == dist.get_world_size() else ())
        dims = tuple(dims) or data_parallel_dims(names)
        if not dims:
            raise ValueError(f"device mesh with dimensions {names} has no data-parallel dimension "
                             f"(one of {DATA_PARALLEL_DIMS}); pass data_parallel_group= explicitly")
        axes = [names.index(d) for d in dims]
        rest = [a for a in range(grid.dim()) if a not in axes]
        dp_size = 1
        for a in axes:
            dp_size *= int(grid.shape[a])
        rows = grid.permute(*rest, *axes).reshape(-1, dp_size)  # one row per data-parallel group
        me = dist.get_rank()
        slices = tuple(tuple(int(r) for r in row) for row in rows.tolist())
        for row in slices:
            if me in row:
                return cls(row, row.index(me), slices)
        raise ValueError(f"rank {me} is not in the device mesh {grid.tolist()}")


def _from_sub_mesh(sub) -> DataParallelGroup:
    """The group of a 1-D mesh; when it was sliced from a larger mesh (`mesh["dp"]`), read along that dimension
    of the root mesh, so every slice is known (`DataParallelGroup.slices`)."""
    root = sub._get_root_mesh() if hasattr(sub, "_get_root_mesh") else None
    names = tuple(getattr(sub, "mesh_dim_names", None) or ())
    if root is not None and root is not sub and root.mesh.dim() > 1 and names and \
            all(n in (getattr(root, "mesh_dim_names", None) or ()) for n in names):
        group = DataParallelGroup.from_mesh(root, names)
        if group.ranks == tuple(int(r) for r in sub.mesh.tolist()):
            return group
    return DataParallelGroup.from_mesh(sub)


def data_parallel_dims(names: Sequence[str]) -> Tuple[str, ...]:
    """The data-parallel dimension names among a mesh's `names` (the flattened "dp" alone when present)."""
    names = tuple(names)
    flat = [d for d in _FLATTENED if d in names]
    if flat:
        return tuple(flat)
    return tuple(d for d in names if d in DATA_PARALLEL_DIMS)


def resolve_data_parallel_group(accelerator: Any = None, explicit: Any = None) -> DataParallelGroup:
    """The data-parallel group: `explicit` (a ProcessGroup, a 1-D DeviceMesh or a DataParallelGroup), else
    the accelerator's device mesh (its dp_replicate x dp_shard dimensions), else every process."""
    if isinstance(explicit, DataParallelGroup):
        return explicit
    if explicit is not None:
        if hasattr(explicit, "mesh") and hasattr(explicit, "mesh_dim_names"):
            if explicit.mesh.dim() != 1:
                raise ValueError(f"data_parallel_group: a {explicit.mesh.dim()}-D DeviceMesh; pass its data-parallel "
                                 f"dimension (mesh['dp']) or a ProcessGroup")
            return _from_sub_mesh(explicit)
        return DataParallelGroup.from_process_group(explicit)
    mesh = getattr(accelerator, "torch_device_mesh", None) if accelerator is not None else None
    if mesh is not None:
        pc = getattr(accelerator, "parallelism_config", None)
        dims = tuple(getattr(pc, "dp_dim_names", ()) or ()) if pc is not None else ()
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if "dp" in names:
            dims = ("dp",)
        elif not dims:
            dims = data_parallel_dims(names)
        return DataParallelGroup.from_mesh(mesh, dims)
    return DataParallelGroup.world()


__all__ = ["DATA_PARALLEL_DIMS", "DataParallelGroup", "data_parallel_dims", "resolve_data_parallel_group"]
