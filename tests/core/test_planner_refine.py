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


def _reference_refine(state, budget, goal, max_iters, candidates=2):
    """`_refine` one rank at a time with the full matrices (no screens): what the screens must equal."""
    budget = np.maximum(budget, np.finfo(np.float64).tiny)
    members = _Members(state.dest, budget.shape[0])
    stuck = np.zeros(budget.shape[0], dtype=bool)
    for _ in range(max_iters):
        full = state.load / budget
        h = int(np.argmax(np.where(stuck, -np.inf, full)))
        if full[h] <= goal or stuck[h]:
            return
        mine, cand = members.of(h), _emptiest(full, h, candidates)
        groups = [members.of(int(l)) for l in cand]
        theirs = np.concatenate(groups)
        ca = state.costs[mine]
        to_slot = np.argmin(state.slot_tok[cand], axis=1)
        room = state.cap - state.slot_tok[cand, to_slot]
        move = np.maximum(((state.load[h] - ca) / budget[h])[:, None],
                          (state.load[cand][None, :] + ca[:, None]) / budget[cand][None, :])
        move = np.where(state.tokens[mine][:, None] <= room[None, :], move, np.inf)
        col_rank = np.repeat(cand, [g.size for g in groups])
        swap = np.full((mine.size, max(theirs.size, 1)), np.inf)
        if theirs.size:
            delta = ca[:, None] - state.costs[theirs][None, :]
            swap = np.maximum((state.load[h] - delta) / budget[h],
                              (state.load[col_rank][None, :] + delta) / budget[col_rank][None, :])
            ta, tb = state.tokens[mine][:, None], state.tokens[theirs][None, :]
            into_l = state.slot_tok[col_rank, state.micro[theirs]][None, :] - tb + ta
            into_h = state.slot_tok[h, state.micro[mine]][:, None] - ta + tb
            swap = np.where((into_l <= state.cap) & (into_h <= state.cap), swap, np.inf)
        km, ks = int(np.argmin(move)), int(np.argmin(swap))
        if not min(move.flat[km], swap.flat[ks]) < full[h]:
            stuck[h] = True
        elif move.flat[km] <= swap.flat[ks]:
            a, j = divmod(km, cand.size)
            state.move(int(mine[a]), int(cand[j]), int(to_slot[j]))
            members.moved(int(mine[a]), h, int(cand[j]))
        else:
            a, j = divmod(ks, theirs.size)
            item_a, item_b, l = int(mine[a]), int(theirs[j]), int(col_rank[j])
            slot_a, slot_b = int(state.micro[item_a]), int(state.micro[item_b])
            state.move(item_b, h, slot_a)
            state.move(item_a, l, slot_b)
            members.moved(item_b, l, h)
            members.moved(item_a, h, l)


def test_refine_with_its_screens_moves_exactly_as_one_rank_at_a_time():
    from hf_dp_balance.core.planner.refine import _refine
    from hf_dp_balance.core.planner.state import _copy_state

    changed = 0
    for seed in range(8):
        R, M = 12 + 3 * seed, (2, 4, 8)[seed % 3]
        tokens, owners, mbs = _long_tail(100 + seed, R, M, 4096)
        state, budget = _state(tokens, owners, mbs, R, M, 4096, (1.4e-4, 1e-3)[seed % 2])
        ours, theirs = _copy_state(state), _copy_state(state)
        _refine(ours, budget, 1.0025, 2 * R + 16)
        _reference_refine(theirs, budget, 1.0025, 2 * R + 16)
        assert np.array_equal(ours.dest, theirs.dest) and np.array_equal(ours.micro, theirs.micro), seed
        assert np.array_equal(ours.load, theirs.load)
        changed += int(np.count_nonzero(ours.dest != state.dest))
    assert changed > 0  # the refinement did move items
