"""Under FSDP2, do the recorder's unit spans (`timing="unit_events"`) time each rank's own forward, without the
all-gather waits? Rank-skewed inputs, side by side on every rank of one run.

A random-weight Qwen2 decoder (tiny on CPU; `--layers/--hidden` for a GPU), `fully_shard` per decoder layer and
then the root, rank r's packed row `--tokens * (1 + r * --skew)` tokens long: every rank but the last waits for
a slower one at every layer's all-gather. Per rank, the minimum over `--steps` steps of:
  spans      3x the forward spans of `runtime.recorder.timed_parts` / 3 (what `unit_events` reads), CUDA events
             on CUDA, the synchronised clock elsewhere
  whole      the same around the whole model (`forward_events`, the DDP timing): holds the waits
  wall       the synchronised wall time of the forward
  own        the same rank's forward of the same model without FSDP (no collective): its own compute
The claim holds where `spans` ~ `own` on every rank while `wall` ~ the slowest rank's `own` on all of them.

    torchrun --nproc_per_node 2 bench/fsdp_unit_spans.py                       # CPU, gloo, tiny
    torchrun --nproc_per_node 8 bench/fsdp_unit_spans.py --layers 8 --hidden 2048 --tokens 4096 --skew 1
        # GPUs (NCCL, bf16, one GPU per process): what a GPU check verifies (not run here: no GPU lent)
"""

from __future__ import annotations

import argparse
import copy
import os
import time


def _model(args, device, dtype):
    from hf_dp_balance.testing.models import make_model

    heads = max(2, args.hidden // 64)
    model = make_model("text", seed=0, attn_implementation=args.attn, text_config=dict(
        num_hidden_layers=args.layers, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2)))
    return model.to(device=device, dtype=dtype)


def _batch(args, rank, device):
    import torch

    tokens = int(args.tokens * (1 + rank * args.skew))
    ids = torch.randint(3, 500, (1, tokens), generator=torch.Generator().manual_seed(rank)).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128, help="rank 0's tokens")
    parser.add_argument("--skew", type=float, default=7.0, help="rank r gets tokens * (1 + r * skew)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--attn", default="sdpa")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_dp_balance.runtime.recorder import StepClock, StepRecorder, synchronize

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    model = _model(args, device, torch.bfloat16 if cuda else torch.float32)
    plain = copy.deepcopy(model)
    batch = _batch(args, rank, device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Both recorders on the same forwards (their hooks are independent), the unsharded forward just before:
    # every step's four numbers are taken at the same moment of a shared machine.
    units = StepRecorder(StepClock("unit_events", device.type), micro_batches=False)
    whole = StepRecorder(StepClock("forward_events", device.type), micro_batches=False)
    units.install(model)
    whole.install(model)
    rows = []
    for _ in range(args.steps):
        synchronize()
        start = time.perf_counter()
        loss = plain(**batch).loss  # the forward alone, with autograd recording as in training
        synchronize()
        own = time.perf_counter() - start
        del loss
        dist.barrier()
        units.begin()
        whole.begin()
        synchronize()
        start = time.perf_counter()
        loss = model(**batch).loss
        synchronize()
        wall = time.perf_counter() - start
        loss.backward()
        rows.append((units.end() / 3.0, whole.end() / 3.0, wall, own))
        model.zero_grad()
    units.remove()
    whole.remove()
    spans, whole_s, wall, own = (min(r[k] for r in rows) for k in range(4))
    mine = {"rank": rank, "tokens": int(batch["input_ids"].shape[1]), "spans": spans, "whole": whole_s,
            "wall": wall, "own": own}
    table = [None] * world
    dist.all_gather_object(table, mine)
    if rank == 0:
        print(f"FSDP2 per decoder layer, {world} ranks on {device.type}, min of {args.steps} steps (seconds)")
        print(f"  {'rank':>4s} {'tokens':>7s} {'spans':>9s} {'whole':>9s} {'wall':>9s} {'own':>9s} "
              f"{'spans/own':>9s} {'spans/wall':>10s}")
        for r in table:
            print(f"  {r['rank']:4d} {r['tokens']:7d} {r['spans']:9.4f} {r['whole']:9.4f} {r['wall']:9.4f} "
                  f"{r['own']:9.4f} {r['spans'] / r['own']:9.2f} {r['spans'] / r['wall']:10.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
