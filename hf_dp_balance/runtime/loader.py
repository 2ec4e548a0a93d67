"""`BalancedLoader`: plan and exchange each optimizer step's samples one step ahead, in a thread.

One planning rank plans each step and sends every rank its orders (inside look-ahead windows every rank
plans from the same gathered numbers and they compare digests), so every rank follows the same plan; a
planner failure keeps every sample in place on every rank alike (planning never stops training); a plan
changes where a sample is computed, never which samples a step trains; every rank yields the same number of
micro-batches per step. The per-step pipeline and look-ahead: docs/exchange.md.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core.codec import transfer_layout
from hf_dp_balance.core.costing import planning_costs, sample_grids
from hf_dp_balance.core.steps import plan_hash, slot_loads, step_imbalance
from hf_dp_balance.runtime.exchange import (H_NUM_MICRO, O_APPLIED, O_BEFORE, O_AFTER, O_MOVED, O_MOVED_BYTES,
                                            O_NUM_MICRO, O_NUM_SAMPLES, O_OFFSET, O_STATUS, PLANNER, STATUS_END,
                                            STATUS_FAILED, ExchangeError, SampleExchange, StepOrders, failure_detail)
from hf_dp_balance.runtime.logs import get_logger
from hf_dp_balance.runtime.step_rows import (F_COST, F_MICRO, F_NBYTES, F_STEP, F_TOKENS, F_VISION, F_WIDTH, Prepared,
                                             StepStats, StepWork, agree_lookahead, agree_plan, check_cap, collate_slots,
                                             cost_rows, describe_samples, gather_step, list_collate,
                                             pull_micro_batches, slot_members, slot_samples, step_decision,
                                             step_header, validate_plan)
from hf_dp_balance.runtime.planned_step import local_layout, orders_for_ranks, slots_of
from hf_dp_balance.runtime.step_plan import plan_work, planner_for, token_cap
from hf_dp_balance.runtime.step_stream import StepStream

logger = get_logger(__name__)


class BalancedLoader:
    """Wrap a prepared train dataloader whose micro-batches are lists of sample dicts.

    Iterating yields packed micro-batches (one packed row each), grouped by
    optimizer step (`gradient_accumulation_steps` per step, fewer in the last
    step of an epoch), balanced across ranks. `iter_steps()` yields the
    step's list instead. Attributes it does not define (`dataset`, `sampler`,
    `batch_sampler`, ...) come from the wrapped dataloader; `__len__` is its
    length in micro-batches.

    The cost model can be replaced between steps from the main thread
    (`set_cost_model`); each rank puts its own current costs into the gather,
    so all ranks still plan from the same numbers. Balancing happens only in
    steps where every rank has it switched on (`set_balancing`) and has a
    cost model.

    Collaborators are injectable (tests use plain text samples): `collator`
    (list of sample dicts -> packed batch; default `PackedCollator(model_config,
    config.max_tokens)`), `features_fn` (sample -> (tokens, vision) where vision
    lists the sample's vision items as (t, h, w) grids or patch counts of one-frame
    items (`core.costing.item_grids`), or is just their count (an int: then no
    vision cost can be planned); default `sample_features` and the sample's grids),
    `plan_fn` (default `planner.plan_step`, within fixed partners beyond `config.max_partners + 1` ranks). `packed_input` (a `runtime.packed_input.PackedInput`): the
    micro-batches are the user's packed rows; they are split into samples before planning, every slot goes
    back in their layout, and without `config.max_tokens` the cap is the step's longest row (ratio 1.0).
    `on_fatal` (message -> None: what the watchdog does when a peer stops answering while training;
    default: log it and exit 1, see `runtime.watchdog`).

    `close()` ends the thread and destroys the side groups this loader created (end of training).
    """

    raw_batches_per_micro = 1  # raw batches read per micro-batch slot (a resume skips as many)

    def __init__(self, dataloader: Iterable, config: Optional[DPBalanceConfig] = None, *,
                 gradient_accumulation_steps: int = 1, model_config: Any = None,
                 collator: Optional[Callable[[list], Any]] = None,
                 features_fn: Optional[Callable[[dict], Tuple[int, int]]] = None,
                 plan_fn: Optional[Callable] = None, cost_model: Any = None,
                 exchange: Optional[SampleExchange] = None, sync: Optional[str] = None,
                 id_key: Optional[str] = None, balancing: bool = True, speed: float = 1.0,
                 packed_input: Any = None, on_fatal: Optional[Callable[[str], None]] = None,
                 side_channel: Any = None):
        self.dataloader = dataloader
        self.config = config if config is not None else DPBalanceConfig()
        self.packed_input = packed_input  # runtime.packed_input.PackedInput: the user's micro-batches are packed rows
        if packed_input is not None:
            collator = collator or packed_input.collate
            packed_input.max_tokens = self.config.max_tokens  # a user's micro-batch above the cap: refused at its step
            if self.config.max_tokens is None:  # the cap is the step's longest user row (see token_cap)
                self.config = dataclasses.replace(self.config, max_token_ratio=1.0)
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps}: must be >= 1")
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        if collator is None or features_fn is None:
            if model_config is None:
                raise ValueError("BalancedLoader needs model_config (for PackedCollator / sample_features) "
                                 "unless both collator and features_fn are given")
            from hf_dp_balance.core.packing import PackedCollator, sample_features

            collator = collator or PackedCollator(model_config, max_tokens=self.config.max_tokens)
            if features_fn is None:
                def features_fn(sample, _cfg=model_config):
                    f = sample_features(sample, _cfg)
                    return int(f.tokens), sample_grids(sample, f.vision_items)  # grids: per-frame costing
        self.collator = collator
        self.features_fn = features_fn
        sync = sync or self.config.sync
        self.sync = "step" if sync == "auto" else sync  # `auto` without a framework to ask: DDP semantics
        self.id_key = id_key
        # (decoder, vision, version): the models in force for the steps the thread prepares; version counts the
        # set_cost_model calls, equal on every rank (the same broadcast fits, in the same order)
        self._models = (cost_model, None, 0)
        # models set but not yet in force: (first step they cost, models), oldest first (`set_cost_model`)
        self._scheduled: List[tuple] = []
        self._models_lock = threading.Lock()
        self._speeds = {0: float(speed)}  # models version -> the speed this rank plans with under it
        # versions whose models are a prior (planned hedged); never removed, so a step costed with one is
        # hedged on every rank whenever its thread plans it, even after a fit has landed
        self._prior_versions: set = set()
        self._probe = False  # prior-costed steps probe the cost's shape for a step-time fit (`set_cost_model`)
        self._balancing = bool(balancing)
        self._speed = float(speed)
        # The side groups and the watchdog belong to the run's SideChannel (a session's); a loader made alone
        # (no side channel, no exchange) makes its own and closes it with itself.
        self._owned_side = None
        if side_channel is None and exchange is None:
            from hf_dp_balance.runtime.side_channel import SideChannel

            side_channel = self._owned_side = SideChannel(None, self.config, on_fatal=on_fatal)
        self.side_channel = side_channel
        self._exchange = exchange if exchange is not None else side_channel.exchange()
        self._watchdog = side_channel.watchdog if side_channel is not None and self.config.watchdog else None
        self.plan_fn = planner_for(self._exchange.world_size, self.config, plan_fn)  # partners bounded at scale
        self.step_offset = 0  # the user's step of the next stream's first step (errors name it)
        self._stats: List[StepStats] = []
        self._stats_lock = threading.Lock()
        self._window_plans: dict = {}   # stream step of a window's first step -> its plan (window_state)
        self._resume_window: Optional[dict] = None  # a saved window the next pass starts inside
        self._active: Optional[StepStream] = None

    # -- settings from the main thread (read by the thread at the start of each step) ----------
    def set_cost_model(self, cost_model: Any, vision: Any = None, prior: bool = False, probe: bool = False) -> None:
        """Plan the steps prepared from now on with `cost_model.sample_costs(tokens)` per sample, plus
        `vision`'s cost of the sample's images when given (see `planning_costs`: give it when the vision
        tower is not balanced on its own). None as `cost_model` switches planning off. `prior`: the models
        are a FLOP prior, not fitted to this machine (the warm-up): each step's placement holds up under
        both the prior and the tokens (`core.hedge.hedged_plan`; never worse than the token-balanced plan
        there). With `probe` as well (the fit will see only step times: `fit_mode="step_max"`) it is
        `core.hedge.probe_plan`'s instead: token-balanced, or one that tells the fit how heavy attention is
        (never worse than the token-balanced plan under the tokens, the prior and a 3x heavier attention
        share). Per-rank fits see every rank's time, so they need no probing and keep the hedged plan.

        Every rank must make the same calls in the same order (the callback does: one broadcast fit):
        a step is balanced only when every rank costed its rows with the same call's models."""
        with self._models_lock:
            latest = self._latest_models()
            version = latest[2] + 1
            if prior:
                self._prior_versions.add(version)  # before the models: a thread that sees the version finds it
            self._probe = bool(probe)  # one value per run (the fit mode), the same on every rank
            self._speeds[version] = self._speeds[latest[2]]
            start = self._first_unprepared_step()
            if start is None:
                self._models, self._scheduled = (cost_model, vision, version), []
            else:
                self._scheduled.append((start, (cost_model, vision, version)))

    def _latest_models(self) -> tuple:
        return self._scheduled[-1][1] if self._scheduled else self._models

    def _first_unprepared_step(self) -> Optional[int]:
        """The first step the thread cannot have prepared yet (None: no stream runs, nothing is prepared).

        New models take effect there, not at whatever step the thread happens to prepare next: the step is a
        function of the steps consumed so far, so every process (tp/cp peers in other data-parallel groups,
        which never gather with this one, included) plans each step with the same models. The thread runs at
        most `prefetch_steps` queued steps plus the window in hand ahead of the consumer; one step while it
        waits for a first model (`StepStream`)."""
        stream = self._active
        if stream is None or stream.done:
            return None
        reach = 1 if self.waits_for_model() else self.config.prefetch_steps + max(1, self.config.lookahead_steps)
        return stream.first_step + stream.consumed + reach

    def _models_for(self, step: int) -> tuple:
        """The models that cost `step` (thread side): the newest whose first step has come."""
        with self._models_lock:
            while self._scheduled and self._scheduled[0][0] <= step:
                self._models = self._scheduled.pop(0)[1]
            return self._models

    def set_balancing(self, enabled: bool) -> None:
        self._balancing = bool(enabled)

    def waits_for_model(self) -> bool:
        """Balancing is on but no cost model is set yet (`StepPhases`)."""
        return self._balancing and self.config.enabled and self.cost_model is None

    def set_step_offset(self, step: int) -> None:
        """The optimizer step the user sees at the start of the next pass (Trainer: `state.global_step`
        at the epoch's start, resume included). Errors and `StepStats.step` count from it."""
        self.step_offset = int(step)

    def set_speed(self, speed: float) -> None:
        """This rank's relative speed (1.0 = nominal) for heterogeneous ranks, from the newest models on."""
        if not speed > 0:
            raise ValueError(f"speed={speed!r}: must be > 0")
        with self._models_lock:
            self._speed = float(speed)
            self._speeds[self._latest_models()[2]] = float(speed)

    @property
    def cost_model(self):
        """The newest decoder model set (in force from its first step on)."""
        return self._latest_models()[0]

    @property
    def vision_cost_model(self):
        return self._latest_models()[1]

    @property
    def exchange(self) -> SampleExchange:
        return self._exchange

    def pop_stats(self) -> List[StepStats]:
        """Statistics of the steps consumed since the last call (oldest first)."""
        with self._stats_lock:
            out, self._stats = self._stats, []
        return out

    # -- dataloader protocol ------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.dataloader)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(epoch)

    def __getattr__(self, name: str):
        if name in ("dataloader", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def __iter__(self) -> Iterator[Any]:
        for batches in self.iter_steps():
            yield from batches

    def iter_steps(self, raw_iterator: Optional[Iterator] = None, step_limit: Optional[int] = None) -> Iterator[list]:
        """Yield each optimizer step's packed micro-batches (a list), balanced; the thread stops after `step_limit`."""
        stream = self.open_stream(raw_iterator if raw_iterator is not None else iter(self.dataloader), step_limit)
        try:
            while True:
                batches = stream.next_step()
                if batches is None:
                    return
                yield batches
        finally:
            stream.close()

    def open_stream(self, raw_iterator: Iterator, step_limit: Optional[int] = None) -> "StepStream":
        """Start the background pipeline over `raw_iterator` (micro-batches = lists of sample dicts).

        The first micro-batch is pulled here, in the calling thread: accelerate's
        `DataLoaderShard` synchronises RNG states with a collective on the
        training group at its first `next()`, which must not run in a thread.
        """
        if self._active is not None:
            self._active.close()
        with self._stats_lock:
            self._window_plans = {}
        self._active = StepStream(self, raw_iterator, step_limit, self._watchdog)
        self._prime(self._active, step_limit)
        return self._active

    def _prime(self, stream: StepStream, step_limit: Optional[int]) -> None:
        """Return once the thread has queued the steps it keeps ready (or ended, or failed).

        Runs in the caller's thread before its first step, where the caller waits for step 1 anyway.
        Without it the thread prepares steps 2..prefetch_steps+1 while step 1 trains: the first step
        overlaps `prefetch_steps` steps of pulling, gathering, moving and packing, every later step one.
        Costs the start `prefetch_steps - 1` steps of preparation once.
        """
        # Until a model is set the thread stays one step ahead (StepStream._wait_for_model_or_consumer).
        waits = self.waits_for_model()
        want = 1 if waits else self.config.prefetch_steps
        if step_limit is not None:
            want = min(want, step_limit)
        stream.wait_until_queued(want, self.config.timeout_s + 5.0)  # the gathers time out before this

    def stream_for(self, raw_iterator: Iterator, step_limit: Optional[int] = None) -> "StepStream":
        """The running stream over `raw_iterator`, started on first use (Trainer integration)."""
        if self._active is None or self._active.source is not raw_iterator:
            self.open_stream(raw_iterator, step_limit)
        return self._active

    def close(self) -> None:
        """Stop the thread; close the side channel when this loader made its own (else its owner closes it)."""
        if self._active is not None:
            self._active.close()
            self._active = None
        if self._owned_side is not None:
            self._owned_side.close()
            self._owned_side = None

    # -- one step, run in the background thread ----------------------------------------------
    def prepare_step(self, step: int, pull: Callable[[], Optional[list]]) -> Prepared:
        """Pull up to GA micro-batches and describe every sample (features, cost, encoded size)."""
        rank = self._exchange.rank
        if self.packed_input is not None:
            pull = self.packed_input.puller(pull, step, rank)
        micro_batches = pull_micro_batches(step, pull, self.gradient_accumulation_steps, rank)
        prep, grids = describe_samples(step, micro_batches, rank, self.features_fn, self.id_key)
        return cost_rows(prep, grids, self._models_for(step))  # one read: costs and version always match

    def _plan(self, work: StepWork, balance: bool, speeds: np.ndarray, hedge: bool = False):
        """`runtime.step_plan.plan_work` with this loader's world, config, sync and planner."""
        return plan_work(work, balance, speeds, self._exchange.world_size, self.config, self.sync, self.plan_fn, hedge,
                         probe=self._probe)

    def _asks(self, prep: Optional[Prepared]) -> Tuple[bool, bool, float]:
        """(whether this rank asks to balance the step, whether its models are a prior, its speed)."""
        # Balance only when every rank's rows were costed by a model: a model that lands while a rank is
        # preparing must not mix its costs with another rank's token stand-ins in one plan.
        wants = prep is not None and prep.model_version is not None and self._balancing and self.config.enabled
        prior = prep is not None and prep.model_version in self._prior_versions
        speed = self._speeds.get(prep.model_version, self._speed) if prep is not None else self._speed
        return wants, prior, speed

    def _gather(self, step: int, prep: Optional[Prepared], error: Optional[str]):
        """Every rank's rows on every rank (look-ahead windows): `gather_step`."""
        wants, prior, speed = self._asks(prep)
        return gather_step(self._exchange, step, prep, error, wants, speed, prior)

    def run_step(self, step: int, prep: Optional[Prepared], error: Optional[str]):
        """Collective part of a step. Returns (packed micro-batches, stats) or None at the end of the data.

        Every rank sends its metadata rows to the planning rank, which plans once and sends each rank its
        orders (`runtime.planned_step`); samples move point to point between the pairs that trade; every
        rank packs its slots and tells the planning rank, which answers every rank whether all packed.
        Every rank follows the one plan, so a planner failure keeps every sample in place on every rank alike.
        """
        ex = self._exchange
        t0 = time.perf_counter()
        wants, prior, speed = self._asks(prep)
        header = step_header(prep, error, wants, speed, prior)
        rows = prep.rows if prep is not None else None
        if ex.rank == PLANNER:
            orders, plan_s = self._plan_for_every_rank(step, prep, header, error)
        else:
            ex.send_rows(step, rows, header, error)
            orders, plan_s = ex.receive_orders(step), 0.0
        status = int(orders.head[O_STATUS])
        if status == STATUS_FAILED:
            raise ExchangeError(f"{orders.text} (raised on rank {ex.rank})")
        if status == STATUS_END:
            return None
        t1 = time.perf_counter()
        num_micro, offset, n_local = int(orders.head[O_NUM_MICRO]), int(orders.head[O_OFFSET]), len(prep.samples)
        layout = local_layout(orders, prep.rows[:, F_NBYTES].astype(np.int64), ex.world_size)
        received = ex.exchange_payloads(step, prep.samples, offset, layout, prep.entries)
        t2 = time.perf_counter()
        by_slot = slots_of(orders, num_micro)

        def samples_of(members):
            return [prep.samples[g - offset] if offset <= g < offset + n_local else received[g] for g in members]

        batches, ids = collate_slots(ex, self.collator, step, by_slot, samples_of, self.id_key)
        t3 = time.perf_counter()
        head = orders.head
        digest, _, reason = orders.text.partition("\n")
        stats = StepStats(
            step=step, num_micro_batches=num_micro, num_samples=int(head[O_NUM_SAMPLES]),
            applied=bool(head[O_APPLIED]), reason=reason, imbalance_before=float(head[O_BEFORE]),
            imbalance_after=float(head[O_AFTER]), moved_samples=int(head[O_MOVED]),
            moved_bytes=int(head[O_MOVED_BYTES]), bytes_sent=layout.bytes_sent, bytes_received=layout.bytes_received,
            plan_hash=digest, gather_s=t1 - t0 - plan_s, plan_s=plan_s, exchange_s=t2 - t1, collate_s=t3 - t2,
            local_samples=[len(s) for s in by_slot], local_ids=ids)
        return batches, stats

    def _plan_for_every_rank(self, step: int, prep: Optional[Prepared], header: np.ndarray, error: Optional[str]):
        """The planning rank: collect every rank's rows, plan the step once, send every rank its orders.

        Returns (this rank's orders, seconds spent planning). A failure reported by any rank, or a sample over
        the hard cap, becomes failed orders for every rank (each raises the same error); a planner failure
        keeps the start placement for every rank (planning never stops training).
        """
        ex = self._exchange
        world = ex.world_size
        meta, failed = ex.collect_rows(step, prep.rows if prep is not None else None, header, error, F_WIDTH)
        t0 = time.perf_counter()

        def send_all(orders):
            ex.send_orders(step, orders)
            return orders[ex.rank], time.perf_counter() - t0

        if failed:
            text = (f"hf_dp_balance sample exchange, step {step}: rank(s) {sorted(failed)} failed before the "
                    f"exchange: {failure_detail(failed)}")
            return send_all([StepOrders.failed(text)] * world)
        num_micro = int(meta.headers[:, H_NUM_MICRO].max())
        if num_micro == 0:
            return send_all([StepOrders.failed("end of data", STATUS_END)] * world)
        balance, speeds, hedge = step_decision(meta.headers)
        rows, owners = meta.rows, meta.owners
        micro = rows[:, F_MICRO].astype(np.int64)
        work = StepWork(step, rows, owners, owners, micro, num_micro, prep.samples, prep.entries)
        try:
            check_cap(work, self.config.max_tokens, ex.rank)
        except ExchangeError as exc:
            return send_all([StepOrders.failed(str(exc))] * world)
        dest_rank, dest_micro, applied, reason, failure = self._plan(work, balance, speeds, hedge)
        if failure is not None:  # only this rank plans: every rank follows its start placement
            detail = failure_detail({ex.rank: failure})
            logger.warning("hf_dp_balance: step %d: planning failed on rank %d (the planning rank); every rank "
                           "keeps its samples this step: %s", step, ex.rank, detail)
            reason = f"planner failed on rank(s) [{ex.rank}]: {detail}"
        costs = rows[:, F_COST]
        before = step_imbalance(slot_loads(costs, owners, micro, world, num_micro), self.sync, speeds)
        after = step_imbalance(slot_loads(costs, dest_rank, dest_micro, world, num_micro), self.sync, speeds)
        applied = applied or bool(np.any(owners != dest_rank))
        text = f"{plan_hash(dest_rank, dest_micro)}\n{reason}"
        return send_all(orders_for_ranks(owners, dest_rank, dest_micro, rows[:, F_NBYTES], world, num_micro,
                                         (applied, before, after), text))

    def _finish_step(self, work: StepWork, balance: bool, speeds: np.ndarray, t0: float, t1: float,
                     hedge: bool = False):
        """Plan from the start placement, move samples from their holders, pack every slot: (batches, stats).

        `t0` / `t1`: when the step's gather started / ended (for the statistics); `hedge`: see `_plan`.
        """
        ex, rows, holders = self._exchange, work.rows, work.holders
        check_cap(work, self.config.max_tokens, ex.rank)
        dest_rank, dest_micro, applied, reason, failure = self._plan(work, balance, speeds, hedge)
        if balance and ex.world_size > 1 and rows.shape[0]:  # the planner ran (on every rank alike)
            dest_rank, dest_micro, fallback = agree_plan(ex, work, dest_rank, dest_micro, failure)
            applied, reason = (False, fallback) if fallback is not None else (applied, reason)
        t2 = time.perf_counter()
        offset = int(np.searchsorted(holders, ex.rank))  # holders are rank-major
        layout = transfer_layout(holders, dest_rank, rows[:, F_NBYTES].astype(np.int64), ex.rank, ex.world_size)
        moved = holders != dest_rank
        moved_bytes = int(rows[moved, F_NBYTES].sum())
        received = ex.exchange_payloads(work.step, work.samples, offset, layout, work.entries) if moved.any() else {}
        t3 = time.perf_counter()
        by_slot = slot_members(dest_rank, dest_micro, ex.rank, work.num_micro)
        batches, ids = collate_slots(ex, self.collator, work.step, by_slot,
                                     lambda members: slot_samples(work, members, received, ex.rank), self.id_key)
        t4 = time.perf_counter()

        costs = rows[:, F_COST]
        before = slot_loads(costs, work.start_rank, work.start_micro, ex.world_size, work.num_micro)
        after = slot_loads(costs, dest_rank, dest_micro, ex.world_size, work.num_micro)
        stats = StepStats(
            step=work.step, num_micro_batches=work.num_micro, num_samples=int(rows.shape[0]),
            applied=applied or bool(moved.any()), reason=work.note + reason,
            imbalance_before=step_imbalance(before, self.sync, speeds),
            imbalance_after=step_imbalance(after, self.sync, speeds),
            moved_samples=int(moved.sum()), moved_bytes=moved_bytes,
            bytes_sent=layout.bytes_sent, bytes_received=layout.bytes_received,
            plan_hash=plan_hash(dest_rank, dest_micro), gather_s=t1 - t0, plan_s=t2 - t1, exchange_s=t3 - t2,
            collate_s=t4 - t3, local_samples=[len(s) for s in by_slot], local_ids=ids)
        return batches, stats

    def run_window(self, step0: int, preps: List[Prepared], error: Optional[str]):
        """Look-ahead over len(preps) steps: yields (batches, stats) in step order, None at the end of the data.

        One gather for the window. When every rank holds the full window and
        balancing is on, `plan_lookahead` chooses each sample's step within the
        window and `assign_slots` its start slot, agreed across ranks (`agree_lookahead`:
        all fall back together or all raise); then every step is planned and
        exchanged as usual (samples move from the rank that holds them). Else
        (warm-up, the end of the data) the steps run one by one.
        """
        from hf_dp_balance.core.lookahead import assign_slots, plan_lookahead

        ex, ga, k = self._exchange, self.gradient_accumulation_steps, len(preps)
        t0 = time.perf_counter()
        rows = [p.rows.copy() for p in preps]
        for j, r in enumerate(rows):
            r[:, F_STEP] = j
        versions = {p.model_version for p in preps}  # one model for the whole window, or it is not planned
        window = Prepared([mb for p in preps for mb in p.micro_batches], [s for p in preps for s in p.samples],
                           [e for p in preps for e in p.entries], np.concatenate(rows, axis=0),
                           model_version=versions.pop() if len(versions) == 1 else None)
        meta, balance, speeds, _ = self._gather(step0, window, error)
        resume, self._resume_window = self._resume_window, None  # the first window of a resumed pass only
        if resume is not None:
            yield from self._resume_in_window(step0, window, meta, balance, speeds, resume, t0)
            return
        full = bool(np.all(meta.headers[:, H_NUM_MICRO] == k * ga))
        if not (full and balance and k > 1):
            for j, prep in enumerate(preps):
                result = self.run_step(step0 + j, prep, None)
                yield result
                if result is None:
                    return
            return
        t1 = time.perf_counter()
        rows, holders, world = meta.rows, meta.owners, ex.world_size
        steps = rows[:, F_STEP].astype(np.int64)
        micro = rows[:, F_MICRO].astype(np.int64)
        tokens = rows[:, F_TOKENS].astype(np.int64)
        cap = 0
        for j in range(k):  # one cap for the window: keeping every step as it came stays feasible
            sel = steps == j
            largest = int(slot_loads(tokens[sel], holders[sel], micro[sel], world, ga).max())
            cap = max(cap, token_cap(tokens[sel], world * ga, self.config, largest))
        kept, failure = (steps, holders, micro), None
        try:
            # DDP meets once per step: a rank (its GA micro-batches) is the unit an outlier must not share;
            # FSDP / ZeRO-3 meets every micro-batch: the unit is a slot.
            units, unit_cap = (world, cap * ga) if self.sync == "step" else (world * ga, cap)
            new_step = plan_lookahead(rows[:, F_COST], tokens, steps, units, window=k, max_tokens=unit_cap)
            slot = assign_slots(tokens, steps, new_step, micro * world + holders, world * ga, cap)
            planned = (np.asarray(new_step, dtype=np.int64), slot % world, slot // world)
        except Exception as exc:  # noqa: BLE001 - planning never stops training: every rank falls back together (agree_lookahead)
            planned, failure = kept, f"{type(exc).__name__}: {exc}"
        new_step, start_rank, start_micro, note = agree_lookahead(ex, step0, k, kept, planned, failure)
        self._remember_window(step0, k, 0, new_step, start_rank, start_micro, cap, note)
        yield from self._window_steps(step0, window, meta, 0, k, (new_step, start_rank, start_micro), cap, note,
                                      True, speeds, t0, t1)

    def _window_steps(self, step0, window, meta, skip, k, placement, cap, note, balance, speeds, t0, t1):
        """Steps skip..k-1 of a planned window: each planned and exchanged from its start placement."""
        ex, ga, rows, holders = self._exchange, self.gradient_accumulation_steps, meta.rows, meta.owners
        new_step, start_rank, start_micro = placement
        my_first = int(np.searchsorted(holders, ex.rank))
        for j in range(skip, k):
            idx = np.flatnonzero(new_step == j)  # ascending global index: still rank-major by holder
            held = idx[holders[idx] == ex.rank] - my_first
            work = StepWork(step0 + j - skip, rows[idx], holders[idx], start_rank[idx], start_micro[idx], ga,
                            [window.samples[i] for i in held], [window.entries[i] for i in held], cap, note)
            yield self._finish_step(work, balance, speeds, t0 if j == skip else t1, t1)

    def _remember_window(self, step0, k, skip, new_step, start_rank, start_micro, cap, note) -> None:
        """The window's plan, kept for `window_state` (a resume inside it re-applies it) until the consumer has
        taken every step of it: the thread may run any number of windows ahead (`prefetch_steps` queued steps
        plus the window in hand), so plans are dropped by what was consumed, never by how many are kept."""
        stream = self._active
        first, consumed = (stream.first_step, stream.consumed) if stream is not None else (self.step_offset, 0)
        key = step0 - first  # steps the stream handed out before this window
        with self._stats_lock:
            self._window_plans[key] = {"k": int(k), "skip": int(skip), "steps": new_step.tolist(),
                                       "rank": start_rank.tolist(), "micro": start_micro.tolist(),
                                       "cap": int(cap), "note": note}
            # a window is dropped once the stream handed out the step after its last: a consumer that takes the
            # next step before its current one ends (`BalancedDataLoader` reads one step ahead to find the end of
            # the data) may still save a resume point inside it until then
            for old in [s for s, plan in self._window_plans.items() if s + plan["k"] - plan["skip"] < consumed]:
                del self._window_plans[old]

    def _resume_in_window(self, step0, window, meta, balance, speeds, resume, t0):
        """The window a resume starts inside: the saved plan (every rank holds the same), its untrained steps."""
        n, saved = int(meta.rows.shape[0]), len(resume["steps"])
        if n != saved:
            raise ValueError(f"step {step0}, rank {self._exchange.rank}: resuming inside a look-ahead window: the "
                             f"window read {n} samples, the saved state planned {saved}; the data differs from the "
                             f"run that saved it (same dataset, order and batch size are needed)")
        placement = tuple(np.asarray(resume[key], dtype=np.int64) for key in ("steps", "rank", "micro"))
        k, skip = int(resume["k"]), int(resume["trained"])
        self._remember_window(step0, k, skip, *placement, resume["cap"], resume["note"])
        yield from self._window_steps(step0, window, meta, skip, k, placement, resume["cap"], resume["note"],
                                      balance, speeds, t0, time.perf_counter())

    def window_state(self, consumed: int) -> Optional[dict]:
        """Where a resume continues when `consumed` steps of the current pass were handed out: None at a window
        boundary, else the window's plan and how many of its steps were trained (`trained`)."""
        with self._stats_lock:
            for key, plan in self._window_plans.items():
                end = key + plan["k"] - plan["skip"]
                if key <= consumed < end and (consumed > key or plan["skip"] > 0):
                    return {**plan, "trained": plan["skip"] + consumed - key}
        return None

    def resume_in_window(self, state: Optional[dict]) -> None:
        """The next pass starts inside a look-ahead window (`window_state`'s): its untrained steps first.

        The window must be one of this loader's look-ahead (`lookahead_steps` = the window's `k`): a loader
        that plans other windows (or none) would read the window's raw batches again from its start and train
        its first steps twice, so it refuses by name."""
        if state:
            k = max(1, self.config.lookahead_steps)
            if int(state["k"]) != k:
                raise ValueError(f"hf_dp_balance: the resume state was taken inside a look-ahead window of "
                                 f"{state['k']} steps (lookahead_steps={state['k']}), this loader has "
                                 f"lookahead_steps={self.config.lookahead_steps}: resume with the same setting")
        self._resume_window = dict(state) if state else None

    def resume_trained_steps(self) -> int:
        """Steps of the resumed window already trained (their raw batches are read again), 0 without one."""
        return int(self._resume_window["trained"]) if self._resume_window else 0

    def resume_window_steps(self) -> int:
        """Steps of raw data the next pass's first window reads (a resumed window's `k`), 0 without one."""
        return int(self._resume_window["k"]) if self._resume_window else 0

    def settings(self) -> dict:
        """Every setting of this loader that decides which samples a step trains: a resume state taken under
        other values would train samples twice or never (`BalanceSession.load_state_dict` compares them)."""
        return {"data_parallel_size": int(self._exchange.world_size),
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "lookahead_steps": int(self.config.lookahead_steps), "prefetch_steps": int(self.config.prefetch_steps),
                "dispatch": bool(getattr(self, "dispatches", False))}

    def stream_position(self) -> int:
        """Steps of the current pass handed to the consumer (0 when no stream runs)."""
        stream = self._active
        return int(stream.consumed) if stream is not None and not stream.done else 0

    def record_stats(self, stats: StepStats) -> None:
        with self._stats_lock:
            self._stats.append(stats)


# StepStats, list_collate, planning_costs, validate_plan and the F_* columns stay importable from here.
__all__ = ["BalancedLoader", "StepStats", "list_collate", "planning_costs", "plan_hash", "slot_loads", "step_imbalance", "token_cap",
           "validate_plan", "F_MICRO", "F_TOKENS", "F_VISION", "F_COST", "F_NBYTES", "F_STEP", "F_WIDTH"]
