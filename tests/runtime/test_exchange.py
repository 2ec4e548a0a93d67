"""The side-group sample exchange and the differentiable row all_to_all, on real gloo processes."""

import os
import time

import numpy as np
import pytest
import torch

from hf_dp_balance.testing.spawn import run_ranks, run_ranks_allow_failures
from hf_dp_balance.core.codec import encoded_nbytes, sample_entries, transfer_layout
from hf_dp_balance.runtime.all_to_all import all_to_all_rows
from hf_dp_balance.testing.side import side_exchange as _exchange
from hf_dp_balance.runtime.exchange import ExchangeError, SampleExchange


# ------------------------------------------------------------------ on real processes

def _exchange_round(rank, world):
    """Every rank owns a few samples; a shared random plan moves some; check who ends up with what."""
    torch.manual_seed(100 + rank)
    ex = _exchange(30)
    rng = np.random.default_rng(7)  # same on every rank: the plan
    counts = rng.integers(0, 5, world)
    counts[world - 1] = 0  # one rank with no samples at all
    mine = [{"sample_id": int(counts[:rank].sum() + i), "input_ids": torch.randint(0, 100, (int(3 + 5 * i),)),
             "pixel_values": torch.randn(int(i) * 4, 6)} for i in range(int(counts[rank]))]
    rows = np.array([[s["sample_id"], encoded_nbytes(sample_entries(s))] for s in mine], dtype=np.float64).reshape(-1, 2)
    meta = ex.gather_metadata(0, rows, num_micro_batches=1)
    n = meta.rows.shape[0]
    assert n == counts.sum() and np.array_equal(meta.rows[:, 0], np.arange(n))
    dest = rng.integers(0, world, n)
    layout = transfer_layout(meta.owners, dest, meta.rows[:, 1].astype(np.int64), rank, world)
    offset = int(np.searchsorted(meta.owners, rank))
    got = ex.exchange_payloads(0, mine, offset, layout)
    expected_from_elsewhere = sorted(int(g) for g in np.flatnonzero((dest == rank) & (meta.owners != rank)))
    assert sorted(got) == expected_from_elsewhere
    checks = {g: (int(s["sample_id"]), int(s["input_ids"].sum()), float(s["pixel_values"].sum())) for g, s in got.items()}
    sent = {int(counts[:rank].sum() + i): (s["sample_id"], int(s["input_ids"].sum()), float(s["pixel_values"].sum()))
            for i, s in enumerate(mine)}

    # differentiable rows: each rank sends (r+1) rows to every rank; gradient of sum(out * 2) is 2 everywhere
    x = torch.randn(world * (rank + 1), 3, requires_grad=True)
    out = all_to_all_rows(x, [rank + 1] * world, [r + 1 for r in range(world)], group=ex.group)
    (out * 2).sum().backward()
    grad_ok = bool(torch.allclose(x.grad, torch.full_like(x, 2.0)))
    return checks, sent, grad_ok, out.shape[0]


def test_exchange_moves_exactly_the_planned_samples_4_ranks():
    results = run_ranks(_exchange_round, 4, timeout=120)
    all_sent = {}
    for _, sent, _, _ in results:
        all_sent.update(sent)
    for rank, (checks, _, grad_ok, rows) in enumerate(results):
        for g, value in checks.items():
            assert value == all_sent[g]  # arrived intact
        assert grad_ok and rows == sum(r + 1 for r in range(4))


def _fault_reported_then_inside(rank, world, timeout_s):
    """Step 3: rank 1 reports a local failure at the gather. Step 5: rank 1 raises inside the payload exchange."""
    ex = _exchange(timeout_s)
    t0 = time.monotonic()
    try:
        ex.gather_metadata(3, np.zeros((1, 2)), num_micro_batches=1,
                           error="ValueError: bad sample" if rank == 1 else None)
        first = None
    except ExchangeError as exc:
        first = (time.monotonic() - t0, str(exc))
    return first, _fault_inside_exchange(rank, world, timeout_s, False, ex)


def _fault_inside_exchange(rank, world, timeout_s, hard_exit, ex=None, late_s=0.0):
    ex = ex or _exchange(timeout_s)
    sample = {"input_ids": torch.arange(10)}
    nbytes = encoded_nbytes(sample_entries(sample))
    meta = ex.gather_metadata(5, np.array([[nbytes]], dtype=np.float64), num_micro_batches=1)
    owners, sizes = meta.owners, meta.rows[:, 0].astype(np.int64)
    dest = (owners + 1) % world
    if rank == 1:
        if hard_exit:
            os._exit(3)  # the process dies in the middle of the exchange
        sizes = sizes + 8  # this rank's layout disagrees with what it encodes: it raises inside the exchange
    layout = transfer_layout(owners, dest, sizes, rank, world)
    time.sleep(late_s)  # > 0: rank 1 is gone before the others post their sends
    t0 = time.monotonic()
    try:
        ex.exchange_payloads(5, [sample], rank, layout)
    except ExchangeError as exc:
        return time.monotonic() - t0, str(exc)
    return None


def _check_others_raised_within_timeout(results, timeout_s, named):
    for rank in (0, 2):
        ok, value = results[rank]
        assert ok and value is not None, value
        elapsed, msg = value
        assert elapsed < timeout_s + 3.0
        assert "step 5" in msg and "payload point to point" in msg
        if named:  # a rank that raised leaves a note naming itself
            assert "rank 1 (step 5" in msg


def test_failures_make_every_rank_raise_naming_step_and_rank():
    timeout_s = 4.0
    results = run_ranks(_fault_reported_then_inside, 3, timeout_s, timeout=90)
    for first, _ in results:  # the failure flag: told at the gather, not after the timeout
        elapsed, msg = first
        assert elapsed < 3.0
        assert "step 3" in msg and "rank(s) [1]" in msg and "bad sample" in msg
    _check_others_raised_within_timeout([(True, second) for _, second in results], timeout_s, named=True)
    assert "rank 1" in results[1][1][1]  # the failing rank raises its own clear error


@pytest.mark.parametrize("late_s", [0.0, 1.5])
def test_rank_dying_inside_the_exchange_makes_the_others_raise_within_the_timeout(late_s):
    # late: gloo refuses the send at its post (peer closed), which must read like any other failure
    timeout_s = 4.0
    results = run_ranks_allow_failures(_fault_inside_exchange, 3, timeout_s, True, None, late_s, timeout=60)
    _check_others_raised_within_timeout(results, timeout_s, named=False)
    assert not results[1][0]


def _labels(rank, world):
    import torch.distributed as dist

    ex = _exchange(10)
    out = {}

    def local_bug():
        raise ValueError("row 3 has no tokens")

    try:
        ex._run(7, "orders", local_bug)
    except ExchangeError as exc:
        out["local"] = str(exc)
    if rank == 0:  # rank 1 never joins: a real collective timeout on rank 0
        try:
            ex._run(8, "rows to the planning rank", lambda: dist.barrier(group=ex.group))
        except ExchangeError as exc:
            out["timeout"] = str(exc)
    return out


def test_a_local_error_is_named_as_this_rank_s_not_as_a_collective_timeout():
    results = run_ranks(_labels, 2, timeout=120)
    for rank in (0, 1):
        msg = results[rank]["local"]
        assert "step 7, orders: failed on rank" in msg and "ValueError: row 3 has no tokens" in msg, msg
        assert "collective" not in msg and "timeout" not in msg, msg
    assert "collective on the side group failed (timeout 10s)" in results[0]["timeout"], results[0]["timeout"]
