"""`hf-dp-balance demo`: train a tiny Qwen2-VL three ways on gloo ranks and compare the slowest rank.

The three ways see the same samples in the same optimizer steps (step k trains
samples [k*B, (k+1)*B) of one synthetic long-tail multimodal dataset, B =
ranks * samples_per_rank), on the real `Trainer`, from the same initial weights:

* ``none``: fixed-length packs. Each step's samples, in order, are cut into
  one pack per rank with (as nearly as contiguous cuts allow) the same number
  of tokens: what fixed-length packing gives every rank.
* ``batch_rebalance``: transformers' own ``train_sampling_strategy=
  "batch_rebalance"`` (`BatchRebalanceSampler`: a fixed cost bs*max_len +
  0.001*bs*max_len^2 over text lengths). The dataset is laid out so that the
  sampler's seeded shuffle yields exactly the same step sets.
* ``hf_dp_balance``: the stock Trainer with ``callbacks=[DPBalanceCallback()]``
  (sequential sampler, `samples_per_rank` samples per rank before balancing):
  warm-up timing, cost model fit, then samples exchanged between ranks.

The three ways run at the same time (3 x ranks processes, one gloo group per
way) and wait for each other after every step, outside the timed window: step
k of every way runs in the same state of the shared machine, so drift (other
jobs, clock changes) cannot favour the way that happened to run in a quiet
minute. Run one after the other, the mean rank compute of the three ways (the
same samples: the same work) differed by up to 17% between ways.

Every rank packs its micro-batch into one row (`PackedCollator`) and runs the
varlen attention (cost sum(L^2) on CPU, as flash-attn varlen on GPUs). A
rank's compute is the CPU time of its main thread from `on_step_begin` to
`on_step_end` (forward + backward + optimizer step); a rank waiting in a
collective burns no CPU, so this is the rank's own work even with several
ranks sharing two cores. The step time of a real cluster is the slowest
rank's compute, so ``slowest_rank_compute_s`` (sum over the compared steps of
the slowest rank) is what balancing should cut. The first ``warmup`` steps
(timing and fitting for hf_dp_balance) are trained by all three ways but left
out of the comparison; they are in the per-step arrays of demo.json.

Invariants checked and written to demo.json: every way trains the same sample
ids in every step, and the per-step losses agree (balancing changes where a
sample is computed, never what the step computes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

WAYS = ("none", "batch_rebalance", "hf_dp_balance")
LOSS_RTOL = 1e-4  # per-step loss agreement across ways (float32 summation order differs)
_BATCH_REBALANCE_SEED = 42  # transformers' BatchRebalanceSampler default (Trainer does not pass one)
# The demo's decoder: bigger than `data.tiny_config`'s (hidden 64, 2 layers), so that a step's compute is
# dominated by the model (dense layers ~ L, attention ~ sum(L^2), ViT ~ patches) rather than by fixed
# per-step Python work (Trainer, hooks, gloo calls), as on a real cluster where a step takes seconds.
# head_dim 32: the 16 rotary frequencies split t/h/w as 4/6/6. The vision merger outputs the decoder width.
DEMO_HIDDEN = 256
DEMO_TEXT_CONFIG = dict(hidden_size=DEMO_HIDDEN, intermediate_size=2 * DEMO_HIDDEN, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
DEMO_VISION_CONFIG = dict(hidden_size=DEMO_HIDDEN)


# --------------------------------------------------------------------------- pure parts


def token_balanced_packs(tokens: Sequence[int], parts: int) -> List[List[int]]:
    """Cut a sequence of samples into `parts` contiguous packs of nearly equal tokens.

    Cut r is placed at the sample boundary closest to r/parts of the total, so
    every pack holds about total/parts tokens: fixed-length packing of one step.
    Every pack gets at least one sample when there are at least `parts` samples.
    """
    tokens = np.asarray(tokens, dtype=np.float64)
    n = tokens.size
    if parts < 1 or n < parts:
        raise ValueError(f"token_balanced_packs: need at least {parts} samples for {parts} packs, got {n}")
    cum = np.concatenate([[0.0], np.cumsum(tokens)])
    cuts = [0]
    for r in range(1, parts):
        target = cum[-1] * r / parts
        j = int(np.argmin(np.abs(cum - target)))
        j = min(max(j, cuts[-1] + 1), n - (parts - r))  # non-empty packs on both sides
        cuts.append(j)
    cuts.append(n)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def fit_step(warmup: int) -> int:
    """The callback's `warmup_steps` so that step `warmup + 1` is the first planned with the fitted model.

    Until a model is set the loader stays one step ahead: after the fit at the end of step w, step w+1
    is already prepared without it and step w+2 is the first planned (with look-ahead too: the next
    window is prepared only once its previous step is taken). At least 2 timed steps (the first is dropped).
    """
    return max(2, warmup - 1)


def batch_rebalance_layout(num_samples: int, seed: int = _BATCH_REBALANCE_SEED, epoch: int = 0) -> np.ndarray:
    """Dataset layout that makes `BatchRebalanceSampler`'s seeded shuffle yield samples in schedule order.

    The sampler visits dataset positions `order = randperm(n, seed + epoch)`; storing
    schedule sample j at position order[j] makes its global batch k exactly the
    schedule's step k. Returns `layout` with dataset[p] = schedule sample layout[p].
    """
    import torch

    g = torch.Generator()
    g.manual_seed(seed + epoch)
    order = torch.randperm(num_samples, generator=g).numpy()
    layout = np.empty(num_samples, dtype=np.int64)
    layout[order] = np.arange(num_samples)
    return layout


def summarize_way(compute: np.ndarray, tokens_per_step: np.ndarray, losses: Sequence[float],
                  samples_per_step: Sequence[Sequence[int]], moved_samples: int, warmup: int) -> dict:
    """One way's numbers over the compared steps (after `warmup`); per-step arrays over all steps.

    compute: [steps, ranks] seconds; tokens_per_step: [steps].
    """
    compute = np.asarray(compute, dtype=np.float64)
    sl = slice(warmup, None)
    slowest = compute.max(axis=1)
    mean = compute.mean(axis=1)
    slowest_s = float(slowest[sl].sum())
    return {
        "slowest_rank_compute_s": slowest_s,
        "mean_rank_compute_s": float(mean[sl].sum()),
        "imbalance": float(slowest[sl].sum() / max(mean[sl].sum(), 1e-12) - 1.0),
        "samples_trained": int(sum(len(s) for s in samples_per_step[sl])),
        "tokens_trained": int(np.asarray(tokens_per_step)[sl].sum()),
        "tokens_per_s": float(np.asarray(tokens_per_step)[sl].sum() / max(slowest_s, 1e-12)),
        "moved_samples": int(moved_samples),
        "losses": [float(x) for x in losses],
        "per_step_slowest_s": slowest.tolist(),
        "per_step_mean_s": mean.tolist(),
        "per_rank_compute_s": compute.tolist(),
        "samples_per_step": [sorted(int(i) for i in s) for s in samples_per_step],
    }


def placement_bound(costs: np.ndarray, samples_per_step: Sequence[Sequence[int]], ranks: int) -> List[float]:
    """Per step: the least slowest-rank excess over the mean any placement of its samples can reach.

    max(heaviest sample, total / ranks) / (total / ranks) - 1, with `costs` per sample id (the fitted
    models' prediction). Above 0 only where one sample outweighs a rank's whole share: then no per-step
    balancing can go lower (only moving samples to other steps could). O(samples).
    """
    costs = np.asarray(costs, dtype=np.float64)
    out = []
    for ids in samples_per_step:
        c = costs[np.asarray(ids, dtype=np.int64)] if len(ids) else np.zeros(1)
        share = c.sum() / ranks
        out.append(float(max(c.max(), share) / share - 1.0) if share > 0 else 0.0)
    return out


def reachable_cut(costs: np.ndarray, none_rank_samples: Sequence[Sequence[Sequence[int]]],
                  ranks: int, step_constant: float = 0.0) -> dict:
    """How far below fixed-length packs any per-step placement can bring the slowest rank (predicted).

    `none_rank_samples[k][r]`: sample ids rank r trained in step k under fixed-length packs; `costs`
    per sample id and `step_constant` per rank-step come from the fitted models. Returns
    ``none_predicted_s`` (sum over steps of none's slowest rank), ``bound_s`` (sum over steps of
    max(heaviest sample, share) + constant: no placement of a step's samples does better) and
    ``ceiling`` = 1 - bound_s / none_predicted_s, the largest cut per-step balancing can make on
    these steps. Both sums use the same model, so its error mostly cancels in the ratio. O(samples).
    """
    costs = np.asarray(costs, dtype=np.float64)
    none_s = bound_s = 0.0
    for per_rank in none_rank_samples:
        loads = np.array([costs[np.asarray(ids, dtype=np.int64)].sum() if len(ids) else 0.0 for ids in per_rank])
        ids = [i for r in per_rank for i in r]
        heaviest = float(costs[np.asarray(ids, dtype=np.int64)].max()) if ids else 0.0
        none_s += float(loads.max()) + step_constant
        bound_s += max(heaviest, float(loads.sum()) / ranks) + step_constant
    return {"none_predicted_s": none_s, "bound_s": bound_s,
            "ceiling": 1.0 - bound_s / none_s if none_s > 0 else 0.0}


def check_invariants(runs: Dict[str, dict], reference: str = "none", rtol: float = LOSS_RTOL,
                     window: int = 1, window_from: Optional[int] = None, windowed: Sequence[str] = ()) -> dict:
    """Same sample ids in every step of every way; per-step losses equal to the reference's within `rtol`.

    With look-ahead (`window` K > 1) the ways in `windowed` may train a sample in another step of its
    window (aligned windows of K steps from step index `window_from`): from there on their samples are
    compared per window and their losses are not compared (a reordered step trains other samples, and
    every later step starts from other weights). Steps before `window_from` are compared as usual.
    """
    ref = runs[reference]
    out = {"same_samples": True, "losses_equal": True, "max_loss_rel_diff": 0.0, "loss_rtol": rtol}
    if window > 1:
        out.update(window=window, windows_from_step=window_from, windowed=list(windowed))
    for name, run in runs.items():
        a, b = np.asarray(run["losses"]), np.asarray(ref["losses"])
        mine, theirs = run["samples_per_step"], ref["samples_per_step"]
        if window > 1 and name in windowed:
            cut = int(window_from)
            a, b = a[:cut], b[:cut]
            same = mine[:cut] == theirs[:cut] and len(mine) == len(theirs) and all(
                sorted(i for s in mine[w:w + window] for i in s) == sorted(i for s in theirs[w:w + window] for i in s)
                for w in range(cut, len(theirs), window))
        else:
            same = mine == theirs
        out["same_samples"] = out["same_samples"] and same
        if a.shape != b.shape:
            out["losses_equal"] = False
            continue
        rel = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-12))) if a.size else 0.0
        out["max_loss_rel_diff"] = max(out["max_loss_rel_diff"], rel)
        out["losses_equal"] = out["losses_equal"] and rel <= rtol
    return out


def format_table(runs: Dict[str, dict]) -> str:
    none = runs["none"]["slowest_rank_compute_s"]
    lines = [f"{'way':<16}{'slowest rank s':>15}{'mean rank s':>13}{'imbalance':>11}{'samples':>9}"
             f"{'tokens/s':>10}{'moved':>7}{'vs none':>9}"]
    for name, r in runs.items():
        lines.append(f"{name:<16}{r['slowest_rank_compute_s']:>15.3f}{r['mean_rank_compute_s']:>13.3f}"
                     f"{100 * r['imbalance']:>10.1f}%{r['samples_trained']:>9d}{r['tokens_per_s']:>10.0f}"
                     f"{r['moved_samples']:>7d}{100 * (r['slowest_rank_compute_s'] / none - 1):>+8.1f}%")
    return "\n".join(lines)


# --------------------------------------------------------------------------- one rank


class _Rows:
    """The synthetic samples as per-sample dicts of tensors, converted on access (a rank reads only its own)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        from hf_dp_balance.testing.data import to_sample

        return to_sample(self.ds[int(i)])


class _Samples:
    """Map-style dataset over per-sample dicts (tensors) in a given order."""

    def __init__(self, samples, order: Sequence[int]):
        self.samples, self.order = samples, [int(i) for i in order]

    def __len__(self):
        return len(self.order)

    def __getitem__(self, i):
        return self.samples[self.order[i]]


class _Packs:
    """Map-style dataset whose item k*ranks + r is rank r's fixed-length pack of step k, packed on access."""

    def __init__(self, samples, packs: List[List[int]], collator):
        self.samples, self.packs, self.collator = samples, packs, collator

    def __len__(self):
        return len(self.packs)

    def __getitem__(self, i):
        return self.collator([self.samples[j] for j in self.packs[i]])


class _RowsCollator:
    """Dataset rows (python lists, a "length" column) -> per-sample tensors -> the packing collator."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, rows):
        from hf_dp_balance.testing.data import to_sample

        return self.collator([to_sample({k: v for k, v in r.items() if k != "length"}) for r in rows])


def _first(batch):
    return batch[0]


def _make_probe(model, key_to_id: dict, on_step_done):
    """A TrainerCallback timing this rank's compute per step and reading which samples it computed.

    `on_step_done(step)` runs after the step's time is taken (outside the timed window): the demo
    reports progress there and waits for the other ways, so the three ways run their steps in lockstep.
    """
    from transformers import TrainerCallback

    from hf_dp_balance.core.packing import segment_boundaries

    class Probe(TrainerCallback):
        def __init__(self):
            self.compute: List[float] = []
            self.samples: List[List[int]] = []
            self._t0 = None
            self._current: List[int] = []
            model.register_forward_pre_hook(self._read, with_kwargs=True)

        def _read(self, module, args, kwargs):
            ids = kwargs["input_ids"][0].tolist()
            pos = kwargs["position_ids"]
            starts = segment_boundaries(pos)[0]  # row 0 of the batch (of the plain positions for [4, B, T])
            for a, b in zip(starts, starts[1:]):
                sid = key_to_id.get(tuple(ids[a:b]))
                if sid is not None:  # None: the collator's no-op row of a rank without samples
                    self._current.append(sid)

        def on_step_begin(self, args, state, control, **kw):
            self._current = []
            self._t0 = time.thread_time()

        def on_step_end(self, args, state, control, **kw):
            self.compute.append(time.thread_time() - self._t0)
            self.samples.append(self._current)
            on_step_done(len(self.compute))

    return Probe()


def _train_way(way: str, rank: int, world: int, samples, key_to_id: dict, tokens: np.ndarray, opts: dict,
               on_step_done) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    from hf_dp_balance.runtime.attention import register_varlen_attention
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.testing.data import make_model
    from hf_dp_balance.core.packing import PackedCollator

    steps, warmup, per_rank = opts["steps"] + opts["warmup"], opts["warmup"], opts["samples_per_rank"]
    B = world * per_rank
    model = make_model("qwen2_vl", seed=opts["seed"], attn_implementation=register_varlen_attention(),
                       text_config=DEMO_TEXT_CONFIG, vision_config=DEMO_VISION_CONFIG)
    collator = PackedCollator(model.config)
    probe = _make_probe(model, key_to_id, on_step_done)
    common = dict(output_dir=opts["workdir"], use_cpu=True, max_steps=steps, logging_steps=1, save_strategy="no",
                  report_to=[], disable_tqdm=True, seed=opts["seed"], learning_rate=1e-3, warmup_steps=0,
                  remove_unused_columns=False, dataloader_drop_last=True, ddp_find_unused_parameters=True,
                  log_level="error")
    callbacks = [probe]
    if way == "none":
        packs = []
        for k in range(steps):
            step_ids = list(range(k * B, (k + 1) * B))
            packs += [[step_ids[i] for i in p] for p in token_balanced_packs(tokens[step_ids], world)]
        train = _Packs(samples, packs, collator)
        args = TrainingArguments(per_device_train_batch_size=1, train_sampling_strategy="sequential", **common)
        collate = _first
    elif way == "batch_rebalance":
        # A `datasets.Dataset` with a "length" column, as a Trainer user would give it: Trainer then reads the
        # sampler's lengths from the column instead of loading (and image-processing) every sample on every rank.
        layout = batch_rebalance_layout(steps * B)
        train = samples.ds.select(layout).add_column("length", [int(tokens[i]) for i in layout])
        args = TrainingArguments(per_device_train_batch_size=per_rank, train_sampling_strategy="batch_rebalance",
                                 **common)
        collate = _RowsCollator(collator)
    else:
        train = _Samples(samples, range(steps * B))
        args = TrainingArguments(per_device_train_batch_size=per_rank, train_sampling_strategy="sequential", **common)
        collate = collator
        # Fit one step before the last warm-up step: the step prepared during the fit step keeps its
        # placement, so the first compared step is the first planned with the fitted model. Without vision-tower balancing (the default here) the loader
        # plans each sample at decoder + ViT cost (its images are encoded where it goes); with it
        # (`vision_tower`), the tower is balanced per image from step 1 and the loader plans decoder cost.
        config = DPBalanceConfig(warmup_steps=fit_step(warmup), lookahead_steps=opts["lookahead"],
                                 vision=opts["vision"], max_token_ratio=opts["max_token_ratio"])
        callbacks = [DPBalanceCallback(config), probe]
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # the demo's own progress bar and table replace the log lines
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    moved = sum(int(h.get("dp_balance/moved_samples", 0)) for h in trainer.state.log_history)
    applied = [int(h.get("dp_balance/applied", 0)) for h in trainer.state.log_history if "loss" in h]
    extra = {}
    if way == "hf_dp_balance":
        cb = callbacks[0]
        extra = {"cost_model": cb.decoder_model.to_dict() if cb.decoder_model else None,
                 "vision_cost_model": cb.vision_model.to_dict() if cb.vision_model else None,
                 "vision_tower_balanced": bool(opts["vision"]),
                 "fit_reports": cb.fit_reports, "applied_steps": applied,
                 "balanced_loader": cb.loader is not None}
    torch.distributed.barrier()
    return {"compute": probe.compute, "samples": probe.samples, "losses": losses, "moved": moved, **extra}


def _rank_main(way: str, rank: int, world: int, port: int, ds_path: str, opts: dict, results, lockstep) -> None:
    """One rank of one way: its own gloo group (`port`); `lockstep` is shared by every rank of every way."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                       # DDP's C++ "find_unused_parameters ... did not find any unused parameters" warning, once
                       # per rank: the flag is needed (text-only packs leave the vision tower unused), the
                       # warning is noise in the demo's output. Read when torch loads, which is below.
                       "TORCH_CPP_LOG_LEVEL": "ERROR"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)

    def step_done(step: int) -> None:
        if rank == 0:
            results.put(("step", way, rank, step))
        lockstep.wait(timeout=opts["step_timeout_s"])  # thread CPU time is not spent while waiting

    try:
        import datasets
        import transformers

        transformers.logging.set_verbosity_error()
        datasets.disable_progress_bars()
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        ds = datasets.load_from_disk(ds_path)
        key_to_id = {}
        for i, ids in enumerate(ds["input_ids"]):  # a few tiny samples repeat their tokens: they share the first id
            key_to_id.setdefault(tuple(int(t) for t in ids), i)
        tokens = np.array([len(ids) for ids in ds["input_ids"]])
        lockstep.wait(timeout=opts["step_timeout_s"])  # every way starts step 1 together
        out = _train_way(way, rank, world, _Rows(ds), key_to_id, tokens, opts, step_done)
        results.put(("done", way, rank, True, out))
    except BaseException:  # noqa: BLE001 - forwarded to the parent with its traceback
        import traceback

        lockstep.abort()  # the other ways stop waiting for this one
        results.put(("done", way, rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the command


def settings_problem(steps: int, ranks: int, warmup: int, samples_per_rank: int, lookahead: int,
                     max_token_ratio: float = 1.5) -> Optional[str]:
    """What is wrong with these demo settings, or None (checked before any process starts)."""
    if steps < 1 or ranks < 2 or warmup < 1 or samples_per_rank < 1 or lookahead < 0:
        return (f"need steps >= 1, ranks >= 2, warmup >= 1, samples_per_rank >= 1, lookahead >= 0; got steps={steps}, "
                f"ranks={ranks}, warmup={warmup}, samples_per_rank={samples_per_rank}, lookahead={lookahead}")
    if not max_token_ratio >= 1.0:
        return f"--max-token-ratio {max_token_ratio}: must be >= 1.0 (a cap below the mean cannot hold every sample)"
    if lookahead > 1 and warmup % lookahead:
        return (f"--warmup {warmup} must be a multiple of --lookahead {lookahead} (the loader's windows start at "
                f"step 1, and the compared steps must start a window)")
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_demo(steps: int = 15, ranks: int = 4, *, warmup: int = 6, samples_per_rank: int = 16, seed: int = 0,
             mix: str = "long_tail", max_token_ratio: float = 1.5, vision: bool = False, lookahead: int = 0,
             progress: bool = True, timeout_s: float = 900.0) -> dict:
    """Run the three ways at once, each on `ranks` spawned gloo processes, in lockstep; returns demo.json's content."""
    import datasets
    import torch.multiprocessing as mp

    from hf_dp_balance.testing.data import build_synthetic_dataset

    problem = settings_problem(steps, ranks, warmup, samples_per_rank, lookahead, max_token_ratio)
    if problem:
        raise ValueError(f"demo: {problem}")
    total = (steps + warmup) * ranks * samples_per_rank
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hf_dp_balance_demo_") as tmp:
        if progress:
            print(f"building {total} synthetic samples (tiny Qwen2-VL, {mix} mix) ...", file=sys.stderr)
        datasets.disable_progress_bars()
        ds = build_synthetic_dataset("qwen2_vl", total, seed=seed, mix=mix)
        ds.save_to_disk(os.path.join(tmp, "ds"))
        tokens = [len(ids) for ids in ds["input_ids"]]
        # patch rows of each sample's images / videos: the fitted vision model's unit
        patches = [[int(np.prod(g)) for g in (img or [])] + [int(np.prod(g)) for g in (vid or [])]
                   for img, vid in zip(ds["image_grid_thw"], ds["video_grid_thw"])]
        opts = {"steps": steps, "warmup": warmup, "samples_per_rank": samples_per_rank, "seed": seed, "vision": vision,
                "max_token_ratio": max_token_ratio, "lookahead": lookahead, "workdir": os.path.join(tmp, "out"),
                "step_timeout_s": timeout_s}
        # The three ways run at the same time, each on its own `ranks` processes and gloo group, and meet
        # after every step (a barrier outside the timed window): step k of every way runs while the
        # machine is in the same state, so a slower minute of the shared cores slows all three alike.
        ctx = mp.get_context("spawn")
        results, lockstep = ctx.Queue(), ctx.Barrier(len(WAYS) * ranks)
        procs = {}
        for way in WAYS:
            port = _free_port()
            for r in range(ranks):
                args = (way, r, ranks, port, os.path.join(tmp, "ds"), opts, results, lockstep)
                procs[way, r] = ctx.Process(target=_rank_main, args=args, daemon=True)
        for p in procs.values():
            p.start()
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps + warmup, desc=f"demo: {', '.join(WAYS)} in lockstep", unit="step", file=sys.stderr)
        got: Dict[tuple, dict] = {}
        failures: Dict[tuple, str] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) + len(failures) < len(procs):
                if time.monotonic() > deadline:
                    late = sorted(set(procs) - set(got) - set(failures))
                    raise RuntimeError(f"demo: {late} (way, rank) did not finish within {timeout_s:.0f}s")
                try:
                    msg = results.get(timeout=1.0)
                except Exception:  # queue.Empty
                    dead = [k for k, p in procs.items() if k not in got and k not in failures and not p.is_alive()]
                    if dead:
                        failures[dead[0]] = f"exited with code {procs[dead[0]].exitcode}"
                        lockstep.abort()
                    continue
                if msg[0] == "step":
                    _, way, _, step = msg
                    if bar is not None and way == WAYS[0]:
                        bar.update(step - bar.n)
                    continue
                _, way, rank, ok, value = msg
                (got if ok else failures)[way, rank] = value
            if failures:  # the first real error, not a way that stopped because another one broke the barrier
                key = next((k for k, v in failures.items() if "BrokenBarrierError" not in v), next(iter(failures)))
                raise RuntimeError(f"demo: {key[0]} rank {key[1]} failed:\n{failures[key]}")
        finally:
            if bar is not None:
                bar.close()
            for p in procs.values():
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    by_rank = {r: {way: got[way, r] for way in WAYS} for r in range(ranks)}
    by_rank[0].update(tokens=tokens, patches=patches)
    return assemble(by_rank, ranks, steps, warmup, samples_per_rank, seed, mix, time.perf_counter() - started,
                    lookahead=lookahead)


def assemble(by_rank: Dict[int, dict], ranks: int, steps: int, warmup: int, samples_per_rank: int, seed: int,
             mix: str, wall_s: float, lookahead: int = 0) -> dict:
    """Combine the ranks' records into demo.json's content (pure)."""
    tokens = np.asarray(by_rank[0]["tokens"])
    runs = {}
    for way in WAYS:
        compute = np.array([by_rank[r][way]["compute"] for r in range(ranks)]).T  # [steps, ranks]
        samples = [sorted(s for r in range(ranks) for s in by_rank[r][way]["samples"][k])
                   for k in range(compute.shape[0])]
        step_tokens = np.array([tokens[s].sum() if s else 0 for s in samples])
        runs[way] = summarize_way(compute, step_tokens, by_rank[0][way]["losses"], samples,
                                  by_rank[0][way]["moved"], warmup)
    hf = by_rank[0]["hf_dp_balance"]
    runs["hf_dp_balance"].update({k: hf[k] for k in ("cost_model", "vision_cost_model", "vision_tower_balanced",
                                                      "fit_reports", "applied_steps", "balanced_loader") if k in hf})
    none, br, ours = (runs[w]["slowest_rank_compute_s"] for w in WAYS)
    bound = None
    if hf.get("cost_model") and hf.get("vision_cost_model") and "patches" in by_rank[0]:
        from hf_dp_balance.core.cost import CostModel
        from hf_dp_balance.runtime.loader import planning_costs

        costs = planning_costs(tokens, by_rank[0]["patches"], CostModel.from_dict(hf["cost_model"]),
                               CostModel.from_dict(hf["vision_cost_model"]))
        per_step = placement_bound(costs, runs["none"]["samples_per_step"], ranks)
        compared = np.asarray(per_step[warmup:])
        constant = hf["cost_model"].get("constant", 0.0) + hf["vision_cost_model"].get("constant", 0.0)
        none_rank_samples = [[by_rank[r]["none"]["samples"][k] for r in range(ranks)]
                             for k in range(warmup, len(per_step))]
        bound = {"per_step_excess": per_step, "compared_steps_bound_by_one_sample": int((compared > 0.02).sum()),
                 "compared_steps": int(compared.size),
                 **reachable_cut(costs, none_rank_samples, ranks, constant)}
    return {
        "settings": {"ranks": ranks, "steps": steps, "warmup_steps": warmup, "samples_per_rank": samples_per_rank,
                     "samples_per_step": ranks * samples_per_rank, "seed": seed, "mix": mix,
                     "lookahead_steps": lookahead,
                     "model": f"tiny Qwen2-VL (random weights; decoder hidden {DEMO_HIDDEN}, "
                              f"{DEMO_TEXT_CONFIG['num_hidden_layers']} layers), varlen attention, gloo, "
                              "1 thread per rank",
                     "compute": "thread CPU time of forward+backward+optimizer per rank per step"},
        "runs": runs,
        # every way trains the same samples, so the same work: no placement gets the slowest rank below the mean
        "gain": {"vs_none": 1.0 - ours / none, "vs_batch_rebalance": 1.0 - ours / br,
                 "batch_rebalance_vs_none": 1.0 - br / none,
                 "perfect_balance_vs_none": 1.0 - runs["none"]["mean_rank_compute_s"] / none},
        "invariants": check_invariants(runs, window=lookahead, window_from=warmup, windowed=["hf_dp_balance"]),
        "placement_bound": bound,
        "wall_s": wall_s,
    }


def plot(result: dict, path: str) -> None:
    """Per-step slowest vs mean rank compute for each way (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = {"none": "tab:red", "batch_rebalance": "tab:orange", "hf_dp_balance": "tab:green"}
    warmup = result["settings"]["warmup_steps"]
    for way, run in result["runs"].items():
        x = np.arange(1, len(run["per_step_slowest_s"]) + 1)
        ax.plot(x, run["per_step_slowest_s"], "-", color=colors.get(way), label=f"{way}: slowest rank")
        ax.plot(x, run["per_step_mean_s"], "--", color=colors.get(way), alpha=0.6, label=f"{way}: mean rank")
    ax.axvspan(0.5, warmup + 0.5, color="0.9",
               label="warm-up, not compared (hf_dp_balance: sampler order until its cost model is fitted)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("rank compute per step (s, thread CPU time)")
    s = result["settings"]
    ax.set_title(f"tiny Qwen2-VL, {s['ranks']} gloo ranks, {s['mix']} mix: slowest vs mean rank")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13))  # below: the lines stay clear
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=15, help="compared optimizer steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=6,
                        help="steps trained by every way but not compared (hf_dp_balance times, fits, prefetches)")
    parser.add_argument("--vision-tower", action="store_true",
                        help="hf_dp_balance also balances the vision tower per image (default: the loader plans "
                             "each sample at decoder + vision cost, its images encoded where it goes)")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks (processes, one thread each)")
    parser.add_argument("--samples-per-rank", type=int, default=16, help="samples per rank per step before balancing")
    parser.add_argument("--mix", choices=("long_tail", "bounded"), default="long_tail")
    parser.add_argument("--max-token-ratio", type=float, default=1.5,
                        help="hf_dp_balance's hard per-rank token cap, as a multiple of the mean")
    parser.add_argument("--lookahead", type=int, default=0, metavar="K",
                        help="hf_dp_balance also moves samples between the steps of windows of K steps (the "
                             "library's lookahead_steps): then its samples match none's per window, not per step, "
                             "and its losses after the warm-up are not compared; --warmup must be a multiple of K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="demo.json", help="where to write the results")
    parser.add_argument("--plot", default="demo.png", help="where to write the plot (PNG); '' for none")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    problem = settings_problem(args.steps, args.ranks, args.warmup, args.samples_per_rank, args.lookahead,
                               args.max_token_ratio)
    if problem:
        print(f"hf-dp-balance demo: error: {problem}", file=sys.stderr)
        return 2
    result = run_demo(args.steps, args.ranks, warmup=args.warmup, samples_per_rank=args.samples_per_rank,
                      seed=args.seed, mix=args.mix, max_token_ratio=args.max_token_ratio,
                      vision=args.vision_tower, lookahead=args.lookahead, progress=not args.no_progress)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(format_table(result["runs"]))
    g, inv = result["gain"], result["invariants"]

    def cut(x: float) -> str:
        return f"{100 * abs(x):.1f}% {'lower' if x >= 0 else 'higher'}"

    print(f"\nslowest-rank compute: {cut(g['vs_none'])} than none, {cut(g['vs_batch_rebalance'])} than "
          f"batch_rebalance (steps {args.warmup + 1}..{args.warmup + args.steps}; {args.warmup} warm-up steps "
          f"not compared)")
    print(f"perfect balance (every rank at none's mean rank compute, the same work) would be "
          f"{100 * g['perfect_balance_vs_none']:.1f}% lower than none")
    bound = result.get("placement_bound")
    if bound:
        print(f"{bound['compared_steps_bound_by_one_sample']} of {bound['compared_steps']} compared steps hold a "
              f"sample heavier than a rank's share (fitted costs): no placement within the step gets their "
              f"slowest rank down to the mean (placement_bound in the JSON)")
        if "ceiling" in bound:
            got = g["vs_none"] / bound["ceiling"] if bound["ceiling"] > 0 else float("nan")
            print(f"reachable by any per-step placement of these steps (fitted costs): {100 * bound['ceiling']:.1f}% "
                  f"below none; hf_dp_balance measured {100 * g['vs_none']:.1f}% ({100 * got:.0f}% of it)")
    if inv.get("window", 1) > 1:
        print(f"look-ahead K={inv['window']}: hf_dp_balance may train a sample in another step of its window, so "
              f"the per-step bound above does not hold for it; same samples in every step before step "
              f"{inv['windows_from_step'] + 1} and in every window of {inv['window']} steps from there: "
              f"{inv['same_samples']}; losses equal before step {inv['windows_from_step'] + 1} "
              f"(rtol {inv['loss_rtol']:g}): {inv['losses_equal']} (max rel. diff {inv['max_loss_rel_diff']:.2e})")
    else:
        print(f"same samples in every step: {inv['same_samples']}; per-step losses equal (rtol {inv['loss_rtol']:g}): "
              f"{inv['losses_equal']} (max rel. diff {inv['max_loss_rel_diff']:.2e})")
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else "") + f" in {result['wall_s']:.0f}s")
    return 0 if inv["same_samples"] and inv["losses_equal"] else 1


__all__ = ["add_arguments", "run", "run_demo", "token_balanced_packs", "placement_bound", "reachable_cut",
           "batch_rebalance_layout", "summarize_way", "check_invariants", "settings_problem", "assemble", "plot",
           "format_table"]
