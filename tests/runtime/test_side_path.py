"""The per-step side path on real gloo processes: one planning rank, payloads point to point, one all_reduce."""

import time

import numpy as np
import torch

from hf_dp_balance.core.codec import encoded_nbytes, sample_entries, transfer_layout
from hf_dp_balance.runtime.exchange import ExchangeError
from hf_dp_balance.testing.side import side_exchange, socket_fds
from hf_dp_balance.testing.spawn import run_ranks

GA = 2
# Pairs that trade in every step of `_PairsPlan`: 1 <-> 2 both ways, 3 -> 5. Ranks 0 and 4 trade with no one.
PAIRS = ((1, 2), (2, 1), (3, 5))


class _Plan:
    def __init__(self, dest_rank, dest_micro):
        self.dest_rank, self.dest_micro_batch, self.applied, self.reason = dest_rank, dest_micro, True, "pairs"


def _pairs_plan(costs, owners, micro, world, num_micro, **kw):
    """Each (source, destination) of PAIRS moves the source's first sample of every micro-batch."""
    dest = np.asarray(owners, dtype=np.int64).copy()
    for src, dst in PAIRS:
        for m in range(num_micro):
            held = np.flatnonzero((owners == src) & (micro == m))
            dest[held[0]] = dst
    return _Plan(dest, np.asarray(micro, dtype=np.int64).copy())


def _steps_with_pairs(rank, world, steps):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader
    from hf_dp_balance.runtime.parallel import DataParallelGroup
    from hf_dp_balance.runtime.side_channel import new_side_group
    from hf_dp_balance.runtime.exchange import SampleExchange

    def micro_batches():
        for i in range(steps * GA):
            yield [{"input_ids": torch.full((4 + (7 * i + 3 * k + rank) % 20,), rank, dtype=torch.int32),
                    "sample_id": 10_000 * rank + 10 * i + k} for k in range(3)]

    cfg = DPBalanceConfig(timeout_s=30, prefetch_steps=1, min_gain=0.0, watchdog=False)
    import torch.distributed as dist

    ex = SampleExchange(30, group=new_side_group(DataParallelGroup.world(), 30))
    # the default group's barrier connects its own peers (the far ends asynchronously): all of them before counting
    dist.barrier()
    dist.barrier()
    time.sleep(1.0)
    before = socket_fds()
    dist.barrier()  # no rank's side path starts before every rank has counted (same ring: no new sockets)
    loader = BalancedLoader(micro_batches(), cfg, gradient_accumulation_steps=GA,
                            collator=lambda s: {"ids": [x["sample_id"] for x in s],
                                                "ranks": [int(x["input_ids"][0]) for x in s]},
                            features_fn=lambda s: (int(s["input_ids"].numel()), 0), plan_fn=_pairs_plan,
                            cost_model=CostModel(1.0, 1.0), exchange=ex)
    out = []
    for batches in loader.iter_steps():
        (st,) = loader.pop_stats()
        out.append(dict(ids=[b["ids"] for b in batches], holders=[b["ranks"] for b in batches],
                        sent=st.bytes_sent, received=st.bytes_received, applied=st.applied, hash=st.plan_hash))
    opened = socket_fds() - before
    loader.close()
    return out, opened


def test_only_trading_pairs_move_bytes_and_every_sample_trains_once_6_ranks():
    world, steps = 6, 4
    results = run_ranks(_steps_with_pairs, world, steps, timeout=240, env={"TORCH_GLOO_LAZY_INIT": "1"})
    trading = {r for pair in PAIRS for r in pair}
    for s in range(steps):
        assert len({results[r][0][s]["hash"] for r in range(world)}) == 1
        got = [i for r in range(world) for mb in results[r][0][s]["ids"] for i in mb]
        expected = {10_000 * r + 10 * i + k for r in range(world) for i in (GA * s, GA * s + 1) for k in range(3)}
        assert len(got) == len(set(got)) and set(got) == expected, f"step {s}: samples lost or duplicated"
        for r in range(world):
            st = results[r][0][s]
            assert st["applied"]
            if r in trading:
                assert st["sent"] + st["received"] > 0
            else:  # a rank that trades with no one sends and receives no payload at all
                assert st["sent"] == 0 and st["received"] == 0, (r, st)
            # a sample trains where the plan put it: rank 2 holds one of rank 1's per micro-batch, and so on
            came_from = {h for mb in st["holders"] for h in mb} - {r}
            assert came_from == {src for src, dst in PAIRS if dst == r}, (r, came_from)
    opened = [results[r][1] for r in range(world)]
    print("sockets opened per rank during the steps:", opened)
    # lazily connected sockets: the planning rank meets every rank; every other rank meets the planning rank and
    # the peers it trades with, nothing else (an all_to_all met all 5; a ring all_reduce adds 2 neighbours)
    assert opened[0] >= world - 1, opened
    for r in range(1, world):
        peers = {b for a, b in PAIRS if a == r} | {a for a, b in PAIRS if b == r}
        assert opened[r] <= 1 + len(peers), (r, opened)
    assert opened[4] <= 1, opened


# ------------------------------------------------------------------ a failure inside the point-to-point phase

