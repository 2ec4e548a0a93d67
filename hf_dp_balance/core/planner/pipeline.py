"""The planning pipeline of `plan_balance` and `plan_step(sync="step")`: which stage runs when.

Every stage works on one `_State` (the working placement) toward per-rank budgets (`lower_bound x
speed`). The goal: the fullest rank (load / budget) at or under 1 + tolerance; the trades' limit is
1 + tolerance / 2. Every stage keeps every slot under the token cap and places every item exactly once.

1. Incremental method (`passes._balance_incremental`), from the current placement: a cap repair
   (tokens shed from slots over the cap), shed and place (best fit), refine (moves and one-for-one
   swaps from the fullest rank), one-for-many exchanges (`eject`), the item-count fixes. Runs first
   unless the slots are full (step 2 goes first then); stops at the goal.
2. Full-cap trades (`_full_cap_trades`), for slots filled to the cap: no large item fits anywhere and
   only exchanges help, judged by the tokens they send. First when most slots have less room than a
   large item (`_trades_first`), else only after step 1 ends above the goal.
   - After step 1, or first where large items are dearer per token (`_lumpy`): at 2 to 4 micro-batches
     long items first (`assign`, where its search expects to send at most `_TRUST` of the tokens);
     ladder trades (`chain`) and step 1; while above the goal up to `_PASSES` ladder passes at any cost
     per token (`_residue_trades`), then up to `_PASSES` that make load room where the free tokens are
     (`_roomy_trades`), each followed by step 1.
   - First for a milder cost: small-change trades (`trade`), step 1.
   Both end with small-change trades, a polish, and sending home the items a detour took away (`home`);
   after long items first, one-for-one swaps close a gap of a few tenths over the trades' limit.
3. Moves budget: a plan of steps 1-2 within twice the tolerance ends the call (the one sending fewer
   tokens): a repack sends most of the step again.
4. Repack fallback (`repack`), only above that: the over-full and the emptiest ranks re-placed by
   capped LPT and renamed toward their items' owners, their number doubled until the goal.
5. Choice among all attempts: the lowest fullest rank, and among plans within the tolerance of it
   the fewest tokens sent (a cap repair's repack must beat the incremental plan by `min_gain`).

`sync="micro_batch"` runs step 1 without exchanges (`slots`); `api` checks the result exactly and
keeps it only when required or when it pays (`min_gain`).
"""

from __future__ import annotations

import numpy as np

from hf_dp_balance.core.planner import repack
from hf_dp_balance.core.planner.assign import _assign_long, _long_first, _long_first_applies
from hf_dp_balance.core.planner.chain import _ladder_trades
from hf_dp_balance.core.planner.home import _send_home
from hf_dp_balance.core.planner.passes import _balance_incremental, _polish
from hf_dp_balance.core.planner.refine import _swap_down
from hf_dp_balance.core.planner.state import (_FEW_SLOTS, _LARGE, _PASSES, _Infeasible, _State, _copy_state,
                                              _fullest, _sent)
from hf_dp_balance.core.planner.trade import _trade

_TRUST = 0.5  # long items first go first where their search expects to send at most this share of the tokens
_ROOMY_AIM = 0.98  # x budget: where the roomy passes aim the ranks with free tokens (room for a full rank's excess)
_LUMPY = 2.0  # large items dearer per token than the rest by this factor: a rank must trade one away whole


def _balance(state: _State, budget: np.ndarray, tolerance: float, relocate: bool = True,
             deep: bool = True, repack_gain: float = 0.0) -> _State:
    """Steps 1-5; `deep` False (sync="micro_batch"): step 1 without exchanges. With `repack_gain` > 0 (a
    cap repair, applied whatever it gains) a repack replaces the incremental plan only if it cuts the
    fullest rank by that fraction. Raises _Infeasible only when no attempt finds a feasible plan."""
    if not deep:
        return _balance_incremental(state, budget, tolerance, relocate, deep=False)
    start, origin = state.dest.copy(), _copy_state(state)
    first = _trades_first(origin)
    lumpy = first and _lumpy(origin)
    # trades that go first work on `state` itself and run step 1 themselves: their plan is the base
    base = _full_cap_trades(state, budget, tolerance, relocate, ladder=lumpy) if first else None
    # after ladder trades, a repack that does not beat them ends the doubling (it rarely does)
    stop_at = _fullest(base, budget) if lumpy and base is not None else np.inf
    traded = None
    if base is None:
        try:
            base = _balance_incremental(_copy_state(origin) if first else state, budget, tolerance, relocate)
        except _Infeasible:
            pass
        if not first and (base is None or _fullest(base, budget) > 1.0 + tolerance):
            traded = _full_cap_trades(_copy_state(origin), budget, tolerance, relocate)
    plans = [p for p in (base, traded) if p is not None]
    # the first plan at the goal, else the one sending fewest tokens within twice the tolerance (step 3)
    done = next((p for p in plans if _fullest(p, budget) <= 1.0 + tolerance), None)
    if done is not None or (done := _fewest_sent(plans, budget, 1.0 + 2.0 * tolerance, start)) is not None:
        return done
    repacks = repack._repack_until(origin if base is None else base, origin, budget, tolerance, start, stop_at,
                                   none_yet=not plans)
    tried = [p for p in (base, *repacks, traded) if p is not None]
    return _choose(tried, base, budget, tolerance, start, repack_gain)


