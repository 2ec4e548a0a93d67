"""StepClock counts this thread's compute (not its waits) on CPU; StepTimings keeps the newest records."""

import time

import numpy as np

from hf_dp_balance.runtime.step_timing import StepClock, StepTimings


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_clock_counts_compute_and_not_waiting():
    clock = StepClock("cpu")
    assert clock.mode == "thread_cpu" and clock.stop() is None  # not started
    clock.start()
    _busy(0.05)
    time.sleep(0.2)  # a rank blocked in a collective or on data burns no CPU
    elapsed = clock.stop()
    assert 0.04 <= elapsed < 0.15


def test_timings_keep_the_most_recent_records_in_order():
    timings = StepTimings(max_records=3)
    for step in range(5):
        timings.record(step, [step * step, step, 1, 1], [0, 0, 0, 1], 0.1 * step)
    steps, decoder, vision, seconds = timings.arrays()
    assert steps.tolist() == [2, 3, 4] and len(timings) == 3
    assert decoder[:, 0].tolist() == [4, 9, 16] and vision.shape == (3, 4)
    assert np.allclose(seconds, [0.2, 0.3, 0.4])
