"""One optimizer step's data in the `BalancedLoader`: the metadata rows every rank gathers, and the slots.

Preparation (this rank, before the gather): pull the step's micro-batches and describe every sample by
one row (micro-batch, tokens, vision items, cost, encoded bytes, step in the window). Finishing (after the
plan): which global samples each of this rank's slots trains, in ascending global index whatever the plan,
so a plan changes where a sample is computed, never which samples a step trains.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from hf_dp_balance.core.codec import encoded_nbytes, sample_entries
from hf_dp_balance.core.costing import item_grids, planning_costs
from hf_dp_balance.runtime.exchange import (H_FLAGS, H_NUM_MICRO, H_NUM_SAMPLES, H_SPEED, H_STATUS, H_WIDTH,
                                            ExchangeError, SampleExchange, differing_ranks, failure_detail)
from hf_dp_balance.runtime.logs import get_logger

logger = get_logger(__name__)

# Columns of the per-sample metadata rows gathered from every rank.
F_MICRO, F_TOKENS, F_VISION, F_COST, F_NBYTES, F_STEP, F_WIDTH = range(7)  # F_STEP: step within a look-ahead window
FLAG_BALANCE = 1  # this rank asks for balancing (enabled, past warm-up, has a cost model)
FLAG_PRIOR = 2  # this rank's rows were costed by a FLOP prior (the step's plan is hedged, on every rank alike)
MODEL_VERSION_SHIFT = 8  # flags >> 8: which cost model costed the rows (ranks must agree to balance)


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


class Prepared:
    """One rank's side of a step (or a look-ahead window) before the gather."""

    __slots__ = ("micro_batches", "samples", "entries", "rows", "model_version")

    def __init__(self, micro_batches, samples, entries, rows, model_version: Optional[int] = None):
        self.micro_batches, self.samples, self.entries, self.rows = micro_batches, samples, entries, rows
        # which set_cost_model call's models costed the rows; None: no model (costs are token stand-ins)
        self.model_version = model_version


@dataclass(frozen=True)
class StepWork:
    """One step to plan, move and pack: its samples in ascending global order (rank-major by holder).

    `samples` / `entries` are this rank's held ones, in that order; `cap` the tokens per slot (None: the
    step's own `token_cap`); `note` prefixes the step's reason (a look-ahead failure).
    """

    step: int
    rows: np.ndarray          # [n, F_WIDTH] gathered metadata rows
    holders: np.ndarray       # rank holding each sample (its payload moves from there)
    start_rank: np.ndarray    # placement the plan starts from
    start_micro: np.ndarray
    num_micro: int
    samples: Sequence[dict]
    entries: Sequence[list]
    cap: Optional[int] = None
    note: str = ""


def pull_micro_batches(step: int, pull: Callable[[], Optional[list]], count: int, rank: int) -> List[list]:
    """Up to `count` micro-batches (lists of sample dicts) from `pull`; fewer at the end of the data."""
    micro_batches: List[list] = []
    for m in range(count):
        try:
            mb = pull()
        except StopIteration:
            raise
        except Exception as exc:  # the user's dataset / collate: say where, keep the type
            if str(exc).startswith("step "):
                raise
            raise RuntimeError(f"step {step}, rank {rank}, micro-batch {m}: reading it from the dataloader "
                               f"failed: {type(exc).__name__}: {exc}") from exc
        if mb is None:
            break
        if not isinstance(mb, (list, tuple)):
            raise ValueError(f"step {step}, rank {rank}, micro-batch {m}: the dataloader yielded a "
                             f"{type(mb).__name__}, not a list of sample dicts; its collate_fn must defer "
                             f"packing (hf_dp_balance.runtime.loader.list_collate)")
        micro_batches.append(list(mb))
    return micro_batches


def _describe(sample: Any, where: str, features_fn: Callable) -> Tuple[list, int, Optional[np.ndarray], int]:
    """(codec entries, tokens, item grids or None, item count) of one sample; ValueError naming it."""
    entries = sample_entries(sample, where)
    try:
        tokens, vision = features_fn(sample)
    except Exception as exc:  # name the sample, keep the cause
        raise ValueError(f"{where}: cannot compute its features: {type(exc).__name__}: {exc}") from exc
    tokens = _whole_count(tokens, "tokens", where)
    try:
        grids = None if isinstance(vision, (int, np.integer)) else item_grids(vision)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"{where}: bad vision features {vision!r}: {exc}") from exc
    count = _whole_count(vision, "vision item count", where) if grids is None else grids.shape[0]
    return entries, tokens, grids, count


