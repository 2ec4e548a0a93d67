"""`StreamPosition`: where a pass over balanced steps is, in the terms a resume needs.

A balanced loader reads raw batches ahead of training and, inside a look-ahead window, may train a window's
samples in any of its steps. So the resume point is not "the raw batches read so far" but: the epoch, the
completed steps, the raw batches behind them, and, inside a window, the window's plan and how many of its steps
were trained; the window is then read again from its start and re-planned as saved. This class keeps that
count for one loader and turns a saved position into what the next pass skips. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

from typing import Callable, Optional


class StreamPosition:
    """The resume point of one balanced loader (see the module docstring).

    `micro_per_step`: micro-batch slots of a full step (gradient accumulation); `raw_per_micro`: raw batches
    read per slot (dispatch mode: one per data-parallel rank); `window_state(steps_done)`: the look-ahead
    window a resume after that many steps falls inside (None outside one); `resume_in_window(window)`: hand a
    saved window to the loader (None: this loader cannot resume inside a window).
    """

    def __init__(self, micro_per_step: int = 1, raw_per_micro: int = 1,
                 window_state: Optional[Callable[[int], Optional[dict]]] = None,
                 resume_in_window: Optional[Callable[[Optional[dict]], None]] = None):
        self.micro_per_step = int(micro_per_step)
        self.raw_per_micro = int(raw_per_micro)
        self._window_state = window_state
        self._resume_in_window = resume_in_window
        self.epoch: Optional[int] = None  # the epoch of the pass in progress (None between passes)
        self.next_epoch = 0               # the epoch of the next pass, where the loader has no epoch counter
        self.steps_done = 0               # steps of the current pass fully handed out
        self._raw_done = 0                # raw batches behind them
        self._steps_base = 0              # completed steps of the pass before its first step (a resumed pass)
        self._skip_raw = 0                # restore: raw batches the next pass skips
        self._skip_trained = 0            # restore inside a look-ahead window: its steps already trained
        self._skip_steps = 0              # restore: completed steps before the next pass's first step

    def _window_raw(self, trained_steps: int) -> int:
        return trained_steps * self.micro_per_step * self.raw_per_micro

    def position(self, epoch: int) -> dict:
        """Where a resume continues (`epoch`: the pass's): its completed steps, the raw batches read before the
        resume point and, inside a look-ahead window, the window's plan and its trained steps."""
        window = self._window_state(self.steps_done) if self._window_state is not None else None
        raw = self._raw_done - (self._window_raw(window["trained"]) if window is not None else 0)
        return {"epoch": int(epoch), "steps": self._steps_base + self.steps_done, "micro_batches": raw,
                "window": window}

    def restore(self, position: dict) -> int:
        """The next pass resumes at `position` (`position()`'s); returns its epoch. A window is handed to the
        loader, or refused by name when it cannot resume inside one."""
        window = position.get("window")
        if window and self._resume_in_window is None:
            raise ValueError("hf_dp_balance: the state was taken inside a look-ahead window, and this loader "
                             "cannot resume one")
        self.next_epoch = int(position["epoch"])
        self._skip_raw = int(position.get("micro_batches", 0))
        self._skip_trained = int(window["trained"]) if window else 0
        self._skip_steps = int(position.get("steps", 0)) - self._skip_trained
        if self._resume_in_window is not None:
            self._resume_in_window(window)
        return self.next_epoch

    def begin_pass(self, epoch: int) -> int:
        """A pass of `epoch` starts; returns the raw batches it skips (a resumed pass). A pass resumed inside a
        window counts the window's trained steps as read: the window is read again from its start."""
        skip = self._skip_raw
        self.epoch, self.steps_done, self._steps_base = int(epoch), 0, self._skip_steps
        self._raw_done = skip + self._window_raw(self._skip_trained)
        self._skip_raw, self._skip_steps, self._skip_trained = 0, 0, 0
        return skip

    def step_done(self, step: int, num_micro: int) -> None:
        """Step `step` (0-based in the pass) of `num_micro` micro-batches is handed out: a checkpoint after it
        resumes after it."""
        self.steps_done = step + 1
        self._raw_done += num_micro * self.raw_per_micro

    def end_pass(self) -> None:
        """The pass read its data to the end: a resume starts the next epoch."""
        self.next_epoch, self.epoch = self.epoch + 1, None
        self.steps_done, self._raw_done, self._steps_base = 0, 0, 0


__all__ = ["StreamPosition"]
