"""`PackedInput`: the thin layer before `BalancedLoader` for users whose collator builds the rows.

Each user micro-batch (a list of sample dicts; a dict of packed rows: position_ids restarting at 0
per sample, or flash-attention's cu_seq_lens; or padded rows with an attention_mask) becomes per-sample
dicts (`core.unpacking.split_packed`); each balanced slot goes back in the layout of the first micro-batch
(`core.unpacking.repack`): cu_seq_lens in, cu_seq_lens out; padded in, padded out (or one padding-free row
when the model's attention is varlen: `core.padded_rows.padded_output`); a collator's `pad_to_multiple_of`
is kept. The kind of input is read from the first micro-batch and logged once;
a later micro-batch of another kind, or one that cannot be split, raises naming step, rank, micro-batch,
row, sample and key. Use: `BalancedLoader(dataloader, config, model_config=cfg,
packed_input=PackedInput(cfg))`; rules and limits: docs/packing.md ("Layouts").
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from hf_dp_balance.core.packing import PackedCollator
from hf_dp_balance.core.padded_rows import padded_output
from hf_dp_balance.core.unpacking import INPUT_SAMPLES, PackedLayout, detect_input, layout_of, repack, split_packed
from hf_dp_balance.runtime.logs import get_logger

logger = get_logger(__name__)


class PackedInput:
    """Per-sample dicts out of the user's micro-batches, and the user's layout back for each slot.

    `model_config`: the model's config (family). `collate_fn`: the user's own collator, called on a
    micro-batch that arrives as a list (where an installer replaced the dataloader's collate by
    `list_collate`, as Trainer installation does), so that what is split is what the user's model
    would have received. `collator`: packs one row (default `PackedCollator(model_config)`; the token cap
    is the planner's). `multiple` / `pad_token_id`: the width alignment and pad id of the user's rows
    (default: the collator's `pad_to_multiple_of`, and its `pad_token_id` or its tokenizer's, else the
    model's). `max_tokens`: the hard cap (`DPBalanceConfig.max_tokens`; the loader sets it): a user's
    micro-batch whose samples hold more tokens raises, naming the cap and the row's width (the cap is per
    micro-batch slot, and no plan can keep such a micro-batch in place). After the first micro-batch: `kind` (one of core.unpacking's INPUT_*), `layout` (None for
    per-sample lists) and `pack_length` (the widest row seen on this rank).
    """

    def __init__(self, model_config: Any, *, collate_fn: Optional[Callable[[list], Any]] = None,
                 collator: Optional[PackedCollator] = None, multiple: Optional[int] = None,
                 pad_token_id: Optional[int] = None, max_tokens: Optional[int] = None):
        self.model_config = model_config
        self.max_tokens = max_tokens
        self.collate_fn = collate_fn
        self.collator = collator if collator is not None else PackedCollator(model_config)
        self.multiple = multiple if multiple is not None else getattr(collate_fn, "pad_to_multiple_of", None)
        if pad_token_id is None:
            pad_token_id = getattr(collate_fn, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(getattr(collate_fn, "tokenizer", None), "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if pad_token_id is not None else self.collator.pad_token_id
        self.kind: Optional[str] = None
        self.layout: Optional[PackedLayout] = None
        self.pack_length = 0

    def samples_of(self, micro_batch: Any, where: str = "micro-batch") -> List[dict]:
        """The micro-batch's samples, in order (a list passes through); ValueError prefixed by `where`."""
        try:
            if self.collate_fn is not None and isinstance(micro_batch, (list, tuple)):
                micro_batch = self.collate_fn(list(micro_batch))
            kind = detect_input(micro_batch)
            if self.kind is None:
                self._first(kind, micro_batch)
            elif kind != self.kind:
                raise ValueError(f"is {kind}, the first micro-batch was {self.kind}")
            if kind == INPUT_SAMPLES:
                return list(micro_batch)
            self.pack_length = max(self.pack_length, int(micro_batch["input_ids"].shape[1]))
            samples = split_packed(micro_batch, self.model_config, multiple=self.multiple, pad_token_id=self.pad_token_id)
            self._check_cap(micro_batch, samples)
            return samples
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc

    def _check_cap(self, micro_batch: Any, samples: List[dict]) -> None:
        if self.max_tokens is None:
            return
        tokens = sum(int(s["input_ids"].numel()) for s in samples)
        if tokens > self.max_tokens:
            rows, width = (int(n) for n in micro_batch["input_ids"].shape)
            raise ValueError(f"key 'input_ids': the collator's rows are {width} tokens wide ({rows} row(s), "
                             f"{len(samples)} samples of {tokens} tokens), above the hard cap max_tokens="
                             f"{self.max_tokens} per micro-batch: set max_tokens to at least {tokens} (or leave it "
                             f"unset: the cap is then the step's longest micro-batch), or have the collator put "
                             f"at most {self.max_tokens} tokens in a micro-batch")

    def _first(self, kind: str, micro_batch: Any) -> None:
        self.kind = kind
        if kind == INPUT_SAMPLES:
            logger.info("hf_dp_balance: input: %s (packed with PackedCollator)", kind)
            return
        self.layout = layout_of(micro_batch, self.multiple, padded_output(self.model_config))
        back = ("one sample per row, padded as given" if self.layout.output == "padded" else
                "one padding-free row per micro-batch (varlen attention: the same loss, no pad FLOPs)") \
            if self.layout.side else "in this layout, at most the step's longest row each"
        logger.info("hf_dp_balance: input: %s (%d row(s) of %d tokens per micro-batch, keys %s%s); balanced rows "
                    "go back %s", kind, self.layout.rows, self.layout.width, list(self.layout.keys),
                    f", widths a multiple of {self.multiple}" if self.multiple else "", back)

    def puller(self, pull: Callable[[], Optional[Any]], step: int, rank: int) -> Callable[[], Optional[List[dict]]]:
        """`pull` (next raw micro-batch or None) turned into one that yields each micro-batch's samples."""
        count = [0]

        def pull_samples():
            micro_batch = pull()
            if micro_batch is None:
                return None
            where = f"step {step}, rank {rank}, micro-batch {count[0]}"
            count[0] += 1
            return self.samples_of(micro_batch, where)

        return pull_samples

    def collate(self, samples: List[dict]) -> Any:
        """One balanced slot in the user's layout (`PackedCollator`'s row for per-sample lists)."""
        if self.layout is None:
            return self.collator(samples)
        longest = max((int(s["input_ids"].numel()) for s in samples), default=0)
        return repack(samples, self.layout, self.collator, self.pad_token_id,
                      capacity=max(self.pack_length, longest))


def packed_input_for(mode: str, collate_fn: Any, model_config: Any) -> Optional[PackedInput]:
    """`PackedInput` over the user's collator when the rows it yields are packed, else None (per-sample).

    One rule for every front end (the Trainer callback and `DPBalancer.prepare`). `mode` is
    `DPBalanceConfig.input`; `auto` takes the rows as packed when the collator is the user's own: not our
    `PackedCollator` (the library packs), not our `list_collate`, and not a padding or stacking default
    (transformers' `default_data_collator` / `DataCollatorWithPadding`, torch's `default_collate` /
    `default_convert`), whose rows have no sample boundaries to split at. `packed` always splits.
    """
    if mode == "samples" or collate_fn is None or model_config is None:
        return None
    if mode == "auto" and _is_library_or_default_collate(collate_fn):
        return None
    return PackedInput(model_config, collate_fn=collate_fn)


def _is_library_or_default_collate(collate_fn: Any) -> bool:
    from torch.utils.data import default_collate, default_convert
    from transformers.data.data_collator import DataCollatorWithPadding, default_data_collator

    from hf_dp_balance.runtime.step_rows import list_collate

    if isinstance(collate_fn, (PackedCollator, DataCollatorWithPadding)):
        return True
    return any(collate_fn is f for f in (default_data_collator, default_collate, default_convert, list_collate))
