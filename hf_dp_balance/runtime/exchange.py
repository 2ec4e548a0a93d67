"""Cross-rank sample exchange over a side gloo process group: metadata gather and payload all_to_all.

`SampleExchange` owns one side gloo group (never the training group, so it may run in a background
thread); its metadata gather carries a failure flag, so a rank that failed locally makes every rank raise
`ExchangeError` at once, and any collective that fails or times out raises `ExchangeError` naming the step,
the phase and the ranks that reported a failure. Encoding and split sizes: `core.codec`. Details:
docs/exchange.md.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from hf_dp_balance.core.codec import (PayloadError, SampleEntry, TransferLayout, decode_received, encode_sample,
                                      sample_entries)


class ExchangeError(RuntimeError):
    """A collective of the sample exchange failed, or a rank reported a failure; names step and ranks."""


def failure_detail(failed: Mapping[int, str]) -> str:
    """"rank 1: msg; rank 3: msg" of {rank: message}, by rank: how every error of the runtime lists its ranks."""
    return "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items()))


# Fixed header every rank contributes to the first gather of a step.
H_STATUS, H_NUM_SAMPLES, H_NUM_MICRO, H_FLAGS, H_SPEED, H_WIDTH = range(6)
_MSG_BYTES = 512
_STORE_PREFIX = "exchange_failed"  # one key per run: every failed rank appends its line
_STORE_DEADLINE_S = 2.0  # the failure notes are best effort: a stopped store host must not hold the error


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
            detail = failure_detail(self._gather_messages(step, failed, error))
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

    def _gather_messages(self, step: int, failed: np.ndarray, error: Optional[str]) -> Dict[int, str]:
        """{rank: message} of the `failed` ranks (one all_gather of fixed-size text; every rank calls it)."""
        msg = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        text = (error or "").encode("utf-8", "replace")[:_MSG_BYTES]
        if text:
            msg[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        msgs = [torch.empty_like(msg) for _ in range(self.world_size)]
        self._run(step, "failure message all_gather", lambda: self._dist.all_gather(msgs, msg, group=self.group))
        return {int(r): msgs[r].numpy().tobytes().rstrip(b"\x00").decode("utf-8", "replace") for r in failed}

    def agree(self, step: int, phase: str, value: int = 0, error: Optional[str] = None) -> Tuple[np.ndarray, Dict[int, str]]:
        """(every rank's int64 `value`, {rank: message} of the ranks that passed `error`), equal on every rank.

        One all_gather of two int64 per rank; one more fetches the messages only when some rank failed.
        A rank's local failure in `phase` thus reaches every peer before the step goes on (no timeout).
        """
        mine = torch.tensor([1 if error is not None else 0, int(value)], dtype=torch.int64)
        both = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._run(step, f"{phase} all_gather", lambda: self._dist.all_gather(both, mine, group=self.group))
        table = torch.stack(both).numpy()
        failed = np.flatnonzero(table[:, 0] != 0)
        return table[:, 1].copy(), (self._gather_messages(step, failed, error) if failed.size else {})

    def raise_if_failed(self, step: int, phase: str, error: Optional[str] = None) -> None:
        """`agree` on a local failure: when any rank passes `error`, every rank raises `ExchangeError` naming them."""
        _, failed = self.agree(step, phase, error=error)
        if failed:
            detail = failure_detail(failed)
            raise ExchangeError(f"hf_dp_balance, step {step}, {phase}: rank(s) {sorted(failed)} failed "
                                f"(raised on rank {self.rank}): {detail}")

    def exchange_payloads(self, step: int, local_samples: Sequence[Mapping[str, Any]], local_offset: int,
                          layout: TransferLayout, entries: Optional[Sequence[List[SampleEntry]]] = None
                          ) -> Dict[int, Dict[str, Any]]:
        """Send this rank's moving samples and receive the ones moving here: {global index: sample}.

        `local_samples[i]` is the sample of global index `local_offset + i`.
        One `all_to_all_single` over uint8 with uneven splits; skipped entirely
        (on every rank alike) when no sample moves anywhere.
        """
        dist = self._dist
        chunks, expected = [], []
        for r in range(self.world_size):
            for g in layout.send_index[r]:
                i = int(g) - local_offset
                where = f"step {step}, rank {self.rank}, sample {i} (global {int(g)})"
                ent = entries[i] if entries is not None else sample_entries(local_samples[i], where)
                chunks.append(encode_sample(local_samples[i], where, ent))
            expected.append(layout.send_splits[r])
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        if send.numel() != sum(expected):
            msg = f"encoded {send.numel()} bytes but the gathered sizes promise {sum(expected)}"
            self.report_failure(step, msg)
            raise ExchangeError(f"hf_dp_balance sample exchange, step {step}, rank {self.rank}: {msg}")
        recv = torch.empty(layout.bytes_received, dtype=torch.uint8)
        self._run(step, "payload all_to_all", lambda: dist.all_to_all_single(
            recv, send, output_split_sizes=list(layout.recv_splits), input_split_sizes=list(expected),
            group=self.group))
        try:
            return decode_received(recv, layout, step)
        except PayloadError as exc:
            raise ExchangeError(str(exc)) from exc


__all__ = ["ExchangeError", "failure_detail", "SampleExchange", "GatheredMetadata", "H_STATUS", "H_NUM_SAMPLES", "H_NUM_MICRO",
           "H_FLAGS", "H_SPEED", "H_WIDTH"]
