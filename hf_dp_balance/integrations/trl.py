"""TRL's `SFTTrainer` with `DPBalanceCallback`: TRL's own preparation and collator, or `PackedCollator`.

Two ways, both balanced by the callback (docs/trl.md):

- TRL's collator (`data_collator` left unset): TRL prepares the dataset (raw text or pre-tokenized, python
  or torch format; `packing=True` packs it), its collator builds the rows (padded, `padding_free=True`, or
  TRL's packed rows), and the input stage splits them into sequences, balances and puts them back in TRL's
  layout (`runtime.packed_input`). Nothing to set or check.
- `PackedCollator` (VLM samples the user tokenized): the collator packs per-sample tensors itself, so the
  samples must reach it as the user made them. `sft_setup_problems` names each setting of such a run that
  would break that, with the reason for that run; the callback raises with them at train begin (every rank
  alike, before any collective).

`sft_config(**kwargs)` is TRL's `SFTConfig` with `remove_unused_columns=False` (TRL's column removal keeps only
input_ids / labels / seq_lengths, dropping the pixels `PackedCollator` packs; TRL's own collator ignores the
extra columns). It leaves TRL's dataset preparation on (TRL's own collator needs it: raw text, packing); a
`PackedCollator` VLM run adds `dataset_kwargs={"skip_prepare_dataset": True}` (the check says why).
"""

from __future__ import annotations

from typing import Any, List

# What `sft_config` sets: the one setting a PackedCollator VLM run needs and TRL's own collator does not mind.
SFT_SETTINGS = {"remove_unused_columns": False}


def sft_config(**kwargs: Any):
    """`trl.SFTConfig(**kwargs)` with `remove_unused_columns=False`; an explicit True raises ValueError."""
    from trl import SFTConfig

    if kwargs.get("remove_unused_columns", False):
        raise ValueError("sft_config: remove_unused_columns=True drops the pixel keys PackedCollator packs; leave it out")
    return SFTConfig(**{**kwargs, "remove_unused_columns": False})


def is_sft_config(args: Any) -> bool:
    """Whether `args` is TRL's `SFTConfig` (or a subclass), without importing trl."""
    return any(c.__name__ == "SFTConfig" and c.__module__.startswith("trl") for c in type(args).__mro__)


def _library_packs(collator: Any) -> bool:
    from hf_dp_balance.core.packing import PackedCollator

    return isinstance(collator, PackedCollator)


def sft_setup_problems(args: Any, dataset: Any, model_config: Any, collator: Any = None) -> List[str]:
    """The settings of an `SFTTrainer` run whose `collator` is `PackedCollator` that break balancing (empty
    when fine, for TRL's own collator, or when `args` is not TRL's).

    `dataset`: the train dataloader's dataset (after TRL prepared it and Trainer removed unused columns);
    `model_config`: the model's config (a VLM has `vision_config`)."""
    if not is_sft_config(args) or not _library_packs(collator):
        return []
    problems = []
    prepared = not (getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset", False)
    vlm = getattr(model_config, "vision_config", None) is not None
    if prepared and getattr(args, "packing", False):
        problems.append("packing=True with data_collator=PackedCollator: TRL packs the samples into rows that "
                        "PackedCollator would pack as one sample, so they would attend to each other; leave "
                        "data_collator unset (TRL's collator: its packed rows are split, balanced and packed back) "
                        "or set packing=False")
    if prepared and vlm and getattr(args, "max_length", None) is not None:
        problems.append(f"dataset_kwargs={{'skip_prepare_dataset': True}}: TRL's preparation truncates input_ids "
                        f"and labels to max_length={args.max_length}, not mm_token_type_ids / pixel_values / "
                        f"image_grid_thw, so a longer sample no longer matches its images")
    columns = getattr(dataset, "column_names", None)
    if vlm and getattr(args, "remove_unused_columns", False):
        kept = f" (kept: {sorted(columns)})" if columns is not None else ""
        problems.append("remove_unused_columns=False: TRL keeps only input_ids, labels and seq_lengths, so the "
                        f"pixel_values / image_grid_thw / mm_token_type_ids PackedCollator packs were dropped{kept}")
    fmt = getattr(dataset, "format", None)
    if isinstance(fmt, dict) and fmt.get("type") != "torch":
        problems.append(f"a torch-formatted dataset (dataset.with_format('torch'); it has format "
                        f"{fmt.get('type')!r}): PackedCollator packs tensors (TRL's own collator takes lists)")
    return problems


def check_sft_setup(args: Any, dataset: Any, model_config: Any, collator: Any = None) -> None:
    """Raise ValueError listing every `sft_setup_problems` entry (nothing for a stock Trainer)."""
    problems = sft_setup_problems(args, dataset, model_config, collator)
    if problems:
        raise ValueError("hf_dp_balance with TRL's SFTTrainer and PackedCollator needs (docs/trl.md): "
                         + "; ".join(problems))


__all__ = ["SFT_SETTINGS", "check_sft_setup", "is_sft_config", "sft_config", "sft_setup_problems"]
