"""One configuration object for the whole library.

`DPBalanceConfig` is what every module reads. It is built from, in order of
precedence: `HF_DP_BALANCE_*` environment variables (they pass through
`accelerate launch` / `torchrun`, whose config files reject unknown keys), then
explicit arguments (`DPBalanceArguments` fields on TrainingArguments, or the
constructor), then the defaults below.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, fields
from typing import Mapping, Optional

from hf_dp_balance.core.choices import FIT_MODES, INPUT_CHOICES, SYNC_CHOICES, TIMING_CHOICES

ENV_PREFIX = "HF_DP_BALANCE_"
# What the watchdog does when a peer is gone: end the process, or raise in the main thread at its next step.
FATAL_CHOICES = ("exit", "raise")


@dataclass(frozen=True)
class DPBalanceConfig:
    """Settings of data-parallel compute balancing.

    Immutable: derive a changed copy with `config.replace(...)`.
    """

    enabled: bool = True
    """Balance the decoder's compute across data-parallel ranks."""

    vision: bool = False
    """Also balance the vision encoder (images move for the ViT, embeddings come back)."""

    warmup_steps: Optional[int] = None
    """Optimizer steps timed before the cost model is fitted. None (default): 5 where each rank's compute is
    timed (`fit_mode="per_rank"`: CPU, DDP, ZeRO-1/2, FSDP with `unit_events`), 16 where only step times are
    (`step_max`: ZeRO-3, and FSDP without visible units, on accelerators), because from fewer step maxima the
    cost's shape is mostly the prior's. Under FSDP / ZeRO-3 every micro-batch's maximum is an observation of its
    own, so with M micro-batches a step the step-time fit waits for 32 of them, between 8 and 16 steps: 16 at
    M = 1-2, 11 at M = 3, 8 from M = 4 (the count is read from the first timed step). Every fit is gated on
    held-out steps (a fit replaces the model in force only when it predicts steps it was not fitted on better:
    docs/cost_model.md), and refitted early at 2x, 4x ... the warm-up until the held-out error settles (a
    rejected or failed fit is retried there), then every `refit_every`. A new model plans from the first step
    the loader thread cannot have prepared when it lands, a step every process agrees on: with `prior` (the
    default: the steps before are planned with the model's FLOP prior) that is warmup_steps + prefetch_steps
    + 2 (+ lookahead_steps - 1), without a prior warmup_steps + 2 (until a model is set the loader prepares one
    step ahead only). Refits follow the same rule."""

    max_token_ratio: float = 1.2
    """Hard per-rank (per micro-batch slot) token cap, as a multiple of the mean tokens per slot."""

    max_tokens: Optional[int] = None
    """Absolute hard token cap per slot (memory); overrides `max_token_ratio` when set."""

    min_gain: float = 0.02
    """Skip a step's plan when it would cut the slowest rank by less than this (relative)."""

    move_tolerance: float = 0.005
    """Among plans within this relative distance of the best makespan, prefer fewer moves."""

    sync: str = "auto"
    """`step` (DDP: ranks meet once per optimizer step), `micro_batch` (FSDP / ZeRO-3), or `auto`."""

    max_partners: int = 64
    """Partners per rank for the whole run: each data-parallel rank sends samples to and receives them from at
    most this many fixed peers (`core.partners.partner_sets`), so connections made on first use stay few.
    0: unbounded (the planner picks any peer each step). The default changes nothing below 66 data-parallel
    ranks; what it costs in balance, tokens sent and CPU at 512 and 4,096 ranks: docs/benchmarks/partners.md."""

    ranks_per_node: int = 1
    """Consecutive data-parallel ranks that share a node: they are always partners of each other (their
    transfers use the node's links). Set it to the GPUs per node / (tp x cp); must not exceed `max_partners`."""

    refit_every: int = 100
    """Refit the cost model every N optimizer steps once its held-out error has settled (before that: early refits
    at 2x, 4x ... `warmup_steps`, never later than N steps apart), on the most recent 64 steps (0: never, except
    to retry a first fit that was rejected or failed).
    Keeps up with drift (clocks, kernels warming up, the data mix changing); costs one gather and, on rank 0,
    the fit and one per held-out fold of the gate (up to five fits) that every rank waits for."""

    fit_mode: str = "auto"
    """`per_rank` (clean per-rank compute times), `step_max` (only step times), or `auto`."""

    timing: str = "auto"
    """Clock of each rank's step and of the vision tower inside it: `thread_cpu` (the main thread's CPU time:
    clean per-rank compute on CPU), `wall` (synchronised wall time of the step: accelerators, whose kernels
    run asynchronously), `forward_events` (the model's forward passes only, on device events (CUDA) or
    synchronised wall clock, x3 for forward + backward: no collective inside under DDP), `unit_events`
    (under FSDP: the forward spans of the sharded units that hold no other unit and of the modules outside
    every unit, each starting after FSDP's pre-hook has waited for the unit's all-gather, x3; a model
    without FSDP units is refused), or `auto` (thread_cpu on a CPU device; on accelerators forward_events
    under DDP, unit_events under FSDP when its units are found in the model, wall under ZeRO-3 and wherever
    they are not). `auto` fit mode follows it: per_rank for thread_cpu, forward_events and unit_events,
    step_max for wall."""

    prior: bool = True
    """Plan from the first step with the FLOP prior of the model's config (`CostModel.from_config`) until the
    fit lands, and fit around it (a scale per term, pulled toward the prior's shape). False: no plan before
    the fit (the first step planned is warmup_steps + 2) and four free coefficients."""

    estimate_speeds: bool = True
    """Estimate each rank's relative speed from its residuals at every fit (a rank consistently slower for
    the same predicted work gets a speed below 1) and give it to the planner; logged as
    dp_balance/speed_rank_<k>."""

    timeout_s: float = 600.0
    """Communication timeout of the side group: a dead or failing rank raises after this, never hangs."""

    prefetch_steps: int = 2
    """Optimizer steps planned and exchanged ahead by the background thread (bounded queue)."""

    lookahead_steps: int = 0
    """Plan outlier samples over a window of K upcoming steps (0: off). Changes data order within K steps."""

    cost_model_path: Optional[str] = None
    """JSON of a fitted cost model to start from (skips warm-up fitting when given)."""

    verbose: bool = False
    """Log a line per step on rank 0 in addition to the periodic metrics."""

    input: str = "auto"
    """What the training dataloader yields: `samples` (per-sample dicts, packed by the library) or `packed`
    (rows the user's collator packed: split, rebalanced, packed back in their layout, no row longer than the
    step's longest). `auto`: `packed` when the Trainer's data collator is the user's own, not `PackedCollator`
    or one of transformers' padding defaults."""

    watchdog: bool = True
    """Run heartbeat rounds on a side group while training: a peer that stops answering within `timeout_s`
    ends the run with a message naming the step, the rank and the phase (instead of every rank waiting in
    the training collective until `ddp_timeout`)."""

    heartbeat_s: float = 1.0
    """Seconds between two heartbeat rounds of the watchdog."""

    error_grace_s: float = 3.0
    """Seconds the watchdog waits, after a round failed, for the main thread to raise the library's error
    itself before it acts (`on_fatal`)."""

    on_fatal: str = "exit"
    """What the watchdog does when a peer is gone: `exit` (log the message and end the process with exit
    code 1: the main thread may be stuck in a training collective until `ddp_timeout`) or `raise` (the main
    thread raises the message as an error at its next step: for a process that must not be ended)."""

    allow_per_rank_loss_mean: bool = False
    """Balance even when each rank's loss is its own token mean (Trainer's `average_tokens_across_devices=False`,
    or a model without loss kwargs): the update then differs from the unbalanced run's, and train begin says
    so once. Off (default): such a run is refused at train begin, naming the setting
    (`integrations.loss_contract`)."""

    metrics_every: int = 10
    """`DPBalancer`: optimizer steps between two measurements of the ranks' compute (a collective run inside the
    step, on every rank at the same step), so that `metrics()` stays local and any rank may call it alone
    (0: never measure). The Trainer callback measures at Trainer's own logging steps."""

    def __post_init__(self) -> None:
        def bad(name: str, value, why: str) -> None:
            raise ValueError(f"DPBalanceConfig.{name}={value!r}: {why}")

        if self.warmup_steps is not None and self.warmup_steps < 0:
            bad("warmup_steps", self.warmup_steps, "must be >= 0")
        if not self.max_token_ratio >= 1.0:
            bad("max_token_ratio", self.max_token_ratio, "must be >= 1.0 (a cap below the mean cannot hold every sample)")
        if self.max_tokens is not None and self.max_tokens <= 0:
            bad("max_tokens", self.max_tokens, "must be a positive token count or None")
        if not 0.0 <= self.min_gain < 1.0:
            bad("min_gain", self.min_gain, "must be in [0, 1)")
        if not 0.0 <= self.move_tolerance < 1.0:
            bad("move_tolerance", self.move_tolerance, "must be in [0, 1)")
        if self.max_partners < 0:
            bad("max_partners", self.max_partners, "must be >= 0 (0: unbounded)")
        if self.ranks_per_node < 1:
            bad("ranks_per_node", self.ranks_per_node, "must be >= 1")
        if 0 < self.max_partners < max(self.ranks_per_node, 2):
            bad("max_partners", self.max_partners, f"must be 0 or at least {max(self.ranks_per_node, 2)} (the "
                f"ranks_per_node={self.ranks_per_node} ranks of a node and one partner outside it)")
        if self.sync not in SYNC_CHOICES:
            bad("sync", self.sync, f"must be one of {SYNC_CHOICES}")
        if self.fit_mode not in FIT_MODES:
            bad("fit_mode", self.fit_mode, f"must be one of {FIT_MODES}")
        if self.input not in INPUT_CHOICES:
            bad("input", self.input, f"must be one of {INPUT_CHOICES}")
        if self.timing not in TIMING_CHOICES:
            bad("timing", self.timing, f"must be one of {TIMING_CHOICES}")
        if self.refit_every < 0:
            bad("refit_every", self.refit_every, "must be >= 0")
        if not self.timeout_s > 0:
            bad("timeout_s", self.timeout_s, "must be > 0 seconds")
        if self.prefetch_steps < 1:
            bad("prefetch_steps", self.prefetch_steps, "must be >= 1")
        if self.metrics_every < 0:
            bad("metrics_every", self.metrics_every, "must be >= 0")
        if self.lookahead_steps < 0:
            bad("lookahead_steps", self.lookahead_steps, "must be >= 0")
        if not self.heartbeat_s > 0:
            bad("heartbeat_s", self.heartbeat_s, "must be > 0 seconds")
        if not self.error_grace_s >= 0:
            bad("error_grace_s", self.error_grace_s, "must be >= 0 seconds")
        if self.on_fatal not in FATAL_CHOICES:
            bad("on_fatal", self.on_fatal, f"must be one of {FATAL_CHOICES}")

    def replace(self, **changes) -> "DPBalanceConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_env(cls, base: Optional["DPBalanceConfig"] = None, environ: Optional[Mapping[str, str]] = None) -> "DPBalanceConfig":
        """`base` (or the defaults) overridden by every `HF_DP_BALANCE_<FIELD>` variable set."""
        environ = os.environ if environ is None else environ
        base = cls() if base is None else base
        changes = {}
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in environ:
                changes[f.name] = _parse_field(f, environ[key], key)
        return base.replace(**changes) if changes else base


