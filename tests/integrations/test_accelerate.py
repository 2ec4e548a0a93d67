"""DPBalancer in a custom Accelerate loop, on real gloo ranks.

The accumulate race: accelerate's `DataLoaderShard` flips the process-wide end-of-data flag when the
exchange thread reads its last batch, steps before the loop trains it, so `accelerator.accumulate()`
syncs gradients at other micro-batches than the unbalanced loop would (and ranks can disagree: DDP
deadlock). The balanced loader must own that flag.
"""

import numpy as np
import pytest
import torch

from hf_dp_balance.testing.spawn import run_ranks

GA = 2


class _TextSamples(torch.utils.data.Dataset):
    """Text samples with long-tail lengths; token 1 is 11 + index, so every sample is identifiable."""

    def __init__(self, n: int, seed: int = 0, max_len: int = 120):
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(np.log(24), 1.0, size=n), 6, max_len).astype(int)
        self.items = []
        for i, length in enumerate(lengths):
            ids = torch.tensor([2, 11 + i] + rng.integers(11 + n, 512, size=int(length) - 2).tolist())
            labels = ids.clone()
            labels[: int(length) // 3] = -100  # a prompt without loss, as in SFT
            self.items.append({"input_ids": ids, "labels": labels, "sample_id": i})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class _EmbeddingSum(torch.nn.Module):
    """The cheapest model a packed batch can drive (the race is about the loop, not the model)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(512, 4)

    def forward(self, input_ids, **kwargs):
        return self.emb(input_ids).mean()


def expected_syncs(num_micro: int, ga: int):
    """accumulate()'s sync pattern without balancing: every GA-th micro-batch and the last one."""
    return [(i + 1) % ga == 0 or i == num_micro - 1 for i in range(num_micro)]


def _sync_pattern(rank, world, how):
    """Per micro-batch: accelerator.sync_gradients inside accumulate(); the main thread is the slow side."""
    import time

    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.testing.models import tiny_config

    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    model = acc.prepare(_EmbeddingSum())
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, warmup_steps=0)
    cost = CostModel(quadratic=1.0, linear=20.0)
    raw = torch.utils.data.DataLoader(_TextSamples(28), batch_size=2)  # 7 micro-batches per rank
    if how == "wrap_shard":  # as a user does today: BalancedLoader over accelerate's prepared shard
        from hf_dp_balance.runtime.loader import BalancedLoader, list_collate

        raw.collate_fn = list_collate
        loader = BalancedLoader(acc.prepare(raw), cfg, gradient_accumulation_steps=GA,
                                model_config=tiny_config("text"), cost_model=cost)
        balancer = None
    else:
        from hf_dp_balance.integrations.accelerate import DPBalancer

        balancer = DPBalancer(acc, model_config=tiny_config("text"), config=cfg, cost_model=cost)
        loader = balancer.prepare(raw)
    syncs = []
    for batch in loader:
        with acc.accumulate(model):
            acc.backward(model(**batch))
            syncs.append(bool(acc.sync_gradients))
        time.sleep(0.02 * (1 + rank))  # the thread runs ahead of the loop
    if balancer is not None:
        balancer.close()
    return syncs


def test_balanced_loader_syncs_gradients_where_the_unbalanced_loop_does_on_every_rank():
    syncs = run_ranks(_sync_pattern, 2, "balancer", timeout=90, pg_timeout_s=40)
    assert syncs[0] == syncs[1] == expected_syncs(7, GA)


@pytest.mark.xfail(strict=True, reason="BalancedLoader over a DataLoaderShard in a custom loop: its thread flips "
                                       "GradientState.end_of_dataloader steps early (Trainer sets sync itself)")
def test_balanced_loader_over_the_shard_races_accumulate():
    syncs = run_ranks(_sync_pattern, 2, "wrap_shard", timeout=90, pg_timeout_s=40)
    assert syncs[0] == syncs[1] == expected_syncs(7, GA)


# --------------------------------------------------------------------------- loss normalisation


def _vlm_samples(family: str, n: int):
    """`n` identifiable VLM samples of varied length: text-only, one image, several images."""
    from hf_dp_balance.testing.data import make_samples

    kinds = ("text", "image", "text", "multi_image")
    out = []
    for i in range(n):
        (sample,) = make_samples(family, (kinds[i % len(kinds)],), seed=i, text_tokens=8 + 7 * (i % 5),
                                 vision_tokens=4 * (1 + i % 3))
        out.append({**sample, "sample_id": i})
    return out


def _samples(family: str, n: int):
    return _TextSamples(n, max_len=60).items if family == "text" else _vlm_samples(family, n)


