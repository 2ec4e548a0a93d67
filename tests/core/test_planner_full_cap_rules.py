"""Rules of the full-cap pass (core/planner/repack.py `_full_cap_pass`) that apply from 8 micro-batches on
only, so that every plan at M <= 4 stays as it was."""

import numpy as np
import pytest

from hf_dp_balance.core.planner import repack
from test_planner_chain import _long_tail, _state


@pytest.mark.parametrize("M, deep", [(2, True), (4, True), (8, False)])
def test_the_exchange_trials_after_the_first_ladder_pass_are_skipped_from_8_micro_batches_on(monkeypatch, M, deep):
    R, cap = 24, 32768
    tokens, owners, mbs = _long_tail(7, R, M, cap)
    state, budget = _state(tokens, owners, mbs, R, M, cap, 1.4e-4)
    calls = []
    real = repack._balance_incremental

    def recording(st, *args, **kwargs):
        calls.append(kwargs.get("deep", True))
        return real(st, *args, **kwargs)

    monkeypatch.setattr(repack, "_balance_incremental", recording)
    plan = repack._full_cap_pass(state, budget, 0.005, True, True, True, long_first=None)
    assert plan is not None and calls  # the first call is the one after the first ladder pass
    assert calls[0] is deep and all(calls[1:])  # the residue / roomy passes keep their trials
