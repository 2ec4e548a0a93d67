"""Which errors `training_errors` translates: torch.distributed's only; the rest pass through untouched.

The translation itself (step, rank, phase, chained from gloo's error) runs on real gloo processes in
tests/integrations/test_training_faults.py.
"""

import pytest
import torch.distributed as dist

from hf_dp_balance.runtime.exchange import ExchangeError
from hf_dp_balance.runtime.exchange import is_distributed_error
from hf_dp_balance.runtime.watchdog import training_errors
from hf_dp_balance.testing.spawn import run_ranks_allow_failures

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:12721: "
        "Connection reset by peer. This is typically caused by a remote worker hanging")


def test_only_torch_distributed_errors_count_as_distributed():
    assert is_distributed_error(RuntimeError(GLOO))
    assert is_distributed_error(dist.DistNetworkError("socket timed out"))  # a DistError subclass, any text
    assert is_distributed_error(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error"))
    assert not is_distributed_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_distributed_error(ValueError("gloo"))  # not a RuntimeError: not from a backend
    assert not is_distributed_error(ExchangeError("hf_dp_balance sample exchange, step 3: ... gloo ..."))
    # the library's own error, already naming step, rank and phase (the vision balancer's backward)
    assert not is_distributed_error(RuntimeError("hf_dp_balance vision balancing, step 4, rank 1: " + GLOO))


def test_anything_else_passes_through_untouched():
    original = ValueError("a bad batch")
    with pytest.raises(ValueError) as caught:
        with training_errors(object()):  # the loader is read only for a distributed error
            raise original
    assert caught.value is original
    with pytest.raises(RuntimeError) as caught:
        with training_errors(None):  # no balanced loader: even gloo's error is left as it is
            raise RuntimeError(GLOO)
    assert str(caught.value) == GLOO


# --------------------------------------------------------------------------- one watchdog, several streams


def _eval_stream_ends_then_a_peer_dies(rank, world):
    import os
    import time

    from hf_dp_balance.runtime.watchdog import Watchdog

    group = dist.new_group(backend="gloo")
    dog = Watchdog(group, timeout_s=3.0, heartbeat_s=0.1, error_grace_s=0.2, on_fatal="raise")
    train = dog.start(lambda: (f"step 7, rank {rank}", ""), lambda: False)
    evaluation = dog.start(lambda: (f"step 0, rank {rank}", ""), lambda: False)
    time.sleep(0.3)
    dog.stop(evaluation)  # the eval loader's pass ended; the train stream is still live
    time.sleep(0.3)
    if rank == 1:
        os._exit(3)  # a peer gone while rank 0 trains: only live rounds can notice
    deadline = time.monotonic() + 15
    while dog.fatal_message is None and time.monotonic() < deadline:
        time.sleep(0.05)
    message, live = dog.fatal_message, dog.live_streams
    dog.stop(train)
    return {"message": message, "live": live}


def test_the_train_stream_keeps_its_liveness_check_when_an_eval_stream_ends():
    results = run_ranks_allow_failures(_eval_stream_ends_then_a_peer_dies, 2, timeout=60, pg_timeout_s=20)
    ok, out = results[0]
    assert ok, out
    assert out["live"] == 1
    assert out["message"] is not None and "step 7, rank 0" in out["message"] and "liveness" in out["message"]
