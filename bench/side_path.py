"""Per-step side path at 4 / 8 / 16 / 32 processes: this tree beside a baseline tree, in one run.

Each measurement runs the loader's per-step path (`BalancedLoader.iter_steps`, GA 2, long-tail text samples,
a cost model, the real planner) on P gloo processes with `TORCH_GLOO_LAZY_INIT=1`, once with the code of
this tree and once with a baseline commit's (extracted with `git archive`; default: the last commit whose
side path gathered every row to every rank). In every rank the calls on the exchange group are counted
(wrapped `torch.distributed` functions) with the hops and bytes of gloo's algorithms: a ring all_gather
is P - 1 sends and P - 1 receives and receives every other rank's tensor; a ring all_reduce 2 (P - 1) of
each and about 2 x its size; all_to_all_single sends to and receives from every peer, empty splits
included; isend / irecv one hop each. Payload (all_to_all_single, or sends tagged as payload) is counted
apart from the side traffic (metadata, orders, agreements). Also per rank: planning time per step
(the planner's thread CPU time), sockets opened during the steps (after the first and after the last), and on ranks 0 and 1 the costs the extrapolation
uses: one small point-to-point hop, one byte of a 16 MiB transfer, one 24-byte all_reduce, and a 24-byte
agreement through rank 0 (every rank sends, rank 0 answers).

Run:  python bench/side_path.py [--ranks 4,8,16] [--steps 12] [--baseline eff4fc4] [--write FILE] [--render FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

GA = 2
SAMPLES_PER_MICRO = 8
WARMUP = 2
PAYLOAD_TAG = 6  # runtime.exchange.TAG_PAYLOAD in this tree
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ inside one rank

def _socket_fds() -> int:
    # testing.side.socket_fds, written here too: this script also runs against older trees that lack it
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


class _Counter:
    """Hops and bytes of the calls made on one process group (wrapped `torch.distributed` functions)."""

    def __init__(self, dist, group, world):
        self.group, self.world = group, world
        self.side = dict(sends=0, recvs=0, bytes=0)
        self.payload = dict(sends=0, recvs=0, bytes=0)
        self._wrap(dist)

    def _wrap(self, dist):
        p = self.world - 1

        def counted(name, fn, account):
            def wrapper(*args, **kw):
                if kw.get("group") is self.group:
                    account(*args, **kw)
                return fn(*args, **kw)
            setattr(dist, name, wrapper)

        def add(kind, sends, recvs, nbytes):
            box = self.payload if kind == "payload" else self.side
            box["sends"] += sends
            box["recvs"] += recvs
            box["bytes"] += int(nbytes)

        counted("all_gather", dist.all_gather, lambda out, t, **kw: add("side", p, p, p * t.numel() * t.element_size()))
        counted("all_reduce", dist.all_reduce,
                lambda t, **kw: add("side", 2 * p, 2 * p, 2 * p * t.numel() * t.element_size() / self.world))
        counted("all_to_all_single", dist.all_to_all_single,
                lambda out, inp, output_split_sizes=None, **kw: add(
                    "payload", p, p, out.numel() * out.element_size()))
        counted("isend", dist.isend, lambda t, *a, tag=0, **kw: add("payload" if tag == PAYLOAD_TAG else "side", 1, 0, 0))
        counted("irecv", dist.irecv, lambda t, *a, tag=0, **kw: add(
            "payload" if tag == PAYLOAD_TAG else "side", 0, 1, t.numel() * t.element_size()))
        counted("send", dist.send, lambda t, *a, tag=0, **kw: add("side", 1, 0, 0))
        counted("recv", dist.recv, lambda t, *a, tag=0, **kw: add("side", 0, 1, t.numel() * t.element_size()))

    def snapshot(self):
        return dict(side=dict(self.side), payload=dict(self.payload))


def _micro_batches(rank: int, steps: int):
    import torch

    rng = np.random.default_rng(1000 + rank)
    for i in range(steps * GA):
        lengths = np.minimum(rng.lognormal(5.0, 1.0, SAMPLES_PER_MICRO).astype(int) + 8, 4000)
        yield [{"input_ids": torch.zeros(int(n), dtype=torch.int32), "sample_id": rank * 10**6 + i * 100 + k}
               for k, n in enumerate(lengths)]


def _pack_lengths(samples):
    return {"lengths": [int(s["input_ids"].numel()) for s in samples]}


def _timed_loop(fn, repeats):
    """Median seconds of one call (the machine is shared: a median resists the other processes' bursts)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _unit_costs(dist, group, rank, world):
    """Seconds per small hop and per byte (ranks 0 and 1), per 24-byte all_reduce and per agreement through rank 0."""
    import torch

    out = {}
    small, big = torch.zeros(1, dtype=torch.int64), torch.zeros(16 * 2**20, dtype=torch.uint8)
    dist.barrier(group=group)
    if rank in (0, 1):
        peer = 1 - rank

        def ping(t):
            if rank == 0:
                dist.send(t, group_dst=peer, group=group)
                dist.recv(t, group_src=peer, group=group)
            else:
                dist.recv(t, group_src=peer, group=group)
                dist.send(t, group_dst=peer, group=group)

        ping(small)
        out["hop_s"] = _timed_loop(lambda: ping(small), 200) / 2
        out["byte_s"] = max(_timed_loop(lambda: ping(big), 9) / 2 - out["hop_s"], 0.0) / big.numel()
    dist.barrier(group=group)
    vec = torch.zeros(3, dtype=torch.int64)
    dist.all_reduce(vec, group=group)
    out["all_reduce_s"] = _timed_loop(lambda: dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group), 50)

    def star():
        if rank == 0:
            bufs = [torch.zeros(3, dtype=torch.int64) for _ in range(world - 1)]
            for w in [dist.irecv(b, group_src=r + 1, group=group) for r, b in enumerate(bufs)]:
                w.wait()
            for w in [dist.isend(vec, group_dst=r, group=group) for r in range(1, world)]:
                w.wait()
        else:
            dist.send(vec, group_dst=0, group=group)
            dist.recv(vec, group_src=0, group=group)

    star()
    dist.barrier(group=group)
    out["star_s"] = _timed_loop(star, 50)
    return out


