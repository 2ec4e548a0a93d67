"""Cross-rank sample exchange over a side gloo process group.

Three pieces, from pure to communicating:

* Sample codec (pure torch, no process group): a per-sample dict of tensors /
  numpy arrays / numbers / strings / numeric lists becomes ONE flat uint8
  buffer: an int64 header (magic, entry count, per entry: kind, dtype code,
  ndim, key length, data length, shape) followed by the key names and the raw
  data, every chunk padded to 8 bytes so that decoding is a zero-copy `view`.
  No pickling. `encoded_nbytes` gives a sample's size without encoding it, so
  every rank can learn every sample's size from the metadata gather.
* `transfer_layout` (pure numpy): given every sample's owner, destination and
  size, which local samples go to which rank and the uneven split sizes of the
  single `all_to_all_single` -- identical on every rank, no size exchange.
* `SampleExchange` (the shell): one side gloo group created once (never the
  training group, so it runs in a background thread while training
  collectives run in the main thread), a metadata all_gather that also carries
  a failure flag (a rank that failed locally tells the others at once instead
  of letting them wait for the timeout), and the payload all_to_all. A
  collective that fails (dead peer, timeout) raises `ExchangeError` naming the
  step, the phase and the ranks that reported a failure.

Also `all_to_all_rows`: a differentiable uneven all_to_all of row tensors
(backward = the reverse all_to_all), for moving vision inputs / embeddings.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

_MAGIC = 0x48464450  # "HFDP"
_ALIGN = 8

# Value kinds: how a decoded entry is turned back into a Python value.
KIND_TENSOR, KIND_NDARRAY, KIND_INT, KIND_FLOAT, KIND_BOOL, KIND_STR, KIND_LIST, KIND_NONE, KIND_BYTES = range(9)

# Fixed dtype vocabulary: the code is the index (append only, never reorder).
_DTYPES: Tuple[torch.dtype, ...] = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
    torch.complex64, torch.complex128,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}

_SUPPORTED = "torch tensors, numpy arrays, int/float/bool, str, bytes, None, rectangular numeric lists"


class ExchangeError(RuntimeError):
    """A collective of the sample exchange failed, or a rank reported a failure; names step and ranks."""


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class _Entry:
    key: bytes
    kind: int
    dtype_code: int
    shape: Tuple[int, ...]
    data: torch.Tensor  # contiguous, flattened to 1-d bytes (uint8)


def _as_entry(key: Any, value: Any, where: str) -> _Entry:
    """One dict item as (kind, dtype, shape, bytes); a clear ValueError for what cannot be sent."""
    if not isinstance(key, str):
        raise ValueError(f"{where}: key {key!r} is not a string; sample dict keys must be strings")
    kbytes = key.encode("utf-8")
    if value is None:
        return _Entry(kbytes, KIND_NONE, 0, (), torch.empty(0, dtype=torch.uint8))
    if isinstance(value, torch.Tensor):
        kind, t = KIND_TENSOR, value.detach()
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc":
            raise ValueError(f"{where}: key {key!r}: numpy array of dtype {value.dtype} cannot be sent (numeric only)")
        kind, t = KIND_NDARRAY, torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, bool):
        kind, t = KIND_BOOL, torch.tensor(value, dtype=torch.bool)
    elif isinstance(value, (int, np.integer)):
        kind, t = KIND_INT, torch.tensor(int(value), dtype=torch.int64)
    elif isinstance(value, (float, np.floating)):
        kind, t = KIND_FLOAT, torch.tensor(float(value), dtype=torch.float64)
    elif isinstance(value, str):
        kind, t = KIND_STR, torch.frombuffer(bytearray(value.encode("utf-8")), dtype=torch.uint8)
    elif isinstance(value, (bytes, bytearray)):
        kind, t = KIND_BYTES, torch.frombuffer(bytearray(value), dtype=torch.uint8)
    elif isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise ValueError(f"{where}: key {key!r}: list cannot be sent ({exc}); supported: {_SUPPORTED}") from None
        if arr.dtype.kind not in "biuf":
            raise ValueError(f"{where}: key {key!r}: list of {arr.dtype} values cannot be sent; supported: {_SUPPORTED}")
        kind, t = KIND_LIST, torch.from_numpy(np.ascontiguousarray(arr))
    else:
        raise ValueError(f"{where}: key {key!r}: value of type {type(value).__name__} cannot be sent; supported: {_SUPPORTED}")
    if t.dtype not in _DTYPE_CODE:
        raise ValueError(f"{where}: key {key!r}: dtype {t.dtype} cannot be sent")
    if t.device.type != "cpu":
        t = t.cpu()
    shape = tuple(int(s) for s in t.shape)
    flat = t.contiguous().reshape(-1)
    data = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
    return _Entry(kbytes, kind, _DTYPE_CODE[t.dtype], shape, data)


def sample_entries(sample: Mapping[str, Any], where: str = "sample") -> List[_Entry]:
    """Validate a sample dict and describe its entries (no copy of tensor data); `where` names it in errors."""
    if not isinstance(sample, Mapping):
        raise ValueError(f"{where}: expected a dict of per-sample values, got {type(sample).__name__}")
    return [_as_entry(k, v, where) for k, v in sample.items()]


def _header_len(entries: Sequence[_Entry]) -> int:
    return 3 + sum(5 + len(e.shape) for e in entries)


def encoded_nbytes(entries: Sequence[_Entry]) -> int:
    """Exact size in bytes of `encode_sample` for these entries (a multiple of 8)."""
    return (8 * _header_len(entries) + sum(_pad(len(e.key)) for e in entries)
            + sum(_pad(e.data.numel()) for e in entries))


def encode_sample(sample: Mapping[str, Any], where: str = "sample", entries: Optional[List[_Entry]] = None) -> torch.Tensor:
    """One sample dict -> one flat uint8 tensor (int64 header, key names, data; 8-byte aligned chunks)."""
    entries = sample_entries(sample, where) if entries is None else entries
    header: List[int] = [_MAGIC, len(entries), encoded_nbytes(entries)]
    for e in entries:
        header += [e.kind, e.dtype_code, len(e.shape), len(e.key), e.data.numel(), *e.shape]
    out = torch.zeros(header[2], dtype=torch.uint8)
    hbytes = torch.tensor(header, dtype=torch.int64).view(torch.uint8)
    out[: hbytes.numel()] = hbytes
    pos = hbytes.numel()
    for e in entries:
        out[pos: pos + len(e.key)] = torch.frombuffer(bytearray(e.key), dtype=torch.uint8) if e.key else out[pos:pos]
        pos += _pad(len(e.key))
    for e in entries:
        n = e.data.numel()
        out[pos: pos + n] = e.data
        pos += _pad(n)
    return out


def decode_sample(buf: torch.Tensor, where: str = "buffer") -> Dict[str, Any]:
    """Inverse of `encode_sample`. Tensors are views into `buf` (8-byte aligned), not copies."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < 24 or buf.numel() % 8:
        raise ValueError(f"{where}: not an encoded sample (uint8 1-d, multiple of 8 bytes expected)")
    words = buf.view(torch.int64)
    if int(words[0]) != _MAGIC or int(words[2]) != buf.numel():
        raise ValueError(f"{where}: corrupt sample buffer (magic {int(words[0]):#x}, size {int(words[2])} vs {buf.numel()})")
    n_entries = int(words[1])
    specs, w = [], 3
    for _ in range(n_entries):
        kind, code, ndim, klen, dlen = (int(x) for x in words[w: w + 5])
        shape = tuple(int(x) for x in words[w + 5: w + 5 + ndim])
        specs.append((kind, code, shape, klen, dlen))
        w += 5 + ndim
    pos = 8 * w
    keys = []
    for _, _, _, klen, _ in specs:
        keys.append(bytes(buf[pos: pos + klen].numpy().tobytes()).decode("utf-8"))
        pos += _pad(klen)
    out: Dict[str, Any] = {}
    for key, (kind, code, shape, _, dlen) in zip(keys, specs):
        raw = buf[pos: pos + dlen]
        pos += _pad(dlen)
        if kind == KIND_NONE:
            out[key] = None
            continue
        dtype = _DTYPES[code]
        t = (raw.view(dtype) if dlen else torch.empty(0, dtype=dtype)).reshape(shape)
        if kind == KIND_TENSOR:
            out[key] = t
        elif kind == KIND_NDARRAY:
            out[key] = t.numpy().copy()
        elif kind in (KIND_INT, KIND_FLOAT, KIND_BOOL):
            out[key] = t.item()
        elif kind == KIND_STR:
            out[key] = t.numpy().tobytes().decode("utf-8")
        elif kind == KIND_BYTES:
            out[key] = t.numpy().tobytes()
        elif kind == KIND_LIST:
            out[key] = t.tolist()
        else:
            raise ValueError(f"{where}: key {key!r}: unknown value kind {kind}")
    return out


