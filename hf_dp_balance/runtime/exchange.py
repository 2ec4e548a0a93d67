"""Cross-rank sample exchange over a side gloo process group: metadata, agreements, payloads.

`SampleExchange` owns one side gloo group (never the training group, so it may run in a background
thread). Per step: every rank sends its metadata rows to one planning rank (`send_rows` / `collect_rows`),
which sends each rank only its own orders (`send_orders` / `receive_orders`); payloads travel point to
point between the pairs that trade (`exchange_payloads`); whether every rank packed its step is agreed
through the planning rank (`raise_if_failed`), plan digests with one fixed-size `all_reduce` (`agree`).
Look-ahead windows still gather every rank's rows to every rank (`gather_metadata`). A rank that failed
locally makes every rank raise `ExchangeError` at once, and any transfer that fails or times out raises
`ExchangeError` naming the step, the phase and the ranks that reported a failure. Encoding and split
sizes: `core.codec`. Details: docs/exchange.md.
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from hf_dp_balance.core.codec import (PayloadError, SampleEntry, TransferLayout, decode_received, encode_sample,
                                      sample_entries)


class ExchangeError(RuntimeError):
    """A collective of the sample exchange failed, or a rank reported a failure; names step and ranks."""


# Text by which a plain RuntimeError is known to come from a torch.distributed backend or its store.
_BACKEND_MARKERS = ("gloo", "nccl", "NCCL", "ProcessGroup", "c10d", "TCPStore", "Connection reset by peer",
                    "Connection closed by peer")


def is_distributed_error(exc: BaseException) -> bool:
    """Whether `exc` is a torch.distributed failure: a `DistError` (or subclass), or a RuntimeError whose
    text comes from gloo / NCCL / the store. The library's own errors (they say "hf_dp_balance") are not."""
    text = str(exc)
    if isinstance(exc, ExchangeError) or "hf_dp_balance" in text.split("\n", 1)[0]:
        return False
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(marker in text for marker in _BACKEND_MARKERS)


def failure_detail(failed: Mapping[int, str]) -> str:
    """"rank 1: msg; rank 3: msg" of {rank: message}, by rank: how every error of the runtime lists its ranks."""
    return "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))


def differing_ranks(digests: np.ndarray) -> List[int]:
    """The ranks whose plan digest differs from the majority's (a tie: rank 0's plan is the reference)."""
    values, counts = np.unique(digests, return_counts=True)
    top = np.flatnonzero(counts == counts.max())
    reference = values[top[0]] if top.size == 1 else digests[0]
    return np.flatnonzero(digests != reference).tolist()


# Fixed header every rank contributes to the first gather of a step.
H_STATUS, H_NUM_SAMPLES, H_NUM_MICRO, H_FLAGS, H_SPEED, H_WIDTH = range(6)
_MSG_BYTES = 512  # a failed rank's message, in the one all_gather that follows a failed agreement
# The rank of the exchange group that plans each step (`collect_rows` / `send_orders`).
PLANNER = 0
# Point-to-point tags: gloo keys collectives by their own prefixed slots, so these never meet a collective.
(TAG_HEADER, TAG_ROWS, TAG_MESSAGE, TAG_ORDERS_HEAD, TAG_ORDERS_BODY, TAG_PAYLOAD, TAG_FLAG, TAG_FLAG_MESSAGE,
 TAG_VERDICT, TAG_VERDICT_BODY) = range(1, 11)
# Orders header (float64, exact for integers below 2**53) the planning rank sends each rank per step.
(O_STATUS, O_NUM_MICRO, O_NUM_SAMPLES, O_OFFSET, O_N_IN, O_N_OUT, O_N_RECV, O_TEXT, O_APPLIED, O_BEFORE, O_AFTER,
 O_MOVED, O_MOVED_BYTES, O_WIDTH) = range(14)
STATUS_OK, STATUS_END, STATUS_FAILED = 0, 1, 2
_STORE_PREFIX = "exchange_failed"  # one key per run: every failed rank appends its line
_STORE_DEADLINE_S = 2.0  # the failure notes are best effort: a stopped store host must not hold the error


