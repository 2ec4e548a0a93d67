"""A peer killed while the others are inside a training collective (no vision balancing).

Real gloo processes; rank 2 is SIGKILLed in the forward of a step after balancing switched on. Every
survivor must end within timeout_s + 10 s with the library's error naming the step, the rank and the
phase (before: gloo's raw "Connection reset by peer", no step, rank or phase), chained from gloo's.
"""

import os
import signal
import time

import torch

from hf_dp_balance.testing.spawn import run_ranks_until

TIMEOUT_S = 4.0
VICTIM = 2


def _note_fault(outdir):
    with open(os.path.join(outdir, "fault_time"), "w") as f:
        f.write(repr(time.time()))


def _text_samples(n):
    return [{"input_ids": torch.arange(2, 8 + (17 * i) % 90), "labels": torch.arange(2, 8 + (17 * i) % 90)}
            for i in range(n)]


def _trainer_rank(rank, world, outdir):
    """Stock Trainer + DPBalanceCallback (DDP on gloo, ddp_timeout 1800 s); rank 2 dies in the forward of step 5."""
    import transformers
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.testing.models import make_model

    transformers.logging.set_verbosity_error()
    model = make_model("text", seed=0)
    args = TrainingArguments(output_dir=outdir, use_cpu=True, per_device_train_batch_size=3,
                             gradient_accumulation_steps=2, max_steps=20, optim="sgd", learning_rate=0.1,
                             report_to=[], logging_steps=1, save_strategy="no", remove_unused_columns=False,
                             disable_tqdm=True, seed=0, dataloader_drop_last=True)
    trainer = Trainer(model=model, args=args, train_dataset=_text_samples(240),
                      data_collator=PackedCollator(model.config),
                      callbacks=[DPBalanceCallback(DPBalanceConfig(min_gain=0.0, timeout_s=TIMEOUT_S),
                                                   cost_model=CostModel(quadratic=1.0, linear=20.0))])

    def hook(module, args, kwargs):
        if rank == VICTIM and trainer.state.global_step == 4:  # training the user's step 5
            _note_fault(outdir)
            os.kill(os.getpid(), signal.SIGKILL)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        trainer.train()
    except Exception as exc:  # the caller checks the chain: gloo's error is kept as the cause
        raise RuntimeError(f"train() raised {type(exc).__name__}: {exc} || cause: {exc.__cause__!r}") from exc
    return "finished"


def _accelerate_rank(rank, world, outdir):
    """The documented DPBalancer loop (DDP on gloo); rank 2 dies in the forward of its 5th optimizer step (step 5, counted from 1 as Trainer)."""
    from accelerate import Accelerator

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.integrations.accelerate import DPBalancer
    from hf_dp_balance.testing.models import make_model

    acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = make_model("text", seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    cfg = DPBalanceConfig(min_gain=0.0, timeout_s=TIMEOUT_S)
    steps = 0
    try:
        with DPBalancer(acc, model=model, config=cfg, cost_model=CostModel(quadratic=1.0, linear=20.0)) as balancer:
            for batch in balancer.prepare(torch.utils.data.DataLoader(_text_samples(240), batch_size=3)):
                if rank == VICTIM and steps == 4:
                    _note_fault(outdir)
                    os.kill(os.getpid(), signal.SIGKILL)
                with acc.accumulate(model):
                    acc.backward(model(**batch).loss)
                    optimizer.step()
                    optimizer.zero_grad()
                steps += acc.sync_gradients
    except Exception as exc:
        raise RuntimeError(f"the loop raised {type(exc).__name__}: {exc} || cause: {exc.__cause__!r}") from exc
    return "finished"


def _survivors_name_step_rank_phase(tmp_path, fn, step):
    start = time.time()
    survivors = [r for r in range(3) if r != VICTIM]
    got = run_ranks_until(fn, 3, str(tmp_path), ranks=survivors, timeout=150, pg_timeout_s=300)
    fault = float((tmp_path / "fault_time").read_text())
    for rank in survivors:
        assert rank in got, f"rank {rank} did not end within the run limit"
        ok, value, seconds = got[rank]
        assert not ok, value
        assert start + seconds - fault < TIMEOUT_S + 10.0, start + seconds - fault
        assert (f"ExchangeError: hf_dp_balance: step {step}, rank {rank}, phase training step "
                f"(DDP gradient all-reduce / forward-backward collective): a peer died or failed") in value, value
        assert "|| cause: " in value and "|| cause: None" not in value, value  # chained from gloo's own error


def test_a_killed_peer_ends_every_trainer_survivor_with_step_rank_and_phase(tmp_path):
    _survivors_name_step_rank_phase(tmp_path, _trainer_rank, 5)


def test_a_killed_peer_ends_every_accelerate_survivor_with_step_rank_and_phase(tmp_path):
    _survivors_name_step_rank_phase(tmp_path, _accelerate_rank, 5)