def _fails_in_payload(rank, world, timeout_s):
    """Step 5: rank 1 raises while encoding its payload for rank 2; rank 3 trades with neither."""
    ex = side_exchange(timeout_s)
    sample = {"input_ids": torch.arange(10)}
    nbytes = encoded_nbytes(sample_entries(sample))
    owners = np.arange(world, dtype=np.int64)
    dest = np.array([0, 2, 1, 3], dtype=np.int64)  # 1 <-> 2 trade, 0 and 3 keep theirs
    sizes = np.full(world, nbytes, dtype=np.int64)
    if rank == 1:
        sizes = sizes + 8  # this rank's layout disagrees with what it encodes: it raises inside the exchange
    layout = transfer_layout(owners, dest, sizes, rank, world)
    t0 = time.monotonic()
    try:
        ex.exchange_payloads(5, [sample], rank, layout)
        ex.raise_if_failed(5, "collate")  # the loader's next agreement: where ranks outside the pair meet it
    except ExchangeError as exc:
        return time.monotonic() - t0, str(exc)
    return None


def test_a_failure_in_the_point_to_point_phase_names_step_rank_and_phase_on_every_rank():
    timeout_s = 4.0
    results = run_ranks(_fails_in_payload, 4, timeout_s, timeout=90)
    for rank, got in enumerate(results):
        assert got is not None, f"rank {rank} did not raise"
        elapsed, msg = got
        assert elapsed < timeout_s + 3.0, (rank, elapsed)
        assert "step 5" in msg and "rank 1" in msg and "payload point to point" in msg, (rank, msg)


# ------------------------------------------------------------------ the orders (pure, no processes)

def test_orders_give_every_sample_one_destination_and_both_ends_the_same_pairs_and_sizes():
    from hf_dp_balance.runtime.exchange import StepOrders
    from hf_dp_balance.runtime.planned_step import local_layout, orders_for_ranks, slots_of

    rng = np.random.default_rng(3)
    world, num_micro = 7, 3
    counts = rng.integers(0, 6, world)
    counts[2] = 0  # a rank that holds nothing
    holders = np.repeat(np.arange(world), counts)
    n = holders.size
    dest_rank, dest_micro, nbytes = rng.integers(0, world, n), rng.integers(0, num_micro, n), rng.integers(8, 99, n)
    orders = [StepOrders.decode(*(lambda h, b: (h.numpy().copy(), b))(*o.encode()))  # through the wire format
              for o in orders_for_ranks(holders, dest_rank, dest_micro, nbytes, world, num_micro, (True, 0.5, 0.1),
                                        "abc\nplanned")]
    trained = sorted(g for r in range(world) for slot in slots_of(orders[r], num_micro) for g in slot)
    assert trained == list(range(n))  # every sample exactly once
    layouts = []
    for r, o in enumerate(orders):
        assert o.text == "abc\nplanned" and int(o.head[1]) == num_micro
        offset = int(counts[:r].sum())
        layouts.append(local_layout(o, nbytes[offset: offset + counts[r]], world))
        for m, slot in enumerate(slots_of(o, num_micro)):
            assert slot == sorted(slot) and all(dest_rank[g] == r and dest_micro[g] == m for g in slot)
    for a in range(world):
        for b in range(world):  # what a sends b is what b expects from a: same samples, same order, same bytes
            assert np.array_equal(layouts[a].send_index[b], layouts[b].recv_index[a])
            assert layouts[a].send_splits[b] == layouts[b].recv_splits[a]
            expected = np.flatnonzero((holders == a) & (dest_rank == b) & (a != b))
            assert np.array_equal(layouts[a].send_index[b], expected)


# ------------------------------------------------------------------ fixed partners beyond max_partners + 1 ranks

def _steps_with_partners(rank, world, steps, max_partners):
    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.loader import BalancedLoader

    def micro_batches():  # rank 0 holds long samples, the others short ones: the plan must move
        for i in range(steps * GA):
            yield [{"input_ids": torch.full((40 if rank == 0 else 4 + (5 * i + 3 * k + rank) % 9,), rank,
                                            dtype=torch.int32), "sample_id": 10_000 * rank + 10 * i + k}
                   for k in range(3)]

    cfg = DPBalanceConfig(timeout_s=30, prefetch_steps=1, min_gain=0.0, watchdog=False, max_partners=max_partners,
                          max_token_ratio=2.0)
    loader = BalancedLoader(micro_batches(), cfg, gradient_accumulation_steps=GA,
                            collator=lambda s: {"ids": [x["sample_id"] for x in s],
                                                "ranks": [int(x["input_ids"][0]) for x in s]},
                            features_fn=lambda s: (int(s["input_ids"].numel()), 0), cost_model=CostModel(1.0, 1.0),
                            exchange=side_exchange(30))
    out = []
    for batches in loader.iter_steps():
        loader.pop_stats()
        out.append(dict(ids=[i for b in batches for i in b["ids"]], holders=[h for b in batches for h in b["ranks"]]))
    loader.close()
    return out


def test_beyond_max_partners_every_sample_moves_only_to_a_fixed_partner_6_ranks():
    from hf_dp_balance.core.partners import partner_sets

    world, steps, k = 6, 3, 2
    results = run_ranks(_steps_with_partners, world, steps, k, timeout=240)
    partners = partner_sets(world, k)
    assert not partners.complete  # the bound is in force at this size
    moved = 0
    for s in range(steps):
        got = [i for r in range(world) for i in results[r][s]["ids"]]
        expected = {10_000 * r + 10 * i + j for r in range(world) for i in (GA * s, GA * s + 1) for j in range(3)}
        assert len(got) == len(set(got)) and set(got) == expected, f"step {s}: samples lost or duplicated"
        for r in range(world):
            for holder in results[r][s]["holders"]:
                if holder != r:
                    moved += 1
                    assert partners.allows(holder, r), (s, holder, r)
    assert moved > 0  # rank 0's long samples went somewhere
