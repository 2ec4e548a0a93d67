"""`BalanceSession`: one balanced training run, whatever framework drives it.

A session owns everything a run creates and keeps the rules every front end must follow alike:

- the `SideChannel` (side groups over the data-parallel slice in one fixed order, the one watchdog, the
  run's store namespace, the config agreed on every process; made on every process or on none);
- the model state: the cost models to start from are read on ONE process (global rank 0) and
  shared (`SideChannel.from_rank0`: the store between slices), so every rank plans with the same models or
  every rank raises naming the file and the rank; the fitter (`CostModelFitter`: records gathered to the
  first process of global rank 0's slice, fitted there, shared the same way, refit) and whether the
  planner hedges (the prior flag travels with the models, the same on every rank);
- the recorder (`StepRecorder`) hooked on the model (the step's timing resolved from the sync mode and the
  model), and the vision balancer when asked for (`attach_vision`);
- one undo registry (`patches`, `runtime.patches.Patches`): whatever an adapter changes on the framework's
  objects (a deferred collate, wrapped methods, a checkpointing registration) is put back by `close()`;
- the sum over the data-parallel group the main thread needs (`sum_over_data_parallel`), and the checkpoint
  files of a folder (`save_checkpoint`, `read_checkpoint_state`);
- the loaders it builds and the rule for publishing models and speeds to them: tp / cp peers of one
  data-parallel index plan with one speed (the fitting slice's, for that index), or their batches would differ;
- `state_dict` / `load_state_dict` of the resume point, versioned and checked against the data-parallel
  size; and `close()`, which undoes all of it in reverse.

The Trainer callback (`integrations.callback`) and `DPBalancer` (`integrations.accelerate`) are adapters:
they map their framework's events onto `start`, `begin_step` / `end_step`, `metrics` and `close`, and read
the framework's facts through `runtime.framework` (sync mode, data-parallel sharding).
Train-begin checks of the user's setup run in one place: the `checks` given to `start`, before any group
is used for training.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.runtime.balance_metrics import LOG_PREFIX, summarize_step_stats, vision_stats
from hf_dp_balance.runtime.fitter import (CostModelFitter, StepClock, StepRecorder, image_patches,
                                          micro_batch_lengths, priors_from_config, resolve_timing)
from hf_dp_balance.runtime.logs import get_logger
from hf_dp_balance.runtime.parallel import DataParallelGroup
from hf_dp_balance.runtime.patches import Patches
from hf_dp_balance.runtime.side_channel import SideChannel

logger = get_logger(__name__)

CHECKPOINT_FILE = "dp_balance_cost_model.json"
STATE_FILE = "dp_balance_state.json"  # the session's state_dict in a Trainer checkpoint (written on rank 0)
STATE_VERSION = 2


def load_checkpoint_models(path: str) -> Dict[str, Any]:
    """Read `dp_balance_cost_model.json`: {"decoder": CostModel, "vision": CostModel|None, "fitted_step": int}."""
    with open(path, "r", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or "decoder" not in data:
        raise ValueError(f"{path}: not a dp_balance cost model checkpoint (no 'decoder' key)")
    return {
        "decoder": CostModel.from_dict(data["decoder"]),
        "vision": CostModel.from_dict(data["vision"]) if data.get("vision") else None,
        "fitted_step": int(data.get("fitted_step", -1)),
    }


def read_checkpoint_state(folders: Sequence[str]) -> Optional[dict]:
    """The session state (`STATE_FILE`) of the first of `folders` that has one, else None."""
    for folder in folders:
        path = os.path.join(folder, STATE_FILE)
        if os.path.isfile(path):
            with open(path, "r", encoding="utf-8") as f:
                return json.load(f)
    return None


def read_start_models(checkpoints: Sequence[str], cost_model_path: Optional[str], have_decoder: bool) -> dict:
    """What rank 0 reads to start from, as a broadcastable dict: the first checkpoint file found, else
    `cost_model_path` (when no model was given), else nothing; {"error": ...} naming the file instead of raising."""
    try:
        for path in checkpoints:
            if os.path.isfile(path):
                saved = load_checkpoint_models(path)
                return {"decoder": saved["decoder"].to_dict(),
                        "vision": saved["vision"].to_dict() if saved["vision"] is not None else None,
                        "source": path, "kind": "checkpoint"}
        if not have_decoder and cost_model_path:
            if not os.path.isfile(cost_model_path):
                return {"error": f"cost_model_path {cost_model_path!r} does not exist on rank 0 (rank 0 reads the "
                                 f"cost model for every rank and broadcasts it)"}
            return {"decoder": CostModel.load(cost_model_path).to_dict(), "vision": None, "source": cost_model_path,
                    "kind": "cost_model_path"}
    except Exception as exc:  # noqa: BLE001 - every rank raises it, after the broadcast
        return {"error": f"reading the cost model on rank 0 failed: {type(exc).__name__}: {exc}"}
    return {}


class BalanceSession:
    """One run's side channel, fitter, recorder, loaders and model state (see the module docstring).

    Create it on every process at the same moment (its side channel creates process groups).
    `data_parallel`: this process's data-parallel group (default: every process).
    """

    def __init__(self, config: DPBalanceConfig, data_parallel: Optional[DataParallelGroup] = None, *,
                 on_fatal: Optional[Callable[[str], None]] = None):
        import torch.distributed as dist

        self.config = config
        # All or nothing on every process (`SideChannel`); nothing below communicates or can fail on one rank.
        self.side = SideChannel(data_parallel, config, on_fatal=on_fatal)
        self.data_parallel = self.side.data_parallel
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.side.distributed else (0, 1)
        self.fitter: Optional[CostModelFitter] = None
        self.recorder: Optional[StepRecorder] = None
        self.patches = Patches()    # what the adapters changed on framework objects, undone at close
        self._hooked = False        # the recorder reads lengths from the model's forward (else from the batches)
        self.loaders: List[Any] = []
        self.vision = None          # the vision balancer this session installed (removed at close)
        self._vision_model = None
        # () -> a vision balancer the user installed (DPBalancer: model._dp_balance_vision); fed models, not owned
        self.vision_source: Optional[Callable[[], Any]] = None
        self.restored_from: Optional[str] = None
        # per balanced loader, in the order the adapter tracked them: (settings(), position(), restore(position))
        self._tracked: List[Tuple[Callable[[], dict], Callable[[], dict], Callable[[dict], None]]] = []
        self._pending_positions: List[Tuple[int, dict, dict]] = []  # loaded before their loader was tracked
        self._measured: Dict[str, float] = {}  # the last `measure`, reported once by `metrics`
        self._closed = False

    # -- open: construct, start and wire, or leave nothing behind ----------------------------------
    @classmethod
    def open(cls, config: DPBalanceConfig, data_parallel: Optional[DataParallelGroup] = None, *,
             setup: Optional[Callable[["BalanceSession"], None]] = None, **start) -> "BalanceSession":
        """A started session: constructed, `start(**start)`ed, then `setup(session)` run (an adapter's wiring:
        loaders, patches, vision). Either all of it completes, or everything made so far (groups, threads,
        hooks, the adapter's `patches`) is closed and the error re-raised: a refused setup leaves nothing behind.
        Construction itself is all or nothing on every process (`SideChannel`)."""
        session = cls(config, data_parallel)
        try:
            session.start(**start)
            if setup is not None:
                setup(session)
        except BaseException:
            session.close()
            raise
        return session

    # -- start -----------------------------------------------------------------------------------
    def start(self, *, model=None, model_config=None, timing: Optional[str] = None, device_type: str = "cpu",
              sync: Optional[str] = None, decoder: Optional[CostModel] = None, vision: Optional[CostModel] = None,
              fitted_step: int = -1,
              checkpoints: Sequence[str] = (), file_step: int = 0,
              checks: Iterable[Callable[[], None]] = ()) -> None:
        """Run the train-begin `checks`, agree the models to start from, make the fitter and hook the recorder.

        Start models: the first of `checkpoints` found on rank 0, else `decoder` / `vision` given, else
        `config.cost_model_path` (read on rank 0), else the warm-up fit (with the FLOP prior of
        `model_config` when `config.prior`). A model read from a file counts as fitted at `file_step` (refitted
        every `refit_every` from there); a model given here is never refitted. Every rank gets the same.
        `sync` is the loader's resolved sync (`step` / `micro_batch`, `runtime.framework.resolve_sync`): a
        step-time fit reads each micro-batch's maximum only where micro-batches meet across ranks (None:
        `config.sync`). `timing` None: `config.timing` resolved for the device, the sync and the model
        (`runtime.fitter.resolve_timing`).
        """
        import torch.distributed as dist

        for check in checks:  # the user's setup, checked on every rank before training starts
            check()
        decoder, vision, fitted_step = self._agree_start_models(checkpoints, decoder, vision, fitted_step, file_step)
        if timing is None:
            timing = resolve_timing(self.config.timing, device_type, sync, model)
        prior, vision_prior = priors_from_config(model_config) if self.config.prior else (None, None)
        group = self.side.control_group
        self.fitter = CostModelFitter(self.config, rank=dist.get_rank(group) if group is not None else 0,
                                      world=self.data_parallel.size if group is not None else 1, group=group,
                                      relay=self.side.relay("models"), timing=timing, sync=sync, decoder=decoder,
                                      vision=vision, fitted_step=fitted_step, prior=prior, vision_prior=vision_prior)
        if self.recorder is not None:
            self.recorder.remove()
        self.recorder = StepRecorder(StepClock(timing, device_type), micro_batches=self.fitter.fits_micro_batches)
        if model is not None:
            self.recorder.install(model)
        self._hooked = model is not None

    def _agree_start_models(self, checkpoints, decoder, vision, fitted_step, file_step):
        found = self.side.from_rank0(read_start_models(checkpoints, self.config.cost_model_path, decoder is not None)
                                     if self.rank == 0 else None, "start_models") or {}
        if "error" in found:
            raise ValueError(f"hf_dp_balance: rank {self.rank}: {found['error']}")
        if "decoder" in found:
            self.restored_from = found["source"]
            vision_model = CostModel.from_dict(found["vision"]) if found.get("vision") else None
            if found["kind"] == "checkpoint":
                return CostModel.from_dict(found["decoder"]), vision_model, file_step
            return CostModel.from_dict(found["decoder"]), vision, file_step
        return decoder, vision, fitted_step

    # -- parts ------------------------------------------------------------------------------------
    def add_loader(self, loader) -> Any:
        """Register a loader built on this session's side channel; it is published to now and closed at `close`."""
        self.loaders.append(loader)
        self.publish(loader)
        return loader

    def attach_vision(self, model, step_source: Optional[Callable[[], int]] = None) -> Any:
        """The vision balancer of `model`, fed this session's vision cost model: with `config.vision`, or when
        the user balanced the tower already (`balance_vision_encoder`, on a group of its own that knows no mesh),
        the session balances it itself over the data-parallel slice (`install_vision`, removed at close; its
        errors name `step_source()`)."""
        if model is None:
            return None
        self.vision_source = lambda: getattr(model, "_dp_balance_vision", None)
        if self.config.vision or self.vision_source() is not None:
            self.install_vision(model)
            if step_source is not None:
                self.vision.step_source = step_source
        return self.vision_balancer

    def install_vision(self, model) -> Any:
        """Balance `model`'s vision tower on the session's vision group over the data-parallel slice (removed at
        `close`). A wrapper the user made before (`balance_vision_encoder`, on a group of its own) is replaced,
        its cost model kept until the session has one."""
        from hf_dp_balance.runtime.vision import balance_vision_encoder

        _, vision = self.fitter.planning_models() if self.fitter is not None else (None, None)
        previous = getattr(model, "_dp_balance_vision", None)
        vision = vision if vision is not None or previous is None else previous.cost_model
        balance_vision_encoder(model, self.config, group=self.side.vision_group(), cost_model=vision)
        self.vision, self._vision_model = getattr(model, "_dp_balance_vision", None), model
        if self.fitter is not None:
            self.publish()  # the tower is balanced on its own now: the loaders plan decoder cost only
        return self.vision

    # -- models and speeds ----------------------------------------------------------------------
    @property
    def speed(self) -> float:
        """The speed this process plans with: its data-parallel index's, as fitted. Under a mesh the fitting
        slice's process of that index measured it (its step includes waiting for its tp / cp peers in their
        collectives on an accelerator), and every slice reads the same value, so peers plan alike."""
        return float(self.fitter.speeds[self.fitter.rank])

    def publish(self, loader=None) -> None:
        """The current models (the fitted ones, else the FLOP priors) and speed to the loaders and the vision
        wrapper (no model: keep everything in place)."""
        decoder, vision = self.fitter.planning_models()
        for target in ([loader] if loader is not None else self.loaders):
            if decoder is not None and hasattr(target, "set_cost_model"):
                # Without vision-tower balancing a sample's images are encoded where the sample goes: plan with
                # decoder + vision; the loader hedges its plans while the prior plans or the fit is uncertain.
                target.set_cost_model(decoder, vision=None if self.vision_balancer is not None else vision,
                                      prior=self.fitter.plans_hedged,
                                      probe=self.fitter.fit_mode == "step_max")
                if hasattr(target, "set_speed"):
                    target.set_speed(self.speed)
        balancer = self.vision_balancer
        if balancer is not None and vision is not None:
            balancer.cost_model = vision

    @property
    def vision_balancer(self):
        """The vision balancer in use: the session's own, else the user's (`vision_source`)."""
        if self.vision is not None:
            return self.vision
        return self.vision_source() if self.vision_source is not None else None

    # -- per step ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.side.raise_if_fatal()
        if self.recorder is not None:
            self.recorder.begin()

    def end_step(self, step: int, elapsed: Optional[float] = None, batches: Sequence[Any] = ()) -> bool:
        """Record the step (its recorder's seconds, or `elapsed`) and fit when due, then publish. A collective
        when a fit is due: every rank ends the same steps. True if it fitted. With no model hooked, the step's
        packed `batches` tell what it computed."""
        if self.recorder is None or self.fitter is None:
            return False
        seconds = self.recorder.end() if elapsed is None else elapsed
        if seconds is None:
            return False
        rec = self.recorder
        if not self._hooked:
            for batch in batches:
                rec.lengths.extend(micro_batch_lengths(batch))
                rec.patches.extend(image_patches(batch))
        if self.fitter.end_step(step, rec.lengths, seconds, rec.patches, rec.vision_s, rec.micro_batches()):
            self.publish()
            return True
        return False

    def measure(self) -> None:
        """Measure the ranks' compute since the last measurement (a collective on the fit group: every rank
        calls it at the same step, inside the step); `metrics` reports it once."""
        if self.fitter is None:
            return
        for name, value in self.fitter.window_metrics().items():
            if value is not None:
                self._measured[LOG_PREFIX + name] = float(value)

    def metrics(self, step_stats: Sequence[Any]) -> Dict[str, float]:
        """The dp_balance/* numbers: the last `measure`ment (once), the loaders' `step_stats`, the vision
        counters and the cost model. Local: no collective, any rank may call it alone at any time."""
        out, self._measured = dict(self._measured), {}
        logs = dict(summarize_step_stats(step_stats))
        logs.update(vision_stats(self.vision_balancer))
        if self.fitter is not None:
            logs.update(self.fitter.model_metrics())
        out.update({LOG_PREFIX + k: float(v) for k, v in logs.items() if v is not None})
        return out

    def sum_over_data_parallel(self, local: int) -> int:
        """Sum of `local` over the data-parallel group: a collective on the session's control group (main
        thread; every data-parallel rank calls it at the same point)."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([int(local)], dtype=torch.int64)
        if self.data_parallel.size > 1:
            dist.all_reduce(value, group=self.side.control_group)
        return int(value.item())

    def model_state(self) -> Optional[dict]:
        """The cost models to checkpoint (None before any is fitted or given)."""
        if self.fitter is None or self.fitter.decoder is None:
            return None
        return {"decoder": self.fitter.decoder.to_dict(),
                "vision": self.fitter.vision.to_dict() if self.fitter.vision is not None else None,
                "fitted_step": self.fitter.fitted_step, "config": self.config.to_dict()}

    def save_checkpoint(self, folder: str) -> None:
        """Write the session's state (`STATE_FILE`) and its cost models (`CHECKPOINT_FILE`, once fitted or given)
        into a checkpoint folder (local; the state is equal on every rank, so one rank writes it)."""
        with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(self.state_dict(), f, sort_keys=True)
        data = self.model_state()
        if data is not None:
            with open(os.path.join(folder, CHECKPOINT_FILE), "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)

    # -- resume point: the session's one state (a torchtitan-style Stateful) --------------------------
    def track_loader(self, loader, position: Callable[[], dict], restore: Callable[[dict], None],
                     workers: int = 0) -> None:
        """`track` a `BalancedLoader`: its settings (`BalancedLoader.settings`) plus the DataLoader's
        `workers` (they change the sample order too)."""
        self.track(lambda: {**loader.settings(), "dataloader_workers": int(workers)}, position, restore)

    def track(self, settings: Callable[[], dict], position: Callable[[], dict],
              restore: Callable[[dict], None]) -> None:
        """Carry one balanced loader's resume point in `state_dict`: `settings()` (what orders its samples, see
        `BalancedLoader.settings`), `position()` (where a resume continues) and `restore(position)`. A state
        loaded before the loader was tracked is applied now."""
        index = len(self._tracked)
        self._tracked.append((settings, position, restore))
        for pending in [p for p in self._pending_positions if p[0] == index]:
            self._pending_positions.remove(pending)
            self._restore_loader(index, pending[1], pending[2])

    def state_dict(self) -> dict:
        """The run's resume state (local, no collective; equal on every data-parallel rank): the format
        version, the data-parallel size, per tracked loader its settings and position (epoch, steps, raw
        batches read, the look-ahead window and its plan), and the cost models in force with their fitted step."""
        return {"version": STATE_VERSION, "data_parallel_size": self.data_parallel.size,
                "loaders": [{"settings": dict(settings()), "position": position()}
                            for settings, position, _ in self._tracked],
                "models": self.model_state()}

    def load_state_dict(self, state: Optional[dict], models: bool = True) -> None:
        """Resume from `state` (`state_dict`'s): data-parallel rank 0's state is broadcast (every rank calls this
        at once; other ranks may pass None), checked (`check_resume_state`), its cost models put in force (unless
        `models` is False: `start` read them already) and every loader's position restored, now or when the
        loader is tracked. A setting that orders the samples differently from the saved run raises naming it, on
        every rank alike."""
        state = self._agree_state(state)
        if state is None:
            return
        self.check_resume_state(state)
        for index, saved in enumerate(state.get("loaders", [])):
            if index < len(self._tracked):
                self._restore_loader(index, saved["settings"], saved["position"])
            else:
                self._pending_positions.append((index, saved["settings"], saved["position"]))
        if models:
            self.restore_models(state.get("models"))

    def _agree_state(self, state: Optional[dict]) -> Optional[dict]:
        """The state of the data-parallel slice's first rank, on every rank of the slice."""
        group = self.side.control_group
        if group is None or self.data_parallel.size == 1:
            return state
        import torch.distributed as dist

        box = [state if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(box, group_src=0, group=group)
        return box[0]

    def _restore_loader(self, index: int, saved: dict, position: dict) -> None:
        settings, _, restore = self._tracked[index]
        current = settings()
        differ = [f"{name}={saved.get(name)!r} (this run: {current.get(name)!r})"
                  for name in sorted(set(saved) | set(current)) if saved.get(name) != current.get(name)]
        if differ:
            raise ValueError(f"hf_dp_balance: rank {self.rank}: the resume state of balanced loader {index} was taken "
                             f"with {', '.join(differ)}: these settings decide which samples each step trains, so "
                             f"resuming under other values would train samples twice or never; resume with the "
                             f"saved values")
        restore(position)

    def restore_models(self, models: Optional[dict]) -> None:
        """Put saved cost models (`model_state`'s) in force on every loader: a resume plans as the saved run
        did, with no new warm-up from the prior. None: keep the models in force."""
        if not models or self.fitter is None:
            return
        self.fitter.restore(CostModel.from_dict(models["decoder"]),
                            CostModel.from_dict(models["vision"]) if models.get("vision") else None,
                            int(models.get("fitted_step", -1)))
        self.publish()

    def resume_state(self, **fields) -> dict:
        """A resume point stamped with the format version and the data-parallel size it was taken at."""
        return {"version": STATE_VERSION, "data_parallel_size": self.data_parallel.size, **fields}

    def check_resume_state(self, state: dict) -> dict:
        """`state` if it was taken by this format at this data-parallel size; else an error naming both."""
        version = state.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"hf_dp_balance: a resume state of version {version!r}; this library reads version "
                             f"{STATE_VERSION} (an older state does not record the settings that order the samples)")
        size = state.get("data_parallel_size")
        if size != self.data_parallel.size:
            raise ValueError(f"hf_dp_balance: the resume state was taken with data_parallel_size={size}, this run "
                             f"has {self.data_parallel.size}: each rank's place in the data would differ")
        return state

    # -- teardown -----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loaders' threads, take the hooks off, remove the vision balancer, undo the adapters'
        `patches`, close the side channel; each part even when an earlier one raised."""
        if self._closed:
            return
        self._closed = True
        try:
            try:
                for loader in reversed(self.loaders):
                    loader.close()
                self.loaders = []
                if self.recorder is not None:
                    self.recorder.remove()
                if self.vision is not None:
                    self.vision.remove()
                    if getattr(self._vision_model, "_dp_balance_vision", None) is self.vision:
                        del self._vision_model._dp_balance_vision
                    self.vision, self._vision_model = None, None
            finally:
                self.patches.undo()
        finally:
            self.side.close()

    @property
    def closed(self) -> bool:
        return self._closed


__all__ = ["BalanceSession", "CHECKPOINT_FILE", "STATE_FILE", "STATE_VERSION", "load_checkpoint_models",
           "read_checkpoint_state", "read_start_models"]
