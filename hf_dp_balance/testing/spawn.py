"""Run a function on real torch.distributed gloo processes and collect what each returns.

`run_ranks(fn, world_size, *args)` spawns `world_size` processes, each with a
default gloo process group, `torch.set_num_threads(1)` (several ranks share two
cores), calls `fn(rank, world_size, *args)` and returns the list of results in
rank order. An exception on any rank is re-raised here with that rank's
traceback; a rank that neither returns nor raises within `timeout` fails the
caller instead of hanging it. `run_groups` runs several such groups at once (one
gloo group each) that can wait for each other (`Lockstep`): the demo's ways.
`fn` must be a module-level function (it is pickled by name).

Ranks fork from a forkserver that imported torch and transformers once (a rank starts in ~0.1 s instead
of 3-4 s of imports each), with this process's environment as it is at the call. A call whose `env`
sets a variable to another value than this process has starts fresh interpreters (spawn) instead:
torch reads some variables when it loads.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Callable, Dict, Optional, Sequence

# torch is imported inside the functions: a spawned process imports this module before its
# `env` is applied, and some variables (TORCH_CPP_LOG_LEVEL, OMP_NUM_THREADS) are read when torch loads.

# A fresh process spends 3-4 s of CPU importing torch and as much again for transformers (7-9 s for two
# ranks on two cores). A forkserver imports them once, in one server process per calling process, and
# forks every rank from it; `multiprocessing` owns that server and ends it when the caller exits.
_PRELOAD = ("torch", "torch.distributed", "transformers", "hf_dp_balance.integrations.callback",
            "hf_dp_balance.testing.models")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailed(RuntimeError):
    pass


class Lockstep:
    """What the processes of one `run_groups` call share: a barrier over every process of every group,
    and a channel for progress to the parent. Passed to `fn` as its third argument."""

    def __init__(self, barrier, results, group: str, rank: int):
        self._barrier, self._results, self.group, self.rank = barrier, results, group, rank

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every process of every group has called `wait` as often (BrokenBarrierError if one failed)."""
        self._barrier.wait(timeout=timeout)

    def abort(self) -> None:
        """Release every process waiting (they raise BrokenBarrierError): one of them failed."""
        self._barrier.abort()

    def report(self, value) -> None:
        """Send `value` to the parent's `on_progress(group, rank, value)`."""
        self._results.put(("progress", (self.group, self.rank), value))