def _rank_main(rank, world, steps):
    import torch.distributed as dist

    from hf_dp_balance.config import DPBalanceConfig
    from hf_dp_balance.core.cost import CostModel
    from hf_dp_balance.runtime.exchange import SampleExchange
    from hf_dp_balance.runtime.loader import BalancedLoader
    from hf_dp_balance.runtime.parallel import DataParallelGroup
    from hf_dp_balance.runtime.side_channel import new_side_group

    from hf_dp_balance.core.planner import plan_step

    import hf_dp_balance

    planner_cpu = [0.0, 0]

    def timed_plan(*a, **kw):  # the planner's thread CPU time, whichever rank calls it
        t = time.thread_time()
        try:
            return plan_step(*a, **kw)
        finally:
            planner_cpu[0] += time.thread_time() - t
            planner_cpu[1] += 1

    cfg = DPBalanceConfig(timeout_s=300, prefetch_steps=1, watchdog=False)
    ex = SampleExchange(300, group=new_side_group(DataParallelGroup.world(), 300))
    dist.barrier()  # the default group's connections, before counting
    counter = _Counter(dist, ex.group, world)
    loader = BalancedLoader(_micro_batches(rank, steps), cfg, gradient_accumulation_steps=GA,
                            collator=_pack_lengths, features_fn=lambda s: (int(s["input_ids"].numel()), 0),
                            cost_model=CostModel(quadratic=16.0 / 53000.0, linear=1.0, per_sample=4.0), exchange=ex,
                            plan_fn=timed_plan)
    # The default group's barrier connects its own peers (gloo's dissemination barrier, about 2 log2 P of
    # them), the far ends asynchronously: connect them all before counting, so only the side path is counted.
    dist.barrier()
    dist.barrier()
    time.sleep(1.0)
    rows, sockets0 = [], _socket_fds()
    dist.barrier()
    for step, _ in enumerate(loader.iter_steps()):
        (st,) = loader.pop_stats()
        rows.append(dict(step=step, plan=st.plan_s, sockets=_socket_fds() - sockets0, work=st.gather_s + st.plan_s + st.exchange_s + st.collate_s,
                         applied=st.applied, hash=st.plan_hash, samples=st.num_samples, traffic=counter.snapshot()))
    sockets = _socket_fds() - sockets0
    loader.close()
    return dict(rows=rows, sockets=sockets, units=_unit_costs(dist, ex.group, rank, world),
                plan_cpu_ms=1000 * planner_cpu[0] / max(planner_cpu[1], 1), plan_calls=planner_cpu[1],
                code=os.path.dirname(hf_dp_balance.__file__))


def _measure(world: int, steps: int) -> dict:
    from hf_dp_balance.testing.spawn import run_ranks

    t0 = time.perf_counter()
    results = run_ranks(_rank_main, world, steps, timeout=1500, pg_timeout_s=300)
    return dict(world=world, steps=steps, results=results, run_s=time.perf_counter() - t0)


# ------------------------------------------------------------------ the parent: trees side by side

