"""`SideChannel`: every process group, thread and store note one balanced training run creates.

One per run, over one data-parallel group (`runtime.parallel.DataParallelGroup`). No side group spans more
than that data-parallel slice: under a dp x tp / cp mesh each slice has its own groups, and what the slices
must agree on goes through the rendezvous store. Every rank creates its groups in the same order, all here,
at one moment:

1. the exchange group (gloo, the loader's background thread: metadata gather, payload all-to-all),
2. the control group (gloo, the main thread: per-step item counts, the cost-model fit, metrics),
3. the heartbeat group of the one `Watchdog` (the slice, when `config.watchdog`),
4. on demand, in the same order on every rank: the vision group (the backend of the default group: the
   vision exchange runs on the model's device) and one more exchange group per further loader.

Construction is all or nothing. Every process first takes the run's number from one store counter (the run
id, which namespaces every store key of the run), then the processes agree on the configuration (rank 0
publishes its `DPBalanceConfig`; a process whose config differs names its fields; every process raises the
same error naming the fields and the ranks), then they make the groups and agree that every process made
them; a failure on any process makes every process destroy what it made and raise one error naming the
ranks and their causes. Each agreement costs a process a few store round trips, whatever the world size.

Group names: where every slice is known (a device mesh, or no mesh), every process takes part in making each
slice's group, so torch names them from its per-process counter and a later run's groups never reuse an
earlier run's names (nor their rendezvous keys in the store). `close()` stops the watchdog and destroys the
groups in reverse order. One timeout (`config.timeout_s`) bounds every side collective and store wait.
`new_side_group` below is the only place `dist.new_group` is called.

What the slices share: the cost models are fitted in the slice that holds global rank 0; its first process
publishes each payload under the run's namespace, the first process of every other slice reads it and
broadcasts it in its slice (`StoreRelay`, `share_from_first`).
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from hf_dp_balance.config import DPBalanceConfig, config_differences, config_digest
from hf_dp_balance.runtime.exchange import ExchangeError, SampleExchange, failure_detail
from hf_dp_balance.runtime.logs import get_logger
from hf_dp_balance.runtime.parallel import DataParallelGroup
from hf_dp_balance.runtime.watchdog import Watchdog

logger = get_logger(__name__)
STORE_ROOT = "hf_dp_balance/"
_RUN_COUNTER = STORE_ROOT + "runs"
# At the end of a run the store's host waits at most this long for slower slices to read its last models (a
# reader that died must not hold the end of the run for timeout_s).
RELAY_DRAIN_S = 30.0
# From this many ranks in a slice, side groups whose connections are all made at creation are worth a word.
EAGER_NOTE_SIZE = 256


class SideChannelError(RuntimeError):
    """Creating a run's side channel failed or the processes disagree; raised alike on every process."""


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def new_side_group(data_parallel: DataParallelGroup, timeout_s: float, backend: str = "gloo", desc: str = "side"):
    """A process group over `data_parallel`'s ranks. The one call of `dist.new_group` in the library.

    The whole world: every process calls this. Several slices, all known (`data_parallel.slices`): every
    process calls this and takes part in making every slice's group in the slices' order (a process outside
    a slice only counts it), so names come from torch's per-process counter and never repeat. Only this
    slice known: its members alone call this (local synchronisation; torch derives the name from the ranks
    and the number of live groups, so a later run may reuse a name: see docs/scale.md)."""
    import torch.distributed as dist

    timeout = _timedelta(timeout_s)
    world = dist.get_world_size()
    if data_parallel.size == world:
        return dist.new_group(backend=backend, timeout=timeout, group_desc=desc)
    if data_parallel.slices:
        mine = None
        for ranks in data_parallel.slices:
            group = dist.new_group(ranks=list(ranks), backend=backend, timeout=timeout, group_desc=desc)
            if dist.get_rank() in ranks:
                mine = group
        return mine
    return dist.new_group(ranks=list(data_parallel.ranks), backend=backend, timeout=timeout,
                          use_local_synchronization=True, group_desc=desc)


def destroy_group(group) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - already gone with the default group
        pass