def _train(acc, family, samples, balanced: bool, steps_seen):
    """The issue's loop; returns the synced gradient of every optimizer step (flat, float64)."""
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import make_model

    model = make_model(family, seed=0, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = acc.prepare(model, optimizer)
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, enabled=balanced, max_token_ratio=3.0)
    grads = []
    with DPBalancer(acc, model=model, config=cfg, cost_model=CostModel(quadratic=1.0, linear=5.0),
                    id_key="sample_id") as balancer:
        loader = balancer.prepare(torch.utils.data.DataLoader(samples, batch_size=2))
        for batch in loader:
            with acc.accumulate(model):
                out = model(**batch)
                acc.backward(out.loss)
                if acc.sync_gradients:
                    grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]))
                optimizer.step()
                optimizer.zero_grad()
        steps_seen.extend((s.step, s.local_ids, s.moved_samples) for s in balancer.step_stats)
        metrics = balancer.metrics()
    return torch.stack(grads).numpy(), metrics  # numpy: a tensor would travel as shared memory of an exited process


def _balanced_and_unbalanced(rank, world, family, n):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    # a rank whose packed row has no image leaves the vision tower without gradients
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True,
                      kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=family != "text")])
    samples = _samples(family, n)
    seen_on, seen_off = [], []
    on, metrics = _train(acc, family, samples, True, seen_on)
    off, _ = _train(acc, family, samples, False, seen_off)
    return {"on": on, "off": off, "seen": seen_on, "metrics": metrics}


def _reference_first_step(family, samples, ids, world):
    """The first step's gradient from one process: every sample alone, summed token loss / the step's
    target tokens, over `world` (DDP averages the ranks' gradients) and GA (`accelerator.backward` divides)."""
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.testing.models import make_model

    model = make_model(family, seed=0, dtype=torch.float64)
    collate = PackedCollator(model.config)
    rows = [collate([samples[i]]) for i in ids]
    total = sum(int((r["labels"][..., 1:] != -100).sum()) for r in rows)
    for r in rows:
        (model(**r, num_items_in_batch=total).loss / (world * GA)).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("family,world", [("text", 2), ("text", 3), ("qwen2_vl", 2)])
def test_the_issue_s_loop_gives_the_unbalanced_gradients_and_trains_every_sample_once(family, world):
    n = 8 * world
    out = run_ranks(_balanced_and_unbalanced, world, family, n, timeout=150, pg_timeout_s=60)
    on, off = torch.from_numpy(out[0]["on"]), torch.from_numpy(out[0]["off"])
    assert on.shape == off.shape and on.shape[0] == 2  # 2 optimizer steps of GA micro-batches of 2 per rank
    for r in out[1:]:  # DDP synced: every rank holds the same gradient
        assert torch.allclose(torch.from_numpy(r["on"]), on, rtol=0, atol=1e-12)
    rel = float(((on - off).norm(dim=1) / off.norm(dim=1)).max())
    assert rel < 1e-5, rel
    moved = sum(m for r in out for (_, _, m) in r["seen"]) // world  # moved_samples is global, seen by every rank
    assert moved > 0  # balancing moved samples, so the equality above could have failed
    trained = [i for r in out for (_, ids, _) in r["seen"] for mb in ids for i in mb]
    assert sorted(trained) == list(range(n))  # every sample exactly once
    first = sorted(i for r in out for (step, ids, _) in r["seen"] if step == 0 for mb in ids for i in mb)
    ref = _reference_first_step(family, _samples(family, n), first, world)
    assert float((on[0] - ref).norm() / ref.norm()) < 1e-5
    metrics = out[0]["metrics"]
    assert metrics["dp_balance/steps"] == 2 and metrics["dp_balance/moved_samples"] == moved


# --------------------------------------------------------------------------- data-parallel dimension only


def _digest(batch) -> str:
    import hashlib

    h = hashlib.sha1()
    for key in sorted(batch):
        value = batch[key]
        h.update(key.encode())
        h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def _tp_pairs(rank, world):
    """A 2 (dp) x 2 (tp) mesh: each tp slice balances over its own dp group; returns what each rank trained."""
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh["dp"].get_local_rank()
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    # the data shard of a dp index, as accelerate makes it under a mesh: tp peers read the same samples
    shard = prepare_data_loader(torch.utils.data.DataLoader(_TextSamples(32), batch_size=2),
                                num_processes=2, process_index=dp_index, put_on_device=False)
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, max_token_ratio=3.0)
    digests, ids = [], []
    with DPBalancer(acc, model_config=tiny_config("text"), config=cfg, cost_model=CostModel(quadratic=1.0, linear=5.0),
                    data_parallel_group=mesh["dp"], id_key="sample_id") as balancer:
        for batch in balancer.prepare(shard):
            digests.append(_digest(batch))
        ids = [i for s in balancer.step_stats for mb in s.local_ids for i in mb]
        moved = sum(s.moved_samples for s in balancer.step_stats)
        dp = balancer.data_parallel
    return {"digests": digests, "ids": ids, "moved": moved, "dp_ranks": dp.ranks, "dp_index": dp.index}