def failure_message(error: Optional[str]) -> torch.Tensor:
    """A rank's entry in a failure all_gather: a flag byte (1: this rank failed) and its message, truncated to a
    fixed size so every rank sends the same bytes."""
    msg = torch.zeros(_MSG_BYTES + 1, dtype=torch.uint8)
    if error is not None:
        msg[0] = 1
        text = error.encode("utf-8", "replace")[:_MSG_BYTES]
        if text:
            msg[1: 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return msg


def read_failures(msgs: Sequence[torch.Tensor]) -> Dict[int, str]:
    """{rank: message} of the ranks whose gathered `failure_message` carries the flag."""
    rows = torch.stack(list(msgs)).cpu().numpy()
    return {r: row[1:].tobytes().rstrip(b"\x00").decode("utf-8", "replace") for r, row in enumerate(rows) if row[0]}


def call_with_deadline(fn, deadline_s: float, default=None):
    """`fn()` in a daemon thread, waited for at most `deadline_s`; `default` when it is late or raises.

    For waits that have no timeout of their own (a rendezvous store whose host is stopped keeps the
    socket open and never answers): the caller goes on, the stuck thread dies with the process.
    """
    box = []

    def target():
        try:
            box.append(fn())
        except Exception:  # noqa: BLE001 - best effort, the caller has the real error
            pass

    worker = threading.Thread(target=target, name="hf_dp_balance-store", daemon=True)
    worker.start()
    worker.join(deadline_s)
    return box[0] if box else default


@dataclass(frozen=True)
class GatheredMetadata:
    """Result of one step's metadata gather; identical on every rank."""

    headers: np.ndarray          # [R, H_WIDTH] float64
    rows: np.ndarray             # [N, F] float64, rank-major, each rank's rows in its local order
    owners: np.ndarray           # [N] int64 rank that holds each row's sample

    @property
    def counts(self) -> np.ndarray:
        return self.headers[:, H_NUM_SAMPLES].astype(np.int64)


class SampleExchange:
    """Collectives of the sample exchange on one side gloo group (created once, reused every step).

    Call the methods in the same order on every rank (they are collectives);
    they may run in a background thread -- but only one thread may use the
    group: other collectives (e.g. the vision exchange) need their own group. Every collective waits at most the
    group's timeout; then `ExchangeError` names the step, the phase and the
    ranks that reported a failure through the rendezvous store.
    """

    def __init__(self, timeout_s: float = 600.0, group=None, *, namespace: str = "hf_dp_balance/"):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("SampleExchange needs an initialized torch.distributed default process group")
        if group is None:
            raise ValueError("SampleExchange needs its side group (runtime.side_channel.SideChannel.exchange() "
                             "makes one); it never creates a group itself")
        self._dist = dist
        self.timeout_s = float(timeout_s)
        # A dedicated gloo group: never the training group, so it can run in a thread beside
        # training collectives, and its timeout bounds every wait of the exchange.
        self.group = group
        # Ranks are positions in the group (a data-parallel subgroup when one is given); failure notes
        # in the store are keyed by global rank, so several subgroups never overwrite each other's, and
        # by the run's namespace, so a later run never reads an earlier run's notes.
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group)
        self._store_prefix = f"{namespace}{_STORE_PREFIX}"

    # -- failure reporting -------------------------------------------------------------------
    def _store(self):
        try:
            return self._dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - best effort only
            return None

    def report_failure(self, step: int, message: str) -> None:
        """Leave a note in the rendezvous store so that peers stuck in a collective can name this rank.

        Every note of the run goes into one key (one append: a line of [global rank, note]), so reading
        them all is one round trip whatever the number of ranks."""
        store = self._store()
        if store is not None:  # the store may be gone or stopped with its host: a deadline, never a hang
            line = json.dumps([int(self._global_ranks[self.rank]), f"step {step}: {message[:300]}"]) + "\n"
            call_with_deadline(lambda: store.append(self._store_prefix, line.encode("utf-8")), _STORE_DEADLINE_S)

    def reported_failures(self) -> Dict[int, str]:
        """Ranks of this group that left a failure note ({group rank: note}; best effort: empty when the store
        is unreachable or stopped). Two store round trips (check, get) whatever the group's size; waits at most
        `_STORE_DEADLINE_S` in all, whatever the store does."""
        store = self._store()
        if store is None:
            return {}
        position = {int(g): r for r, g in enumerate(self._global_ranks)}

        def lookup():
            if not store.check([self._store_prefix]):
                return {}
            found = {}
            for line in store.get(self._store_prefix).decode("utf-8", "replace").splitlines():
                try:
                    global_rank, note = json.loads(line)
                except ValueError:
                    continue
                if int(global_rank) in position:  # notes of other slices share the key
                    found[position[int(global_rank)]] = str(note)
            return found

        return call_with_deadline(lookup, _STORE_DEADLINE_S, default={})

    def _run(self, step: int, phase: str, fn):
        try:
            return fn()
        except Exception as exc:  # gloo raises RuntimeError on timeouts and closed peers
            if not isinstance(exc, ExchangeError) and not is_distributed_error(exc):  # this rank's own code failed
                raise ExchangeError(f"hf_dp_balance sample exchange, step {step}, {phase}: failed on rank "
                                    f"{self.rank}: {type(exc).__name__}: {exc}") from exc
            failed = self.reported_failures()
            who = (", ".join(f"rank {r} ({m})" for r, m in sorted(failed.items())) if failed
                   else "no rank reported a failure (a rank died, hung or stopped iterating)")
            raise ExchangeError(
                f"hf_dp_balance sample exchange, step {step}, {phase}: collective on the side group failed "
                f"(timeout {self.timeout_s:g}s) on rank {self.rank}; failed ranks: {who}; cause: {exc}") from exc

    # -- collectives -------------------------------------------------------------------------
    def gather_metadata(self, step: int, rows: Optional[np.ndarray], *, num_micro_batches: int = 0,
                        flags: int = 0, speed: float = 1.0, error: Optional[str] = None,
                        num_fields: Optional[int] = None) -> GatheredMetadata:
        """All ranks' per-sample rows (float64 [n, F]) plus a small header, with a failure flag.

        Two all_gathers of fixed shape: the headers (counts, flags, status), then
        the rows padded to the largest count. If any rank passes `error`, every
        rank raises `ExchangeError` naming the failed ranks and their messages
        right after the first gather (one more gather fetches the messages).
        """
        dist = self._dist
        if rows is None:
            rows = np.zeros((0, num_fields or 0), dtype=np.float64)
        rows = np.ascontiguousarray(rows, dtype=np.float64)
        if rows.ndim != 2:
            raise ValueError(f"metadata rows must be 2-d [samples, fields], got shape {rows.shape}")
        header = np.zeros(H_WIDTH, dtype=np.float64)
        header[H_STATUS] = 1.0 if error is not None else 0.0
        header[H_NUM_SAMPLES] = rows.shape[0]
        header[H_NUM_MICRO] = num_micro_batches
        header[H_FLAGS] = flags
        header[H_SPEED] = speed
        mine = torch.from_numpy(header)
        heads = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run(step, "metadata header all_gather", lambda: dist.all_gather(heads, mine, group=self.group))
        headers = torch.stack(heads).numpy()

        failed = np.flatnonzero(headers[:, H_STATUS] != 0)
        if failed.size:
            detail = failure_detail(self._gather_failures(step, error))
            raise ExchangeError(f"hf_dp_balance sample exchange, step {step}: rank(s) {failed.tolist()} failed "
                                f"before the exchange: {detail}")

        counts = headers[:, H_NUM_SAMPLES].astype(np.int64)
        width = rows.shape[1]
        max_n = int(counts.max()) if counts.size else 0
        if max_n == 0:
            return GatheredMetadata(headers, np.zeros((0, width)), np.zeros(0, dtype=np.int64))
        padded = torch.zeros((max_n, width), dtype=torch.float64)
        padded[: rows.shape[0]] = torch.from_numpy(rows)
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._run(step, "metadata rows all_gather", lambda: dist.all_gather(gathered, padded, group=self.group))
        all_rows = np.concatenate([gathered[r].numpy()[: counts[r]] for r in range(self.world_size)], axis=0)
        owners = np.repeat(np.arange(self.world_size, dtype=np.int64), counts)
        return GatheredMetadata(headers, all_rows, owners)

    def agree(self, step: int, phase: str, value: int = 0, error: Optional[str] = None) -> Tuple[bool, Dict[int, str]]:
        """(whether every rank passed the same int64 `value`, {rank: message} of the ranks that passed `error`).

        One `all_reduce` (MAX) of three int64 per rank, whatever the number of ranks: [failed, value, -value];
        equal values make max(value) == -max(-value). One all_gather fetches the messages only when some rank
        failed. A rank's local failure in `phase` thus reaches every peer before the step goes on (no timeout).
        """
        value = int(value)
        vec = torch.tensor([1 if error is not None else 0, value, -value], dtype=torch.int64)
        self._run(step, f"{phase} all_reduce", lambda: self._dist.all_reduce(vec, op=self._dist.ReduceOp.MAX,
                                                                             group=self.group))
        failed = self._gather_failures(step, error) if int(vec[0]) else {}
        return int(vec[1]) == -int(vec[2]), failed

    def all_values(self, step: int, phase: str, value: int) -> np.ndarray:
        """Every rank's int64 `value` (one all_gather): only on the error path, to name the ranks that differ."""
        mine = torch.tensor([int(value)], dtype=torch.int64)
        both = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run(step, f"{phase} all_gather", lambda: self._dist.all_gather(both, mine, group=self.group))
        return torch.cat(both).numpy()

    def _gather_failures(self, step: int, error: Optional[str]) -> Dict[int, str]:
        """{rank: message} of every rank that passed `error` (one all_gather of fixed-size text, first byte a flag)."""
        msg = failure_message(error)
        msgs = [torch.empty_like(msg) for _ in range(self.world_size)]
        self._run(step, "failure message all_gather", lambda: self._dist.all_gather(msgs, msg, group=self.group))
        return read_failures(msgs)

    def raise_if_failed(self, step: int, phase: str, error: Optional[str] = None) -> None:
        """When any rank passes `error`, every rank raises `ExchangeError` naming them and their messages.

        Through the planning rank: every other rank sends it a fixed-size flag (and its message when it
        failed), the planning rank answers every rank with the failed ranks and their messages. Two hops per
        rank whatever the number of ranks (a ring all_reduce takes 2 (P - 1)); 2 (P - 1) on the planning rank.
        """
        dist = self._dist
        text = (error or "").encode("utf-8", "replace")[:_MSG_BYTES]
        if self.rank != PLANNER:
            flag = torch.tensor([1 if error is not None else 0, len(text)], dtype=torch.int64)
            ops = [partial(dist.isend, flag, group=self.group, group_dst=PLANNER, tag=TAG_FLAG)]
            if text:
                ops.append(partial(dist.isend, torch.frombuffer(bytearray(text), dtype=torch.uint8),
                                   group=self.group, group_dst=PLANNER, tag=TAG_FLAG_MESSAGE))
            self._wait(step, f"{phase} agreement send to the planning rank", ops)
            verdict = torch.empty(2, dtype=torch.int64)
            self._wait(step, f"{phase} agreement receive from the planning rank",
                       [partial(dist.irecv, verdict, group=self.group, group_src=PLANNER, tag=TAG_VERDICT)])
            body = torch.empty(8 * int(verdict[0]) + int(verdict[1]), dtype=torch.uint8)
            if body.numel():
                self._wait(step, f"{phase} agreement receive from the planning rank",
                           [partial(dist.irecv, body, group=self.group, group_src=PLANNER, tag=TAG_VERDICT_BODY)])
            raw = body.numpy().tobytes()
            failed_ranks = np.frombuffer(raw[: 8 * int(verdict[0])], dtype=np.int64).tolist()
            detail = raw[8 * int(verdict[0]):].decode("utf-8", "replace")
        else:
            failed_ranks, detail = self._judge(step, phase, error)
        if failed_ranks:
            raise ExchangeError(f"hf_dp_balance, step {step}, {phase}: rank(s) {failed_ranks} failed "
                                f"(raised on rank {self.rank}): {detail}")

    def _judge(self, step: int, phase: str, error: Optional[str]) -> Tuple[List[int], str]:
        """The planning rank's side of `raise_if_failed`: collect every flag, answer every rank alike."""
        dist = self._dist
        peers = [r for r in range(self.world_size) if r != self.rank]
        flags = {r: torch.empty(2, dtype=torch.int64) for r in peers}
        self._wait(step, f"{phase} agreement receive on the planning rank",
                   [partial(dist.irecv, flags[r], group=self.group, group_src=r, tag=TAG_FLAG) for r in peers])
        texts = {r: torch.empty(int(flags[r][1]), dtype=torch.uint8) for r in peers if int(flags[r][1])}
        self._wait(step, f"{phase} agreement receive on the planning rank",
                   [partial(dist.irecv, t, group=self.group, group_src=r, tag=TAG_FLAG_MESSAGE)
                    for r, t in texts.items()])
        failed = {r: texts[r].numpy().tobytes().decode("utf-8", "replace") if r in texts else ""
                  for r in peers if int(flags[r][0])}
        if error is not None:
            failed[self.rank] = error[:_MSG_BYTES]
        ranks, detail = sorted(failed), failure_detail(failed)
        body = np.asarray(ranks, dtype=np.int64).tobytes() + detail.encode("utf-8", "replace")
        verdict = torch.tensor([len(ranks), len(body) - 8 * len(ranks)], dtype=torch.int64)
        payload = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else None
        ops = []
        for r in peers:
            ops.append(partial(dist.isend, verdict, group=self.group, group_dst=r, tag=TAG_VERDICT))
            if payload is not None:
                ops.append(partial(dist.isend, payload, group=self.group, group_dst=r, tag=TAG_VERDICT_BODY))
        self._wait(step, f"{phase} agreement send from the planning rank", ops)
        return ranks, detail

    # -- point to point ----------------------------------------------------------------------
    def _wait(self, step: int, phase: str, ops) -> None:
        """Post the sends / receives (`ops`: unposted `partial`s of isend / irecv) and wait for each at most
        the group's timeout. Posting is inside `_run` too: gloo raises at the post when a peer has already
        closed its connection, and that failure must read like any other (step, phase, failed ranks)."""
        limit = datetime.timedelta(seconds=self.timeout_s)

        def wait_all():
            works = [op() for op in ops]
            for work in works:
                work.wait(limit)

        self._run(step, phase, wait_all)

    def send_rows(self, step: int, rows: Optional[np.ndarray], header: np.ndarray, error: Optional[str]) -> None:
        """A non-planning rank's side of `collect_rows`: its header, its rows, its failure message."""
        dist = self._dist
        head, rows_t, msg = _rows_message(rows, header, error)
        ops = [partial(dist.isend, head, group=self.group, group_dst=PLANNER, tag=TAG_HEADER)]
        if rows_t.numel():
            ops.append(partial(dist.isend, rows_t, group=self.group, group_dst=PLANNER, tag=TAG_ROWS))
        if msg.numel():
            ops.append(partial(dist.isend, msg, group=self.group, group_dst=PLANNER, tag=TAG_MESSAGE))
        self._wait(step, "metadata send to the planning rank", ops)

    def collect_rows(self, step: int, rows: Optional[np.ndarray], header: np.ndarray, error: Optional[str],
                     num_fields: int) -> Tuple[GatheredMetadata, Dict[int, str]]:
        """The planning rank's side: (every rank's header and rows, rank-major; {rank: message} of failed ranks).

        Two receives per rank (a fixed-size header, then the rows it announces) and a third from a rank that
        failed (its message): no rank receives any other rank's rows.
        """
        dist = self._dist
        heads, bodies, msgs = [None] * self.world_size, [None] * self.world_size, {}
        own = _rows_message(rows, header, error)
        heads[self.rank], bodies[self.rank] = own[0], own[1]
        if error is not None:
            msgs[self.rank] = error
        peers = [r for r in range(self.world_size) if r != self.rank]
        for r in peers:
            heads[r] = torch.empty(H_WIDTH + 2, dtype=torch.float64)
        self._wait(step, "metadata receive on the planning rank",
                   [partial(dist.irecv, heads[r], group=self.group, group_src=r, tag=TAG_HEADER) for r in peers])
        ops, texts = [], {}
        for r in peers:
            n, text_len = int(heads[r][H_WIDTH]), int(heads[r][H_WIDTH + 1])
            bodies[r] = torch.empty((n, num_fields), dtype=torch.float64)
            if n:
                ops.append(partial(dist.irecv, bodies[r], group=self.group, group_src=r, tag=TAG_ROWS))
            if text_len:
                texts[r] = torch.empty(text_len, dtype=torch.uint8)
                ops.append(partial(dist.irecv, texts[r], group=self.group, group_src=r, tag=TAG_MESSAGE))
        self._wait(step, "metadata receive on the planning rank", ops)
        for r, t in texts.items():
            msgs[r] = t.numpy().tobytes().decode("utf-8", "replace")
        headers = torch.stack([h[:H_WIDTH] for h in heads]).numpy()
        for r in np.flatnonzero(headers[:, H_STATUS] != 0):
            msgs.setdefault(int(r), "")
        counts = headers[:, H_NUM_SAMPLES].astype(np.int64)
        all_rows = np.concatenate([b.reshape(-1, num_fields).numpy() for b in bodies], axis=0) \
            if counts.sum() else np.zeros((0, num_fields))
        owners = np.repeat(np.arange(self.world_size, dtype=np.int64), counts)
        return GatheredMetadata(headers, all_rows, owners), msgs

    def send_orders(self, step: int, orders: Sequence["StepOrders"]) -> None:
        """The planning rank sends every other rank its orders: a fixed-size header, then a body it announces."""
        dist = self._dist
        ops = []
        for r, order in enumerate(orders):
            if r == self.rank:
                continue
            head, body = order.encode()
            ops.append(partial(dist.isend, head, group=self.group, group_dst=r, tag=TAG_ORDERS_HEAD))
            if body.numel():
                ops.append(partial(dist.isend, body, group=self.group, group_dst=r, tag=TAG_ORDERS_BODY))
        self._wait(step, "orders send from the planning rank", ops)

    def receive_orders(self, step: int) -> "StepOrders":
        """A non-planning rank's orders for `step` from the planning rank."""
        dist = self._dist
        head = torch.empty(O_WIDTH, dtype=torch.float64)
        self._wait(step, "orders receive from the planning rank",
                   [partial(dist.irecv, head, group=self.group, group_src=PLANNER, tag=TAG_ORDERS_HEAD)])
        body = torch.empty(StepOrders.body_nbytes(head.numpy()), dtype=torch.uint8)
        if body.numel():
            self._wait(step, "orders receive from the planning rank",
                       [partial(dist.irecv, body, group=self.group, group_src=PLANNER, tag=TAG_ORDERS_BODY)])
        return StepOrders.decode(head.numpy().copy(), body)

    def exchange_payloads(self, step: int, local_samples: Sequence[Mapping[str, Any]], local_offset: int,
                          layout: TransferLayout, entries: Optional[Sequence[List[SampleEntry]]] = None
                          ) -> Dict[int, Dict[str, Any]]:
        """Send this rank's moving samples and receive the ones moving here: {global index: sample}.

        `local_samples[i]` is the sample of global index `local_offset + i`. One send per destination and one
        receive per source with a non-empty split, and nothing else: a rank touches only the peers it trades
        with (a rank that trades with no one sends and receives nothing). Both ends know every split size
        beforehand (the layout), so no size message precedes the payload. A peer that fails or dies makes
        this rank's receive from it (or the step's next agreement) raise within the timeout.
        """
        dist = self._dist
        sends: Dict[int, torch.Tensor] = {}
        for r in range(self.world_size):
            if not layout.send_splits[r]:
                continue
            chunks = []
            for g in layout.send_index[r]:
                i = int(g) - local_offset
                where = f"step {step}, rank {self.rank}, sample {i} (global {int(g)})"
                ent = entries[i] if entries is not None else sample_entries(local_samples[i], where)
                chunks.append(encode_sample(local_samples[i], where, ent))
            sends[r] = torch.cat(chunks)
            if sends[r].numel() != layout.send_splits[r]:
                msg = (f"payload point to point: encoded {sends[r].numel()} bytes for rank {r} but the metadata "
                       f"promises {layout.send_splits[r]}")
                self.report_failure(step, msg)
                raise ExchangeError(f"hf_dp_balance sample exchange, step {step}, rank {self.rank}: {msg}")
        recvs = {r: torch.empty(layout.recv_splits[r], dtype=torch.uint8)
                 for r in range(self.world_size) if layout.recv_splits[r]}
        ops = [partial(dist.irecv, buf, group=self.group, group_src=r, tag=TAG_PAYLOAD)
               for r, buf in recvs.items()]
        ops += [partial(dist.isend, buf, group=self.group, group_dst=r, tag=TAG_PAYLOAD)
                for r, buf in sends.items()]
        self._wait(step, "payload point to point", ops)
        recv = torch.cat([recvs[r] for r in sorted(recvs)]) if recvs else torch.empty(0, dtype=torch.uint8)
        try:
            return decode_received(recv, layout, step)
        except PayloadError as exc:
            raise ExchangeError(str(exc)) from exc


