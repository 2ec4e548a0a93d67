"""`dp_balance_*` fields for `TrainingArguments`: balancing options on the command line.

`DPBalanceArguments` is written out field by field (as TRL's `SFTConfig` is), each with its help
text; a test checks that it matches `DPBalanceConfig` field for field (names, types, defaults).
`enabled` becomes `dp_balance`, every other field `<name>` becomes `dp_balance_<name>`.
`DPBalanceTrainingArguments` inherits from both `TrainingArguments` and `DPBalanceArguments`, so one
`HfArgumentParser(DPBalanceTrainingArguments)` gives `--dp_balance_warmup_steps 8`, ... next to
Trainer's own options. `to_dp_balance_config()` builds the `DPBalanceConfig`, with every
`HF_DP_BALANCE_<FIELD>` environment variable applied on top.

`dp_balance` defaults to True, as `DPBalanceConfig.enabled` does: what balances is the callback, and a
user who adds `DPBalanceCallback()` wants it; `--dp_balance False` (or `--no_dp_balance`) turns it
off for a run without editing the script (docs/usage.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional

from transformers import TrainingArguments

from hf_dp_balance.config import FATAL_CHOICES, DPBalanceConfig
from hf_dp_balance.core.choices import FIT_MODES, INPUT_CHOICES, SYNC_CHOICES, TIMING_CHOICES

ARG_PREFIX = "dp_balance"


def argument_name(config_field: str) -> str:
    """`enabled` -> `dp_balance`; any other config field `x` -> `dp_balance_x`."""
    return ARG_PREFIX if config_field == "enabled" else f"{ARG_PREFIX}_{config_field}"


def _help(text: str, config_field: str, choices=None) -> dict:
    """Field metadata: the help text, naming the config field and its environment variable (and choices)."""
    env = f"HF_DP_BALANCE_{config_field.upper()}"
    meta = {"help": f"{text} (config field `{config_field}`; environment {env} overrides)"}
    if choices is not None:
        meta["choices"] = list(choices)
    return meta


@dataclass
class DPBalanceArguments:
    """Data-parallel compute balancing options (`--dp_balance ...`); mirrors `DPBalanceConfig`."""

    dp_balance: bool = field(default=True, metadata=_help(
        "Balance the decoder's compute across data-parallel ranks; --dp_balance False turns the callback off",
        "enabled"))
    dp_balance_vision: bool = field(default=False, metadata=_help(
        "Also balance the vision encoder: images move to other ranks for the ViT, their embeddings come back",
        "vision"))
    dp_balance_warmup_steps: Optional[int] = field(default=None, metadata=_help(
        "Optimizer steps timed before the cost model is fitted (default: 5 with per-rank timings; with step "
        "times only, i.e. ZeRO-3 or FSDP without visible units on accelerators, 16 steps at 1-2 micro-batches, "
        "11 at 3, 8 from 4, then one refit a warm-up later)", "warmup_steps"))
    dp_balance_max_token_ratio: float = field(default=1.2, metadata=_help(
        "Hard token cap of each rank's micro-batch slot, as a multiple of the mean tokens per slot",
        "max_token_ratio"))
    dp_balance_max_tokens: Optional[int] = field(default=None, metadata=_help(
        "Absolute token cap per micro-batch slot (memory); overrides the ratio when set", "max_tokens"))
    dp_balance_min_gain: float = field(default=0.02, metadata=_help(
        "Skip a step's plan when it cuts the slowest rank by less than this fraction", "min_gain"))
    dp_balance_move_tolerance: float = field(default=0.005, metadata=_help(
        "Among plans within this relative distance of the best makespan, take the one moving fewest samples",
        "move_tolerance"))
    dp_balance_sync: str = field(default="auto", metadata=_help(
        "Where ranks meet: step (DDP, once per optimizer step), micro_batch (FSDP / ZeRO-3), or auto from the Trainer",
        "sync", SYNC_CHOICES))
    dp_balance_max_partners: int = field(default=64, metadata=_help(
        "Partners per rank for the whole run: each data-parallel rank trades samples with at most this many "
        "fixed peers; 0 = unbounded (changes nothing below 66 data-parallel ranks)", "max_partners"))
    dp_balance_ranks_per_node: int = field(default=1, metadata=_help(
        "Consecutive data-parallel ranks that share a node: always partners of each other (GPUs per node / "
        "(tp x cp))", "ranks_per_node"))
    dp_balance_refit_every: int = field(default=100, metadata=_help(
        "Refit the cost model every N optimizer steps after the first fit, on the latest 64 steps (0: never)",
        "refit_every"))
    dp_balance_fit_mode: str = field(default="auto", metadata=_help(
        "How to fit: per_rank (clean per-rank compute times), step_max (the slowest rank of each step), "
        "or auto (follows the timing clock)", "fit_mode", FIT_MODES))
    dp_balance_timing: str = field(default="auto", metadata=_help(
        "Clock of each rank's step and its vision tower: thread_cpu (CPU time of the main thread), wall "
        "(synchronised wall time, accelerators), forward_events (forward passes on device events, x3), "
        "unit_events (under FSDP: the forward spans of its sharded units, after their all-gathers, x3), or auto "
        "(thread_cpu on CPU; on accelerators forward_events under DDP, unit_events under FSDP, wall under "
        "ZeRO-3)", "timing",
        TIMING_CHOICES))
    dp_balance_prior: bool = field(default=True, metadata=_help(
        "Plan from step 1 with the model config's FLOP prior until the fit lands, and fit around it", "prior"))
    dp_balance_estimate_speeds: bool = field(default=True, metadata=_help(
        "Estimate per-rank speeds from the fit's residuals and plan with them", "estimate_speeds"))
    dp_balance_timeout_s: float = field(default=600.0, metadata=_help(
        "Seconds before a collective of the side group fails: a dead rank raises, never hangs", "timeout_s"))
    dp_balance_prefetch_steps: int = field(default=2, metadata=_help(
        "Optimizer steps planned and exchanged ahead by the background thread", "prefetch_steps"))
    dp_balance_lookahead_steps: int = field(default=0, metadata=_help(
        "Plan outlier samples over a window of this many upcoming steps (0: off); reorders data within it",
        "lookahead_steps"))
    dp_balance_cost_model_path: Optional[str] = field(default=None, metadata=_help(
        "JSON of a fitted cost model to start from; skips the warm-up fit", "cost_model_path"))
    dp_balance_verbose: bool = field(default=False, metadata=_help(
        "Log a line per step on rank 0 besides the periodic dp_balance/* metrics", "verbose"))
    dp_balance_input: str = field(default="auto", metadata=_help(
        "What the dataloader yields: samples (per-sample dicts, packed by the library) or packed (rows your "
        "collator packed: split, rebalanced, packed back in your layout); auto: packed when the Trainer's data "
        "collator is your own", "input", INPUT_CHOICES))
    dp_balance_watchdog: bool = field(default=True, metadata=_help(
        "Run heartbeat rounds beside training: a peer that stops answering within timeout_s ends the run with a "
        "message naming step, rank and phase", "watchdog"))
    dp_balance_heartbeat_s: float = field(default=1.0, metadata=_help(
        "Seconds between two heartbeat rounds of the watchdog", "heartbeat_s"))
    dp_balance_error_grace_s: float = field(default=3.0, metadata=_help(
        "Seconds the watchdog waits after a failed round for the main thread to raise the error itself",
        "error_grace_s"))
    dp_balance_on_fatal: str = field(default="exit", metadata=_help(
        "What the watchdog does when a peer is gone: exit (end the process, exit code 1) or raise (the main "
        "thread raises the error at its next step)", "on_fatal", FATAL_CHOICES))
    dp_balance_allow_per_rank_loss_mean: bool = field(default=False, metadata=_help(
        "Balance although each rank's loss is its own mean (average_tokens_across_devices=False): the update "
        "then differs from the unbalanced run's (said once); off: such a run is refused", "allow_per_rank_loss_mean"))
    dp_balance_metrics_every: int = field(default=10, metadata=_help(
        "DPBalancer: optimizer steps between two measurements of the ranks' compute (a collective inside the "
        "step), so that metrics() stays local; 0: never (Trainer measures at its logging steps)", "metrics_every"))

    def __post_init__(self) -> None:
        # Fail at parse time, not at the first training step.
        config_from_arguments(self, environ={})

    def to_dp_balance_config(self, environ: Optional[Mapping[str, str]] = None) -> DPBalanceConfig:
        """The `DPBalanceConfig` these arguments describe, `HF_DP_BALANCE_*` environment variables applied on top."""
        return config_from_arguments(self, environ)


def config_from_arguments(args, environ: Optional[Mapping[str, str]] = None) -> DPBalanceConfig:
    """`DPBalanceConfig` from any object carrying `dp_balance_*` attributes, environment applied on top.

    Missing attributes keep the config default; an invalid value raises `ValueError`
    naming the field (from `DPBalanceConfig`'s own checks).
    """
    values = {}
    for f in dataclasses.fields(DPBalanceConfig):
        name = argument_name(f.name)
        if hasattr(args, name):
            values[f.name] = getattr(args, name)
    try:
        base = DPBalanceConfig(**values)
    except ValueError as exc:
        raise ValueError(f"invalid --dp_balance arguments: {exc}") from None
    return DPBalanceConfig.from_env(base, environ)


@dataclasses.dataclass
class DPBalanceTrainingArguments(TrainingArguments, DPBalanceArguments):
    """`TrainingArguments` plus the `dp_balance_*` options; use with `HfArgumentParser` and `DPBalanceCallback`."""

    def __post_init__(self):
        TrainingArguments.__post_init__(self)
        DPBalanceArguments.__post_init__(self)


__all__ = ["DPBalanceArguments", "DPBalanceTrainingArguments", "argument_name", "config_from_arguments"]
