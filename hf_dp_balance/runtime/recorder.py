"""What one rank computes in an optimizer step and how long it takes, on one clock (torch only).

`StepClock`: thread CPU time, synchronised wall time, or forward spans on device events (the model's
forward, or its FSDP units' forwards: `sharded_units`, `timed_parts`).
`StepRecorder`: forward pre-hooks give the per-sample token lengths (and image patches), hooks on the
vision tower its images and time. Guarantee: the step and the tower inside it are read on the same clock,
so their difference is the decoder's time. Fitting these records: `runtime.fitter`.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

from hf_dp_balance.core.choices import SPAN_TIMINGS, TIMING_MODES
from hf_dp_balance.core.boundaries import segment_lengths


def synchronize() -> None:
    """Wait for the accelerator's queued kernels (CUDA), so that wall time covers their compute."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class StepClock:
    """The one clock of a run: `thread_cpu` (`time.thread_time`), `wall` (synchronised `perf_counter`),
    `forward_events` or `unit_events` (CUDA events where CUDA runs, else synchronised `perf_counter`).

    The step and the vision tower inside it read the same clock, so their difference is the decoder's time.
    `mark()` / `span(a, b)`: an interval on this clock (device events are read once, at the step's end).
    """

    def __init__(self, timing: str, device_type: str = "cpu"):
        if timing not in TIMING_MODES:
            raise ValueError(f"StepClock: timing={timing!r} must be one of {TIMING_MODES} (resolve 'auto' first)")
        self.timing = timing
        self.events = timing in SPAN_TIMINGS and device_type == "cuda"

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


# --------------------------------------------------------------------------- FSDP units


def sharded_units(model) -> list:
    """The modules FSDP gathers parameters for as one unit: every FSDP2 `fully_shard` module (`FSDPModule`)
    and the inner module of every FSDP1 wrapper (`FullyShardedDataParallel._fsdp_wrapped_module`); [] for a
    model without FSDP (DDP, DeepSpeed, a plain module), or a torch without these classes.

    Why a span inside a unit is this rank's compute: FSDP2 registers its forward pre-hook with
    `prepend=True`, and in it the unit's parameters are all-gathered and the compute stream waits for them
    (`wait_for_unshard`: a stream `wait_event` on CUDA, the host blocked on gloo); FSDP1's wrapper unshards
    and waits before it calls the inner module. A pre-hook of ours therefore starts after the wait, and no
    other collective runs in the unit's forward until its forward hook."""
    import torch.distributed as dist

    if not dist.is_available():
        return []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # older torch: no FSDP2
        FSDPModule = ()
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = ()
    units, seen = [], set()
    for module in model.modules():
        unit = None
        if FSDPModule and isinstance(module, FSDPModule):
            unit = module
        elif FullyShardedDataParallel and isinstance(module, FullyShardedDataParallel):
            unit = module._fsdp_wrapped_module
        if unit is not None and id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units


def timed_parts(model, units) -> list:
    """The modules whose forward spans hold no collective, disjoint, covering what they can of the forward:
    each unit that holds no other unit (a decoder layer, a vision block), whole; and each largest subtree
    that holds no unit (the root unit's embeddings, final norm, lm_head; a tower inside the root unit): its
    parameters, if any, belong to a unit already gathered by the time it runs (the root's all-gather waits in
    the root's pre-hook, before every other), or are not sharded at all. What no part covers: the code of a
    unit that holds other units, outside its children (the root's mask building, the loss), and every unit's
    backward (3x forward stands for it, as under DDP)."""
    unit_ids = {id(u) for u in units}
    holds_unit: Dict[int, bool] = {}

    def holds(module) -> bool:
        if id(module) not in holds_unit:
            below = [holds(c) for c in module.children()]  # every child visited: each one's answer is cached
            holds_unit[id(module)] = id(module) in unit_ids or any(below)
        return holds_unit[id(module)]

    def holds_below(module) -> bool:
        return any(holds(c) for c in module.children())

    parts: list = []

    def visit(module) -> None:
        if not holds(module) or (id(module) in unit_ids and not holds_below(module)):
            parts.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return parts


