"""Loss normalisation is part of balancing's contract: known at train begin, for every front end.

Balancing moves samples between ranks. The update is unchanged only when each token's loss is divided by
a count that moving samples does not change: the step's global target count (Trainer's `num_items_in_batch`
with `average_tokens_across_devices=True`; `batch["num_items_in_batch"]` in a `DPBalancer` loop). A per-rank
mean (each rank divides by its own targets) weights a sample by 1 / the targets of the rank it lands on, so
moving it changes the gradient. No weighting can undo that without model code, so such a run is refused
naming the setting, unless `DPBalanceConfig.allow_per_rank_loss_mean` opts in; then it trains with the
other weighting and says so once.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

from hf_dp_balance.runtime.logs import get_logger

logger = get_logger(__name__)

GLOBAL_TOKEN_MEAN = "the step's global token mean"
PER_RANK_MEAN = "a per-rank mean"
LOOP_DEFINED = "what the loop computes"


@dataclass(frozen=True)
class LossNormalisation:
    """How a run divides its loss: `kind` (GLOBAL_TOKEN_MEAN, PER_RANK_MEAN or LOOP_DEFINED) and `why` (the
    settings that make it so, named as the user sets them)."""

    kind: str
    why: str


def trainer_normalisation(average_tokens_across_devices: bool, model_accepts_loss_kwargs: bool,
                          has_compute_loss_func: bool) -> LossNormalisation:
    """Trainer's rule (transformers 5.x `compute_loss`): the loss is scaled to the step's global token mean
    only with `average_tokens_across_devices` and a model (or `compute_loss_func`) that takes
    `num_items_in_batch`; else each rank's loss is its own mean."""
    if not average_tokens_across_devices:
        return LossNormalisation(PER_RANK_MEAN, "average_tokens_across_devices=False: each rank's loss is divided "
                                                "by its own target tokens")
    if not (model_accepts_loss_kwargs or has_compute_loss_func):
        return LossNormalisation(PER_RANK_MEAN, "the model's forward takes no num_items_in_batch (no loss kwargs) "
                                                "and there is no compute_loss_func: each rank's loss is its own mean")
    return LossNormalisation(GLOBAL_TOKEN_MEAN, "average_tokens_across_devices=True with num_items_in_batch")


def loop_normalisation(forward: Any) -> LossNormalisation:
    """A custom loop's `model(**batch).loss`: the global mean when the model's forward takes the batch's
    `num_items_in_batch` (transformers models pass it to their loss), else what the loop computes."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        params = ()
    takes = any(p.name == "num_items_in_batch" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    if takes:
        return LossNormalisation(GLOBAL_TOKEN_MEAN, "model(**batch) passes batch['num_items_in_batch'] to the loss")
    return LossNormalisation(LOOP_DEFINED, "the model's forward takes no num_items_in_batch")


def verdict(norm: LossNormalisation, data_parallel_size: int, allow_per_rank: bool) -> Optional[str]:
    """None when balancing keeps the update; else the line to say once (opted in, or a loop's own loss).
    Raises ValueError naming the setting for a per-rank mean without the opt-in. `data_parallel_size`: the
    ranks samples may move between (tp / cp / sp peers of a mesh are not more of them); one: nothing moves."""
    if data_parallel_size <= 1 or norm.kind == GLOBAL_TOKEN_MEAN:
        return None
    if norm.kind == LOOP_DEFINED:
        return (f"dp_balance: {norm.why}; the update equals the unbalanced one only if the loop divides the summed "
                f"token losses by batch['num_items_in_batch'] (the step's target tokens over all ranks), not by "
                f"this rank's own count")
    if not allow_per_rank:
        raise ValueError(f"hf_dp_balance: the loss is {PER_RANK_MEAN} ({norm.why}), so moving samples between "
                         f"ranks changes the update. Set average_tokens_across_devices=True (the default; the "
                         f"loss is then the step's global token mean and balancing is exact), or opt in to "
                         f"training with the balanced ranks' own means: DPBalanceConfig(allow_per_rank_loss_mean="
                         f"True) / --dp_balance_allow_per_rank_loss_mean / HF_DP_BALANCE_ALLOW_PER_RANK_LOSS_MEAN=1")
    return (f"dp_balance: allow_per_rank_loss_mean: the loss is {PER_RANK_MEAN} ({norm.why}); balanced, each sample "
            f"is weighted by 1 / the targets of the rank it is trained on, so the update differs from the "
            f"unbalanced run's")


def check_trainer_loss(args: Any, trainer: Any, config: Any, data_parallel_size: int) -> None:
    """At the callback's train begin (every rank alike, before any collective): refuse or say once.
    `trainer`: the Trainer (None: its defaults); `data_parallel_size`: the size of the data-parallel group
    (under a device mesh smaller than the world's)."""
    norm = trainer_normalisation(bool(getattr(args, "average_tokens_across_devices", True)),
                                 bool(getattr(trainer, "model_accepts_loss_kwargs", True)),
                                 getattr(trainer, "compute_loss_func", None) is not None)
    line = verdict(norm, data_parallel_size, bool(getattr(config, "allow_per_rank_loss_mean", False)))
    if line:
        logger.warning(line)


def check_loop_loss(model: Any, config: Any, data_parallel_size: int) -> None:
    """At `DPBalancer`'s construction: refuse or say once (see `loop_normalisation`); `data_parallel_size` as
    in `check_trainer_loss`."""
    inner = getattr(model, "module", model)
    if inner is None:
        return
    line = verdict(loop_normalisation(inner.forward), data_parallel_size,
                   bool(getattr(config, "allow_per_rank_loss_mean", False)))
    if line:
        logger.warning(line)


__all__ = ["GLOBAL_TOKEN_MEAN", "LOOP_DEFINED", "LossNormalisation", "PER_RANK_MEAN", "check_loop_loss",
           "check_trainer_loss", "loop_normalisation", "trainer_normalisation", "verdict"]
