"""SideChannel: failure notes of one run are not read by the next; an error's headline says where it happened."""

import numpy as np
import torch

from hf_dp_balance.testing.spawn import run_ranks


def _two_runs(rank, world):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.side_channel import SideChannel
    from hf_dp_balance.testing.side import live_process_groups

    before = live_process_groups()
    first = SideChannel(None, DPBalanceConfig(timeout_s=30))
    ex = first.exchange()
    if rank == 1:
        ex.report_failure(3, "ValueError: the first run's bad sample")
    torch.distributed.barrier()
    seen_in_first = ex.reported_failures()
    first.close()
    second = SideChannel(None, DPBalanceConfig(timeout_s=30))
    seen_in_second = second.exchange().reported_failures()
    ids = (first.run_id, second.run_id)
    second.close()
    return {"first": seen_in_first, "second": seen_in_second, "ids": ids, "groups": (before, live_process_groups())}


def test_failure_notes_are_namespaced_by_run_and_groups_are_destroyed():
    out = run_ranks(_two_runs, 2, timeout=90, pg_timeout_s=40)
    for o in out:
        assert list(o["first"]) == [1] and "first run" in o["first"][1]
        assert o["second"] == {}  # a later run never names the earlier run's failed ranks
        assert o["groups"][0] == o["groups"][1]  # every side group of both runs destroyed
    assert out[0]["ids"] == out[1]["ids"] and out[0]["ids"][0] != out[0]["ids"][1]  # agreed, fresh per run


def _source(rank):
    for i in range(6):
        if rank == 1 and i == 3:
            raise KeyError("input_ids")  # the user's dataset fails on one rank (not a ValueError)
        yield [{"input_ids": torch.arange(5 + i + rank), "sample_id": 10 * rank + i}]


def _key_error(rank, world):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader

    loader = BalancedLoader(_source(rank), DPBalanceConfig(timeout_s=30), gradient_accumulation_steps=2,
                            collator=lambda s: s, features_fn=lambda s: (len(s["input_ids"]), 0),
                            cost_model=CostModel(1.0, 1.0))
    try:
        for _ in loader.iter_steps():
            pass
        return None
    except Exception as exc:  # noqa: BLE001 - the headline each rank sees
        return str(exc).splitlines()[0]
    finally:
        loader.close()


def test_a_non_value_error_keeps_step_rank_micro_batch_and_type_in_its_headline():
    out = run_ranks(_key_error, 2, timeout=90, pg_timeout_s=40)
    assert out[1] is not None and "step 1, rank 1, micro-batch 1" in out[1] and "KeyError" in out[1], out[1]
    assert out[0] is not None and "rank 1" in out[0], out[0]  # the peer is told who failed
