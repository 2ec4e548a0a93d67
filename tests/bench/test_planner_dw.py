"""bench/planner_dw.py and bench/planner_floor.py's exact and whole-short floors (pure): a real plan is a feasible
point of each relaxation, so no floor may exceed the tokens plan_step sends, and the master built from the
plan's own columns prices it exactly."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import planner as bench  # noqa: E402
import planner_dw  # noqa: E402
import planner_floor  # noqa: E402
from hf_dp_balance.core.planner import lower_bound, plan_step  # noqa: E402


def _case(ranks, M=4, seed=0):
    L, own, mb = bench.full_cap_instance("long-tail", ranks, M, seed)
    c = bench.full_cap_costs(L, "strongly quadratic")
    lb = lower_bound(c, ranks)
    plan = plan_step(c, own, mb, ranks, M, tokens=L, max_tokens=bench.PACK, sync="step", min_gain=0.0)
    return L, own, c, lb, plan, float(L[plan.dest_rank != own].sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_dw_floor_is_below_the_plan_and_its_columns_price_it(seed):
    R, M = 16, 4
    L, own, c, lb, plan, sent = _case(R, M, seed)
    inst = planner_dw.Instance(c, L, own, R, M, bench.PACK, 1.01 * lb, 8192.0, 20)
    cols = planner_dw.plan_columns(inst, plan.dest_rank)
    assert sum(col[3] for col in cols) == pytest.approx(sent)
    obj, _, _, _ = planner_dw.master(inst, cols, 1.0, 1.0)
    assert obj <= sent * (1 + 1e-9)  # the artificial columns can only make it cheaper
    zero, _, _, _ = planner_dw.lagrangian(inst, np.zeros(inst.nB), np.zeros(inst.Ks))
    best, last, _ = planner_dw.column_generation(inst, cols, rounds=8, time_limit=60.0)
    assert 0.0 < zero <= best <= sent * (1 + 1e-9)
    assert best <= last * (1 + 1e-6)  # weak duality: the floor never passes the master


def test_floors_with_whole_items_are_below_the_plan():
    R, M = 16, 4
    L, own, c, lb, plan, sent = _case(R, M)
    whole, _, _, _ = planner_floor.milp_floor(c, L, own, R, M, bench.PACK, 1.01 * lb, 8192.0, 30.0, whole_short=True)
    exact, _, _, _ = planner_floor.exact_floor(c, L, own, R, M, bench.PACK, 1.01 * lb, 30.0)
    assert whole is not None and exact is not None
    assert 0.0 < whole <= sent * (1 + 1e-9)
    assert 0.0 < exact <= sent * (1 + 1e-9)
