"""How DPBalanceCallback sits in Trainer's callback list: its log keys reach every callback that reads logs,
whatever the list's order (no reliance on DefaultFlowCallback running first)."""

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.integrations.callback import DPBalanceCallback, place_before_log_readers


class _LogReader(TrainerCallback):
    """A reporter as TensorBoard / W&B are: it reads `logs` in its own on_log."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.seen.append(sorted(k for k in logs if k.startswith("dp_balance/")))


def test_place_before_log_readers_moves_only_past_callbacks_that_do_not_read_logs():
    ours, flow, printer, reader = DPBalanceCallback(), DefaultFlowCallback(), PrinterCallback(), _LogReader()
    callbacks = [flow, printer, reader, ours]
    place_before_log_readers(callbacks, ours)
    assert callbacks == [flow, ours, printer, reader]
    callbacks = [ours, flow]  # already before every reader; nothing reads logs after: it goes last
    place_before_log_readers(callbacks, ours)
    assert callbacks == [flow, ours]
    untouched = [flow, printer]
    place_before_log_readers(untouched, ours)  # not in the list: nothing moves
    assert untouched == [flow, printer]


def test_a_reporter_listed_first_sees_the_keys_even_with_the_callback_before_the_flow_callback(tmp_path):
    from transformers import Trainer, TrainingArguments

    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.testing.models import make_model

    model = make_model("text", seed=0)
    samples = [{"input_ids": torch.arange(2, 2 + n) % 500, "labels": torch.arange(2, 2 + n) % 500}
               for n in (12, 30, 7, 50, 9, 21, 16, 40)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_train_batch_size=2, max_steps=3,
                             logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True,
                             remove_unused_columns=False)
    reader, ours = _LogReader(), DPBalanceCallback(DPBalanceConfig(warmup_steps=100))
    trainer = Trainer(model=model, args=args, train_dataset=samples, data_collator=PackedCollator(model.config),
                      callbacks=[reader, ours])
    callbacks = trainer.callback_handler.callbacks
    assert callbacks.index(ours) < callbacks.index(reader)  # placed before the first log reader at init
    callbacks.remove(ours)
    callbacks.insert(0, ours)  # even before DefaultFlowCallback, which sets control.should_log
    trainer.train()
    assert len(reader.seen) == 3
    for keys in reader.seen:
        assert {"dp_balance/compute_imbalance", "dp_balance/fitted", "dp_balance/slowest_rank_compute_s"} <= set(keys)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all("dp_balance/fitted" in h for h in logged)
