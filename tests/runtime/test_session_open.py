"""`BalanceSession.open`: a session either opens completely or leaves nothing behind (one process, no group)."""

import pytest
import torch

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.runtime.session import BalanceSession


class _Accelerator:
    def backward(self, loss):
        return loss


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_a_setup_that_raises_closes_the_session_and_undoes_its_patches():
    model, accelerator, made = torch.nn.Linear(2, 2), _Accelerator(), []

    def setup(session):
        made.append(session)
        session.patches.name_errors(accelerator, "backward", lambda: None, lambda: 1)
        assert "backward" in vars(accelerator) and _hooks(model) > 0  # wired before the failure
        raise RuntimeError("the adapter's wiring failed")

    with pytest.raises(RuntimeError, match="the adapter's wiring failed"):
        BalanceSession.open(DPBalanceConfig(), model=model, setup=setup)
    (session,) = made
    assert session.closed and session.side.closed
    assert "backward" not in vars(accelerator) and len(session.patches) == 0
    assert _hooks(model) == 0  # the recorder's hooks are off the model


def test_a_failed_start_check_runs_no_setup_and_leaves_no_hook():
    model, ran = torch.nn.Linear(2, 2), []

    def refuse():
        raise ValueError("hf_dp_balance: the user's setup is refused")

    with pytest.raises(ValueError, match="refused"):
        BalanceSession.open(DPBalanceConfig(), model=model, setup=ran.append, checks=[refuse])
    assert ran == [] and _hooks(model) == 0


def test_an_opened_session_is_started_and_wired_once():
    model, ran = torch.nn.Linear(2, 2), []
    session = BalanceSession.open(DPBalanceConfig(), model=model, setup=ran.append)
    try:
        assert ran == [session] and session.fitter is not None and _hooks(model) > 0 and not session.closed
    finally:
        session.close()
    assert _hooks(model) == 0