def _whole_count(value: Any, what: str, where: str) -> int:
    """`value` as a non-negative int64 count, or a ValueError that says what is wrong (inf, NaN, negative...)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{where}: feature {what}={value!r} is not a number: {exc}") from exc
    if not np.isfinite(number):
        raise ValueError(f"{where}: feature {what}={value!r} is not finite")
    if number < 0 or number != int(number) or number >= 2 ** 53:
        raise ValueError(f"{where}: feature {what}={value!r} must be a whole number in [0, 2**53)")
    return int(number)


def describe_samples(step: int, micro_batches: Sequence[list], rank: int, features_fn: Callable,
                     id_key: Optional[str]) -> Tuple[Prepared, List[np.ndarray]]:
    """(the step's `Prepared` with its cost column still 0, each sample's item grids [k, 3]).

    A sample whose `features_fn` gave only an item count has no grids (no vision cost can be planned).
    """
    samples, entries, rows, grids = [], [], [], []
    for m, mb in enumerate(micro_batches):
        for p, sample in enumerate(mb):
            where = f"step {step}, rank {rank}, micro-batch {m}, sample {p}"
            if id_key is not None and isinstance(sample, Mapping) and id_key in sample:
                where += f" ({id_key}={sample[id_key]!r})"
            try:
                ent, tokens, items, count = _describe(sample, where, features_fn)
            except ValueError:
                raise
            except Exception as exc:  # name the sample and keep the type: a bare KeyError says only the key
                raise RuntimeError(f"{where}: {type(exc).__name__}: {exc}") from exc
            samples.append(sample)
            entries.append(ent)
            grids.append(items if items is not None else np.zeros((0, 3), dtype=np.int64))
            rows.append((m, tokens, count, 0.0, encoded_nbytes(ent), 0))
    prep = Prepared(list(micro_batches), samples, entries, np.array(rows, dtype=np.float64).reshape(-1, F_WIDTH))
    return prep, grids


def cost_rows(prep: Prepared, grids: Sequence[np.ndarray], models: Tuple[Any, Any, int]) -> Prepared:
    """Fill the cost column with the (decoder, vision, version) models (`core.costing.planning_costs`).

    Without a decoder model the column holds the tokens, for statistics only (nothing is planned).
    """
    decoder, vision, version = models
    rows = prep.rows
    if decoder is not None and rows.shape[0]:
        rows[:, F_COST] = planning_costs(rows[:, F_TOKENS].astype(np.int64), grids, decoder, vision)
    else:
        rows[:, F_COST] = rows[:, F_TOKENS]
    prep.model_version = version if decoder is not None else None
    return prep


def step_header(prep: Optional[Prepared], error: Optional[str], wants_balance: bool, speed: float,
                prior: bool = False) -> np.ndarray:
    """This rank's fixed header of a step (status, sample count, micro-batches, flags, speed): float64 [H_WIDTH]."""
    flags = (FLAG_BALANCE | (prep.model_version << MODEL_VERSION_SHIFT)) if wants_balance else 0
    if wants_balance and prior:
        flags |= FLAG_PRIOR
    header = np.zeros(H_WIDTH, dtype=np.float64)
    header[H_STATUS] = 1.0 if error is not None else 0.0
    header[H_NUM_SAMPLES] = prep.rows.shape[0] if prep is not None else 0
    header[H_NUM_MICRO] = len(prep.micro_batches) if prep is not None else 0
    header[H_FLAGS] = flags
    header[H_SPEED] = speed
    return header


def step_decision(headers: np.ndarray) -> Tuple[bool, np.ndarray, bool]:
    """(whether to balance, each rank's speed, whether to hedge) from every rank's header.

    Balance only when every rank asks for it and every rank's rows were costed by the same
    `set_cost_model` call's models (a refit can land while ranks prepare this step). Hedge when any rank's
    models are a prior.
    """
    gathered = headers[:, H_FLAGS].astype(np.int64)
    versions = set((gathered >> MODEL_VERSION_SHIFT).tolist())
    balance = bool(np.all(gathered & FLAG_BALANCE)) and len(versions) == 1
    hedge = balance and bool(np.any(gathered & FLAG_PRIOR))
    return balance, headers[:, H_SPEED].astype(np.float64), hedge


