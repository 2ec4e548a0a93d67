"""The simulator's model of a step's cost: seconds per sample (`SampleCost`), the cost presets, and the
per-step maths (slot loads, makespan, exchange time). Pure numpy; the model is written out in docs/simulator.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from hf_dp_balance.core.cost import CostModel
from hf_dp_balance.core.costing import sample_costs
from hf_dp_balance.testing.mix import SampleShapes

# Effective throughput the FLOP presets assume: H100 SXM bf16 dense peak 989 TFLOP/s at
# about 40% MFU. Only ratios matter for the gain; absolute TGS scales with this number.
EFFECTIVE_TFLOPS = 400.0
# Bytes moved per sample: per LLM token input ids, labels (int64) and 4 rows of positions
# (int64) = 48 B; per vision patch 3*2*14*14 = 1176 bf16 values = 2352 B (Qwen2-VL
# pixel_values rows). InternVL tiles are 3*448*448 bf16 = 1204224 B per 1024 patches ~ 1176 B/patch.
BYTES_PER_TOKEN = 48
BYTES_PER_PATCH = 2352
# Network bandwidth per GPU for the sample exchange: 25 GB/s (200 Gb/s of a 400 Gb/s NIC).
DEFAULT_BANDWIDTH_GBS = 25.0


@dataclass(frozen=True)
class SampleCost:
    """Seconds of one sample: decoder over its LLM length + vision encoder over each vision item.

    `step_overhead` is the fixed time per optimizer step that balancing does not change and that is not
    priced apart (data loading, Python, logging); `params` (0: unknown) is what the gradient all-reduce
    and the optimizer step are priced from (`sim_price.StepPrice`).
    """

    name: str
    decoder: CostModel
    vision: Optional[CostModel]
    step_overhead: float
    assumption: str
    params: float = 0.0

    def costs(self, samples: SampleShapes) -> np.ndarray:
        """Seconds per sample (float64 [n]); a drawn vision item is one frame (the mixes draw no frame counts)."""
        return sample_costs(self.decoder, samples.tokens, self.vision, samples.item_patches, samples.item_sample)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "decoder": self.decoder.to_dict(),
            "vision": None if self.vision is None else self.vision.to_dict(),
            "step_overhead_s": self.step_overhead,
            "assumption": self.assumption,
            "params": self.params,
        }


def _seconds(model: CostModel, tflops: float) -> CostModel:
    """A TFLOP-valued CostModel in seconds at `tflops` TFLOP/s."""
    return CostModel(model.quadratic / tflops, model.linear / tflops, model.per_sample / tflops, model.constant / tflops)


def _flop_preset(name, params, d_model, layers, vit, overhead, what) -> SampleCost:
    vit_params, vit_d, vit_layers = vit
    return SampleCost(
        name=name,
        decoder=_seconds(CostModel.from_flops(params, d_model, layers, causal=True), EFFECTIVE_TFLOPS),
        vision=_seconds(CostModel.from_flops(vit_params, vit_d, vit_layers, causal=False), EFFECTIVE_TFLOPS),
        step_overhead=overhead,
        params=params + vit_params,
        assumption=(
            f"{what}: FLOPs 6*params per token + causal flash attention 6*d*layers per L^2 (decoder), "
            f"6*params per patch + full attention 12*d*layers per patches^2 within each image / frame pair / "
            f"tile (vision encoder), at {EFFECTIVE_TFLOPS:.0f} TFLOP/s effective (H100 bf16 at ~40% MFU); "
            f"fixed step part {overhead} s (data loading, Python, logging: a guess); all-reduce and optimizer "
            f"priced from {(params + vit_params) / 1e9:.2f}B parameters"
        ),
    )


# The fixed part of a step besides compute, all-reduce and optimizer (data loading, Python, logging): a guess.
FIXED_STEP_S = 0.05

COST_PRESETS = {
    # Decoder 7B of the generic shape (d 4096, 32 layers) + Qwen2-VL's 675M ViT (d 1280, 32 layers).
    "7b": lambda: _flop_preset("7b", 7e9, 4096, 32, (675e6, 1280, 32), FIXED_STEP_S, "7B decoder + Qwen2-VL ViT-675M"),
    # Qwen2-VL-72B: d 8192, 80 layers, same ViT.
    "72b": lambda: _flop_preset("72b", 72e9, 8192, 80, (675e6, 1280, 32), FIXED_STEP_S,
                                "72B decoder + Qwen2-VL ViT-675M"),
    # InternVL2.5-8B: InternLM2.5-7B (d 4096, 32 layers) + InternViT-300M (d 1024, 24 layers).
    "internvl-8b": lambda: _flop_preset(
        "internvl-8b", 7.7e9, 4096, 32, (304e6, 1024, 24), FIXED_STEP_S, "InternLM2.5-7B + InternViT-300M"
    ),
}


def load_cost(spec: str, step_overhead: Optional[float] = None) -> SampleCost:
    """A preset name (7b, 72b, internvl-8b) or the path of a fitted CostModel JSON.

    A JSON holds one CostModel in seconds (as `hf-dp-balance fit` writes it:
    applied to each sample's LLM length, vision included in L), or
    ``{"decoder": {...}, "vision": {...}}`` for separate vision costs. Its
    `constant` is added once per step, with `step_overhead` (default 0).
    """
    if spec in COST_PRESETS:
        preset = COST_PRESETS[spec]()
        if step_overhead is not None:
            preset = SampleCost(preset.name, preset.decoder, preset.vision, float(step_overhead), preset.assumption,
                                preset.params)
        return preset
    if not os.path.isfile(spec):
        raise ValueError(f"--cost {spec!r}: neither a preset ({', '.join(COST_PRESETS)}) nor an existing JSON file")
    try:
        with open(spec, "r", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--cost {spec}: cannot read a JSON cost model ({e})") from None
    if isinstance(data, dict) and "decoder" in data:
        decoder = CostModel.from_json(json.dumps(data["decoder"]))
        vision = None if data.get("vision") is None else CostModel.from_json(json.dumps(data["vision"]))
    else:
        decoder, vision = CostModel.from_json(json.dumps(data)), None
    overhead = float(step_overhead or 0.0) + decoder.constant + (vision.constant if vision else 0.0)
    decoder = CostModel(decoder.quadratic, decoder.linear, decoder.per_sample, 0.0)
    if vision is not None:
        vision = CostModel(vision.quadratic, vision.linear, vision.per_sample, 0.0)
    return SampleCost(os.path.basename(spec), decoder, vision, overhead, f"fitted cost model from {spec} (seconds)")


def move_seconds(nbytes: np.ndarray, src: np.ndarray, dst: np.ndarray, num_ranks: int, bandwidth: float) -> float:
    """Exchange time: the busiest rank's max(bytes sent, bytes received) / bandwidth (B/s)."""
    moving = src != dst
    if not moving.any():
        return 0.0
    sent = np.bincount(src[moving], weights=nbytes[moving], minlength=num_ranks)
    received = np.bincount(dst[moving], weights=nbytes[moving], minlength=num_ranks)
    return float(max(sent.max(), received.max()) / bandwidth)
