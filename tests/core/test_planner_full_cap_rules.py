"""Rules of the full-cap pass (core/planner/pipeline.py `_full_cap_pass`)."""

import numpy as np
import pytest

from hf_dp_balance.core.planner import pipeline
from test_planner_chain import _long_tail, _state


@pytest.mark.parametrize("M, deep", [(2, True), (4, True), (8, False)])
def test_after_the_first_ladder_pass_only_shed_and_place_from_5_micro_batches_on(monkeypatch, M, deep):
    """No exchange trials and no refinement in the incremental method after the first ladder pass at
    M > 4; at M <= 4 both (and the later incremental passes keep them at every M)."""
    R, cap = 24, 32768
    tokens, owners, mbs = _long_tail(7, R, M, cap)
    state, budget = _state(tokens, owners, mbs, R, M, cap, 1.4e-4)
    calls = []
    real = pipeline._balance_incremental

    def recording(st, *args, **kwargs):
        calls.append((kwargs.get("deep", True), kwargs.get("refine", True)))
        return real(st, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_balance_incremental", recording)
    plan = pipeline._full_cap_pass(state, budget, 0.005, True, True, long_first=None)
    assert plan is not None and calls  # the first call is the one after the first ladder pass
    assert calls[0] == (deep, deep)
    assert all(c == (True, True) for c in calls[1:])  # the residue / roomy passes keep both


def test_the_incremental_method_without_refinement_sheds_and_places_only(monkeypatch):
    from hf_dp_balance.core.planner import passes

    R, M, cap = 24, 8, 32768
    tokens, owners, mbs = _long_tail(3, R, M, cap)
    state, budget = _state(tokens, owners, mbs, R, M, cap, 1.4e-4)
    refined = []
    monkeypatch.setattr(passes, "_refine", lambda *a, **k: refined.append(1))
    passes._balance_incremental(pipeline._copy_state(state), budget, 0.005, deep=False, refine=False)
    assert not refined
    passes._balance_incremental(pipeline._copy_state(state), budget, 0.005, deep=False)  # sync="micro_batch"
    assert refined  # deep=False alone still refines (micro_batch plans unchanged)


@pytest.mark.parametrize("M", [4, 8])
def test_the_residue_ladder_passes_trade_near_each_rank_s_excess_at_any_cost_per_token(monkeypatch, M):
    R, cap = 32, 32768
    tokens, owners, mbs = _long_tail(11, R, M, cap)
    state, budget = _state(tokens, owners, mbs, R, M, cap, 1.4e-4)
    calls = []
    real = pipeline._ladder_trades

    def recording(st, *args, **kwargs):
        calls.append((kwargs.get("near", False), kwargs.get("min_rate")))
        return real(st, *args, **kwargs)

    monkeypatch.setattr(pipeline, "_ladder_trades", recording)
    # the incremental method after the first pass: a no-op, so that a residue pass surely runs
    monkeypatch.setattr(pipeline, "_balance_incremental", lambda st, *a, **k: st)
    pipeline._full_cap_pass(state, budget, 0.005, True, True, long_first=None)
    assert calls[0] == (False, None)  # the first pass: the items worth their tokens only (the default rate)
    residue = [c for c in calls[1:] if c[0]]
    assert residue and all(c[1] == 0.0 for c in residue)
