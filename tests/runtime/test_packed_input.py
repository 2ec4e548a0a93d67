"""BalancedLoader over the packed rows users already have: real gloo ranks, real tiny models (float64)."""

import pytest
import torch

from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.core.unpacking import INPUT_CU_SEQ_LENS, INPUT_POSITIONS, split_packed
from hf_dp_balance.runtime.packed_input import PackedInput
from hf_dp_balance.testing.models import tiny_config
from hf_dp_balance.testing.spawn import run_ranks
from hf_dp_balance.testing.packed_users import UserCollator

GA, BATCH, STEPS = 2, 3, 2
PIXEL_KEYS = {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"}


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
    from hf_dp_balance.testing.data import build_synthetic_dataset, to_sample
    from hf_dp_balance.testing.models import make_model

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


def test_packed_input_for_tells_the_users_packing_from_the_defaults():
    """One rule for Trainer and DPBalancer: only a collator of the user's own is taken as packing."""
    from torch.utils.data import default_collate, default_convert
    from transformers.data.data_collator import default_data_collator

    from hf_dp_balance.core.packing import PackedCollator
    from hf_dp_balance.runtime.packed_input import PackedInput, packed_input_for
    from hf_dp_balance.runtime.step_rows import list_collate
    from hf_dp_balance.testing.models import tiny_config

    config = tiny_config("text")

    def users_own(batch):
        return batch

    for default in (default_collate, default_convert, default_data_collator, list_collate, PackedCollator(config)):
        assert packed_input_for("auto", default, config) is None, default
        assert isinstance(packed_input_for("packed", default, config), PackedInput)  # the user said so
    found = packed_input_for("auto", users_own, config)
    assert isinstance(found, PackedInput) and found.collate_fn is users_own
    assert packed_input_for("samples", users_own, config) is None
    assert packed_input_for("auto", users_own, None) is None  # no model config: nothing to pack with


def test_the_users_padding_collator_is_taken_with_its_alignment_and_pad_and_bad_rows_name_the_setting():
    from transformers import DataCollatorForLanguageModeling

    from hf_dp_balance.core.unpacking import INPUT_PADDED
    from hf_dp_balance.runtime.packed_input import packed_input_for
    from hf_dp_balance.testing.models import build_tokenizer

    config = tiny_config("text")
    config.use_cache = False
    tok = build_tokenizer("text")
    user = DataCollatorForLanguageModeling(tok, mlm=False, pad_to_multiple_of=64)
    packed = packed_input_for("auto", user, config)
    assert isinstance(packed, PackedInput) and packed.multiple == 64 and packed.pad_token_id == tok.pad_token_id
    rows = [{"input_ids": list(range(11, 11 + n))} for n in (5, 70, 9)]
    samples = packed.samples_of(rows, "step 1, rank 0, micro-batch 0")
    assert packed.kind == INPUT_PADDED and [len(s["input_ids"]) for s in samples] == [5, 70, 9]
    back = packed.collate(samples[:1] + samples[2:])
    assert back["input_ids"].shape == (2, 64) and set(back) == {"input_ids", "labels", "attention_mask"}
    packed.max_tokens = 80  # the loader's hard cap: this micro-batch holds 84 tokens
    with pytest.raises(ValueError, match=r"micro-batch 1: .*128 tokens wide \(3 row\(s\), 3 samples of 84 tokens\), "
                                         r"above the hard cap max_tokens=80"):
        packed.samples_of(rows, "step 1, rank 0, micro-batch 1")
    bare = PackedInput(config, collate_fn=lambda s: {"input_ids": torch.ones(2, 4, dtype=torch.long),
                                                     "labels": torch.ones(2, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"step 2, rank 1, micro-batch 0: micro-batch: a dict of rows .* input='samples'"):
        bare.samples_of([{}], "step 2, rank 1, micro-batch 0")
