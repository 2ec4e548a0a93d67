#!/usr/bin/env python
"""Supervised fine-tuning of a vision-language model on the stock `Trainer`, with hf_dp_balance.

One script for every supported family; the family comes from the model's config:
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL (HF-format checkpoints, e.g.
`Qwen/Qwen2-VL-2B-Instruct`, `Qwen/Qwen2.5-VL-7B-Instruct`, `Qwen/Qwen3-VL-8B-Instruct`,
`OpenGVLab/InternVL3-1B-hf`), or `tiny:<family>` for a random-weight tiny model
(CPU runs, smoke tests) that trains on the library's synthetic long-tail data.

What balancing adds to a plain Trainer run is two lines: the `dp_balance_*`
options (`DPBalanceTrainingArguments`) and `callbacks=[DPBalanceCallback()]`.
Every rank then packs its samples into one row (`PackedCollator`, per-sample
positions), the ranks exchange samples each step so that their compute
(attention ~ sum L^2, not tokens) is equal, and the vision tower is balanced
on its own with `--dp_balance_vision`.

Data (`--data`): a JSONL file, one conversation per line::

    {"messages": [{"role": "user", "content": [{"type": "image", "path": "a.jpg"},
                                               {"type": "text", "text": "What is this?"}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]}]}

Only the assistant's last turn is trained (everything before it is label -100).
`--data synthetic` uses `hf_dp_balance.testing.data.build_synthetic_dataset` (tiny models only).

Start it (see recipes/README.md for every launcher):

    # one machine, 8 GPUs, DDP
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/sft_vlm.py \
        --model Qwen/Qwen2-VL-2B-Instruct --data train.jsonl --output_dir out \
        --per_device_train_batch_size 8 --bf16 --dp_balance --dp_balance_vision
    # 4 CPU ranks (gloo), tiny model, synthetic data
    torchrun --nproc_per_node 4 recipes/sft_vlm.py --model tiny:qwen2_vl --data synthetic \
        --output_dir /tmp/out --use_cpu --max_steps 20 --per_device_train_batch_size 8 --dp_balance
    # resume: the same command plus --resume_from_checkpoint /tmp/out/checkpoint-10 (weights are loaded
    # with from_pretrained, see load_model; Trainer restores the rest and the callback its cost model)
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import HfArgumentParser, Trainer

from hf_dp_balance import DPBalanceCallback, PackedCollator, register_varlen_attention
from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.integrations.arguments import DPBalanceTrainingArguments


@dataclass
class ScriptArguments:
    model: str = field(metadata={"help": "HF model id / local path, or tiny:<family> (qwen2_vl, qwen2_5_vl, "
                                         "qwen3_vl, internvl) for a random-weight tiny model"})
    data: str = field(default="synthetic", metadata={"help": "JSONL of conversations, or 'synthetic'"})
    max_samples: Optional[int] = field(default=None, metadata={"help": "use only the first N samples"})
    synthetic_samples: int = field(default=2048, metadata={"help": "samples of --data synthetic"})
    max_length: int = field(default=32768, metadata={"help": "drop samples longer than this (tokens)"})
    dummy_vision: bool = field(
        default=True, metadata={"help": "give a packed row without images a dummy image whose loss is exactly 0, so "
                                        "the vision tower runs on every rank (DDP without find_unused_parameters, "
                                        "FSDP2, ZeRO-3); --no_dummy_vision turns it off (docs/packing.md)"})
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "default: flash_attention_2 when installed on GPU, else the library's "
                                        "varlen attention (per-sample SDPA; cost sum L^2 like flash varlen)"})


def _attention(requested: Optional[str]) -> str:
    if requested:
        return requested
    if torch.cuda.is_available():
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            pass
    return register_varlen_attention()


def free_process_groups() -> None:
    """Destroy the process groups on the main thread, after the caller dropped its trainer: during interpreter
    exit a gloo worker thread releasing a finished collective's tensors cannot take the GIL and aborts the
    process ("terminate called without an active exception"); DDP and the callback hold the groups in
    reference cycles that only gc frees."""
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def load_model(name: str, attn: str, dtype, weights: Optional[str] = None):
    """The model (and processor, None for tiny models) for a hub id / path or `tiny:<family>`.

    `weights`: a Trainer checkpoint to take the weights from (resume). Built with `from_pretrained`
    on purpose: transformers 5.24 writes Qwen2-VL / Qwen2.5-VL / InternVL checkpoints under the hub's
    legacy key names and `Trainer(resume_from_checkpoint=...)` does not map them back (it only warns and
    keeps the fresh weights; huggingface/transformers#43701); `from_pretrained` does map them.
    """
    if name.startswith("tiny:"):
        from hf_dp_balance.testing.models import make_model

        model = make_model(name.split(":", 1)[1], seed=0, attn_implementation=attn)
        if weights:
            model = type(model).from_pretrained(weights, attn_implementation=attn)
            model.train()
        return model, None
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(weights or name, attn_implementation=attn, dtype=dtype)
    return model, AutoProcessor.from_pretrained(name)


def encode_conversation(processor, messages: list, index: int) -> dict:
    """One conversation -> per-sample dict (1-D tensors) with only the last assistant turn as labels."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError(f"sample {index}: key 'messages': the last message must be the assistant's answer")
    kwargs = dict(tokenize=True, return_dict=True, return_tensors="pt")
    full = processor.apply_chat_template(messages, **kwargs)
    prompt = processor.apply_chat_template(messages[:-1], add_generation_prompt=True, **kwargs)
    sample = {k: (v[0] if k in ("input_ids", "mm_token_type_ids", "attention_mask") else v)
              for k, v in full.items() if isinstance(v, torch.Tensor)}
    sample.pop("attention_mask", None)  # packing needs none: boundaries come from the positions
    labels = sample["input_ids"].clone()
    labels[: prompt["input_ids"].shape[1]] = IGNORE_INDEX
    sample["labels"] = labels
    return sample


class ConversationDataset(torch.utils.data.Dataset):
    """JSONL conversations, encoded lazily on access (images are read by the processor)."""

    def __init__(self, path: str, processor, max_samples: Optional[int]):
        with open(path, "r", encoding="utf-8") as f:
            self.rows = [json.loads(line) for line in f if line.strip()]
        if max_samples:
            self.rows = self.rows[:max_samples]
        self.processor = processor

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return encode_conversation(self.processor, self.rows[i]["messages"], i)


def synthetic_dataset(model, n: int, max_samples: Optional[int]):
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample

    ds = build_synthetic_dataset(model.config.model_type, max_samples or n, seed=0, mix="long_tail")

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            return to_sample(ds[i])

    return Rows()


def main(argv=None) -> None:
    parser = HfArgumentParser((ScriptArguments, DPBalanceTrainingArguments))
    script, args = parser.parse_args_into_dataclasses(argv)
    args.remove_unused_columns = False  # samples carry pixel / grid keys the collator needs
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    resume = args.resume_from_checkpoint  # --resume_from_checkpoint out/checkpoint-500
    model, processor = load_model(script.model, _attention(script.attn_implementation), dtype, weights=resume)
    if script.data == "synthetic":
        train = synthetic_dataset(model, script.synthetic_samples, script.max_samples)
    else:
        if processor is None:
            raise ValueError("--data <jsonl> needs a real model with a processor; tiny:<family> takes --data synthetic")
        train = ConversationDataset(script.data, processor, script.max_samples)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        # used as is without --dp_balance (with it the balanced loader packs, with the dummy on)
        data_collator=PackedCollator(model.config, max_tokens=script.max_length, dummy_vision=script.dummy_vision),
        callbacks=[DPBalanceCallback()],  # reads --dp_balance*; HF_DP_BALANCE_* env variables override
    )
    trainer.train(resume_from_checkpoint=resume)  # optimizer, scheduler, RNG, data position, cost model
    if args.should_save:
        trainer.save_model(os.path.join(args.output_dir, "final"))
    del trainer  # its process groups go now (`free_process_groups`), not during interpreter exit
    free_process_groups()


if __name__ == "__main__":
    main()