def default_store():
    """The rendezvous store of the default process group (None without one)."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - not initialized
        return None


def agree_through_store(store, key: str, world: int, rank: int, note: Optional[str], timeout_s: float,
                        what: str) -> Dict[int, str]:
    """{rank: note} of every process that passed a note, the same on every process, once all `world` processes
    have arrived. A process's cost: one append (its note, if any), one counter add, one wait, one or two reads,
    whatever `world` is. Raises `SideChannelError` naming how many arrived when not all do within `timeout_s`."""
    notes, arrived, done = f"{key}/notes", f"{key}/arrived", f"{key}/done"
    if note is not None:
        store.append(notes, (json.dumps([rank, note]) + "\n").encode("utf-8"))
    if store.add(arrived, 1) == world:
        store.set(done, b"1")
    try:
        store.wait([done], _timedelta(timeout_s))
    except Exception as exc:  # noqa: BLE001 - a process never arrived
        count = store.add(arrived, 0)
        raise SideChannelError(f"hf_dp_balance: rank {rank}: {what}: {count} of {world} processes arrived within "
                               f"timeout_s={timeout_s:g}s (the others died, hang, or did not create the run's "
                               f"BalanceSession / SideChannel at the same point): {type(exc).__name__}") from exc
    if not store.check([notes]):
        return {}
    found = {}
    for line in store.get(notes).decode("utf-8", "replace").splitlines():
        if line:
            r, text = json.loads(line)
            found[int(r)] = str(text)
    return found


def open_files_note() -> str:
    """This process's open files and its limit, and what to do about it."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:
        held = -1
    return (f"{held} files open, limit {soft}: raise `ulimit -n` or set TORCH_GLOO_LAZY_INIT=1 in the launcher's "
            f"environment, docs/scale.md")


class StoreRelay:
    """Objects from the first process of the fitting slice to the first process of every other slice,
    through the rendezvous store under the run's namespace: publication n under key `<prefix><n>`, counted
    alike on every process (publications happen at the same steps everywhere). Each reader counts itself in
    `<key>/read`, so the sender (global rank 0, which usually hosts the store) can wait at the end of the run
    until its last publication was read (`drain`) instead of taking the store away from a slower slice."""

    def __init__(self, store, prefix: str, sends: bool, timeout_s: float, readers: int = 1):
        self.store, self.prefix, self.sends, self.timeout_s = store, prefix, sends, float(timeout_s)
        self.readers = int(readers)
        self._count = 0

    def _key(self) -> str:
        key = f"{self.prefix}{self._count}"
        self._count += 1
        return key

    def send(self, obj) -> None:
        self.store.set(self._key(), pickle.dumps(obj))

    def receive(self):
        key = self._key()
        try:
            self.store.wait([key], _timedelta(self.timeout_s))
        except Exception as exc:  # noqa: BLE001
            raise ExchangeError(f"hf_dp_balance: {key}: not published by the fitting slice's first process "
                                f"within timeout_s={self.timeout_s:g}s: {type(exc).__name__}") from exc
        obj = pickle.loads(self.store.get(key))
        self.store.add(f"{key}/read", 1)
        return obj

    def drain(self, deadline_s: float) -> bool:
        """Sender: wait (at most `deadline_s`) until every reader has read the last publication; True if so."""
        if not self.sends or self._count == 0 or self.readers < 1:
            return True
        key, end = f"{self.prefix}{self._count - 1}/read", time.monotonic() + deadline_s
        while time.monotonic() < end:
            if int(self.store.add(key, 0)) >= self.readers:
                return True
            time.sleep(0.02)
        return False


def share_from_first(obj, group, rank: int, world: int, relay: Optional[StoreRelay]):
    """The fitting slice's first process's `obj` on every process: sent to the store first (other slices),
    then broadcast in each slice on `group` from its first process (`rank`/`world`: in `group`). Without a
    relay (one slice): the broadcast alone."""
    import torch.distributed as dist

    if relay is not None and rank == 0:
        if relay.sends:
            relay.send(obj)
        else:
            obj = relay.receive()
    if world > 1:
        box = [obj]
        dist.broadcast_object_list(box, group_src=0, group=group)
        obj = box[0]
    return obj