class StepRecorder:
    """What this rank computed in the current optimizer step, and how long it took (on `clock`).

    With `forward_events` timing the step's time is 3x the model's forward passes (forward + backward),
    measured on device events from the model's forward pre-hook to its forward hook: no collective runs
    inside a DDP forward, so it is this rank's own compute. With `unit_events` (FSDP) it is 3x the sum of
    the forward spans of `timed_parts` (the units holding no other unit, and what lies outside every unit),
    taken only inside the model's forward (a unit recomputed by activation checkpointing in the backward
    is not counted twice); the vision tower's seconds are the parts inside it. Otherwise it is the time
    from `begin` to `end`.

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
        self._part_spans: list = []  # (start, end, inside the tower) of this step's `timed_parts` forwards
        self._in_forward = False  # inside the model's forward (unit spans outside it: a backward's recompute)
        self.parts: list = []  # the modules timed with `unit_events` (set by `install`)

    @property
    def forward_only(self) -> bool:
        return self.clock.timing == "forward_events"

    @property
    def unit_spans(self) -> bool:
        return self.clock.timing == "unit_events"

    @property
    def times_micro_batches(self) -> bool:
        """Whether each micro-batch is timed: on the synchronised wall clock only (`wall`), where the step's
        time is the slowest rank's and a micro-batch boundary is a point every rank passes together, and only
        where the fit reads them (`micro_batches`)."""
        return self._time_micro_batches and self.clock.timing == "wall"

    def begin(self) -> None:
        self.lengths, self.patches, self.vision_s = [], [], 0.0
        self.micro_lengths, self.micro_s, self._micro_starts, self._micro_vision_s = [], [], [], []
        self._forward_spans, self._tower_spans, self._part_spans = [], [], []
        self._in_forward = False
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
        if self.unit_spans:
            parts = [(3.0 * self.clock.span(a, b), in_tower) for a, b, in_tower in self._part_spans]
            elapsed = sum(t for t, _ in parts)
            self.vision_s = sum(t for t, in_tower in parts if in_tower)
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
        With `unit_events`, hooks on every module of `timed_parts` too; a model without FSDP units is refused
        (ValueError: no span of it is known to exclude the all-gather waits).
        Installing again first removes this recorder's previous hooks (no forward is recorded twice)."""
        self.remove()
        tower = vision_tower(model)
        marks = {}
        if self.unit_spans:
            units = sharded_units(model)
            if not units:
                raise ValueError("hf_dp_balance: timing='unit_events' times the forwards of FSDP units, and this "
                                 "model has none (no FSDP2 fully_shard module, no FSDP1 wrapper): use timing='wall' "
                                 "(or 'auto'), or install the recorder after the model is sharded")
            self._install_parts(timed_parts(model, units), tower)

        def before_forward(module, args, kwargs):
            self._in_forward = True
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
            self._in_forward = False
            if "forward" in marks:
                self._forward_spans.append((marks.pop("forward"), self.clock.mark()))

        self._hooks.append(model.register_forward_pre_hook(before_forward, with_kwargs=True))
        if self.forward_only or self.unit_spans:
            self._hooks.append(model.register_forward_hook(after_forward, always_call=True))
        if tower is not None:
            self._install_tower(tower)

    def _install_parts(self, parts: list, tower) -> None:
        """Span hooks on every module of `timed_parts`, registered after FSDP's (whose pre-hook is prepended
        and waits for the unit's all-gather): each span starts once this rank has its parameters."""
        in_tower = {id(m) for m in tower.modules()} if tower is not None else set()
        marks: Dict[int, Any] = {}

        def part_begin(module, args):
            if self._in_forward and self.started is not None:
                marks[id(module)] = self.clock.mark()

        def part_end(module, args, output):
            start = marks.pop(id(module), None)
            if start is not None:
                self._part_spans.append((start, self.clock.mark(), id(module) in in_tower))

        for module in parts:
            self._hooks.append(module.register_forward_pre_hook(part_begin))
            self._hooks.append(module.register_forward_hook(part_end))
        self.parts = list(parts)

    def _install_tower(self, tower) -> None:
        marks = {}

        def tower_begin(module, args, kwargs):
            # The images this rank's tower really computes (after vision balancing moved some).
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            if grid is not None:
                self.patches.extend(image_patches({"image_grid_thw": grid}))
            elif args and hasattr(args[0], "dim") and args[0].dim() == 4:  # InternVL tiles
                self.patches.extend(image_patches({"pixel_values": args[0]}))
            if not self.unit_spans:  # with unit spans the tower's seconds are its parts' (it may hold units)
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
        self.parts = []


__all__ = ["StepClock", "StepRecorder", "image_patches", "micro_batch_lengths", "sharded_units", "synchronize",
           "timed_parts", "vision_tower"]
