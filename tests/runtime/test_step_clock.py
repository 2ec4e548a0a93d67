"""The one step clock (runtime.fitter.StepClock) counts this thread's compute, not its waits, on CPU; the
fitter keeps the newest timing records in order."""

import time

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.runtime.fitter import CostModelFitter
from hf_dp_balance.runtime.recorder import StepClock, StepRecorder


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_clock_counts_compute_and_not_waiting():
    recorder = StepRecorder(StepClock("thread_cpu"))
    assert recorder.end() is None  # not started
    recorder.begin()
    _busy(0.05)
    time.sleep(0.2)  # a rank blocked in a collective or on data burns no CPU
    elapsed = recorder.end()
    assert 0.04 <= elapsed < 0.15


def test_the_fitter_keeps_the_most_recent_records_in_order():
    fitter = CostModelFitter(DPBalanceConfig(refit_every=0, warmup_steps=10**6), timing="thread_cpu")
    total = fitter.records.maxlen + 3
    for step in range(total):
        fitter.record([step + 1], 0.1 * step)
    assert len(fitter.records) == fitter.records.maxlen
    kept = [r.features[1] for r in fitter.records]  # sum of lengths = step + 1
    assert kept == [float(s + 1) for s in range(3, total)]
