"""`Patches`: the one undo registry of a run, and the changes both front ends make to framework objects.

A balanced run changes objects it does not own: a dataloader's collate is deferred (the library packs after the
exchange), a prepared loader keeps samples on the CPU, a Trainer's or Accelerator's methods are wrapped so their
distributed errors name the step, the session is registered for checkpointing. Every such change goes through a
`Patches`, which puts each back exactly as it found it, in reverse order, once. `BalanceSession` owns one
(`session.patches`), so whatever an adapter patched is undone by `session.close()`.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from hf_dp_balance.runtime.loader import list_collate
from hf_dp_balance.runtime.watchdog import TRAINING_PHASE, named_training_call

_MISSING = object()  # "the instance had no attribute of that name before"


class Patches:
    """Changes made to other objects, each with its undo. `undo()` runs every undo newest first, even when one
    raises (the first error is raised after all ran), and leaves the registry empty: a second `undo()` is a
    no-op. Usable as a context manager for a change that must not outlive a block."""

    def __init__(self):
        self._undo: List[Callable[[], None]] = []

    def add(self, undo: Callable[[], None]) -> None:
        """Register an undo for a change made elsewhere (a registration, a hook)."""
        self._undo.append(undo)

    def set(self, owner: Any, name: str, value: Any) -> None:
        """`owner.name = value`; undo puts back the instance's own attribute, or removes it when it had none (so
        a method looked up on the class is the class's again)."""
        before = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name, _MISSING)

        def undo():
            if before is not _MISSING:
                setattr(owner, name, before)
            elif name in vars(owner):
                delattr(owner, name)

        setattr(owner, name, value)
        self._undo.append(undo)

    def name_errors(self, owner: Any, name: str, loader: Callable[[], Any], step: Callable[[], int],
                    phase: str = TRAINING_PHASE) -> None:
        """Wrap the method `owner.name`: a torch.distributed error inside it (a peer killed while this rank is in
        the framework's collectives) is raised as the library's error naming `step()`, the rank and the phase,
        chained from it (`runtime.watchdog.training_errors`; `loader()`: the balanced loader iterated now).
        Anything else passes through untouched."""
        self.set(owner, name, named_training_call(getattr(owner, name), loader, step, phase))

    def undo(self) -> None:
        undo, self._undo = self._undo, []
        first: Optional[BaseException] = None
        for step in reversed(undo):
            try:
                step()
            except BaseException as exc:  # noqa: BLE001 - every undo runs; the first error is raised after
                first = first if first is not None else exc
        if first is not None:
            raise first

    def __len__(self) -> int:
        return len(self._undo)

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def defer_collate(dataloader: Any, patches: Patches, *, keep_on_cpu: bool = False) -> Any:
    """Make `dataloader` yield lists of raw samples (the library packs them after the exchange); returns the torch
    DataLoader whose collate was deferred (a prepared loader's `base_dataloader`, else `dataloader`).
    `keep_on_cpu`: a prepared loader's device placement is turned off too (samples cross ranks from the CPU,
    the packed rows are moved afterwards). Both are undone by `patches`."""
    inner = getattr(dataloader, "base_dataloader", dataloader)
    if getattr(inner, "collate_fn", None) is not list_collate:
        patches.set(inner, "collate_fn", list_collate)
    if keep_on_cpu and getattr(dataloader, "device", None) is not None:
        patches.set(dataloader, "device", None)
    return inner


def register_for_checkpointing(accelerator: Any, state_owner: Any, patches: Patches) -> None:
    """`accelerator.register_for_checkpointing(state_owner)` (its `save_state` / `load_state` carry the
    owner's `state_dict`), taken back by `patches`."""
    register = getattr(accelerator, "register_for_checkpointing", None)
    if register is None:
        return
    register(state_owner)

    def undo():
        objects = getattr(accelerator, "_custom_objects", [])
        objects[:] = [obj for obj in objects if obj is not state_owner]

    patches.add(undo)


__all__ = ["Patches", "defer_collate", "register_for_checkpointing"]
