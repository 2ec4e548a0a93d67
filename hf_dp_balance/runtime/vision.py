"""Balance the vision encoder's compute across data-parallel ranks, inside the forward pass.

`balance_vision_encoder(model)` hooks the vision tower of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL
model: every training forward gathers every rank's item grids, plans with `plan_balance` on per-frame item
costs (the same on every rank), moves only the moved items' pixels, runs the real tower and sends the
embeddings back, differentiably. Guarantees: every rank joins every collective (also with no images), the
result equals the unbalanced model's, and nothing runs in eval mode or without a group of size > 1.
The five steps and why they are exact: docs/vision.md.
"""

from __future__ import annotations

import collections
import inspect
from typing import Callable, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch

from hf_dp_balance.core.costing import item_costs
from hf_dp_balance.core.routing import VisionRoute, route_items, rows_in_order, take_rows
from hf_dp_balance.runtime.all_to_all import all_to_all_rows, named_failure, wait_for
from hf_dp_balance.runtime.exchange import (ExchangeError, differing_ranks, failure_detail, failure_message,
                                            read_failures)
from hf_dp_balance.runtime.logs import get_logger
from hf_dp_balance.runtime.vision_towers import LocalItems, find_inner

__all__ = ["balance_vision_encoder", "VisionBalancer"]

logger = get_logger(__name__)
# Per-forward stats kept until popped; older ones are dropped if nobody pops them.
_MAX_STATS = 1024


# --------------------------------------------------------------------------- autograd pieces


class _TieGradient(torch.autograd.Function):
    """Identity on `x` that makes `deps` part of x's autograd graph (their gradient is zero).

    Ties the returned embeddings to the decoder's input so that the backward
    all_to_all runs on every rank, also on one whose embeddings are empty.
    """

    @staticmethod
    def forward(ctx, x, *deps):
        ctx.dep_meta = [(d.shape, d.dtype, d.device) for d in deps]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.dep_meta)


# --------------------------------------------------------------------------- the wrapper (imperative shell)