def _summary(run: dict) -> dict:
    """Per rank per steady step: side bytes received, side hops, payload hops; planning times; sockets."""
    world, res = run["world"], run["results"]
    steady = [s for s in range(len(res[0]["rows"])) if s >= WARMUP]
    first, last = steady[0] - 1, steady[-1]

    def per_step(r, kind, key):
        a, b = res[r]["rows"][first]["traffic"][kind][key], res[r]["rows"][last]["traffic"][kind][key]
        return (b - a) / len(steady)

    side_bytes = [per_step(r, "side", "bytes") for r in range(world)]
    side_hops = [per_step(r, "side", "sends") + per_step(r, "side", "recvs") for r in range(world)]
    pay_hops = [per_step(r, "payload", "sends") + per_step(r, "payload", "recvs") for r in range(world)]
    plan = [res[r]["plan_cpu_ms"] for r in range(world)]
    calls = [res[r]["plan_calls"] for r in range(world)]
    work = [1000 * float(np.median([res[r]["rows"][s]["work"] for s in steady])) for r in range(world)]
    for s in range(len(res[0]["rows"])):
        assert len({res[r]["rows"][s]["hash"] for r in range(world)}) == 1, f"step {s}: ranks disagree on the plan"
    units = [res[r]["units"] for r in range(world)]
    return dict(world=world, code=res[0]["code"], plan_calls=calls, side_bytes=side_bytes, side_hops=side_hops, payload_hops=pay_hops, plan_ms=plan,
                work_ms=work, sockets=[res[r]["sockets"] for r in range(world)],
                first_sockets=[res[r]["rows"][0]["sockets"] for r in range(world)],
                samples=res[0]["rows"][-1]["samples"], hashes=[x["hash"] for x in res[0]["rows"]],
                applied=sum(x["applied"] for x in res[0]["rows"]), hop_s=units[0]["hop_s"], byte_s=units[0]["byte_s"],
                all_reduce_s=float(np.median([u["all_reduce_s"] for u in units])),
                star_s=float(np.median([u["star_s"] for u in units])), run_s=run["run_s"])


def _run_tree(tree: str, world: int, steps: int) -> dict:
    """One measurement in a fresh interpreter whose `hf_dp_balance` is `tree`'s."""
    env = dict(os.environ, PYTHONPATH=tree, TORCH_GLOO_LAZY_INIT="1", OMP_NUM_THREADS="1")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(world), "--steps", str(steps), "--json", out]
    subprocess.run(cmd, env=env, check=True, timeout=1800, cwd=tree)
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


