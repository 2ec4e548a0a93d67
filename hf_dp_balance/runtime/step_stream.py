"""The background thread of one pass of a `BalancedLoader` over its raw micro-batches, and its bounded queue.

The thread prepares, gathers, plans, exchanges and packs each step through the public `StepPhases` protocol
(the all-to-all `BalancedLoader` and the dispatching `DispatchedLoader` implement it) and queues the packed micro-batches, at most `prefetch_steps` ahead. It stops only while
waiting on a full queue, never between collectives, so ranks that consume the same steps stop at the same
step; a local failure before the gather is told to the peers at that gather (cap, plan and collate
failures are agreed within the step), and any failure reaches the consumer's thread with its traceback.
While any stream is open the run's one `Watchdog` runs its liveness rounds (runtime/watchdog.py).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable, Iterator, List, Optional, Protocol, Tuple

from hf_dp_balance.runtime.exchange import ExchangeError, SampleExchange
from hf_dp_balance.runtime.step_rows import Prepared, StepStats


class StepPhases(Protocol):
    """What the thread stage asks of the step phases, and all it asks (collectives in the order called)."""

    config: Any               # DPBalanceConfig: prefetch_steps, lookahead_steps, timeout_s
    step_offset: int          # the user's step of the stream's first step
    exchange: SampleExchange  # rank, report_failure

    def waits_for_model(self) -> bool:
        """Balancing is on but no cost model is set yet (the stage then stays one step ahead)."""

    def prepare_step(self, step: int, pull: Callable[[], Optional[list]]) -> Prepared:
        """Pull and describe one step's samples (local: no collective)."""

    def run_step(self, step: int, prep: Optional[Prepared], error: Optional[str]):
        """The step's collectives: (packed micro-batches, StepStats), or None at the end of the data; `error`
        (a local failure before the gather) is told to every rank at its gather."""

    def run_window(self, step0: int, preps: List[Prepared], error: Optional[str]) -> Iterator:
        """Look-ahead over len(preps) steps: yields run_step's results in step order, None at the end."""

    def record_stats(self, stats: StepStats) -> None:
        """A step was handed to the consumer (main thread)."""


def named_failure(exc: BaseException, step: int, rank: int) -> BaseException:
    """`exc` when its text already names where it happened (the library's own errors), else a RuntimeError
    whose headline says the step, the rank and the exception's type (a bare KeyError says only 'input_ids')."""
    text = str(exc)
    if isinstance(exc, ExchangeError) or text.startswith("step ") or "hf_dp_balance" in text.split("\n", 1)[0]:
        return exc
    named = RuntimeError(f"step {step}, rank {rank}: {type(exc).__name__}: {text}")
    named.__cause__ = exc
    return named


