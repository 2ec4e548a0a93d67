"""The parts of a simulated step that balancing does not change, and how the exchange of samples shows.

A step = balanced compute (the slowest rank) + exposed gradient all-reduce + optimizer step + a fixed part
+ the exposed exchange. Defaults are documented hardware (H100/H200-class GPUs, 8 per node, NVLink inside a
node, 400 Gb/s per GPU between nodes); which terms are known and which are guesses: docs/simulator.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict

# Ring all-reduce moves 2 (N-1)/N of the gradient bytes through every GPU's link; NCCL's bus bandwidth is
# about the link's: NVLink 4 (H100/H200 SXM) 450 GB/s per direction inside a node, the GPU's own 400 Gb/s
# NIC between nodes (a DGX/HGX node has one NIC per GPU).
INTRA_NODE_GBPS = 3600.0  # Gb/s per GPU (450 GB/s)
INTER_NODE_GBPS = 400.0  # Gb/s per GPU
GPUS_PER_NODE = 8
GRAD_BYTES = {"bf16": 2, "fp32": 4}
# Adam step per parameter: read fp32 master weight, m, v, gradient, write weight, m, v, bf16 copy
# (4*4 + 3*4 + 2 = 30 B) at HBM bandwidth (H100 SXM 3.35 TB/s; H200 4.8 TB/s), unsharded (DDP).
ADAM_BYTES_PER_PARAM = 30
HBM_GBPS = 3350.0  # GB/s
# When the all-reduce overlaps (DDP's buckets), it hides behind the backward pass: ~2/3 of the compute.
BACKWARD_SHARE = 2.0 / 3.0
PARTS = ("compute", "allreduce", "optimizer", "fixed", "exchange")


@dataclass(frozen=True)
class StepPrice:
    """Seconds of a step's parts besides its compute, at one DP size's network (all fields are CLI flags)."""

    params: float = 0.0  # parameters whose gradients are all-reduced every step (0: none)
    grad_dtype: str = "bf16"
    gpus_per_node: int = GPUS_PER_NODE
    intra_node_gbps: float = INTRA_NODE_GBPS
    inter_node_gbps: float = INTER_NODE_GBPS
    allreduce_overlapped: bool = True
    optimizer_s: float = 0.0
    fixed_s: float = 0.0  # data loading, Python, logging: whatever else a step pays once

    def __post_init__(self) -> None:
        if self.grad_dtype not in GRAD_BYTES:
            raise ValueError(f"--grad-dtype {self.grad_dtype!r}: one of {', '.join(GRAD_BYTES)}")
        for name in ("params", "optimizer_s", "fixed_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 0")
        for name in ("intra_node_gbps", "inter_node_gbps", "gpus_per_node"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be > 0")

    @classmethod
    def adam(cls, params: float, **kw) -> "StepPrice":
        """The price with the optimizer step of unsharded Adam over `params` at HBM bandwidth."""
        return cls(params=params, optimizer_s=params * ADAM_BYTES_PER_PARAM / (HBM_GBPS * 1e9), **kw)

    def allreduce_s(self, dp: int) -> float:
        """Ring all-reduce of the gradients over `dp` GPUs: 2 (dp-1)/dp * bytes / the slowest link's bandwidth."""
        if dp <= 1 or self.params == 0:
            return 0.0
        gbps = self.intra_node_gbps if dp <= self.gpus_per_node else self.inter_node_gbps
        nbytes = self.params * GRAD_BYTES[self.grad_dtype]
        return 2.0 * (dp - 1) / dp * nbytes / (gbps * 1e9 / 8)

    def parts(self, dp: int, compute: float, move_s: float, exchange_overlapped: bool) -> Dict[str, float]:
        """Seconds of every part of one step (PARTS), exposed time only.

        The all-reduce, when overlapped, shows only where it outlasts the backward pass; the exchange of
        the next step's samples, when overlapped, runs during this step and shows only where it outlasts it.
        """
        allreduce = self.allreduce_s(dp)
        if self.allreduce_overlapped:
            allreduce = max(0.0, allreduce - BACKWARD_SHARE * compute)
        before = compute + allreduce + self.optimizer_s + self.fixed_s
        exchange = max(0.0, move_s - before) if exchange_overlapped else move_s
        return {"compute": compute, "allreduce": allreduce, "optimizer": self.optimizer_s, "fixed": self.fixed_s,
                "exchange": exchange}

    def to_dict(self, dp_sizes=()) -> dict:
        out = asdict(self)
        out["grad_bytes_per_param"] = GRAD_BYTES[self.grad_dtype]
        out["allreduce_s_by_dp"] = {str(d): self.allreduce_s(d) for d in dp_sizes}
        return out
