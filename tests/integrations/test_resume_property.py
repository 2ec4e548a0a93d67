"""Exactly once across a resume, under both front ends: a property test over the settings that order samples.

Every drawn case trains 2 epochs on P real gloo ranks, stops after a random optimizer step, saves the
session's state through the front end's own checkpointing (`accelerator.save_state` for `DPBalancer`, a
Trainer checkpoint for the callback), resumes in fresh objects and trains to the end: every sample is trained
exactly once per epoch. A resume with another P, GA or look-ahead is refused naming the setting.

One group of P ranks serves many cases (`_serve`, fed through queues), so a case costs its training, not a
spawn. CI runs 51 DPBalancer cases and 12 Trainer cases (a third at each P) on fixed draws (tests/conftest.py's profile); a slow lane
runs more: `HF_DP_BALANCE_RESUME_EXAMPLES=400 HF_DP_BALANCE_RESUME_TRAINER_EXAMPLES=100 pytest
tests/integrations/test_resume_property.py`.
"""

import os
import queue
import shutil
import tempfile
import threading
import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_dp_balance.testing import spawn

EPOCHS = 2
BATCH = 2          # samples per raw batch
STEPS = 4          # optimizer steps per epoch
_WORKERS = __import__("multiprocessing").get_context("forkserver")  # see _serve
# cases per front end: a DPBalancer case costs about a second, a Trainer case (a tiny model, a checkpoint, three
# train() calls) several
WORLDS = (2, 3, 4)  # P: data-parallel ranks
EXAMPLES = int(os.environ.get("HF_DP_BALANCE_RESUME_EXAMPLES", "50"))
TRAINER_EXAMPLES = int(os.environ.get("HF_DP_BALANCE_RESUME_TRAINER_EXAMPLES", "12"))


class EpochShuffle(torch.utils.data.Sampler):
    """A permutation of the indices drawn from the epoch (the same in the resumed run)."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


class Samples(torch.utils.data.Dataset):
    """Tiny samples of long-tail lengths, each carrying its index."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(n)
        self.lengths = (torch.rand(n, generator=g) ** 4 * 300 + 4).long().tolist()

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": torch.full((self.lengths[i],), 7, dtype=torch.long), "sample_id": i}


def _collate(samples):
    return {"sample_ids": torch.tensor([s["sample_id"] for s in samples], dtype=torch.long)}


def _features(sample):
    return int(sample["input_ids"].numel()), 0


def _config(case, **changes):
    from hf_dp_balance.config import DPBalanceConfig

    kw = dict(min_gain=0.0, timeout_s=60, max_token_ratio=3.0, warmup_steps=100, lookahead_steps=case["lookahead"],
              prefetch_steps=case["prefetch"], metrics_every=0)
    kw.update(changes)
    return DPBalanceConfig(**kw)


def _accelerator(case, ga=None):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    return Accelerator(gradient_accumulation_steps=ga or case["ga"], cpu=True,
                       dataloader_config=DataLoaderConfiguration(dispatch_batches=case["dispatch"]))


def _balancer(acc, case, **changes):
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer

    # attention-heavy: long samples are outliers the planner (and the look-ahead) moves
    return DPBalancer(acc, config=_config(case, **changes), cost_model=CostModel(quadratic=1.0, linear=1.0),
                      collator=_collate, features_fn=_features)


def _loader(balancer, case, world):
    n = world * case["ga"] * BATCH * case.get("steps", STEPS)
    workers = dict(num_workers=case["workers"], multiprocessing_context=_WORKERS) if case["workers"] else {}
    plain = torch.utils.data.DataLoader(Samples(n), batch_size=BATCH, sampler=EpochShuffle(n), **workers)
    return balancer.prepare(plain)


def _train(loader, ga, trained, stop=None, steps=STEPS):
    """Train to the end of epoch EPOCHS - 1, or stop after optimizer step `stop` (counted over epochs from 1,
    `steps` an epoch): then True. `trained`: (epoch, sample ids) of every micro-batch this rank trained."""
    step = loader.epoch * steps + loader.position()["steps"]
    for epoch in range(loader.epoch, EPOCHS):
        loader.set_epoch(epoch)
        batches = iter(loader)
        try:
            for i, batch in enumerate(batches):
                trained.append((epoch, batch["sample_ids"].tolist()))
                if (i + 1) % ga == 0:
                    step += 1
                    if step == stop:
                        return True
        finally:
            batches.close()
    return False


