"""Varlen attention: same numbers as eager / sdpa on packed rows, and as separate samples."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_dp_balance.runtime.attention import DEFAULT_NAME, register_varlen_attention, varlen_attention_forward

torch.set_num_threads(1)

LENGTHS = [5, 17, 1, 9, 30]
VOCAB = 97


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2,
    )


def make_model(cls, config, attn, dtype):
    """Same seed -> same weights for every attention implementation; a config copy each, because
    building a model writes the implementation into its (otherwise shared) sub-configs."""
    torch.manual_seed(0)
    model = cls._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=dtype).eval()
    for module in model.modules():
        if hasattr(module, "config") and hasattr(module.config, "_attn_implementation"):
            assert module.config._attn_implementation == attn, (type(module).__name__, module.config._attn_implementation)
    return model


def packed_batch(lengths, seed=0, position_rows=None):
    """input_ids / labels / position_ids of one packed row; the first label of each sample is -100
    (DataCollatorWithFlattening's convention: no prediction across a sample boundary)."""
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    input_ids = torch.cat(samples)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in samples])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    if position_rows:
        positions = positions[None].expand(position_rows, 1, -1).contiguous()
    return samples, input_ids, labels, positions


def summed_token_loss(logits, labels):
    """Sum of next-token cross-entropies (labels shifted as in causal LM losses)."""
    return F.cross_entropy(logits[0, :-1].double(), labels[0, 1:], ignore_index=-100, reduction="sum")


def test_registration_is_idempotent_and_refuses_taken_names():
    from transformers import AttentionInterface

    assert register_varlen_attention() == DEFAULT_NAME
    assert register_varlen_attention() == DEFAULT_NAME
    assert AttentionInterface._global_mapping[DEFAULT_NAME] is varlen_attention_forward
    with pytest.raises(ValueError, match="already registered"):
        register_varlen_attention("sdpa")
    with pytest.raises(ValueError, match="invalid name"):
        register_varlen_attention("my_flash_thing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qwen2_packed_loss_and_gradient_match_eager_sdpa_and_separate_samples(dtype):
    from transformers import Qwen2ForCausalLM

    name = register_varlen_attention()
    config = qwen2_config()
    models = {attn: make_model(Qwen2ForCausalLM, config, attn, dtype) for attn in (name, "eager", "sdpa")}
    samples, input_ids, labels, positions = packed_batch(LENGTHS)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    n_predicted = sum(n - 1 for n in LENGTHS)

    losses, grads = {}, {}
    for attn, model in models.items():
        model.zero_grad()
        # own loss in float64: the model's loss function computes in float32 whatever the dtype
        loss = summed_token_loss(model(input_ids=input_ids, position_ids=positions).logits, labels) / n_predicted
        loss.backward()
        losses[attn] = loss.detach()
        grads[attn] = torch.cat([p.grad.flatten() for p in model.parameters()]).double()

    # packed loss and gradient agree with the masked implementations (eager's softmax runs in
    # float32 whatever the dtype, hence its looser float64 tolerance)
    torch.testing.assert_close(losses[name], losses["sdpa"], rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)
    torch.testing.assert_close(grads[name], grads["sdpa"], **tol)
    torch.testing.assert_close(losses[name], losses["eager"], rtol=1e-5 if dtype == torch.float32 else 1e-7, atol=0)
    torch.testing.assert_close(grads[name], grads["eager"], rtol=1e-5, atol=1e-6)

    # ... and equal the token-weighted mean of the samples run one by one
    model = models[name]
    with torch.no_grad():
        total = sum(summed_token_loss(model(input_ids=s[None]).logits, s[None]) for s in samples)
    torch.testing.assert_close(losses[name], total / n_predicted, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=0)

    # sanity: without position restarts the packed loss is a different number (cross-sample attention)
    with torch.no_grad():
        unpacked = summed_token_loss(model(input_ids=input_ids).logits, labels) / n_predicted
    assert abs(unpacked / losses[name] - 1) > 1e-4


def test_padding_mask_and_cu_seqlens_paths():
    from transformers import Qwen2ForCausalLM

    name = register_varlen_attention()
    config = qwen2_config()
    varlen = make_model(Qwen2ForCausalLM, config, name, torch.float64)
    eager = make_model(Qwen2ForCausalLM, config, "eager", torch.float64)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding on the second row
    with torch.no_grad():
        a = varlen(input_ids=ids, attention_mask=mask).logits
        b = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1, :8], b[1, :8])

    # cu_seq_lens_q (the flattening collator's flash kwargs) gives the same as position restarts
    class Module(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, sum(LENGTHS), 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32)
    by_positions, _ = varlen_attention_forward(Module(), q, k, v, None, position_ids=positions)
    by_cu, _ = varlen_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    unpacked, _ = varlen_attention_forward(Module(), q, k, v, None)
    torch.testing.assert_close(by_positions, by_cu)
    assert not torch.allclose(by_positions, unpacked)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        varlen_attention_forward(Module(), q, k, v, None, cu_seq_lens_q=cu[:-1])


