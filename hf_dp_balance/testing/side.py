"""Side groups for tests that drive the runtime's collectives alone, inside a spawned rank."""

from __future__ import annotations


def side_exchange(timeout_s: float):
    """A `SampleExchange` on a fresh world-wide side group."""
    from hf_dp_balance.runtime.exchange import SampleExchange
    from hf_dp_balance.runtime.parallel import DataParallelGroup
    from hf_dp_balance.runtime.side_channel import new_side_group

    return SampleExchange(timeout_s, group=new_side_group(DataParallelGroup.world(), timeout_s))


def live_process_groups() -> int:
    """Process groups torch.distributed still holds in this process (the default group included)."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


__all__ = ["live_process_groups", "side_exchange", "socket_fds"]


def socket_fds() -> int:
    """Sockets this process holds: with TORCH_GLOO_LAZY_INIT=1 each gloo peer first used adds one."""
    import os

    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count