def _full_cap_trades(origin: _State, budget: np.ndarray, tolerance: float, relocate: bool, ladder: bool = True):
    """Step 2; None when the start breaks the cap (a repair: step 1 does it) or no plan is found. Works on
    `origin` itself (spoilt when it returns None)."""
    if origin.cap is None or bool(np.any(origin.slot_tok > origin.cap)):
        return None
    assigned = _assign_long(origin, budget, tolerance) if ladder and _long_first_applies(origin) else None
    start = None if assigned is None else origin.dest.copy()
    if assigned is not None and assigned[2] > _TRUST * float(origin.tokens.sum()):
        assigned = None  # its search expects to send too many tokens: the trades alone
    plan = _full_cap_pass(origin, budget, tolerance, relocate, ladder, long_first=assigned)
    limit = (1.0 + tolerance / 2.0) * (1.0 + 1e-9)
    if assigned is not None and plan is not None and limit < _fullest(plan, budget) <= 1.0 + tolerance:
        _swap_down(plan, budget * (1.0 + tolerance / 2.0), start)  # a rank a few tenths over: single swaps
    return plan


def _full_cap_pass(state: _State, budget: np.ndarray, tolerance: float, relocate: bool, ladder: bool, long_first):
    """One attempt of step 2, on `state` itself; `long_first`: None, or what `_assign_long` returned for it."""
    start = state.dest.copy()
    try:
        if ladder:
            if long_first is not None:
                _long_first(state, budget, tolerance, long_first)
            _ladder_trades(state, budget, tolerance)
            # with many micro-batches shed and place only: the residue passes do what refining and
            # exchanges would there, sending fewer tokens (at 2-4, where long items go first, both help)
            deep = state.M <= _FEW_SLOTS
            state = _balance_incremental(state, budget, tolerance, relocate, deep=deep, refine=deep)
            for trades in (_residue_trades, _roomy_trades):  # up to _PASSES of each while above the goal
                for _ in range(_PASSES):
                    if _fullest(state, budget) <= 1.0 + tolerance:
                        break
                    trades(state, budget, tolerance)
                    state = _balance_incremental(state, budget, tolerance, relocate)
        else:
            _trade(state, budget, tolerance)
            state = _balance_incremental(state, budget, tolerance, relocate)
        _trade(state, budget, tolerance)
        state = _polish(state, budget, budget * (tolerance / 2.0), tolerance)
        # up to the trades' limit, never above the fullest rank now (fewer tokens, not a slower step)
        _send_home(state, start, budget * min(1.0 + tolerance / 2.0, _fullest(state, budget)))
        state.path = "trades"
        return state
    except _Infeasible:
        return None


def _residue_trades(state: _State, budget: np.ndarray, tolerance: float) -> None:
    """Ladder trades at any cost per token, of the large items whose surplus is nearest each rank's excess:
    what step 1 left over the goal after the first ladder pass."""
    _ladder_trades(state, budget, tolerance, min_rate=0.0, near=True)


def _roomy_trades(state: _State, budget: np.ndarray, tolerance: float) -> None:
    """Ladder trades at any cost per token toward _ROOMY_AIM x budget on the ranks with room for two large
    items (over their M slots), the budget elsewhere: where every free token sits on ranks at or over the
    limit and every rank with load room is token-full, no move fits; a roomy rank's dense items go to
    token-full ranks for their cheaper tokens, and step 1 then moves the excess into that room. The fullest
    rank never rises."""
    roomy = state.cap * state.M - state.slot_tok.sum(axis=1) >= state.cap * 2 * _LARGE
    _ladder_trades(state, np.where(roomy, budget * _ROOMY_AIM, budget), tolerance, min_rate=0.0)


def _trades_first(state: _State) -> bool:
    """Most slots have less token room than a large item (fixed-length packing at max_tokens = the pack
    length): only exchanges help, so the full-cap trades go first."""
    if state.cap is None or state.slot_tok is None or bool(np.any(state.slot_tok > state.cap)):
        return False
    return float(np.median(state.cap - state.slot_tok)) <= state.cap * _LARGE


def _lumpy(state: _State) -> bool:
    """The large items cost at least _LUMPY x more per token than the rest (a strongly quadratic cost): a
    rank over the goal must trade one of them away for many small ones (ladder trades)."""
    large = (state.tokens > state.cap * _LARGE).astype(np.float64)  # (dot products: 8x faster than bincounts)
    t_large, c_large = float(state.tokens @ large), float(state.costs @ large)
    t_rest, c_rest = float(state.tokens.sum()) - t_large, float(state.costs.sum()) - c_large
    return t_large > 0 and t_rest > 0 and c_large / t_large >= _LUMPY * c_rest / t_rest


def _fewest_sent(plans: list, budget: np.ndarray, bar: float, start: np.ndarray):
    """Of the plans whose fullest rank is at or under `bar`, the one sending the fewest tokens (the first of
    equals); None if none is."""
    return min((p for p in plans if _fullest(p, budget) <= bar), key=lambda p: _sent(p, start), default=None)


def _choose(tried: list, incremental, budget: np.ndarray, tolerance: float, start: np.ndarray,
            repack_gain: float) -> _State:
    """Step 5: the lowest fullest rank, and among the attempts within `tolerance` of it the fewest tokens
    sent; the `incremental` plan instead when that is a repack not beating it by `repack_gain`."""
    chosen = _fewest_sent(tried, budget, min(_fullest(p, budget) for p in tried) * (1.0 + tolerance), start)
    if (repack_gain > 0 and incremental is not None and chosen is not incremental
            and _fullest(chosen, budget) > _fullest(incremental, budget) * (1.0 - repack_gain)):
        return incremental
    return chosen
