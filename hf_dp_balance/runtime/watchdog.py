"""Liveness of the ranks while the main thread trains: a stopped or dead peer ends this process with our error.

A stopped rank holds its peers inside a training collective (DDP's all-reduce) until `ddp_timeout`
(30 min by default), and the exchange thread may be idle on its full queue, so no side collective ever
times out. The `Watchdog` runs a tiny all_reduce on its own gloo group every `heartbeat_s` while a stream
is open; when a round fails or times out (`timeout_s`), it waits `error_grace_s` for the main thread to
take the library's error itself, then logs one message naming the step, the rank and the phase, and
ends the process with exit code 1. Every rank leaves the rounds together: a closing rank says so in a
round and every rank stops after that round. `training_error` turns a distributed error raised by the
training step itself (a killed peer: gloo's "Connection reset by peer") into the library's error naming
the step, the rank and the phase. Details: docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional, Tuple, Union

import torch

from hf_dp_balance.runtime.exchange import ExchangeError, failure_detail, is_distributed_error
from hf_dp_balance.runtime.logs import get_logger

logger = get_logger(__name__)
FATAL_EXIT_CODE = 1
TRAINING_PHASE = "training step (DDP gradient all-reduce / forward-backward collective)"


def end_process(message: str) -> None:
    """The default fatal action: the message to the log (transformers' handler, or logging's last resort:
    stderr), then exit code 1 without clean-up (the main thread is stuck in a collective)."""
    logger.error(message)
    for handler in logging.getLogger().handlers + logger.handlers + getattr(logger.parent, "handlers", []):
        handler.flush()
    sys.stderr.flush()
    os._exit(FATAL_EXIT_CODE)


class Watchdog:
    """Heartbeat rounds on its own gloo group while a stream is open; `on_fatal(message)` when a peer is gone.

    `group`: the heartbeat group (the data-parallel slice; made by `runtime.side_channel.SideChannel`, which owns it).
    `describe()` gives the message's context: ("step S, rank R", the exchange thread's error or "");
    `taken()` tells whether the main thread has taken an error (then nothing is ended here).
    `on_fatal`: a callable, None (log and end the process: `end_process`) or "raise" (keep the message:
    `raise_if_fatal()` raises it in the main thread at its next step).
    """

    def __init__(self, group, timeout_s: float, heartbeat_s: float = 1.0, error_grace_s: float = 3.0,
                 on_fatal: Union[Callable[[str], None], str, None] = None):
        import torch.distributed as dist

        self._dist = dist
        self.timeout_s, self.heartbeat_s, self.error_grace_s = float(timeout_s), float(heartbeat_s), float(error_grace_s)
        self.fatal_message: Optional[str] = None
        if on_fatal == "raise":
            on_fatal = self._keep
        elif on_fatal is not None and not callable(on_fatal):
            raise ValueError(f"Watchdog(on_fatal={on_fatal!r}): a callable, None (end the process) or 'raise'")
        self.on_fatal = on_fatal or end_process
        self.rank = dist.get_rank()
        self.group = group
        self._closing = threading.Event()
        self._raised = threading.Event()  # the main thread raised the library's error itself (stand_down)
        self._thread: Optional[threading.Thread] = None
        # the live streams, oldest first: (token, describe, taken); the rounds run while one is live
        self._streams: list = []
        self._streams_lock = threading.Lock()

    def _keep(self, message: str) -> None:
        logger.error(message)
        self.fatal_message = message

    def raise_if_fatal(self) -> None:
        """The kept message (on_fatal="raise") as the library's error, in the calling (main) thread."""
        if self.fatal_message is not None:
            message, self.fatal_message = self.fatal_message, None
            raise ExchangeError(message)

    def start(self, describe: Callable[[], Tuple[str, str]], taken: Callable[[], bool]) -> object:
        """One more live stream (a loader's pass): the rounds run while any stream is live, so a stream that
        ends (an eval loader's) leaves the others checked. Returns the token `stop` takes. Every rank opens and
        ends its streams at the same points, so every rank counts alike."""
        token = object()
        with self._streams_lock:
            self._streams.append((token, describe, taken))
            if self._thread is not None and self._thread.is_alive() and not self._closing.is_set():
                return token
        self._halt()  # rounds that ended (a peer left them) are joined before new ones start
        self._closing.clear()
        self._raised.clear()
        self._thread = threading.Thread(target=self._rounds, args=(self._describe_live, self._taken_live),
                                        name="hf_dp_balance-watchdog", daemon=True)
        self._thread.start()
        return token

    def _newest_live(self):
        with self._streams_lock:
            return self._streams[-1] if self._streams else None

    def _describe_live(self) -> Tuple[str, str]:
        live = self._newest_live()
        return live[1]() if live is not None else (f"rank {self.rank}", "")

    def _taken_live(self) -> bool:
        live = self._newest_live()
        return live[2]() if live is not None else True

    @property
    def live_streams(self) -> int:
        """Streams started and not yet stopped."""
        with self._streams_lock:
            return len(self._streams)

    def _rounds(self, describe: Callable[[], Tuple[str, str]], taken: Callable[[], bool]) -> None:
        flag = torch.zeros(1, dtype=torch.int64)
        while True:
            flag.fill_(1 if self._closing.is_set() else 0)
            t0 = time.monotonic()
            try:
                self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self.group)
            except Exception as exc:  # noqa: BLE001 - a peer stopped, died or left without closing
                if self._closing.is_set():
                    return
                self._fatal(describe, taken, f"{type(exc).__name__} after {time.monotonic() - t0:.1f}s: "
                                             f"{str(exc).splitlines()[0] if str(exc) else ''}")
                return
            if int(flag.item()) > 0:  # some rank closed its stream: every rank stops after this round
                return
            self._closing.wait(self.heartbeat_s)

    def _fatal(self, describe: Callable[[], Tuple[str, str]], taken: Callable[[], bool], cause: str) -> None:
        deadline = time.monotonic() + self.error_grace_s
        while time.monotonic() < deadline:  # the main thread may still take our error and raise it itself
            if taken() or self._closing.is_set() or self._raised.is_set():
                return
            time.sleep(0.05)
        where, detail = describe()
        self.on_fatal(f"hf_dp_balance: {where}, phase liveness check: a peer stopped answering within "
                      f"timeout_s={self.timeout_s:g}s while this rank trained (it would wait in the training "
                      f"collective until ddp_timeout); ending this process (cause: {cause}){detail}")

    def stand_down(self) -> None:
        """The main thread raises the library's error itself: a failed round ends nothing (one message)."""
        self._raised.set()

    def stop(self, token: Optional[object] = None) -> None:
        """The stream of `token` ended (None: every stream, as at close); the rounds stop when no stream is live."""
        with self._streams_lock:
            self._streams = [] if token is None else [live for live in self._streams if live[0] is not token]
            if self._streams:
                return
        self._halt()

    def _halt(self) -> None:
        """Leave the rounds (every rank leaves after the next one); waits at most timeout_s + 2 s."""
        if self._thread is None:
            return
        self._closing.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout_s + 2.0)
        self._thread = None