class VisionBalancer:
    """Forward hooks on one model that balance its vision tower across the group's ranks.

    Attached as `model._dp_balance_vision` by `balance_vision_encoder`.
    `pop_stats()` returns and clears the per-forward statistics (one dict per
    training forward): applied, reason, items (whole group), items_moved,
    local_items / computed_items (this rank: owned / run here), pixel_bytes_moved /
    embedding_bytes_moved (whole group, forward; the backward moves the
    embedding bytes again), imbalance_before / imbalance_after (slowest rank's
    predicted vision cost over the mean, minus 1: core.steps.step_imbalance), makespan_before / makespan_after.
    `remove()` takes the hooks off. Only the last 1024 forwards are kept.
    """

    def __init__(self, model, config=None, *, group=None, cost_model=None):
        import torch.distributed as dist

        from hf_dp_balance.config import DPBalanceConfig
        from hf_dp_balance.core.cost import CostModel

        self.config = config if config is not None else DPBalanceConfig()
        self.cost_model = cost_model if cost_model is not None else CostModel.default_vision()
        self.inner, self.tower = find_inner(model)
        self._owns_group = False
        # None, a DeviceMesh or a DataParallelGroup: a group of its own over those ranks
        made = group is None or not (dist.is_available() and isinstance(group, dist.ProcessGroup))
        if made and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # An own communicator with the data-parallel ranks and the default backend: the
            # backward all_to_all then never interleaves with DDP's gradient
            # all-reduce on the default group (orders could differ across ranks).
            from hf_dp_balance.runtime.parallel import resolve_data_parallel_group
            from hf_dp_balance.runtime.side_channel import new_side_group

            data_parallel = resolve_data_parallel_group(explicit=group)  # None: every process
            group = new_side_group(data_parallel, self.config.timeout_s, dist.get_backend())
            self._owns_group = True  # remove() destroys it (each gloo group is a mesh of sockets and threads)
        elif made:
            group = None
        self.group = group
        self.forwards = 0  # balanced training forwards so far (named in errors)
        # () -> the optimizer step the user sees, for errors; the callback may set it (default: none)
        self.step_source: Optional[Callable[[], int]] = None
        self._stats: Deque[dict] = collections.deque(maxlen=_MAX_STATS)
        self._pending_tie: Optional[torch.Tensor] = None
        self._handles = [
            self.inner.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            self.inner.language_model.register_forward_pre_hook(self._before_decoder, with_kwargs=True),
            self.inner.register_forward_hook(self._after_forward),
        ]

    # -- public -------------------------------------------------------------------

    def pop_stats(self) -> List[dict]:
        stats = list(self._stats)
        self._stats.clear()
        return stats

    def remove(self) -> None:
        """Take the hooks off and destroy the process group this balancer created (end of training)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._owns_group:
            import torch.distributed as dist

            self._owns_group = False
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - already torn down with the default group
                pass

    # -- hooks --------------------------------------------------------------------

    def _active(self) -> bool:
        import torch.distributed as dist

        return (self.inner.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.group) > 1)

    def _before_forward(self, module, args, kwargs):
        self._pending_tie = None
        if not self._active():
            return None
        if args:  # positional call: name everything so pixel_values can be replaced
            bound = inspect.signature(self.inner.forward).bind(*args, **kwargs)
            extra = bound.arguments.pop("kwargs", {})
            kwargs, args = {**bound.arguments, **extra}, ()
        kwargs = dict(kwargs)
        out = self.balanced_encode(kwargs)
        if out is None:
            return None
        encoder_outputs, used_keys, tie = out
        for key in used_keys:
            kwargs[key] = None
        if encoder_outputs:
            kwargs["mm_encoder_outputs"] = encoder_outputs
        self._pending_tie = tie
        return args, kwargs

    def _before_decoder(self, module, args, kwargs):
        tie, self._pending_tie = self._pending_tie, None
        if tie is None:
            return None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise ValueError("balance_vision_encoder: the decoder was called without inputs_embeds; "
                             "cannot tie the vision exchange into the backward")
        kwargs = dict(kwargs)
        kwargs["inputs_embeds"] = _TieGradient.apply(embeds, tie)
        return args, kwargs

    def _after_forward(self, module, args, output):
        if self._pending_tie is not None:  # the decoder never ran: the backward would hang
            self._pending_tie = None
            raise RuntimeError("balance_vision_encoder: the language model was not called in this forward")
        return None

    # -- one balanced forward ---------------------------------------------------------

    def _where(self, phase: str) -> str:
        import torch.distributed as dist

        step = f"step {self.step_source()}, " if self.step_source is not None else ""
        return (f"hf_dp_balance vision balancing, {step}forward {self.forwards}, rank {dist.get_rank(self.group)}, "
                f"phase {phase}")

    def _collective(self, phase: str, start) -> None:
        """Post one collective on the group (`start()` calls it with `async_op=True`, returns the work) and wait
        for it at most `timeout_s`. On NCCL a timed wait blocks this thread until the collective ends, so a
        failure raises here, named, rather than later in the backend's own watchdog."""
        def post_and_wait():
            work = start()
            if work is not None:  # (None: this rank is not in the group; nothing was posted)
                wait_for(work, self.config.timeout_s)

        self._named(phase, post_and_wait)

    def _named(self, phase: str, fn):
        """fn(): a distributed failure or a timeout raises `ExchangeError` naming step, rank and phase; any other
        error is this rank's own and is named as such."""
        try:
            return fn()
        except ExchangeError:
            raise
        except Exception as exc:  # noqa: BLE001 - sorted into this rank's own error or the collective's
            raise named_failure(self._where(phase), self.config.timeout_s, exc) from exc

    def _agree(self, phase: str, value: int, error: Optional[str],
               fatal: Optional[str] = None) -> Tuple[bool, Dict[int, str]]:
        """(whether every rank passed the same int64 `value`, {rank: message} of the ranks that passed `error`).

        One fixed-size `all_reduce` (MAX) of four int64 per rank, [error, fatal, value, -value], whatever the
        number of ranks; one all_gather of the messages only when some rank failed. A rank that passes
        `fatal` (its own step broke) makes every rank raise `ExchangeError` naming the failed ranks.
        """
        import torch.distributed as dist

        value = int(value)
        vec = torch.tensor([error is not None, fatal is not None, value, -value], dtype=torch.int64,
                           device=self._comm_device())
        self._collective(f"{phase} all_reduce", lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=self.group,
                                                                        async_op=True))
        flags = vec.cpu().tolist()
        if not (flags[0] or flags[1]):
            return flags[2] == -flags[3], {}
        failed = self._failures(fatal if fatal is not None else error)
        if flags[1]:
            raise ExchangeError(f"{self._where(phase)}: rank(s) {sorted(failed)} failed: {failure_detail(failed)}")
        return flags[2] == -flags[3], failed

    def _agree_plan(self, plan, failure: Optional[str], fatal: Optional[str]) -> Dict[int, str]:
        """{rank: message} of the ranks whose planner failed (the same on every rank; empty: every plan agreed).

        `_agree` on a digest of the plan, before anything moves: a rank whose own step broke (`fatal`) makes
        every rank raise; plans that differ while no planner failed raise `ExchangeError` on every rank, naming
        the ranks whose plan differs from the majority's (a tie: from rank 0's; one all_gather on that path).
        """
        import torch.distributed as dist

        from hf_dp_balance.runtime.step_rows import plan_digest

        digest = 0 if plan is None else plan_digest(np.asarray([bool(plan.applied)]), np.asarray(plan.dest))
        same, failed = self._agree("plan check", digest, failure, fatal)
        if failed or same:
            return failed
        mine = torch.tensor([digest], dtype=torch.int64, device=self._comm_device())
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self.group))]
        self._collective("plan check all_gather", lambda: dist.all_gather(every, mine, group=self.group,
                                                                          async_op=True))
        digests = torch.cat(every).cpu().numpy()
        odd = differing_ranks(digests)
        raise ExchangeError(f"{self._where('plan check')}: the plan of rank(s) {odd} differs from the other ranks' "
                            f"(digests {[f'{int(d):013x}' for d in digests]}); every rank plans from the same "
                            f"gathered grids, so the cost model or the planner differs on those ranks")

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist

        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather_grids(self, grids: np.ndarray, error: Optional[str] = None) -> Tuple[np.ndarray, np.ndarray]:
        """(item_rank, grids) of every item of every rank, rank-major (two all_gathers).

        The first gather carries a failure flag: when any rank passes `error` (its pixel rows are bad),
        every rank raises `ExchangeError` naming those ranks and their messages (one more gather).
        """
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        dev = self._comm_device()
        count = torch.tensor([grids.shape[0], error is not None], dtype=torch.int64, device=dev)
        counts = [torch.zeros_like(count) for _ in range(world)]
        self._collective("item count all_gather", lambda: dist.all_gather(counts, count, group=self.group,
                                                                          async_op=True))
        counts = torch.stack(counts).cpu().tolist()
        if any(c[1] for c in counts):
            failed = self._failures(error)
            raise ExchangeError(f"{self._where('local items')}: rank(s) {sorted(failed)} failed: "
                                + failure_detail(failed))
        counts = [int(c[0]) for c in counts]
        width = max(counts)
        if width == 0:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
        padded = torch.zeros((width, 3), dtype=torch.int64, device=dev)
        padded[:grids.shape[0]] = torch.as_tensor(grids, dtype=torch.int64)
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        self._collective("item grids all_gather", lambda: dist.all_gather(gathered, padded, group=self.group,
                                                                          async_op=True))
        all_grids = np.concatenate([g[:c].cpu().numpy() for g, c in zip(gathered, counts)])
        item_rank = np.repeat(np.arange(world, dtype=np.int64), counts)
        return item_rank, all_grids

    def _failures(self, error: Optional[str]) -> Dict[int, str]:
        """{rank: message} of every rank that passes `error` (one all_gather of fixed-size text, first byte a
        flag; every rank calls it)."""
        import torch.distributed as dist

        msg = failure_message(error).to(self._comm_device())
        msgs = [torch.zeros_like(msg) for _ in range(dist.get_world_size(self.group))]
        self._collective("failure message all_gather", lambda: dist.all_gather(msgs, msg, group=self.group,
                                                                               async_op=True))
        return read_failures(msgs)

    def balanced_encode(self, kwargs: dict):
        """Run steps 1-5 for this rank's forward kwargs.

        Returns None when the plan is skipped (the model then runs its own
        images), else (mm_encoder_outputs for this rank, pixel kwargs to clear,
        tensor to tie into the decoder input or None).

        Every rank enters the same collectives in the same order. A failure of this rank's own part (its
        input, its pixel rows, its tower) reaches every rank at the next fixed-size agreement (the item
        count gather, the plan check, the tower check) and every rank raises one `ExchangeError` naming the
        step, the phase and the failed ranks; a planner that fails on any rank makes every rank keep its
        images (planning never stops training); plans that differ raise on every rank before anything moves.
        """
        import torch.distributed as dist

        from hf_dp_balance.core.planner import plan_balance
        from hf_dp_balance.core.steps import step_imbalance

        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.forwards += 1
        items, used, error = None, [], None  # mm_encoder_outputs precomputed by the caller: take part with no items
        if kwargs.get("mm_encoder_outputs") is None:
            try:
                items, used = self.tower.local_items(kwargs, rank)
            except Exception as exc:  # noqa: BLE001 - bad input here: every rank raises at the gather, none times out
                error = f"{type(exc).__name__}: {exc}"
        local_grids = items.grids if items is not None else np.zeros((0, 3), dtype=np.int64)
        item_rank, grids = self._gather_grids(local_grids, error)
        n_local = int(local_grids.shape[0])
        stats = {"applied": False, "items": int(grids.shape[0]), "items_moved": 0,
                 "pixel_bytes_moved": 0, "embedding_bytes_moved": 0,
                 "local_items": n_local, "computed_items": n_local}
        if grids.shape[0] == 0:
            self._stats.append({**stats, "reason": "no images on any rank"})
            return None

        plan, failure = None, None
        try:
            plan = plan_balance(item_costs(grids, self.cost_model), item_rank, world, min_gain=self.config.min_gain,
                                tolerance=self.config.move_tolerance)
        except Exception as exc:  # noqa: BLE001 - agreed below: every rank keeps its images alike
            failure = f"{type(exc).__name__}: {exc}"
        route, send, kept, moves, own = None, None, None, {}, None
        if plan is not None and plan.applied and (np.asarray(plan.dest) != item_rank).any():
            try:  # this rank's part of the pixel exchange, before the plan check: a failure here is agreed there
                route = self._route(item_rank, grids, np.asarray(plan.dest, dtype=np.int64), moves)
                send, kept = self._pixel_rows(items, route)
            except Exception as exc:  # noqa: BLE001 - raised on every rank by the plan check
                own = exc
        failed = self._agreed(lambda: self._agree_plan(plan, failure, _text(own)), own)
        if failed:
            detail = failure_detail(failed)
            logger.warning("%s: planning failed on rank(s) %s; every rank keeps its images: %s",
                           self._where("plan check"), sorted(failed), detail)
            self._stats.append({**stats, "reason": f"planning failed on rank(s) {sorted(failed)}: {detail}"})
            return None
        stats.update(reason=plan.reason, makespan_before=float(plan.makespan_before),
                     makespan_after=float(plan.makespan_after),
                     imbalance_before=step_imbalance(plan.loads_before[:, None], "step"),
                     imbalance_after=step_imbalance(plan.loads_after[:, None], "step"))
        if not plan.applied:
            stats["imbalance_after"] = stats["imbalance_before"]
            self._stats.append(stats)
            return None
        if route is None:  # same plan on every rank: every rank skips the payload exchange alike
            stats["imbalance_after"] = stats["imbalance_before"]
            self._stats.append({**stats, "reason": "plan moves no item"})
            return None
        stats.update(moves)

        received = self._exchange_pixels(send, route)
        try:
            pixels = received if kept.shape[0] == 0 else kept if received.shape[0] == 0 else torch.cat([kept, received])
            computed, differentiable = self._encode(pixels, grids[route.computed_items], kwargs)
            kept_out_rows = int(items.out_rows[route.kept_items].sum()) if items is not None else 0
            kept_out, moved_out = computed[:kept_out_rows], computed[kept_out_rows:]
            own = None
        except Exception as exc:  # noqa: BLE001 - raised on every rank by the tower check
            own = exc
        # before the embeddings travel: a rank whose tower failed never reaches the return, its peers would wait
        self._agreed(lambda: self._agree("tower forward", 0, None, _text(own)), own)
        back = self._return_embeddings(moved_out, route, differentiable)
        self._stats.append(stats)
        tie = back if differentiable else None
        if items is None:
            return {}, used, tie
        return self._own_outputs(items, kept_out, back, route), used, tie

    @staticmethod
    def _agreed(agreement, own: Optional[BaseException]):
        """`agreement()`; an `ExchangeError` it raises carries this rank's own exception `own` as its cause."""
        try:
            return agreement()
        except ExchangeError as err:
            if own is not None:
                raise err from own
            raise

    def _route(self, item_rank: np.ndarray, grids: np.ndarray, dest: np.ndarray, stats: dict) -> VisionRoute:
        """This rank's route for the planned `dest`; records the moved items and bytes in `stats`."""
        import torch.distributed as dist

        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        moved = dest != item_rank
        in_rows = grids.prod(axis=1) if self.tower.family != "internvl" else np.ones(len(grids), dtype=np.int64)
        out_rows = self.tower.out_rows(grids)
        route = route_items(item_rank, dest, in_rows, out_rows, rank, world)
        elem = torch.empty((), dtype=self.tower.module.dtype).element_size()
        stats.update(applied=True, items_moved=int(moved.sum()), computed_items=int(route.computed_items.size),
                     pixel_bytes_moved=int(in_rows[moved].sum()) * self.tower.row_width * elem,
                     embedding_bytes_moved=int(out_rows[moved].sum()) * self.tower.out_width * elem)
        return route

    def _no_rows(self, width: int) -> torch.Tensor:
        device = self.tower.module.device if hasattr(self.tower.module, "device") else self._comm_device()
        return torch.zeros((0, width), dtype=self.tower.module.dtype, device=device)

    def _pixel_rows(self, items: Optional[LocalItems], route: VisionRoute) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows this rank sends, in destination order; rows of the items it keeps): no communication."""
        no_rows = self._no_rows(self.tower.row_width)
        if items is None:
            return no_rows, no_rows
        return (take_rows(items.pixel_parts, rows_in_order(items.in_rows, route.send_order), no_rows),
                take_rows(items.pixel_parts, rows_in_order(items.in_rows, route.kept_items), no_rows))

    def _exchange_pixels(self, send: torch.Tensor, route: VisionRoute) -> torch.Tensor:
        """Step 3: moved items' pixels to the planned ranks (no gradient: pixels are inputs); the rows received,
        by source rank."""
        import torch.distributed as dist

        received = send.new_empty((sum(route.recv_in_rows), self.tower.row_width))
        self._collective("pixel all_to_all", lambda: dist.all_to_all_single(
            received, send.contiguous(), output_split_sizes=route.recv_in_rows,
            input_split_sizes=route.send_in_rows, group=self.group, async_op=True))
        return received

    def _encode(self, pixels: torch.Tensor, grids: np.ndarray, kwargs: dict) -> Tuple[torch.Tensor, bool]:
        """Step 4: the real tower on the items computed here; (embedding rows, whether differentiable)."""
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in self.tower.module.parameters())
        if grids.shape[0]:
            computed = self.tower.compute(pixels, grids, kwargs)
        else:
            computed = self._no_rows(self.tower.out_width)
        if computed.shape[1] != self.tower.out_width:
            import torch.distributed as dist

            raise ValueError(f"rank {dist.get_rank(self.group)}: vision tower gave width {computed.shape[1]}, "
                             f"expected {self.tower.out_width}")
        if differentiable and not computed.requires_grad:
            # Nothing computed here: a leaf keeps this rank in the backward all_to_all.
            computed = computed.detach().requires_grad_(True)
        return computed, differentiable

    def _return_embeddings(self, moved_out: torch.Tensor, route: VisionRoute, differentiable: bool) -> torch.Tensor:
        """Step 5: moved items' embeddings back to their owners (gradients the reverse way in the backward)."""
        import torch.distributed as dist

        if differentiable:
            return self._named("embedding all_to_all", lambda: all_to_all_rows(
                moved_out, route.send_out_rows, route.recv_out_rows, group=self.group,
                where=self._where("embedding gradient all_to_all (backward)"), timeout_s=self.config.timeout_s))
        back = moved_out.new_empty((sum(route.recv_out_rows), self.tower.out_width))
        self._collective("embedding all_to_all", lambda: dist.all_to_all_single(
            back, moved_out.contiguous(), output_split_sizes=route.recv_out_rows,
            input_split_sizes=route.send_out_rows, group=self.group, async_op=True))
        return back

    def _own_outputs(self, items: LocalItems, kept_out: torch.Tensor, back: torch.Tensor, route: VisionRoute):
        """This rank's `mm_encoder_outputs`: its kept and returned rows, back in local item order."""
        rows = back if kept_out.shape[0] == 0 else kept_out if back.shape[0] == 0 else torch.cat([kept_out, back])
        restore = route.restore_rows
        if not (restore.size == rows.shape[0] and (restore == np.arange(restore.size)).all()):
            rows = rows.index_select(0, torch.from_numpy(restore).to(rows.device))
        return self.tower.encoder_outputs(rows, items)


