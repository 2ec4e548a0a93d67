"""`BalancedLoader`: plan and exchange each optimizer step's samples one step ahead, in a thread.

Per optimizer step the background thread
  1. pulls the step's gradient-accumulation micro-batches (lists of sample
     dicts: the wrapped dataloader's collate is deferred),
  2. computes per-sample features (tokens, patches of each image) and costs
     (`planning_costs`: the current decoder `CostModel`, plus the vision
     encoder's cost of the sample's images when the vision tower is not
     balanced on its own) and the exact encoded size of each sample,
  3. gathers that metadata from every rank (side gloo group, one fixed-shape
     all_gather, with a failure flag),
  4. plans the whole step with `plan_step` -- pure numpy on identical gathered
     data, so every rank computes the identical plan (invariant 3); a planner
     failure falls back to "no move" on every rank alike (invariant 4),
  5. exchanges only the samples that move (one uneven all_to_all of bytes),
  6. collates each micro-batch slot into one packed row (`PackedCollator`),
and queues the packed micro-batches (bounded: `prefetch_steps`) with the
step's statistics. Every rank yields the same number of micro-batches per step
(the maximum over ranks; a slot without samples becomes the collator's no-op
row), which the training collectives need.

Determinism: within a slot samples keep ascending global index (rank-major,
then local order), whatever the plan, so a plan changes where a sample is
computed, never which samples a step trains (invariant 1).

Look-ahead (`lookahead_steps` = K > 1): the thread prepares K steps at once
and gathers them in one go; when every rank holds the full window and
balancing is on, `lookahead.plan_lookahead` picks each sample's step inside
the window (outliers grouped into few steps) and `assign_slots` its start
slot, then each step is planned and exchanged as above, samples moving from
the rank that holds them. Samples then train up to K-1 steps earlier or later
than the sampler yields them; each window still trains each of its samples
exactly once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hf_dp_balance.config import DPBalanceConfig
from hf_dp_balance.core import steps as step_maths
from hf_dp_balance.core.steps import plan_hash, slot_loads, step_imbalance
from hf_dp_balance.runtime.exchange import (H_FLAGS, H_NUM_MICRO, H_SPEED, ExchangeError, SampleExchange, encoded_nbytes, sample_entries,
                       transfer_layout)

logger = logging.getLogger(__name__)

# Columns of the per-sample metadata rows gathered from every rank.
F_MICRO, F_TOKENS, F_VISION, F_COST, F_NBYTES, F_STEP, F_WIDTH = range(7)  # F_STEP: step within a look-ahead window
FLAG_BALANCE = 1  # this rank asks for balancing (enabled, past warm-up, has a cost model)
_MODEL_VERSION_SHIFT = 8  # flags >> 8: which cost model costed the rows (ranks must agree to balance)


@dataclass
class StepStats:
    """What one optimizer step's exchange did (identical on every rank except the local byte counts / times)."""

    step: int
    num_micro_batches: int
    num_samples: int                      # global
    applied: bool                         # a plan moved samples
    reason: str                           # why (not) applied
    imbalance_before: float               # makespan / (total load / ranks) - 1, with the costs used for planning
    imbalance_after: float
    moved_samples: int                    # global: samples whose rank changed
    moved_bytes: int                      # global payload bytes
    bytes_sent: int                       # this rank
    bytes_received: int                   # this rank
    plan_hash: str                        # hash of (dest rank, dest micro-batch): equal on every rank
    gather_s: float = 0.0                 # thread wall time: metadata gather
    plan_s: float = 0.0                   # thread wall time: planning
    exchange_s: float = 0.0               # thread wall time: payload all_to_all (encode + decode included)
    collate_s: float = 0.0                # thread wall time: packing
    wait_s: float = 0.0                   # main thread: time blocked waiting for this step
    local_samples: List[int] = field(default_factory=list)       # samples per local micro-batch after the plan
    local_ids: Optional[List[List[Any]]] = None                  # per local micro-batch: values of `id_key`


def list_collate(samples: Sequence[Any]) -> list:
    """Collate that defers packing: a micro-batch stays a list of per-sample dicts."""
    return list(samples)