def training_error(loader: Any, exc: BaseException, phase: str = TRAINING_PHASE,
                   step: Optional[int] = None) -> Optional[ExchangeError]:
    """The library's error for `exc`, raised by a training collective on this rank; None when `exc` is not a
    distributed failure (or there is no `BalancedLoader`): then the caller re-raises it untouched.

    Names the step (`step`, else the loader's stream: the step in training), the rank, `phase`, and the ranks
    that left a failure note in the store (at most 2 s; a killed rank leaves none). Tells the loader's
    watchdog to stand down: the caller raises this error (chained from `exc`), the only message.
    """
    if loader is None or not is_distributed_error(exc):
        return None
    exchange = loader.exchange
    stream = getattr(loader, "_active", None)
    if step is not None or stream is None:
        where = f"step {step if step is not None else '?'}, rank {exchange.rank}"
    else:
        where = stream.describe()[0]
    watchdog = getattr(loader, "_watchdog", None)
    if watchdog is not None:
        watchdog.stand_down()
    failed = exchange.reported_failures()
    who = f" (ranks that reported a failure: {failure_detail(failed)})" if failed else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ExchangeError(f"hf_dp_balance: {where}, phase {phase}: a peer died or failed{who}: "
                         f"{type(exc).__name__}: {first}")


@contextlib.contextmanager
def training_errors(loader: Any, phase: str = TRAINING_PHASE, step: Optional[Callable[[], int]] = None) -> Iterator[None]:
    """Run a training step's collectives: a distributed error inside comes out as `training_error`'s,
    chained `from` the original; any other exception passes through untouched. `step()`: the user's step."""
    try:
        yield
    except Exception as exc:
        error = training_error(loader, exc, phase, step() if step is not None else None)
        if error is None:
            raise
        raise error from exc


def named_training_call(call: Callable, loader: Callable[[], Any], step: Callable[[], int],
                        phase: str = TRAINING_PHASE) -> Callable:
    """`call` run inside `training_errors(loader(), phase, step)`: its distributed errors name the user's
    step, the rank and the phase. `functools.wraps` keeps `__wrapped__` (accelerate's `unwrap_model` walks
    that chain of a model's forward)."""
    @functools.wraps(call)
    def named(*args, **kwargs):
        with training_errors(loader(), phase, step):
            return call(*args, **kwargs)

    return named


__all__ = ["Watchdog", "end_process", "FATAL_EXIT_CODE", "TRAINING_PHASE",
           "named_training_call", "training_error", "training_errors"]
