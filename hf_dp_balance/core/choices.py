"""The allowed values of the library's string settings, each written once.

`DPBalanceConfig` validates against these, `DPBalanceArguments` offers them as
`--help` choices, the `fit` command line and `fit_cost_model` accept them.
"""

from __future__ import annotations

# How ranks meet in a step: `step` (DDP: once per optimizer step, in the gradient all-reduce) or
# `micro_batch` (FSDP / ZeRO-3: in every micro-batch). The config adds `auto` (read from the Trainer).
SYNC_MODES = ("step", "micro_batch")
SYNC_CHOICES = ("auto",) + SYNC_MODES

# How the cost model is fitted: per-rank times, the slowest rank of each step only, or chosen by the data.
FIT_MODES = ("auto", "per_rank", "step_max")

# The clock that times each rank's step (and the vision tower inside it): the main thread's CPU time
# (clean per-rank compute on CPU, where a rank blocked in a collective burns no CPU) or synchronised
# wall time (accelerators: kernels run asynchronously, CPU time would measure their launches only).
# `forward_events`: each rank's forward passes alone (device events on CUDA, synchronised wall clock
# elsewhere), x3 for forward + backward: under DDP the forward has no collective, so it is a clean
# per-rank observation on accelerators.
# `unit_events`: under FSDP (FSDP2 `fully_shard`, FSDP1 wrappers) the forward spans of the sharded units that
# hold no other unit, and of the modules outside every unit, each from a forward pre-hook that runs after
# FSDP's own (which waits for the unit's all-gather) to the forward hook: the rank's own forward compute
# without the waits, x3 for forward + backward (runtime.recorder.timed_parts).
# `auto`: thread CPU time on a CPU device; on accelerators forward events under DDP, unit events under FSDP
# (its units found in the model, micro_batch sync), wall time elsewhere the forward meets other ranks
# (ZeRO-3: its parameter fetches run inside every module that owns parameters, so no module span is clean).
TIMING_MODES = ("thread_cpu", "wall", "forward_events", "unit_events")
TIMING_CHOICES = ("auto",) + TIMING_MODES
# The timings that read forward spans (device events on CUDA) and take 3x their sum as the step's compute.
SPAN_TIMINGS = ("forward_events", "unit_events")

# What the training dataloader yields: per-sample dicts that the library packs (`samples`), or rows the
# user's collator already packed, split and packed back in their layout (`packed`). `auto`: packed when the
# Trainer's data collator is the user's own (not PackedCollator, not transformers' padding defaults).
INPUT_MODES = ("samples", "packed")
INPUT_CHOICES = ("auto",) + INPUT_MODES

__all__ = ["FIT_MODES", "INPUT_CHOICES", "INPUT_MODES", "SPAN_TIMINGS", "SYNC_CHOICES", "SYNC_MODES",
           "TIMING_CHOICES", "TIMING_MODES"]
