import pytest

from hf_dp_balance.testing.spawn import RankFailed, run_ranks


def _sum_ranks(rank, world_size):
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t)


def _raise_on_one(rank, world_size):
    if rank == 1:
        raise KeyError("sample 3 of rank 1")
    return rank


def test_ranks_run_real_collectives():
    assert run_ranks(_sum_ranks, 2) == [3.0, 3.0]


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RankFailed, match="rank 1 raised(.|\n)*sample 3 of rank 1"):
        run_ranks(_raise_on_one, 2, timeout=120)