def _accelerate_case(rank, world, case, folder):
    trained = []
    acc = _accelerator(case)
    with _balancer(acc, case) as balancer:
        loader = _loader(balancer, case, world)
        assert _train(loader, case["ga"], trained, stop=case["stop"], steps=case.get("steps", STEPS))
        state = loader.state_dict()
        acc.save_state(folder)
    acc.wait_for_everyone()
    refusals = {}
    if case["refuse"]:
        tries = {"gradient_accumulation_steps": dict(ga=case["ga"] % 3 + 1)}
        if not case["dispatch"]:
            tries["lookahead_steps"] = dict(lookahead=(case["lookahead"] + 2) % 4)
        for name, change in tries.items():
            other = _accelerator(case, ga=change.get("ga"))
            with _balancer(other, case, lookahead_steps=change.get("lookahead", case["lookahead"])) as balancer:
                _loader(balancer, {**case, **change}, world)
                try:
                    other.load_state(folder)
                except ValueError as exc:
                    refusals[name] = str(exc)
        wrong = {**state, "data_parallel_size": world + 1}
        with _balancer(_accelerator(case), case) as balancer:
            loader = _loader(balancer, case, world)
            try:
                loader.load_state_dict(wrong)
            except ValueError as exc:
                refusals["data_parallel_size"] = str(exc)
    acc = _accelerator(case)
    with _balancer(acc, case) as balancer:
        loader = _loader(balancer, case, world)
        acc.load_state(folder)
        resumed_at = loader.position()
        _train(loader, case["ga"], trained)
    return {"trained": trained, "state": state, "resumed_at": resumed_at, "refusals": refusals}


