#!/usr/bin/env python
"""Supervised fine-tuning of a vision-language model with TRL's `SFTTrainer`, balanced by hf_dp_balance.

The same model, data and options as `recipes/sft_vlm.py` (stock Trainer), on `SFTTrainer`. What TRL needs
beside `callbacks=[DPBalanceCallback()]` and `data_collator=PackedCollator(...)` (docs/trl.md):
`hf_dp_balance.integrations.trl.sft_config` turns off TRL's column removal and dataset preparation (the
samples are already tokenized; the collator packs them), the dataset is a torch-formatted `datasets.Dataset`,
and `processing_class` is the model's processor (a tokenizer for tiny models). The callback refuses a run
whose settings would feed it other samples than the user's, with an error naming them.

    # 2 CPU ranks (gloo), tiny model, synthetic data
    torchrun --nproc_per_node 2 recipes/sft_trl.py --model tiny:qwen2_vl --output_dir /tmp/trl --use_cpu \
        --max_steps 8 --per_device_train_batch_size 4 --report_to none
    # one machine, 8 GPUs
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/sft_trl.py \
        --model Qwen/Qwen2-VL-2B-Instruct --data train.jsonl --output_dir out --bf16

Balancing options come from `HF_DP_BALANCE_*` environment variables (e.g. `HF_DP_BALANCE_VISION=1`).
"""

import dataclasses
import os
import sys
from typing import Optional

import torch
from transformers import HfArgumentParser

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling recipe's model and data helpers
from sft_vlm import _attention, encode_conversation, load_model  # noqa: E402

from hf_dp_balance import DPBalanceCallback, PackedCollator  # noqa: E402
from hf_dp_balance.integrations.trl import sft_config  # noqa: E402


@dataclasses.dataclass
class ScriptArguments:
    """sft_vlm's options without --max_length (SFTConfig's here; unused: TRL's preparation is off)."""

    model: str = dataclasses.field(metadata={"help": "HF model id / local path, or tiny:<family>"})
    data: str = dataclasses.field(default="synthetic", metadata={"help": "JSONL of conversations, or 'synthetic'"})
    max_samples: Optional[int] = dataclasses.field(default=None, metadata={"help": "use only the first N samples"})
    synthetic_samples: int = dataclasses.field(default=2048, metadata={"help": "samples of --data synthetic"})
    dummy_vision: bool = dataclasses.field(default=True, metadata={"help": "as in recipes/sft_vlm.py"})
    attn_implementation: Optional[str] = dataclasses.field(default=None, metadata={"help": "as in recipes/sft_vlm.py"})


def train_dataset(script, model, processor):
    """A torch-formatted `datasets.Dataset` of per-sample dicts (TRL refuses a plain torch Dataset)."""
    import datasets

    if script.data == "synthetic":
        from hf_dp_balance.testing.data import build_synthetic_dataset

        n = script.max_samples or script.synthetic_samples
        return build_synthetic_dataset(model.config.model_type, n, seed=0).with_format("torch")
    if processor is None:
        raise ValueError("--data <jsonl> needs a real model with a processor; tiny:<family> takes --data synthetic")
    import json

    def rows():
        with open(script.data, "r", encoding="utf-8") as f:
            for i, line in enumerate(x for x in f if x.strip()):
                if script.max_samples and i >= script.max_samples:
                    return
                sample = encode_conversation(processor, json.loads(line)["messages"], i)
                yield {k: v.tolist() for k, v in sample.items()}

    return datasets.Dataset.from_generator(rows).with_format("torch")


def main(argv=None) -> None:
    from trl import SFTConfig, SFTTrainer

    script, sft = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses(argv)
    chosen = {f.name: getattr(sft, f.name) for f in dataclasses.fields(SFTConfig) if f.init}
    for name in ("remove_unused_columns", "dataset_kwargs"):  # sft_config sets these two
        chosen.pop(name)
    args = sft_config(**chosen)
    dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else None)
    model, processor = load_model(script.model, _attention(script.attn_implementation), dtype)
    if processor is None:
        from hf_dp_balance.testing.data import build_tokenizer

        processor = build_tokenizer(model.config.model_type)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train_dataset(script, model, processor),
                         processing_class=processor,
                         data_collator=PackedCollator(model.config,
                                                      dummy_vision=script.dummy_vision),
                         callbacks=[DPBalanceCallback()])
    trainer.train()
    if args.should_save:
        trainer.save_model(os.path.join(args.output_dir, "final"))


if __name__ == "__main__":
    main()
