"""One planning rank per step: the orders it sends each rank, and what a rank makes of its own orders.

The planning rank holds every rank's metadata rows of the step (nobody else does), plans once, and sends
each rank only what concerns it (`StepOrders`): the samples it trains and their slots, its samples that
leave and where to, and the samples that arrive, their holder and size. Sizes travel in the orders, so
both ends of every payload transfer know its length and its pair before it starts (no size handshake).
Building every rank's orders is one sort of the step's samples: O(N log N) on the planning rank, O(what
a rank touches) everywhere else.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from hf_dp_balance.core.codec import TransferLayout
from hf_dp_balance.runtime.exchange import (O_AFTER, O_APPLIED, O_BEFORE, O_MOVED, O_MOVED_BYTES, O_NUM_MICRO,
                                            O_NUM_SAMPLES, O_OFFSET, O_WIDTH, StepOrders)


def orders_for_ranks(holders: np.ndarray, dest_rank: np.ndarray, dest_micro: np.ndarray, nbytes: np.ndarray,
                     world: int, num_micro: int, stats: Tuple[bool, float, float], text: str) -> List[StepOrders]:
    """Every rank's `StepOrders` of one plan (samples in ascending global index, rank-major by holder).

    Guarantees: each sample appears in exactly one rank's `in_index` (its destination), and a moving sample
    in its holder's `out_index` and its destination's `recv_index`, both in ascending global index, so
    sender and receiver agree on the order of the bytes between them. `stats`: (applied, imbalance before,
    after) of the step, copied into every header with the moved count and bytes.
    """
    holders = np.asarray(holders, dtype=np.int64)
    dest_rank = np.asarray(dest_rank, dtype=np.int64)
    dest_micro = np.asarray(dest_micro, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    n = holders.size
    index = np.arange(n, dtype=np.int64)
    moved = holders != dest_rank
    offsets = np.concatenate([[0], np.cumsum(np.bincount(holders, minlength=world))])

    def split_by(keys, sel):
        """Indices of `sel` grouped by `keys` (stable: ascending global index within a group), and group bounds."""
        idx = index[sel]
        order = idx[np.argsort(keys[sel], kind="stable")]
        bounds = np.concatenate([[0], np.cumsum(np.bincount(keys[sel], minlength=world))])
        return order, bounds

    landing, land_at = split_by(dest_rank, np.ones(n, dtype=bool))
    arriving, arrive_at = split_by(dest_rank, moved)
    leaving = index[moved]  # rank-major by holder already: holder groups are contiguous
    leave_at = np.concatenate([[0], np.cumsum(np.bincount(holders[moved], minlength=world))])
    applied, before, after = stats
    out = []
    for r in range(world):
        head = np.zeros(O_WIDTH, dtype=np.float64)
        head[O_NUM_MICRO], head[O_NUM_SAMPLES], head[O_OFFSET] = num_micro, n, offsets[r]
        head[O_APPLIED], head[O_BEFORE], head[O_AFTER] = float(applied), before, after
        head[O_MOVED], head[O_MOVED_BYTES] = int(moved.sum()), int(nbytes[moved].sum())
        ins = landing[land_at[r]: land_at[r + 1]]
        outs = leaving[leave_at[r]: leave_at[r + 1]]
        recv = arriving[arrive_at[r]: arrive_at[r + 1]]
        out.append(StepOrders(head, ins, dest_micro[ins], outs, dest_rank[outs], recv, holders[recv], nbytes[recv],
                              text))
    return out


def local_layout(orders: StepOrders, local_nbytes: np.ndarray, world: int) -> TransferLayout:
    """This rank's `TransferLayout` from its orders: sizes of its own samples from its rows, of the others' from
    the orders (`local_nbytes[i]`: encoded size of this rank's sample of global index offset + i)."""
    offset = int(orders.head[O_OFFSET])
    empty = np.zeros(0, dtype=np.int64)
    send, recv = [empty] * world, [empty] * world
    send_splits, recv_splits = [0] * world, [0] * world
    for r in np.unique(orders.out_dest).tolist():  # only the peers this rank trades with: O(its samples)
        send[r] = orders.out_index[orders.out_dest == r]
        send_splits[r] = int(local_nbytes[send[r] - offset].sum())
    for r in np.unique(orders.recv_src).tolist():
        sel = orders.recv_src == r
        recv[r], recv_splits[r] = orders.recv_index[sel], int(orders.recv_bytes[sel].sum())
    return TransferLayout(tuple(send), tuple(recv), tuple(send_splits), tuple(recv_splits))


def slots_of(orders: StepOrders, num_micro: int) -> List[List[int]]:
    """Global indices of the samples each of this rank's slots trains, ascending within a slot."""
    members: List[List[int]] = [[] for _ in range(num_micro)]
    for g, m in zip(orders.in_index.tolist(), orders.in_slot.tolist()):
        members[m].append(g)
    return members


__all__ = ["orders_for_ranks", "local_layout", "slots_of"]
