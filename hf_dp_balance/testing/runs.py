"""Small Trainer and DPBalancer runs for the front-end tests: unique text samples, a packing collator, and a
record of what every forward computed (step, the packed samples' ids, a digest of the micro-batch)."""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional

import numpy as np
import torch


class TextSamples(torch.utils.data.Dataset):
    """Unique text samples with long-tail lengths: tokens 1-2 encode the index (`sample_id` too)."""

    def __init__(self, n: int, seed: int = 0, with_ids: bool = False):
        rng = np.random.default_rng(seed)
        lengths = np.clip(rng.lognormal(np.log(48), 1.0, size=n), 8, 400).astype(int)
        self.items = []
        for i, length in enumerate(lengths):
            body = rng.integers(11, 512, size=int(length) - 3).tolist()
            ids = torch.tensor([2, 11 + i % 400, 11 + i // 400] + body)
            item = {"input_ids": ids, "labels": ids.clone()}
            if with_ids:
                item["sample_id"] = i
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def sample_index(first_tokens) -> int:
    """The dataset index a sample's tokens 1-2 encode."""
    return (int(first_tokens[1]) - 11) + 400 * (int(first_tokens[2]) - 11)


def pack_text(samples):
    """One packed row: positions restart per sample, each sample's first label masked."""
    ids, pos, labels = [], [], []
    for s in samples:
        x = s["input_ids"].tolist()
        ids += x
        pos += list(range(len(x)))
        labels += [-100] + x[1:]
    t = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    return {"input_ids": t(ids), "position_ids": t(pos), "labels": t(labels)}


def digest(batch: Dict[str, Any]) -> str:
    """A digest of a micro-batch's tensors (byte-identical batches, equal digests)."""
    h = hashlib.sha1()
    for key in sorted(batch):
        value = batch[key]
        if key == "num_items_in_batch":
            continue
        h.update(key.encode())
        h.update(value.detach().cpu().numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def record_forwards(model, step_of) -> List[tuple]:
    """A forward pre-hook on `model`: appends (step_of(), sample indices of the packed row, digest) per forward."""
    seen: List[tuple] = []

    def hook(module, args, kwargs):
        ids, pos = kwargs["input_ids"][0].tolist(), kwargs["position_ids"][0].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0]
        batch = {k: v for k, v in kwargs.items() if k in ("input_ids", "position_ids", "labels")}
        seen.append((step_of(), tuple(sample_index(ids[s:s + 3]) for s in starts), digest(batch)))

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def text_trainer(out_dir: str, *, max_steps: int, save_steps: int = 1000, n: int = 96, add: str = "callbacks",
                 callback: Any = None, batch_size: int = 4, **dp_fields):
    """A Trainer of the tiny text model over `TextSamples(n)`, with `callback` (a DPBalanceCallback) given in
    `callbacks=` (`add="callbacks"`) or added after init (`add="add_callback"`). Returns (trainer, seen)."""
    from transformers import Trainer

    from hf_dp_balance.integrations.arguments import DPBalanceTrainingArguments
    from hf_dp_balance.testing.models import make_model

    args = DPBalanceTrainingArguments(
        output_dir=out_dir, use_cpu=True, per_device_train_batch_size=batch_size, max_steps=max_steps,
        logging_steps=1, save_strategy="steps", save_steps=save_steps, report_to=[], disable_tqdm=True, seed=0,
        data_seed=0, dataloader_drop_last=True, learning_rate=1e-3, dp_balance=True, dp_balance_warmup_steps=3,
        **dp_fields)
    model = make_model("text", seed=0)
    ref: List[Optional[Any]] = [None]
    seen = record_forwards(model, lambda: ref[0].state.global_step + 1)
    trainer = Trainer(model=model, args=args, train_dataset=TextSamples(n), data_collator=pack_text,
                      callbacks=[callback] if add == "callbacks" else None)
    if add == "add_callback":
        trainer.add_callback(callback)
    ref[0] = trainer
    return trainer, seen


def process_counts() -> Dict[str, int]:
    """Threads, open file descriptors and live process groups of this process, once they have settled."""
    import os
    import threading
    import time

    from hf_dp_balance.testing.side import live_process_groups

    def now():
        return threading.active_count(), len(os.listdir("/proc/self/fd")), live_process_groups()

    last, since, start = now(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < 0.5 and time.monotonic() - start < 10.0:
        time.sleep(0.05)
        current = now()
        if current != last:
            last, since = current, time.monotonic()
    return {"threads": last[0], "fds": last[1], "groups": last[2]}


__all__ = ["TextSamples", "digest", "pack_text", "process_counts", "record_forwards", "sample_index", "text_trainer"]