def test_tp_peers_get_identical_batches_and_each_dp_group_trains_every_sample_once():
    out = run_ranks(_tp_pairs, 4, timeout=150, pg_timeout_s=60)
    assert [o["dp_ranks"] for o in out] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    for a, b in ((0, 1), (2, 3)):  # tp peers: same dp index
        assert out[a]["digests"] == out[b]["digests"] and out[a]["ids"] == out[b]["ids"]
    assert out[0]["digests"] != out[2]["digests"]  # dp ranks differ (the comparison above could fail)
    for group in ((0, 2), (1, 3)):
        assert sorted(i for r in group for i in out[r]["ids"]) == list(range(32))
        assert out[group[0]]["moved"] > 0  # balancing applied


def _spin(seconds: float) -> None:
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _fits_by_itself(rank, world):
    """No cost model given: the balancer times the loop's steps, fits after warm-up and refits, over a
    2 (dp) x 2 (tp) mesh; the loop burns CPU as a*L^2 + b*L per sample (what the fit must find)."""
    from accelerate import Accelerator
    from accelerate.data_loader import prepare_data_loader
    from torch.distributed.device_mesh import init_device_mesh

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.runtime.fitter import micro_batch_lengths
    from hf_dp_balance.testing.models import tiny_config

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    shard = prepare_data_loader(torch.utils.data.DataLoader(_TextSamples(48), batch_size=2),
                                num_processes=2, process_index=mesh["dp"].get_local_rank(), put_on_device=False)
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, max_token_ratio=3.0, warmup_steps=2, refit_every=2,
                          metrics_every=1)
    digests, models, metrics = [], [], []
    with DPBalancer(acc, model_config=tiny_config("text"), config=cfg, data_parallel_group=mesh["dp"],
                    id_key="sample_id") as balancer:
        loader = balancer.prepare(shard)
        for i, batch in enumerate(loader):
            digests.append(_digest(batch))
            _spin(sum(2e-6 * n * n + 1e-4 * n for n in micro_batch_lengths(batch)))
            if i % GA == GA - 1:  # a step's last micro-batch: the model in force after it
                model = balancer.cost_model
                models.append(None if model is None else model.to_dict())
                metrics.append(balancer.metrics())
        fits = [r["step"] for r in balancer.fitter.fit_reports]
        moved = [s.moved_samples for s in balancer.step_stats]
        ids = [i for s in balancer.step_stats for mb in s.local_ids for i in mb]
        same = balancer.session.loaders[0].cost_model is balancer.cost_model
    return {"digests": digests, "models": models, "metrics": metrics, "fits": fits, "moved": moved, "ids": ids,
            "loader_has_it": same}


def test_the_balancer_fits_and_refits_by_itself_with_one_model_for_every_tp_slice():
    out = run_ranks(_fits_by_itself, 4, timeout=180, pg_timeout_s=60)
    for o in out:
        assert o["fits"] == [2, 4, 6]  # after warm-up, then every refit_every steps, with no call from the loop
        assert o["loader_has_it"]
        assert o["models"] == out[0]["models"]  # one fit for every process: tp slices plan alike
        # read inside a step, the model is the one in force when it began: fitted at the end of step 2
        assert o["models"][:2] == [None, None] and o["models"][2] is not None
        # before the fit, the FLOP prior of the model config plans (as under Trainer): warm-up is balanced
        assert o["moved"][0] > 0 and o["metrics"][0]["dp_balance/planning_with_prior"] == 1.0
        m = o["metrics"][-1]
        assert m["dp_balance/planning_with_prior"] == 0.0
        assert m["dp_balance/fitted"] == 1.0 and m["dp_balance/compute_imbalance"] >= 0.0
        assert m["dp_balance/slowest_rank_compute_s"] > 0.0 and "dp_balance/cost_quadratic" in m
    assert sum(out[0]["moved"][3:]) > 0  # then it balances
    fitted = out[0]["models"][-1]
    assert fitted["quadratic"] > 0.0
    for a, b in ((0, 1), (2, 3)):  # tp peers: identical batches all along, fitted model included
        assert out[a]["digests"] == out[b]["digests"]
    for group in ((0, 2), (1, 3)):
        assert sorted(i for r in group for i in out[r]["ids"]) == list(range(48))


