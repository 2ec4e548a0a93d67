"""Routing of a balanced vision forward (pure): every item's rows end where they must, only moved items travel."""

import numpy as np
import pytest

from hf_dp_balance.core.routing import route_items, rows_in_order, take_rows


def _check_route_roundtrip(item_rank, dest, in_rows, out_rows, world):
    """Simulate both all_to_alls with numpy and check every item's rows end where they must.

    Kept items (dest == owner) must not travel: their rows are taken in place.
    """
    n = len(item_rank)
    routes = [route_items(item_rank, dest, in_rows, out_rows, r, world) for r in range(world)]
    # item i's pixel rows are the values (i, k) for k < in_rows[i]
    local = [np.nonzero(item_rank == r)[0] for r in range(world)]
    sent = []
    for r, route in enumerate(routes):
        assert all(dest[i] != r for i in local[r][route.send_order])
        assert all(dest[i] == r for i in local[r][route.kept_items])
        assert sorted(np.concatenate([route.send_order, route.kept_items]).tolist()) == list(range(len(local[r])))
        rows = [(i, k) for i in local[r][route.send_order] for k in range(in_rows[i])]
        chunks, start = [], 0
        for size in route.send_in_rows:
            chunks.append(rows[start:start + size])
            start += size
        assert route.send_in_rows[r] == 0 and route.recv_in_rows[r] == 0
        sent.append(chunks)
    for r, route in enumerate(routes):
        received = [row for s in range(world) for row in sent[s][r]]
        assert len(received) == sum(route.recv_in_rows)
        kept_rows = [(i, k) for i in local[r][route.kept_items] for k in range(in_rows[i])]
        expect = [(i, k) for i in route.computed_items for k in range(in_rows[i])]
        assert kept_rows + received == expect
        assert all(dest[i] == r for i in route.computed_items)
    # embeddings back: item i's output rows are (i, k) for k < out_rows[i]
    back, kept_out = [], []
    for r, route in enumerate(routes):
        n_kept = len(route.kept_items)
        kept_out.append([(i, k) for i in route.computed_items[:n_kept] for k in range(out_rows[i])])
        rows = [(i, k) for i in route.computed_items[n_kept:] for k in range(out_rows[i])]
        chunks, start = [], 0
        for size in route.send_out_rows:
            chunks.append(rows[start:start + size])
            start += size
        back.append(chunks)
    for r, route in enumerate(routes):
        arrived = [row for s in range(world) for row in back[s][r]]
        assert len(arrived) == sum(route.recv_out_rows)
        combined = kept_out[r] + arrived
        restored = [combined[j] for j in route.restore_rows]
        assert restored == [(i, k) for i in local[r] for k in range(out_rows[i])]
        assert route.exchanges == bool(sum(route.send_in_rows) or sum(route.recv_in_rows))
    assert sorted(np.concatenate([rt.computed_items for rt in routes]).tolist()) == list(range(n))


def test_route_items_roundtrip_random():
    rng = np.random.default_rng(0)
    for _ in range(30):
        world = int(rng.integers(1, 6))
        n = int(rng.integers(0, 12))
        item_rank = np.sort(rng.integers(0, world, size=n))
        dest = rng.integers(0, world, size=n)
        in_rows = rng.integers(1, 7, size=n)
        out_rows = rng.integers(1, 4, size=n)
        _check_route_roundtrip(item_rank, dest, in_rows, out_rows, world)


def test_route_items_rejects_bad_input():
    with pytest.raises(ValueError, match="non-decreasing"):
        route_items(np.array([1, 0]), np.array([0, 0]), np.ones(2), np.ones(2), 0, 2)
    with pytest.raises(ValueError, match="item 1: item_dest=5"):
        route_items(np.array([0, 0]), np.array([0, 5]), np.ones(2), np.ones(2), 0, 2)
    with pytest.raises(ValueError, match="in_rows has shape"):
        route_items(np.array([0, 0]), np.array([0, 0]), np.ones(3), np.ones(2), 0, 2)


def test_rows_in_order():
    assert rows_in_order([2, 1, 3], np.array([2, 0])).tolist() == [3, 4, 5, 0, 1]
    assert rows_in_order([2, 1], np.array([], dtype=np.int64)).tolist() == []


def testtake_rows_gathers_across_parts_without_joining_them():
    import torch

    images = torch.arange(10.0).reshape(5, 2)
    videos = torch.arange(100.0, 108.0).reshape(4, 2)
    joined = torch.cat([images, videos])
    empty = torch.zeros(0, 2)
    rng = np.random.default_rng(1)
    for _ in range(20):
        rows = rng.permutation(9)[: int(rng.integers(0, 10))]
        assert torch.equal(take_rows([images, videos], rows, empty), joined[torch.as_tensor(rows, dtype=torch.long)])
    # a run inside one part is a view of it: no copy
    view = take_rows([images, videos], np.array([6, 7, 8]), empty)
    assert torch.equal(view, videos[1:]) and view.data_ptr() == videos[1].data_ptr()
    assert take_rows([images, videos], np.array([], dtype=np.int64), empty) is empty