class SideChannel:
    """The side groups, the watchdog and the store namespace of one run (see the module docstring).

    Create it on every process of the job at the same moment (it creates process groups); `close()` on every
    process at the end of the run. `on_fatal(message)`: what the watchdog does when a peer is gone (default:
    `config.on_fatal`: end the process, or keep the message for `raise_if_fatal` in the main thread).
    Raises `SideChannelError`, the same on every process, when the configs differ or a process cannot make
    its groups; nothing it made is left behind then.
    """

    def __init__(self, data_parallel: Optional[DataParallelGroup] = None, config: Optional[DPBalanceConfig] = None,
                 *, on_fatal: Optional[Callable[[str], None]] = None):
        import torch.distributed as dist

        self.config = config if config is not None else DPBalanceConfig()
        self.timeout_s = float(self.config.timeout_s)
        self.data_parallel = data_parallel if data_parallel is not None else DataParallelGroup.world()
        self.world = DataParallelGroup.world()
        self.distributed = dist.is_available() and dist.is_initialized()
        self._groups: List[Any] = []  # creation order; close() destroys in reverse
        self.spans_world = self.data_parallel.size == self.world.size
        # The slice whose first process fits the cost models for every slice: the one holding global rank 0.
        self.fitting_slice = 0 in self.data_parallel.ranks
        self.exchange_group = self.control_group = None
        self.watchdog: Optional[Watchdog] = None
        self._vision_group = None
        self._exchanges_made = 0
        self._relays: List[StoreRelay] = []
        self._closed = False
        self._store = default_store() if self.distributed else None
        if self._store is None:  # a single process without torch.distributed (a one-process Trainer)
            self.run_id = uuid.uuid4().hex[:12]
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        # Every process adds one per run: the run's number is the same on every process and never repeats.
        self.run_id = str((int(self._store.add(_RUN_COUNTER, 1)) - 1) // world)
        self._agree_config(rank, world)  # before any group: the config decides how many there are
        if rank == 0 and self.data_parallel.size >= EAGER_NOTE_SIZE and os.environ.get("TORCH_GLOO_LAZY_INIT") != "1":
            logger.warning("dp_balance: each side group connects its %d ranks when it is made (%d file descriptors "
                           "a group on every process); TORCH_GLOO_LAZY_INIT=1 in the launcher's environment makes "
                           "gloo connect only the peers a group uses (docs/scale.md)", self.data_parallel.size,
                           self.data_parallel.size + 3)
        failure = None
        try:
            self.exchange_group = self._new(self.data_parallel, desc="exchange")
            self.control_group = self._new(self.data_parallel, desc="control")
            if self.config.watchdog and self.data_parallel.size > 1:
                fatal = on_fatal if on_fatal is not None else (None if self.config.on_fatal == "exit" else "raise")
                self.watchdog = Watchdog(self._new(self.data_parallel, desc="heartbeat"), self.timeout_s,
                                         self.config.heartbeat_s, self.config.error_grace_s, fatal)
        except Exception as exc:  # noqa: BLE001 - agreed below, raised on every process alike
            failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            if "Too many open files" in str(exc):
                failure += f" ({open_files_note()})"
        try:
            failed = agree_through_store(self._store, f"{self.store_namespace}construction", world, rank, failure,
                                         self.timeout_s, "creating the side groups")
        except SideChannelError:
            self.close()
            raise
        if failed:
            self.close()
            raise SideChannelError(f"hf_dp_balance: creating the side channel failed on rank(s) {sorted(failed)}; "
                                   f"every process destroyed its side groups: "
                                   f"{failure_detail(failed)}")

    def _agree_config(self, rank: int, world: int) -> None:
        """Rank 0's config to every process; every process raises the same error naming the fields that differ
        and the ranks, when any process's config is not rank 0's."""
        mine = self.config.to_dict()
        key = f"{self.store_namespace}config/rank0"
        if rank == 0:
            self._store.set(key, json.dumps({"digest": config_digest(self.config), "fields": mine},
                                            default=repr).encode("utf-8"))
        note = None
        try:
            self._store.wait([key], _timedelta(self.timeout_s))
            theirs = json.loads(self._store.get(key).decode("utf-8"))
            if theirs["digest"] != config_digest(self.config):
                mine_json = json.loads(json.dumps(mine, default=repr))
                note = ", ".join(f"{name}={mine_json.get(name)!r} (rank 0: {theirs['fields'].get(name)!r})"
                                 for name in config_differences(mine_json, theirs["fields"]))
        except Exception as exc:  # noqa: BLE001 - rank 0 never published: the agreement below names the count
            note = f"rank 0's config unreadable: {type(exc).__name__}"
        differ = agree_through_store(self._store, f"{self.store_namespace}config", world, rank, note,
                                     self.timeout_s, "agreeing the configuration")
        if differ:
            raise SideChannelError(f"hf_dp_balance: DPBalanceConfig differs across processes (every process must "
                                   f"run with the same settings, HF_DP_BALANCE_* variables included): "
                                   f"{failure_detail(differ)}")

    # -- groups -------------------------------------------------------------------------------
    def _new(self, data_parallel: DataParallelGroup, backend: str = "gloo", desc: str = "side"):
        group = new_side_group(data_parallel, self.timeout_s, backend, f"hf_dp_balance/{self.run_id}/{desc}")
        self._groups.append(group)
        return group

    @property
    def groups(self) -> List[Any]:
        """Every process group this channel holds, in creation order."""
        return list(self._groups)

    @property
    def store_namespace(self) -> str:
        """Prefix of this run's keys (failure notes, agreements, published models) in the rendezvous store."""
        return f"{STORE_ROOT}{self.run_id}/"

    def relay(self, name: str) -> Optional[StoreRelay]:
        """A new store relay between slices (None with one slice, which needs none); a collective in that every
        process asks for its relays in the same order."""
        if self.spans_world or self._store is None:
            return None
        # numbered per channel (every process asks in the same order): a second relay of one name never
        # reads the first one's keys
        slices = len(self.data_parallel.slices) or self.world.size // self.data_parallel.size
        relay = StoreRelay(self._store, f"{self.store_namespace}{name}/{len(self._relays)}/", self.fitting_slice,
                           self.timeout_s, readers=slices - 1)
        self._relays.append(relay)
        return relay

    def from_rank0(self, obj, name: str):
        """Global rank 0's `obj` on every process (the others pass anything): `share_from_first` on the control
        group, through the store between slices. A collective of every process."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        return share_from_first(obj, self.control_group, dist.get_rank(self.control_group),
                                self.data_parallel.size, self.relay(name))

    def exchange(self) -> SampleExchange:
        """A `SampleExchange` for one loader: the first on the exchange group made at creation, each further
        one on a new group (made here: every rank prepares its loaders in the same order)."""
        if not self.distributed:
            raise ValueError("SideChannel.exchange: the sample exchange needs an initialized torch.distributed")
        group = self.exchange_group if self._exchanges_made == 0 else self._new(self.data_parallel, desc="exchange")
        self._exchanges_made += 1
        return SampleExchange(self.timeout_s, group=group, namespace=self.store_namespace)

    def vision_group(self):
        """The vision exchange's group (made at the first call, on every rank at the same point)."""
        import torch.distributed as dist

        if self._vision_group is None:
            self._vision_group = self._new(self.data_parallel, dist.get_backend(), desc="vision")
        return self._vision_group

    # -- fatal errors in the main thread --------------------------------------------------------
    def raise_if_fatal(self) -> None:
        """With `on_fatal="raise"`: the watchdog's message as an error, in the calling (main) thread."""
        if self.watchdog is not None:
            self.watchdog.raise_if_fatal()

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the watchdog, destroy every group in reverse order of creation (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.watchdog is not None:
            self.watchdog.stop()
        for relay in self._relays:  # the store outlives this run on the sender until slower slices have read
            try:
                if not relay.drain(min(self.timeout_s, RELAY_DRAIN_S)):
                    logger.warning("dp_balance: %s: not read by every other slice within %gs of the end of the run",
                                   relay.prefix, min(self.timeout_s, RELAY_DRAIN_S))
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to wait for
                pass
        for group in reversed(self._groups):
            if group is not None:
                destroy_group(group)
        self._groups = []

    @property
    def closed(self) -> bool:
        return self._closed


__all__ = ["STORE_ROOT", "SideChannel", "SideChannelError", "StoreRelay", "agree_through_store", "default_store",
           "destroy_group", "new_side_group", "open_files_note", "share_from_first", "RELAY_DRAIN_S"]