# --------------------------------------------------------------------------- dispatch mode


def _generate(n, log):
    import os

    with open(log, "a") as f:  # which process reads the data
        f.write(os.environ["RANK"] + "\n")
    for item in _TextSamples(n).items:
        yield {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in item.items()}


def _dispatched(rank, world, kind, log):
    import datasets
    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config

    n = 28
    if kind in ("to_iterable", "dispatcher"):
        rows = list(_generate(n, log))
        data = datasets.Dataset.from_list(rows).to_iterable_dataset()
    else:
        data = datasets.IterableDataset.from_generator(_generate, gen_kwargs={"n": n, "log": log})
    data = data.with_format("torch")
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)  # an iterable dataset: accelerate dispatches
    model = acc.prepare(_EmbeddingSum())
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, max_token_ratio=3.0)
    syncs = []
    with DPBalancer(acc, model_config=tiny_config("text"), config=cfg, cost_model=CostModel(quadratic=1.0, linear=5.0),
                    id_key="sample_id") as balancer:
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        if kind == "dispatcher":  # what accelerator.prepare made of it: a DataLoaderDispatcher
            loader = acc.prepare(loader)
            assert type(loader).__name__ == "DataLoaderDispatcher"
        for batch in balancer.prepare(loader):
            with acc.accumulate(model):
                acc.backward(model(**batch))
                syncs.append(bool(acc.sync_gradients))
        ids = [int(i) for s in balancer.step_stats for mb in s.local_ids for i in mb]
        moved = sum(s.moved_samples for s in balancer.step_stats)
        loader_type = type(balancer.session.loaders[0]).__name__
    refused = ""
    if kind == "to_iterable":  # rank 0 alone would split packed rows: refused by name before anything runs
        with DPBalancer(acc, model_config=tiny_config("text"), config=cfg.replace(input="packed")) as packed:
            try:
                packed.prepare(torch.utils.data.DataLoader(data, batch_size=2))
            except ValueError as exc:
                refused = str(exc)
    return {"ids": ids, "moved": moved, "syncs": syncs, "loader": loader_type, "refused": refused}


@pytest.mark.parametrize("kind", ["to_iterable", "from_generator", "dispatcher"])
def test_dispatch_mode_balances_streaming_data_read_on_rank_0_only(kind, tmp_path):
    log = str(tmp_path / "readers.txt")
    out = run_ranks(_dispatched, 2, kind, log, timeout=120, pg_timeout_s=50)
    assert [o["loader"] for o in out] == ["DispatchedLoader"] * 2
    assert sorted(i for o in out for i in o["ids"]) == list(range(28))  # every sample exactly once
    assert out[0]["moved"] == out[1]["moved"] > 0  # planned on rank 0, applied
    # 28 samples in batches of 2 = 14 raw batches = 7 micro-batches per rank: GA steps 2, 2, 2, 1
    assert out[0]["syncs"] == out[1]["syncs"] == expected_syncs(7, GA)
    if kind == "from_generator":
        assert open(log).read().split() == ["0"]  # only rank 0 read the stream
    if kind == "to_iterable":
        assert all("not supported in dispatch mode" in o["refused"] for o in out)


# --------------------------------------------------------------------------- resume


def _resume(rank, world):
    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config

    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    model = acc.prepare(_EmbeddingSum())
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, max_token_ratio=3.0)
    runs, lengths, state = [], [], None
    for part in range(2):  # train 2 of the 4 steps, save, stop; then a new run resumes from the state
        ids, syncs = [], []
        with DPBalancer(acc, model_config=tiny_config("text"), config=cfg, cost_model=CostModel(quadratic=1.0, linear=5.0),
                        id_key="sample_id") as balancer:
            loader = balancer.prepare(torch.utils.data.DataLoader(_TextSamples(28), batch_size=2))
            lengths.append(len(loader))
            if state is not None:
                loader.load_state_dict(state)
            steps = 0
            for batch in loader:
                with acc.accumulate(model):
                    acc.backward(model(**batch))
                    syncs.append(bool(acc.sync_gradients))
                if acc.sync_gradients:
                    steps += 1
                    if part == 0 and steps == 2:
                        state = loader.state_dict()
                        break
            ids = [i for s in balancer.step_stats for mb in s.local_ids for i in mb]
        runs.append({"ids": ids, "syncs": syncs})
    return {"runs": runs, "state": state, "lengths": lengths}