def planning_costs(tokens: np.ndarray, vision_patches: Sequence[Sequence[int]], decoder: Any,
                   vision: Any = None) -> np.ndarray:
    """Each sample's cost on the rank that trains it: decoder cost of its tokens, plus (when `vision`
    is given) the vision encoder's cost of its images, sum over items of vision.sample_costs(patches).

    Pass `vision` when the vision tower is NOT balanced on its own: a sample's images are then encoded
    on the rank the sample goes to, and in a small model they can be most of the sample's compute.
    With vision-tower balancing on, pass None: the tower's load is spread per image separately.
    `vision_patches[i]` lists the patch rows of sample i's images / videos (t*h*w each; InternVL: one
    entry per tile), the same unit the callback fits the vision model on. Cost O(samples + items).
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    costs = np.asarray(decoder.sample_costs(tokens), dtype=np.float64).reshape(-1).copy()
    if vision is not None:
        if len(vision_patches) != tokens.size:
            raise ValueError(f"planning_costs: {len(vision_patches)} vision patch lists for {tokens.size} samples")
        counts = np.array([len(v) for v in vision_patches], dtype=np.int64)
        if counts.sum():
            flat = np.concatenate([np.asarray(v, dtype=np.int64).reshape(-1) for v in vision_patches if len(v)])
            owner = np.repeat(np.arange(tokens.size), counts)
            costs += np.bincount(owner, weights=np.asarray(vision.sample_costs(flat), dtype=np.float64),
                                 minlength=tokens.size)
    return costs


def token_cap(tokens: np.ndarray, num_slots: int, config: DPBalanceConfig, largest_slot: int = 0) -> int:
    """`core.steps.token_cap` with the config's `max_tokens` / `max_token_ratio`."""
    return step_maths.token_cap(tokens, num_slots, config.max_tokens, config.max_token_ratio, largest_slot)


def validate_plan(dest_rank, dest_micro, n: int, num_ranks: int, num_micro: int) -> Tuple[np.ndarray, np.ndarray]:
    """The planner's arrays as int64, or ValueError: every sample gets exactly one valid (rank, micro-batch)."""
    dest_rank = np.asarray(dest_rank, dtype=np.int64).reshape(-1)
    dest_micro = np.asarray(dest_micro, dtype=np.int64).reshape(-1)
    if dest_rank.size != n or dest_micro.size != n:
        raise ValueError(f"plan has {dest_rank.size}/{dest_micro.size} destinations for {n} samples")
    if n and (dest_rank.min() < 0 or dest_rank.max() >= num_ranks or dest_micro.min() < 0 or dest_micro.max() >= num_micro):
        raise ValueError("plan has a destination outside [0, ranks) x [0, micro-batches)")
    return dest_rank, dest_micro


def _default_plan_fn():
    from hf_dp_balance.core.planner import plan_step

    return plan_step