# ---------------------------------------------------------------------------------------------
# Pure layout of one exchange
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransferLayout:
    """What one rank sends and receives in the payload all_to_all of a step."""

    send_index: Tuple[np.ndarray, ...]  # per destination rank: global sample indices this rank sends (ascending)
    recv_index: Tuple[np.ndarray, ...]  # per source rank: global sample indices this rank receives (ascending)
    send_splits: Tuple[int, ...]        # bytes per destination rank
    recv_splits: Tuple[int, ...]        # bytes per source rank

    @property
    def bytes_sent(self) -> int:
        return int(sum(self.send_splits))

    @property
    def bytes_received(self) -> int:
        return int(sum(self.recv_splits))


def transfer_layout(owners: np.ndarray, dest: np.ndarray, nbytes: np.ndarray, rank: int, world_size: int) -> TransferLayout:
    """Split sizes of the payload all_to_all for `rank`, from data every rank has (no size exchange).

    Only samples with dest != owner move. Within each (source, destination)
    pair samples travel in ascending global index, so sender and receiver agree
    on the order without any extra message.
    """
    owners = np.asarray(owners, dtype=np.int64)
    dest = np.asarray(dest, dtype=np.int64)
    nbytes = np.asarray(nbytes, dtype=np.int64)
    if not (owners.shape == dest.shape == nbytes.shape):
        raise ValueError(f"owners {owners.shape}, dest {dest.shape}, nbytes {nbytes.shape} must have one entry per sample")
    if owners.size and (owners.min() < 0 or owners.max() >= world_size or dest.min() < 0 or dest.max() >= world_size):
        raise ValueError(f"owner / destination ranks must lie in [0, {world_size})")
    moves = owners != dest
    idx = np.arange(owners.size)
    send = tuple(idx[moves & (owners == rank) & (dest == r)] for r in range(world_size))
    recv = tuple(idx[moves & (dest == rank) & (owners == r)] for r in range(world_size))
    return TransferLayout(send, recv, tuple(int(nbytes[s].sum()) for s in send), tuple(int(nbytes[s].sum()) for s in recv))