def _text(exc: Optional[BaseException]) -> Optional[str]:
    """"Type: message" of this rank's own exception (None: none), as the agreements carry it."""
    return None if exc is None else f"{type(exc).__name__}: {exc}"


def balance_vision_encoder(model, config=None, *, group=None, cost_model=None):
    """Balance the vision tower of `model` across the data-parallel ranks, in place; returns `model`.

    `model`: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL model (the
    `...ForConditionalGeneration` or its base model), before DDP / Accelerate
    wrapping. Call it on every rank. `group`: a `ProcessGroup` of the data-parallel ranks, used as is;
    else a group of its own is made (on every process) over the ranks of a 1-D `DeviceMesh`
    (`mesh["dp"]`) or a `DataParallelGroup`, or of every process (None). `config`: `DPBalanceConfig`
    (reads `min_gain`, `move_tolerance`, `timeout_s`); `cost_model`: the vision `CostModel` (default
    `CostModel.default_vision()`; replace it with `model._dp_balance_vision.cost_model = fitted`).
    Calling it twice replaces the previous wrapper.
    """
    previous = getattr(model, "_dp_balance_vision", None)
    if previous is not None:
        previous.remove()
    balancer = VisionBalancer(model, config, group=group, cost_model=cost_model)
    model._dp_balance_vision = balancer
    return model
