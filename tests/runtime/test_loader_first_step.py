"""The loader's first steps on real gloo ranks: the queue is full before step 1 trains, and steps costed by a
FLOP prior get the hedged plan."""

import numpy as np

from hf_dp_balance.testing.spawn import run_ranks

# 12 samples, 4 per rank; the prior weighs attention (L^2) far above the tokens (tests/core/test_hedge.py)
LENGTHS = [157, 89, 156, 437, 56, 60, 215, 103, 449, 42, 49, 102]


def _loader(rank, steps, cost_model, prefetch=2):
    import torch
    from torch.utils.data import DataLoader

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.loader import BalancedLoader
    from hf_dp_balance.runtime.step_rows import list_collate

    mine = [k for k in range(len(LENGTHS)) if k // 4 == rank]
    raw = [[{"input_ids": torch.zeros(LENGTHS[k], dtype=torch.int32), "sample_id": k} for k in mine]] * steps
    return BalancedLoader(DataLoader(raw, batch_size=None, collate_fn=list_collate),
                          DPBalanceConfig(timeout_s=60, prefetch_steps=prefetch, min_gain=0.0, max_token_ratio=4.0),
                          collator=lambda s: {"ids": [x["sample_id"] for x in s]}, id_key="sample_id",
                          features_fn=lambda s: (int(s["input_ids"].numel()), 0), cost_model=cost_model)


def _queued_at_open(rank, world):
    from hf_dp_balance.core.cost import CostModel

    out = {}
    for name, model in (("model", CostModel(quadratic=1e-2, linear=1.0)), ("none", None)):
        loader = _loader(rank, 4, model)
        stream = loader.open_stream(iter(loader.dataloader), step_limit=4)
        out[name] = stream._queue.qsize()  # read before anything is taken
        while stream.next_step() is not None:
            pass
        loader.close()
    return out


def test_the_queue_is_full_before_the_first_step_is_taken():
    # Step 1 overlaps the preparation of one later step, as every other step does (before: all of
    # steps 2..prefetch_steps+1 were prepared while step 1 trained). Without a model it stays one ahead.
    for got in run_ranks(_queued_at_open, 2, timeout=120):
        assert got == {"model": 2, "none": 1}, got


def _step_ids(rank, world):
    """{way: (this rank's ids, the step's reason)}: a fitted model, the prior hedged, the prior probing."""
    from hf_dp_balance.core.cost import CostModel

    out = {}
    for way, prior, probe in (("plain", False, False), ("hedged", True, False), ("probed", True, True)):
        loader = _loader(rank, 1, None)
        loader.set_cost_model(CostModel(quadratic=1e-2, linear=1.0), prior=prior, probe=probe)
        (batches,) = list(loader.iter_steps())
        (stats,) = loader.pop_stats()
        loader.close()
        out[way] = (batches[0]["ids"], stats.reason)
    return out


def _token_excess(per_rank_ids):
    loads = np.array([sum(LENGTHS[i] for i in ids) for ids in per_rank_ids], dtype=float)
    return loads.max() / loads.mean() - 1.0


def test_a_step_costed_by_the_prior_gets_the_hedged_plan_and_probes_only_for_a_step_time_fit():
    out = run_ranks(_step_ids, 3, timeout=120)
    ways = {way: [o[way] for o in out] for way in ("plain", "hedged", "probed")}
    for got in ways.values():  # every sample once, every way
        assert sorted(i for ids, _ in got for i in ids) == list(range(len(LENGTHS)))
    assert all("hedged:" in r and "probe" not in r for _, r in ways["hedged"]), ways["hedged"]
    assert not any("hedged" in r for _, r in ways["plain"])
    # the prior's own plan leaves a rank > 50% above the mean in tokens; the hedged one < 20%
    assert _token_excess([i for i, _ in ways["plain"]]) > 0.5
    assert _token_excess([i for i, _ in ways["hedged"]]) < 0.2
    # a per-rank fit sees every rank's time: its warm-up keeps the hedged plan; a step-time fit sees only the
    # slowest rank, so its warm-up probes the cost's shape (`core.hedge.probe_plan`), every rank alike
    assert all("probe" in r for _, r in ways["probed"]) and len({r for _, r in ways["probed"]}) == 1
