"""Sample codec and transfer layout of the cross-rank exchange (pure torch / numpy, no process group).

A per-sample dict becomes ONE flat uint8 buffer that decodes as zero-copy views; `encoded_nbytes` gives its
size without encoding; `transfer_layout` gives every rank the same split sizes of the payload all_to_all.
Format and guarantees: docs/exchange.md ("Sample codec").
"""

from __future__ import annotations

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
    torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}

_SUPPORTED = "torch tensors, numpy arrays, int/float/bool, str, bytes, None, rectangular numeric lists"


def _pad(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class SampleEntry:
    key: bytes
    kind: int
    dtype_code: int
    shape: Tuple[int, ...]
    data: torch.Tensor  # contiguous, flattened to 1-d bytes (uint8)


_INT64 = (-(2 ** 63), 2 ** 63 - 1)


def _as_entry(key: Any, value: Any, where: str) -> SampleEntry:
    """One dict item as (kind, dtype, shape, bytes); a ValueError naming `where` and the key for what cannot be
    sent (also for what numpy / torch refuse with TypeError / OverflowError / RuntimeError)."""
    if not isinstance(key, str):
        raise ValueError(f"{where}: key {key!r} is not a string; sample dict keys must be strings")
    try:
        return _entry(key, key.encode("utf-8"), value, where)
    except (TypeError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"{where}: key {key!r}: value of type {type(value).__name__} cannot be sent ({exc}); "
                         f"supported: {_SUPPORTED}") from exc


def _entry(key: str, kbytes: bytes, value: Any, where: str) -> SampleEntry:
    if value is None:
        return SampleEntry(kbytes, KIND_NONE, 0, (), torch.empty(0, dtype=torch.uint8))
    if isinstance(value, torch.Tensor):
        kind, t = KIND_TENSOR, value.detach()
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.itemsize > (16 if value.dtype.kind == "c" else 8):
            raise ValueError(f"{where}: key {key!r}: numpy array of dtype {value.dtype} cannot be sent (numeric "
                             f"dtypes of at most 64 bits per part; cast long double to float64)")
        kind, t = KIND_NDARRAY, torch.from_numpy(np.ascontiguousarray(value))
    elif isinstance(value, bool):
        kind, t = KIND_BOOL, torch.tensor(value, dtype=torch.bool)
    elif isinstance(value, (int, np.integer)):
        if not _INT64[0] <= int(value) <= _INT64[1]:
            raise ValueError(f"{where}: key {key!r}: int {int(value)} does not fit in int64")
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
        if arr.dtype.kind not in "biuf" or arr.dtype == object:
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
    return SampleEntry(kbytes, kind, _DTYPE_CODE[t.dtype], shape, data)


def sample_entries(sample: Mapping[str, Any], where: str = "sample") -> List[SampleEntry]:
    """Validate a sample dict and describe its entries (no copy of tensor data); `where` names it in errors."""
    if not isinstance(sample, Mapping):
        raise ValueError(f"{where}: expected a dict of per-sample values, got {type(sample).__name__}")
    return [_as_entry(k, v, where) for k, v in sample.items()]


def _header_len(entries: Sequence[SampleEntry]) -> int:
    return 3 + sum(5 + len(e.shape) for e in entries)


def encoded_nbytes(entries: Sequence[SampleEntry]) -> int:
    """Exact size in bytes of `encode_sample` for these entries (a multiple of 8)."""
    return (8 * _header_len(entries) + sum(_pad(len(e.key)) for e in entries)
            + sum(_pad(e.data.numel()) for e in entries))


def encode_sample(sample: Mapping[str, Any], where: str = "sample", entries: Optional[List[SampleEntry]] = None) -> torch.Tensor:
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


class PayloadError(ValueError):
    """Received bytes that do not split into whole encoded samples (names the step and the source rank)."""


def decode_received(recv: torch.Tensor, layout: TransferLayout, step: int = -1) -> Dict[int, Dict[str, Any]]:
    """Split the received bytes back into samples keyed by global index (sizes come from each header)."""
    out: Dict[int, Dict[str, Any]] = {}
    pos = 0
    for r in range(len(layout.recv_index)):
        end = pos + layout.recv_splits[r]
        for g in layout.recv_index[r]:
            size = int(recv[pos: pos + 24].view(torch.int64)[2]) if pos + 24 <= end else -1
            if size <= 0 or pos + size > end:
                raise PayloadError(f"hf_dp_balance sample exchange, step {step}: corrupt payload from rank {r}")
            out[int(g)] = decode_sample(recv[pos: pos + size], f"step {step}, sample {int(g)} from rank {r}")
            pos += size
        pos = end
    return out


__all__ = [
    "PayloadError", "SampleEntry", "TransferLayout", "transfer_layout", "sample_entries", "encoded_nbytes", "encode_sample",
    "decode_sample", "decode_received",
]
