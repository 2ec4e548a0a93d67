"""Differentiable uneven all_to_all of row tensors (vision inputs / embeddings between ranks).

Our own autograd Function on `torch.distributed.all_to_all_single`: the backward is the reverse
all_to_all, so gradients return to the rows' owners (works on gloo and NCCL).
"""

from __future__ import annotations

from typing import Sequence

import torch


class _AllToAllRows(torch.autograd.Function):
    """Uneven all_to_all of rows whose backward is the reverse all_to_all (gradients return to the owners).

    Our own, on `torch.distributed.all_to_all_single`: `torch.distributed.nn.functional.all_to_all_single`
    is deprecated since torch 2.13 (a FutureWarning on every call) and its replacement is private.
    """

    @staticmethod
    def forward(ctx, tensor, send_counts, recv_counts, group, where):
        import torch.distributed as dist

        ctx.send_counts, ctx.recv_counts, ctx.group, ctx.where = send_counts, recv_counts, group, where
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import torch.distributed as dist

        grad_in = grad_out.new_empty((sum(ctx.send_counts), *grad_out.shape[1:]))
        try:
            dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=ctx.send_counts,
                                   input_split_sizes=ctx.recv_counts, group=ctx.group)
        except RuntimeError as exc:  # the backward runs far from the forward: say which exchange it was
            raise RuntimeError(f"{ctx.where or 'all_to_all_rows backward'}: collective failed (a peer died, hung "
                               f"or failed): {exc}") from exc
        return grad_in, None, None, None, None


def all_to_all_rows(tensor: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group=None,
                    where: str = "") -> torch.Tensor:
    """Rows [n, ...] split by `send_counts` (rows per destination rank) -> rows received, by source rank.

    Differentiable: the backward pass is the reverse all_to_all (gradients go
    back to the rows' owners; works on gloo). Counts must agree pairwise across
    ranks (send_counts[j] on rank i == recv_counts[i] on rank j). Every rank of
    the group must call it (also in backward, which autograd guarantees when
    every rank's output takes part in its loss). `where` names the exchange in a backward failure.
    """
    import torch.distributed as dist

    send_counts = [int(c) for c in send_counts]
    recv_counts = [int(c) for c in recv_counts]
    world = dist.get_world_size(group)
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"send_counts / recv_counts need one entry per rank of the group ({world})")
    if sum(send_counts) != tensor.shape[0]:
        raise ValueError(f"send_counts sum to {sum(send_counts)} but the tensor has {tensor.shape[0]} rows")
    return _AllToAllRows.apply(tensor, send_counts, recv_counts, group, where)


__all__ = ["all_to_all_rows"]
