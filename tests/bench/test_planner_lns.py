"""bench/planner_lns.py (pure): large-neighbourhood search from plan_step's full-cap plan keeps a valid plan
(every item in one (rank, slot), slots within the cap and not empty, every rank within the goal), never sends
more tokens than the plan it started from, and does find what a neighbourhood can bring home."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import planner as bench  # noqa: E402
import planner_lns  # noqa: E402
from hf_dp_balance.core.planner import lower_bound, plan_step  # noqa: E402


def _has_scipy_highs_core():
    # the bench's default solver is the HiGHS copy inside scipy (a private module, for its warm start); a scipy
    # that moves it must not fail CI, the public `milp` path is tested either way
    try:
        from scipy.optimize._highspy import _core  # noqa: F401
    except ImportError:
        return False
    return True


HIGHS = _has_scipy_highs_core()
_NO_HIGHS = pytest.mark.skipif(not HIGHS, reason="scipy.optimize._highspy._core not in this scipy")


def _case(R, M, seed):
    L, own, mb = bench.full_cap_instance("long-tail", R, M, seed)
    c = bench.full_cap_costs(L, "strongly quadratic")
    plan = plan_step(c, own, mb, R, M, tokens=L, max_tokens=bench.PACK, sync="step", min_gain=0.0)
    return L, own, c, lower_bound(c, R), plan, mb


def _assert_valid(L, own, c, dest, micro, R, M, goal_load):
    assert dest.shape == micro.shape == L.shape  # every item exactly once
    assert 0 <= dest.min() and dest.max() < R and 0 <= micro.min() and micro.max() < M
    slot = dest * M + micro
    assert np.bincount(slot, weights=L, minlength=R * M).max() <= bench.PACK
    assert np.bincount(slot, minlength=R * M).min() >= 1
    assert np.bincount(dest, weights=c, minlength=R).max() <= goal_load * (1 + 1e-9)


@pytest.mark.parametrize("solver,free_short", [pytest.param("highs", 1.0, marks=_NO_HIGHS),
                                               pytest.param("highs", 0.3, marks=_NO_HIGHS), ("milp", 1.0)])
def test_lns_keeps_a_valid_plan_and_never_sends_more(solver, free_short):
    R, M = 8, 4
    L, own, c, lb, plan, mb = _case(R, M, 0)
    goal_load = 1.01 * lb
    start = float(L[plan.dest_rank != own].sum())
    assert start > 0
    dest, micro, hist = planner_lns.lns(c, L, own, plan.dest_rank.copy(), plan.dest_micro_batch.copy(), R, M,
                                        bench.PACK, goal_load, [3], ["trade", "mix", "random"], 1.0, 60.0, 0,
                                        max_iters=3, solver=solver, free_short=free_short)
    _assert_valid(L, own, c, dest, micro, R, M, goal_load)
    slowest, sent = planner_lns.check_plan(c, L, own, dest, micro, R, M, bench.PACK, goal_load)
    assert slowest <= 1.0 + 1e-9
    assert sent <= start and len(hist) == 3
    assert [h[4] for h in hist] == sorted((h[4] for h in hist), reverse=True)  # accepted steps only go down


def test_a_needless_move_is_brought_home():
    # every rank within the goal at home, then one short item sent to a rank with room: the neighbourhood of
    # both ranks sends nothing at its optimum
    R, M = 4, 2
    L, own, c, lb, plan, mb = _case(R, M, 1)
    home_load = np.bincount(own, weights=c, minlength=R)
    goal_load = 1.001 * max(float(home_load.max()), lb)
    dest, micro = own.copy(), mb.copy()  # the packs as they came: a valid plan that sends nothing
    planner_lns.check_plan(c, L, own, dest, micro, R, M, bench.PACK, goal_load)
    load = np.bincount(dest, weights=c, minlength=R)
    to = int(np.argmin(load))
    frm = (to + 1) % R
    slot_tok = np.bincount(dest * M + micro, weights=L, minlength=R * M)
    slot_items = np.bincount(dest * M + micro, minlength=R * M)
    m = int(np.argmin(slot_tok[to * M:(to + 1) * M]))
    fits = (own == frm) & (L <= bench.PACK - slot_tok[to * M + m]) & (load[to] + c <= goal_load)
    fits &= slot_items[frm * M + micro] >= 2  # its slot stays non-empty
    assert fits.any()
    item = int(np.flatnonzero(fits)[np.argmin(L[fits])])
    dest[item], micro[item] = to, m
    planner_lns.check_plan(c, L, own, dest, micro, R, M, bench.PACK, goal_load)
    nd, nm, sent, msg = planner_lns.solve_neighbourhood(c, L, own, dest, micro, np.array(sorted({frm, to})), M,
                                                        bench.PACK, goal_load, 10.0,
                                                        solver="highs" if HIGHS else "milp")
    assert nd is not None, msg
    assert sent == 0.0 and not np.any(nd != own)
    planner_lns.check_plan(c, L, own, nd, nm, R, M, bench.PACK, goal_load)


def test_check_plan_rejects_a_slot_over_the_cap():
    R, M = 8, 4
    L, own, c, lb, plan, mb = _case(R, M, 0)
    micro = plan.dest_micro_batch.copy()
    dest = plan.dest_rank.copy()
    sel = np.flatnonzero(dest == 0)
    micro[sel] = 0  # rank 0's four slots into one
    with pytest.raises(AssertionError):
        planner_lns.check_plan(c, L, own, dest, micro, R, M, bench.PACK, 1.01 * lb)