class _Prepared:
    """One rank's side of a step before the gather."""

    __slots__ = ("micro_batches", "samples", "entries", "rows", "model_version")

    def __init__(self, micro_batches, samples, entries, rows, model_version: Optional[int] = None):
        self.micro_batches, self.samples, self.entries, self.rows = micro_batches, samples, entries, rows
        # which set_cost_model call's models costed the rows; None: no model (costs are token stand-ins)
        self.model_version = model_version


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
    config.max_tokens)`), `features_fn` (sample -> (tokens, vision) where vision is
    the patch rows of each image / video (a sequence) or just their count (an int:
    then no vision cost can be planned); default `sample_features`), `plan_fn`
    (default `planner.plan_step`).
    """

    def __init__(self, dataloader: Iterable, config: Optional[DPBalanceConfig] = None, *,
                 gradient_accumulation_steps: int = 1, model_config: Any = None,
                 collator: Optional[Callable[[list], Any]] = None,
                 features_fn: Optional[Callable[[dict], Tuple[int, int]]] = None,
                 plan_fn: Optional[Callable] = None, cost_model: Any = None,
                 exchange: Optional[SampleExchange] = None, sync: Optional[str] = None,
                 id_key: Optional[str] = None, balancing: bool = True, speed: float = 1.0):
        self.dataloader = dataloader
        self.config = config if config is not None else DPBalanceConfig()
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
                    return int(f.tokens), tuple(f.vision_items)
        self.collator = collator
        self.features_fn = features_fn
        self.plan_fn = plan_fn
        sync = sync or self.config.sync
        self.sync = "step" if sync == "auto" else sync  # `auto` without a framework to ask: DDP semantics
        self.id_key = id_key
        # (decoder, vision, version): one tuple, swapped atomically for the thread; version counts the
        # set_cost_model calls, equal on every rank (the same broadcast fits, in the same order)
        self._models = (cost_model, None, 0)
        self._balancing = bool(balancing)
        self._speed = float(speed)
        self._exchange = exchange if exchange is not None else SampleExchange(self.config.timeout_s)
        self._stats: List[StepStats] = []
        self._stats_lock = threading.Lock()
        self._active: Optional[_StepStream] = None

    # -- settings from the main thread (read by the thread at the start of each step) ----------
    def set_cost_model(self, cost_model: Any, vision: Any = None) -> None:
        """Plan the steps prepared from now on with `cost_model.sample_costs(tokens)` per sample, plus
        `vision`'s cost of the sample's images when given (see `planning_costs`: give it when the vision
        tower is not balanced on its own). None as `cost_model` switches planning off.

        Every rank must make the same calls in the same order (the callback does: one broadcast fit):
        a step is balanced only when every rank costed its rows with the same call's models."""
        self._models = (cost_model, vision, self._models[2] + 1)

    def set_balancing(self, enabled: bool) -> None:
        self._balancing = bool(enabled)

    def set_speed(self, speed: float) -> None:
        """This rank's relative speed (1.0 = nominal) for heterogeneous ranks."""
        if not speed > 0:
            raise ValueError(f"speed={speed!r}: must be > 0")
        self._speed = float(speed)

    @property
    def cost_model(self):
        return self._models[0]

    @property
    def vision_cost_model(self):
        return self._models[1]

    @property
    def exchange(self) -> SampleExchange:
        return self._exchange

    def at_window_boundary(self) -> bool:
        """Whether the steps consumed so far end a look-ahead window (always, without look-ahead).

        With `lookahead_steps` = K > 1 the samples of a window of K steps may train in any of its steps,
        so a checkpoint inside a window would resume with some samples trained twice and others never
        (Trainer skips whole sampler steps). Windows start at the first step of each pass over the data.
        """
        k = self.config.lookahead_steps
        stream = self._active
        return k <= 1 or stream is None or stream._done or stream.consumed % k == 0

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

    def skip_first_batches(self, num_batches: int) -> "BalancedLoader":
        """A loader over the same data that skips `num_batches` micro-batches (a whole number of steps)."""
        if num_batches % self.gradient_accumulation_steps:
            raise ValueError(f"skip_first_batches({num_batches}): must be a multiple of gradient_accumulation_steps="
                             f"{self.gradient_accumulation_steps} so that steps keep their micro-batches")
        from accelerate import skip_first_batches

        clone = object.__new__(BalancedLoader)
        clone.__dict__.update(self.__dict__)
        clone.dataloader = skip_first_batches(self.dataloader, num_batches)
        clone._active, clone._stats, clone._stats_lock = None, [], threading.Lock()
        return clone

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

    def open_stream(self, raw_iterator: Iterator, step_limit: Optional[int] = None) -> "_StepStream":
        """Start the background pipeline over `raw_iterator` (micro-batches = lists of sample dicts).

        The first micro-batch is pulled here, in the calling thread: accelerate's
        `DataLoaderShard` synchronises RNG states with a collective on the
        training group at its first `next()`, which must not run in a thread.
        """
        if self._active is not None:
            self._active.close()
        self._active = _StepStream(self, raw_iterator, step_limit)
        return self._active

    def stream_for(self, raw_iterator: Iterator, step_limit: Optional[int] = None) -> "_StepStream":
        """The running stream over `raw_iterator`, started on first use (Trainer integration)."""
        if self._active is None or self._active.source is not raw_iterator:
            self.open_stream(raw_iterator, step_limit)
        return self._active

    def close(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    # -- one step, run in the background thread ----------------------------------------------
    def _prepare(self, step: int, pull: Callable[[], Optional[list]]) -> _Prepared:
        """Pull up to GA micro-batches and describe every sample (features, cost, encoded size)."""
        rank = self._exchange.rank
        micro_batches: List[list] = []
        for m in range(self.gradient_accumulation_steps):
            mb = pull()
            if mb is None:
                break
            if not isinstance(mb, (list, tuple)):
                raise ValueError(f"step {step}, rank {rank}, micro-batch {m}: the dataloader yielded a "
                                 f"{type(mb).__name__}, not a list of sample dicts; its collate_fn must defer "
                                 f"packing (hf_dp_balance.runtime.loader.list_collate)")
            micro_batches.append(list(mb))
        samples, entries, rows, patches = [], [], [], []
        for m, mb in enumerate(micro_batches):
            for p, sample in enumerate(mb):
                where = f"step {step}, rank {rank}, micro-batch {m}, sample {p}"
                if self.id_key is not None and isinstance(sample, dict) and self.id_key in sample:
                    where += f" ({self.id_key}={sample[self.id_key]!r})"
                ent = sample_entries(sample, where)
                try:
                    tokens, vision = self.features_fn(sample)
                except Exception as exc:  # name the sample, keep the cause
                    raise ValueError(f"{where}: cannot compute its features: {exc}") from exc
                items = () if isinstance(vision, (int, np.integer)) else tuple(int(v) for v in vision)
                count = int(vision) if isinstance(vision, (int, np.integer)) else len(items)
                if not (tokens >= 0 and count >= 0 and all(v >= 0 for v in items)):
                    raise ValueError(f"{where}: negative features tokens={tokens}, vision={vision}")
                samples.append(sample)
                entries.append(ent)
                patches.append(items)
                rows.append((m, tokens, count, 0.0, encoded_nbytes(ent), 0))
        arr = np.array(rows, dtype=np.float64).reshape(-1, F_WIDTH)
        decoder, vision_model, version = self._models  # one read: costs and version always match
        if decoder is not None and arr.shape[0]:
            arr[:, F_COST] = planning_costs(arr[:, F_TOKENS].astype(np.int64), patches, decoder, vision_model)
        else:
            arr[:, F_COST] = arr[:, F_TOKENS]  # for statistics only: no model, no planning
        return _Prepared(micro_batches, samples, entries, arr, model_version=version if decoder is not None else None)

    def _plan(self, step: int, rows: np.ndarray, owners: np.ndarray, micro: np.ndarray, num_micro: int,
              balance: bool, speeds: np.ndarray, cap: Optional[int] = None):
        """(dest_rank, dest_micro, applied, reason) from the start placement (owners, micro).

        Never raises: a planner failure keeps the start placement (invariant 4).
        """
        world = self._exchange.world_size
        if not balance:
            return owners, micro, False, "balancing off (warm-up, disabled or no cost model on some rank)"
        if world == 1 or rows.shape[0] == 0:
            return owners, micro, False, "nothing to balance"
        try:
            plan_fn = self.plan_fn or _default_plan_fn()
            tokens = rows[:, F_TOKENS].astype(np.int64)
            if cap is None:
                largest = int(slot_loads(tokens, owners, micro, world, num_micro).max())
                cap = token_cap(tokens, world * num_micro, self.config, largest)
            plan = plan_fn(rows[:, F_COST], owners, micro, world, num_micro, tokens=tokens, max_tokens=cap,
                           speeds=None if np.all(speeds == 1.0) else speeds, sync=self.sync,
                           min_gain=self.config.min_gain, tolerance=self.config.move_tolerance)
            dest_rank, dest_micro = validate_plan(plan.dest_rank, plan.dest_micro_batch, rows.shape[0], world, num_micro)
            applied = bool(getattr(plan, "applied", True)) and bool(np.any(dest_rank != owners) or np.any(dest_micro != micro))
            return dest_rank, dest_micro, applied, str(getattr(plan, "reason", "planned"))
        except Exception as exc:  # invariant 4: planning never stops training
            logger.warning("hf_dp_balance: step %d: planning failed, no move this step: %r", step, exc)
            return owners, micro, False, f"planner failed: {exc!r}"

    def _gather(self, step: int, prep: Optional[_Prepared], error: Optional[str]):
        # Balance only when every rank's rows were costed by a model: a model that lands while a rank is
        # preparing must not mix its costs with another rank's token stand-ins in one plan.
        wants = prep is not None and prep.model_version is not None and self._balancing and self.config.enabled
        flags = (FLAG_BALANCE | (prep.model_version << _MODEL_VERSION_SHIFT)) if wants else 0
        meta = self._exchange.gather_metadata(
            step, prep.rows if prep is not None else None,
            num_micro_batches=len(prep.micro_batches) if prep is not None else 0,
            flags=flags, speed=self._speed, error=error, num_fields=F_WIDTH)
        gathered = meta.headers[:, H_FLAGS].astype(np.int64)
        # and every rank's costs from the same model (a refit can land while ranks prepare this step)
        versions = set((gathered >> _MODEL_VERSION_SHIFT).tolist())
        balance = bool(np.all(gathered & FLAG_BALANCE)) and len(versions) == 1
        return meta, balance, meta.headers[:, H_SPEED].astype(np.float64)

    def _run_step(self, step: int, prep: Optional[_Prepared], error: Optional[str]):
        """Collective part of a step. Returns (packed micro-batches, stats) or None at the end of the data."""
        t0 = time.perf_counter()
        meta, balance, speeds = self._gather(step, prep, error)
        num_micro = int(meta.headers[:, H_NUM_MICRO].max())
        if num_micro == 0:
            return None
        micro = meta.rows[:, F_MICRO].astype(np.int64)
        return self._finish_step(step, meta.rows, meta.owners, meta.owners, micro, num_micro, balance, speeds,
                                 prep.samples, prep.entries, t0, time.perf_counter())

    def _finish_step(self, step: int, rows: np.ndarray, holders: np.ndarray, start_rank: np.ndarray,
                     start_micro: np.ndarray, num_micro: int, balance: bool, speeds: np.ndarray,
                     samples: Sequence[dict], entries: Sequence[list], t0: float, t1: float,
                     cap: Optional[int] = None, note: str = ""):
        """Plan from the start placement, move samples from their holders, pack every slot.

        `rows` are the step's samples in ascending global order (rank-major by
        holder); `samples` / `entries` are this rank's held ones, in that order.
        """
        ex = self._exchange
        dest_rank, dest_micro, applied, reason = self._plan(step, rows, start_rank, start_micro, num_micro,
                                                            balance, speeds, cap)
        t2 = time.perf_counter()
        offset = int(np.searchsorted(holders, ex.rank))  # holders are rank-major
        layout = transfer_layout(holders, dest_rank, rows[:, F_NBYTES].astype(np.int64), ex.rank, ex.world_size)
        moved = holders != dest_rank
        moved_bytes = int(rows[moved, F_NBYTES].sum())
        received = ex.exchange_payloads(step, samples, offset, layout, entries) if moved.any() else {}
        t3 = time.perf_counter()

        # Assemble each slot in ascending global index, whatever the plan.
        mine = np.flatnonzero(dest_rank == ex.rank)
        by_slot: List[List[int]] = [[] for _ in range(num_micro)]
        for g in mine:
            by_slot[int(dest_micro[g])].append(int(g))
        batches, ids = [], [] if self.id_key else None
        for m, members in enumerate(by_slot):
            slot = [received[g] if holders[g] != ex.rank else samples[g - offset] for g in members]
            if ids is not None:
                ids.append([s.get(self.id_key) for s in slot])
            try:
                batches.append(self.collator(slot))
            except Exception as exc:
                raise ValueError(f"step {step}, rank {ex.rank}, micro-batch {m}: collating samples "
                                 f"{members} (global indices) failed: {exc}") from exc
        t4 = time.perf_counter()

        costs = rows[:, F_COST]
        before = slot_loads(costs, start_rank, start_micro, ex.world_size, num_micro)
        after = slot_loads(costs, dest_rank, dest_micro, ex.world_size, num_micro)
        stats = StepStats(
            step=step, num_micro_batches=num_micro, num_samples=int(rows.shape[0]),
            applied=applied or bool(moved.any()), reason=note + reason,
            imbalance_before=step_imbalance(before, self.sync, speeds),
            imbalance_after=step_imbalance(after, self.sync, speeds),
            moved_samples=int(moved.sum()), moved_bytes=moved_bytes,
            bytes_sent=layout.bytes_sent, bytes_received=layout.bytes_received,
            plan_hash=plan_hash(dest_rank, dest_micro), gather_s=t1 - t0, plan_s=t2 - t1, exchange_s=t3 - t2,
            collate_s=t4 - t3, local_samples=[len(s) for s in by_slot], local_ids=ids)
        return batches, stats

    def _run_window(self, step0: int, preps: List[_Prepared], error: Optional[str]):
        """Look-ahead over len(preps) steps: yields (batches, stats) in step order, None at the end of the data.

        One gather for the window. When every rank holds the full window and
        balancing is on, `plan_lookahead` chooses each sample's step within the
        window and `assign_slots` its start slot; then every step is planned and
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
        window = _Prepared([mb for p in preps for mb in p.micro_batches], [s for p in preps for s in p.samples],
                           [e for p in preps for e in p.entries], np.concatenate(rows, axis=0),
                           model_version=versions.pop() if len(versions) == 1 else None)
        meta, balance, speeds = self._gather(step0, window, error)
        full = bool(np.all(meta.headers[:, H_NUM_MICRO] == k * ga))
        if not (full and balance and k > 1):
            for j, prep in enumerate(preps):
                result = self._run_step(step0 + j, prep, None)
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
        try:
            # DDP meets once per step: a rank (its GA micro-batches) is the unit an outlier must not share;
            # FSDP / ZeRO-3 meets every micro-batch: the unit is a slot.
            units, unit_cap = (world, cap * ga) if self.sync == "step" else (world * ga, cap)
            new_step = plan_lookahead(rows[:, F_COST], tokens, steps, units, window=k, max_tokens=unit_cap)
            slot = assign_slots(tokens, steps, new_step, micro * world + holders, world * ga, cap)
            start_rank, start_micro, note = slot % world, slot // world, ""
        except Exception as exc:  # invariant 4
            logger.warning("hf_dp_balance: steps %d..%d: look-ahead failed, steps kept: %r", step0, step0 + k - 1, exc)
            new_step, start_rank, start_micro, note = steps, holders, micro, f"look-ahead failed: {exc!r}; "
        my_first = int(np.searchsorted(holders, ex.rank))
        for j in range(k):
            idx = np.flatnonzero(new_step == j)  # ascending global index: still rank-major by holder
            held = idx[holders[idx] == ex.rank] - my_first
            yield self._finish_step(
                step0 + j, rows[idx], holders[idx], start_rank[idx], start_micro[idx], ga, True, speeds,
                [window.samples[i] for i in held], [window.entries[i] for i in held], t0 if j == 0 else t1, t1,
                cap, note)

    def _record(self, stats: StepStats) -> None:
        with self._stats_lock:
            self._stats.append(stats)


class _StepStream:
    """The background thread of one pass over a raw micro-batch iterator, and its bounded queue."""

    def __init__(self, loader: BalancedLoader, source: Iterator, step_limit: Optional[int]):
        self.loader = loader
        self.source = source
        self.step_limit = step_limit
        self._queue: "queue.Queue[tuple]" = queue.Queue(maxsize=loader.config.prefetch_steps)
        self._stop = threading.Event()
        self._done = False
        self.consumed = 0  # steps handed to the consumer so far (the stream's step index of the next one)
        self._first_error: Optional[BaseException] = None
        # First pull in the caller's thread (see BalancedLoader.open_stream).
        self._peeked: List[Any] = []
        self._exhausted = False
        if step_limit is None or step_limit > 0:
            try:
                self._peeked.append(next(source))
            except StopIteration:
                self._exhausted = True
        self._thread = threading.Thread(target=self._main, name="hf_dp_balance-exchange", daemon=True)
        self._thread.start()

    def _pull(self) -> Optional[list]:
        if self._peeked:
            return self._peeked.pop()
        if self._exhausted:
            return None
        try:
            return next(self.source)
        except StopIteration:
            self._exhausted = True
            return None

    def _put(self, item: tuple) -> bool:
        """Queue `item`; False only when the queue is full and the stream was closed.

        The thread stops only here, never between collectives: ranks that consume
        the same number of steps then all stop at the same step (the one that
        found the queue full), and no rank is left waiting in a collective.
        """
        while True:
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self._stop.is_set():
                    return False

    def _wait_for_model_or_consumer(self) -> bool:
        """Until a cost model is set, stay one step ahead only; False when the stream was closed meanwhile.

        Without a model nothing is planned, so running `prefetch_steps` ahead would only mean more steps
        prepared without it when the fit lands: planning then starts with step warmup_steps + 2 instead
        of warmup_steps + prefetch_steps + 2. Every rank consumes the same steps, so every rank's thread
        leaves this wait for the same step, and a closed stream stops every rank at the same step (as in
        `_put`).
        """
        loader = self.loader
        while loader._balancing and loader.config.enabled and loader.cost_model is None and not self._queue.empty():
            if self._stop.is_set():
                return False
            time.sleep(0.002)
        return True

    def _main(self) -> None:
        loader = self.loader
        step = 0
        pending: Optional[Tuple[BaseException, str]] = None  # a local failure, told to the peers at the next gather
        try:
            while self.step_limit is None or step < self.step_limit:
                if not self._wait_for_model_or_consumer():
                    return
                span = max(1, loader.config.lookahead_steps)  # steps prepared and gathered together
                if self.step_limit is not None:
                    span = min(span, self.step_limit - step)
                preps: List[_Prepared] = []
                if pending is None:
                    try:
                        for j in range(span):
                            preps.append(loader._prepare(step + j, self._pull))
                    except Exception as exc:  # noqa: BLE001 - forwarded below
                        pending = (exc, traceback.format_exc())
                if pending is not None:
                    loader._exchange.report_failure(step, repr(pending[0]))
                    try:
                        loader._run_step(step, None, f"{type(pending[0]).__name__}: {pending[0]}")
                    except ExchangeError:
                        pass  # the gather raises on every rank; here the local cause is the better error
                    raise pending[0]
                ended = False
                try:
                    if span == 1:
                        result = loader._run_step(step, preps[0], None)
                        results, ended = ([] if result is None else [result]), result is None
                        results = iter(results)
                    else:
                        results = loader._run_window(step, preps, None)
                    for result in results:
                        if result is None:
                            ended = True
                            break
                        if not self._put(("step", result[0], result[1])):
                            return
                        step += 1
                except ExchangeError:
                    raise
                except Exception as exc:  # noqa: BLE001 - collation etc.: tell the peers at the next gather
                    loader._exchange.report_failure(step, repr(exc))
                    pending = (exc, traceback.format_exc())
                    step += 1
                    continue
                if ended:
                    break
            if pending is not None:  # failed in the last step before the limit: the peers have stopped already
                raise pending[0]
            self._put(("end",))
        except BaseException as exc:  # noqa: BLE001 - reaches the main thread with its traceback
            self._put(("error", exc, traceback.format_exc()))

    def next_step(self) -> Optional[list]:
        """The next step's packed micro-batches, or None at the end; re-raises a thread failure here."""
        if self._done:
            return None
        t0 = time.perf_counter()
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError("hf_dp_balance: the exchange thread stopped without a result")
        wait = time.perf_counter() - t0
        if item[0] == "end":
            self._done = True
            return None
        if item[0] == "error":
            self._done = True
            exc, tb = item[1], item[2]
            raise RuntimeError(f"hf_dp_balance BalancedLoader background thread failed: {exc}\n"
                               f"--- thread traceback ---\n{tb}") from exc
        _, batches, stats = item
        stats.wait_s = wait
        self.consumed = stats.step + 1
        self.loader._record(stats)
        return batches

    def close(self) -> None:
        """Stop the thread at its next full-queue wait; waits for the step in flight (its peers finish it too)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.loader.config.timeout_s + 5.0)


__all__ = ["BalancedLoader", "StepStats", "list_collate", "planning_costs", "plan_hash", "slot_loads", "step_imbalance", "token_cap",
           "validate_plan"]
