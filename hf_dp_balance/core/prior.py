"""The FLOP prior of a model: each sample's cost as a*L^2 + b*L + c, read from its transformers config.

`decoder_flops(cfg)` / `vision_flops(cfg)` give the FORWARD FLOPs of one sample (decoder: L tokens, causal
attention over the sample as varlen kernels compute it) or one frame (vision: L patches, bidirectional
attention within the frame) as (quadratic, linear, constant). `prior_coefficients` adds the backward pass.
Configs are read by attribute only (no transformers import). Formulas and sources: docs/cost_model.md.
"""

from __future__ import annotations

from typing import Any, Tuple

# Backward of a dense layer = 2 matmuls per forward matmul (input and weight gradients): 3x forward.
DENSE_FWD_BWD = 3.0
# Flash / SDPA-flash backward recomputes QK^T, then dV, dP, dQ, dK: 5 matmuls against the forward's 2.
ATTENTION_FWD_BWD = 3.5

Flops = Tuple[float, float, float]  # (per L^2, per L, per sample) forward FLOPs


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    if default is None:
        raise ValueError(f"{type(cfg).__name__}: none of {names} is set; cannot build the FLOP prior")
    return default


def text_config(cfg: Any) -> Any:
    """The decoder's config of a VLM (`text_config` / `llm_config`), or the config itself."""
    for name in ("text_config", "llm_config"):
        sub = getattr(cfg, name, None)
        if sub is not None:
            return sub
    return cfg


