"""Fault paths on real gloo processes: every surviving rank raises fast, naming step, rank and phase."""

import os
import signal
import time

import numpy as np

from hf_dp_balance.runtime.exchange import ExchangeError, SampleExchange
from hf_dp_balance.testing.spawn import run_ranks_until

TIMEOUT_S = 3.0


def _timed(fn):
    """(seconds, message of the ExchangeError) or (seconds, None) when `fn` returned."""
    t0 = time.monotonic()
    try:
        fn()
        return time.monotonic() - t0, None
    except ExchangeError as exc:
        return time.monotonic() - t0, str(exc)


# ------------------------------------------------------------------ item 1: the store's host stopped

def _store_host_stops(rank, world):
    ex = SampleExchange(timeout_s=TIMEOUT_S)
    ex.gather_metadata(0, np.zeros((1, 2)), num_micro_batches=1)
    if rank == 0:  # rank 0 hosts the rendezvous store (env://): stopped, its socket stays open, never answers
        os.kill(os.getpid(), signal.SIGSTOP)
    return _timed(lambda: ex.gather_metadata(1, np.zeros((1, 2)), num_micro_batches=1))


def test_stopped_store_host_does_not_hang_the_error_path():
    got = run_ranks_until(_store_host_stops, 3, ranks=[1, 2], timeout=60)
    for rank in (1, 2):
        ok, value, _ = got[rank]
        assert ok, value
        elapsed, msg = value
        assert msg is not None and "step 1" in msg and "metadata header all_gather" in msg and f"rank {rank}" in msg
        assert elapsed < TIMEOUT_S + 4.0, elapsed  # the store lookup has a deadline (it hung for good before)
