"""`StreamPosition`: the resume point of a balanced loader, counted in the raw batches the next pass skips."""

import pytest

from hf_dp_balance.runtime.stream_position import StreamPosition


def _run_steps(position, steps, num_micro):
    for step in range(steps):
        position.step_done(step, num_micro)


@pytest.mark.parametrize("raw_per_micro", [1, 3])
def test_a_resume_skips_the_raw_batches_of_the_completed_steps_and_keeps_counting(raw_per_micro):
    ga = 2
    saved = StreamPosition(ga, raw_per_micro)
    assert saved.begin_pass(0) == 0
    _run_steps(saved, 3, ga)
    point = saved.position(0)
    # dispatch mode reads one raw batch per rank and slot: the skip counts them all, not the slots
    assert point == {"epoch": 0, "steps": 3, "micro_batches": 3 * ga * raw_per_micro, "window": None}

    resumed = StreamPosition(ga, raw_per_micro)
    assert resumed.restore(point) == 0
    assert resumed.begin_pass(resumed.next_epoch) == 3 * ga * raw_per_micro
    _run_steps(resumed, 1, ga)
    assert resumed.position(0) == {"epoch": 0, "steps": 4, "micro_batches": 4 * ga * raw_per_micro, "window": None}
    assert resumed.begin_pass(0) == 0  # the skip applies to one pass only


def test_a_short_last_step_counts_its_own_micro_batches_and_a_finished_pass_resumes_at_the_next_epoch():
    position = StreamPosition(4)
    position.begin_pass(2)
    position.step_done(0, 4)
    position.step_done(1, 1)
    assert position.position(2)["micro_batches"] == 5
    position.end_pass()
    assert (position.epoch, position.next_epoch) == (None, 3)
    assert position.position(3) == {"epoch": 3, "steps": 0, "micro_batches": 0, "window": None}


def test_inside_a_window_the_resume_reads_the_window_again_from_its_start():
    window = {"trained": 2, "plan": "saved"}
    handed = []
    saved = StreamPosition(2, window_state=lambda done: window if done == 5 else None)
    saved.begin_pass(0)
    _run_steps(saved, 5, 2)
    point = saved.position(0)
    assert point["micro_batches"] == (5 - 2) * 2 and point["steps"] == 5 and point["window"] is window

    resumed = StreamPosition(2, window_state=lambda done: None, resume_in_window=handed.append)
    resumed.restore(point)
    assert handed == [window]  # the loader re-plans the window as saved
    assert resumed.begin_pass(0) == (5 - 2) * 2  # the window's raw batches are read again


def test_a_window_is_refused_by_name_where_the_loader_cannot_resume_one():
    with pytest.raises(ValueError, match="inside a look-ahead window"):
        StreamPosition(2).restore({"epoch": 0, "steps": 3, "micro_batches": 2, "window": {"trained": 1}})
