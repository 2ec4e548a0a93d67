"""Differentiable uneven all_to_all of row tensors (vision inputs / embeddings between ranks).

Our own autograd Function on `torch.distributed.all_to_all_single`: the backward is the reverse
all_to_all, so gradients return to the rows' owners (works on gloo and NCCL). Both directions wait for
the collective at most `timeout_s` (`wait_for`, also used by the vision path's other collectives); the
backward raises `ExchangeError` naming the exchange (`where`) when it fails.
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch

from hf_dp_balance.runtime.exchange import ExchangeError, is_distributed_error


class CollectiveFailure(RuntimeError):
    """A posted collective failed or did not end within its timeout: a peer died, hung or failed (never this
    rank's own error; gloo's timed wait says only "Operation timed out!")."""


def wait_for(work, timeout_s: Optional[float]) -> None:
    """Wait for a posted collective (`async_op=True`) at most `timeout_s` (None: the group's own timeout); any
    failure raises `CollectiveFailure`. A timed wait blocks the calling thread until the collective ends, on
    NCCL too: a failure then raises here rather than in the backend's watchdog."""
    try:
        if timeout_s is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=float(timeout_s)))
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises, the collective did not complete
        raise CollectiveFailure(f"{type(exc).__name__}: {exc}") from exc


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` says a collective failed (a `CollectiveFailure`, or a torch.distributed error), as opposed
    to an error of this rank's own code."""
    return isinstance(exc, CollectiveFailure) or is_distributed_error(exc)


def _exchange(out: torch.Tensor, rows: torch.Tensor, out_counts, in_counts, group, timeout_s: Optional[float]):
    """One uneven all_to_all_single into `out`, waited for at most `timeout_s` (`wait_for`)."""
    import torch.distributed as dist

    wait_for(dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=out_counts,
                                    input_split_sizes=in_counts, group=group, async_op=True), timeout_s)


def named_failure(where: str, timeout_s: Optional[float], exc: Exception) -> ExchangeError:
    """The error of a collective at `where`: the collective's failure (a peer died, hung or failed) or this
    rank's own error, each named as such."""
    limit = f"timeout {timeout_s:g}s; " if timeout_s is not None else ""
    if not is_collective_failure(exc):
        return ExchangeError(f"{where}: failed on this rank: {type(exc).__name__}: {exc}")
    return ExchangeError(f"{where}: collective failed ({limit}a peer died, hung or failed): {exc}")


class _AllToAllRows(torch.autograd.Function):
    """Uneven all_to_all of rows whose backward is the reverse all_to_all (gradients return to the owners).

    Our own, on `torch.distributed.all_to_all_single`: `torch.distributed.nn.functional.all_to_all_single`
    is deprecated since torch 2.13 (a FutureWarning on every call) and its replacement is private.
    """

    @staticmethod
    def forward(ctx, tensor, send_counts, recv_counts, group, where, timeout_s):
        ctx.send_counts, ctx.recv_counts, ctx.group, ctx.where = send_counts, recv_counts, group, where
        ctx.timeout_s = timeout_s
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        _exchange(out, tensor, recv_counts, send_counts, group, timeout_s)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.send_counts), *grad_out.shape[1:]))
        try:
            _exchange(grad_in, grad_out, ctx.send_counts, ctx.recv_counts, ctx.group, ctx.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the backward runs far from the forward: say which exchange it was
            raise named_failure(ctx.where or "all_to_all_rows backward", ctx.timeout_s, exc) from exc
        return grad_in, None, None, None, None, None


def all_to_all_rows(tensor: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group=None,
                    where: str = "", timeout_s: Optional[float] = None) -> torch.Tensor:
    """Rows [n, ...] split by `send_counts` (rows per destination rank) -> rows received, by source rank.

    Differentiable: the backward pass is the reverse all_to_all (gradients go
    back to the rows' owners; works on gloo). Counts must agree pairwise across
    ranks (send_counts[j] on rank i == recv_counts[i] on rank j). Every rank of
    the group must call it (also in backward, which autograd guarantees when
    every rank's output takes part in its loss). Each direction waits at most `timeout_s` (None: the
    group's timeout); a failure there raises `ExchangeError` naming the exchange by `where`.
    """
    import torch.distributed as dist

    send_counts = [int(c) for c in send_counts]
    recv_counts = [int(c) for c in recv_counts]
    world = dist.get_world_size(group)
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"send_counts / recv_counts need one entry per rank of the group ({world})")
    if sum(send_counts) != tensor.shape[0]:
        raise ValueError(f"send_counts sum to {sum(send_counts)} but the tensor has {tensor.shape[0]} rows")
    return _AllToAllRows.apply(tensor, send_counts, recv_counts, group, where, timeout_s)


__all__ = ["CollectiveFailure", "all_to_all_rows", "is_collective_failure", "named_failure", "wait_for"]
