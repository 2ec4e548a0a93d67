"""`BalancedDataLoader`: what `DPBalancer.prepare` returns, the loader a custom Accelerate loop iterates.

It composes with accelerate's prepared loader instead of patching it: the background exchange
thread iterates the `DataLoaderShard`, and this object yields the packed, balanced micro-batches,
already on the device, each with `num_items_in_batch` (the step's target tokens summed over the
data-parallel ranks). It owns the end-of-data state that `accelerator.accumulate()` reads: it is
the active dataloader of accelerate's `GradientState` while it is iterated, and its
`end_of_dataloader` turns True at the last micro-batch of the last step, on every rank alike (the
end of the data is decided collectively by the exchange). The shard's own flag, which flips when
the thread reads the last raw batch steps ahead, is never seen by `accumulate()`.

Guarantees: every rank yields the same number of micro-batches per step (so gradient sync falls on
the same micro-batch everywhere); `len`, `set_epoch` pass through; `state_dict` / `load_state_dict`
resume after the last completed step (no sample of a completed step trained twice).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import time

from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.runtime.stream_position import StreamPosition


def target_tokens(batch: dict) -> int:
    """Tokens that carry a loss in a packed micro-batch: labels[..., 1:] != -100 (Trainer's count)."""
    labels = batch.get("labels")
    if labels is None:
        return 0
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


class _RawSource:
    """The prepared loader's iterator as the exchange thread reads it, stopping at the loader's own end flag.

    Accelerate's `DataLoaderShard` sets `end_of_dataloader` right before it yields its last batch and
    unregisters itself from the process-wide `GradientState` on the next `next()`. Stopping there keeps
    that unregistration (and the epoch counter's increment) out of the thread: `finish()` runs it in
    the main thread at the end of the pass. Optionally skips the first `skip` micro-batches (resume).
    """

    def __init__(self, loader: Any, skip: int = 0):
        self._loader = loader
        self._iterator = None  # made at the first pull: in dispatch mode only rank 0 ever reads
        self._last = False
        self._skip = int(skip)

    def __iter__(self):
        return self

    def __next__(self):
        if self._iterator is None:
            self._iterator = iter(self._loader)
        while True:
            if self._last:
                raise StopIteration
            batch = next(self._iterator)
            if getattr(self._loader, "end_of_dataloader", False):
                self._last = True
            if self._skip > 0:
                self._skip -= 1
                continue
            return batch

    def finish(self) -> None:
        """Main thread, end of the pass: let the loader close its pass (unregister, count the epoch)."""
        if self._iterator is None:
            return
        if self._last:
            for _ in self._iterator:  # runs the loader's end-of-pass code; yields nothing more
                pass
        else:
            close = getattr(self._iterator, "close", None)
            if close is not None:
                close()


class BalancedDataLoader:
    """Iterate for packed, balanced micro-batches on the device; see the module docstring.

    `steps_source(raw_iterator)` yields each optimizer step's list of packed micro-batches (CPU);
    `prepared`: accelerate's prepared loader (len, set_epoch, dataset, ... pass through to it);
    `count_items(local_count) -> global count` sums over the data-parallel group;
    `recorder`: the step's timer (`runtime.fitter.StepRecorder`: `begin()` at the step's first micro-batch,
    `end()` after its last one came back; with the wall clock the loader's own wait inside the step is
    left out); `on_step(step, batches, seconds)` receives every completed step (timing records);
    `before_last(step)` runs right before the step's last micro-batch is handed out (its statistics are
    complete then, and a loop that logs after that micro-batch's optimizer step sees them).
    """

    def __init__(self, prepared: Any, steps_source: Callable[[Iterator], Iterator[list]], *, device: Any,
                 count_items: Callable[[int], int], recorder: Any, on_step: Callable[[int, list, float], None],
                 before_last: Optional[Callable[[int], None]] = None,
                 gradient_state: Any = None, length: Optional[Callable[[], int]] = None,
                 window_state: Optional[Callable[[int], Optional[dict]]] = None,
                 resume_in_window: Optional[Callable[[Optional[dict]], None]] = None,
                 state_owner: Any = None, micro_per_step: int = 1, raw_per_micro: int = 1):
        self.prepared = prepared
        self._steps_source = steps_source
        self._device = device
        self._count_items = count_items
        self._recorder = recorder
        self._waited = 0.0               # wall seconds this step waited for the next one (left out of wall timing)
        self._on_step = on_step
        self._before_last = before_last
        self._length = length
        if gradient_state is None:
            from accelerate.state import GradientState

            gradient_state = GradientState()
        self.gradient_state = gradient_state
        self.end_of_dataloader = False   # read by accelerator.accumulate() through GradientState
        self.remainder = -1              # no padded samples: every sample is trained once
        self._state_owner = state_owner  # the session whose state_dict holds this loader's position
        # the resume point: micro-batch slots of a full step (gradient accumulation), raw batches read per slot
        # (dispatch mode: one per rank), the loader's look-ahead window
        self._position = StreamPosition(micro_per_step, raw_per_micro, window_state, resume_in_window)

    # -- dataloader protocol ------------------------------------------------------------------
    def __len__(self) -> int:
        return self._length() if self._length is not None else len(self.prepared)

    def set_epoch(self, epoch: int) -> None:
        self._position.next_epoch = int(epoch)
        if hasattr(self.prepared, "set_epoch"):
            self.prepared.set_epoch(epoch)
            return
        sampler = getattr(self.prepared, "sampler", None)  # a plain DataLoader (dispatch mode)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        if hasattr(getattr(self.prepared, "dataset", None), "set_epoch"):
            self.prepared.dataset.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, else of the next pass (after `load_state_dict`: the resumed one)."""
        if self._position.epoch is not None:
            return self._position.epoch
        return int(getattr(self.prepared, "iteration", self._position.next_epoch))

    def __getattr__(self, name: str):
        if name == "prepared" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.prepared, name)

    def position(self) -> dict:
        """Where a resume continues: the epoch, the completed steps of its pass, the raw batches read before
        the resume point, and, inside a look-ahead window (whose samples may train in any of its steps), the
        window's plan and how many of its steps were trained (the window is then read again from its start)."""
        return self._position.position(self.epoch)

    def restore(self, position: dict) -> None:
        """The next pass starts at `position` (`position()`'s): its raw batches before it are read and skipped;
        inside a look-ahead window, with the window's untrained samples."""
        self.set_epoch(self._position.restore(position))

    def state_dict(self) -> dict:
        """The run's one resume state (`BalanceSession.state_dict`: every balanced loader's position, the
        settings that order the samples, the cost models), as `accelerator.save_state` saves it."""
        if self._state_owner is None:
            raise ValueError("BalancedDataLoader.state_dict: this loader belongs to no session")
        return self._state_owner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s state (refused by name when a setting that orders the samples differs).
        Every data-parallel rank calls it at once (rank 0's state is broadcast)."""
        if self._state_owner is None:
            raise ValueError("BalancedDataLoader.load_state_dict: this loader belongs to no session")
        self._state_owner.load_state_dict(state)

    # -- iteration ----------------------------------------------------------------------------
    def _last_micro_batch(self, step: int, num_micro: int, steps: Iterator[list]) -> Optional[list]:
        """Before a step's last micro-batch goes out: its statistics, the resume point (the step counts as
        done: a checkpoint after its optimizer step resumes after it), and the next step, whose absence
        is the end of the data."""
        if self._before_last is not None:
            self._before_last(step)
        self._position.step_done(step, num_micro)
        t0 = time.perf_counter()
        upcoming = next(steps, None)
        self._waited += time.perf_counter() - t0
        self.end_of_dataloader = upcoming is None
        return upcoming

    def _step_seconds(self) -> Optional[float]:
        """The step's time on the recorder's clock; wall time leaves out the wait for the next step."""
        seconds = self._recorder.end()
        if seconds is not None and self._recorder.clock.timing == "wall":
            seconds = max(seconds - self._waited, 0.0)
        return seconds

    def __iter__(self):
        from accelerate.utils import send_to_device

        position = self._position
        raw = _RawSource(self.prepared, skip=position.begin_pass(getattr(self.prepared, "iteration",
                                                                         position.next_epoch)))
        steps = self._steps_source(raw)
        self.end_of_dataloader = False
        registered = False
        try:
            current = next(steps, None)  # the first raw pull (and the shard's RNG sync) ran in this thread
            # Registered after the shard registered itself: the active dataloader accumulate() reads is us.
            self.gradient_state._add_dataloader(self)
            registered = True
            while current is not None:
                total = self._count_items(sum(target_tokens(b) for b in current))
                step, upcoming = position.steps_done, None
                for i, micro in enumerate(current):
                    if i == len(current) - 1:  # is this the last step? decided collectively, same on every rank
                        upcoming = self._last_micro_batch(step, len(current), steps)
                    batch = dict(micro)
                    batch["num_items_in_batch"] = total
                    batch = send_to_device(batch, self._device) if self._device is not None else batch
                    if i == 0:
                        self._waited = 0.0
                        self._recorder.begin()
                    yield batch
                self._on_step(step, current, self._step_seconds())
                current = upcoming
            position.end_pass()  # a finished pass resumes at the next
        finally:
            steps.close()
            raw.finish()
            if registered:
                self.gradient_state._remove_dataloader(self)
            self.end_of_dataloader = False


__all__ = ["BalancedDataLoader", "target_tokens"]
