"""Cost-model test inputs: published model sizes and step times drawn from a known cost model."""

import numpy as np

from hf_dp_balance.core.cost import CostModel, features_of


def published_configs():
    """Real sizes (from the published config.json of each model), built from the config classes."""
    from transformers import InternVLConfig, Qwen2Config, Qwen2VLConfig, Qwen3VLConfig

    qwen2_7b = Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                           intermediate_size=18944, vocab_size=152064)
    qwen2_vl_2b = Qwen2VLConfig(
        text_config=dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936),
        vision_config=dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2))
    qwen3_vl_8b = Qwen3VLConfig(
        text_config=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288, vocab_size=151936),
        vision_config=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                           out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24]))
    internvl3_8b = InternVLConfig(
        text_config=dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, intermediate_size=18944, vocab_size=151674),
        vision_config=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                           image_size=448, patch_size=14))
    return qwen2_7b, qwen2_vl_2b, qwen3_vl_8b, internvl3_8b


def fixed_length_steps(seed, steps=16, ranks=8, pack=8192, noise=0.03):
    """(prior, truth, features [steps, ranks, 4], step times): fixed-length packs (sum L equal on every rank)
    timed by a known model, Qwen2-7B's prior with attention 30% slower, under `noise` (3%) log-normal noise."""
    rng = np.random.default_rng(seed)
    prior = CostModel.from_config(published_configs()[0])
    scale = 1.0 / 400.0  # TFLOPs -> s at 400 TFLOP/s
    lin = prior.linear * scale
    truth = CostModel(prior.quadratic * scale * 1.3, lin, 0.001 * lin * pack, 0.05 * lin * pack)
    packs = []
    for _ in range(steps * ranks):
        lengths, left = [], pack
        while left > 0:
            lengths.append(int(min(left, max(16, rng.lognormal(np.log(300), 0.9)))))
            left -= lengths[-1]
        packs.append(lengths)
    feats = np.stack([features_of(p) for p in packs]).reshape(steps, ranks, 4)
    return prior, truth, feats, truth.predict(feats) * rng.lognormal(0.0, noise, size=(steps, ranks))
