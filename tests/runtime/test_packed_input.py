"""BalancedLoader over the packed rows users already have: real gloo ranks, real tiny models (float64)."""

import pytest
import torch

from hf_dp_balance.core.packing import IGNORE_INDEX, PackedCollator
from hf_dp_balance.core.unpacking import INPUT_CU_SEQ_LENS, INPUT_POSITIONS, split_packed
from hf_dp_balance.runtime.packed_input import PackedInput
from hf_dp_balance.testing.data import tiny_config
from hf_dp_balance.testing.spawn import run_ranks

GA, BATCH, STEPS = 2, 3, 2
PIXEL_KEYS = {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}


def _double(samples):
    return [{k: (v.double() if v.is_floating_point() else v) for k, v in s.items()} for s in samples]


def _with_cu_seq_lens(batch):
    """A small hand-written collator's extra: flash-attention's varlen kwargs next to the positions."""
    plain = batch["position_ids"][0] if batch["position_ids"].ndim == 3 else batch["position_ids"]
    starts = torch.nonzero(plain.reshape(-1) == 0).flatten().tolist() + [plain.numel()]
    cu = torch.tensor(starts, dtype=torch.int32)
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    return dict(batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def _pad_to(row, width):
    """Fixed-width packing by hand: fill the row to `width` with a pad segment that trains nothing."""
    pad = width - row["input_ids"].shape[1]
    out = dict(row, input_ids=torch.cat([row["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1),
               labels=torch.cat([row["labels"], torch.full((1, pad), IGNORE_INDEX)], 1))
    if "mm_token_type_ids" in row:
        out["mm_token_type_ids"] = torch.cat([row["mm_token_type_ids"], torch.zeros(1, pad, dtype=torch.long)], 1)
    pos = row["position_ids"]
    out["position_ids"] = torch.cat([pos, torch.arange(pad).expand(*pos.shape[:-1], pad)], -1)
    return out


class UserCollator:
    """What a user who packs already has: transformers' flattening collator (text) or PackedCollator (VLMs)
    for `layout` "positions"; plus cu_seq_lens written by hand ("flash"); or two rows per micro-batch, the
    first sample in row 0, the others in row 1, padded to one width ("rows")."""

    def __init__(self, config, family, layout):
        from transformers import DataCollatorWithFlattening

        self.layout, self.text = layout, family == "text"
        flash = layout == "flash"
        self.pack = DataCollatorWithFlattening(return_flash_attn_kwargs=flash) if self.text else PackedCollator(config)

    def __call__(self, samples):
        samples = _double(samples)
        if self.layout == "rows":
            a, b = self.pack(samples[:1]), self.pack(samples[1:])
            width = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
            a, b = _pad_to(a, width), _pad_to(b, width)
            dims = {"position_ids": a["position_ids"].ndim - 2}
            return {k: torch.cat([r[k] for r in (a, b) if k in r], dims.get(k, 0)) for k in {**a, **b}}
        batch = self.pack(samples)
        return _with_cu_seq_lens(batch) if self.layout == "flash" and not self.text else batch


def _targets(batch):
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def _step_grads(model, batches, group_sum):
    """This step's global gradient (all ranks summed), the loss normalised by the step's global target count."""
    total = group_sum(torch.tensor(float(sum(_targets(b) for b in batches)), dtype=torch.float64))
    model.zero_grad()
    for b in batches:
        (model(**b).loss * _targets(b) / total).backward()
    flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                      for p in model.parameters()])
    return group_sum(flat)


def _case(rank, world, family, layout):
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader
    from hf_dp_balance.testing.data import build_synthetic_dataset, make_model, to_sample

    def group_sum(t):
        dist.all_reduce(t)
        return t

    model = make_model(family, seed=0, dtype=torch.float64)
    data = [to_sample(r) for r in build_synthetic_dataset(family, world * GA * BATCH * STEPS, seed=1, scale=1 / 32)]
    loader_of = lambda: DataLoader(data[rank::world], batch_size=BATCH, collate_fn=UserCollator(model.config, family, layout))
    raw = list(loader_of())
    ref_steps = [raw[i:i + GA] for i in range(0, len(raw), GA)]
    ref = [_step_grads(model, step, group_sum) for step in ref_steps]
    longest = [torch.tensor(max(b["input_ids"].shape[1] for b in step)) for step in ref_steps]
    for t in longest:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)

    packed = PackedInput(model.config)
    loader = BalancedLoader(loader_of(), DPBalanceConfig(timeout_s=60, min_gain=0.0), gradient_accumulation_steps=GA,
                            model_config=model.config, packed_input=packed,
                            cost_model=CostModel(quadratic=1.0, linear=20.0))
    steps = list(loader.iter_steps())
    bal = [_step_grads(model, step, group_sum) for step in steps]
    keys = [sorted(k for b in step for k in b) for step in steps]
    widths = [max(b["input_ids"].shape[1] for b in step) for step in steps]
    rows = sorted({b["input_ids"].shape[0] for step in steps for b in step})
    def trained(batches):  # the samples with a target (pad segments train nothing and are not counted)
        return [bytes(s["input_ids"].numpy()) for b in batches for s in split_packed(b, model.config)
                if bool((s["labels"] != IGNORE_INDEX).any())]

    mine, theirs = trained([b for step in steps for b in step]), trained(raw)
    everyone, originals = [None] * world, [None] * world
    dist.all_gather_object(everyone, mine)
    dist.all_gather_object(originals, theirs)
    rel = [float((b - r).norm() / r.norm()) for b, r in zip(bal, ref)]
    stats = loader.pop_stats()
    return dict(rel=rel, kind=packed.kind, keys=keys, ref_keys=[sorted(k for b in s for k in b) for s in ref_steps],
                widths=widths, rows=rows, longest=[int(t) for t in longest], moved=sum(s.moved_samples for s in stats),
                hashes=[s.plan_hash for s in stats], exactly_once=sorted(sum(everyone, [])) == sorted(sum(originals, [])),
                dtypes={k: str(v.dtype) for b in steps[0] for k, v in b.items() if isinstance(v, torch.Tensor)},
                ref_dtypes={k: str(v.dtype) for b in raw for k, v in b.items() if isinstance(v, torch.Tensor)})


def _cases(rank, world, cases):
    torch.set_num_threads(1)
    return [_case(rank, world, family, layout) for family, layout in cases]


CASES = [("text", "flash"), ("text", "positions"), ("text", "rows"), ("qwen2_vl", "flash"), ("qwen2_vl", "rows"),
         ("qwen2_5_vl", "positions"), ("qwen3_vl", "flash"), ("internvl", "flash")]


def test_packed_rows_balanced_across_ranks_train_exactly_as_unbalanced():
    results = run_ranks(_cases, 2, CASES, timeout=600)
    for c, (family, layout) in enumerate(CASES):
        flash = layout == "flash"
        r0, r1 = results[0][c], results[1][c]
        assert r0["hashes"] == r1["hashes"], family  # identical plans
        assert r0["moved"] > 0, family  # balancing really moved samples
        for r in (r0, r1):
            assert r["kind"] == (INPUT_CU_SEQ_LENS if flash else INPUT_POSITIONS), family
            assert max(r["rel"]) < 1e-5, (family, flash, r["rel"])
            assert r["exactly_once"], family
            # no row above the user's: the step's longest row (one row per micro-batch), or the longest row
            # the user's packing produced so far (several rows, filled in order)
            caps = r["longest"] if layout != "rows" else [max(r["longest"][:i + 1]) for i in range(len(r["longest"]))]
            assert all(w <= cap for w, cap in zip(r["widths"], caps)), (family, r["widths"], caps)
            if layout != "rows":
                assert r["rows"] == [1], r["rows"]
            for k, rk in zip(r["keys"], r["ref_keys"]):  # the user's layout: cu_seq_lens in, cu_seq_lens out
                assert set(k) - PIXEL_KEYS == set(rk) - PIXEL_KEYS, (family, k, rk)
                assert ("cu_seq_lens_q" in k) == flash
            assert all(r["ref_dtypes"][k] == d for k, d in r["dtypes"].items()), (family, r["dtypes"])


def test_a_micro_batch_of_another_kind_raises_naming_it():
    config = tiny_config("text")
    config.use_cache = False
    samples = [{"input_ids": torch.arange(1, 5), "labels": torch.tensor([IGNORE_INDEX, 2, 3, 4])}]
    packed = PackedInput(config)
    rows = packed.collator(samples)
    assert len(packed.samples_of(rows)) == 1 and packed.kind == INPUT_POSITIONS
    with pytest.raises(ValueError, match="micro-batch 7: is per-sample lists, the first micro-batch was packed rows"):
        packed.samples_of(samples, "micro-batch 7")
    empty = packed.collate([])  # an empty slot: a no-op row in the user's layout
    assert set(empty) == set(rows) and empty["input_ids"].shape == (1, 1)
