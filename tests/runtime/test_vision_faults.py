"""Faults inside a balanced vision forward, on real gloo ranks: a failure on one rank (its tower, its
planner, its input, its cost model) or a peer that dies ends every rank fast with one error naming step,
rank and phase, or (a planner failure) makes every rank keep its images alike; nothing waits for the
group's timeout."""

import os
import signal
import time

import torch

from hf_dp_balance.testing.spawn import run_ranks_until

TIMEOUT_S = 20.0  # the vision group's timeout: every fast path below ends well inside it
FAST_S = 6.0
STOP_TIMEOUT_S = 3.0  # a stopped peer is only found by the timeout: a short one


def _model(timeout_s=TIMEOUT_S):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.testing import models

    torch.manual_seed(0)
    model = balance_vision_encoder(models.make_model("qwen2_vl", seed=0),
                                   DPBalanceConfig(vision=True, timeout_s=timeout_s))
    model._dp_balance_vision.step_source = lambda: 40 + model._dp_balance_vision.forwards  # as the callback sets it
    return model


def _batch(rank):
    from hf_dp_balance.testing.vision_rows import qwen_row

    # rank 1 holds four images (one large), rank 0 one small: every plan moves images to rank 0 and both ranks
    # run the tower; a per-image cost model moves other images than the default one
    items = [("image", 1, 8, 8)] + [("image", 1, 4, 4)] * 3 if rank == 1 else [("image", 1, 4, 4)]
    return qwen_row("qwen2_vl", items, seed=rank)