def _context(env):
    """The forkserver where a rank's environment is this process's (plus nothing new), else spawn: a forked
    rank shares torch as the server loaded it, so a variable read at load time could not take effect."""
    import torch.multiprocessing as mp

    if any(os.environ.get(k) != v for k, v in (env or {}).items()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _worker(key, world_size, port, fn, args, results, pg_timeout_s, env, lockstep):
    group, rank = key
    # the caller's environment now, not the one the forkserver started with
    os.environ.clear()
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        if lockstep is None:
            out = fn(rank, world_size, *args)
        else:
            out = fn(rank, world_size, Lockstep(lockstep, results, group, rank), *args)
        results.put(("done", key, out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent process
        if lockstep is not None:
            lockstep.abort()  # the other groups stop waiting for this one
        results.put(("failed", key, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _spawn(fn, groups: Sequence, world_size: int, args, pg_timeout_s: float, env, lockstep: bool):
    """Start `world_size` processes per group (one gloo group, one port each): (processes by (group, rank),
    results queue, barrier or None)."""
    ctx = _context(env)
    env = {**os.environ, **(env or {})}
    results = ctx.Queue()
    barrier = ctx.Barrier(len(groups) * world_size) if lockstep else None
    procs = {}
    for group in groups:
        port = _free_port()
        for r in range(world_size):
            procs[group, r] = ctx.Process(target=_worker, daemon=True, args=(
                (group, r), world_size, port, fn, args, results, pg_timeout_s, env, barrier))
    for p in procs.values():
        p.start()
    return procs, results, barrier


def _collect(procs: Dict, results, timeout: float, *, stop_on_death: bool, barrier=None,
             on_progress: Optional[Callable] = None):
    """Results and failures by (group, rank) until every process answered, one died (`stop_on_death`),
    or `timeout` seconds passed; then the processes are joined (killed after 5 s). A process that
    exits without answering is a failure; with a barrier, it is aborted so the others stop waiting."""
    outs, failures, died = {}, {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(outs) + len(failures) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                kind, key, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [k for k, p in procs.items() if k not in outs and k not in failures and not p.is_alive()
                        and p.exitcode not in (0, None)]
                for k in dead:
                    failures[k] = f"process exited with code {procs[k].exitcode}"
                    died.append(k)
                if dead and barrier is not None:
                    barrier.abort()
                if dead and stop_on_death:
                    break
                continue
            if kind == "progress":
                if on_progress is not None:
                    on_progress(*key, value)
            else:
                (outs if kind == "done" else failures)[key] = value
    finally:
        for p in procs.values():
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return outs, failures, died


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout_s: float = 120.0, env=None):
    procs, results, _ = _spawn(fn, [None], world_size, args, pg_timeout_s, env, lockstep=False)
    outs, failures, died = _collect(procs, results, timeout, stop_on_death=True)
    outs = {r: v for (_, r), v in outs.items()}
    if died:
        ranks = [r for _, r in died]
        raise RankFailed(f"ranks {ranks} died with exit codes {[procs[None, r].exitcode for r in ranks]}")
    failures = {r: v for (_, r), v in failures.items()}
    if len(outs) + len(failures) < world_size:
        missing = sorted(set(range(world_size)) - set(outs) - set(failures))
        raise RankFailed(f"ranks {missing} did not finish within {timeout}s; failures so far: {failures}")
    if failures:
        first = min(failures)
        raise RankFailed(f"rank {first} raised:\n{failures[first]}" +
                         (f"\n(also failed: ranks {sorted(failures)})" if len(failures) > 1 else ""))
    return [outs[r] for r in range(world_size)]


def run_ranks_allow_failures(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout_s: float = 120.0, env=None):
    """Like run_ranks, but returns ([(ok, value_or_traceback)] by rank) so fault tests can inspect every rank."""
    procs, results, _ = _spawn(fn, [None], world_size, args, pg_timeout_s, env, lockstep=False)
    outs, failures, _ = _collect(procs, results, timeout, stop_on_death=False)
    got = {**{k: (False, v) for k, v in failures.items()}, **{k: (True, v) for k, v in outs.items()}}
    return [got.get((None, r), (False, "no result before the test's timeout")) for r in range(world_size)]


def run_groups(fn, groups: Sequence[str], world_size: int, *args, timeout: float = 300.0,
               pg_timeout_s: float = 120.0, env=None, on_progress: Optional[Callable] = None) -> Dict[str, list]:
    """Run `fn(rank, world_size, lockstep, *args)` on `world_size` ranks of every group at the same time.

    Each group has its own gloo process group; `lockstep` (a `Lockstep`, with `.group` and `.rank`) is
    shared by all processes, so groups can meet between steps and report progress
    (`on_progress(group, rank, value)` runs in the caller). Returns {group: [result by rank]}. A
    failure releases every waiting process and is raised here (RankFailed) with its traceback: the
    first that is not another process's BrokenBarrierError.
    """
    procs, results, barrier = _spawn(fn, list(groups), world_size, args, pg_timeout_s, env, lockstep=True)
    outs, failures, _ = _collect(procs, results, timeout, stop_on_death=False, barrier=barrier,
                                 on_progress=on_progress)
    if failures:  # the first real error, not a group that stopped because another one broke the barrier
        key = next((k for k, v in failures.items() if "BrokenBarrierError" not in v), next(iter(failures)))
        raise RankFailed(f"{key[0]} rank {key[1]} failed:\n{failures[key]}")
    late = sorted(set(procs) - set(outs))
    if late:
        raise RankFailed(f"{late} (group, rank) did not finish within {timeout:.0f}s")
    return {g: [outs[g, r] for r in range(world_size)] for g in groups}


def run_ranks_until(fn, world_size: int, *args, ranks, timeout: float = 120.0, pg_timeout_s: float = 120.0, env=None):
    """Fault tests: run like `run_ranks`, return {rank: (ok, value_or_traceback, seconds)} once every rank in
    `ranks` reported (or died, or `timeout` passed), then SIGKILL every process still there (stopped or hung).

    Seconds count from the start of the processes; a rank that did not report is missing from the result.
    """
    start = time.monotonic()
    procs, results, _ = _spawn(fn, [None], world_size, args, pg_timeout_s, env, lockstep=False)
    got, wanted = {}, set(ranks)
    try:
        while not wanted <= set(got) and time.monotonic() - start < timeout:
            try:
                kind, (_, rank), value = results.get(timeout=0.5)
                if kind != "progress":
                    got[rank] = (kind == "done", value, time.monotonic() - start)
            except queue.Empty:
                for r in wanted - set(got):
                    if not procs[None, r].is_alive():
                        got[r] = (False, f"process exited with code {procs[None, r].exitcode}",
                                  time.monotonic() - start)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
        for p in procs.values():
            p.join(timeout=5)
    return got
