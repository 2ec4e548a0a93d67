"""The swap screen of `_refine` (core/planner/refine.py): it skips only swaps that cannot lower h."""

import numpy as np

from hf_dp_balance.core.planner.refine import _emptiest, _swap_may_fit
from hf_dp_balance.core.planner.state import _Members
from test_planner_chain import _long_tail, _state


def _best_swap_worst(state, budget, h, mine, theirs, col_rank):
    """The least larger fullness of any swap within the cap: `_best_swap`'s matrices written out."""
    delta = state.costs[mine][:, None] - state.costs[theirs][None, :]
    worst = np.maximum((state.load[h] - delta) / budget[h],
                       (state.load[col_rank][None, :] + delta) / budget[col_rank][None, :])
    ta, tb = state.tokens[mine][:, None], state.tokens[theirs][None, :]
    into_l = state.slot_tok[col_rank, state.micro[theirs]][None, :] - tb + ta
    into_h = state.slot_tok[h, state.micro[mine]][:, None] - ta + tb
    return float(np.where((into_l <= state.cap) & (into_h <= state.cap), worst, np.inf).min())


def test_the_swap_screen_skips_only_swaps_that_cannot_lower_the_fullest_rank():
    skipped = helpful = 0
    for seed in range(12):
        R, M = 6 + seed % 5, (1, 2, 4, 8)[seed % 4]
        pack = (4096, 32768)[seed % 2]
        tokens, owners, mbs = _long_tail(seed, R, M, pack)
        state, budget = _state(tokens, owners, mbs, R, M, pack, (1.9e-5, 1.4e-4, 1e-3)[seed % 3])
        members = _Members(state.dest, R)
        full = state.load / budget
        for h in range(R):
            cand = _emptiest(full, h, 2)
            mine = members.of(h)
            groups = [members.of(int(l)) for l in cand]
            theirs = np.concatenate(groups)
            if mine.size == 0 or theirs.size == 0:
                continue
            worst = _best_swap_worst(state, budget, h, mine, theirs, np.repeat(cand, [g.size for g in groups]))
            if not _swap_may_fit(state, mine, theirs, cand):
                skipped += 1
                assert not worst < full[h], (seed, h)
            helpful += worst < full[h]
    assert skipped > 0 and helpful > 0  # both outcomes seen: the test can fail either way
