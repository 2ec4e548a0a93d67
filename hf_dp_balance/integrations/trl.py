"""TRL's `SFTTrainer` with `DPBalanceCallback` and `PackedCollator`: the settings it needs, set or checked.

`sft_config(**kwargs)` is TRL's `SFTConfig` with the settings balancing needs filled in; `sft_setup_problems`
names each one a run got wrong, and the callback raises with them at train begin (every rank alike, before
any collective). The settings no code can check are listed in docs/trl.md.
"""

from __future__ import annotations

from typing import Any, List

# What the balanced loader needs from TRL: the samples as the user made them (the collator packs them).
SFT_SETTINGS = {"remove_unused_columns": False, "dataset_kwargs": {"skip_prepare_dataset": True}}


def sft_config(**kwargs: Any):
    """`trl.SFTConfig(**kwargs)` with `remove_unused_columns=False` and `dataset_kwargs={"skip_prepare_dataset":
    True}` (other `dataset_kwargs` kept); an explicit opposite value raises ValueError naming it."""
    from trl import SFTConfig

    if kwargs.get("remove_unused_columns", False):
        raise ValueError("sft_config: remove_unused_columns=True drops the pixel keys the collator packs; leave it out")
    dataset_kwargs = dict(kwargs.get("dataset_kwargs") or {})
    if not dataset_kwargs.get("skip_prepare_dataset", True):
        raise ValueError("sft_config: dataset_kwargs['skip_prepare_dataset']=False re-tokenizes the samples; leave it out")
    dataset_kwargs["skip_prepare_dataset"] = True
    return SFTConfig(**{**kwargs, "remove_unused_columns": False, "dataset_kwargs": dataset_kwargs})


def is_sft_config(args: Any) -> bool:
    """Whether `args` is TRL's `SFTConfig` (or a subclass), without importing trl."""
    return any(c.__name__ == "SFTConfig" and c.__module__.startswith("trl") for c in type(args).__mro__)


def sft_setup_problems(args: Any, dataset: Any, model_config: Any) -> List[str]:
    """The settings an `SFTTrainer` run got wrong for balancing (empty when fine, or when `args` is not TRL's).

    `dataset`: the train dataloader's dataset (after Trainer removed unused columns); `model_config`: the
    model's config (a VLM has `vision_config`)."""
    if not is_sft_config(args):
        return []
    problems = []
    if not (getattr(args, "dataset_kwargs", None) or {}).get("skip_prepare_dataset", False):
        problems.append("dataset_kwargs={'skip_prepare_dataset': True}: without it TRL prepares the already "
                        "tokenized samples again (it truncates input_ids only, to max_length)")
    columns = getattr(dataset, "column_names", None)
    if getattr(args, "remove_unused_columns", False) and getattr(model_config, "vision_config", None) is not None:
        kept = f" (kept: {sorted(columns)})" if columns is not None else ""
        problems.append("remove_unused_columns=False: TRL keeps only input_ids, labels and seq_lengths, so the "
                        f"pixel_values / image_grid_thw / mm_token_type_ids the collator packs were dropped{kept}")
    fmt = getattr(dataset, "format", None)
    if isinstance(fmt, dict) and fmt.get("type") != "torch":
        problems.append(f"a torch-formatted dataset (dataset.with_format('torch'); it has format "
                        f"{fmt.get('type')!r}): the collator packs tensors")
    return problems


def check_sft_setup(args: Any, dataset: Any, model_config: Any) -> None:
    """Raise ValueError listing every `sft_setup_problems` entry (nothing for a stock Trainer)."""
    problems = sft_setup_problems(args, dataset, model_config)
    if problems:
        raise ValueError("hf_dp_balance with TRL's SFTTrainer needs (docs/trl.md; hf_dp_balance.integrations.trl."
                         "sft_config sets the first two): " + "; ".join(problems))


__all__ = ["SFT_SETTINGS", "check_sft_setup", "is_sft_config", "sft_config", "sft_setup_problems"]