def _rows_message(rows: Optional[np.ndarray], header: np.ndarray, error: Optional[str]):
    """(header + [row count, message length] float64, rows float64, message uint8) of one rank's metadata."""
    rows_t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float64)) if rows is not None and rows.size \
        else torch.empty(0, dtype=torch.float64)
    text = (error or "").encode("utf-8", "replace")[:_MSG_BYTES] if error is not None else b""
    head = np.zeros(H_WIDTH + 2, dtype=np.float64)
    head[:H_WIDTH] = header
    head[H_WIDTH] = rows.shape[0] if rows is not None and rows.size else 0
    head[H_WIDTH + 1] = len(text)
    msg = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(head), rows_t, msg


@dataclass
class StepOrders:
    """What one rank needs of a step's plan, and nothing about other ranks' samples.

    `head` (float64 [O_WIDTH]): status, micro-batches, the step's sample count, this rank's first global
    index (`offset`), entry counts and the step's global statistics. Global indices are rank-major by
    holder. `in_index` / `in_slot`: the samples this rank trains and their micro-batch slot (ascending
    index); `out_index` / `out_dest`: its samples that leave and where to; `recv_index` / `recv_src` /
    `recv_bytes`: the samples that arrive, their holder and encoded size. `text`: plan hash and reason
    ("hash\nreason"), or the error every rank raises when the status is failed.
    """

    head: np.ndarray
    in_index: np.ndarray
    in_slot: np.ndarray
    out_index: np.ndarray
    out_dest: np.ndarray
    recv_index: np.ndarray
    recv_src: np.ndarray
    recv_bytes: np.ndarray
    text: str

    @staticmethod
    def body_nbytes(head: np.ndarray) -> int:
        return 8 * int(2 * head[O_N_IN] + 2 * head[O_N_OUT] + 3 * head[O_N_RECV]) + int(head[O_TEXT])

    @classmethod
    def failed(cls, text: str, status: int = STATUS_FAILED) -> "StepOrders":
        head = np.zeros(O_WIDTH, dtype=np.float64)
        head[O_STATUS] = status
        empty = np.zeros(0, dtype=np.int64)
        return cls(head, empty, empty, empty, empty, empty, empty, empty, text)

    def encode(self) -> Tuple[torch.Tensor, torch.Tensor]:
        text = self.text.encode("utf-8", "replace")
        head = self.head.copy()
        head[O_N_IN], head[O_N_OUT], head[O_N_RECV], head[O_TEXT] = (self.in_index.size, self.out_index.size,
                                                                     self.recv_index.size, len(text))
        ints = np.concatenate([self.in_index, self.in_slot, self.out_index, self.out_dest, self.recv_index,
                               self.recv_src, self.recv_bytes]).astype(np.int64)
        body = ints.tobytes() + text
        return (torch.from_numpy(head),
                torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8))

    @classmethod
    def decode(cls, head: np.ndarray, body: torch.Tensor) -> "StepOrders":
        n_in, n_out, n_recv = int(head[O_N_IN]), int(head[O_N_OUT]), int(head[O_N_RECV])
        raw = body.numpy().tobytes()
        n_ints = 2 * n_in + 2 * n_out + 3 * n_recv
        ints = np.frombuffer(raw[: 8 * n_ints], dtype=np.int64)
        parts = np.split(ints, np.cumsum([n_in, n_in, n_out, n_out, n_recv, n_recv]))
        return cls(head, *parts, raw[8 * n_ints:].decode("utf-8", "replace"))


__all__ = ["ExchangeError", "failure_detail", "differing_ranks", "is_distributed_error", "SampleExchange", "GatheredMetadata", "StepOrders", "PLANNER", "O_STATUS",
           "O_NUM_MICRO", "O_NUM_SAMPLES", "O_OFFSET", "O_APPLIED", "O_BEFORE", "O_AFTER", "O_MOVED", "O_MOVED_BYTES",
           "O_WIDTH", "STATUS_OK", "STATUS_END", "STATUS_FAILED", "H_STATUS", "H_NUM_SAMPLES", "H_NUM_MICRO",
           "H_FLAGS", "H_SPEED", "H_WIDTH"]
