"""Fault paths on real gloo processes: every surviving rank raises fast, naming step, rank and phase."""

import os
import signal
import time

import numpy as np
import torch

from hf_dp_balance.testing.side import side_exchange as _exchange
from hf_dp_balance.runtime.exchange import ExchangeError, SampleExchange
from hf_dp_balance.testing.spawn import run_ranks_until

TIMEOUT_S = 3.0


def _timed(fn):
    """(seconds, message of the ExchangeError) or (seconds, None) when `fn` returned."""
    t0 = time.monotonic()
    try:
        fn()
        return time.monotonic() - t0, None
    except ExchangeError as exc:
        return time.monotonic() - t0, str(exc)


def _errors(got, ranks):
    """{rank: (seconds, ExchangeError message)} of ranks whose function returned `_timed`'s result after raising."""
    out = {}
    for rank in ranks:
        ok, value, _ = got[rank]
        assert ok, value
        elapsed, msg = value
        assert msg is not None, f"rank {rank} did not raise"
        out[rank] = (elapsed, msg)
    return out


# ------------------------------------------------------------------ the store's host stopped

def _store_host_stops(rank, world):
    ex = _exchange(TIMEOUT_S)
    ex.gather_metadata(0, np.zeros((1, 2)), num_micro_batches=1)
    if rank == 0:  # rank 0 hosts the rendezvous store (env://): stopped, its socket stays open, never answers
        os.kill(os.getpid(), signal.SIGSTOP)
    return _timed(lambda: ex.gather_metadata(1, np.zeros((1, 2)), num_micro_batches=1))


def test_stopped_store_host_does_not_hang_the_error_path():
    got = run_ranks_until(_store_host_stops, 3, ranks=[1, 2], timeout=60)
    for rank, (elapsed, msg) in _errors(got, [1, 2]).items():
        assert "step 1" in msg and "metadata header all_gather" in msg and f"rank {rank}" in msg
        assert elapsed < TIMEOUT_S + 4.0, elapsed  # the store lookup has a deadline (it hung for good before)


# ------------------------------------------------------------------ items 2 and 4: through the loader, one spawn

