"""Dispatch mode: data-parallel rank 0 reads each step's global batch, plans it, and sends every rank its samples.

The balanced counterpart of accelerate's `DataLoaderDispatcher` (`dispatch_batches=True`, the default
for iterable and streaming datasets): only rank 0 iterates the data. Per optimizer step it pulls
GA x ranks raw micro-batches (micro-batch m of rank r is raw batch m * ranks + r, the dispatcher's
slicing), describes and costs every sample as `BalancedLoader` does, plans the step from that
placement (the unbalanced start), and sends each rank exactly its planned samples: one header
broadcast, then one point-to-point message pair per rank. No all_to_all, and no rank receives
samples it does not train (the stock dispatcher broadcasts the whole global batch to everyone).

Guarantees as `BalancedLoader`: every sample of a step is trained exactly once; within a slot samples
keep ascending global index; every rank gets the same number of micro-batches per step; a planning
failure keeps the start placement. Look-ahead is not supported here (`lookahead_steps` is ignored).
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, List, Optional

import numpy as np
import torch

from hf_dp_balance.core.codec import decode_sample, encode_sample
from hf_dp_balance.runtime.exchange import ExchangeError
from hf_dp_balance.runtime.loader import BalancedLoader, slot_loads, step_imbalance
from hf_dp_balance.runtime.step_rows import (F_COST, F_MICRO, F_NBYTES, F_WIDTH, Prepared, StepStats, StepWork,
                                             pull_micro_batches)
from hf_dp_balance.runtime.logs import get_logger

logger = get_logger(__name__)

# Header broadcast by rank 0 each step (float64): then per rank its sample count, then its payload bytes.
D_STATUS, D_NUM_MICRO, D_NUM_SAMPLES, D_APPLIED, D_BEFORE, D_AFTER, D_MOVED, D_MOVED_BYTES, D_WIDTH = range(9)
STATUS_OK, STATUS_END, STATUS_FAILED = 0, 1, 2


class DispatchedLoader(BalancedLoader):
    """`BalancedLoader` whose data is read on data-parallel rank 0 only (see the module docstring).

    Same constructor and interface (`iter_steps`, `set_cost_model`, `pop_stats`, `close`); the
    iterator given to `iter_steps` is read on rank 0 only, and yields per-process raw batches.
    """

    dispatches = True  # a resume state records it: the raw order differs from a per-rank loader's

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._start_ranks: Optional[np.ndarray] = None  # thread-only: start rank of the prepared step's samples

    @property
    def raw_batches_per_micro(self) -> int:
        """Raw batches rank 0 reads per micro-batch slot: one per data-parallel rank (a resume skips as many)."""
        return int(self._exchange.world_size)

    @property
    def is_source(self) -> bool:
        return self._exchange.rank == 0

    def open_stream(self, raw_iterator: Iterator, step_limit: Optional[int] = None):
        # only rank 0 reads data; the stream's first pull elsewhere takes a placeholder
        return super().open_stream(raw_iterator if self.is_source else iter([None]), step_limit)

    def prepare_step(self, step: int, pull: Callable[[], Optional[list]]) -> Prepared:
        """Rank 0: the step's global batch as GA micro-batches of all ranks' raw batches; else nothing."""
        if not self.is_source:
            return Prepared([], [], [], np.zeros((0, F_WIDTH)), model_version=None)
        world, sizes = self._exchange.world_size, []

        def pull_global():  # one micro-batch slot of every rank, as the dispatcher slices it
            parts = pull_micro_batches(step, pull, world, 0)
            if not parts:
                return None
            sizes.append([len(p) for p in parts])
            return [s for p in parts for s in p]

        prep = super().prepare_step(step, pull_global)
        self._start_ranks = np.concatenate([np.repeat(np.arange(len(sz)), sz) for sz in sizes]).astype(np.int64) \
            if sizes else np.zeros(0, dtype=np.int64)
        return prep

    def run_step(self, step: int, prep: Optional[Prepared], error: Optional[str]):
        """Rank 0 plans and sends; every rank receives its samples and packs its slots."""
        ex = self._exchange
        t0 = time.perf_counter()
        if error is not None and not self.is_source:  # rank 0 meets the failure as a timeout of its next send
            raise ExchangeError(f"hf_dp_balance dispatch, step {step}, rank {ex.rank}: {error}")
        if self.is_source:
            head, plan = self._plan_and_send(step, prep, error)
        else:
            head, plan = self._broadcast_header(step, None), None
        if int(head[D_STATUS]) == STATUS_FAILED:
            raise ExchangeError(f"hf_dp_balance dispatch, step {step}: data-parallel rank 0 failed "
                                f"({error or 'see its error'})")
        num_micro = int(head[D_NUM_MICRO])
        if int(head[D_STATUS]) == STATUS_END or num_micro == 0:
            return None
        t1 = time.perf_counter()
        mine = plan if plan is not None else self._receive(step, head)
        t2 = time.perf_counter()
        by_slot: List[list] = [[] for _ in range(num_micro)]
        for index, slot, sample in mine:
            by_slot[slot].append((index, sample))
        batches, ids = [], [] if self.id_key else None
        for m, members in enumerate(by_slot):
            members.sort(key=lambda item: item[0])  # ascending global index, whatever the plan
            slot = [s for _, s in members]
            if ids is not None:
                ids.append([s.get(self.id_key) for s in slot])
            batches.append(self.collator(slot))
        local_bytes = int(head[D_WIDTH + ex.world_size + ex.rank])
        stats = StepStats(
            step=step, num_micro_batches=num_micro, num_samples=int(head[D_NUM_SAMPLES]),
            applied=bool(head[D_APPLIED]), reason="dispatch", imbalance_before=float(head[D_BEFORE]),
            imbalance_after=float(head[D_AFTER]), moved_samples=int(head[D_MOVED]),
            moved_bytes=int(head[D_MOVED_BYTES]), bytes_sent=0 if ex.rank else int(head[D_WIDTH + ex.world_size:].sum()),
            bytes_received=0 if ex.rank == 0 else local_bytes, plan_hash="", gather_s=t1 - t0, plan_s=0.0,
            exchange_s=t2 - t1, collate_s=time.perf_counter() - t2, local_samples=[len(s) for s in by_slot],
            local_ids=ids)
        return batches, stats

    def _broadcast_header(self, step: int, head: Optional[np.ndarray]) -> np.ndarray:
        import torch.distributed as dist

        ex = self._exchange
        t = torch.from_numpy(head) if head is not None else torch.zeros(D_WIDTH + 2 * ex.world_size, dtype=torch.float64)
        ex._run(step, "dispatch header broadcast", lambda: dist.broadcast(t, group=ex.group, group_src=0))
        return t.numpy()

    def _plan_and_send(self, step: int, prep: Optional[Prepared], error: Optional[str]):
        """Rank 0: plan the global batch, broadcast the header, send each rank its samples.

        Returns (header, this rank's [(global index, slot, sample)])."""
        import torch.distributed as dist

        ex, world = self._exchange, self._exchange.world_size
        head = np.zeros(D_WIDTH + 2 * world, dtype=np.float64)
        if error is not None or prep is None:
            head[D_STATUS] = STATUS_FAILED
            return self._broadcast_header(step, head), None
        num_micro = len(prep.micro_batches)
        if num_micro == 0:
            head[D_STATUS] = STATUS_END
            return self._broadcast_header(step, head), None
        rows, start = prep.rows, self._start_ranks
        micro = rows[:, F_MICRO].astype(np.int64)
        balance = prep.model_version is not None and self._balancing and self.config.enabled
        work = StepWork(step, rows, start, start, micro, num_micro, prep.samples, prep.entries)
        # only rank 0 plans here, so a planner failure needs no agreement: it keeps every sample in place
        dest_rank, dest_micro, applied, reason, failure = self._plan(work, balance, np.ones(world))
        if failure is not None:
            logger.warning("hf_dp_balance: step %d: %s; every sample stays in place", step, reason)
        moved = dest_rank != start
        costs = rows[:, F_COST]
        head[D_NUM_MICRO], head[D_NUM_SAMPLES], head[D_APPLIED] = num_micro, rows.shape[0], float(applied)
        head[D_BEFORE] = step_imbalance(slot_loads(costs, start, micro, world, num_micro), self.sync)
        head[D_AFTER] = step_imbalance(slot_loads(costs, dest_rank, dest_micro, world, num_micro), self.sync)
        head[D_MOVED], head[D_MOVED_BYTES] = int(moved.sum()), int(rows[moved, F_NBYTES].sum())
        outgoing = []
        for r in range(world):
            idx = np.flatnonzero(dest_rank == r)
            head[D_WIDTH + r] = idx.size
            head[D_WIDTH + world + r] = int(rows[idx, F_NBYTES].sum()) if r else 0
            outgoing.append(idx)
        self._broadcast_header(step, head)
        for r in range(1, world):
            idx = outgoing[r]
            meta = torch.from_numpy(np.stack([idx, dest_micro[idx], rows[idx, F_NBYTES].astype(np.int64)]).reshape(-1)
                                    .astype(np.int64))
            payload = (torch.cat([encode_sample(prep.samples[i], f"step {step}, sample {i}", prep.entries[i])
                                  for i in idx]) if idx.size else torch.empty(0, dtype=torch.uint8))
            ex._run(step, f"dispatch send to rank {r}", lambda: (dist.send(meta, group=ex.group, group_dst=r),
                                                                 dist.send(payload, group=ex.group, group_dst=r)))
        keep = outgoing[0]
        return head, [(int(i), int(dest_micro[i]), prep.samples[i]) for i in keep]

    def _receive(self, step: int, head: np.ndarray):
        """Ranks > 0: this rank's samples from rank 0, as [(global index, slot, sample)]."""
        import torch.distributed as dist

        ex = self._exchange
        n = int(head[D_WIDTH + ex.rank])
        nbytes = int(head[D_WIDTH + ex.world_size + ex.rank])
        meta = torch.empty(3 * n, dtype=torch.int64)
        payload = torch.empty(nbytes, dtype=torch.uint8)
        ex._run(step, "dispatch receive", lambda: (dist.recv(meta, group=ex.group, group_src=0),
                                                   dist.recv(payload, group=ex.group, group_src=0)))
        index, slot, size = meta.reshape(3, n).tolist() if n else ([], [], [])
        out, pos = [], 0
        for g, m, s in zip(index, slot, size):
            out.append((g, m, decode_sample(payload[pos: pos + s], f"step {step}, sample {g} from rank 0")))
            pos += s
        return out


__all__ = ["DispatchedLoader"]