def test_state_dict_resumes_after_the_last_completed_step():
    out = run_ranks(_resume, 2, timeout=120, pg_timeout_s=50)
    state = out[0]["state"]
    assert state["version"] == 2 and state["data_parallel_size"] == 2
    assert state["loaders"] == [{"settings": {"data_parallel_size": 2, "gradient_accumulation_steps": GA,
                                              "lookahead_steps": 0, "prefetch_steps": 2, "dispatch": False,
                                              "dataloader_workers": 0},
                                 "position": {"epoch": 0, "steps": 2, "micro_batches": 4, "window": None}}]
    assert state["models"]["decoder"] == {**state["models"]["decoder"], "quadratic": 1.0, "linear": 5.0}
    assert out[0]["lengths"] == [7, 7]
    first = [i for o in out for i in o["runs"][0]["ids"]]
    second = [i for o in out for i in o["runs"][1]["ids"]]
    assert sorted(first + second) == list(range(28))  # nothing trained twice, nothing skipped
    for o in out:
        assert o["runs"][0]["syncs"] == expected_syncs(4, GA)
        assert o["runs"][1]["syncs"] == expected_syncs(3, GA)  # the rest: one full step, one short


# --------------------------------------------------------------------------- failure


def _one_bad_sample(rank, world):
    import time

    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import tiny_config

    samples = _TextSamples(28).items
    samples[9] = {**samples[9], "labels": samples[9]["labels"][:-1]}  # one label short: cannot be packed
    acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
    t0 = time.perf_counter()
    with DPBalancer(acc, model_config=tiny_config("text"), config=DPBalanceConfig(timeout_s=20)) as balancer:
        try:
            for _ in balancer.prepare(torch.utils.data.DataLoader(samples, batch_size=2)):
                pass
        except Exception as exc:  # noqa: BLE001 - the test looks at what each rank was told
            return {"error": str(exc), "seconds": time.perf_counter() - t0}
    return {"error": None}


def test_a_bad_sample_on_one_rank_stops_every_rank_with_an_error_naming_it():
    out = run_ranks(_one_bad_sample, 2, timeout=90, pg_timeout_s=50)
    # sample 9 is rank 0's (batches alternate between ranks): every rank is told its step, rank, sample, key
    for o in out:
        assert "step 1, rank 0, micro-batch 0, sample 1" in o["error"] and "'labels'" in o["error"], o["error"]
    assert "rank(s) [0] failed" in out[1]["error"]
    assert max(o["seconds"] for o in out) < 20  # told at the next gather, not after the timeout


# --------------------------------------------------------------------------- metrics on one rank; the models resume


def _main_process_logs_then_resumes(rank, world, folder):
    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.runtime.fitter import micro_batch_lengths
    from hf_dp_balance.testing.data import tiny_config

    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=30, max_token_ratio=3.0, warmup_steps=2, refit_every=0,
                          metrics_every=2)
    logged, models = [], []
    for part in range(2):
        acc = Accelerator(gradient_accumulation_steps=GA, cpu=True)
        with DPBalancer(acc, model_config=tiny_config("text"), config=cfg, id_key="sample_id") as balancer:
            loader = balancer.prepare(torch.utils.data.DataLoader(_TextSamples(48), batch_size=2))
            if part == 1:
                acc.load_state(folder)
                models.append(balancer.cost_model.to_dict() if balancer.cost_model is not None else None)
            for i, batch in enumerate(loader):
                _spin(sum(2e-6 * n * n + 1e-4 * n for n in micro_batch_lengths(batch)))
                if i % GA == GA - 1 and acc.is_main_process:  # the usual logging idiom: one rank only
                    logged.append(balancer.metrics())
                if part == 0 and i == 4 * GA - 1:  # after step 4: the warm-up fit landed after step 2
                    models.append(balancer.cost_model.to_dict())
                    acc.save_state(folder)
                    break
    return {"logged": logged, "models": models}


def test_metrics_on_the_main_process_only_and_a_resume_keeps_the_fitted_models(tmp_path):
    out = run_ranks(_main_process_logs_then_resumes, 2, str(tmp_path), timeout=120, pg_timeout_s=40)
    assert len(out[0]["logged"]) == 4 + 2 and out[1]["logged"] == []  # no rank waited for the other
    assert any("dp_balance/compute_imbalance" in m for m in out[0]["logged"])  # measured inside the steps
    for o in out:  # the resumed balancer plans with the saved fit from its first step, no new warm-up
        assert o["models"][0] is not None and o["models"][1] == o["models"][0]