def _parse_field(f: dataclasses.Field, text: str, key: str):
    """Parse an environment value by the field's declared type, with an error naming the variable."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    raw = text.strip()
    try:
        if "Optional" in kind and raw.lower() in ("", "none", "null"):
            return None
        if "bool" in kind:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected one of 1/0/true/false/yes/no/on/off")
        if "int" in kind:
            return int(raw)
        if "float" in kind:
            return float(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"environment variable {key}={text!r}: {exc}") from None


def config_field_names() -> tuple:
    return tuple(f.name for f in fields(DPBalanceConfig))


# Fields that may differ between processes: only rank 0 reads the cost model file, and logging is local.
RANK_LOCAL_FIELDS = ("cost_model_path", "verbose")


def config_digest(config: DPBalanceConfig) -> str:
    """A short hex digest of every field's value but `RANK_LOCAL_FIELDS`: equal on two processes exactly when
    their configs agree on everything that decides the groups, the collectives and the plans."""
    shared = {k: v for k, v in config.to_dict().items() if k not in RANK_LOCAL_FIELDS}
    text = json.dumps(shared, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def config_differences(mine: Mapping, theirs: Mapping) -> tuple:
    """The field names (but `RANK_LOCAL_FIELDS`) whose values differ between two `DPBalanceConfig.to_dict()`
    results, in field order."""
    return tuple(name for name in config_field_names()
                 if name not in RANK_LOCAL_FIELDS and mine.get(name) != theirs.get(name))


__all__ = ["DPBalanceConfig", "ENV_PREFIX", "FATAL_CHOICES", "RANK_LOCAL_FIELDS", "config_differences", "config_digest",
           "config_field_names"]