def _outcome(fn):
    """("ok", seconds, stats reason) or ("raised", seconds, "ExceptionType: message")."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test asserts the type in the message
        return "raised", time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    return "ok", time.monotonic() - t0, None


class _Once:
    """A forward pre-hook on the vision tower that raises on one rank, once."""

    def __init__(self, rank, victim):
        self.armed = rank == victim

    def __call__(self, module, args):
        if self.armed:
            self.armed = False
            raise RuntimeError("CUDA out of memory (injected)")


def _one_rank_fails(rank, world):
    """Scenarios in sequence on the same group: each must leave every rank at the same point."""
    import hf_dp_balance.core.planner as planner
    from hf_dp_balance.core.cost import CostModel

    model = _model()
    balancer = model._dp_balance_vision
    batch = _batch(rank)
    out = {}
    model(**batch).loss.backward()  # healthy: balancing applies
    out["healthy"] = balancer.pop_stats()[-1]

    # 1. the tower raises on rank 1 while rank 0 heads for the embedding return
    hook = balancer.tower.module.register_forward_pre_hook(_Once(rank, 1))
    out["tower raises"] = _outcome(lambda: model(**batch))
    hook.remove()
    balancer.pop_stats()

    # 2. the planner raises on rank 1 only: every rank keeps its images (planning never stops training)
    real = planner.plan_balance

    def failing(*args, **kwargs):
        raise FloatingPointError("planner exploded (injected)")

    planner.plan_balance = failing if rank == 1 else real
    try:
        out["planner raises"] = _outcome(lambda: model(**batch).loss.backward())
    finally:
        planner.plan_balance = real
    stats = balancer.pop_stats()
    out["planner raises stats"] = stats[-1] if stats else None

    # 3. rank 1 plans with another cost model: the plans differ, every rank raises before anything moves
    own = balancer.cost_model
    if rank == 1:
        balancer.cost_model = CostModel(quadratic=0.0, linear=0.0, per_sample=1.0)
    out["plans differ"] = _outcome(lambda: model(**batch))
    balancer.cost_model = own
    balancer.pop_stats()

    # 4. bad input of a kind the tower adapter does not check itself (a grid that is no tensor) on rank 1
    bad = dict(batch)
    if rank == 1:
        bad["image_grid_thw"] = batch["image_grid_thw"].tolist()
    out["bad grid"] = _outcome(lambda: model(**bad))

    model(**batch).loss.backward()  # the group is still in step: a healthy forward balances again
    out["healthy after"] = balancer.pop_stats()[-1]
    return out


def test_a_failure_on_one_rank_inside_the_vision_step_is_agreed_by_every_rank():
    got = run_ranks_until(_one_rank_fails, 2, ranks=[0, 1], timeout=240)
    for rank in (0, 1):
        ok, out, _ = got[rank]
        assert ok, out
        assert out["healthy"]["applied"] and out["healthy"]["items_moved"] > 0, out["healthy"]

        kind, seconds, msg = out["tower raises"]
        assert kind == "raised" and seconds < FAST_S, out["tower raises"]  # rank 0 waited the 20 s timeout before
        assert msg.startswith("ExchangeError: hf_dp_balance vision balancing, step 42, forward 2, "
                              f"rank {rank}, phase tower forward: rank(s) [1] failed"), msg
        assert "rank 1: RuntimeError: CUDA out of memory (injected)" in msg, msg

        kind, seconds, msg = out["planner raises"]
        assert kind == "ok" and seconds < FAST_S, out["planner raises"]
        stats = out["planner raises stats"]
        assert not stats["applied"] and stats["computed_items"] == stats["local_items"], stats
        assert "planning failed on rank(s) [1]: rank 1: FloatingPointError: planner exploded" in stats["reason"], stats

        kind, seconds, msg = out["plans differ"]
        assert kind == "raised" and seconds < FAST_S, out["plans differ"]
        assert msg.startswith("ExchangeError: hf_dp_balance vision balancing, step 44, forward 4, "
                              f"rank {rank}, phase plan check: the plan of rank(s) [1] differs"), msg

        kind, seconds, msg = out["bad grid"]
        assert kind == "raised" and seconds < FAST_S, out["bad grid"]
        assert msg.startswith("ExchangeError: hf_dp_balance vision balancing, step 45, forward 5, "
                              f"rank {rank}, phase local items: rank(s) [1] failed"), msg
        assert "rank 1: ValueError: rank 1: image_grid_thw is a list, not a tensor" in msg, msg

        assert out["healthy after"]["applied"], out["healthy after"]


# ------------------------------------------------------------------ a peer dies inside the step


def _peer_dies(rank, world, where):
    model = _model(STOP_TIMEOUT_S if where == "stopped" else TIMEOUT_S)
    balancer = model._dp_balance_vision
    batch = _batch(rank)
    model(**batch).loss.backward()  # healthy first
    if rank == 1:
        if where == "forward":  # dies inside its tower: rank 0 is at (or heads for) the embedding return
            balancer.tower.module.register_forward_pre_hook(lambda module, args: os._exit(3))
        elif where == "stopped":  # stops inside its tower: rank 0 waits the group's timeout, no longer
            balancer.tower.module.register_forward_pre_hook(lambda module, args: os.kill(os.getpid(), signal.SIGSTOP))
        else:  # dies at the start of its backward: rank 0 waits in the embedding gradient return
            model.lm_head.register_full_backward_pre_hook(lambda module, grad: os._exit(3))
    return _outcome(lambda: model(**batch).loss.backward())


def _check_peer_died(where, phase, limit_s=FAST_S):
    got = run_ranks_until(_peer_dies, 2, where, ranks=[0], timeout=120)
    ok, value, _ = got[0]
    assert ok, value
    kind, seconds, msg = value
    assert kind == "raised" and seconds < limit_s, value
    assert msg.startswith(f"ExchangeError: hf_dp_balance vision balancing, step 42, forward 2, rank 0, "
                          f"phase {phase}"), msg
    return msg


def test_a_peer_dying_in_the_vision_forward_ends_the_survivor_with_a_named_error():
    _check_peer_died("forward", "tower forward")


def test_a_peer_dying_before_the_vision_backward_ends_the_survivor_with_a_named_error():
    _check_peer_died("backward", "embedding gradient all_to_all (backward)")


def test_a_stopped_peer_ends_the_survivor_after_the_timeout_as_a_collective_failure():
    msg = _check_peer_died("stopped", "tower forward all_reduce: collective failed (timeout 3s;",
                           limit_s=STOP_TIMEOUT_S + FAST_S)
    assert "failed on this rank" not in msg, msg  # gloo's timed wait says only "Operation timed out!"