def _extract(ref: str) -> str:
    where = tempfile.mkdtemp(prefix="side_path_baseline_")
    archive = subprocess.run(["git", "archive", ref, "hf_dp_balance"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
    return where


def _fmt_ranks(values, digits=0):
    """'median (max)' of per-rank values."""
    return f"{np.median(values):,.{digits}f} ({max(values):,.{digits}f})"


def report(pairs, args) -> list:
    lines = [
        "| P | side bytes received per rank per step: before / after, median (max) | side hops per rank per step: "
        "before / after, median (max) | payload hops per rank per step: before / after | planning ms per step: "
        "CPU, before (every rank) / after (the planning rank) | sockets opened per rank (lazy init): before / after, median "
        "(max), after the first step / after all steps | agreement latency: all_reduce / through rank 0 | thread time "
        "per step (gather + plan + exchange + pack), median over ranks: before / after |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for before, after in pairs:
        assert before["hashes"] == after["hashes"], f"P={after['world']}: plans differ between the trees"
        lines.append(
            f"| {after['world']} | {_fmt_ranks(before['side_bytes'])} / {_fmt_ranks(after['side_bytes'])} | "
            f"{_fmt_ranks(before['side_hops'])} / {_fmt_ranks(after['side_hops'])} | "
            f"{np.median(before['payload_hops']):.1f} / {np.median(after['payload_hops']):.1f} | "
            f"{np.median(before['plan_ms']):.1f} / {after['plan_ms'][0]:.1f} "
            f"(planner calls per rank: {before['plan_calls'][1]} / {after['plan_calls'][1]}) | "
            f"{_fmt_ranks(before['first_sockets'])} / {_fmt_ranks(after['first_sockets'])}, "
            f"{_fmt_ranks(before['sockets'])} / {_fmt_ranks(after['sockets'])} | "
            f"{1e6 * after['all_reduce_s']:.0f} / {1e6 * after['star_s']:.0f} us | "
            f"{np.median(before['work_ms']):.0f} / {np.median(after['work_ms']):.0f} ms |")
    lines += [""] + extrapolate(pairs)
    last = pairs[-1][1]
    lines += ["", f"Samples per step at P={last['world']}: {last['samples']}; plans identical on every rank and "
                  f"between the trees at every step; steps applied: {last['applied']}.",
              "Unit costs measured between ranks 0 and 1 (loopback) in each run, us a small hop / ns a byte: "
              + "; ".join(f"P={a['world']}: {1e6 * b['hop_s']:.0f}, {1e6 * a['hop_s']:.0f} / {1e9 * b['byte_s']:.2f}, "
                          f"{1e9 * a['byte_s']:.2f}" for b, a in pairs)
              + "; the extrapolation takes the smallest of each (the least disturbed by the other processes)."]
    return lines


def _fit(ps, values):
    """(a, b) of values ~ a + b * P by least squares (the measured sizes); flat (their mean) when the slope
    comes out negative (noise around a constant)."""
    b, a = np.polyfit(np.asarray(ps, dtype=float), np.asarray(values, dtype=float), 1)
    return (a, b) if b >= 0 else (float(np.mean(values)), 0.0)


def extrapolate(pairs, targets=(512, 4096, 32768)) -> list:
    """Per rank per step at large DP from the measured P-dependence and unit costs (hop and byte)."""
    ps = [a["world"] for _, a in pairs]
    # the least disturbed measurement of each unit cost: on a shared machine other processes only add time
    hop_s = float(min(x["hop_s"] for pair in pairs for x in pair))
    byte_s = float(min(x["byte_s"] for pair in pairs for x in pair if x["byte_s"] > 0))
    series = {
        "before, every rank": ([np.median(b["side_bytes"]) for b, _ in pairs],
                               [np.median(b["side_hops"]) for b, _ in pairs]),
        "after, a rank that does not plan": ([np.median(a["side_bytes"][1:]) for _, a in pairs],
                                             [np.median(a["side_hops"][1:]) for _, a in pairs]),
        "after, the planning rank": ([a["side_bytes"][0] for _, a in pairs], [a["side_hops"][0] for _, a in pairs]),
    }
    plan_per_sample = np.median([a["plan_ms"][0] / a["samples"] for _, a in pairs])
    per_rank = pairs[-1][1]["samples"] / pairs[-1][1]["world"]
    lines = ["| DP | who | side bytes received per step | side hops per step | its own side time per step at the "
             "measured unit costs (hops x hop + bytes x byte) |", "|---|---|---|---|---|"]
    for target in targets:
        for who, (nbytes, hops) in series.items():
            fb, fh = _fit(ps, nbytes), _fit(ps, hops)
            b, h = fb[0] + fb[1] * target, fh[0] + fh[1] * target
            size = f"{b / 1e6:,.1f} MB" if b >= 1e5 else f"{b / 1e3:,.2f} kB"
            lines.append(f"| {target:,} | {who} | {size} | {h:,.0f} | {1000 * (h * hop_s + b * byte_s):,.1f} ms |")
    lines += ["", f"Planning CPU per step grows with the step's samples (measured {1000 * plan_per_sample:.1f} us a "
                  f"sample at {per_rank:.0f} samples per rank); at DP 512 / 4,096 / 32,768 that is about "
                  + " / ".join(f"{plan_per_sample * per_rank * t:,.0f} ms" for t in targets)
                  + " per step, before on every rank, after on the planning rank only."]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="4,8,16")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--baseline", default="eff4fc4", help="git ref of the baseline tree")
    ap.add_argument("--write", default=None, help="also write the table (markdown) and raw summaries (json) here")
    ap.add_argument("--render", default=None, help="print the report of an earlier run's json (--write FILE.json)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:  # a child: one measurement with whatever hf_dp_balance PYTHONPATH gives
        with open(args.json, "w") as f:
            json.dump(_summary(_measure(args.one, args.steps)), f)
        return 0
    if args.render:
        with open(args.render) as f:
            pairs = [tuple(pair) for pair in json.load(f)]
    else:
        baseline = _extract(args.baseline)
        pairs = []
        for world in [int(x) for x in args.ranks.split(",")]:
            pairs.append((_run_tree(baseline, world, args.steps), _run_tree(ROOT, world, args.steps)))
            print(f"P={world}: done", flush=True)
    text = "\n".join([f"Command: `python bench/side_path.py --ranks {args.ranks} --steps {args.steps} "
                      f"--baseline {args.baseline}`", ""] + report(pairs, args)) + "\n"
    print(text)
    if args.write and not args.render:
        with open(args.write, "w") as f:
            f.write(text)
        with open(args.write + ".json", "w") as f:
            json.dump([[b, a] for b, a in pairs], f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
