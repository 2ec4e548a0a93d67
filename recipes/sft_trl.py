#!/usr/bin/env python
"""Supervised fine-tuning with TRL's `SFTTrainer`, balanced by hf_dp_balance (docs/trl.md).

Text models: TRL's own pipeline, untouched. TRL tokenizes the raw text (or conversations) and packs it
(`packing=True`, BFD, `--trl_packing`, on by default here); its padding-free collator builds the rows, and
`callbacks=[DPBalanceCallback()]` splits them into their sequences, balances and packs them back in TRL's
layout. Vision-language models (`recipes/sft_vlm.py`'s model, data and options): TRL packs no images, so
the samples are tokenized here and `data_collator=PackedCollator(...)` packs them, with a torch-formatted
`datasets.Dataset`, `remove_unused_columns=False` (`hf_dp_balance.integrations.trl.sft_config`) and
`dataset_kwargs={"skip_prepare_dataset": True}` (TRL's truncation would cut input_ids, not images). The
callback refuses a run whose settings would break balancing, naming each with its reason.

    # 2 CPU ranks (gloo), tiny model, synthetic data
    torchrun --nproc_per_node 2 recipes/sft_trl.py --model tiny:text --output_dir /tmp/trl --use_cpu \
        --max_steps 8 --per_device_train_batch_size 4 --max_length 512 --report_to none
    torchrun --nproc_per_node 2 recipes/sft_trl.py --model tiny:qwen2_vl --output_dir /tmp/trl --use_cpu \
        --max_steps 8 --per_device_train_batch_size 4 --report_to none
    # one machine, 8 GPUs
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/sft_trl.py \
        --model Qwen/Qwen2.5-0.5B --data train.jsonl --output_dir out --bf16    # {"text": ...} or {"messages": ...}
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
from sft_vlm import _attention, encode_conversation, free_process_groups, load_model  # noqa: E402

from hf_dp_balance import DPBalanceCallback, PackedCollator  # noqa: E402
from hf_dp_balance.integrations.trl import sft_config  # noqa: E402


@dataclasses.dataclass
class ScriptArguments:
    """sft_vlm's options without --max_length (SFTConfig's here), and whether TRL packs text."""

    model: str = dataclasses.field(metadata={"help": "HF model id / local path, or tiny:<family>"})
    data: str = dataclasses.field(default="synthetic", metadata={"help": "JSONL of conversations, or 'synthetic'"})
    max_samples: Optional[int] = dataclasses.field(default=None, metadata={"help": "use only the first N samples"})
    synthetic_samples: int = dataclasses.field(default=2048, metadata={"help": "samples of --data synthetic"})
    dummy_vision: bool = dataclasses.field(default=True, metadata={"help": "as in recipes/sft_vlm.py"})
    attn_implementation: Optional[str] = dataclasses.field(default=None, metadata={"help": "as in recipes/sft_vlm.py"})
    trl_packing: bool = dataclasses.field(default=True, metadata={
        "help": "text models: TRL packs the dataset (SFTConfig packing=True); false: TRL's padding-free rows"})


def is_text_model(name: str) -> bool:
    if name.startswith("tiny:"):
        return name == "tiny:text"
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(name), "vision_config", None) is None


def text_model(name: str, attn: str, dtype):
    """A causal LM and its tokenizer (`tiny:text`: a tiny random model and tokenizer)."""
    if name == "tiny:text":
        from hf_dp_balance.testing.models import build_tokenizer, make_model

        return make_model("text", seed=0, attn_implementation=attn), build_tokenizer("text")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, attn_implementation=attn, dtype=dtype), AutoTokenizer.from_pretrained(name)


def text_dataset(script, tokenizer):
    """Raw text for TRL to tokenize and pack: `--data` JSONL rows with "text" or "messages", or synthetic text."""
    import datasets

    if script.data != "synthetic":
        data = datasets.load_dataset("json", data_files=script.data, split="train")
        return data.select(range(min(script.max_samples, len(data)))) if script.max_samples else data
    from hf_dp_balance.testing.data import build_synthetic_dataset

    n = script.max_samples or script.synthetic_samples
    rows = build_synthetic_dataset("text", n, seed=0)
    return datasets.Dataset.from_dict({"text": [tokenizer.decode([t for t in r["input_ids"] if t > 10]) for r in rows]})


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
    chosen.pop("remove_unused_columns")  # sft_config sets it
    dtype = torch.bfloat16 if sft.bf16 else (torch.float16 if sft.fp16 else None)
    attn = _attention(script.attn_implementation)
    if is_text_model(script.model):
        model, tokenizer = text_model(script.model, attn, dtype)
        chosen["packing"] = chosen["packing"] or script.trl_packing  # TRL's rows without padding (BFD packs)
        trainer = SFTTrainer(model=model, args=sft_config(**chosen), train_dataset=text_dataset(script, tokenizer),
                             processing_class=tokenizer, callbacks=[DPBalanceCallback()])
    else:
        model, processor = load_model(script.model, attn, dtype)
        if processor is None:
            from hf_dp_balance.testing.models import build_tokenizer

            processor = build_tokenizer(model.config.model_type)
        # the samples are tokenized here: TRL's preparation would truncate input_ids, not the images
        chosen["dataset_kwargs"] = {**(chosen.get("dataset_kwargs") or {}), "skip_prepare_dataset": True}
        trainer = SFTTrainer(model=model, args=sft_config(**chosen), train_dataset=train_dataset(script, model, processor),
                             processing_class=processor,
                             data_collator=PackedCollator(model.config, dummy_vision=script.dummy_vision),
                             callbacks=[DPBalanceCallback()])
    trainer.train()
    if trainer.args.should_save:
        trainer.save_model(os.path.join(trainer.args.output_dir, "final"))
    del trainer  # its process groups go now (`free_process_groups`), not during interpreter exit
    free_process_groups()


if __name__ == "__main__":
    main()
