"""What one rank computes in an optimizer step and how long it takes, on one clock (torch only).

`StepClock`: thread CPU time, synchronised wall time, or the forward passes on device events.
`StepRecorder`: forward pre-hooks give the per-sample token lengths (and image patches), hooks on the
vision tower its images and time. Guarantee: the step and the tower inside it are read on the same clock,
so their difference is the decoder's time. Fitting these records: `runtime.fitter`.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from hf_dp_balance.core.choices import TIMING_MODES
from hf_dp_balance.core.boundaries import segment_lengths


def synchronize() -> None:
    """Wait for the accelerator's queued kernels (CUDA), so that wall time covers their compute."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """The one clock of a run: `thread_cpu` (`time.thread_time`), `wall` (synchronised `perf_counter`) or
    `forward_events` (CUDA events where CUDA runs, else synchronised `perf_counter`).

    The step and the vision tower inside it read the same clock, so their difference is the decoder's time.
    `mark()` / `span(a, b)`: an interval on this clock (device events are read once, at the step's end).
    """

    def __init__(self, timing: str, device_type: str = "cpu"):
        if timing not in TIMING_MODES:
            raise ValueError(f"StepClock: timing={timing!r} must be one of {TIMING_MODES} (resolve 'auto' first)")
        self.timing = timing
        self.events = timing == "forward_events" and device_type == "cuda"

    def now(self) -> float:
        if self.timing == "thread_cpu":
            return time.thread_time()
        synchronize()
        return time.perf_counter()

    def mark(self):
        """A point in time: a recorded CUDA event (no synchronisation) or `now()`."""
        if self.events:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.now()

    def span(self, start, end) -> float:
        """Seconds from mark `start` to mark `end` (waits for `end`'s event on CUDA)."""
        if self.events:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start


# --------------------------------------------------------------------------- what a micro-batch computes


def micro_batch_lengths(inputs: Dict[str, Any]) -> List[int]:
    """Per-sample token lengths of one micro-batch, as the model will compute it.

    Packed rows ([B, T] or Qwen-VL's [4, B, T] position ids): the samples of
    `core.boundaries.segment_lengths`. Padded rows: the attention mask's row sums.
    Otherwise every row is one sample.
    """
    import torch

    pos = inputs.get("position_ids")
    if isinstance(pos, torch.Tensor) and (pos.dim() == 2 or (pos.dim() == 3 and pos.shape[0] == 4)):
        return segment_lengths(pos)
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return [int(x) for x in mask.sum(dim=1).tolist()]
    ids = inputs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return [int(ids.shape[-1])] * (int(ids.shape[0]) if ids.dim() == 2 else 1)
    return []


def image_patches(inputs: Dict[str, Any]) -> List[int]:
    """Patches of every frame of every image / video in a micro-batch: the vision cost model's unit
    (`core.costing.frame_patches`: a Qwen-VL grid (t, h, w) is t frames of h*w; InternVL: one tile each)."""
    import torch

    from hf_dp_balance.core.costing import frame_patches

    out: List[int] = []
    for key in ("image_grid_thw", "video_grid_thw"):
        grid = inputs.get(key)
        if isinstance(grid, torch.Tensor) and grid.numel():
            out.extend(int(x) for x in frame_patches(grid.detach().cpu().numpy().reshape(-1, 3))[0].tolist())
    if not out and inputs.get("pixel_values") is not None and inputs.get("image_grid_thw") is None:
        pv = inputs["pixel_values"]
        if isinstance(pv, torch.Tensor) and pv.dim() == 4:  # InternVL tiles: cost per tile is fixed
            out.extend([int(pv.shape[-1] * pv.shape[-2]) // (14 * 14)] * int(pv.shape[0]))
    return out


def vision_tower(model):
    """The vision tower module of a Qwen-VL / InternVL model, or None."""
    for path in ("model.visual", "visual", "model.vision_tower", "vision_tower"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


class StepRecorder:
    """What this rank computed in the current optimizer step, and how long it took (on `clock`).

    With `forward_events` timing the step's time is 3x the model's forward passes (forward + backward),
    measured on device events from the model's forward pre-hook to its forward hook: no collective runs
    inside a DDP forward, so it is this rank's own compute. Otherwise it is the time from `begin` to `end`.

    Micro-batches: every model forward starts one (`micro_lengths`, one list of sample lengths each). With
    `wall` timing each micro-batch is also timed (`micro_s`, after `end`): from its forward's start to the
    next one's, the last to the step's end (so it also holds the step's tail: gradient reduction, clipping,
    the optimizer step). Each boundary reads the synchronised clock, one device synchronisation per
    micro-batch; under FSDP / ZeRO-3 the ranks already meet in every layer's all-gather, so the host waiting
    for the device once more per micro-batch costs only the launch-ahead it drains (the fit of these times:
    `core.fitting.fit_from_micro_batches`).
    """

    def __init__(self, clock: StepClock, micro_batches: bool = True):
        self.clock = clock
        self._time_micro_batches = micro_batches  # False: the fit reads the step's sums (no extra syncs)
        self.lengths: List[int] = []
        self.micro_lengths: List[List[int]] = []
        self.micro_s: List[float] = []
        self.patches: List[int] = []
        self.vision_s = 0.0
        self.started: Optional[float] = None
        self._hooks: list = []
        self._forward_spans: list = []  # (start, end) marks of this step's model forwards
        self._tower_spans: list = []  # (start, end, micro-batch index) of this step's tower forwards
        self._micro_starts: List[float] = []
        self._micro_vision_s: List[float] = []  # tower seconds of each micro-batch, set by `end` with micro_s

    @property
    def forward_only(self) -> bool:
        return self.clock.timing == "forward_events"

    @property
    def times_micro_batches(self) -> bool:
        """Whether each micro-batch is timed: on the synchronised wall clock only (`wall`), where the step's
        time is the slowest rank's and a micro-batch boundary is a point every rank passes together, and only
        where the fit reads them (`micro_batches`)."""
        return self._time_micro_batches and self.clock.timing == "wall"

    def begin(self) -> None:
        self.lengths, self.patches, self.vision_s = [], [], 0.0
        self.micro_lengths, self.micro_s, self._micro_starts, self._micro_vision_s = [], [], [], []
        self._forward_spans, self._tower_spans = [], []
        self.started = self.clock.now()

    def end(self) -> Optional[float]:
        """Seconds of this step (None when no step was begun); `vision_s` and `micro_s` are final after it."""
        if self.started is None:
            return None
        stop = self.clock.now()
        elapsed = stop - self.started
        self.started = None
        # Backward of the tower (and of the model) costs ~2x its forward: 3x forward is its share of the step.
        tower = [(3.0 * self.clock.span(a, b), m) for a, b, m in self._tower_spans]
        self.vision_s = sum(t for t, _ in tower)
        if self.forward_only:
            elapsed = 3.0 * sum(self.clock.span(a, b) for a, b in self._forward_spans)
        if self.times_micro_batches and self._micro_starts:
            bounds = self._micro_starts + [stop]
            self.micro_s = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            self._micro_vision_s = [0.0] * len(self.micro_s)
            for t, m in tower:
                if 0 <= m < len(self._micro_vision_s):
                    self._micro_vision_s[m] += t
        return elapsed

    def micro_batches(self) -> Optional[Tuple[List[List[int]], List[float], List[float]]]:
        """(sample lengths, seconds, vision tower seconds) of each micro-batch of the step just ended, when they
        were timed (`times_micro_batches`) and every forward's work was read; else None."""
        if not self.micro_s or len(self.micro_s) != len(self.micro_lengths):
            return None
        return [list(x) for x in self.micro_lengths], list(self.micro_s), list(self._micro_vision_s)

    def install(self, model) -> None:
        """Hooks: the model's forward inputs give the sample lengths (and, without a separate tower, the
        image patches); the vision tower's forward gives the images it really computes and its time.
        Installing again first removes this recorder's previous hooks (no forward is recorded twice)."""
        self.remove()
        tower = vision_tower(model)
        marks = {}

        def before_forward(module, args, kwargs):
            inputs = dict(kwargs)
            if self.times_micro_batches and self.started is not None:
                self._micro_starts.append(self.clock.now())  # synchronised: the previous micro-batch is done
            lengths = micro_batch_lengths(inputs)
            self.lengths.extend(lengths)
            self.micro_lengths.append(lengths)
            if tower is None:
                self.patches.extend(image_patches(inputs))
            if self.forward_only:
                marks["forward"] = self.clock.mark()
            return None

        def after_forward(module, args, output):
            if "forward" in marks:
                self._forward_spans.append((marks.pop("forward"), self.clock.mark()))

        self._hooks.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
        if self.forward_only:
            self._hooks.append(model.register_forward_hook(after_forward))
        if tower is not None:
            self._install_tower(tower)

    def _install_tower(self, tower) -> None:
        marks = {}

        def tower_begin(module, args, kwargs):
            # The images this rank's tower really computes (after vision balancing moved some).
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if grid is not None:
                self.patches.extend(image_patches({"image_grid_thw": grid}))
            elif args and hasattr(args[0], "dim") and args[0].dim() == 4:  # InternVL tiles
                self.patches.extend(image_patches({"pixel_values": args[0]}))
            marks["t"] = self.clock.mark()

        def tower_end(module, args, output):
            if "t" in marks:
                self._tower_spans.append((marks.pop("t"), self.clock.mark(), len(self.micro_lengths) - 1))

        self._hooks.append(tower.register_forward_pre_hook(tower_begin, with_kwargs=True))
        self._hooks.append(tower.register_forward_hook(tower_end))

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


__all__ = ["StepClock", "StepRecorder", "image_patches", "micro_batch_lengths", "synchronize", "vision_tower"]
