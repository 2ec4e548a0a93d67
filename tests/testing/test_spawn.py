import pytest

from hf_dp_balance.testing.spawn import RankFailed, run_groups, run_ranks


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


def _step_in_lockstep(rank, world_size, lockstep, steps):
    """Each step: an all-reduce within the group, a report, then every process of every group meets."""
    import time

    import torch
    import torch.distributed as dist

    seen = []
    for step in range(steps):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)  # within this group only: its own gloo group
        if lockstep.group == "slow":
            time.sleep(0.2)  # the fast group must wait for it at every step
        if rank == 0:
            lockstep.report(step + 1)
        lockstep.wait(timeout=60)
        seen.append((float(t), time.monotonic()))  # when every process of both groups had finished the step
    return lockstep.group, seen


def _fail_in_one_group(rank, world_size, lockstep):
    if lockstep.group == "b" and rank == 1:
        raise ValueError("broken sample in group b")
    lockstep.wait(timeout=600)  # without the abort the others would wait here until the caller gives up
    return rank


def test_groups_run_at_once_with_their_own_collectives_and_meet_every_step():
    progress = []
    out = run_groups(_step_in_lockstep, ["fast", "slow"], 2, 3, timeout=240,
                     on_progress=lambda group, rank, value: progress.append((group, rank, value)))
    assert set(out) == {"fast", "slow"}
    for group, results in out.items():
        assert [g for g, _ in results] == [group, group]
        assert all([s for s, _ in seen] == [3.0, 3.0, 3.0] for _, seen in results)  # 1 + 2 within the group
    # lockstep: the fast group leaves step k+1 only after the slow group's 0.2 s of step k+1
    fast_times = [t for _, t in out["fast"][0][1]]
    assert all(b - a >= 0.15 for a, b in zip(fast_times, fast_times[1:])), fast_times
    assert sorted(v for g, r, v in progress if g == "fast") == [1, 2, 3] and all(r == 0 for _, r, _ in progress)


def test_a_failure_in_one_group_releases_the_others_and_is_the_one_reported():
    import time

    started = time.monotonic()
    with pytest.raises(RankFailed, match="b rank 1 failed(.|\n)*broken sample in group b"):
        run_groups(_fail_in_one_group, ["a", "b"], 2, timeout=150)
    # released at once, not when the caller's 150 s run out (spawning 4 ranks takes 10-25 s on 2 busy cores)
    assert time.monotonic() - started < 110


def _origin(rank, world_size, names):
    """Which process started this rank, and the variables it sees."""
    import os

    return os.getppid(), {n: os.environ.get(n) for n in names}


def test_ranks_fork_from_the_forkserver_with_the_caller_s_environment_of_now(monkeypatch):
    import os

    run_ranks(_sum_ranks, 1)  # the forkserver runs from here on, with the environment it started with
    monkeypatch.setenv("HF_DP_BALANCE_SPAWN_PROBE", "set after the server started")
    (parent, seen), = run_ranks(_origin, 1, ["HF_DP_BALANCE_SPAWN_PROBE"])
    assert parent != os.getpid()  # forked by the server, not started by this process
    assert seen == {"HF_DP_BALANCE_SPAWN_PROBE": "set after the server started"}


def test_a_rank_environment_that_differs_starts_a_fresh_interpreter():
    import os

    # a variable torch may read when it loads must reach a torch not loaded yet: not the server's copy
    (parent, seen), = run_ranks(_origin, 1, ["TORCH_CPP_LOG_LEVEL"], env={"TORCH_CPP_LOG_LEVEL": "INFO"})
    assert parent == os.getpid() and seen == {"TORCH_CPP_LOG_LEVEL": "INFO"}