class StepStream:
    """The background thread of one pass over a raw micro-batch iterator, and its bounded queue."""

    def __init__(self, loader: StepPhases, source: Iterator, step_limit: Optional[int], watchdog=None):
        self.loader = loader
        self.source = source
        self.step_limit = step_limit
        self.first_step = loader.step_offset  # the user's step of this pass's first step
        self.rank = loader.exchange.rank
        self._queue: "queue.Queue[tuple]" = queue.Queue(maxsize=loader.config.prefetch_steps)
        self._stop = threading.Event()
        self._done = False
        self.consumed = 0  # steps handed to the consumer so far (the stream's step index of the next one)
        self._first_error: Optional[BaseException] = None
        self._thread_error: Optional[BaseException] = None  # what the thread failed with (for the watchdog)
        self._error_taken = False  # the consumer took an error or closed the stream: nothing to end here
        # First pull in the caller's thread (see BalancedLoader.open_stream).
        self._peeked: List[Any] = []
        self._exhausted = False
        if step_limit is None or step_limit > 0:
            try:
                self._peeked.append(next(source))
            except StopIteration:
                self._exhausted = True
        self._thread = threading.Thread(target=self._main, name="hf_dp_balance-exchange", daemon=True)
        self._thread.start()
        self._watchdog = self._liveness = watchdog
        self._watch_token = watchdog.start(self.describe, lambda: self._error_taken) if watchdog is not None else None

    @property
    def done(self) -> bool:
        """The consumer has taken the stream's end (or its error)."""
        return self._done

    def describe(self) -> Tuple[str, str]:
        """("step S, rank R" of the step in training, the thread's error or ""): the watchdog's context."""
        where = f"step {self.first_step + max(0, self.consumed - 1)}, rank {self.rank}"
        return where, "" if self._thread_error is None else f"; the exchange thread failed: {self._thread_error}"

    def _pull(self) -> Optional[list]:
        if self._peeked:
            return self._peeked.pop()
        if self._exhausted:
            return None
        try:
            return next(self.source)
        except StopIteration:
            self._exhausted = True
            return None

    def _put(self, item: tuple) -> bool:
        """Queue `item`; False only when the queue is full and the stream was closed.

        The thread stops only here, never between collectives: ranks that consume
        the same number of steps then all stop at the same step (the one that
        found the queue full), and no rank is left waiting in a collective.
        """
        while True:
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self._stop.is_set():
                    return False

    def _wait_for_model_or_consumer(self) -> bool:
        """Until a cost model is set, stay one step ahead only; False when the stream was closed meanwhile.

        Without a model nothing is planned, so running `prefetch_steps` ahead would only mean more steps
        prepared without it when the fit lands: planning then starts with step warmup_steps + 2 instead
        of warmup_steps + prefetch_steps + 2. Every rank consumes the same steps, so every rank's thread
        leaves this wait for the same step, and a closed stream stops every rank at the same step (as in
        `_put`).
        """
        loader = self.loader
        while loader.waits_for_model() and not self._queue.empty():
            if self._stop.is_set():
                return False
            time.sleep(0.002)
        return True

    def _main(self) -> None:
        loader = self.loader
        step = first = self.first_step
        pending: Optional[Tuple[BaseException, str]] = None  # a local failure, told to the peers at the next gather
        try:
            while self.step_limit is None or step - first < self.step_limit:
                if not self._wait_for_model_or_consumer():
                    return
                span = max(1, loader.config.lookahead_steps)  # steps prepared and gathered together
                if self.step_limit is not None:
                    span = min(span, self.step_limit - (step - first))
                resumed = loader.resume_window_steps() if step == first and hasattr(loader, "resume_window_steps") else 0
                if resumed:  # a resume inside a window reads the whole window again, whatever the step limit
                    span = resumed
                preps: List[Prepared] = []
                if pending is None:
                    try:
                        for j in range(span):
                            preps.append(loader.prepare_step(step + j, self._pull))
                    except Exception as exc:  # noqa: BLE001 - forwarded below
                        pending = (named_failure(exc, step + len(preps), self.rank), traceback.format_exc())
                if pending is not None:  # no collective of this step has started: told at its gather
                    loader.exchange.report_failure(step, repr(pending[0]))
                    try:
                        loader.run_step(step, None, f"{type(pending[0]).__name__}: {pending[0]}")
                    except ExchangeError:
                        pass  # the gather raises on every rank; here the local cause is the better error
                    raise pending[0]
                ended = False
                try:
                    if span == 1:
                        result = loader.run_step(step, preps[0], None)
                        results, ended = ([] if result is None else [result]), result is None
                        results = iter(results)
                    else:
                        results = loader.run_window(step, preps, None)
                    for result in results:
                        if result is None:
                            ended = True
                            break
                        if not self._put(("step", result[0], result[1])):
                            return
                        step += 1
                except ExchangeError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the step's collectives have started: raise now
                    # The peers are inside this step's collectives: going on to the next step's gather would
                    # meet theirs out of order. The note in the store names this rank in their error.
                    loader.exchange.report_failure(step, f"{type(exc).__name__}: {exc}")
                    raise named_failure(exc, step, self.rank) from exc
                if ended:
                    break
            self._put(("end",))
        except BaseException as exc:  # noqa: BLE001 - reaches the main thread with its traceback
            self._thread_error = exc
            self._put(("error", exc, traceback.format_exc()))

    def wait_until_queued(self, steps: int, timeout_s: float) -> None:
        """Return once `steps` steps are queued, the thread has ended (data over, or failed: `next_step`
        says which), or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while self._queue.qsize() < steps and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.002)

    def next_step(self) -> Optional[list]:
        """The next step's packed micro-batches, or None at the end; re-raises a thread failure here."""
        if self._liveness is not None:  # on_fatal="raise": a peer was found gone while this rank trained
            self._liveness.raise_if_fatal()
        if self._done:
            return None
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("hf_dp_balance: the exchange thread stopped without a result")
        wait = time.perf_counter() - t0
        if item[0] == "end":
            self._done = True
            self._stop_watchdog()
            return None
        if item[0] == "error":
            self._done = True
            self._error_taken = True
            exc, tb = item[1], item[2]
            raise RuntimeError(f"hf_dp_balance BalancedLoader background thread failed: {exc}\n"
                               f"--- thread traceback ---\n{tb}") from exc
        _, batches, stats = item
        stats.wait_s = wait
        self.consumed = stats.step + 1 - self.first_step
        self.loader.record_stats(stats)
        return batches

    def close(self) -> None:
        """Stop the thread at its next full-queue wait; waits for the step in flight (its peers finish it too)."""
        self._stop.set()
        self._error_taken = True
        self._stop_watchdog()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.loader.config.timeout_s + 5.0)


    def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop(self._watch_token)  # the loader's other streams stay checked
            self._watchdog = None


__all__ = ["StepPhases", "StepStream", "named_failure"]