def _trainer_run(case, folder, trained, stop=None, resume=None, **changes):
    """A Trainer of the tiny text model, 2 epochs of STEPS steps; stops (and saves) after step `stop`."""
    from transformers import TrainerCallback

    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from transformers import Trainer

    from hf_dp_balance.integrations.arguments import DPBalanceTrainingArguments
    from hf_dp_balance.testing.models import make_model
    from hf_dp_balance.testing.runs import TextSamples, pack_text, sample_index

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop:
                control.should_training_stop = True

    import torch.distributed as dist

    world = dist.get_world_size()
    fields = dict(gradient_accumulation_steps=case["ga"], dataloader_num_workers=case["workers"],
                  dp_balance_lookahead_steps=case["lookahead"], dp_balance_prefetch_steps=case["prefetch"],
                  dp_balance_min_gain=0.0, dp_balance_max_token_ratio=3.0, dp_balance_timeout_s=60,
                  dp_balance_refit_every=0)
    fields.update(changes)
    ga = fields["gradient_accumulation_steps"]
    callback = DPBalanceCallback(cost_model=CostModel(quadratic=1e-6, linear=1e-5, per_sample=0.0, constant=0.0))
    args = DPBalanceTrainingArguments(
        output_dir=folder, use_cpu=True, per_device_train_batch_size=BATCH, max_steps=EPOCHS * STEPS,
        logging_steps=1000, save_strategy="steps", save_steps=stop or 1000, report_to=[], disable_tqdm=True, seed=0,
        data_seed=0, learning_rate=1e-3, dp_balance=True, **fields)
    model = make_model("text", seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=TextSamples(world * ga * BATCH * STEPS),
                      data_collator=pack_text, callbacks=[callback] + ([StopAt()] if stop is not None else []))

    def record(module, args, kwargs):  # (epoch, the packed samples' indices) of every forward
        ids, pos = kwargs["input_ids"].reshape(-1).tolist(), kwargs["position_ids"].reshape(-1).tolist()
        starts = [i for i, p in enumerate(pos) if p == 0 and ids[i] == 2 and i + 3 <= len(ids)]  # not padding
        trained.append((trainer.state.global_step // STEPS, [sample_index(ids[i:i + 3]) for i in starts]))

    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.train(resume_from_checkpoint=resume)


def _trainer_case(rank, world, case, folder):
    import json

    import torch.distributed as dist

    from hf_dp_balance.runtime.session import STATE_FILE

    trained = []
    _trainer_run(case, folder, trained, stop=case["stop"])
    checkpoint = os.path.join(folder, f"checkpoint-{case['stop']}")
    with open(os.path.join(checkpoint, STATE_FILE)) as f:
        state = json.load(f)
    dist.barrier()
    refusals = {}
    if case["refuse"]:
        tries = {"gradient_accumulation_steps": dict(gradient_accumulation_steps=case["ga"] % 3 + 1),
                 "lookahead_steps": dict(dp_balance_lookahead_steps=(case["lookahead"] + 2) % 4),
                 "data_parallel_size": {}}
        # a Trainer costs seconds: one refusal per case, the drawn one
        for name, change in [(case["refuse"], tries[case["refuse"]])]:
            if name == "data_parallel_size" and rank == 0:  # the state of a run with another P
                with open(os.path.join(checkpoint, STATE_FILE), "w") as f:
                    json.dump({**state, "data_parallel_size": world + 1}, f)
            dist.barrier()
            try:
                _trainer_run(case, folder, [], resume=checkpoint, **change)
            except ValueError as exc:
                refusals[name] = str(exc)
            dist.barrier()
        if rank == 0:
            with open(os.path.join(checkpoint, STATE_FILE), "w") as f:
                json.dump(state, f)
        dist.barrier()
    _trainer_run(case, folder, trained, resume=checkpoint)
    return {"trained": trained, "state": state, "refusals": refusals}


CASES = {"accelerate": _accelerate_case, "trainer": _trainer_case}


def _serve(rank, world, jobs, results):
    """Run the cases sent to this rank until None comes (one process group for many cases)."""
    import multiprocessing

    torch.set_num_threads(1)
    # the spawner's ranks are daemons (they die with the test); DataLoader workers need a parent that may fork
    multiprocessing.current_process()._config["daemon"] = False
    # DataLoader workers fork from one server per rank that imported torch and this module once: a worker
    # forked from the rank itself (gloo and exchange threads running) can crash, a spawned one costs seconds
    _WORKERS.set_forkserver_preload(["torch", Samples.__module__])
    multiprocessing.set_start_method("forkserver", force=True)  # Trainer's DataLoader workers too
    while True:
        job = jobs[rank].get(timeout=900)
        if job is None:
            return "stopped"
        try:
            results.put((rank, "ok", CASES[job["front"]](rank, world, job, job["folder"])))
        except BaseException:  # noqa: BLE001 - reported to the test
            results.put((rank, "error", traceback.format_exc()))
            return "failed"


class RankServer:
    """P ranks (one gloo group) that run cases from queues; the test process feeds them."""

    def __init__(self, world: int):
        ctx = spawn._context(None)
        self.world = world
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.outcome = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.broken = False

    def _run(self):
        try:
            self.outcome["ranks"] = spawn.run_ranks(_serve, self.world, self.jobs, self.results, timeout=1800,
                                                    pg_timeout_s=60)
        except Exception as exc:  # noqa: BLE001 - seen by `run_case`
            self.outcome["error"] = exc

    def run_case(self, case: dict, timeout: float = 240.0) -> list:
        for q in self.jobs:
            q.put(case)
        outs, waited = {}, 0.0
        while len(outs) < self.world:
            try:
                rank, kind, value = self.results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                if waited > timeout or not self.thread.is_alive():
                    self.broken = True
                    raise AssertionError(f"case {case} did not finish within {waited:.0f}s ({self.outcome})") from None
                continue
            if kind == "error":
                self.broken = True
                raise AssertionError(f"rank {rank} failed case {case}:\n{value}")
            outs[rank] = value
        return [outs[r] for r in range(self.world)]

    def stop(self):
        for q in self.jobs:
            q.put(None)
        self.thread.join(timeout=60)


@pytest.fixture(scope="module")
def servers():
    """One rank server at a time (P ranks; at most 4 processes plus their DataLoader workers)."""
    held = {}

    def get(world):
        current = held.get("server")
        if current is not None and (current.world != world or current.broken):
            current.stop()
            current = None
        if current is None:
            current = held["server"] = RankServer(world)
        return current

    yield get
    if held.get("server") is not None:
        held["server"].stop()


@st.composite
def cases(draw, front, world):
    dispatch = draw(st.booleans()) if front == "accelerate" else False
    return {"world": world, "front": front, "ga": draw(st.sampled_from([1, 3])),
            "lookahead": draw(st.sampled_from([0, 2, 3])), "prefetch": draw(st.sampled_from([1, 2, 6])),
            "dispatch": dispatch, "workers": draw(st.sampled_from([0, 2])),
            "stop": draw(st.integers(1, EPOCHS * STEPS - 1)),
            "refuse": draw(st.sampled_from([None, "gradient_accumulation_steps", "lookahead_steps",
                                            "data_parallel_size"]))}


# One test per P: its cases run on one group of P ranks (a group starts once, not at every change of P).
@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
@settings(max_examples=-(-EXAMPLES // len(WORLDS)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_dpbalancer_trains_every_sample_exactly_once_per_epoch_across_a_resume(servers, world, data):
    _check_case(servers, data.draw(cases("accelerate", world), label="case"))


@pytest.mark.dist
@pytest.mark.parametrize("world", WORLDS)
@settings(max_examples=-(-TRAINER_EXAMPLES // len(WORLDS)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_trainer_trains_every_sample_exactly_once_per_epoch_across_a_resume(servers, world, data):
    _check_case(servers, data.draw(cases("trainer", world), label="case"))


def _check_case(servers, case):
    _run_and_check(lambda job: servers(job["world"]).run_case(job), case)


def test_a_state_taken_windows_behind_the_thread_resumes_every_sample_once():
    # the thread runs prefetch_steps steps plus a window ahead of the loop (here 3 windows of 2 steps): the plan
    # of the window the loop is in must still be there when the state is taken after step 5
    case = {"world": 2, "front": "accelerate", "ga": 2, "lookahead": 2, "prefetch": 6, "dispatch": False,
            "workers": 0, "stop": 5, "refuse": None, "steps": 16}
    _run_and_check(lambda job: spawn.run_ranks(_accelerate_case, 2, job, job["folder"], timeout=240,
                                               pg_timeout_s=60), case)


def _run_and_check(run, case):
    folder = tempfile.mkdtemp(prefix="resume_case_")
    try:
        outs = run({**case, "folder": folder})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    steps = case.get("steps", STEPS)  # optimizer steps an epoch
    world, n = case["world"], case["world"] * case["ga"] * BATCH * steps
    for epoch in range(EPOCHS):
        trained = sorted(i for o in outs for e, ids in o["trained"] if e == epoch for i in ids)
        assert trained == list(range(n)), (epoch, case)
    state = outs[0]["state"]
    assert all(o["state"] == state for o in outs)  # one state on every rank
    (saved,) = state["loaders"]
    if case["front"] == "accelerate":
        assert saved["position"]["epoch"] == (case["stop"] - 1) // steps  # dispatch mode counted it too
    assert saved["settings"]["data_parallel_size"] == world and saved["settings"]["dispatch"] == case["dispatch"]
    assert state["models"] is not None  # the cost models travel with the state
    k, in_pass = max(1, case["lookahead"]), (case["stop"] - 1) % steps + 1
    inside = not case["dispatch"] and k > 1 and in_pass % k != 0 and in_pass < steps // k * k  # full windows only
    assert (saved["position"]["window"] is not None) == inside, saved["position"]
    if case["refuse"]:
        names = {"gradient_accumulation_steps", "data_parallel_size"} | (
            set() if case["dispatch"] else {"lookahead_steps"})  # dispatch mode has no look-ahead
        if case["front"] == "trainer":
            names = {case["refuse"]}
        for o in outs:
            assert set(o["refusals"]) == names, o["refusals"]
            for name, text in o["refusals"].items():
                assert name in text
