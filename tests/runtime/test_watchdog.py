"""Which errors `training_errors` translates: torch.distributed's only; the rest pass through untouched.

The translation itself (step, rank, phase, chained from gloo's error) runs on real gloo processes in
tests/integrations/test_training_faults.py.
"""

import pytest
import torch.distributed as dist

from hf_dp_balance.runtime.exchange import ExchangeError
from hf_dp_balance.runtime.watchdog import is_distributed_error, training_errors

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
