"""Sample codec and transfer layout of the exchange (pure: no process group)."""

import numpy as np
import pytest
import torch

from hf_dp_balance.core.codec import (PayloadError, decode_received, decode_sample, encode_sample, encoded_nbytes,
                                      sample_entries, transfer_layout)


def _rich_sample():
    return {
        "input_ids": torch.arange(7, dtype=torch.int64),
        "pixel_values": torch.randn(3, 5).to(torch.bfloat16),
        "image_grid_thw": torch.tensor([[1, 2, 4]], dtype=torch.int32),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(5.5, dtype=torch.float16),
        "empty": torch.zeros(0, 3),
        "sample_id": 42, "weight": 0.25, "flag": True, "name": "héllo", "raw": b"\x00ab",
        "labels": [[1, 2], [3, 4]], "none": None, "arr": np.arange(6, dtype=np.float32).reshape(2, 3), "nothing": [],
    }


def test_codec_round_trip_keeps_values_types_and_dtypes():
    s = _rich_sample()
    buf = encode_sample(s)
    assert buf.dtype == torch.uint8 and buf.numel() % 8 == 0
    assert buf.numel() == encoded_nbytes(sample_entries(s))
    d = decode_sample(buf)
    assert list(d) == list(s)
    for k, v in s.items():
        got = d[k]
        if isinstance(v, torch.Tensor):
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
        elif isinstance(v, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == v.dtype and np.array_equal(got, v)
        else:
            assert type(got) is type(v) and got == v, k


def test_codec_rejects_unsendable_values_naming_sample_and_key():
    with pytest.raises(ValueError, match=r"rank 1, sample 3.*'meta'.*dict"):
        encode_sample({"input_ids": torch.ones(2), "meta": {"a": 1}}, "rank 1, sample 3")
    with pytest.raises(ValueError, match=r"'ragged'"):
        sample_entries({"ragged": [[1, 2], [3]]}, "sample 0")
    with pytest.raises(ValueError, match=r"'words'.*str"):
        sample_entries({"words": ["a", "b"]}, "sample 0")
    with pytest.raises(ValueError, match="not a string"):
        sample_entries({3: torch.ones(1)}, "sample 0")
    with pytest.raises(ValueError, match="corrupt"):
        bad = encode_sample({"x": torch.ones(3)}).clone()
        bad[:8] = 0
        decode_sample(bad)


def test_transfer_layout_sender_and_receiver_agree():
    rng = np.random.default_rng(0)
    world = 4
    owners = np.sort(rng.integers(0, world, 200))
    dest = np.where(rng.random(200) < 0.3, rng.integers(0, world, 200), owners)
    nbytes = rng.integers(1, 100, 200) * 8
    layouts = [transfer_layout(owners, dest, nbytes, r, world) for r in range(world)]
    for i in range(world):
        for j in range(world):
            np.testing.assert_array_equal(layouts[i].send_index[j], layouts[j].recv_index[i])
            assert layouts[i].send_splits[j] == layouts[j].recv_splits[i]
        assert layouts[i].send_index[i].size == 0 and layouts[i].send_splits[i] == 0  # nothing sent to itself
    moved = owners != dest
    assert sum(l.bytes_sent for l in layouts) == nbytes[moved].sum()
    with pytest.raises(ValueError, match="one entry per sample"):
        transfer_layout(owners, dest[:-1], nbytes, 0, world)


def test_decode_received_splits_whole_samples_and_rejects_a_cut_payload():
    samples = [{"input_ids": torch.arange(3 + i)} for i in range(3)]
    bufs = [encode_sample(s) for s in samples]
    sizes = np.array([b.numel() for b in bufs])
    # rank 1 receives sample 0 and 2 from rank 0, sample 1 from rank 2
    layout = transfer_layout(np.array([0, 2, 0]), np.array([1, 1, 1]), sizes, 1, 3)
    recv = torch.cat([bufs[0], bufs[2], bufs[1]])
    got = decode_received(recv, layout, step=4)
    assert sorted(got) == [0, 1, 2]
    for g, s in enumerate(samples):
        assert torch.equal(got[g]["input_ids"], s["input_ids"])
    with pytest.raises(PayloadError, match="step 4: corrupt payload from rank 0"):
        cut = transfer_layout(np.array([0]), np.array([1]), sizes[:1] - 8, 1, 3)  # split shorter than the sample
        decode_received(bufs[0][:-8], cut, step=4)


def test_codec_names_sample_key_and_rank_for_out_of_range_values_and_sends_unsigned_arrays():
    where = "step 3, rank 1, micro-batch 0, sample 2"
    for value, why in ((2 ** 70, "does not fit in int64"), (-(2 ** 63) - 1, "does not fit in int64"),
                       ([2 ** 70, 1], "list of object"), (np.zeros(2, dtype=np.longdouble), "cast long double"),
                       (np.zeros(2, dtype=np.clongdouble), "cast long double")):
        if np.dtype(np.longdouble).itemsize <= 8 and isinstance(value, np.ndarray):
            continue  # long double is float64 on this platform: sendable
        with pytest.raises(ValueError, match=rf"^{where}: key 'x': .*{why}"):
            encode_sample({"x": value}, where)
    for dtype in (np.uint16, np.uint32, np.uint64):  # documented as supported, refused before
        arr = np.array([0, 7, np.iinfo(dtype).max], dtype=dtype)
        got = decode_sample(encode_sample({"x": arr}, where))["x"]
        assert got.dtype == arr.dtype and np.array_equal(got, arr)
    got = decode_sample(encode_sample({"x": float("inf"), "y": [1.0, float("nan")], "z": 2 ** 63 - 1}))
    assert got["x"] == float("inf") and np.isnan(got["y"][1]) and got["z"] == 2 ** 63 - 1
