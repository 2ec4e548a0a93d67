"""How each way of `hf-dp-balance demo` trains on one rank: the schedule (pure), the datasets, the probe.

``none`` gets the step's samples in fixed-length packs (one equal-token pack per rank), ``batch_rebalance``
transformers' sampler over a dataset laid out so that its shuffle yields the same steps, ``hf_dp_balance``
the samples in order with `DPBalanceCallback`; the same samples in the same steps from the same weights.
The probe times each rank's main thread from `on_step_begin` to `on_step_end` and reads which samples it
computed. `apps.demo` spawns the ranks and runs the command.
"""

from __future__ import annotations

import time
from typing import List, Sequence

import numpy as np

_BATCH_REBALANCE_SEED = 42  # transformers' BatchRebalanceSampler default (Trainer does not pass one)
# The demo's decoder: bigger than `models.tiny_config`'s (hidden 64, 2 layers), so that a step's compute is
# dominated by the model (dense layers ~ L, attention ~ sum(L^2), ViT ~ patches) rather than by fixed
# per-step Python work (Trainer, hooks, gloo calls), as on a real cluster where a step takes seconds.
# head_dim 32: the 16 rotary frequencies split t/h/w as 4/6/6. The vision merger outputs the decoder width.
DEMO_HIDDEN = 256
DEMO_TEXT_CONFIG = dict(hidden_size=DEMO_HIDDEN, intermediate_size=2 * DEMO_HIDDEN, num_hidden_layers=4,
                        num_attention_heads=8, num_key_value_heads=4,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})
DEMO_VISION_CONFIG = dict(hidden_size=DEMO_HIDDEN)


# --------------------------------------------------------------------------- the ways' schedule (pure)


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


class _OrderedSamples:
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

    from hf_dp_balance.core.boundaries import segment_boundaries

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


def _way_inputs(way: str, world: int, samples, tokens: np.ndarray, opts: dict, collator):
    """What the Trainer of `way` trains on: (dataset, TrainingArguments, data collator, config or None).

    none: the step's samples in fixed-length packs, one per rank; batch_rebalance: transformers' sampler over a
    dataset laid out so that its shuffle yields the schedule's steps; hf_dp_balance: the samples in order.
    """
    from transformers import TrainingArguments

    from hf_dp_balance.config import DPBalanceConfig

    steps, warmup, per_rank = opts["steps"] + opts["warmup"], opts["warmup"], opts["samples_per_rank"]
    B = world * per_rank
    common = dict(output_dir=opts["workdir"], use_cpu=True, max_steps=steps, logging_steps=1, save_strategy="no",
                  report_to=[], disable_tqdm=True, seed=opts["seed"], learning_rate=1e-3, warmup_steps=0,
                  remove_unused_columns=False, dataloader_drop_last=True, ddp_find_unused_parameters=True,
                  log_level="error")
    packs = []  # none's fixed-length packs: one per rank per step, equal tokens
    for k in range(steps):
        step_ids = list(range(k * B, (k + 1) * B))
        packs += [[step_ids[i] for i in p] for p in token_balanced_packs(tokens[step_ids], world)]
    one_pack = TrainingArguments(per_device_train_batch_size=1, train_sampling_strategy="sequential", **common)
    if way == "none":
        return _Packs(samples, packs, collator), one_pack, _first, None
    if way == "batch_rebalance":
        # A `datasets.Dataset` with a "length" column, as a Trainer user would give it: Trainer then reads the
        # sampler's lengths from the column instead of loading (and image-processing) every sample on every rank.
        layout = batch_rebalance_layout(steps * B)
        train = samples.ds.select(layout).add_column("length", [int(tokens[i]) for i in layout])
        args = TrainingArguments(per_device_train_batch_size=per_rank, train_sampling_strategy="batch_rebalance",
                                 **common)
        return train, args, _RowsCollator(collator), None
    # Fit one step before the last warm-up step: the step prepared during the fit step keeps its placement, so
    # the first compared step is the first planned with the fitted model. Without vision-tower balancing (the
    # default here) the loader plans each sample at decoder + ViT cost (its images are encoded where it goes);
    # with it (`vision_tower`), the tower is balanced per image from step 1 and the loader plans decoder cost.
    config = DPBalanceConfig(warmup_steps=fit_step(warmup), lookahead_steps=opts["lookahead"],
                             vision=opts["vision"], max_token_ratio=opts["max_token_ratio"])
    if opts.get("input") == "packed":  # the user's own setup: none's packs are what the balanced way receives
        return _Packs(samples, packs, collator), one_pack, _first, config
    args = TrainingArguments(per_device_train_batch_size=per_rank, train_sampling_strategy="sequential", **common)
    return _OrderedSamples(samples, range(steps * B)), args, collator, config


def train_way(way: str, rank: int, world: int, ds, key_to_id: dict, tokens: np.ndarray, opts: dict,
              on_step_done) -> dict:
    """Train one way on this rank with the stock Trainer over the synthetic dataset `ds`; returns its per-step
    record (compute, samples, losses; the balancer's models and fits for hf_dp_balance)."""
    import torch
    from transformers import Trainer
    from transformers.trainer_callback import PrinterCallback

    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.integrations.callback import DPBalanceCallback
    from hf_dp_balance.runtime.attention import register_varlen_attention
    from hf_dp_balance.testing.models import make_model

    model = make_model("qwen2_vl", seed=opts["seed"], attn_implementation=register_varlen_attention(),
                       text_config=DEMO_TEXT_CONFIG, vision_config=DEMO_VISION_CONFIG)
    probe = _make_probe(model, key_to_id, on_step_done)
    train, args, collate, config = _way_inputs(way, world, _Rows(ds), tokens, opts, PackedCollator(model.config))
    if config is None:
        balancer = None
    elif opts.get("input") == "packed":
        balancer = _packed_input_callback(DPBalanceCallback)(config)
    else:
        balancer = DPBalanceCallback(config)
    callbacks = [balancer, probe] if balancer is not None else [probe]
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # the demo's own progress bar and table replace the log lines
    trainer.train()
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    moved = sum(int(h.get("dp_balance/moved_samples", 0)) for h in history)
    extra = {}
    if balancer is not None:
        extra = {"cost_model": balancer.decoder_model.to_dict() if balancer.decoder_model else None,
                 "vision_cost_model": balancer.vision_model.to_dict() if balancer.vision_model else None,
                 "vision_tower_balanced": bool(opts["vision"]), "fit_reports": balancer.fit_reports,
                 "applied_steps": [int(h.get("dp_balance/applied", 0)) for h in history if "loss" in h],
                 "balanced_loader": balancer.loader is not None}
    torch.distributed.barrier()
    return {"compute": probe.compute, "samples": probe.samples, "losses": losses, "moved": moved, **extra}


def _packed_input_callback(base):
    """`DPBalanceCallback` with the packed-input hook (until the callback takes `packed_input` itself): the
    Trainer's collator yields packed rows, which `PackedInput` splits before balancing and packs back."""
    from hf_dp_balance.integrations.install import install_balanced_loader
    from hf_dp_balance.runtime.packed_input import PackedInput

    class PackedInputCallback(base):
        def _install_loader(self, train_dataloader, model, args):
            trainer = self._trainer_ref()
            self._installed_on = trainer
            return install_balanced_loader(trainer, self.config,
                                           packed_input=PackedInput(model.config, collate_fn=trainer.data_collator))

    return PackedInputCallback


__all__ = ["DEMO_HIDDEN", "DEMO_TEXT_CONFIG", "DEMO_VISION_CONFIG", "batch_rebalance_layout", "fit_step",
           "token_balanced_packs", "train_way"]
