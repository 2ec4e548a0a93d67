"""The collators of users who already pack, for the packed-input tests (core, runtime, integrations)."""

import torch

from hf_dp_balance.core.families import IGNORE_INDEX
from hf_dp_balance.core.packing import PackedCollator


def double(samples):
    return [{k: (v.double() if v.is_floating_point() else v) for k, v in s.items()} for s in samples]


def with_cu_seq_lens(batch):
    """A small hand-written collator's extra: flash-attention's varlen kwargs next to the positions."""
    plain = batch["position_ids"][0] if batch["position_ids"].ndim == 3 else batch["position_ids"]
    starts = torch.nonzero(plain.reshape(-1) == 0).flatten().tolist() + [plain.numel()]
    cu = torch.tensor(starts, dtype=torch.int32)
    longest = max(b - a for a, b in zip(starts, starts[1:]))
    return dict(batch, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)


def pad_to(row, width):
    """Fixed-width packing by hand: fill the row to `width` with a pad segment that trains nothing."""
    pad = width - row["input_ids"].shape[1]
    out = dict(row, input_ids=torch.cat([row["input_ids"], torch.zeros(1, pad, dtype=torch.long)], 1),
               labels=torch.cat([row["labels"], torch.full((1, pad), IGNORE_INDEX)], 1))
    if "mm_token_type_ids" in row:
        out["mm_token_type_ids"] = torch.cat([row["mm_token_type_ids"], torch.zeros(1, pad, dtype=torch.long)], 1)
    pos = row["position_ids"]
    out["position_ids"] = torch.cat([pos, torch.arange(pad).expand(*pos.shape[:-1], pad)], -1)
    return out


PADDING_LAYOUTS = ("lm_padded", "seq2seq_left", "trl_aligned")


def padding_collator(layout: str, multiple: int = 64):
    """A text collator users already have, taking python-list samples: transformers'
    `DataCollatorForLanguageModeling(mlm=False)` (right padding, "lm_padded"), `DataCollatorForSeq2Seq` with
    a left-padding tokenizer ("seq2seq_left"), both with `pad_to_multiple_of=multiple`, or TRL's padding-free
    collator aligned to `multiple` ("trl_aligned")."""
    from hf_dp_balance.testing.models import build_tokenizer

    tok = build_tokenizer("text")
    if layout == "lm_padded":
        from transformers import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(tok, mlm=False, pad_to_multiple_of=multiple)
    if layout == "seq2seq_left":
        from transformers import DataCollatorForSeq2Seq

        tok.padding_side = "left"
        return DataCollatorForSeq2Seq(tok, pad_to_multiple_of=multiple)
    if layout == "trl_aligned":
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        return DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=True,
                                               pad_to_multiple_of=multiple)
    raise ValueError(f"layout {layout!r}: expected one of {PADDING_LAYOUTS}")


class UserCollator:
    """What a user who packs already has: transformers' flattening collator (text) or PackedCollator (VLMs)
    for `layout` "positions"; plus cu_seq_lens written by hand ("flash"); or two rows per micro-batch, the
    first sample in row 0, the others in row 1, padded to one width ("rows"); or one of `PADDING_LAYOUTS`
    (text), its `pad_to_multiple_of` readable as the user's collator's. Float features become float64."""

    def __init__(self, config, family, layout):
        from transformers import DataCollatorWithFlattening

        self.layout, self.text = layout, family == "text"
        if layout in PADDING_LAYOUTS:
            self.pack = padding_collator(layout)
            self.pad_to_multiple_of = self.pack.pad_to_multiple_of
            tok = getattr(self.pack, "tokenizer", None)
            self.pad_token_id = tok.pad_token_id if tok is not None else self.pack.pad_token_id
            return
        flash = layout == "flash"
        self.pack = DataCollatorWithFlattening(return_flash_attn_kwargs=flash) if self.text else PackedCollator(config)

    def __call__(self, samples):
        if self.layout in PADDING_LAYOUTS:
            keep = ("input_ids",) if self.layout == "lm_padded" else ("input_ids", "labels")  # LM: labels = inputs
            return self.pack([{k: s[k].tolist() for k in keep} for s in samples])
        samples = double(samples)
        if self.layout == "rows":
            a, b = self.pack(samples[:1]), self.pack(samples[1:])
            width = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
            a, b = pad_to(a, width), pad_to(b, width)
            dims = {"position_ids": a["position_ids"].ndim - 2}
            return {k: torch.cat([r[k] for r in (a, b) if k in r], dims.get(k, 0)) for k in {**a, **b}}
        batch = self.pack(samples)
        return with_cu_seq_lens(batch) if self.layout == "flash" and not self.text else batch