def decoder_flops(cfg: Any) -> Tuple[float, float]:
    """Forward FLOPs of one sample of L tokens: (dense per token, causal attention per L^2 per layer sum).

    Per layer and token: q/o projections 2*2*d*h*hd, k/v 2*2*d*kv*hd, SwiGLU MLP 3*2*d*I; plus the LM head
    2*d*V once. Causal attention over the sample: QK^T and AV over L(L+1)/2 pairs, 2*2*h*hd FLOPs each,
    i.e. 2*h*hd*(L^2 + L) per layer.
    Returns (dense_per_token, attention_coefficient) with attention FLOPs = coef * (L^2 + L).
    """
    cfg = text_config(cfg)
    d = int(_get(cfg, "hidden_size"))
    layers = int(_get(cfg, "num_hidden_layers"))
    heads = int(_get(cfg, "num_attention_heads"))
    kv = int(_get(cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(cfg, "head_dim", default=d // heads))
    inter = int(_get(cfg, "intermediate_size"))
    vocab = int(_get(cfg, "vocab_size"))
    per_layer = 4.0 * d * heads * head_dim + 4.0 * d * kv * head_dim + 6.0 * d * inter
    return layers * per_layer + 2.0 * d * vocab, 2.0 * layers * heads * head_dim


def _pair(value: Any) -> int:
    return int(value[0]) if isinstance(value, (list, tuple)) else int(value)


def _merger_per_patch(width: int, merge: int, out: int) -> float:
    """Qwen-VL patch merger (2-layer MLP on merge^2 concatenated patches, then to `out`), per patch."""
    hidden = width * merge * merge
    return (2.0 * hidden * hidden + 2.0 * hidden * out) / (merge * merge)


def vision_flops(cfg: Any) -> Tuple[float, float, float, float]:
    """Forward FLOPs of one frame of L patches: (dense per patch, full-attention coef, windowed-attention
    per patch, per frame), attention FLOPs = coef * L^2 (bidirectional: QK^T + AV, 4*width per pair per
    layer). Qwen2-VL / Qwen2.5-VL / Qwen3-VL towers (patch embed, blocks, merger(s)) and InternViT tiles
    (class token, pixel-shuffle projector). Qwen2.5-VL's window layers attend within windows of W
    patches: 4*width*W per patch (exact when the frame tiles into whole windows, an upper bound else)."""
    vcfg = getattr(cfg, "vision_config", None)
    if vcfg is None:
        raise ValueError(f"{type(cfg).__name__} has no vision_config: no vision tower to build a prior for")
    kind = str(getattr(vcfg, "model_type", ""))
    if kind.startswith("intern"):
        return _internvit_flops(cfg, vcfg)
    width = int(_get(vcfg, "embed_dim" if kind == "qwen2_vl_vision" else "hidden_size"))
    depth = int(_get(vcfg, "depth", "num_hidden_layers"))
    patch, merge = _pair(_get(vcfg, "patch_size")), int(_get(vcfg, "spatial_merge_size", default=2))
    embed = 2.0 * 3 * int(_get(vcfg, "temporal_patch_size", default=1)) * patch * patch * width
    if kind == "qwen2_vl_vision":
        mlp = 4.0 * width * width * float(_get(vcfg, "mlp_ratio"))  # fc1, fc2 (GELU)
        out, mergers = int(_get(vcfg, "hidden_size")), 1
    elif kind == "qwen2_5_vl_vision":
        mlp = 6.0 * width * int(_get(vcfg, "intermediate_size"))  # gate, up, down (SwiGLU)
        out, mergers = int(_get(vcfg, "out_hidden_size")), 1
    else:  # qwen3_vl_vision: fc1, fc2 (GELU), one merger per deepstack layer besides the final one
        mlp = 4.0 * width * int(_get(vcfg, "intermediate_size"))
        out = int(_get(vcfg, "out_hidden_size"))
        mergers = 1 + len(getattr(vcfg, "deepstack_visual_indexes", None) or ())
    dense = embed + depth * (8.0 * width * width + mlp) + mergers * _merger_per_patch(width, merge, out)
    full_layers, window_per_patch = depth, 0.0
    if kind == "qwen2_5_vl_vision":  # window attention except in fullatt_block_indexes
        full_layers = len(getattr(vcfg, "fullatt_block_indexes", None) or ())
        window = (int(_get(vcfg, "window_size")) // patch) ** 2  # patches per window
        window_per_patch = 4.0 * width * window * (depth - full_layers)
    return dense, 4.0 * width * full_layers, window_per_patch, 0.0


def _internvit_flops(cfg: Any, vcfg: Any) -> Tuple[float, float, float, float]:
    """InternViT per tile of L patches (+1 class token) and InternVL's projector (pixel shuffle by
    `downsample_ratio`, then 2 linear layers to the decoder width)."""
    width = int(_get(vcfg, "hidden_size"))
    depth = int(_get(vcfg, "num_hidden_layers"))
    patch = _pair(_get(vcfg, "patch_size"))
    per_token = depth * (8.0 * width * width + 4.0 * width * int(_get(vcfg, "intermediate_size")))
    embed = 2.0 * 3 * patch * patch * width
    ratio = float(getattr(cfg, "downsample_ratio", 0.5))
    text_width = int(_get(text_config(cfg), "hidden_size"))
    projector = ratio * ratio * (2.0 * (width / (ratio * ratio)) * text_width + 2.0 * text_width * text_width)
    attn = 4.0 * width * depth
    # L+1 tokens: the class token's dense work is per tile; attention (L+1)^2 = L^2 + 2L + 1
    return per_token + embed + projector, attn, 2.0 * attn, per_token + attn


def prior_coefficients(cfg: Any, module: str = "decoder") -> Tuple[float, float, float, float]:
    """(quadratic, linear, per_sample, constant) FLOPs of forward + backward of one sample (decoder) or
    one frame (vision); constant is 0 (a step's fixed overhead is not FLOPs: the fit finds it)."""
    if module == "decoder":
        dense, attn = decoder_flops(cfg)
        return ATTENTION_FWD_BWD * attn, DENSE_FWD_BWD * dense + ATTENTION_FWD_BWD * attn, 0.0, 0.0
    if module == "vision":
        dense, attn, window, per_frame = vision_flops(cfg)
        return (ATTENTION_FWD_BWD * attn, DENSE_FWD_BWD * dense + ATTENTION_FWD_BWD * window,
                DENSE_FWD_BWD * per_frame, 0.0)
    raise ValueError(f"module={module!r}: must be 'decoder' or 'vision'")


__all__ = ["ATTENTION_FWD_BWD", "DENSE_FWD_BWD", "decoder_flops", "prior_coefficients", "text_config", "vision_flops"]
