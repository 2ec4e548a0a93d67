"""bench/planner_relax.py (pure): the plan rounded from the LP keeps every slot within the cap, its
running loads and slot tokens are those of the items where they now are, and the repair ends within
the planner's goal."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import planner as bench  # noqa: E402
import planner_relax  # noqa: E402
from hf_dp_balance.core.planner import lower_bound  # noqa: E402
from hf_dp_balance.core.planner.state import _State, _fullest  # noqa: E402


@pytest.mark.parametrize("ranks, threshold", [(32, 0.5), (32, 0.2), (64, 0.5)])
def test_rounded_plan_is_a_placement_within_the_cap(ranks, threshold):
    M = 4
    L, own, mb = bench.full_cap_instance("long-tail", ranks, M, 0)
    c = bench.full_cap_costs(L, "strongly quadratic")
    lb = lower_bound(c, ranks)
    y, recv, klass, flows, _, status, _ = planner_relax.relaxation(c, L, own, ranks, M, bench.PACK, 1.0025 * lb, 8192)
    assert status == 0
    state = _State(c, L, float(bench.PACK), np.ones(ranks), own, mb, M, np.bincount(own, weights=c, minlength=ranks), 0)
    state = planner_relax.round_plan(state, y, recv, klass, flows, threshold)
    assert np.any(state.dest != own)  # the instance is lumpy: rounding moves something
    slot_tok = np.bincount(state.dest * M + state.micro, weights=L, minlength=ranks * M).reshape(ranks, M)
    assert slot_tok.max() <= bench.PACK
    np.testing.assert_allclose(state.slot_tok, slot_tok)
    np.testing.assert_allclose(state.load, np.bincount(state.dest, weights=c, minlength=ranks), rtol=1e-9)


def test_relax_case_ends_within_the_planners_goal():
    L, own, mb = bench.full_cap_instance("long-tail", 64, 4, 0)
    c = bench.full_cap_costs(L, "strongly quadratic")
    out = planner_relax.relax_case(c, L, own, mb, 64, 4, 1.0025, 8192.0)
    assert out["status"] == 0
    assert out["done"][0] <= 1.005  # 1 + plan_step's default tolerance (64 x 4: plan_step ends at 1.0039 too)
    assert 0.0 < out["done"][1] < 100.0