def gather_step(exchange: SampleExchange, step: int, prep: Optional[Prepared], error: Optional[str],
                wants_balance: bool, speed: float, prior: bool = False):
    """(metadata of every rank, whether to balance, each rank's speed, whether to hedge): one metadata gather
    to every rank (look-ahead windows); `step_decision` decides from the gathered flags, alike on every rank."""
    header = step_header(prep, error, wants_balance, speed, prior)
    meta = exchange.gather_metadata(
        step, prep.rows if prep is not None else None, num_micro_batches=int(header[H_NUM_MICRO]),
        flags=int(header[H_FLAGS]), speed=speed, error=error, num_fields=F_WIDTH)
    return (meta, *step_decision(meta.headers))


def validate_plan(dest_rank, dest_micro, n: int, num_ranks: int, num_micro: int) -> Tuple[np.ndarray, np.ndarray]:
    """The planner's arrays as int64, or ValueError: every sample gets exactly one valid (rank, micro-batch)."""
    dest_rank = np.asarray(dest_rank, dtype=np.int64).reshape(-1)
    dest_micro = np.asarray(dest_micro, dtype=np.int64).reshape(-1)
    if dest_rank.size != n or dest_micro.size != n:
        raise ValueError(f"plan has {dest_rank.size}/{dest_micro.size} destinations for {n} samples")
    if n and (dest_rank.min() < 0 or dest_rank.max() >= num_ranks or dest_micro.min() < 0 or dest_micro.max() >= num_micro):
        raise ValueError("plan has a destination outside [0, ranks) x [0, micro-batches)")
    return dest_rank, dest_micro


def default_plan_fn():
    """`core.planner.plan_step`, imported on first use (the planner is the heaviest core module)."""
    from hf_dp_balance.core.planner import plan_step

    return plan_step


def slot_members(dest_rank: np.ndarray, dest_micro: np.ndarray, rank: int, num_micro: int) -> List[List[int]]:
    """Global indices of the samples each of `rank`'s slots trains, ascending within a slot."""
    members: List[List[int]] = [[] for _ in range(num_micro)]
    for g in np.flatnonzero(dest_rank == rank):
        members[int(dest_micro[g])].append(int(g))
    return members


def slot_samples(work: StepWork, members: Sequence[int], received: Dict[int, dict], rank: int) -> List[dict]:
    """The sample dicts of one slot: held here (in `work.samples`) or received from their holder."""
    offset = int(np.searchsorted(work.holders, rank))  # holders are rank-major
    return [received[g] if work.holders[g] != rank else work.samples[g - offset] for g in members]


def plan_digest(*arrays: np.ndarray) -> int:
    """52 bits of a hash of the plan's arrays (dest rank, dest micro-batch, ...) as an int (exact in an int64 gather)."""
    h = hashlib.sha1()
    for a in arrays:
        h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
    return int(h.hexdigest()[:13], 16)


def agree_digests(ex: SampleExchange, step: int, where: str, phase: str, digest: int,
                  failure: Optional[str]) -> Dict[int, str]:
    """{rank: message} of the ranks whose planner failed (equal on every rank; empty: every plan agreed).

    One fixed-size `all_reduce` of every rank's digest and failed flag (`SampleExchange.agree`). Digests
    that differ while no planner failed raise `ExchangeError` on every rank, naming the ranks whose plan
    differs from the majority's (a tie: rank 0's; one all_gather on that error path only). `where` names
    the step(s) in the message ("step 7", "steps 7..9").
    """
    same, failed = ex.agree(step, phase, digest, failure)
    if failed:
        return failed
    if not same:
        digests = ex.all_values(step, phase, digest)
        odd = differing_ranks(digests)
        raise ExchangeError(f"hf_dp_balance, {where}, {phase}: the plan of rank(s) {odd} differs from "
                            f"the other ranks' (digests {[f'{int(d):013x}' for d in digests]}; raised on rank "
                            f"{ex.rank}); every rank plans from the same gathered numbers, so the planner or "
                            f"its inputs differ on those ranks")
    return {}


def agree_plan(ex: SampleExchange, work: StepWork, dest_rank: np.ndarray, dest_micro: np.ndarray,
               failure: Optional[str]):
    """Compare plans across ranks before anything moves: (dest_rank, dest_micro, fallback reason or None).

    `agree_digests` on the plan: a planner that failed on any rank makes every rank keep the start
    placement and log it (planning never stops training); plans that differ raise `ExchangeError` on every rank.
    """
    failed = agree_digests(ex, work.step, f"step {work.step}", "plan check", plan_digest(dest_rank, dest_micro),
                           failure)
    if failed:
        detail = failure_detail(failed)
        logger.warning("hf_dp_balance: step %d: planning failed on rank(s) %s; every rank keeps its samples "
                       "this step: %s", work.step, sorted(failed), detail)
        return work.start_rank, work.start_micro, f"planner failed on rank(s) {sorted(failed)}: {detail}"
    return dest_rank, dest_micro, None