# ---------------------------------------------------------------------------------------------
# Shell: side group, metadata gather, payload all_to_all
# ---------------------------------------------------------------------------------------------

# Fixed header every rank contributes to the first gather of a step.
H_STATUS, H_NUM_SAMPLES, H_NUM_MICRO, H_FLAGS, H_SPEED, H_WIDTH = range(6)
_MSG_BYTES = 512
_STORE_PREFIX = "hf_dp_balance/exchange_failed/"


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

    def __init__(self, timeout_s: float = 600.0, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("SampleExchange needs an initialized torch.distributed default process group")
        self._dist = dist
        self.timeout_s = float(timeout_s)
        # A dedicated gloo group: never the training group, so it can run in a thread beside
        # training collectives, and its timeout bounds every wait of the exchange.
        self.group = group if group is not None else dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        # Ranks are positions in the group (a data-parallel subgroup when one is given); failure notes
        # in the store are keyed by global rank, so several subgroups never overwrite each other's.
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._global_ranks = dist.get_process_group_ranks(self.group)

    # -- failure reporting -------------------------------------------------------------------
    def _store(self):
        try:
            return self._dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - best effort only
            return None

    def report_failure(self, step: int, message: str) -> None:
        """Leave a note in the rendezvous store so that peers stuck in a collective can name this rank."""
        store = self._store()
        if store is not None:
            try:
                store.set(f"{_STORE_PREFIX}{self._global_ranks[self.rank]}", f"step {step}: {message[:300]}")
            except Exception:  # noqa: BLE001 - the store may be gone with rank 0
                pass

    def reported_failures(self) -> Dict[int, str]:
        """Ranks that left a failure note (best effort: empty when the store is unreachable)."""
        store, found = self._store(), {}
        if store is None:
            return found
        for r in range(self.world_size):
            key = f"{_STORE_PREFIX}{self._global_ranks[r]}"
            try:
                if store.check([key]):
                    found[r] = store.get(key).decode("utf-8", "replace")
            except Exception:  # noqa: BLE001
                break
        return found

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
            msg = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
            text = (error or "").encode("utf-8", "replace")[:_MSG_BYTES]
            if text:
                msg[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            msgs = [torch.empty_like(msg) for _ in range(self.world_size)]
            self._run(step, "failure message all_gather", lambda: dist.all_gather(msgs, msg, group=self.group))
            texts = [msgs[r].numpy().tobytes().rstrip(b"\x00").decode("utf-8", "replace") for r in failed]
            detail = "; ".join(f"rank {r}: {t}" for r, t in zip(failed.tolist(), texts))
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

    def exchange_payloads(self, step: int, local_samples: Sequence[Mapping[str, Any]], local_offset: int,
                          layout: TransferLayout, entries: Optional[Sequence[List[_Entry]]] = None
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
        return decode_received(recv, layout, step)

    def destroy(self) -> None:
        try:
            self._dist.destroy_process_group(self.group)
        except Exception:  # noqa: BLE001 - already torn down with the default group
            pass


def decode_received(recv: torch.Tensor, layout: TransferLayout, step: int = -1) -> Dict[int, Dict[str, Any]]:
    """Split the received bytes back into samples keyed by global index (sizes come from each header)."""
    out: Dict[int, Dict[str, Any]] = {}
    pos = 0
    for r in range(len(layout.recv_index)):
        end = pos + layout.recv_splits[r]
        for g in layout.recv_index[r]:
            size = int(recv[pos: pos + 24].view(torch.int64)[2]) if pos + 24 <= end else -1
            if size <= 0 or pos + size > end:
                raise ExchangeError(f"hf_dp_balance sample exchange, step {step}: corrupt payload from rank {r}")
            out[int(g)] = decode_sample(recv[pos: pos + size], f"step {step}, sample {int(g)} from rank {r}")
            pos += size
        pos = end
    return out


# ---------------------------------------------------------------------------------------------
# Differentiable uneven all_to_all of rows
# ---------------------------------------------------------------------------------------------

class _AllToAllRows(torch.autograd.Function):
    """Uneven all_to_all of rows whose backward is the reverse all_to_all (gradients return to the owners).

    Our own, on `torch.distributed.all_to_all_single`: `torch.distributed.nn.functional.all_to_all_single`
    is deprecated since torch 2.13 (a FutureWarning on every call) and its replacement is private.
    """

    @staticmethod
    def forward(ctx, tensor, send_counts, recv_counts, group):
        import torch.distributed as dist

        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=send_counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        import torch.distributed as dist

        grad_in = grad_out.new_empty((sum(ctx.send_counts), *grad_out.shape[1:]))
        dist.all_to_all_single(grad_in, grad_out.contiguous(), output_split_sizes=ctx.send_counts,
                               input_split_sizes=ctx.recv_counts, group=ctx.group)
        return grad_in, None, None, None


def all_to_all_rows(tensor: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], group=None) -> torch.Tensor:
    """Rows [n, ...] split by `send_counts` (rows per destination rank) -> rows received, by source rank.

    Differentiable: the backward pass is the reverse all_to_all (gradients go
    back to the rows' owners; works on gloo). Counts must agree pairwise across
    ranks (send_counts[j] on rank i == recv_counts[i] on rank j). Every rank of
    the group must call it (also in backward, which autograd guarantees when
    every rank's output takes part in its loss).
    """
    import torch.distributed as dist

    send_counts = [int(c) for c in send_counts]
    recv_counts = [int(c) for c in recv_counts]
    world = dist.get_world_size(group)
    if len(send_counts) != world or len(recv_counts) != world:
        raise ValueError(f"send_counts / recv_counts need one entry per rank of the group ({world})")
    if sum(send_counts) != tensor.shape[0]:
        raise ValueError(f"send_counts sum to {sum(send_counts)} but the tensor has {tensor.shape[0]} rows")
    return _AllToAllRows.apply(tensor, send_counts, recv_counts, group)


__all__ = [
    "ExchangeError", "SampleExchange", "GatheredMetadata", "TransferLayout", "transfer_layout",
    "sample_entries", "encoded_nbytes", "encode_sample", "decode_sample", "decode_received", "all_to_all_rows",
]
