"""Run a function on N real torch.distributed gloo processes and collect what each returns.

`run_ranks(fn, world_size, *args)` spawns `world_size` processes, each with a
default gloo process group, `torch.set_num_threads(1)` (several ranks share two
cores), calls `fn(rank, world_size, *args)` and returns the list of results in
rank order. An exception on any rank is re-raised here with that rank's
traceback; a rank that neither returns nor raises within `timeout` fails the
test instead of hanging it. `fn` must be a module-level function (spawn pickles
it by name).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results, pg_timeout_s, env):
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        out = fn(rank, world_size, *args)
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - forwarded to the test process
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class RankFailed(RuntimeError):
    pass


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout_s: float = 120.0, env=None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env = dict(env or {})
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout_s, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outs, failures = {}, {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(outs) + len(failures) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(outs) - set(failures))
                raise RankFailed(f"ranks {missing} did not finish within {timeout}s; failures so far: {failures}")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outs and r not in failures
                        and p.exitcode not in (0, None)]
                if dead:
                    raise RankFailed(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}")
                continue
            (outs if ok else failures)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if failures:
        first = min(failures)
        raise RankFailed(f"rank {first} raised:\n{failures[first]}" +
                         (f"\n(also failed: ranks {sorted(failures)})" if len(failures) > 1 else ""))
    return [outs[r] for r in range(world_size)]


def run_ranks_allow_failures(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout_s: float = 120.0, env=None):
    """Like run_ranks, but returns ([(ok, value_or_traceback)] by rank) so fault tests can inspect every rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout_s, dict(env or {})), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    got = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(got) < world_size:
            left = (deadline - datetime.datetime.now()).total_seconds()
            if left <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
                got[rank] = (ok, value)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in got and not p.is_alive() and p.exitcode not in (0, None):
                        got[r] = (False, f"process exited with code {p.exitcode}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [got.get(r, (False, "no result before the test's timeout")) for r in range(world_size)]


def run_ranks_until(fn, world_size: int, *args, ranks, timeout: float = 120.0, pg_timeout_s: float = 120.0, env=None):
    """Fault tests: run like `run_ranks`, return {rank: (ok, value_or_traceback, seconds)} once every rank in
    `ranks` reported (or died, or `timeout` passed), then SIGKILL every process still there (stopped or hung).

    Seconds count from the start of the processes; a rank that did not report is missing from the result.
    """
    import time

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, pg_timeout_s, dict(env or {})),
                         daemon=True) for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    got, wanted = {}, set(ranks)
    try:
        while not wanted <= set(got) and time.monotonic() - start < timeout:
            try:
                rank, ok, value = results.get(timeout=0.5)
                got[rank] = (ok, value, time.monotonic() - start)
            except queue.Empty:
                for r in wanted - set(got):
                    if not procs[r].is_alive():
                        got[r] = (False, f"process exited with code {procs[r].exitcode}", time.monotonic() - start)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
    return got