def agree_lookahead(ex: SampleExchange, step0: int, window: int, kept: Tuple[np.ndarray, ...],
                    planned: Tuple[np.ndarray, ...], failure: Optional[str]):
    """(new step, start rank, start micro-batch, note) of every window sample, agreed across ranks.

    `planned`: this rank's look-ahead result, `kept`: the steps and slots as they came. `agree_digests` on
    the look-ahead plan: when it failed on any rank (`failure`: this rank's message), every rank keeps the
    steps as they came and logs which rank failed and why (`note` prefixes each step's
    reason); look-ahead plans that differ raise `ExchangeError` on every rank, naming the odd ranks.
    """
    where = f"steps {step0}..{step0 + window - 1}"
    if ex.world_size > 1:
        failed = agree_digests(ex, step0, where, "look-ahead plan check", plan_digest(*planned), failure)
    else:
        failed = {ex.rank: failure} if failure is not None else {}
    if failed:
        detail = failure_detail(failed)
        logger.warning("hf_dp_balance: %s: look-ahead failed on rank(s) %s; every rank keeps the steps as they "
                       "came: %s", where, sorted(failed), detail)
        return (*kept, f"look-ahead failed on rank(s) {sorted(failed)}: {detail}; ")
    return (*planned, "")


def check_cap(work: StepWork, cap: Optional[int], rank: int) -> None:
    """A sample over the hard cap (`max_tokens`) on its own raises `ExchangeError` before anything moves.

    Every rank sees the same gathered tokens, so every rank raises the same error without a collective;
    it names the sample as the rank that holds it pulled it (rank, micro-batch, position).
    """
    rows = work.rows
    over = np.flatnonzero(rows[:, F_TOKENS] > cap) if cap is not None else np.zeros(0, dtype=np.int64)
    if not over.size:
        return
    g = int(over[0])
    holder, m, j = int(work.holders[g]), int(rows[g, F_MICRO]), int(rows[g, F_STEP])
    same = (work.holders[:g] == holder) & (rows[:g, F_MICRO] == m) & (rows[:g, F_STEP] == j)
    raise ExchangeError(
        f"hf_dp_balance, step {work.step}, token cap: rank {holder}, micro-batch {m}, sample {int(same.sum())} "
        f"has {int(rows[g, F_TOKENS])} tokens, over the hard cap max_tokens={cap} on its own"
        + (f" ({over.size - 1} more samples over the cap)" if over.size > 1 else "")
        + f"; raised on every rank before any sample moved (checked on rank {rank})")


def collate_slots(ex: SampleExchange, collator: Callable, step: int, by_slot: List[List[int]],
                  samples_of: Callable[[List[int]], List[dict]], id_key: Optional[str]):
    """(packed batch of each slot, `id_key` values per slot or None); `samples_of(members)`: a slot's dicts.

    A collate failure on any rank raises `ExchangeError` on every rank, naming the rank, the slot and the
    cause, before any rank hands the step to training (`SampleExchange.raise_if_failed`: two hops per rank).
    """
    rank = ex.rank
    batches, ids = [], [] if id_key else None
    error, cause = None, None
    for m, members in enumerate(by_slot):
        slot = samples_of(members)
        if ids is not None:
            ids.append([s.get(id_key) for s in slot])
        try:
            batches.append(collator(slot))
        except Exception as exc:  # noqa: BLE001 - told to every rank below
            error = (f"step {step}, rank {rank}, micro-batch {m}: collating samples {members} "
                     f"(global indices) failed: {type(exc).__name__}: {exc}")
            cause = exc
            break
    try:
        ex.raise_if_failed(step, "collate", error)
    except ExchangeError as exc:
        raise exc from cause
    return batches, ids


__all__ = ["F_MICRO", "F_TOKENS", "F_VISION", "F_COST", "F_NBYTES", "F_STEP", "F_WIDTH", "FLAG_BALANCE", "FLAG_PRIOR",
           "MODEL_VERSION_SHIFT", "StepStats", "list_collate", "Prepared", "StepWork", "pull_micro_batches",
           "describe_samples", "cost_rows", "step_header", "step_decision",
           "gather_step", "validate_plan", "default_plan_fn", "slot_members",
           "slot_samples", "plan_digest", "agree_digests", "failure_detail", "agree_plan", "agree_lookahead", "check_cap", "collate_slots"]