def _text_samples(rank, steps, ga, long_at=None):
    """Micro-batches of two text samples of uneven lengths; `long_at` = (step, rank): one sample of 900 tokens."""
    for i in range(steps * ga):
        mb = []
        for k in range(2):
            n = 900 if long_at == (i // ga, rank) and k == 1 else 5 + (37 * (i + k + 3 * rank)) % 60
            mb.append({"input_ids": torch.ones(n, dtype=torch.int32), "sample_id": 1000 * rank + 10 * i + k})
        yield mb


def _features(sample):
    return int(sample["input_ids"].numel()), 0


def _ids(samples):
    return {"ids": [s["sample_id"] for s in samples]}


def _consume(loader):
    """(per step: (ids per micro-batch, reason), the RuntimeError's message or None, seconds since the last step)."""
    steps, t0 = [], time.monotonic()
    try:
        for batches in loader.iter_steps():
            steps.append(([b["ids"] for b in batches], loader.pop_stats()[0].reason))
            t0 = time.monotonic()
        return steps, None, 0.0
    except RuntimeError as exc:
        return steps, str(exc), time.monotonic() - t0


def _results(fn):
    """What `fn` returned on each of 2 ranks (both must return)."""
    got = run_ranks_until(fn, 2, ranks=[0, 1], timeout=150)
    for rank in (0, 1):
        assert got[rank][0], got[rank][1]
    return [got[rank][1] for rank in (0, 1)]


class _Planner:
    """The real planner, but on `rank` at `step` (counted in planner calls) it raises or returns another plan."""

    def __init__(self, rank, step, mode):
        from hf_dp_balance.core.planner import plan_step

        self.rank, self.step, self.mode, self.calls, self.plan_step = rank, step, mode, 0, plan_step

    def __call__(self, costs, owners, micro, world, num_micro, **kw):
        plan, self.calls = self.plan_step(costs, owners, micro, world, num_micro, **kw), self.calls + 1
        if self.calls - 1 == self.step and torch.distributed.get_rank() == self.rank:
            if self.mode == "raise":
                raise RuntimeError("planner exploded")
            plan.dest_rank[:] = (np.asarray(owners) + 1) % world  # a plan no other rank computed
        return plan


def _loader_faults(rank, world):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader

    ga, cfg, model, ex = 2, DPBalanceConfig(timeout_s=20, prefetch_steps=2, min_gain=0.0), CostModel(1.0, 1.0), None
    out = {}

    def run(name, samples, cfg, collator=_ids, plan_fn=None):
        nonlocal ex
        loader = BalancedLoader(samples, cfg, gradient_accumulation_steps=ga, collator=collator, features_fn=_features,
                                cost_model=model, plan_fn=plan_fn, exchange=ex, id_key="sample_id")
        ex, out[name] = loader.exchange, _consume(loader)

    run("cap", _text_samples(rank, 5, ga, long_at=(2, 1)), cfg.replace(max_tokens=500))

    def collator(samples):
        if rank == 0 and any(s["sample_id"] % 1000 >= 20 for s in samples):  # rank 0's second step
            raise ValueError("packing exploded")
        return _ids(samples)

    run("collate", _text_samples(rank, 5, ga), cfg, collator=collator)
    # one planning rank (rank 0) plans each step; inside look-ahead windows every rank plans and they compare
    run("planner raises", _text_samples(rank, 5, ga), cfg, plan_fn=_Planner(0, 2, "raise"))
    run("plan differs", _text_samples(rank, 5, ga), cfg.replace(lookahead_steps=2), plan_fn=_Planner(1, 2, "differ"))
    return out


def test_loader_faults_reach_every_rank_before_the_step_trains():
    import torch.distributed  # noqa: F401 - _Planner reads the rank

    results = _results(_loader_faults)
    for rank, out in enumerate(results):
        # a sample over the hard cap on its own: every rank raises at that step, before it trains
        steps, msg, elapsed = out["cap"]
        assert len(steps) == 2 and msg is not None, out["cap"]
        assert "step 2, token cap: rank 1, micro-batch 0, sample 1 has 900 tokens" in msg and elapsed < 5.0
        # a collate failure on rank 0 at step 1: rank 1 does not train step 1 either (it did, then timed out)
        steps, msg, elapsed = out["collate"]
        assert len(steps) == 1 and msg is not None and elapsed < 5.0, out["collate"]
        assert "step 1, collate: rank(s) [0]" in msg and "packing exploded" in msg and "micro-batch" in msg
        # the planner raises on the planning rank at step 2: every rank trains every step, step 2 unbalanced
        steps, msg, _ = out["planner raises"]
        assert msg is None and len(steps) == 5, out["planner raises"]
        assert "planner failed on rank(s) [0]" in steps[2][1] and "planner exploded" in steps[2][1]
        # inside a look-ahead window, a plan that differs on rank 1: every rank raises at once, naming rank 1
        steps, msg, elapsed = out["plan differs"]
        assert len(steps) == 2 and msg is not None and elapsed < 5.0, out["plan differs"]
        assert "step 2, plan check: the plan of rank(s) [1] differs" in msg
    for name in ("planner raises",):  # exactly once across the ranks, whatever step 2 did
        trained = sorted(i for out in results for ids, _ in out[name][0] for mb in ids for i in mb)
        assert trained == sorted(1000 * r + 10 * i + k for r in (0, 1) for i in range(10) for k in (0, 1))


# ------------------------------------------------------------ the planner with look-ahead: the window's plan is agreed

class _Lookahead:
    """The real look-ahead planner, but on `rank` at its `call`-th call it raises or returns another plan."""

    def __init__(self, real, rank, call, mode):
        self.real, self.rank, self.call, self.mode, self.calls = real, rank, call, mode, 0

    def __call__(self, costs, tokens, steps, num_ranks, *, window, **kw):
        new_step, self.calls = self.real(costs, tokens, steps, num_ranks, window=window, **kw), self.calls + 1
        if self.calls - 1 == self.call and torch.distributed.get_rank() == self.rank:
            if self.mode == "raise":
                raise RuntimeError("look-ahead exploded")
            return (np.asarray(new_step) + 1) % window  # a window plan no other rank computed
        return new_step


def _lookahead_faults(rank, world):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core import lookahead
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader

    cfg = DPBalanceConfig(timeout_s=20, prefetch_steps=2, min_gain=0.0, lookahead_steps=3)
    real, ex, out = lookahead.plan_lookahead, None, {}
    for name, mode in (("look-ahead raises", "raise"), ("look-ahead differs", "differ")):
        lookahead.plan_lookahead = _Lookahead(real, 1, 0, mode)  # rank 1, the first window (steps 0..2)
        loader = BalancedLoader(_text_samples(rank, 6, 2), cfg, gradient_accumulation_steps=2, collator=_ids,
                                features_fn=_features, cost_model=CostModel(1.0, 1.0), exchange=ex, id_key="sample_id")
        try:
            ex, out[name] = loader.exchange, _consume(loader)
        finally:
            lookahead.plan_lookahead = real
    return out


def test_a_lookahead_failure_or_differing_window_plan_is_agreed_by_every_rank():
    import torch.distributed  # noqa: F401 - _Lookahead reads the rank

    results = _results(_lookahead_faults)
    for out in results:
        # the look-ahead raises on rank 1 in the first window: every rank keeps that window's steps as they came
        steps, msg, _ = out["look-ahead raises"]
        assert msg is None and len(steps) == 6, out["look-ahead raises"]
        for j, (_, reason) in enumerate(steps):
            failed = "look-ahead failed on rank(s) [1]: rank 1: RuntimeError: look-ahead exploded" in reason
            assert failed == (j < 3), (j, reason)  # the second window is planned again
        # a window plan that differs on rank 1: every rank raises before the window trains, naming rank 1
        steps, msg, elapsed = out["look-ahead differs"]
        assert steps == [] and msg is not None and elapsed < 5.0, out["look-ahead differs"]
        assert "steps 0..2, look-ahead plan check: the plan of rank(s) [1] differs" in msg, msg
    trained = sorted(i for out in results for ids, _ in out["look-ahead raises"][0] for mb in ids for i in mb)
    assert trained == sorted(1000 * r + 10 * i + k for r in (0, 1) for i in range(12) for k in (0, 1))  # exactly once


# ------------------------------------------------------------------ the vision path

def _vision_bad_rows(rank, world):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.testing import models
    from hf_dp_balance.testing.vision_rows import qwen_row

    torch.manual_seed(0)
    model = balance_vision_encoder(models.make_model("qwen2_vl", seed=0), DPBalanceConfig(vision=True, timeout_s=20))
    model._dp_balance_vision.step_source = lambda: 40 + model._dp_balance_vision.forwards  # as the callback sets it
    batch = qwen_row("qwen2_vl", [("image", 1, 4, 4)] * (1 + 3 * rank), seed=rank)
    model(**batch).loss.backward()  # a healthy forward first
    if rank == 1:  # this rank's pixel rows no longer match its grid
        batch = {**batch, "pixel_values": batch["pixel_values"][:-3]}
    return _timed(lambda: model(**batch))


def test_bad_pixel_rows_on_one_rank_make_every_rank_raise_at_once():
    got = run_ranks_until(_vision_bad_rows, 2, ranks=[0, 1], timeout=120)
    for rank, (elapsed, msg) in _errors(got, [0, 1]).items():
        assert elapsed < 5.0, elapsed  # the peer timed out (20 s) with a raw gloo error before
        assert f"step 42, forward 2, rank {rank}, phase local items: rank(s) [1] failed" in msg
        assert "rank 1: pixel_values has shape" in msg


# ------------------------------------------------------------------ a peer stops while the main thread trains

def _train_loop_peer_stops(rank, world, outdir, victim, signum):
    """A loop whose every step ends in a training all_reduce on the default group (DDP's place); at step 4 the
    victim stops (or dies) inside the "forward". Survivors block in the all_reduce; the watchdog must end them."""
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader

    err = os.open(os.path.join(outdir, f"stderr_{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # the watchdog's one message goes to stderr
    cfg = DPBalanceConfig(timeout_s=TIMEOUT_S, prefetch_steps=2, min_gain=0.0)
    loader = BalancedLoader(_text_samples(rank, 30, 2), cfg, gradient_accumulation_steps=2, collator=_ids,
                            features_fn=_features, cost_model=CostModel(1.0, 1.0))
    loader.set_step_offset(40)  # as the callback does: errors name the user's step
    for step, batches in enumerate(loader.iter_steps()):
        if step == 4 and rank == victim:
            with open(os.path.join(outdir, "fault_time"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signum)
        torch.distributed.all_reduce(torch.ones(1))  # the training collective
    return "finished"


def _peer_stops(tmp_path, victim, signum):
    start = time.time()
    got = run_ranks_until(_train_loop_peer_stops, 3, str(tmp_path), victim, signum,
                          ranks=[r for r in range(3) if r != victim], timeout=90, pg_timeout_s=300)
    fault = float((tmp_path / "fault_time").read_text())
    for rank in (r for r in range(3) if r != victim):
        ok, value, seconds = got[rank]
        assert not ok and "exited with code 1" in value, value
        assert start + seconds - fault < TIMEOUT_S + 10.0  # the default group would wait its 300 s
        msg = (tmp_path / f"stderr_{rank}").read_text()
        assert f"hf_dp_balance: step 44, rank {rank}, phase liveness check" in msg, msg


def test_a_stopped_peer_ends_every_surviving_rank_blocked_in_training(tmp_path):
    _peer_stops(tmp_path, 2, signal.SIGSTOP)


# ------------------------------------------------------------------ side groups end with training

def _open_close_cycles(rank, world, cycles):
    import threading

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader
    from hf_dp_balance.runtime.vision import balance_vision_encoder
    from hf_dp_balance.testing import models

    model = models.make_model("qwen2_vl", seed=0)
    counts = []
    for _ in range(cycles):  # one "train()": a loader (exchange + watchdog groups) and a vision balancer
        balance_vision_encoder(model, DPBalanceConfig(vision=True, timeout_s=20))
        loader = BalancedLoader(_text_samples(rank, 3, 2), DPBalanceConfig(timeout_s=20), gradient_accumulation_steps=2,
                                collator=_ids, features_fn=_features, cost_model=CostModel(1.0, 1.0))
        assert len(list(loader.iter_steps())) == 3
        loader.close()
        model._dp_balance_vision.remove()
        counts.append(_settled_counts())
    return counts


def _settled_counts(settle_s: float = 0.5, limit_s: float = 10.0):
    """(threads, open fds) once they have not changed for `settle_s`: finished threads take a moment to go,
    longer on a loaded machine."""
    import threading

    def now():
        return threading.active_count(), len(os.listdir("/proc/self/fd"))

    last, since, start = now(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < settle_s and time.monotonic() - start < limit_s:
        time.sleep(0.05)
        current = now()
        if current != last:
            last, since = current, time.monotonic()
    return last


def test_side_groups_are_destroyed_when_training_ends():
    got = run_ranks_until(_open_close_cycles, 2, 4, ranks=[0, 1], timeout=120)
    for rank in (0, 1):
        ok, counts, _ = got[rank]
        assert ok, counts
        # (threads, fds) after cycles 2..4: no growth (+3 groups per cycle before)
        assert counts[-1][0] <= counts[1][0] and counts[-1][1] <= counts[1][1], counts


# ------------------------------------------------------------------ bad features name their culprit

def test_bad_features_name_the_sample_and_say_what_is_wrong():
    import pytest

    from hf_dp_balance.runtime.step_rows import describe_samples

    for tokens, vision, why in ((float("inf"), 0, "tokens=inf is not finite"), (float("nan"), 0, "tokens=nan is not finite"),
                                (torch.tensor(float("inf")), 0, "is not finite"), (-3, 0, "tokens=-3 must be a whole"),
                                (2.5, 0, "must be a whole"), (4, -1, "vision item count=-1 must be a whole"),
                                (4, [[1, -2, 2]], "bad vision features")):
        with pytest.raises(ValueError, match=rf"^step 2, rank 1, micro-batch 0, sample 1: .*{why}"):
            describe_samples(2, [[{"a": 1}, {"a": 2}]], 1, lambda s, t=tokens, v=vision: (t, v) if s["a"] == 2 else (1, 0),
                             None)


# ------------------------------------------------------------------ a peer stops under a stock Trainer

def _trainer_peer_stops(rank, world, outdir, signum):
    """Stock Trainer + DPBalanceCallback on gloo (DDP, ddp_timeout at its default 1800 s); rank 2 stops in the
    forward of step 4, balancing on from the start."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.models import make_model

    err = os.open(os.path.join(outdir, f"stderr_{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)
    transformers.logging.set_verbosity_error()
    model = make_model("text", seed=0)
    samples = [{"input_ids": torch.arange(2, 8 + (17 * i) % 90), "labels": torch.arange(2, 8 + (17 * i) % 90)}
               for i in range(240)]
    args = TrainingArguments(output_dir=outdir, use_cpu=True, per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, max_steps=20, optim="sgd", learning_rate=0.1,
                             report_to=[], logging_steps=1, save_strategy="no", remove_unused_columns=False,
                             disable_tqdm=True, seed=0, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=samples, data_collator=PackedCollator(model.config),
                      callbacks=[DPBalanceCallback(DPBalanceConfig(min_gain=0.0, timeout_s=TIMEOUT_S),
                                                   cost_model=CostModel(quadratic=1.0, linear=20.0))])

    def hook(module, args, kwargs):
        if rank == 2 and trainer.state.global_step == 4:
            with open(os.path.join(outdir, "fault_time"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signum)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    return "finished"


def test_a_stopped_rank_under_a_stock_trainer_ends_the_others_with_our_error(tmp_path):
    start = time.time()
    got = run_ranks_until(_trainer_peer_stops, 3, str(tmp_path), signal.SIGSTOP, ranks=[0, 1], timeout=150)
    fault = float((tmp_path / "fault_time").read_text())
    for rank in (0, 1):
        ok, value, seconds = got[rank]
        assert not ok and "exited with code 1" in value, value
        assert start + seconds - fault < TIMEOUT_S + 10.0  # torch's own error would come after ddp_timeout (1800 s)
        msg = (tmp_path / f"stderr_{rank}").read_text()
        assert f"rank {rank}, phase liveness check" in msg and "hf_dp_balance: step " in msg, msg