def test_varlen_cost_is_sum_of_squares_not_total_squared():
    """Score matrix sizes, counted by intercepting SDPA: sum(L^2) for the varlen attention."""
    q = torch.randn(1, 2, sum(LENGTHS), 8)
    seen = []
    real = F.scaled_dot_product_attention

    def counting(query, key, *args, **kwargs):
        seen.append(query.shape[2] * key.shape[2])
        return real(query, key, *args, **kwargs)

    class Module(torch.nn.Module):
        is_causal = True

    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    F.scaled_dot_product_attention = counting
    try:
        varlen_attention_forward(Module(), q, q, q, None, position_ids=positions)
    finally:
        F.scaled_dot_product_attention = real
    assert sum(seen) == sum(n * n for n in LENGTHS)


def qwen2_vl_config():
    from transformers import Qwen2VLConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    )
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  temporal_patch_size=2, spatial_merge_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=90, video_token_id=91,
                         vision_start_token_id=92, vision_end_token_id=93)


def test_qwen2_vl_decoder_packed_matches_sdpa_and_separate_samples():
    from transformers import Qwen2VLForConditionalGeneration

    name = register_varlen_attention()
    config = qwen2_vl_config()
    varlen = make_model(Qwen2VLForConditionalGeneration, config, name, torch.float64)
    sdpa = make_model(Qwen2VLForConditionalGeneration, config, "sdpa", torch.float64)
    lengths = [7, 20, 3, 11]
    samples, input_ids, labels, positions = packed_batch([n for n in lengths], seed=2, position_rows=4)
    samples = [s % 90 for s in samples]  # text only: keep clear of the vision special tokens
    input_ids, labels = input_ids % 90, torch.where(labels >= 0, labels % 90, labels)
    mm = torch.zeros_like(input_ids)
    with torch.no_grad():
        a = summed_token_loss(varlen(input_ids=input_ids, position_ids=positions, mm_token_type_ids=mm).logits, labels)
        b = summed_token_loss(sdpa(input_ids=input_ids, position_ids=positions, mm_token_type_ids=mm).logits, labels)
        total = sum(
            summed_token_loss(varlen(input_ids=s[None], mm_token_type_ids=torch.zeros_like(s[None])).logits, s[None])
            for s in samples
        )
    torch.testing.assert_close(a, b, rtol=1e-10, atol=0)
    torch.testing.assert_close(a, total, rtol=1e-10, atol=0)


def test_qwen2_vl_vision_tower_under_the_varlen_name_equals_sdpa():
    """Given the name for the whole model, the ViT calls it per image (is_causal=False): still exact."""
    from transformers import Qwen2VLForConditionalGeneration

    name = register_varlen_attention()
    config = qwen2_vl_config()
    varlen = make_model(Qwen2VLForConditionalGeneration, config, name, torch.float64)
    sdpa = make_model(Qwen2VLForConditionalGeneration, config, "sdpa", torch.float64)
    grid = torch.tensor([[1, 4, 6], [1, 2, 2]])
    patch_dim = 3 * 2 * 14 * 14
    pixels = torch.randn(int(grid.prod(dim=1).sum()), patch_dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        a = varlen.model.visual(pixels, grid_thw=grid)
        b = sdpa.model.visual(pixels, grid_thw=grid)
    a = getattr(a, "pooler_output", a)
    b = getattr(b, "pooler_output", b)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_mrope_positions_use_the_text_row_only():
    """[4, b, T]: row 0 gives the restarts; [3, b, T] (no text row) is one sequence, as in transformers
    (its temporal row is constant over an image and must not be read as restarts)."""

    class Module(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, sum(LENGTHS), 8, generator=g, dtype=torch.float64)
    text = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    mrope = torch.zeros(3, 1, sum(LENGTHS), dtype=torch.long)  # e.g. one image: constant temporal row
    packed, _ = varlen_attention_forward(Module(), q, q, q, None, position_ids=text)
    four_rows, _ = varlen_attention_forward(Module(), q, q, q, None, position_ids=torch.cat([text[None], mrope]))
    three_rows, _ = varlen_attention_forward(Module(), q, q, q, None, position_ids=mrope)
    whole, _ = varlen_attention_forward(Module(), q, q, q, None)
    torch.testing.assert_close(four_rows, packed)
    torch.testing.assert_close(three_rows, whole)
