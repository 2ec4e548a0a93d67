"""`SideChannel`: every process group, thread and store note one balanced training run creates.

One per run, over one data-parallel group (`runtime.parallel.DataParallelGroup`). Every rank must
create its groups in the same order, so they are all created here, in one fixed order, at one moment:

1. the exchange group (gloo, the loader's background thread: metadata gather, payload all-to-all),
2. the control group (gloo, the main thread: per-step item counts, the cost-model fit, metrics),
3. the fit group: the control group, or, when the data-parallel group is one slice of a larger mesh
   (tp / cp peers), a group over every process, so that every slice plans with the same models,
4. the heartbeat group of the one `Watchdog` (every process, when `config.watchdog`),
5. on demand, in the same order on every rank: the vision group (the backend of the default group: the
   vision exchange runs on the model's device) and one more exchange group per further loader.

`close()` stops the watchdog and destroys them in reverse order. Failure notes in the rendezvous
store are namespaced by a run id agreed at creation (rank 0's, broadcast), so a second run in the
same process never names the ranks that failed in an earlier one. One timeout (`config.timeout_s`)
bounds every side collective. The collectives of the library take their group as a parameter and
never create one: `new_side_group` below is the only place `dist.new_group` is called.
"""

from __future__ import annotations

import datetime
import uuid
from typing import Any, Callable, List, Optional

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.runtime.exchange import SampleExchange
from hf_dp_balance.runtime.parallel import DataParallelGroup
from hf_dp_balance.runtime.watchdog import Watchdog


def new_side_group(data_parallel: DataParallelGroup, timeout_s: float, backend: str = "gloo"):
    """A process group over `data_parallel`'s ranks (only its members call this: local synchronisation
    when it is not the whole world). The one call of `dist.new_group` in the library."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=float(timeout_s))
    if data_parallel.size == dist.get_world_size():
        return dist.new_group(backend=backend, timeout=timeout)
    return dist.new_group(ranks=list(data_parallel.ranks), backend=backend, timeout=timeout,
                          use_local_synchronization=True)


def destroy_group(group) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - already gone with the default group
        pass


class SideChannel:
    """The side groups, the watchdog and the failure-note namespace of one run (see the module docstring).

    Create it on every process of the job at the same moment (it creates process groups); `close()` on every
    process at the end of the run. `on_fatal(message)`: what the watchdog does when a peer is gone (default:
    `config.on_fatal`: end the process, or keep the message for `raise_if_fatal` in the main thread).
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
        # A single process without torch.distributed (a one-process Trainer): no groups, nothing to agree.
        self.exchange_group = self._new(self.data_parallel) if self.distributed else None
        self.control_group = self._new(self.data_parallel) if self.distributed else None
        self.fit_group = self.control_group if self.spans_world else self._new(self.world)
        self.run_id = self._agree_run_id()
        self.watchdog: Optional[Watchdog] = None
        if self.config.watchdog and self.world.size > 1:
            fatal = on_fatal if on_fatal is not None else (None if self.config.on_fatal == "exit" else "raise")
            self.watchdog = Watchdog(self._new(self.world), self.timeout_s, self.config.heartbeat_s,
                                     self.config.error_grace_s, fatal)
        self._vision_group = None
        self._exchanges_made = 0
        self._closed = False

    # -- groups -------------------------------------------------------------------------------
    def _new(self, data_parallel: DataParallelGroup, backend: str = "gloo"):
        group = new_side_group(data_parallel, self.timeout_s, backend)
        self._groups.append(group)
        return group

    def _agree_run_id(self) -> str:
        """A fresh id, the same on every process (rank 0's, broadcast on the fit group)."""
        import torch.distributed as dist

        box = [uuid.uuid4().hex[:12]]
        if self.distributed and self.world.size > 1:
            dist.broadcast_object_list(box, group_src=0, group=self.fit_group)
        return str(box[0])

    @property
    def store_namespace(self) -> str:
        """Prefix of this run's failure notes in the rendezvous store."""
        return f"hf_dp_balance/{self.run_id}/"

    def exchange(self) -> SampleExchange:
        """A `SampleExchange` for one loader: the first on the exchange group made at creation, each further
        one on a new group (made here: every rank prepares its loaders in the same order)."""
        if not self.distributed:
            raise ValueError("SideChannel.exchange: the sample exchange needs an initialized torch.distributed")
        group = self.exchange_group if self._exchanges_made == 0 else self._new(self.data_parallel)
        self._exchanges_made += 1
        return SampleExchange(self.timeout_s, group=group, namespace=self.store_namespace)

    def vision_group(self):
        """The vision exchange's group (made at the first call, on every rank at the same point)."""
        import torch.distributed as dist

        if self._vision_group is None:
            self._vision_group = self._new(self.data_parallel, dist.get_backend())
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
        for group in reversed(self._groups):
            destroy_group(group)
        self._groups = []

    @property
    def closed(self) -> bool:
        return self._closed


__all__ = ["SideChannel", "destroy_group", "new_side_group"]
