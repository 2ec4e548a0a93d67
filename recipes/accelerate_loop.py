#!/usr/bin/env python
"""A complete custom Accelerate training loop for a Qwen-VL model, balanced with `DPBalancer`.

    # 2 CPU ranks (gloo), tiny random-weight Qwen2-VL, synthetic long-tail data
    torchrun --nproc_per_node 2 recipes/accelerate_loop.py --model tiny:qwen2_vl --output_dir /tmp/loop --cpu
    # GPUs: a real model by hub id or path (its processor is not needed: the data is synthetic or yours)
    accelerate launch --config_file recipes/accelerate/ddp.yaml recipes/accelerate_loop.py \
        --model Qwen/Qwen2-VL-2B-Instruct --data my_dataset_on_disk --output_dir out --bf16

The loop is the one in docs/accelerate.md: `balancer.prepare(dataloader)` gives packed, balanced
micro-batches on the device, each with `num_items_in_batch` (the step's target tokens over all
data-parallel ranks), so `model(**batch).loss` is the step's global token mean and balancing changes
no gradient. Planning uses `--cost_model` (a fitted JSON, e.g. from `hf-dp-balance fit`) or a FLOP prior
of the model's decoder. Rank 0 writes one JSON line per logged step to `<output_dir>/log.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub id / local path of a Qwen-VL model, or tiny:<family>")
    p.add_argument("--data", default="synthetic", help="'synthetic', or a datasets.save_to_disk folder of "
                                                       "per-sample columns (input_ids, labels, pixel keys)")
    p.add_argument("--synthetic_samples", type=int, default=64)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=6, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=4, help="samples per rank per micro-batch")
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--cost_model", default=None, help="fitted CostModel JSON (default: a FLOP prior)")
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_model(name: str, dtype):
    """The model for a hub id / path, or `tiny:<family>` (random weights, CPU runs)."""
    from hf_dp_balance import register_varlen_attention

    attn = "flash_attention_2" if torch.cuda.is_available() and _has_flash_attn() else register_varlen_attention()
    if name.startswith("tiny:"):
        from hf_dp_balance.testing.models import make_model

        return make_model(name.split(":", 1)[1], seed=0, attn_implementation=attn)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(name, attn_implementation=attn, dtype=dtype)
    model.config.text_config.use_cache = False  # else the packing mask is silently skipped
    return model


def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def load_samples(args, model):
    """A torch Dataset of per-sample dicts of tensors."""
    import datasets

    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample

    if args.data == "synthetic":
        rows = build_synthetic_dataset(model.config.model_type, args.synthetic_samples, seed=args.seed)
    else:
        rows = datasets.load_from_disk(args.data)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return to_sample(rows[i])

    return Samples()


def cost_model_for(args, model):
    from hf_dp_balance import CostModel

    if args.cost_model:
        return CostModel.load(args.cost_model)
    text = getattr(model.config, "text_config", model.config)
    params = sum(p.numel() for p in model.parameters())
    return CostModel.from_flops(params, text.hidden_size, text.num_hidden_layers, causal=True)


def main(argv=None) -> None:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, set_seed

    from hf_dp_balance import DPBalanceConfig, DPBalancer

    args = parse_args(argv)
    set_seed(args.seed)
    # A packed row without images leaves the vision tower without gradients: DDP must not wait for them.
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, cpu=args.cpu,
                              mixed_precision="bf16" if args.bf16 else "no",
                              kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    model = load_model(args.model, torch.bfloat16 if args.bf16 else None)
    train = load_samples(args, model)
    cost_model = cost_model_for(args, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    log_path = os.path.join(args.output_dir, "log.jsonl")
    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        open(log_path, "w").close()

    config = DPBalanceConfig(cost_model_path=None)  # HF_DP_BALANCE_* environment variables apply on top
    with DPBalancer(accelerator, model=model, config=config, cost_model=cost_model) as balancer:
        train_dl = balancer.prepare(torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True))
        step, losses, epoch, loss = 0, [], 0, float("nan")
        while step < args.max_steps:
            train_dl.set_epoch(epoch)
            for batch in train_dl:
                with accelerator.accumulate(model):
                    out = model(**batch)  # the loss is already divided by the step's global target tokens
                    accelerator.backward(out.loss)
                    losses.append(float(out.loss.detach()))
                    optimizer.step()
                    optimizer.zero_grad()
                if not accelerator.sync_gradients:
                    continue
                step += 1
                # each micro-batch's loss is its summed token loss / the step's global tokens: summed over
                # micro-batches and ranks, it is the step's global mean token loss
                loss = torch.tensor(sum(losses), device=accelerator.device)
                losses = []
                loss = float(accelerator.reduce(loss, reduction="sum"))
                if step % args.logging_steps == 0:
                    metrics = balancer.metrics()
                    if accelerator.is_main_process:
                        with open(log_path, "a") as f:
                            f.write(json.dumps({"step": step, "loss": loss, **metrics}) + "\n")
                if step >= args.max_steps:
                    break
            epoch += 1
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(os.path.join(args.output_dir, "final"))
    if not math.isfinite(loss):
        raise SystemExit(f"loss is {loss}")


if __name__ == "__main__":
    main()
